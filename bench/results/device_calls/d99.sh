#!/usr/bin/env bash
# Run 2026-12-05 (results: tiered_serving.md, "The step at a take-over"). The in-place update
# showed no benefit and was taken out again after this call.
# Ninety-ninth call: a captured static-set step whose key changes (the bound, every ~6 % of
# growth; the codes, at a take-over) updates the previous CUDA graph in place
# (cudaGraphExecUpdate) instead of instantiating a new one, and gpu_serving_bench records the
# slowest timed steps' phases (slowest_steps). 1. Every C++ test binary and the Python
# client's tests (the GPU placements' steps across growing bounds and take-overs). 2. d98's
# take-over run again: each step's server time, and where the slowest ones spent it. 3. Issue
# 15's 128K rows, default policy, batch 1, as a check. 4. The transformers backend end to end.
# Carry: .device/b99/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/model (tinylm-a.npz, prompt.txt), client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 99
bash bench/device_test_suite.sh $B $L $S
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
cat /proc/loadavg | tee -a $S
timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/takeover.json \
  --placement=tiered --contexts=640 --batches=1,8 --selectors=index,retopk --auto_tau \
  --steps=700 --warmup=900 > /dev/null 2> $L/takeover.log
echo "take-over rc $? t=$SECONDS" | tee -a $S
serving_summary $L/takeover.json
python3 - $L/takeover.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    t = r["server_us_by_step"]
    # Timed step i carries bulk row 900 + i (a prompt of 640: no bulk before the warm-up).
    print(r["selector"], "batch", r["batch"], "max", round(r["server_max_us"]),
          "around 1536:", [round(x) for x in t[1536 - 900 - 2:1536 - 900 + 3]])
    for s in r.get("slowest_steps", []):
        print("   bulk", 900 + s["step"], {k: round(v) for k, v in s.items() if k != "step"})
PY
timeout 150 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s128k.json \
  --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau \
  --steps=40 --warmup=5 > /dev/null 2> $L/s128k.log
echo "128K rc $? t=$SECONDS" | tee -a $S
serving_summary $L/s128k.json
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
hf_demo_check hf_demo_d99
cp $L/takeover.json $L/s128k.json $OUT/ 2>/dev/null
device_call_end
