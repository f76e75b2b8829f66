#!/usr/bin/env bash
# Fifty-fourth call: pcie_gather_bench again with its split configurations interleaved step by
# step (d52 and d53 disagreed at 128K: the host's part alone ran at 230 and 298 us), 128K,
# 512K, 128K; the host's NUMA layout beside it.
set -u
tar -C .device/b54 -xJf .device/b54/ship/bundle.tar.xz
B=$PWD/.device/b54/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b54/bundle/lib
L=/tmp/d54; mkdir -p $L
S=$OUT/d54_summary.txt
cat /proc/loadavg | tee -a $S
lscpu | grep -iE "model name|numa|socket|L3" | tee -a $S
nvidia-smi topo -m 2>&1 | head -6 | tee -a $S
n=0
for t in 131072 524288 131072; do
  n=$((n + 1))
  timeout 150 $B/pcie_gather_bench --tokens=$t --gpu_heads=8 --split_heads=0,4,8,12,16 > $OUT/d54_pcie_${n}_$t.json 2> $L/pcie_${n}_$t.err
  echo "run $n pcie tokens $t rc $?" | tee -a $S
  grep -E "split|exact|gpu  8" $L/pcie_${n}_$t.err | tee -a $S
done
echo "t=$SECONDS done" | tee -a $S
