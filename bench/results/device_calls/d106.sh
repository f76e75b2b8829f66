#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine (no H200 could be started), with the shim before it wrote
# what each copy moved (the lines have no bytes); results: tiered_serving.md, "The step at a
# take-over".
# Hundred-and-sixth call: where a take-over's stall goes (d98-d99: `reserve` 1.3 ms a layer,
# `plan` + `launch` 1-3 ms at batch 1), on a machine without Nsight Systems (d105: no nsys).
# kvrecalld runs under bench/cuda_api_timer.c (LD_PRELOAD), which writes every blocking CUDA
# runtime call over 100 us with its thread, and each function's totals at exit; d99's take-over
# run (a 640-token prompt, bulk 900 to 1600, index and retopk, batches 1 and 8) against it.
# Carry: .device/b106/ship (d105's bundle, HEAD 8258121's binaries, and
# libkvrecall_cuda_api_timer.so). Its wrapper is bench/device_call.sh's timed_kvrecalld since
# d110 (the same script; the 100 us it set by default now given).
set -u
. bench/device_call.sh
device_call_begin 106
timed_kvrecalld $PWD/.device/b106/ship/libkvrecall_cuda_api_timer.so $L/api_calls.txt 100
start_kvrecalld $L/kvrecalld_timed $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/takeover.json \
  --placement=tiered --contexts=640 --batches=1,8 --selectors=index,retopk --auto_tau \
  --steps=700 --warmup=900 > /dev/null 2> $L/takeover.log
echo "take-over rc $? t=$SECONDS" | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
serving_summary $L/takeover.json
python3 - $L/takeover.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    t = r["server_us_by_step"]
    # Timed step i carries bulk row 900 + i (a prompt of 640: no bulk before the warm-up).
    print(r["selector"], "batch", r["batch"], "max", round(r["server_max_us"]),
          "around 1536:", [round(x) for x in t[1536 - 900 - 2:1536 - 900 + 3]])
    for s in r.get("slowest_steps", [])[:4]:
        print("   bulk", 900 + s["step"], {k: round(v) for k, v in s.items() if k != "step"})
PY
grep "^#" $L/api_calls.txt | tee -a $S
# The slow calls of the threads that step (not the learning's, kvrecall-codes), with the gap
# before each, so that the take-overs' bursts stand out.
python3 - $L/api_calls.txt <<'PY' 2>&1 | tee -a $S
import sys
rows = [l.rstrip("\n").split(None, 3) for l in open(sys.argv[1]) if not l.startswith("#")]
print(len(rows), "calls over 100 us;", sum(r[3] == "kvrecall-codes" for r in rows), "of them the learning's")
steps = [r for r in rows if r[3] != "kvrecall-codes"]
prev = 0
for r in steps[:200]:
    print("%9s %6s %-26s %-16s gap %d" % (r[0], r[1], r[2], r[3], int(r[0]) - prev))
    prev = int(r[0])
PY
cp $L/takeover.json $L/api_calls.txt $OUT/
device_call_end
