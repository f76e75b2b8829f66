#!/usr/bin/env bash
# Run 2026-12-05 on an H100 machine (results: tiered_serving.md, "The step at a take-over").
# Hundred-and-seventh call: d106 again (a take-over timed by bench/cuda_api_timer.c), the shim's
# threshold at 20 us, index alone, so that the take-over step's many short calls show: d106 saw
# only one call over 100 us in a batch-1 take-over step of ~4 ms (a ~960 us cudaMemcpy) and one
# in a batch-8 step whose reservations took 7.8 ms (a 2.3 ms cudaHostAlloc). Prints the three
# 10 ms windows whose calls on the stepping threads (all but the learning's) take longest,
# by function. Carry: .device/b106/ship.
set -u
. bench/device_call.sh
device_call_begin 106  # d106's bundle and shim
N=107
S=$OUT/d107_summary.txt
cat > $L/kvrecalld_timed <<SH
#!/bin/sh
export LD_PRELOAD=$PWD/.device/b106/ship/libkvrecall_cuda_api_timer.so
export KVRECALL_API_TIMER_OUT=$L/api_calls_20us.txt
export KVRECALL_API_TIMER_US=20
exec $B/kvrecalld "\$@"
SH
chmod +x $L/kvrecalld_timed
start_kvrecalld $L/kvrecalld_timed $L/kvrecalld_20us.log --address=127.0.0.1:0 || exit 1
timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/takeover_20us.json \
  --placement=tiered --contexts=640 --batches=1,8 --selectors=index --auto_tau \
  --steps=700 --warmup=900 > /dev/null 2> $L/takeover_20us.log
echo "take-over rc $? t=$SECONDS" | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
serving_summary $L/takeover_20us.json
python3 - $L/takeover_20us.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    for s in r.get("slowest_steps", [])[:2]:
        print(r["selector"], r["batch"], "bulk", 900 + s["step"],
              {k: round(v) for k, v in s.items() if k != "step"})
PY
python3 - $L/api_calls_20us.txt <<'PY' 2>&1 | tee -a $S
import collections, sys
rows = []
for l in open(sys.argv[1]):
    if l.startswith("#"):
        continue
    p = l.rstrip("\n").split(None, 3)
    rows.append((int(p[0]), int(p[1]), p[2], p[3] if len(p) > 3 else "?"))
steps = sorted(r for r in rows if r[3] != "kvrecall-codes" and r[3] != "kvrecall-build")
print(len(rows), "calls over 20 us;", len(steps), "on the stepping threads")
# Each call's window [t, t + 10 ms): the time its calls took; the three heaviest, apart.
j, total, windows = 0, 0, []
for i, r in enumerate(steps):
    while j < len(steps) and steps[j][0] < r[0] + 10000:
        total += steps[j][1]; j += 1
    windows.append((total, i, j))
    total -= r[1]
taken = []
for total, i, j in sorted(windows, reverse=True):
    if any(abs(steps[i][0] - steps[a][0]) < 20000 for _, a, _ in taken):
        continue
    taken.append((total, i, j))
    if len(taken) == 3:
        break
for total, i, j in taken:
    calls = steps[i:j]
    by = collections.defaultdict(lambda: [0, 0])
    for c in calls:
        by[c[2].split(":")[0]][0] += 1; by[c[2].split(":")[0]][1] += c[1]
    print("window at %.4f s: %d us in %d calls;" % (steps[i][0] / 1e6, total, len(calls)),
          ", ".join("%s %d/%dus" % (k, v[0], v[1]) for k, v in sorted(by.items(), key=lambda x: -x[1][1])))
    for c in calls:
        if c[1] >= 50:
            print("   %.4f %5d %s %s" % (c[0] / 1e6, c[1], c[2], c[3]))
PY
grep "^#" $L/api_calls_20us.txt | tee -a $S
cp $L/takeover_20us.json $L/api_calls_20us.txt $OUT/
device_call_end
