#!/usr/bin/env bash
# Run 2026-12-05 (twelfth session): pq_encode.md, device_tests.md, tiered_serving.md.
# Hundred-and-fourteenth call: PqEncodeKernel weighs up to 8 keys of a warp at once (each
# centroid read once for all of them; the tile's key parts staged in shared memory with the
# codebook), where d112's kernel weighed one key at a time (~160 us for 8 to 2048 keys of 8 sets,
# flat: latency-bound).
#   1. The whole test suite (cuda_pq_encode_test: the new kernel against the CPU encoder and
#      PqEncodeRows bit for bit, and review 11b's additions, never run on a GPU before).
#   2. pq_encode_bench, d112's binary and this one, alternating twice; ncu on the new kernel.
#   3. d98's take-over run, d112's kvrecalld and this one alternating twice; issue 15's 128K rows.
# Bundles: .device/b114 (this code), .device/b112 (d112's). Carry both ships and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b112 -xJf .device/b112/ship/bundle.tar.xz
OLD=$PWD/.device/b112/bundle/bin
device_call_begin 114
$B/cuda_pq_encode_test 2>&1 | grep -E "^\[ +(OK|FAILED|  PASSED) +\]|Failure|Expected|Which is" |
  head -40 | tee -a $S
bash bench/device_test_suite.sh $B $L $S
for rep in 1 2; do
  for v in old new; do
    bin=$B; [ $v = old ] && bin=$OLD
    timeout 120 $bin/pq_encode_bench > $OUT/pq_encode_${v}${rep}_d114.json 2> $L/pq_$v$rep.log
    echo "pq_encode_bench $v$rep rc $? t=$SECONDS" | tee -a $S
    cat $L/pq_$v$rep.log | tee -a $S
  done
done
for rows in 64 2048; do
  timeout 90 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats -k regex:PqEncodeKernel --launch-skip 16 --launch-count 1 \
    $B/pq_encode_bench --rows=$rows --reps=2 --warmup=0 > $OUT/ncu_pq_encode_${rows}_d114.txt \
    2> $L/ncu_$rows.err
  echo "ncu rows $rows rc $? t=$SECONDS" | tee -a $S
  grep -E "Duration|Registers Per|Achieved Occupancy|Stall|"\
"Compute \(SM\) Throughput|Memory Throughput" \
    $OUT/ncu_pq_encode_${rows}_d114.txt | head -20 | tee -a $S
done
for rep in 1 2; do
  takeover_run old$rep $OLD/kvrecalld
  takeover_run new$rep $B/kvrecalld
done
tiered_rows $B/kvrecalld 131072
device_call_end
