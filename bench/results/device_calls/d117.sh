#!/usr/bin/env bash
# Run 2026-12-05 (twelfth session): tiered_serving.md ("The step at a take-over").
# Hundred-and-seventeenth call: where a batch-1 take-over's `plan` (270-420 us, against ~10 in
# other steps) and `launch` (175-305 us, against ~20) go since eager module loading and the new
# PqEncode (d114-d116). bench/cuda_api_timer.c now also times launches (__cudaLaunchKernel),
# kernel attributes, events, async copies and cudaSetDevice, at a 3 us threshold, so that the
# take-over step's calls show one by one, and the gaps between them (host code) too.
# d98's take-over run at batch 1, index then retopk, on 34256b1's kvrecalld. Prints the three
# 3 ms windows of the stepping threads with the most time in calls: each call of 3 us or more
# and each gap of 20 us or more between them. Carry: .device/b117/ship.
set -u
. bench/device_call.sh
device_call_begin 117
timed_kvrecalld $PWD/.device/b117/ship/libkvrecall_cuda_api_timer.so $L/api_calls_3us.txt 3
start_kvrecalld $L/kvrecalld_timed $L/kvrecalld_3us.log --address=127.0.0.1:0 || exit 1
timeout 240 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/takeover_3us.json \
  --placement=tiered --contexts=640 --batches=1 --selectors=index,retopk --auto_tau \
  --steps=700 --warmup=900 > /dev/null 2> $L/takeover_3us.log
echo "take-over rc $? t=$SECONDS" | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
python3 - $L/takeover_3us.json <<'PY' 2>&1 | tee -a $S
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print(r["selector"], r["batch"], "p50", round(r["server_p50_us"]))
    for s in r.get("slowest_steps", [])[:3]:
        print("  bulk", 900 + s["step"], {k: round(v) for k, v in s.items() if k != "step"})
PY
python3 - $L/api_calls_3us.txt <<'PY' 2>&1 | tee -a $S
import collections, sys
rows = []
for l in open(sys.argv[1]):
    if l.startswith("#"):
        continue
    p = l.rstrip("\n").split(None, 3)
    rows.append((int(p[0]), int(p[1]), p[2], p[3] if len(p) > 3 else "?"))
steps = sorted(r for r in rows if r[3] not in ("kvrecall-codes", "kvrecall-build"))
print(len(rows), "calls timed;", len(steps), "on the stepping threads")
# Windows of 3 ms by the calls' time in them; the three heaviest apart by 50 ms.
j, total, windows = 0, 0, []
for i, r in enumerate(steps):
    while j < len(steps) and steps[j][0] < r[0] + 3000:
        total += steps[j][1]; j += 1
    windows.append((total, i, j))
    total -= r[1]
taken = []
for total, i, j in sorted(windows, reverse=True):
    if any(abs(steps[i][0] - steps[a][0]) < 50000 for _, a, _ in taken):
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
          ", ".join("%s %d/%dus" % (k, v[0], v[1])
                    for k, v in sorted(by.items(), key=lambda x: -x[1][1])))
    end = calls[0][0]
    for c in calls:
        if c[0] - end >= 20:
            print("   %.4f gap %d us" % (end / 1e6, c[0] - end))
        print("   %.4f %5d %s %s" % (c[0] / 1e6, c[1], c[2], c[3]))
        end = max(end, c[0] + c[1])
PY
grep "^#" $L/api_calls_3us.txt | tee -a $S
xz -T4 -c $L/api_calls_3us.txt > $OUT/api_calls_3us_d117.txt.xz
cp $L/takeover_3us.json $OUT/
device_call_end
