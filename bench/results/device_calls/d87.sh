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
(cd tests && KVRECALLD=$B/kvrecalld KVRECALL_CLI=$B/kvrecall PYTHONPATH=$PWD/../client/python \
  KVRECALL_SOURCE_DIR=$PWD/.. timeout 280 python3 -m unittest python_client_test \
  > $L/python_client_test.log 2>&1; echo "python_client_test rc $?" > $L/python_rc.txt) &
python_pid=$!
ls $B/*_test | xargs -P6 -I{} sh -c \
  't=$(basename {}); timeout 240 {} --gtest_brief=1 > '"$L"'/$t.log 2>&1; echo "$t rc $?"' \
  | sort > $L/rc.txt
echo "t=$SECONDS C++ tests: $(grep -c 'rc 0$' $L/rc.txt) of $(wc -l < $L/rc.txt) binaries pass" \
  | tee -a $S
grep -v 'rc 0$' $L/rc.txt | tee -a $S
for log in $L/*_test.log; do
  grep -H -E "^\[  FAILED  \]|tests ran" $log | grep -v "listed below" | head -12
done > $L/failures.txt
grep -E "FAILED" $L/failures.txt | tail -40 | tee -a $S
wait $python_pid
echo "$(cat $L/python_rc.txt) t=$SECONDS" | tee -a $S
tail -3 $L/python_client_test.log | tee -a $S
grep -E "^(FAIL|ERROR):" $L/python_client_test.log | head -20 | tee -a $S
cd $L && tar czf $OUT/d87_logs.tgz *.log *.txt 2>/dev/null
