#!/usr/bin/env bash
# Run 2026-12-05 (twelfth session): pq_encode.md, device_tests.md, tiered_serving.md.
# Hundred-and-eighteenth call: review 12's mends (PqEncodeParams::keys_per_warp, the split chosen
# by PqEncodeKeysPerWarp, PqEncodeSplitTest asking for every split at every part size against
# PqEncodeRows) and a take-over's staging not zeroed (ChargedBuffer::AllocateForOverwrite: d117
# found the catch-up coding's 1 MB staging filled and waited for on the step's path, ~50 us).
#   1. The whole test suite.
#   2. pq_encode_bench once (the kernel is d116's).
#   3. d98's take-over run, 34256b1's kvrecalld (old) and this one alternating twice; then this
#      one's batch-1 take-over under bench/cuda_api_timer.c at 3 us, its allocation bursts.
# Bundle: .device/b118 (this code, and 34256b1's kvrecalld as kvrecalld_34256b1; the shim in
# its ship). Carry .device/b118/ship and client/python/kvrecall/_gen. Everything but the
# summary comes back in d118_out.tgz.
# (Its run under the shim was inline when it ran; bench/device_call.sh's takeover_calls since,
# the same commands.)
set -u
. bench/device_call.sh
device_call_begin 118
R=$L/out
mkdir -p $R
$B/cuda_pq_encode_test 2>&1 | grep -E "^\[ +(FAILED|  PASSED) +\]|Failure|Expected|Which is" |
  head -40 | tee -a $S
$B/cuda_pq_encode_test --gtest_brief=0 2>&1 | grep -c "^\[       OK" | sed 's/^/OK cases: /' |
  tee -a $S
bash bench/device_test_suite.sh $B $L $S
pq_encode_runs d118 $B
for rep in 1 2; do
  takeover_run old$rep $B/kvrecalld_34256b1
  takeover_run new$rep $B/kvrecalld
done
takeover_calls $PWD/.device/b118/ship/libkvrecall_cuda_api_timer.so
mv $OUT/*.json $R/ 2>/dev/null
tar -C $L -czf $OUT/d118_out.tgz out
device_call_end
