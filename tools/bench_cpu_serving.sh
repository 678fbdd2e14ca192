#!/usr/bin/env bash
# CPU serving benchmark: one aggregated worker, concurrency 1/8/32, vs HF generate() batch 1.
set -u
MODEL=$1; TAG=$2; VOCAB=$3; PORT=$4; OUT=bench_results
cat > /tmp/w_$TAG.yaml <<YAML
model: $MODEL
max_batch_size: 64
max_num_tokens: 2048
kv_cache_config: {tokens_per_block: 32, max_tokens: 32768}
YAML
.venv/bin/python -m trtdisagg ctx --config /tmp/w_$TAG.yaml --port $PORT > /tmp/w_$TAG.log 2>&1 &
for i in $(seq 1 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
PID=$(pgrep -f "port $PORT" | head -1)
for c in 1 8 32; do
  n=$((c*4)); [ $c -eq 1 ] && n=8
  .venv/bin/python tools/bench_serving.py --base-url http://127.0.0.1:$PORT --input-len 128 --output-len 128 \
    --vocab-size $VOCAB --concurrency $c --num-requests $n --warmup 2 --sample-rss-pid $PID \
    --label $TAG-c$c --result-json $OUT/$TAG-c$c.json --no-progress > $OUT/$TAG-c$c.txt 2>&1
done
kill $PID; wait
.venv/bin/python tools/bench_hf_baseline.py --model-dir $MODEL --input-len 128 --output-len 128 --vocab-size $VOCAB \
  --num-requests 4 --warmup 1 --threads 1 --label hf-$TAG --result-json $OUT/hf-$TAG.json --no-progress > $OUT/hf-$TAG.txt 2>&1
