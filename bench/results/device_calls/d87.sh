#!/usr/bin/env bash
# Eighty-seventh call: the whole test suite on the H200 at b226b79, this stop's final code
# (d85's plus the metrics endpoint's bounded queue, the reply-size check before a shared
# step is applied, and the hardening test's shorter wait): every tests/*_test binary, six at
# a time, and the Python client's tests beside them.
# Carry: .device/b87/ship (every tests/*_test, kvrecalld, kvrecall), client/python/kvrecall/_gen.
set -u
tar -C .device/b87 -xJf .device/b87/ship/bundle.tar.xz
B=$PWD/.device/b87/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b87/bundle/lib
L=/tmp/d87; mkdir -p $L
S=$OUT/d87_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
bash bench/device_test_suite.sh $B $L $S
cd $L && tar czf $OUT/d87_logs.tgz *.log *.txt 2>/dev/null
