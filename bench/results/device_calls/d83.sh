#!/usr/bin/env bash
# Eighty-third call: the three tests that failed on the H200 in d82 (a geometry a GPU's tier does
# not serve, and a NaN payload through torch), again at c238953: client_library_test,
# cli_kvrecall_test and the Python client's tests. Carry: .device/b83/ship (the two test
# binaries, kvrecalld, kvrecall), client/python/kvrecall/_gen.
set -u
tar -C .device/b83 -xJf .device/b83/ship/bundle.tar.xz
B=$PWD/.device/b83/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b83/bundle/lib
S=$OUT/d83_summary.txt
for t in client_library_test cli_kvrecall_test; do
  timeout 200 $B/$t --gtest_brief=1 > $OUT/$t.log 2>&1; echo "$t rc $?" | tee -a $S
  grep -E "FAILED|tests ran|PASSED" $OUT/$t.log | tee -a $S
done
(cd tests && KVRECALLD=$B/kvrecalld KVRECALL_CLI=$B/kvrecall PYTHONPATH=$PWD/../client/python \
  KVRECALL_SOURCE_DIR=$PWD/.. timeout 280 python3 -m unittest python_client_test \
  > $OUT/python_client_test.log 2>&1; echo "python_client_test rc $?") | tee -a $S
tail -3 $OUT/python_client_test.log | tee -a $S
grep -E "^(FAIL|ERROR):" $OUT/python_client_test.log | tee -a $S
echo "t=$SECONDS all done" | tee -a $S
