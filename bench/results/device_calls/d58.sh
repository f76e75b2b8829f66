#!/usr/bin/env bash
# Fifty-eighth call: the review's mends of the GPU's exact heads (a failed Start drains both
# streams; the pinning on the tier's own device; every set error word read; sessions of another
# top_k step apart) and the new test of a short shortlist's device heads against a host-only
# server. Tests only, and memcheck on the two served tests of the device heads.
set -u
tar -C .device/b58 -xJf .device/b58/ship/bundle.tar.xz
B=$PWD/.device/b58/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b58/bundle/lib
L=/tmp/d58; mkdir -p $L
S=$OUT/d58_summary.txt
for t in tiered_shortlist_test tiered_codes_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED" $L/$t.log | head -8 | tee -a $S
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/tiered_shortlist_test --gtest_filter='*DeviceHeads*:*HalfTheHeads*' > $L/memcheck.log 2>&1
echo "memcheck rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS done" | tee -a $S
cd $L && tar czf $OUT/d58.tgz *.log
