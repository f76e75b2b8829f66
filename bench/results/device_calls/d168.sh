#!/usr/bin/env bash
# Written 2026-12-07 (twenty-fifth session) for device_tests.md. Hundred-and-sixty-eighth call,
# at the session's code (review 27's server changes, the metrics token, the CLI's prefill and
# decode, review 28's mends, dead code out). (1) The whole suite; (2) issue 15's rows at
# 128K and 512K, 100 steps; (3) the transformers backend end to end.
# Bundle .device/b168; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 168
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d168
device_call_end
