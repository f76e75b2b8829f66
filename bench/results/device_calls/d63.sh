#!/usr/bin/env bash
# Sixty-third call: tests only, after d62's failure (tier_micros.launch took the planning time and
# left the bulk; the planning is tier_micros.plan now): tiered_shortlist_test, tiered_placement.
set -u
tar -C .device/b63 -xJf .device/b63/ship/bundle.tar.xz
B=$PWD/.device/b63/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b63/bundle/lib
S=$OUT/d63_summary.txt
for t in tiered_shortlist_test tiered_placement_test; do
  timeout 100 $B/$t > $OUT/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $OUT/$t.log | head -8 | tee -a $S
done
