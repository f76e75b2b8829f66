#!/usr/bin/env bash
# Fifty-third call: cuda::CandidateAttention (the exact path over candidate lists, reading the
# KV wherever a DeviceSeq points: device memory or mapped host memory) against the CPU
# reference, also under memcheck; cuda_retopk_test (HashInsert moved to common.cuh); then
# pcie_gather_bench with whole exact heads split between the GPU (over PCIe) and the host's 16
# threads, at 128K and 512K.
set -u
tar -C .device/b53 -xJf .device/b53/ship/bundle.tar.xz
B=$PWD/.device/b53/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b53/bundle/lib
L=/tmp/d53; mkdir -p $L
S=$OUT/d53_summary.txt
cat /proc/loadavg | tee -a $S
for t in cuda_candidate_attention_test cuda_retopk_test; do
  timeout 200 $B/$t > $L/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "PASSED|FAILED|Failure|SKIPPED|error" $L/$t.log | head -12 | tee -a $S
done
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/cuda_candidate_attention_test > $L/memcheck.log 2>&1
echo "memcheck cuda_candidate_attention_test rc $?" | tee -a $S
grep -E "ERROR SUMMARY|PASSED|FAILED" $L/memcheck.log | head -4 | tee -a $S
echo "t=$SECONDS tests done" | tee -a $S
for t in 131072 524288; do
  timeout 150 $B/pcie_gather_bench --tokens=$t --gpu_heads=8,16 --split_heads=0,4,8,10,12,16 > $OUT/d53_pcie_$t.json 2> $L/pcie_$t.err
  echo "pcie tokens $t rc $?" | tee -a $S
  cat $L/pcie_$t.err | tee -a $S
done
echo "t=$SECONDS done" | tee -a $S
cd $L && tar czf $OUT/d53.tgz *.log *.err
