#!/usr/bin/env bash
# Run in the seventh session (2026-12-05; no device was lent in the fifth or sixth): results in
# device_tests.md, tiered_serving.md ("The step at a take-over") and ppl_hf_backend_gpu.md.
# Ninety-eighth call: the code after review 5, the cancellation fixes and probe 5's fixes (the
# codes' take-over at half again as many rows, no prompt codes under 256 bulk rows, a learning's
# OpenMP team of two; a CreateSession cancelled in its handler or past its deadline undone, a
# queued Prefill's staging released on cancel, the Prefill's deadline checked before the
# install; a Decode whose reply could pass --max_message_mb refused first; auto_tau's replay
# over each query's own prefix, counting views of at least R * K + W). 1. Every C++ test binary
# and the Python client's tests (gpu_placement_test's ReTopK-vs-cpu check covers the
# calibration change on the GPU placement). 2. Steps across a take-over: a prompt with no bulk,
# timed from bulk 900 to 1600 (a learning starts at 1024 and takes over at 1536), batch 1 and 8
# (eight layers' learnings queued at one step), each step's server time kept. 3. The
# transformers backend end to end.
# Carry: .device/b98/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/model (tinylm-a.npz, prompt.txt), client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 98
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
    worst = sorted(range(len(t)), key=lambda i: -t[i])[:5]
    # Timed step i carries bulk row 900 + i (a prompt of 640: no bulk before the warm-up).
    print(r["selector"], "batch", r["batch"], "max", round(r["server_max_us"]),
          "worst steps (bulk, us):", [(900 + i, round(t[i])) for i in worst],
          "around 1536:", [round(x) for x in t[1536 - 900 - 2:1536 - 900 + 3]])
PY
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
hf_demo_check hf_demo_d98
cp $L/takeover.json $OUT/ 2>/dev/null
device_call_end
