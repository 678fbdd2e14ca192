#!/bin/bash
# One device call: tools/bench_transfer.py on CUDA for this tree and for variants of it, in turn,
# so that each comparison is made within one call on one host.
#
# Run from the repository root on the device, with the wheels of docs/BENCHMARKS.md
# ("Running on the GPU machine") in .whl/. Results go to $OUT (bench.txt, results.tgz).
#
#   VARIANTS="base" ROUNDS="1 2 3" SIZES="2048 8192" ONCE="1024 32768" BUSY=2048 \
#       SUITE=1 bash tools/device_ab_transfer.sh
# GEN_GPU=1 puts gen on the second GPU (GPU to GPU, on a two-GPU machine); default 0 (the same GPU).
#
# Variants are copies of the tree under /tmp/v; `base` is the tree as it is. Another variant is a
# copy that a step added here changes (a sed on its files), so that both run in the same call.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/res /tmp/v
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
for v in ${VARIANTS:-base}; do
    rm -rf "/tmp/v/$v" && mkdir -p "/tmp/v/$v" && cp -r trtdisagg tools "/tmp/v/$v/"
done

bench() { # variant tokens round [extra bench_transfer arguments]
    local v=$1 t=$2 r=$3 schedule=${SCHED:-generation-first}
    shift 3
    local tag="${v}_${t}_${r}_${schedule}${1:+_busy}"
    echo "=== $v tokens=$t round=$r schedule=$schedule $* $(date +%T)" >> "$OUT/bench.txt"
    (cd "/tmp/v/$v" && PYTHONPATH="/tmp/site:/tmp/v/$v" timeout 150 python3 tools/bench_transfer.py \
        --device cuda --model-8b --tokens "$t" --gen-gpu "${GEN_GPU:-0}" \
        --iterations "${ITER:-40}" --warmup 3 --schedule "$schedule" \
        --result-json "/tmp/res/r_$tag.json" "$@" 2>&1 \
        | grep -v "UCX  WARN\|NIXL INFO\|iterations$" >> "$OUT/bench.txt")
}
for r in ${ROUNDS:-1}; do for t in ${SIZES:-2048}; do for v in ${VARIANTS:-base}; do
    bench "$v" "$t" "$r"
done; done; done
for t in ${ONCE:-}; do for v in ${VARIANTS:-base}; do bench "$v" "$t" 1; done; done
for t in ${BUSY:-}; do for v in ${VARIANTS:-base}; do bench "$v" "$t" 1 --ctx-busy-ms 5; done; done
for t in ${ALL:-}; do for v in ${VARIANTS:-base}; do SCHED=both bench "$v" "$t" 1; done; done
tar -czf "$OUT/results.tgz" -C /tmp res
if [ "${SUITE:-0}" = 1 ]; then
    PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
        > "$OUT/gpu_suite.txt" 2>&1
    tail -5 "$OUT/gpu_suite.txt"
fi
grep -h "ratio vs raw\|^===" "$OUT/bench.txt"
