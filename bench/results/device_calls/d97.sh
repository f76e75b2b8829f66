#!/usr/bin/env bash
# Ninety-seventh call: a tiered layer's shortlist codes learned again as its bulk grows
# (server/backends/codes_learning.h: a short prompt gets codes once its bulk reaches 1024 rows,
# and new ones at every doubling up to 16384, off the decode path) and the outlier bar set on
# the bulk's held-out last fifth (BulkCodes::kHeldOutShare); the prompt-query window as one type
# (PromptQueryWindow). 1. Every C++ test binary (the GPU tier's learning in tiered_codes_test)
# and the Python client's tests. 2. A short prompt decoding 8000 tokens, against a prompt of
# the same bulk and tiered exact_topk there (the flat scan the old code fell back to). 3. Issue
# 15's 128K rows as a check (the codes at prefill now learn from the bulk's first 4/5). 4. The
# transformers backend end to end (bytes as the cpu placement's).
# Carry: .device/b97/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/model (tinylm-a.npz, prompt.txt), client/python/kvrecall/_gen.
set -u
tar -C .device/b97 -xJf .device/b97/ship/bundle.tar.xz
B=$PWD/.device/b97/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b97/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d97; mkdir -p $L
S=$OUT/d97_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
# 1. Every C++ test binary and, beside them, the Python client's tests.
bash bench/device_test_suite.sh $B $L $S
grep -E "CodesAreLearned|TinyPrompt|WhileItsCodes|EveryCodedRow" $L/tiered_codes_test.log | tee -a $S
summarize() {
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]:
  paths = " ".join("%s:%dc/%dus" % (k, v["candidates_mean"], v["bulk_p50_us"]) for k, v in r.get("head_bulk_by_path", {}).items())
  print(r["context"], r["batch"], r["selector"], r.get("exact_search"), "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "bulk", round(r.get("bulk_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), "gpuB", r.get("session_gpu_bytes"), "build", round(r.get("build_seconds_max",0),2), paths)' $1 2>&1 | tee -a $S
}
# 2. Short prompt, long generation: bulk 8000-8100 when timed.
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
cat /proc/loadavg | tee -a $S
timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/short.json \
  --placement=tiered --contexts=640 --batches=1 --selectors=index,retopk --auto_tau \
  --steps=100 --warmup=8000 > /dev/null 2> $L/short.log
echo "short prompt rc $? t=$SECONDS" | tee -a $S
summarize $L/short.json
timeout 150 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/long.json \
  --placement=tiered --contexts=8640 --batches=1 --selectors=index,retopk,exact_topk \
  --auto_tau --steps=100 --warmup=8 > /dev/null 2> $L/long.log
echo "long prompt rc $? t=$SECONDS" | tee -a $S
summarize $L/long.json
# 3. Issue 15's 128K rows, default policy, batch 1.
if [ $SECONDS -lt 380 ]; then
  timeout 120 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s128k.json \
    --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau \
    --steps=40 --warmup=5 > /dev/null 2> $L/s128k.log
  echo "128K rc $? t=$SECONDS" | tee -a $S
  summarize $L/s128k.json
else
  echo "t=$SECONDS 128K skipped" | tee -a $S
fi
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
# 4. The transformers backend end to end (as d93).
if [ $SECONDS -lt 470 ]; then
  start_kvrecalld $B/kvrecalld $L/kvrecalld_hf.log --address=127.0.0.1:0 || exit 1
  PYTHONPATH=client/python timeout 100 python3 -m kvrecall.hf_demo --server "$kvrecalld_address" \
    --model .device/model/tinylm-a.npz --text .device/model/prompt.txt --prompt 8192 --new 64 \
    --batch 2 --dtype bf16 --auto-tau --policies index:512 tiered/index:512 retopk:512 \
    tiered/retopk:512 --out $OUT/hf_demo_d97.json > $L/hf.log 2>&1
  echo "hf_demo rc $? t=$SECONDS" | tee -a $S
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print("ok", d.get("ok"))
for r in d["runs"]: print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"), r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"), r.get("first_divergence_from_cpu"), "s", round(r.get("seconds", 0), 2), "error" if "error" in r else "")' $OUT/hf_demo_d97.json 2>&1 | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
else
  echo "t=$SECONDS hf_demo skipped" | tee -a $S
fi
cp $L/short.json $L/long.json $L/s128k.json $OUT/ 2>/dev/null
cd $L && tar czf $OUT/d97_logs.tgz *.log *.txt 2>/dev/null
