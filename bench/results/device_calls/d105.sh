#!/usr/bin/env bash
# NOT RUN: no device was lent in the eighth or the ninth session (2026-12-05). Its bundle
# .device/b105 holds fe8ffbe's binaries (rebuilt in the ninth session); a later session rebuilds
# it from its HEAD if the code has moved on (the recipe in device_tests.md), runs this first, and
# records what it shows.
# Hundred-and-fifth call: the final code on the GPU, and why a warm machine stepped at ~500 us
# (d102-d103) where a fresh one stepped at 285 (d104).
#   1. On the fresh machine, first: 128K tiered retopk and index, batch 1 (d104's run), with a
#      sampler beside it (load, the server's RSS and transparent huge pages, the GPU's clocks).
#   2. The whole test suite (every C++ binary and the Python client's tests).
#   3. What the suite left behind: load, the busiest processes, the free huge pages.
#   4. Step 1 again, on the machine the suite warmed.
#   5. The transformers backend end to end (tiered bytes as the cpu placement's).
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
hf_demo_check hf_demo_d105
device_call_end
