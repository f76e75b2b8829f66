#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for tiered_serving.md ("One slow head a step").
# Hundred-and-forty-eighth call, bundle .device/b147 (3dfbd1a's kvrecalld; gpu_serving_bench
# recording every timed step's host heads and all its phases for the slowest steps). After
# d146 the 128K rows still have 0-4 of 100 steps over twice the p50: where do they go? The rows
# at 128K, 200 steps, twice in one kvrecalld; the slowest steps' phases and slowest heads.
# d148 repeats d147 (where one thread at a time stalled 2-3 ms, in a host head or in the
# decisions) with the machine's steal time (vmstat's st: the hypervisor running something
# else on this VM's cores) recorded every second.
set -u
. bench/device_call.sh
device_call_begin 147
N=148 L=/tmp/d148 S=$OUT/d148_summary.txt
R=$L/out
mkdir -p "$R"
# The hypervisor's steal time and the host's interrupts, every second, beside the rows.
vmstat -w 1 > "$L/vmstat.log" 2>&1 &
vmstat_pid=$!
awk '/^(cpu|ctxt|intr) / {print $1, $2, $3, $4, $5, $6, $7, $8, $9, $10}' /proc/stat \
  > "$L/stat_before.txt"
start_kvrecalld "$B/kvrecalld" "$L/kvrecalld.log" --address=127.0.0.1:0 || exit 1
for round in 1 2; do
  rows_run "r$round" 131072 200 slowest
done
kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null
cp "$L"/r1.json "$L"/r2.json "$R/"
tar -C "$R" -czf "$OUT/d148_rows.tgz" .
kill "$vmstat_pid"
awk '/^(cpu|ctxt|intr) / {print $1, $2, $3, $4, $5, $6, $7, $8, $9, $10}' /proc/stat \
  > "$L/stat_after.txt"
cat "$L/stat_before.txt" "$L/stat_after.txt" | tee -a "$S"
cut -c1-200 "$L/vmstat.log" | tee -a "$S"
cp "$L/vmstat.log" "$OUT/d148_vmstat.log"
device_call_end
