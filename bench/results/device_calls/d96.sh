#!/usr/bin/env bash
# Ninety-sixth call: the whole suite on the H200 at this stop's final code (d95's, plus the gpu
# placement's auto_tau calibration staging its window of queries; before, review 4's mends:
# the socket-owner check of a token alone, the metrics round, the budget tests at d = 64 that
# d93 and d94 failed on a GPU's tier; the tiered window test): every tests/*_test binary, six
# at a time, and the Python client's tests beside them.
# Carry: .device/b96/ship (every tests/*_test, kvrecalld, kvrecall), client/python/kvrecall/_gen.
set -u
tar -C .device/b96 -xJf .device/b96/ship/bundle.tar.xz
B=$PWD/.device/b96/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b96/bundle/lib
L=/tmp/d96; mkdir -p $L
S=$OUT/d96_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
bash bench/device_test_suite.sh $B $L $S
cd $L && tar czf $OUT/d96_logs.tgz *.log *.txt 2>/dev/null
