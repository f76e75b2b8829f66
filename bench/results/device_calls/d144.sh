#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for device_tests.md and tiered_serving.md.
# Hundred-and-forty-fourth call, at 1432dbd: f16 on a GPU at softmax scales past ln 2 (the score
# factor applied after the MMA: the CUDA kernel suites' new f16 geometries, the gpu and tiered
# placements' f16 scale-1 sessions), review 17c's take-back mends, and e7dbc50's StreamCall (not
# run on a device before). (1) issue 15's headline rows at 128K on the fresh machine; (2) the
# whole suite; (3) the transformers backend end to end. Bundle .device/b144; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 144
tiered_rows $B/kvrecalld 131072
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d144
device_call_end
