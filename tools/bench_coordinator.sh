#!/usr/bin/env bash
# Coordinator overhead and front-end capacity on CPU (tiny model), all measured in one run:
#   1. the same short requests sent directly to an aggregated worker, and through
#      coordinator -> ctx -> gen (the difference is the coordinator plus the KV handover);
#   2. max_tokens=1 requests (answered by ctx alone) through a coordinator with num_workers 1 and 2.
set -u
OUT=${OUT:-bench_results}; mkdir -p $OUT
W='{"model": "tiny", "kv_cache_config": {"tokens_per_block": 32, "max_tokens": 16384}}'
T='{"backend": "NIXL", "nixl_progress_thread": false}'
python3 - <<PY
import json, yaml
w = json.loads('$W')
yaml.safe_dump(w, open("/tmp/bc_agg.yaml", "w"))
w["cache_transceiver_config"] = json.loads('$T')
yaml.safe_dump(w, open("/tmp/bc_pd.yaml", "w"))
for name, port, workers in (("c1", 18400, 1), ("c2", 18410, 2)):
    yaml.safe_dump({"hostname": "127.0.0.1", "port": port, "num_workers": workers,
                    "context_servers": {"urls": ["127.0.0.1:18402"]},
                    "generation_servers": {"urls": ["127.0.0.1:18403"]}}, open(f"/tmp/bc_{name}.yaml", "w"))
PY
PY=.venv/bin/python
$PY -m trtdisagg ctx --config /tmp/bc_agg.yaml --port 18401 > /tmp/bc_agg.log 2>&1 &
$PY -m trtdisagg ctx --config /tmp/bc_pd.yaml --port 18402 > /tmp/bc_ctx.log 2>&1 &
$PY -m trtdisagg gen --config /tmp/bc_pd.yaml --port 18403 > /tmp/bc_gen.log 2>&1 &
for p in 18401 18402 18403; do for i in $(seq 1 120); do curl -sf localhost:$p/health >/dev/null && break; sleep 1; done; done
$PY -m trtdisagg coordinator --config /tmp/bc_c1.yaml > /tmp/bc_c1.log 2>&1 &
for i in $(seq 1 60); do curl -sf localhost:18400/health >/dev/null && break; sleep 1; done
B="$PY tools/bench_serving.py --input-len 32 --output-len 8 --vocab-size 512 --no-progress"
for round in 1 2; do
  $B --base-url http://127.0.0.1:18401 --concurrency 1 --num-requests 60 --warmup 5 --label direct --result-json $OUT/coord-direct.json > $OUT/coord-direct.txt 2>&1
  $B --base-url http://127.0.0.1:18400 --concurrency 1 --num-requests 60 --warmup 5 --label via-coordinator --result-json $OUT/coord-via.json > $OUT/coord-via.txt 2>&1
done
C="$PY tools/bench_serving.py --input-len 16 --output-len 1 --vocab-size 512 --no-progress --concurrency 64 --num-requests 1500 --warmup 50"
$C --base-url http://127.0.0.1:18400 --label frontend-1 --result-json $OUT/frontend-1.json > $OUT/frontend-1.txt 2>&1
kill %4; wait %4 2>/dev/null
$PY -m trtdisagg coordinator --config /tmp/bc_c2.yaml > /tmp/bc_c2.log 2>&1 &
for i in $(seq 1 60); do curl -sf localhost:18410/health >/dev/null && break; sleep 1; done
$C --base-url http://127.0.0.1:18410 --label frontend-2 --result-json $OUT/frontend-2.json > $OUT/frontend-2.txt 2>&1
kill $(jobs -p) 2>/dev/null; wait
