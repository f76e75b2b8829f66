#!/usr/bin/env bash
# Written 2026-12-06 (twentieth session) for device_tests.md and tiered_serving.md.
# Hundred-and-fifty-fifth call, at 7c40cb0 (the nineteenth session's last code): (1) the whole
# suite, which holds GpuBudgetTest.ARequestTheGpuRefusesInItsStepAppendsNoToken (written in the
# nineteenth session and never run on a device: d154 was not run); (2) issue 15's rows at 128K
# and 512K, 100 steps; (3) the transformers backend end to end. Bundle .device/b155; carry its
# ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 155
bash bench/device_test_suite.sh $B $L $S
"$B/gpu_placement_test" --gtest_filter='*RefusesInItsStep*' > "$L/refusal.log" 2>&1
echo "refusal test rc $?" | tee -a "$S"
grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|Failure" -A2 "$L/refusal.log" | head -20 | tee -a "$S"
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d155
device_call_end
