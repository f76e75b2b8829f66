#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine (no H200 could be started), bundle .device/b105 built from
# 8258121 (results: device_tests.md, tiered_serving.md "Before and after the test suite",
# ppl_hf_backend_gpu.md). The machine had no nsys: step 5 printed "no nsys" (d106 times the
# take-over with bench/cuda_api_timer.c instead).
# Hundred-and-fifth call: the final code on the GPU, and why a warm machine stepped at ~500 us
# (d102-d103) where a fresh one stepped at 285 (d104).
#   1. On the fresh machine, first: 128K tiered retopk and index, batch 1 (d104's run), with a
#      sampler beside it (load, the server's RSS and transparent huge pages, the GPU's clocks).
#   2. The whole test suite (every C++ binary and the Python client's tests).
#   3. What the suite left behind: load, the busiest processes, the free huge pages.
#   4. Step 1 again, on the machine the suite warmed.
#   5. Where a take-over's ~1 ms goes (d98-d99: `reserve` 1.3 ms a layer, `plan` + `launch`
#      1-3 ms at batch 1): d99's take-over run (index, batches 1 and 8) with kvrecalld under
#      Nsight Systems, if the machine has it: every CUDA API call over 100 us, by bulk length.
#   6. The transformers backend end to end (tiered bytes as the cpu placement's).
# Carry: .device/b105/ship, .device/model, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 105

# Every 2 s until killed: the load, the free memory and huge pages, each kvrecalld's RSS and
# anonymous huge pages, the GPU's SM clock and throttle reasons.
sample() {
  while true; do
    {
      echo "t=$SECONDS load $(cut -d' ' -f1-3 /proc/loadavg)" \
        "$(grep -E '^(MemFree|AnonHugePages|HugePages_Free)' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
      for pid in $(pgrep -x kvrecalld); do
        echo "  kvrecalld $pid $(grep -E '^(Rss|AnonHugePages)' /proc/$pid/smaps_rollup \
          2>/dev/null | tr -s ' ' | tr '\n' ' ')"
      done
      nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu \
        --format=csv,noheader 2>/dev/null | sed 's/^/  gpu /'
    } >> "$1"
    sleep 2
  done
}

step_128k() {  # $1: a name for this run
  start_kvrecalld $B/kvrecalld $L/kvrecalld_$1.log --address=127.0.0.1:0 || return 1
  sample $L/sample_$1.txt &
  local sampler=$!
  cat /proc/loadavg | tee -a $S
  timeout 200 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/s128k_$1.json \
    --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau \
    --steps=60 --warmup=8 > /dev/null 2> $L/s128k_$1.log
  echo "128K $1 rc $? t=$SECONDS" | tee -a $S
  kill $sampler; wait $sampler 2>/dev/null
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  serving_summary $L/s128k_$1.json
  grep -E "kvrecalld|gpu" $L/sample_$1.txt | sort | uniq -c | sort -rn | head -6 | tee -a $S
  tail -3 $L/sample_$1.txt | tee -a $S
  cp $L/s128k_$1.json $OUT/
}

echo "THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)" \
  "defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag)" | tee -a $S
step_128k fresh
bash bench/device_test_suite.sh $B $L $S
echo "after the suite: $(cat /proc/loadavg)" | tee -a $S
grep -E '^(MemFree|AnonHugePages)' /proc/meminfo | tee -a $S
cat /proc/buddyinfo | tee -a $S
ps -eo pid,stat,pcpu,etime,comm --sort=-pcpu | head -8 | tee -a $S
step_128k after_suite

takeover_nsys() {
  command -v nsys > /dev/null || { echo "no nsys" | tee -a $S; return; }
  nsys profile --trace=cuda --sample=none --cpuctxsw=none -o $L/takeover -f true \
    $B/kvrecalld --metrics_address=127.0.0.1:0 --address=127.0.0.1:0 > $L/kvrecalld_nsys.log 2>&1 &
  local nsys_pid=$!
  local address=""
  for _ in $(seq 300); do
    address=$(sed -n 's/^kvrecalld listening on //p' $L/kvrecalld_nsys.log)
    [ -n "$address" ] && break
    sleep 0.1
  done
  [ -n "$address" ] || { tail -5 $L/kvrecalld_nsys.log | tee -a $S; kill $nsys_pid; return; }
  timeout 240 $B/gpu_serving_bench --server=$address --out=$L/takeover_nsys.json \
    --placement=tiered --contexts=640 --batches=1,8 --selectors=index --auto_tau \
    --steps=700 --warmup=900 > /dev/null 2> $L/takeover_nsys.log
  echo "take-over under nsys rc $? t=$SECONDS" | tee -a $S
  kill $(pgrep -x kvrecalld)  # the profiled one alone runs now
  for _ in $(seq 90); do kill -0 $nsys_pid 2>/dev/null || break; sleep 1; done
  ls -la $L/takeover.nsys-rep | tee -a $S
  serving_summary $L/takeover_nsys.json
  python3 - $L/takeover_nsys.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["selector"], "batch", r["batch"], "max", round(r["server_max_us"]))
    for s in r.get("slowest_steps", [])[:4]:
        print("   bulk", 900 + s["step"], {k: round(v) for k, v in s.items() if k != "step"})
PY
  nsys stats --report cuda_api_sum --format csv -o $L/api $L/takeover.nsys-rep > /dev/null 2>&1
  nsys stats --report cuda_api_trace --format csv -o $L/trace $L/takeover.nsys-rep > /dev/null 2>&1
  head -25 $L/api_cuda_api_sum.csv | cut -c1-160 | tee -a $S
  # The calls over 100 us, in time order (start s from the profile's start, duration us, name).
  python3 - $L/trace_cuda_api_trace.csv <<'PY' 2>&1 | tee -a $S
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
if rows and "Duration (ns)" not in rows[0]:
    sys.exit("columns: %s" % list(rows[0]))
t0 = float(rows[0]["Start (ns)"]) if rows else 0
slow = [r for r in rows if float(r["Duration (ns)"]) > 100e3]
print(len(rows), "calls,", len(slow), "over 100 us")
for r in slow[:120]:
    print("%.4f %8.0f %s" % ((float(r["Start (ns)"]) - t0) / 1e9, float(r["Duration (ns)"]) / 1e3,
                            r["Name"]))
PY
  cp $L/takeover_nsys.json $OUT/
  xz -T4 -c $L/trace_cuda_api_trace.csv > $OUT/takeover_api_trace.csv.xz
}
takeover_nsys
hf_demo_check hf_demo_d105
device_call_end
