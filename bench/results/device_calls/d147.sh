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
  rows_run "r$round" 131072 200 slowest
done
kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null
cp "$L"/r1.json "$L"/r2.json "$R/"
tar -C "$R" -czf "$OUT/d147_rows.tgz" .
device_call_end
