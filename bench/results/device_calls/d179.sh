#!/usr/bin/env bash
# Written 2026-12-07 (thirtieth session). Hundred-and-seventy-ninth call: d176's load test again,
# its two rounds (8192-token prompts with 400 decoded, then 640 with 1800) repeated up to four
# times on one kvrecalld, to tell whether what the process kept after d176's two rounds (146 MiB
# of RSS, 36 MiB of device memory, the sessions' gauges at 0) levels off or grows round after
# round. Bundle .device/b179: a copy of .device/b176's ship/ (f7bd2b8: kvrecalld, load_test).
# Not run in the thirtieth session (five tries got no machine); run 2026-12-08 on an H100 by
# d181.sh, after its tests: hardening.md, "Load test" (d176's section).
set -u
. bench/device_call.sh
device_call_begin 179
load_test_server || exit 1
load_test_state start
for pair in 1 2 3 4; do
  [ $SECONDS -lt 180 ] || { echo "t=$SECONDS: no time for pair $pair" | tee -a "$S"; break; }
  load_test_round --sessions=18 --prompt=8192 --tokens=400 --baseline_tokens=100
  load_test_round --sessions=18 --prompt=640 --tokens=1800 --baseline_tokens=100
done
load_test_server_stop
tar -C "$R" -czf "$OUT/d179_raw.tgz" . 2>/dev/null
device_call_end
