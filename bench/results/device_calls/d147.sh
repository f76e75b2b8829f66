#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for tiered_serving.md ("One slow head a step").
# Hundred-and-forty-seventh call, bundle .device/b147 (3dfbd1a's kvrecalld; gpu_serving_bench
# recording every timed step's host heads and all its phases for the slowest steps). After
# d146 the 128K rows still have 0-4 of 100 steps over twice the p50: where do they go? The rows
# at 128K, 200 steps, twice in one kvrecalld; the slowest steps' phases and slowest heads.
set -u
. bench/device_call.sh
device_call_begin 147
start_kvrecalld "$B/kvrecalld" "$L/kvrecalld.log" --address=127.0.0.1:0 || exit 1
for round in 1 2; do
  timeout 200 "$B/gpu_serving_bench" --server="$kvrecalld_address" --out="$L/r$round.json" \
    --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau \
    --steps=200 --warmup=8 > /dev/null 2> "$L/r$round.log"
  echo "round $round rc $? t=$SECONDS" | tee -a "$S"
  serving_summary "$L/r$round.json"
  python3 - "$L/r$round.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    s = sorted(r["server_us_by_step"])
    p50 = s[len(s) // 2]
    print(" ", r["selector"], "p50", round(p50), "p90", round(s[int(0.9 * len(s))]), "p99",
          round(s[int(0.99 * len(s))]), "max", round(s[-1]), "over 2x p50:",
          sum(x > 2 * p50 for x in s))
    for st in r["slowest_steps"]:
        heads = st.pop("heads")
        slow = sorted(heads, key=lambda h: -h[2])[:2]
        print("   ", {k: round(v) for k, v in st.items()}, "heads", len(heads),
              "slowest [path, start, us, keys]", [[round(x) for x in h] for h in slow])
PY
done
kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null
cp "$L"/r1.json "$L"/r2.json "$R/"
tar -C "$R" -czf "$OUT/d147_rows.tgz" .
device_call_end
