#!/usr/bin/env bash
# Two trees' CPU workers side by side: both serve at once (an idle worker takes no CPU), and
# bench_serving runs alternate between them, so each round's ratio compares runs seconds apart
# on this VM, whose speed drifts within minutes. Tiny model, 128 / 128 tokens, ignore_eos.
#
#   bash tools/bench_cpu_ab.sh BASE_TREE [ROUNDS] [CONCURRENCY]
#
# BASE_TREE is another checkout (e.g. `git worktree add --detach /tmp/base <commit>`); this tree
# is the new one. Prints each round's tok/s and new / base, then the median ratio. PY (default
# .venv/bin/python) runs everything; EXTRA is appended to the workers' YAML (default
# "api_server_count: 1"); results go to OUT_DIR (default bench_results/ab).
set -u
BASE=$(cd "$1" && pwd); NEW=$PWD; ROUNDS=${2:-8}; C=${3:-1}
PY=${PY:-$NEW/.venv/bin/python}; OUT=${OUT_DIR:-bench_results/ab}
mkdir -p "$OUT"
cat > "$OUT/worker.yaml" <<YAML
model: tiny
max_batch_size: 64
max_num_tokens: 2048
kv_cache_config: {tokens_per_block: 32, max_tokens: 32768}
${EXTRA:-api_server_count: 1}
YAML
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
for side in base new; do
  tree=$BASE port=18931; [ $side = new ] && tree=$NEW port=18932
  (cd "$tree" && PYTHONPATH=$tree exec $PY -m trtdisagg ctx --config "$NEW/$OUT/worker.yaml" \
    --port $port > "$NEW/$OUT/$side.log" 2>&1) &
  PIDS+=($!)
done
for port in 18931 18932; do
  for _ in $(seq 1 120); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 1; done
done
rate() { $PY -c 'import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(round(s.get("all", next(iter(s.values())))["output_throughput"], 1))' "$1"; }
ratios=()
for round in $(seq 1 "$ROUNDS"); do
  for side in base new; do
    port=18931; [ $side = new ] && port=18932
    $PY tools/bench_serving.py --base-url "http://127.0.0.1:$port" --input-len 128 \
      --output-len 128 --vocab-size 512 --concurrency "$C" --num-requests $((C * 6)) \
      --warmup 2 --result-json "$OUT/$side-c$C-r$round.json" --no-progress > /dev/null 2>&1
  done
  base=$(rate "$OUT/base-c$C-r$round.json"); new=$(rate "$OUT/new-c$C-r$round.json")
  ratio=$($PY -c "print(f'{$new / $base:.2f}')")
  ratios+=("$ratio")
  echo "round $round c=$C base $base tok/s, new $new tok/s, new / base $ratio"
done
$PY -c "import statistics, sys; print(f'c=$C: new / base median {statistics.median(map(float, sys.argv[1:])):.2f}')" "${ratios[@]}"
