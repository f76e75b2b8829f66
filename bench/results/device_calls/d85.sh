#!/usr/bin/env bash
# Eighty-fifth call: the whole test suite on the H200 again, at 9bb5548 (this stop's security and
# crash fixes: per-call tenants, the shared region's SIGBUS guard, kMaxLayerTokens, the shutdown
# handler): every tests/*_test binary, six at a time, and the Python client's tests beside them.
# Carry: .device/b85/ship (every tests/*_test, kvrecalld, kvrecall), client/python/kvrecall/_gen.
set -u
tar -C .device/b85 -xJf .device/b85/ship/bundle.tar.xz
B=$PWD/.device/b85/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b85/bundle/lib
L=/tmp/d85; mkdir -p $L
S=$OUT/d85_summary.txt
cat /proc/loadavg | tee -a $S
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
bash bench/device_test_suite.sh $B $L $S
cd $L && tar czf $OUT/d85_logs.tgz *.log *.txt 2>/dev/null
