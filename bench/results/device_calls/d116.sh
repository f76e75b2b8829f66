#!/usr/bin/env bash
# Run 2026-12-05 (twelfth session): pq_encode.md, device_tests.md, tiered_serving.md.
# Hundred-and-sixteenth call: d115's PqEncodeKernel (70 us for 64-1024 keys of 8 sets, ncu at 64:
# 8 SMs busy) with a warp's keys chosen at launch, 8, 2 or 1, the most that still give every SM
# a block; a test that every split codes alike (PqEncodeSplitTest).
#   1. The whole test suite.
#   2. pq_encode_bench, d112's binary and this one, alternating twice, and both at the training's
#      shape (16384 keys, one set a launch); ncu on the new kernel.
#   3. d98's take-over run, d112's kvrecalld and this one alternating twice; issue 15's 128K and
#      512K rows.
# Bundles: .device/b116 (this code), .device/b112 (d112's). Carry both ships and
# client/python/kvrecall/_gen. Everything but the summary comes back in d116_out.tgz.
set -u
. bench/device_call.sh
tar -C .device/b112 -xJf .device/b112/ship/bundle.tar.xz
OLD=$PWD/.device/b112/bundle/bin
device_call_begin 116
R=$L/out
mkdir -p $R
$B/cuda_pq_encode_test 2>&1 | grep -E "^\[ +(OK|FAILED|  PASSED) +\]|Failure|Expected|Which is" |
  head -40 | tee -a $S
bash bench/device_test_suite.sh $B $L $S
for rep in 1 2; do
  for v in old new; do
    bin=$B; [ $v = old ] && bin=$OLD
    timeout 120 $bin/pq_encode_bench > $R/pq_encode_${v}${rep}_d116.json 2> $L/pq_$v$rep.log
    echo "pq_encode_bench $v$rep rc $? t=$SECONDS" | tee -a $S
    cat $L/pq_$v$rep.log | tee -a $S
  done
done
# The server's other shape: the training's (16384 keys, one set a launch: GpuPqAssigner; bf16
# here, the training's sample is f32).
for v in old new; do
  bin=$B; [ $v = old ] && bin=$OLD
  timeout 60 $bin/pq_encode_bench --rows=16384 --kv_heads=1 > $R/pq_encode_train_${v}_d116.json \
    2> $L/pq_train_$v.log
  echo "training shape $v" | tee -a $S
  cat $L/pq_train_$v.log | tee -a $S
done
for rows in 64 2048; do
  timeout 90 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section LaunchStats -k regex:PqEncodeKernel --launch-skip 16 --launch-count 1 \
    $B/pq_encode_bench --rows=$rows --reps=2 --warmup=0 > $R/ncu_pq_encode_${rows}_d116.txt \
    2> $L/ncu_$rows.err
  echo "ncu rows $rows rc $? t=$SECONDS" | tee -a $S
  grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|"\
"Compute \(SM\) Th|Memory Th" \
    $R/ncu_pq_encode_${rows}_d116.txt | head -20 | tee -a $S
done
for rep in 1 2; do
  takeover_run old$rep $OLD/kvrecalld
  takeover_run new$rep $B/kvrecalld
done
tiered_rows $B/kvrecalld 131072 524288
mv $OUT/*.json $R/ 2>/dev/null
tar -C $L -czf $OUT/d116_out.tgz out
device_call_end
