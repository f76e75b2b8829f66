#!/usr/bin/env bash
# Written 2026-12-06 (twenty-first session) for device_tests.md and tiered_serving.md.
# Hundred-and-sixty-first call, at 934bfc1 (the twenty-first session's last code: probe 23's
# mend of selector growth past the budgets, max_tokens setting that growth aside; probe 24's
# percentiles): (1) the whole suite; (2) issue 15's rows at 128K and 512K, 100 steps; (3) the
# transformers backend end to end. Bundle .device/b161; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 161
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d161
device_call_end
