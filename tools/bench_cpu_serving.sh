#!/usr/bin/env bash
# CPU serving benchmark: one aggregated worker against Hugging Face generate() at batch 1, in
# interleaved rounds (this VM's speed drifts within minutes: a ratio is taken between runs
# seconds apart). Per round: the worker at each concurrency in CONCURRENCY (default "1 32"),
# each followed by an HF generate() run on the same prompt and output lengths (128 / 128,
# ignore_eos / min_new_tokens, greedy, one torch thread). Prints one line per run and, per
# concurrency, the ratio worker / HF of each round and their median.
#
#   PYTHONPATH=$PWD bash tools/bench_cpu_serving.sh MODEL TAG VOCAB PORT
#
# PY (default .venv/bin/python) runs everything; PYTHONPATH picks the tree under test; EXTRA is
# appended to the worker's YAML (e.g. "api_server_count: 1"); ROUNDS (default 6); results
# (bench_serving / bench_hf_baseline JSON) go to OUT_DIR (default bench_results). PIN=<cpu>
# runs the worker (`cpu_affinity`) and HF on that CPU, and the client on the others.
set -u
MODEL=$1; TAG=$2; VOCAB=$3; PORT=$4; OUT=${OUT_DIR:-bench_results}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
ON_PIN=() ON_REST=()
if [ -n "${PIN:-}" ]; then
  REST=$($PY -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0) - {$PIN}))))")
  ON_PIN=(taskset -c "$PIN") ON_REST=(taskset -c "$REST")
fi
cat > "$OUT/worker-$TAG.yaml" <<YAML
model: $MODEL
max_batch_size: 64
max_num_tokens: 2048
kv_cache_config: {tokens_per_block: 32, max_tokens: 32768}
${PIN:+cpu_affinity: [$PIN]}
${EXTRA:-}
YAML
# -P: the current directory (a checkout) does not go before PYTHONPATH on sys.path.
$PY -P -m trtdisagg ctx --config "$OUT/worker-$TAG.yaml" --port "$PORT" > "$OUT/worker-$TAG.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
for _ in $(seq 1 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
# The output tok/s in a result JSON (its "all" class, or its one class).
THROUGHPUT='import json, sys
def throughput(path):
    summary = json.load(open(path))["summary"]
    return summary.get("all", next(iter(summary.values())))["output_throughput"]
'
rate() { $PY -c "$THROUGHPUT"'
print(round(throughput(sys.argv[1]), 1))' "$1"; }
for round in $(seq 1 "${ROUNDS:-6}"); do
  for c in ${CONCURRENCY:-1 32}; do
    n=$((c * 3)); [ "$c" -eq 1 ] && n=6
    worker=$OUT/$TAG-c$c-r$round.json hf=$OUT/hf-$TAG-c$c-r$round.json
    "${ON_REST[@]}" $PY tools/bench_serving.py --base-url "http://127.0.0.1:$PORT" --input-len 128 \
      --output-len 128 --vocab-size "$VOCAB" --concurrency "$c" --num-requests $n --warmup 2 \
      --label "$TAG-c$c" --result-json "$worker" --no-progress > /dev/null 2>&1
    "${ON_PIN[@]}" $PY tools/bench_hf_baseline.py --model-dir "$MODEL" --input-len 128 --output-len 128 \
      --vocab-size "$VOCAB" --num-requests 3 --warmup 1 --threads 1 --label "hf-$TAG" \
      --result-json "$hf" --no-progress > /dev/null 2>&1
    echo "round $round c=$c worker $(rate "$worker") tok/s, HF generate() $(rate "$hf") tok/s"
  done
done
for c in ${CONCURRENCY:-1 32}; do
  { echo "$THROUGHPUT"; cat <<'PY'
import statistics
from pathlib import Path
out, tag, c = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = sorted(out.glob(f"{tag}-c{c}-r*.json"), key=lambda p: int(p.stem.rsplit("-r", 1)[1]))
ratios = [throughput(w) / throughput(out / f"hf-{w.name}") for w in runs]
print(f"c={c}: worker / HF per round {', '.join(f'{r:.2f}' for r in ratios)}; "
      f"median {statistics.median(ratios):.2f}")
PY
  } | $PY - "$OUT" "$TAG" "$c"
done
