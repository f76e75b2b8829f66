#!/usr/bin/env bash
# Run 2026-12-05: the suite 48 of 49 (a thread-count margin, widened); retopk build 1.39 s at
# 128K (tiered_serving.md, "ReTopK's build on the GPU").
# Hundred-and-second call: a tiered retopk layer's build finds its prompt queries' exact top-K
# (the C seeds and auto_tau's C + 256 queries against nearly the whole prompt) with the tier's
# batch top-K, cuBLAS on the GPU, instead of the CPU's (d99: 5.47 s of build at 128K, against
# the index's 0.37). 1. Every C++ test binary and the Python client's tests. 2. Issue 15's 128K
# rows, default policy, batch 1: the build seconds and the step (the same as d99's if the
# GPU's lists are the CPU's).
# Carry: .device/b102/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/model, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 102
bash bench/device_test_suite.sh $B $L $S
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s128k.json \
  --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau \
  --steps=40 --warmup=5 > /dev/null 2> $L/s128k.log
echo "128K rc $? t=$SECONDS" | tee -a $S
serving_summary $L/s128k.json
python3 - $L/s128k.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["selector"], "build first", round(r["build_seconds_first"], 3), "max",
          round(r["build_seconds_max"], 3), "prefill", round(r["prefill_seconds"], 2))
PY
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cp $L/s128k.json $OUT/ 2>/dev/null
device_call_end
