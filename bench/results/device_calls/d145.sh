#!/usr/bin/env bash
# Written 2026-12-06 (eighteenth session) for tiered_serving.md ("One slow head a step").
# Hundred-and-forty-fifth call, bundle .device/b144 (1432dbd). At 512K 4-8 of 60 tiered steps
# took ~2 ms where the p50 is ~400 us (d139, d140): in each, one host head of the ~16 took
# 1.5-2.2 ms and the others ~0.2 ms, with the same candidates. The hypothesis: a pool thread
# preempted mid-head (the pool has a thread per core: 15 workers and the caller, beside gRPC's,
# CUDA's and the bench client's threads). The rows at 128K and 512K (100 steps), kvrecalld's
# pool at 16 threads (the default), 14 and 12 (OMP_NUM_THREADS), twice in turn; each run's
# involuntary context switches of kvrecalld's threads by name.
set -u
. bench/device_call.sh
device_call_begin 144
N=145 L=/tmp/d145 S=$OUT/d145_summary.txt
R=$L/out
mkdir -p "$R"
switches() {  # PID: involuntary context switches per thread name, summed
  for t in /proc/$1/task/*; do
    echo "$(cat $t/comm) $(awk '/^nonvoluntary_ctxt_switches/ {print $2}' $t/status)"
  done | awk '{s[$1] += $2} END {for (k in s) printf "%s=%d ", k, s[k]; print ""}'
}
for round in 1 2; do
  for threads in 16 14 12; do
    name=r${round}_t$threads
    OMP_NUM_THREADS=$threads start_kvrecalld "$B/kvrecalld" "$L/kvrecalld_$name.log" \
      --address=127.0.0.1:0 || continue
    for context in 131072 524288; do
      before=$(switches $kvrecalld_pid)
      rows_run "${name}_$context" "$context" 100
      echo "  switches before: $before" | tee -a "$S"
      echo "  switches after:  $(switches $kvrecalld_pid)" | tee -a "$S"
      cp "$L/${name}_$context.json" "$R/"
    done
    kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null
  done
done
tar -C "$R" -czf "$OUT/d145_rows.tgz" .
device_call_end
