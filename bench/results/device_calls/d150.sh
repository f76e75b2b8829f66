#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for device_tests.md and tiered_serving.md.
# Hundred-and-fiftieth call, at de4eb60 (this session's last code: the step as 3dfbd1a's): (1)
# issue 15's rows at 128K and 512K, 100 steps, on the fresh machine; (2) the whole suite; (3) the
# transformers backend end to end. Bundle .device/b150; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 150
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d150
device_call_end
