#!/usr/bin/env bash
# Seventy-sixth call: the exact search review's tests on the GPU (tiered_shortlist_test's new
# echo and refusal cases, tiered_placement_test, service_hardening_test whose tiered cases now
# ask for the graph by its knobs), then where a tiered ReTopK step's `decide` goes on the H200
# host (bench/decide_bench.cc): the decisions cold and warm by thread count, the pool's wake-up
# alone, at kvrecalld's default spin (100 us) and at 400, with and without a small last loop.
# Bundle: .device/b76.
set -u
tar -C .device/b76 -xJf .device/b76/ship/bundle.tar.xz
B=$PWD/.device/b76/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b76/bundle/lib
L=/tmp/d76; mkdir -p $L
S=$OUT/d76_summary.txt
cat /proc/loadavg | tee -a $S
for t in tiered_shortlist_test tiered_placement_test service_hardening_test; do
  timeout 240 $B/$t --gtest_brief=1 > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED|tests ran" $L/$t.log | head -8 | tee -a $S
done
echo "t=$SECONDS tests done" | tee -a $S
n=0
for flags in "--spin_us=100 --finish_threads=2" "--spin_us=400 --finish_threads=2" \
             "--spin_us=400 --finish_threads=0" "--spin_us=100 --finish_threads=0 --gap_us=0"; do
  n=$((n + 1))
  cat /proc/loadavg | tee -a $S
  echo "decide_bench $flags" | tee -a $S
  timeout 120 $B/decide_bench $flags --steps=60 > $OUT/decide_$n.json 2> $L/decide_$n.log
  echo "rc $?" | tee -a $S
  grep threads $L/decide_$n.log | tee -a $S
done
echo "t=$SECONDS all done" | tee -a $S
