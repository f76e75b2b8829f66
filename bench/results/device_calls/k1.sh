#!/usr/bin/env bash
# k1: the PQ shortlist's kernels reworked (tables per (codebook, rows) block, the scan's tables
# interleaved per centroid, a collect pass of the shortlist's own) against the kernels of HEAD
# (6336982), both linked into the same pq_shortlist_bench: the parity test, then the 128K
# shortlist timed base / new alternately in process and per kernel under Nsight Compute, then
# the parity test under compute-sanitizer (memcheck; racecheck on a few cases if time is left).
set -u
D=.device/k1
tar -C $D -xJf $D/ship/bundle.tar.xz
B=$PWD/$D/bundle/bin
export LD_LIBRARY_PATH=$PWD/$D/bundle/lib
L=/tmp/k1; mkdir -p $L
S=$OUT/k1_summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $S

timeout 150 $B/cuda_pq_shortlist_test > $L/test.log 2>&1
echo "cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "^\[  PASSED|^\[  FAILED|Failure|SKIPPED|^Expected|Which is|row [0-9]" $L/test.log \
  | head -40 | tee -a $S
echo "t=$SECONDS test done" | tee -a $S

bench() {  # VARIANT RUN
  local bin=$B/pq_shortlist_bench
  [ $1 = base ] && bin=$B/pq_shortlist_bench_base
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
  for v in base new; do
    [ $SECONDS -lt 200 ] || { echo "t=$SECONDS skip bench $v $i" | tee -a $S; continue; }
    bench $v $i
  done
done
echo "t=$SECONDS benches done" | tee -a $S

# Per-kernel device times: base launches per step Pq{Table,Scan}Kernel and RowCollectKernel
# twice (the shortlist's, then the bench's select-alone); new: Pq{Table,Scan,Collect}Kernel.
ncu_times() {  # VARIANT REGEX SKIP COUNT
  local bin=$B/pq_shortlist_bench
  [ $1 = base ] && bin=$B/pq_shortlist_bench_base
  timeout 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:"$2" \
    --launch-skip $3 --launch-count $4 $bin --context=131072 --shortlists=1024 --graph=false \
    --steps=8 --warmup=2 > $L/ncu_$1.csv 2> $L/ncu_$1.err
  echo "ncu $1 rc $?" | tee -a $S
  python3 - $L/ncu_$1.csv $1 <<'EOF' 2>&1 | tee -a $S
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
name, grid, unit, value = (head.index(c) for c in ("Kernel Name", "Grid Size", "Metric Unit",
                                                    "Metric Value"))
for r in rows[1:]:
    print(sys.argv[2], r[name].split("(")[0][:60], r[grid], r[value], r[unit])
EOF
}
if which ncu > /dev/null && [ $SECONDS -lt 260 ]; then
  ncu_times base 'Pq|RowCollect' 8 16
  ncu_times new 'Pq' 6 12
fi
echo "t=$SECONDS ncu done" | tee -a $S

timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_pq_shortlist_test \
  > $L/memcheck.log 2>&1
echo "memcheck cuda_pq_shortlist_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|^\[  PASSED|^\[  FAILED" $L/memcheck.log | head -5 | tee -a $S
if [ $SECONDS -lt 330 ]; then
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 $B/cuda_pq_shortlist_test \
    --gtest_filter='*M8Group4:*M16Group2:*Bins*' \
    > $L/racecheck.log 2>&1
  echo "racecheck cuda_pq_shortlist_test rc $?" | tee -a $S
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|^\[  PASSED|^\[  FAILED" $L/racecheck.log | head -5 \
    | tee -a $S
fi
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/k1_logs.tgz *.log *.json *.csv *.err 2>/dev/null
