#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for device_tests.md and tiered_serving.md.
# Hundred-and-fiftieth call, at de4eb60 (this session's last code: the step as 3dfbd1a's): (1)
# issue 15's rows at 128K and 512K, 100 steps, on the fresh machine; (2) the whole suite; (3) the
# transformers backend end to end. Bundle .device/b150; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 150
start_kvrecalld "$B/kvrecalld" "$L/kvrecalld_rows.log" --address=127.0.0.1:0 || exit 1
for context in 131072 524288; do
  timeout 200 "$B/gpu_serving_bench" --server="$kvrecalld_address" --out="$L/s$context.json" \
    --placement=tiered --contexts=$context --batches=1 --selectors=retopk,index --auto_tau \
    --steps=100 --warmup=8 > /dev/null 2> "$L/s$context.log"
  echo "$context rc $? t=$SECONDS" | tee -a "$S"
  serving_summary "$L/s$context.json"
  python3 - "$L/s$context.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    s = sorted(r["server_us_by_step"])
    p50 = s[len(s) // 2]
    print("  ", r["selector"], r["context"], "p90", round(s[int(0.9 * len(s))]), "p99",
          round(s[int(0.99 * len(s))]), "max", round(s[-1]), "over 2x p50:",
          sum(x > 2 * p50 for x in s))
PY
  cp "$L/s$context.json" "$OUT/"
done
kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d150
device_call_end
