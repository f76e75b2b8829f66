#!/usr/bin/env bash
# Sixty-sixth call: where the PQ shortlist's ~58 us go (d65's pq_shortlist_bench: kernels 79 us
# in-process, the selection alone 42): per-kernel device times of the shortlist at 128K under
# Nsight Compute (or Nsight Systems), whichever the machine has.
set -u
tar -C .device/b65 -xJf .device/b65/ship/bundle.tar.xz
B=$PWD/.device/b65/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b65/bundle/lib
S=$OUT/d66_summary.txt
ls /usr/local/cuda/bin | tr '\n' ' ' | tee -a $S; echo | tee -a $S
which ncu nsys | tee -a $S
if which ncu > /dev/null; then
  timeout 400 ncu --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size -k regex:'Pq|Row|Publish' --launch-skip 8 --launch-count 16 $B/pq_shortlist_bench --context=131072 --shortlists=1024 --graph=false --steps=6 --warmup=2 > $OUT/ncu.txt 2>&1
  echo "ncu rc $?" | tee -a $S
  grep -E "^\s+[A-Za-z]+.*\(|gpu__time|sm__thr|dram__thr|grid_size" $OUT/ncu.txt | head -120 | tee -a $S
elif which nsys > /dev/null; then
  timeout 400 nsys profile -o $OUT/prof --stats=true $B/pq_shortlist_bench --context=131072 --shortlists=1024 --graph=false --steps=6 --warmup=2 > $OUT/nsys.txt 2>&1
  echo "nsys rc $?" | tee -a $S
  grep -A 30 "cuda_gpu_kern_sum" $OUT/nsys.txt | head -40 | tee -a $S
fi
echo "t=$SECONDS done" | tee -a $S
