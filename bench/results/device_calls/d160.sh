#!/usr/bin/env bash
# Written 2026-12-06 (twenty-first session) for device_tests.md. Hundred-and-sixtieth call, at
# 27db339: tiered_placement_test alone, after d159 found probe 22's two new tests refused
# on a GPU tier (head_dim 32; now 64). Bundle .device/b160 (that binary alone); carry its ship/.
set -u
. bench/device_call.sh
device_call_begin 160
"$B/tiered_placement_test" > "$L/tiered_placement_test.log" 2>&1
echo "tiered_placement_test rc $?" | tee -a "$S"
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$L/tiered_placement_test.log" | tee -a "$S"
device_call_end
