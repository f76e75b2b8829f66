#!/usr/bin/env bash
# Written 2026-12-07 (thirtieth session). Hundred-and-seventy-ninth call: d176's load test again,
# its two rounds (8192-token prompts with 400 decoded, then 640 with 1800) repeated up to four
# times on one kvrecalld, to tell whether what the process kept after d176's two rounds (146 MiB
# of RSS, 36 MiB of device memory, the sessions' gauges at 0) levels off or grows round after
# round. Bundle .device/b179: a copy of .device/b176's ship/ (f7bd2b8: kvrecalld, load_test).
# Not run yet: five tries from 21:53 to 22:25 UTC got no machine.
set -u
. bench/device_call.sh
device_call_begin 179
start_kvrecalld "$B/kvrecalld" "$L/kvrecalld.log" --address=127.0.0.1:0 || exit 1
metrics_url=$(sed -n 's/^kvrecalld metrics on //p' "$L/kvrecalld.log")
state() {  # PHASE: the sessions' memory by the server's gauges and the process's device memory
  python3 - "$metrics_url" "$1" <<'PY' 2>&1 | tee -a "$S"
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
keep = ("kvrecall_sessions_open", "kvrecall_gpu_memory_bytes", "kvrecall_host_memory_bytes",
        "kvrecall_tokens_held", "kvrecall_codes_learnings_total")
print(sys.argv[2], " ".join(l for l in text.splitlines()
                            if l.startswith(keep) and not l.startswith("#")))
PY
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$S"
  grep -E "VmRSS" "/proc/$kvrecalld_pid/status" | tee -a "$S"
}
state start
round=0
load() {  # FLAG...
  round=$((round + 1))
  timeout 150 "$B/load_test" --server="$kvrecalld_address" --server_pid="$kvrecalld_pid" \
    --json="$R/load_$round.json" --placements=gpu,tiered --q_heads=32 --kv_heads=8 \
    --head_dim=128 --top_k=512 --layers=2 "$@" 2>&1 | tee -a "$S"
  echo "round $round rc ${PIPESTATUS[0]} t=$SECONDS" | tee -a "$S"
  state "after round $round"
}
for pair in 1 2 3 4; do
  [ $SECONDS -lt 180 ] || { echo "t=$SECONDS: no time for pair $pair" | tee -a "$S"; break; }
  load --sessions=18 --prompt=8192 --tokens=400 --baseline_tokens=100
  load --sessions=18 --prompt=640 --tokens=1800 --baseline_tokens=100
done
kill "$kvrecalld_pid"
wait "$kvrecalld_pid"
echo "kvrecalld rc $? t=$SECONDS" | tee -a "$S"
grep -v "^kvrecalld listening\|^kvrecalld metrics" "$L/kvrecalld.log" | tail -20 | tee -a "$S"
tar -C "$R" -czf "$OUT/d179_raw.tgz" . 2>/dev/null
device_call_end
