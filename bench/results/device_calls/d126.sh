#!/usr/bin/env bash
# Run 2026-12-05 (fourteenth session): tiered_serving.md ("A model's layers in turn"),
# kv_growth.md, device_tests.md.
# Hundred-and-twenty-sixth call, d125's (never run) with the pinning beside a growth:
# (1) bench/kv_growth_bench with the device: a growth's copy against HostMemory::Grow, and
# beside them the pinning (today's unpin and whole re-pin, against registering only the added
# bytes), bf16 rows at 1728, 16384 and 131072 rows;
# (2) bench/model_tokens.py, 32 layers, a 640-token prompt, bulk 900 -> 1600, index: learned
# codes now sized for the rows they serve (the token after the take-over grew them before),
# and the same with max_tokens announced (2300: the KV set aside at creation, so the host-KV
# growth stall of d123 cannot come);
# (3) the whole suite (the captured steps keyed by the softmax scale too; LayersSteppingInTurn
# with each layer's own key; the candidate attention over two adjacent registrations).
# Bundle: .device/b126, built at fe2b8a4 (every *_test, kvrecalld, kvrecall, gpu_serving_bench,
# kv_growth_bench). Carry .device/b126/ship and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 126
$B/kv_growth_bench --rows=1728,16384,131072 --row_bytes=2048 --repeats=5 > $R/kv_growth.json \
  2> $L/kv_growth.err
echo "kv_growth rc $? t=$SECONDS" | tee -a "$S"
python3 - $R/kv_growth.json <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
print("pins", d["pins"], "huge", d["huge_pages"])
for l in d["lengths"]:
    print(l["rows"], {k: round(v["p50_ms"], 3) for k, v in l.items() if isinstance(v, dict)})
PY
model_tokens_run index_grown $B/kvrecalld index --layers=32 --prompt=640 --from=900 --to=1600
model_tokens_run index_announced $B/kvrecalld index --layers=32 --prompt=640 --from=900 \
  --to=1600 --max-tokens=2300
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d126_out.tgz out
device_call_end
