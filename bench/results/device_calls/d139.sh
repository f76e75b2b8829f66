#!/usr/bin/env bash
# Written 2026-12-06 (seventeenth session) for device_tests.md and tiered_serving.md.
# Hundred-and-thirty-ninth call, at 70121ee (the sixteenth session's last code; its suite last ran
# whole at b136 = 84edc63, and d138 ran only seven binaries at f00b451): (1) issue 15's headline
# rows (tiered retopk and index, batch 1, K = 512, auto_tau, 60 steps) at 128K and 512K on the
# fresh machine, before anything else; (2) the whole suite; (3) the transformers backend end to
# end (tiered bytes = cpu bytes = SDPA's). Bundle .device/b139; carry its ship/,
# client/python/kvrecall/_gen and .device/model.
set -u
. bench/device_call.sh
device_call_begin 139
tiered_rows $B/kvrecalld 131072 524288
bash bench/device_test_suite.sh $B $L $S
hf_demo_check hf_demo_d139
device_call_end
