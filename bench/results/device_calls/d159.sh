#!/usr/bin/env bash
# Written 2026-12-06 (twenty-first session) for device_tests.md and tiered_serving.md.
# Hundred-and-fifty-ninth call, at 1744dfd (the twenty-first session's code: probe 22's mends of
# tiered ReTopK's graph build and refresh count, the memory budgets per tenant with their GPU
# test): (1) the whole suite; (2) issue 15's rows at 128K and 512K, 100 steps; (3) the
# transformers backend end to end. Bundle .device/b159; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 159
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d159
device_call_end
