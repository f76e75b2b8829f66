#!/usr/bin/env bash
# Written 2026-12-06 (seventeenth session) for device_tests.md. Hundred-and-forty-first call, at
# f624560 + its test (review 17's mends: a Prefill whose OK never reached its client taken back,
# Prefill streams counting themselves, f16 on a GPU refusing softmax scales past ln 2, a refused
# move target falling back to the pages alone): (1) the whole suite; (2) the transformers
# backend end to end (its Prefills commit through the changed path). Bundle .device/b141;
# carry its ship/, client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 141
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d141
device_call_end
