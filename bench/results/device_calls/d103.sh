#!/usr/bin/env bash
# Run 2026-12-05: tiered_serving.md, "ReTopK's build on the GPU".
# Hundred-and-third call: d102's 128K rows were slower than d99's for index too (524 against 308
# us), which d102's change does not touch: an A/B in one call, d101's kvrecalld (the build's
# top-K on the CPU) against d102's (on the GPU), twice each, alternating: the build seconds and
# the steps.
# Carry: .device/b101/ship, .device/b102/ship, client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 102
tar -C .device/b101 -xJf .device/b101/ship/bundle.tar.xz
S=$OUT/d103_summary.txt
for rep in 1 2; do
  for arm in 101 102; do
    root=$PWD/.device/b$arm/bundle
    export LD_LIBRARY_PATH=$root/lib
    start_kvrecalld $root/bin/kvrecalld $L/kvrecalld_$arm$rep.log --address=127.0.0.1:0 || exit 1
    timeout 150 $root/bin/gpu_serving_bench --server=$kvrecalld_address \
      --out=$L/s128k_$arm$rep.json --placement=tiered --contexts=131072 --batches=1 \
      --selectors=retopk,index --auto_tau --steps=40 --warmup=5 > /dev/null \
      2> $L/s128k_$arm$rep.log
    echo "b$arm rep $rep rc $? t=$SECONDS" | tee -a $S
    kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
    serving_summary $L/s128k_$arm$rep.json
  done
done
cp $L/s128k_*.json $OUT/ 2>/dev/null
(cd "$L" && tar czf "$OUT/d103_logs.tgz" ./*.log 2>/dev/null)
