#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for device_tests.md. Hundred-and-forty-ninth call, at
# 9173819 (this session's last code: the tiered exact head's table sized to its ids, review 18's
# mends, f16 kernel tests with queries at 65504): the whole suite, and the transformers backend
# end to end. Bundle .device/b149; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 149
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d149
device_call_end
