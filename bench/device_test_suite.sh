#!/usr/bin/env bash
# The whole test suite of a device bundle (bench/results/device_tests.md): every *_test binary in
# BIN, six at a time, each with its own log in LOGS, and beside them the Python client's tests
# against BIN's kvrecalld; what passed and what failed appended to SUMMARY. Run from the
# repository root:  bench/device_test_suite.sh BIN LOGS SUMMARY
set -u
B=$1 L=$2 S=$3
mkdir -p "$L"
# (The source directory absolute: the tests find ../shared/models beside it by dirname, which a
# path ending in /.. defeats.)
(cd tests && KVRECALLD=$B/kvrecalld KVRECALL_CLI=$B/kvrecall PYTHONPATH=$PWD/../client/python \
  KVRECALL_SOURCE_DIR=$(cd .. && pwd) timeout 280 python3 -m unittest python_client_test \
  > "$L/python_client_test.log" 2>&1; echo "python_client_test rc $?" > "$L/python_rc.txt") &
python_pid=$!
ls "$B"/*_test | xargs -P6 -I{} sh -c \
  't=$(basename {}); timeout 240 {} --gtest_brief=1 > '"$L"'/$t.log 2>&1; echo "$t rc $?"' \
  | sort > "$L/rc.txt"
passed=$(grep -c 'rc 0$' "$L/rc.txt")
echo "t=$SECONDS C++ tests: $passed of $(wc -l < "$L/rc.txt") binaries pass" | tee -a "$S"
grep -v 'rc 0$' "$L/rc.txt" | tee -a "$S"
for log in "$L"/*_test.log; do
  grep -H -E "^\[  FAILED  \]|tests ran|SKIPPED \]" "$log" | grep -v "listed below" | head -12
done > "$L/failures.txt"
grep -E "FAILED" "$L/failures.txt" | tail -80 | tee -a "$S"
grep -c "SKIPPED" "$L/failures.txt" | sed 's/^/skipped lines: /' | tee -a "$S"
wait $python_pid
echo "$(cat "$L/python_rc.txt") t=$SECONDS" | tee -a "$S"
tail -4 "$L/python_client_test.log" | tee -a "$S"
grep -E "^(FAIL|ERROR):" "$L/python_client_test.log" | head -20 | tee -a "$S"
