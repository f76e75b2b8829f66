#!/usr/bin/env bash
# NOT RUN: the tenth session's device time ran out (2026-12-05). The change it measures is
# d108_takeover_rows.patch (beside this file; not on main: its GPU path has not run): apply it
# (git apply), build, bundle the four tests below with kvrecalld, gpu_serving_bench and, as
# kvrecalld_before, a kvrecalld built without it, into .device/b108 (device_tests.md's recipe),
# run this, and land the patch if the tests pass and the take-over step is shorter.
# Hundred-and-eighth call: a take-over's catch-up coding by one launch of a block per (row, KV
# head) (cuda::PqEncodeRows) instead of a PqEncode launch per KV head, which for the few
# hundred rows a take-over codes ran ~1 ms a layer on the step's path (d107: the errors'
# 16 KB download waiting ~985 us for eight launches of one or two blocks).
#   1. The GPU tests that code bulks on the device (codes_learning_test's new case compares the
#      GPU tier's codes, few rows and many, with the quantizers' encoding), and the kernels'.
#   2. d107's take-over run (index and retopk, batches 1 and 8) against kvrecalld before
#      (8258121) and after: the take-over step (bulk 1536) and p50.
#   (Cut for want of device time: a second pair of runs, and the after binary under the shim.)
# Carry: .device/b108/ship (the tests, kvrecalld, kvrecalld_before, gpu_serving_bench, the shim).
set -u
. bench/device_call.sh
device_call_begin 108
for t in codes_learning_test cuda_pq_encode_test tiered_shortlist_test tiered_placement_test; do
  timeout 200 $B/$t --gtest_brief=1 > $L/$t.log 2>&1
  echo "$t rc $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $L/$t.log | tr '\n' ' ')" | tee -a $S
done
grep -h "FAILED\|Failure" $L/*_test.log | head -20 | tee -a $S

takeover() {  # $1: the binary's name in $B, $2: a name for the run
  start_kvrecalld $B/$1 $L/kvrecalld_$2.log --address=127.0.0.1:0 || return 1
  timeout 120 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/takeover_$2.json \
    --placement=tiered --contexts=640 --batches=1,8 --selectors=index,retopk --auto_tau \
    --steps=700 --warmup=900 > /dev/null 2> $L/takeover_$2.log
  echo "take-over $2 rc $? t=$SECONDS" | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 - $L/takeover_$2.json $2 <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    t = r["server_us_by_step"]
    at = {s["step"]: s for s in r.get("slowest_steps", [])}.get(1536 - 900, {})
    print(sys.argv[2], r["selector"], "batch", r["batch"], "p50", round(r["server_p50_us"]),
          "p99", round(r["server_p99_us"]), "take-over step", round(t[1536 - 900]),
          "reserve", round(at.get("reserve_us", -1)), "plan", round(at.get("plan_us", -1)),
          "launch", round(at.get("launch_us", -1)))
PY
  cp $L/takeover_$2.json $OUT/
}
takeover kvrecalld_before before
takeover kvrecalld after
device_call_end
