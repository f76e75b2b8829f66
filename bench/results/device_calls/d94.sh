#!/usr/bin/env bash
# Ninety-fourth call: the final code of this stop on the H200 (d93's plus the prompt's queries
# staged as a window of the last ones the build reads: PromptQueries, ReTopK's seeds and
# calibration window instead of all T rows; the value checks of a q nothing keeps). Every C++
# test binary and the Python client's tests; the transformers backend end to end (its tiered
# retopk builds from the window); and the peak host memory of one 128K tiered retopk session's
# prefill, d93's kvrecalld (every query staged for retopk) against this one (the window).
# Carry: .device/b94/ship (every tests/*_test, kvrecalld, kvrecall, gpu_serving_bench),
# .device/b93k (d93's kvrecalld, stripped, xz: the comparison), .device/model, _gen.
set -u
tar -C .device/b94 -xJf .device/b94/ship/bundle.tar.xz
xz -dc .device/b93k/kvrecalld.xz > /tmp/kvrecalld_b93 && chmod +x /tmp/kvrecalld_b93
B=$PWD/.device/b94/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b94/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d94; mkdir -p $L
S=$OUT/d94_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
# 1. Every C++ test binary and, beside them, the Python client's tests.
bash bench/device_test_suite.sh $B $L $S
grep -E "HfBackendTest|skipped" $L/python_client_test.log | head -20 | tee -a $S
# 2. The transformers backend end to end (as d88, d93).
start_kvrecalld $B/kvrecalld $L/kvrecalld_hf.log --address=127.0.0.1:0 || exit 1
PYTHONPATH=client/python timeout 200 python3 -m kvrecall.hf_demo --server "$kvrecalld_address" \
  --model .device/model/tinylm-a.npz --text .device/model/prompt.txt --prompt 8192 --new 64 \
  --batch 2 --dtype bf16 --auto-tau --policies index:512 tiered/index:512 retopk:512 \
  tiered/retopk:512 --out $OUT/hf_demo_d94.json > $L/hf.log 2>&1
echo "hf_demo rc $? t=$SECONDS" | tee -a $S
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print("ok", d.get("ok"))
for r in d["runs"]: print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"), r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"), r.get("first_divergence_from_cpu"), "s", round(r.get("seconds", 0), 2), "error" if "error" in r else "")' $OUT/hf_demo_d94.json 2>&1 | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
# 3. Peak host memory of a 128K tiered retopk prefill (one layer, 32 / 8 heads, d = 128, bf16):
# the prompt's queries are 2 GiB of f32; the KV 512 MiB.
for build in b93 b94; do
  binary=$B/kvrecalld; [ $build = b93 ] && binary=/tmp/kvrecalld_b93  # (b94's libraries)
  start_kvrecalld $binary $L/kvrecalld_$build.log \
    --address=127.0.0.1:0 || exit 1
  timeout 120 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/m_$build.json \
    --placement=tiered --contexts=131072 --batches=1 --selectors=retopk --auto_tau \
    --steps=10 --warmup=2 > /dev/null 2> $L/m_$build.log
  echo "$build bench rc $? $(grep -E 'VmHWM|VmRSS' /proc/$kvrecalld_pid/status | tr -s ' \n' ' ')" | tee -a $S
  python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[2], r["selector"], "srv", round(r["server_p50_us"]), "build", round(r.get("build_seconds_max",0),2), "hostB", r.get("session_host_bytes"))' $L/m_$build.json $build 2>&1 | tee -a $S
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
done
cd $L && tar czf $OUT/d94_logs.tgz *.log *.txt 2>/dev/null
