#!/usr/bin/env bash
# context_first vs generation_first on CPU (tiny model): the same ctx and gen workers behind two
# coordinators that differ only in schedule_style, measured one right after the other, ROUNDS
# (default 3) rounds, concurrency 1 (no queueing: what the schedule saves is the handover itself).
#   bash tools/bench_schedules.sh            # -> bench_results/sched-{context,generation}_first-r*.json
#   GPU=1 bash tools/bench_schedules.sh      # 8B geometry, ctx on GPU 0, gen on GPU 1 (2 x H200)
set -u
OUT=${OUT:-bench_results}; mkdir -p $OUT
PY=${PY:-.venv/bin/python}
P=${PORT:-18500}
VOCAB=512; [ -n "${GPU:-}" ] && VOCAB=128256
python3 - <<PY
import yaml
w = {"model": "tiny", "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 16384},
     "cache_transceiver_config": {"backend": "NIXL", "nixl_progress_thread": False}}
if "${GPU:-}":
    w = {"model": "synthetic:llama3-8b", "device": "cuda", "dtype": "bfloat16",
         "max_seq_len": 8192, "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 262144},
         "cache_transceiver_config": {"backend": "NIXL"}}
yaml.safe_dump({**w, "cuda_device": 0}, open("/tmp/bs_ctx.yaml", "w"))
yaml.safe_dump({**w, "cuda_device": 1 if "${GPU:-}" else 0}, open("/tmp/bs_gen.yaml", "w"))
for style, port in (("context_first", $P), ("generation_first", $P + 10)):
    yaml.safe_dump({"hostname": "127.0.0.1", "port": port, "schedule_style": style,
                    "context_servers": {"urls": ["127.0.0.1:$((P + 1))"]},
                    "generation_servers": {"urls": ["127.0.0.1:$((P + 2))"]}},
                   open(f"/tmp/bs_{style}.yaml", "w"))
PY
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
$PY -m trtdisagg ctx --config /tmp/bs_ctx.yaml --port $((P + 1)) > /tmp/bs_ctx.log 2>&1 &
$PY -m trtdisagg gen --config /tmp/bs_gen.yaml --port $((P + 2)) > /tmp/bs_gen.log 2>&1 &
$PY -m trtdisagg coordinator --config /tmp/bs_context_first.yaml > /tmp/bs_c1.log 2>&1 &
$PY -m trtdisagg coordinator --config /tmp/bs_generation_first.yaml > /tmp/bs_c2.log 2>&1 &
for p in $((P + 1)) $((P + 2)) $P $((P + 10)); do
  for i in $(seq 1 300); do curl -sf localhost:$p/health >/dev/null && break; sleep 1; done
done
B="$PY tools/bench_serving.py --input-len ${INPUT_LEN:-128} --output-len 8 --vocab-size $VOCAB \
   --concurrency 1 --num-requests 40 --warmup 5 --no-progress --perf-metrics"
for round in $(seq 1 ${ROUNDS:-3}); do
  for style in context_first generation_first; do
    port=$P; [ $style = generation_first ] && port=$((P + 10))
    $B --base-url http://127.0.0.1:$port --label $style \
      --result-json $OUT/sched-$style-r$round.json > $OUT/sched-$style-r$round.txt 2>&1
    echo "round $round $style: $(grep -m1 -i 'ttft' $OUT/sched-$style-r$round.txt)"
  done
done
