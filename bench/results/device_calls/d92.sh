#!/usr/bin/env bash
# Ninety-second call: the whole suite on the H200 at e67fa57, this stop's final code (d91's
# plus the start's check of --shared_memory_dir and the hf backend's refusal message): every
# tests/*_test binary, six at a time, and the Python client's tests beside them.
# Carry: .device/b92/ship (every tests/*_test, kvrecalld, kvrecall), client/python/kvrecall/_gen.
set -u
tar -C .device/b92 -xJf .device/b92/ship/bundle.tar.xz
B=$PWD/.device/b92/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b92/bundle/lib
L=/tmp/d92; mkdir -p $L
S=$OUT/d92_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
bash bench/device_test_suite.sh $B $L $S
cd $L && tar czf $OUT/d92_logs.tgz *.log *.txt 2>/dev/null
