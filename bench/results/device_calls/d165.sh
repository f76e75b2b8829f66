#!/usr/bin/env bash
# Written 2026-12-07 (twenty-fourth session) for device_tests.md. Hundred-and-sixty-fifth call,
# at the session's code (the clients' deadlines and cancellation; the server leaves a step whose
# call was cancelled before it began unapplied). (1) The whole suite; (2) issue 15's rows at
# 128K and 512K, 100 steps; (3) the transformers backend end to end.
# Bundle .device/b165; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 165
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d165
device_call_end
