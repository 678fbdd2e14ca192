#!/usr/bin/env bash
# Issue #28 on two H200s (nvidia-h200-x2): one step per device call, each inside the device
# tool's 10 minutes, in this order (the first four are what #28 accepts on):
#
#   step           budget    what
#   tests          4 min     tests/gpu/test_gpu_multi_rank.py: a TP2 worker, a PP2 worker, and a
#                            TP2 ctx -> PP2 gen pairing (greedy equality, byte-exact KV)
#   transfer       5 min     tools/bench_transfer.py, ctx's pool on GPU 0, gen's on GPU 1, 8B
#                            geometry, 1k / 2k / 8k / 32k tokens, every schedule against one raw
#                            NIXL write in the same run with the same polling (both spin on CUDA);
#                            GB/s against NVLink's 450 GB/s per direction is bytes / p50
#   chat           9.5 min   goodput, chat workload: aggregated and disagg
#   long           9.5 min   goodput, long-context workload: aggregated and disagg
#   chat-variants  9.5 min   goodput, chat: generation_first and conditional
#   long-variants  7 min     goodput, long: generation_first (conditional is disagg there: every
#                            long prompt is over its 1024-token threshold)
#   smoke1         5 min     on nvidia-h200 (one GPU): the goodput tool with ctx and gen sharing
#                            GPU 0 (and two aggregated workers sharing it), two low rates
#
# With the machine's start, the six two-GPU steps take about 46 minutes of device time: a
# 30-minute session runs tests, chat and long (then transfer if time is left), the next one the
# rest. A goodput step that runs short of its budget skips its last rates and says so; a later
# call can measure them (--rates), and `report` merges every call's summary.
#
# Run from the repository root with the wheels of docs/BENCHMARKS.md ("Running on the GPU
# machine") in .whl/ and `carry: [".whl"]`:
#
#   bash tools/device_two_gpu.sh tests            # kind nvidia-h200-x2
#   bash tools/device_two_gpu.sh smoke1           # kind nvidia-h200
#
# Files go to $OUT (at most 5 per step). Afterwards, here, with each call's files in a folder:
#
#   python tools/bench_goodput.py report --out docs/img/goodput bench_results/goodput/*/goodput_summary.json
set -euo pipefail
STEP=${1:?usage: bash tools/device_two_gpu.sh tests|transfer|chat|long|chat-variants|long-variants|smoke1}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader

goodput() {  # bench_goodput.py run arguments...
    set -o pipefail
    python3 tools/bench_goodput.py run --out "$OUT" "$@" 2>&1 | tee "$OUT/goodput.log"
}

case $STEP in
tests)
    timeout 230 python3 -m pytest -q -m gpu tests/gpu/test_gpu_multi_rank.py -p no:cacheprovider \
        -rA 2>&1 | tee "$OUT/multi_rank.txt"
    ;;
transfer)
    for tokens in 1024 2048 8192 32768; do
        echo "=== $tokens tokens $(date +%T)" | tee -a "$OUT/transfer.txt"
        timeout 70 python3 tools/bench_transfer.py --device cuda --model-8b --tokens "$tokens" \
            --ctx-gpu 0 --gen-gpu 1 --iterations 32 --warmup 3 --schedule both \
            --result-json "$OUT/transfer_$tokens.json" 2>&1 \
            | grep -v "UCX  WARN\|NIXL INFO" | tee -a "$OUT/transfer.txt" || true
    done
    ;;
chat)
    # Expected knees near 16-22 req/s over the two GPUs (one ctx GPU prefills about 20 chat
    # prompts a second; 64 decode slots per worker): the sweep stops two points past its own.
    goodput --workloads chat --modes aggregated,disagg --rates 8,12,16,20,24,28 --point-s 30
    ;;
long)
    # One ctx GPU prefills about 1.5 long prompts a second; aggregated prefills on both.
    goodput --workloads long --modes aggregated,disagg --rates 0.75,1.25,1.75,2.25,2.75 \
        --point-s 40
    ;;
chat-variants)
    goodput --workloads chat --modes generation_first,conditional --rates 8,12,16,20,24,28 \
        --point-s 30
    ;;
long-variants)
    goodput --workloads long --modes generation_first --rates 0.75,1.25,1.75,2.25,2.75 \
        --point-s 40 --budget 400
    ;;
smoke1)
    goodput --conf-set one_h200 --workloads chat --modes aggregated,disagg --rates 2,4 \
        --point-s 15 --refine 0 --warmup-requests 4 --start-reserve 45 --budget 285
    ;;
*)
    echo "unknown step $STEP" >&2
    exit 2
    ;;
esac
