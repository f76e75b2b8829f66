#!/usr/bin/env bash
# Written 2026-12-07 (twenty-ninth session). Hundred-and-seventy-sixth call: the load test
# (bench/load_test.cc, which the hardening's CPU figures come from) on the GPU placements for
# the first time, against one kvrecalld with the device: every session of the gpu and tiered
# placements with each selector they serve, each on its own Decode stream, all decoding at once.
# Two rounds on the same kvrecalld: long prompts (8192 tokens, 400 decoded), then short ones (640
# tokens, 1800 decoded; load_test's static set is 16 sinks and a ring of 256, so each tiered
# layer's codes, learned from its 368-row prompt bulk, are learned again at bulk 1024 and take
# over at 1536, under the load). Errors must be 0; after each round every session is closed and
# the server's sessions' GPU and host bytes (kvrecall_gpu_memory_bytes, kvrecall_host_memory_bytes)
# are recorded (0 expected), and so is the process's device memory (nvidia-smi), before and after.
# Bundle .device/b176 (f7bd2b8: kvrecalld, load_test); carry its ship/.
# Run 2026-12-07 21:48 UTC (thirtieth session, after eight tries that got no machine) on an H100,
# with d178 after it in the same call: hardening.md, "Load test", "On the GPU placements".
# (Its rounds' helpers moved into bench/device_call.sh since, for d179, the commands unchanged.)
set -u
. bench/device_call.sh
device_call_begin 176
load_test_server || exit 1
load_test_state start
load_test_round --sessions=18 --prompt=8192 --tokens=400 --baseline_tokens=100
load_test_round --sessions=18 --prompt=640 --tokens=1800 --baseline_tokens=100
load_test_server_stop
tar -C "$R" -czf "$OUT/d176_raw.tgz" . 2>/dev/null
device_call_end
