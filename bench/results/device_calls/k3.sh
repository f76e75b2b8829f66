#!/usr/bin/env bash
# k3: the reworked shortlist (A: k1's kernels; the hist zeroing of k2 moved back to the collect)
# and three candidates built from it (/tmp copies linked in place of the library's
# pq_shortlist.cu.o): B, the collect pass staging its positions in shared memory and appending
# them with one global reservation per block and list; C, the scan planned at most one block per
# multiprocessor; D, both. Each: the parity test (with the long-part case added after k2),
# memcheck, racecheck on a few cases; then all against HEAD's kernels (base), in process and per
# kernel under Nsight Compute.
set -u
D=.device/k3
tar -C $D -xJf $D/ship/bundle.tar.xz
B=$PWD/$D/bundle/bin
export LD_LIBRARY_PATH=$PWD/$D/bundle/lib
L=/tmp/k3; mkdir -p $L
S=$OUT/k3_summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $S
suffix() { [ $1 = A ] && echo "" || echo "_$1"; }

for v in A B C D; do
  t=$B/cuda_pq_shortlist_test$(suffix $v)
  timeout 150 $t > $L/test_$v.log 2>&1
  echo "test $v rc $?" | tee -a $S
  grep -E "^\[  PASSED|^\[  FAILED|Failure|^Expected|Which is|row [0-9]" $L/test_$v.log \
    | head -12 | tee -a $S
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $t > $L/memcheck_$v.log 2>&1
  echo "memcheck $v rc $?" | tee -a $S
  grep -E "ERROR SUMMARY|^\[  PASSED|^\[  FAILED" $L/memcheck_$v.log | tail -3 | tee -a $S
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 $t \
    --gtest_filter='*M8Group4:*M16Group2:*Bins*:*Group4FewValuesWithScores' \
    > $L/racecheck_$v.log 2>&1
  echo "racecheck $v rc $?" | tee -a $S
  grep -E "RACECHECK SUMMARY|^\[  PASSED|^\[  FAILED" $L/racecheck_$v.log | tail -2 | tee -a $S
  echo "t=$SECONDS" | tee -a $S
done

bench() {  # VARIANT RUN
  timeout 120 $B/pq_shortlist_bench$(suffix $1) --context=131072 --shortlists=1024 \
    --graph=false --steps=16 --warmup=3 --kernel_repeats=20 > $L/pq_$1_$2.json 2> $L/pq_$1_$2.log
  echo "bench $1 $2 rc $?" | tee -a $S
  python3 - $L/pq_$1_$2.json $1 <<'PY' 2>&1 | tee -a $S
import json, sys
v = json.load(open(sys.argv[1]))["variants"]["pq1024"]
r = lambda k, q="p50": round(v[k][q], 1)
print(sys.argv[2], "kernels p50", r("gpu_kernels_us"), "repeat p50", r("gpu_kernels_repeat_us"),
      "p90", r("gpu_kernels_repeat_us", "p90"), "gpu_part p50", r("gpu_us"),
      "select_alone p50", r("gpu_select_alone_us"), "recall", round(v["recall_at_k"]["mean"], 5),
      "mass", round(v["mass_of_exact_topk"]["mean"], 5), "ids_fnv", v["ids_fnv"])
PY
}
for i in 1 2; do
  for v in base A B C D; do
    [ $SECONDS -lt 240 ] || { echo "t=$SECONDS skip bench $v $i" | tee -a $S; continue; }
    bench $v $i
  done
done
echo "t=$SECONDS benches done" | tee -a $S

ncu_times() {  # VARIANT REGEX SKIP COUNT
  timeout 100 ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:"$2" \
    --launch-skip $3 --launch-count $4 $B/pq_shortlist_bench$(suffix $1) --context=131072 \
    --shortlists=1024 --graph=false --steps=8 --warmup=2 > $L/ncu_$1.csv 2> $L/ncu_$1.err
  echo "ncu $1 rc $?" | tee -a $S
  python3 - $L/ncu_$1.csv $1 <<'PY' 2>&1 | tee -a $S
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[0] != "ID"]
for r in rows:
    print(sys.argv[2], r[4].split("(")[0][:60], r[8], r[14], r[13])
PY
}
ncu_times base 'Pq|RowCollect' 8 16
for v in A B C D; do
  [ $SECONDS -lt 330 ] && ncu_times $v 'Pq' 6 12
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/k3_logs.tgz *.log *.json *.csv *.err 2>/dev/null
