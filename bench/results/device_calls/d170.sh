#!/usr/bin/env bash
# Written 2026-12-07 (twenty-sixth session) for device_tests.md. Hundred-and-seventieth call,
# at 19440cd (the metrics endpoint's HTTPS, and review 27's server changes and the twenty-fifth
# session's: the metrics token, the CLI's prefill and decode, dead code out; none had run on a
# GPU: d167-d169 got no machine).
# (1) The whole suite; (2) issue 15's rows at 128K and 512K, 100 steps; (3) the transformers
# backend end to end.
# Bundle .device/b170; carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 170
bash bench/device_test_suite.sh $B $L $S
rows_steps=100 tiered_rows "$B/kvrecalld" 131072 524288
hf_demo_check hf_demo_d170
device_call_end
