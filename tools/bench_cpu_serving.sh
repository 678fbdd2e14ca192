#!/usr/bin/env bash
# CPU serving benchmark: one aggregated worker, concurrency 1/8/32, vs HF generate() batch 1 and a
# plain HF greedy loop. PY (default .venv/bin/python) runs everything; PYTHONPATH picks the tree
# under test; EXTRA is appended to the worker's YAML (e.g. "async_scheduling: false").
set -u
MODEL=$1; TAG=$2; VOCAB=$3; PORT=$4; OUT=${OUT_DIR:-bench_results}
PY=${PY:-.venv/bin/python}
mkdir -p $OUT
cat > /tmp/w_$TAG.yaml <<YAML
model: $MODEL
max_batch_size: 64
max_num_tokens: 2048
kv_cache_config: {tokens_per_block: 32, max_tokens: 32768}
${EXTRA:-}
YAML
$PY -m trtdisagg ctx --config /tmp/w_$TAG.yaml --port $PORT > /tmp/w_$TAG.log 2>&1 &
PID=$!
for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
for c in ${CONCURRENCY:-1 8 32}; do
  n=$((c*4)); [ $c -eq 1 ] && n=8
  $PY tools/bench_serving.py --base-url http://127.0.0.1:$PORT --input-len 128 --output-len 128 \
    --vocab-size $VOCAB --concurrency $c --num-requests $n --warmup 2 --sample-rss-pid $PID \
    --label $TAG-c$c --result-json $OUT/$TAG-c$c.json --no-progress > $OUT/$TAG-c$c.txt 2>&1
done
kill $PID; wait
for mode in generate plain-loop; do
  flag=""; [ $mode = plain-loop ] && flag=--plain-loop
  $PY tools/bench_hf_baseline.py --model-dir $MODEL --input-len 128 --output-len 128 \
    --vocab-size $VOCAB --num-requests 4 --warmup 1 --threads 1 $flag --label hf-$mode-$TAG \
    --result-json $OUT/hf-$mode-$TAG.json --no-progress > $OUT/hf-$mode-$TAG.txt 2>&1
done
