#!/usr/bin/env bash
# Ninety-third call: the code of this stop checked whole on the H200: SequenceStep.position (the
# sequencer check; the hf backend now says each token's position), the metrics endpoint's
# eviction of idle peers, --plaintext_unix_sockets and the clients' token over it, the prompt's
# queries staged only where the build reads them, the tiered shortlist lists allocated and
# charged at the build (probe 4). Every C++ test binary and the Python client's tests (the hf
# backend's need torch: here only); the transformers backend end to end; issue 15's 128K rows as
# a check that the step's path did not regress.
# Carry: .device/b93/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/model (tinylm-a.npz, prompt.txt), client/python/kvrecall/_gen.
set -u
tar -C .device/b93 -xJf .device/b93/ship/bundle.tar.xz
B=$PWD/.device/b93/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b93/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d93; mkdir -p $L
S=$OUT/d93_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
# 1. Every C++ test binary and, beside them, the Python client's tests.
bash bench/device_test_suite.sh $B $L $S
grep -E "HfBackendTest|skipped" $L/python_client_test.log | head -20 | tee -a $S
# 2. The transformers backend end to end (as d82).
start_kvrecalld $B/kvrecalld $L/kvrecalld_hf.log --address=127.0.0.1:0 || exit 1
PYTHONPATH=client/python timeout 200 python3 -m kvrecall.hf_demo --server "$kvrecalld_address" \
  --model .device/model/tinylm-a.npz --text .device/model/prompt.txt --prompt 8192 --new 64 \
  --batch 2 --dtype bf16 --auto-tau --policies index:512 tiered/index:512 retopk:512 \
  tiered/retopk:512 --out $OUT/hf_demo_d93.json > $L/hf.log 2>&1
echo "hf_demo rc $? t=$SECONDS" | tee -a $S
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print("ok", d.get("ok"))
for r in d["runs"]: print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"), r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"), r.get("first_divergence_from_cpu"), "s", round(r.get("seconds", 0), 2), "error" if "error" in r else "")' $OUT/hf_demo_d93.json 2>&1 | tee -a $S
tail -3 $L/hf.log | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
# 3. Issue 15's 128K rows, default policy, batch 1 and 8.
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
if [ $SECONDS -lt 420 ]; then
  cat /proc/loadavg | tee -a $S
  timeout 150 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s1.json \
    --placement=tiered --contexts=131072 --batches=1,8 --selectors=retopk,index --auto_tau \
    --steps=30 --warmup=5 > /dev/null 2> $L/s1.log
  echo "serving rc $? t=$SECONDS" | tee -a $S
  cp $L/s1.json $OUT/serving_d93.json
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(r["context"], r["batch"], r["selector"], r.get("exact_search"), r.get("effective_shortlist"), "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "devx", round(r.get("device_exact_p50_us",0)), "bulk", round(r.get("bulk_p50_us",0)), "decide", round(r.get("decide_p50_us",0)), "finish", round(r.get("finish_p50_us",0)), "devheads", round(r.get("device_exact_heads_per_step",0),2), "gpuB", r.get("session_gpu_bytes"), "build", round(r.get("build_seconds_max",0),2))' $L/s1.json 2>&1 | tee -a $S
else
  echo "t=$SECONDS serving skipped" | tee -a $S
fi
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cd $L && tar czf $OUT/d93_logs.tgz *.log *.txt 2>/dev/null
