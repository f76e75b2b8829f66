#!/usr/bin/env bash
# Run 2026-12-05 (twelfth session): device_tests.md, tiered_serving.md ("The step at a
# take-over").
# Hundred-and-nineteenth call: a captured step plans its scan bound for the row the next step
# scans too (GraphTokenBound(coded + 1)), so that the step after a take-over (at a bucket's end
# for a layer whose codes were first learned at 1024 rows, as here) is not captured once more
# (d117, d118: two captures a take-over). Also the last refactors (DeviceBuffer::Zeroed on
# ForOverwrite).
#   1. The whole test suite.
#   2. This kvrecalld's batch-1 take-over under bench/cuda_api_timer.c at 3 us: its allocation
#      bursts (a take-over's should show one cudaGraphInstantiate, d118's showed two).
#   3. d98's take-over run, d118's kvrecalld (old, as kvrecalld_7a92e31: that commit's server but
#      for Zeroed's refactor) and this one, once each.
# Bundle: .device/b119 (the shim in its ship). Carry .device/b119/ship and
# client/python/kvrecall/_gen. Everything but the summary comes back in d119_out.tgz.
# (Its run under the shim was inline when it ran; bench/device_call.sh's takeover_calls since,
# the same commands.)
set -u
. bench/device_call.sh
device_call_begin 119
R=$L/out
mkdir -p $R
bash bench/device_test_suite.sh $B $L $S
takeover_calls $PWD/.device/b119/ship/libkvrecall_cuda_api_timer.so
takeover_run old $B/kvrecalld_7a92e31
takeover_run new $B/kvrecalld
mv $OUT/*.json $R/ 2>/dev/null
tar -C $L -czf $OUT/d119_out.tgz out
device_call_end
