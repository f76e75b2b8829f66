#!/usr/bin/env bash
# Written 2026-12-08 (thirty-first session). Hundred-and-eighty-first call: d180's one failure
# mended (GpuHostBudgetTest sent its next step on the stream its refused step had ended) and
# what it showed (K = 2^20 was admitted by the gpu placement, then failed its first step with
# INTERNAL: a row's selection holds 8 bytes a position in shared memory) refused at
# CreateSession, as a longer shortlist than a GPU holds is in the tiered placement: the GPU
# binaries those touch, four at a time; then d179's load test rounds (its own bundle, b179).
# Bundles .device/b181 (gpu_placement_test, tiered_shortlist_test, the cuda_* tests of the
# selections, kvrecalld) and .device/b179; carry both ships.
# Run 2026-12-08 00:47 UTC on an H100: device_tests.md, d180-d181; hardening.md (d179).
set -u
. bench/device_call.sh
device_call_begin 181
test_binaries
device_call_end
[ $SECONDS -lt 200 ] && bash bench/results/device_calls/d179.sh > "$OUT/d179_console.txt" 2>&1
tail -30 "$OUT/d179_console.txt" 2>/dev/null
