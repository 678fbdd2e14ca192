#!/usr/bin/env bash
# Where does the disaggregated short-request TTFT go? (docs/BENCHMARKS.md, "Disaggregated vs
# aggregated on two H200s"). Starts the 2-GPU disaggregated cluster once, then in the same run:
#   1. the short class alone through the coordinator (ctx -> gen), with server phase timings;
#   2. the same load sent straight to the gen worker (served there aggregated), as the baseline;
#   3. the mixed workload (long prompts at 1/s) through the coordinator, with phase timings.
# Every result JSON and the cluster logs go to $OUT (default ./probe_out). MIXED=0 skips step 3;
# the environment reaches every process of the cluster (for A/B runs of a setting, with TAG).
#
#   bash tools/probe_gpu_ttft.sh            # on the device: nvidia-h200-x2
set -euo pipefail
OUT=${OUT:-probe_out}
mkdir -p "$OUT"
PY=${PY:-python3}
CONF=${CONF:-conf/gpu/two_h200_disagg.yaml}
LOGS="$OUT/cluster"
sed "s#^log_dir: .*#log_dir: $LOGS#" "$CONF" > "$OUT/cluster.yaml"

$PY -m trtdisagg up "$OUT/cluster.yaml" > "$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
# Ready when a real request through ctx and gen answers (the coordinator listens before that).
for _ in $(seq 600); do
    if curl -sf localhost:8000/v1/completions -H 'content-type: application/json' \
        -d '{"prompt": [1, 2, 3], "max_tokens": 2}' > /dev/null 2>&1; then break; fi
    if ! kill -0 $UP 2>/dev/null; then echo "cluster died"; tail -50 "$OUT/up.log"; exit 1; fi
    sleep 1
done

TAG=${TAG:-}  # a suffix for this run's result names (e.g. the setting being compared)
bench() {  # name, base url, extra args...
    local name=$1$TAG url=$2; shift 2
    $PY tools/bench_serving.py --base-url "$url" --no-progress --perf-metrics \
        --label "$name" --result-json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt"
}
SHORT=(--concurrency 16 --input-len 128 --output-len 256)
bench warmup http://127.0.0.1:8000 "${SHORT[@]}" --num-requests 32 > /dev/null
bench short_disagg http://127.0.0.1:8000 "${SHORT[@]}" --num-requests 96
bench short_gen_direct http://127.0.0.1:8002 "${SHORT[@]}" --num-requests 96
[ "${MIXED:-1}" = 1 ] || exit 0
bench mixed_disagg http://127.0.0.1:8000 --mixed --long-rate 1 --duration 25 \
    --short-concurrency 16 --short-input-len 128 --short-output-len 256 \
    --long-input-len 4096:16384 --long-output-len 16 --num-requests 1000
