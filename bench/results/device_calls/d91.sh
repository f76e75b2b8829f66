#!/usr/bin/env bash
# Ninety-first call: the whole suite on the H200 at c6c7d4b, this stop's final code (d88's plus
# the review's mends: the metrics endpoint's wait when full, the trace writer's links and modes,
# a revoked token's open streams, a second server's regions): every tests/*_test binary, six at
# a time, and the Python client's tests beside them.
# Carry: .device/b91/ship (every tests/*_test, kvrecalld, kvrecall), client/python/kvrecall/_gen.
set -u
tar -C .device/b91 -xJf .device/b91/ship/bundle.tar.xz
B=$PWD/.device/b91/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b91/bundle/lib
L=/tmp/d91; mkdir -p $L
S=$OUT/d91_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
bash bench/device_test_suite.sh $B $L $S
cd $L && tar czf $OUT/d91_logs.tgz *.log *.txt 2>/dev/null
