#!/bin/bash
# One device call that compares this tree with another one (BASE, a directory holding that
# tree's trtdisagg/, tools/ and conf/) on the same host, in turn: the KV transfer microbenchmark
# (tools/bench_transfer.py, generation-first, ctx and gen on GPU 0) and the TTFT at concurrency 1
# through the coordinator (conf/gpu/one_h200.yaml: 8B geometry, ctx and gen sharing GPU 0).
#
# Run from the repository root on the device, with the wheels of docs/BENCHMARKS.md ("Running on
# the GPU machine") in .whl/. Make BASE here first, e.g. for commit C:
#     mkdir -p .base && git archive C trtdisagg tools conf | tar -x -C .base
# and carry both:  carry [".whl", ".base"]   command: BASE=.base bash tools/device_compare.sh
#
# Knobs: SIZES (tokens of 8B KV, 128 KiB each; default "2048 8192 32768"), ROUNDS ("1 2"),
# TTFT=0 skips the TTFT part, TRANSFER=0 the transfer part, SUITE=1 runs the GPU suite first,
# SCHEDULE=generation_first sets the coordinator's schedule_style for the TTFT part.
# ENGINE=1 adds tools/bench_engine.py on conf/gpu/worker.yaml (512 in / 128 out) per tree, in
# turn for each round: ENGINE_C sets its concurrencies ("16"), ENGINE_ARGS adds arguments
# (e.g. "--skip-http").
# Results: $OUT/compare.txt (the table at the end), $OUT/*.json.
set -u
OUT=${OUT:-/tmp/out}
BASE=${BASE:?set BASE to the other tree}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
HERE=$PWD
declare -A TREE=([new]=$HERE [base]=$(cd "$BASE" && pwd))

if [ "${SUITE:-0}" = 1 ]; then
    PYTHONPATH=/tmp/site:$HERE timeout 300 python3 -m pytest -m gpu tests/gpu -q \
        -p no:cacheprovider -k "not multi_rank" > "$OUT/gpu_suite.txt" 2>&1
    tail -3 "$OUT/gpu_suite.txt"
fi

transfer() { # tree tokens round
    local t=$1 n=$2 r=$3
    echo "=== transfer $t tokens=$n round=$r" >> "$OUT/compare.txt"
    (cd "${TREE[$t]}" && PYTHONPATH="/tmp/site:${TREE[$t]}" timeout 150 python3 \
        tools/bench_transfer.py --device cuda --model-8b --tokens "$n" --gen-gpu 0 \
        --iterations "${ITER:-40}" --warmup 3 --schedule generation-first \
        --result-json "$OUT/transfer_${t}_${n}_${r}.json" 2>&1 \
        | grep -E "ratio vs raw|raw NIXL \(post|generation-first \(" >> "$OUT/compare.txt")
}
if [ "${TRANSFER:-1}" = 1 ]; then
    for r in ${ROUNDS:-1 2}; do for n in ${SIZES:-2048 8192 32768}; do
        # the order of the two trees alternates between rounds
        if [ $((r % 2)) = 1 ]; then transfer new "$n" "$r"; transfer base "$n" "$r"
        else transfer base "$n" "$r"; transfer new "$n" "$r"; fi
    done; done
fi

engine() { # tree round
    local t=$1 r=$2
    echo "=== engine $t round=$r" >> "$OUT/compare.txt"
    (cd "${TREE[$t]}" && PYTHONPATH="/tmp/site:${TREE[$t]}" timeout 280 python3 \
        tools/bench_engine.py --config conf/gpu/worker.yaml --concurrency "${ENGINE_C:-16}" \
        --input-len 512 --output-len 128 --vocab-size 32000 ${ENGINE_ARGS:-} \
        --result-json "$OUT/engine_${t}_${r}.json" 2>&1 | grep -E "^(offline|http) " \
        >> "$OUT/compare.txt")
}
if [ "${ENGINE:-0}" = 1 ]; then
    for r in ${ROUNDS:-1 2}; do
        if [ $((r % 2)) = 1 ]; then engine new "$r"; engine base "$r"
        else engine base "$r"; engine new "$r"; fi
    done
fi

ttft() { # tree
    local t=$1 dir=${TREE[$1]}
    sed -e "s#^log_dir: .*#log_dir: /tmp/logs_$t#" \
        -e "/^coordinator:/a\\  schedule_style: ${SCHEDULE:-context_first}" \
        "$dir/conf/gpu/one_h200.yaml" > "/tmp/up_$t.yaml"
    (cd "$dir" && PYTHONPATH="/tmp/site:$dir" exec python3 -m trtdisagg up "/tmp/up_$t.yaml") \
        > "$OUT/up_$t.log" 2>&1 &
    local up=$!
    for _ in $(seq 300); do  # ready when a request through ctx and gen answers
        curl -sf localhost:8000/v1/completions -H 'content-type: application/json' \
            -d '{"prompt": [1, 2, 3], "max_tokens": 2}' > /dev/null 2>&1 && break
        kill -0 $up 2>/dev/null || { echo "$t: cluster died"; tail -20 "$OUT/up_$t.log"; return; }
        sleep 1
    done
    echo "=== ttft $t" >> "$OUT/compare.txt"
    PYTHONPATH="/tmp/site:$HERE" python3 "$HERE/tools/bench_serving.py" \
        --base-url http://127.0.0.1:8000 --concurrency 1 --input-len 512 --output-len 16 \
        --num-requests "${TTFT_N:-40}" --warmup 4 --vocab-size 32000 --no-progress \
        --label "ttft_$t" --result-json "$OUT/ttft_$t.json" 2>&1 | grep -i "ttft\|tpot" \
        >> "$OUT/compare.txt"
    kill -INT $up; wait $up 2>/dev/null
}
if [ "${TTFT:-1}" = 1 ]; then
    for t in ${TTFT_ORDER:-new base new base}; do ttft "$t"; done
fi
cat "$OUT/compare.txt"
