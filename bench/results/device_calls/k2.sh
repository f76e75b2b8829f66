#!/usr/bin/env bash
# k2: the reworked shortlist after k1 (the parity test's tie check fixed; the histograms zeroed
# by the scan's last block as it reads them): the parity test, memcheck and racecheck; then,
# for where the rest of its time goes, timing-only variants built from the same source
# (/tmp copies, not committed): f16 tables (scan lookups of 8 bytes, f32 sums), the scan
# without its histogram atomics, the collect without its last block's selection, and a
# diagnostic build printing each row's threshold-bin candidates and the phases' clocks.
set -u
D=.device/k2
tar -C $D -xJf $D/ship/bundle.tar.xz
B=$PWD/$D/bundle/bin
export LD_LIBRARY_PATH=$PWD/$D/bundle/lib
L=/tmp/k2; mkdir -p $L
S=$OUT/k2_summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $S

timeout 150 $B/cuda_pq_shortlist_test > $L/test.log 2>&1
echo "cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "^\[  PASSED|^\[  FAILED|Failure|SKIPPED|^Expected|Which is|row [0-9]" $L/test.log \
  | head -30 | tee -a $S
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_pq_shortlist_test \
  > $L/memcheck.log 2>&1
echo "memcheck cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|^\[  PASSED|^\[  FAILED" $L/memcheck.log | tail -4 | tee -a $S
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 $B/cuda_pq_shortlist_test \
  --gtest_filter='*M8Group4:*M16Group2:*Bins*' > $L/racecheck.log 2>&1
echo "racecheck cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "RACECHECK SUMMARY|^\[  PASSED|^\[  FAILED" $L/racecheck.log | tail -3 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S

bench() {  # VARIANT RUN
  local bin=$B/pq_shortlist_bench
  [ $1 = new ] || bin=$B/pq_shortlist_bench_$1
  timeout 120 $bin --context=131072 --shortlists=1024 --graph=false --steps=16 --warmup=3 \
    --kernel_repeats=20 > $L/pq_$1_$2.json 2> $L/pq_$1_$2.log
  echo "bench $1 $2 rc $?" | tee -a $S
  python3 - $L/pq_$1_$2.json $1 <<'EOF' 2>&1 | tee -a $S
import json, sys
v = json.load(open(sys.argv[1]))["variants"]["pq1024"]
r = lambda k, q="p50": round(v[k][q], 1)
print(sys.argv[2], "kernels p50", r("gpu_kernels_us"), "repeat p50", r("gpu_kernels_repeat_us"),
      "p90", r("gpu_kernels_repeat_us", "p90"), "gpu_part p50", r("gpu_us"),
      "select_alone p50", r("gpu_select_alone_us"), "recall", round(v["recall_at_k"]["mean"], 5),
      "mass", round(v["mass_of_exact_topk"]["mean"], 5), "ids_fnv", v["ids_fnv"])
EOF
}
for i in 1 2; do
  for v in base new f16; do
    [ $SECONDS -lt 200 ] || { echo "t=$SECONDS skip bench $v $i" | tee -a $S; continue; }
    bench $v $i
  done
done
echo "t=$SECONDS benches done" | tee -a $S

ncu_times() {  # VARIANT REGEX SKIP COUNT
  local bin=$B/pq_shortlist_bench
  [ $1 = new ] || bin=$B/pq_shortlist_bench_$1
  timeout 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:"$2" \
    --launch-skip $3 --launch-count $4 $bin --context=131072 --shortlists=1024 --graph=false \
    --steps=8 --warmup=2 > $L/ncu_$1.csv 2> $L/ncu_$1.err
  echo "ncu $1 rc $?" | tee -a $S
  python3 - $L/ncu_$1.csv $1 <<'EOF' 2>&1 | tee -a $S
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[0] != "ID"]
for r in rows:
    print(sys.argv[2], r[4].split("(")[0][:60], r[8], r[14], r[13])
EOF
}
if which ncu > /dev/null; then
  ncu_times new 'Pq' 6 12
  for v in f16 noatom notail; do
    [ $SECONDS -lt 300 ] && ncu_times $v 'Pq' 6 9
  done
fi
echo "t=$SECONDS ncu done" | tee -a $S

timeout 60 $B/pq_shortlist_bench_diag --context=131072 --shortlists=1024 --graph=false \
  --steps=6 --warmup=2 > $L/diag.out 2> $L/diag.log
echo "diag rc $?" | tee -a $S
python3 - $L/diag.out <<'EOF' 2>&1 | tee -a $S
import re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
col = [l.split() for l in lines if l.startswith("DIAG collect")]
def med(xs): return (round(statistics.median(xs)), min(xs), max(xs)) if xs else None
get = lambda rows, key, f=int: [f(r[r.index(key) + 1]) for r in rows]
print("collect rows", len(col), "count (med,min,max)", med(get(col, "count")),
      "need", med(get(col, "need")), "above", med(get(col, "above")))
print("collect entry_to_last_ns", med(get(col, "entry_to_last_ns")),
      "block_cycles_to_last", med(get(col, "block_cycles_to_last")),
      "tail_cycles", med(get(col, "tail_cycles")))
big = sorted(get(col, "count"))[-8:]
print("largest counts", big)
sc = [l.split() for l in lines if l.startswith("DIAG scan x")]
print("scan block phases (cycles) prologue", med(get(sc, "prologue")), "scoring",
      med(get(sc, "scoring")), "flush", med(get(sc, "flush")))
sl = [l.split() for l in lines if l.startswith("DIAG scan last")]
print("scan last block thresholds cycles", med(get(sl, "thresholds")))
EOF
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/k2_logs.tgz *.log *.json *.csv *.err *.out 2>/dev/null
