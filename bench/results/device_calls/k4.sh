#!/usr/bin/env bash
# k4: the shortlist's scan keeping 8-bit coarse bins instead of f32 scores, and its collect
# reading those (a quarter of the bytes) and rescoring from the codes only the keys of the
# threshold bin's coarse bin. Variants (pq_shortlist.cu compiled alone and linked ahead of the
# library, as in k3): base = HEAD's kernels (255e84c); N = the new kernels launched plainly
# (kDependentLaunch = false); P = the same launched as programmatic dependents (the library as
# built, kDependentLaunch = true). Each variant's parity test (base's for the new test cases),
# memcheck on N and P, racecheck on P; then base, N and P alternating in process, and per kernel
# under Nsight Compute.
# (As it ran, N's binaries were bundled as *_n while this script asks for *_N: N's test, memcheck,
# benches and ncu did not run (rc 127 / 1). Its summary's bench lines failed on a "p10" key the
# bench does not print; the figures were read from the JSON files of k4_logs.tgz.)
set -u
D=.device/k4
tar -C $D -xJf $D/ship/bundle.tar.xz
B=$PWD/$D/bundle/bin
export LD_LIBRARY_PATH=$PWD/$D/bundle/lib
L=/tmp/k4; mkdir -p $L
S=$OUT/k4_summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $S
suffix() { [ $1 = P ] && echo "" || echo "_$1"; }

for v in P N base; do
  t=$B/cuda_pq_shortlist_test$(suffix $v)
  timeout 120 $t > $L/test_$v.log 2>&1
  echo "test $v rc $?" | tee -a $S
  grep -E "^\[  PASSED|^\[  FAILED|Failure|^Expected|Which is|row [0-9]" $L/test_$v.log \
    | head -12 | tee -a $S
  echo "t=$SECONDS" | tee -a $S
done
for v in P N; do
  t=$B/cuda_pq_shortlist_test$(suffix $v)
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $t > $L/memcheck_$v.log 2>&1
  echo "memcheck $v rc $?" | tee -a $S
  grep -E "ERROR SUMMARY|^\[  PASSED|^\[  FAILED" $L/memcheck_$v.log | tail -3 | tee -a $S
  echo "t=$SECONDS" | tee -a $S
done
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 $B/cuda_pq_shortlist_test \
  --gtest_filter='*M8Group4:*M16Group2:*Bins*:*Group4FewValuesWithScores:*Mixed*:*Graph*' \
  > $L/racecheck_P.log 2>&1
echo "racecheck P rc $?" | tee -a $S
grep -E "RACECHECK SUMMARY|^\[  PASSED|^\[  FAILED" $L/racecheck_P.log | tail -2 | tee -a $S
echo "t=$SECONDS" | tee -a $S

bench() {  # VARIANT RUN
  timeout 120 $B/pq_shortlist_bench$(suffix $1) --context=131072 --shortlists=1024 \
    --graph=false --steps=16 --warmup=3 --kernel_repeats=20 > $L/pq_$1_$2.json 2> $L/pq_$1_$2.log
  echo "bench $1 $2 rc $?" | tee -a $S
  python3 - $L/pq_$1_$2.json $1 <<'PY' 2>&1 | tee -a $S
import json, sys
v = json.load(open(sys.argv[1]))["variants"]["pq1024"]
r = lambda k, q="p50": round(v[k][q], 1)
print(sys.argv[2], "kernels p50", r("gpu_kernels_us"), "repeat p50", r("gpu_kernels_repeat_us"),
      "p10", r("gpu_kernels_repeat_us", "p10"), "p90", r("gpu_kernels_repeat_us", "p90"),
      "gpu_part p50", r("gpu_us"), "select_alone p50", r("gpu_select_alone_us"),
      "recall", round(v["recall_at_k"]["mean"], 5), "mass", round(v["mass_of_exact_topk"]["mean"], 5),
      "ids_fnv", v["ids_fnv"], "repeat_mismatches", v.get("ids_repeat_mismatches"))
PY
}
for i in 1 2 3; do
  for v in base N P; do
    [ $SECONDS -lt 200 ] || { echo "t=$SECONDS skip bench $v $i" | tee -a $S; continue; }
    bench $v $i
  done
done
echo "t=$SECONDS benches done" | tee -a $S

ncu_times() {  # VARIANT
  timeout 100 ncu --clock-control none --csv --metrics gpu__time_duration.sum -k regex:Pq \
    --launch-skip 6 --launch-count 12 $B/pq_shortlist_bench$(suffix $1) --context=131072 \
    --shortlists=1024 --graph=false --steps=8 --warmup=2 > $L/ncu_$1.csv 2> $L/ncu_$1.err
  echo "ncu $1 rc $?" | tee -a $S
  python3 - $L/ncu_$1.csv $1 <<'PY' 2>&1 | tee -a $S
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and r[0] != "ID"]
for r in rows:
    print(sys.argv[2], r[4].split("(")[0][:60], r[8], r[14], r[13])
PY
}
for v in base P N; do
  [ $SECONDS -lt 260 ] && ncu_times $v
done
echo "t=$SECONDS all done" | tee -a $S
cd $L && tar czf $OUT/k4_logs.tgz *.log *.json *.csv *.err 2>/dev/null
