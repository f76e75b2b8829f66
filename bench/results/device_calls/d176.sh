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
set -u
. bench/device_call.sh
device_call_begin 176
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
load --sessions=18 --prompt=8192 --tokens=400 --baseline_tokens=100
load --sessions=18 --prompt=640 --tokens=1800 --baseline_tokens=100
kill "$kvrecalld_pid"
wait "$kvrecalld_pid"
echo "kvrecalld rc $? t=$SECONDS" | tee -a "$S"
grep -v "^kvrecalld listening\|^kvrecalld metrics" "$L/kvrecalld.log" | tail -20 | tee -a "$S"
tar -C "$R" -czf "$OUT/d176_raw.tgz" . 2>/dev/null
device_call_end
