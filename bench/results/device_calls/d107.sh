#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine (results: tiered_serving.md, "The step at a take-over").
# Hundred-and-seventh call: d106 again (a take-over timed by bench/cuda_api_timer.c), the shim's
# threshold at 20 us, index alone, so that the take-over step's many short calls show: d106 saw
# only one call over 100 us in a batch-1 take-over step of ~4 ms (a ~960 us cudaMemcpy) and one
# in a batch-8 step whose reservations took 7.8 ms (a 2.3 ms cudaHostAlloc). Prints the three
# 10 ms windows whose calls on the stepping threads (all but the learning's) take longest,
# by function. Carry: .device/b106/ship. (Its analysis of the calls is bench/device_call.sh's
# api_windows since d110, its wrapper timed_kvrecalld: the same code.)
set -u
. bench/device_call.sh
device_call_begin 106  # d106's bundle and shim
N=107
S=$OUT/d107_summary.txt
timed_kvrecalld $PWD/.device/b106/ship/libkvrecall_cuda_api_timer.so $L/api_calls_20us.txt 20
start_kvrecalld $L/kvrecalld_timed $L/kvrecalld_20us.log --address=127.0.0.1:0 || exit 1
timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/takeover_20us.json \
  --placement=tiered --contexts=640 --batches=1,8 --selectors=index --auto_tau \
  --steps=700 --warmup=900 > /dev/null 2> $L/takeover_20us.log
echo "take-over rc $? t=$SECONDS" | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
serving_summary $L/takeover_20us.json
python3 - $L/takeover_20us.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    for s in r.get("slowest_steps", [])[:2]:
        print(r["selector"], r["batch"], "bulk", 900 + s["step"],
              {k: round(v) for k, v in s.items() if k != "step"})
PY
api_windows $L/api_calls_20us.txt
cp $L/takeover_20us.json $L/api_calls_20us.txt $OUT/
device_call_end
