#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine: pq_encode.md, device_tests.md, tiered_serving.md.
# Hundred-and-twelfth call (eleventh session, 2026-12-05): PqEncode rewritten (a block per (64
# keys, code set), a warp weighing a codebook staged in shared memory against one key at a time,
# every KV head in one launch) after d111 found the old kernel (a thread per key) ~110 us a
# launch whatever the count (~107-125 us), eight launches a coding, and PqEncodeRows linear in the rows.
#   1. The whole test suite (cuda_pq_encode_test: the new kernel against the CPU encoder, sets
#      against single calls, PqEncodeRows against it; every GPU coding and training through it).
#   2. bench/pq_encode_bench: per KV head, every head at once, by rows, at 8 to 2048 rows.
#   3. d98's take-over run, and issue 15's 128K rows (the prompt's coding is in the build).
# Bundle: .device/b112 (device_tests.md's recipe, pq_encode_bench). Carry: .device/b112/ship,
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 112
timeout 120 $B/pq_encode_bench > $OUT/pq_encode_d112.json 2> $L/pq_encode.log
echo "pq_encode_bench rc $?" | tee -a $S
cat $L/pq_encode.log | tee -a $S
$B/cuda_pq_encode_test 2>&1 | grep -E "^\[ +(OK|FAILED) +\]|Failure|Expected|Which is" |
  head -30 | tee -a $S
bash bench/device_test_suite.sh $B $L $S
takeover_run encode $B/kvrecalld
tiered_rows $B/kvrecalld 131072
device_call_end
