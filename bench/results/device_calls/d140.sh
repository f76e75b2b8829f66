#!/usr/bin/env bash
# Written 2026-12-06 (seventeenth session) for device_tests.md, kv_growth.md and
# tiered_serving.md. Hundred-and-fortieth call, at 231803b (this session's code: reservations
# chosen and held at once, a move's target mapped writable first, the host budget charging an
# array's footprint, probe 17's mends): (1) issue 15's headline rows on the fresh machine;
# (2) the whole suite; (3) host_memory_test's strict-overcommit test, which skips where
# vm.overcommit_memory is not 2: run here under vm.overcommit_memory=2 with 8 GiB of room
# (vm.overcommit_kbytes), this session's binary and host_memory_test_before (the same test
# linked with 63b9fc9's host_memory.cc less the writable target: the A/B of that change), the
# host's settings restored after. Bundle .device/b140; carry its ship/ and
# client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 140
tiered_rows $B/kvrecalld 131072 524288
bash bench/device_test_suite.sh $B $L $S
mode=$(cat /proc/sys/vm/overcommit_memory) ratio=$(cat /proc/sys/vm/overcommit_ratio)
kbytes=$(cat /proc/sys/vm/overcommit_kbytes)
restore() {
  echo "$mode" > /proc/sys/vm/overcommit_memory
  if [ "$kbytes" = 0 ]; then echo "$ratio" > /proc/sys/vm/overcommit_ratio
  else echo "$kbytes" > /proc/sys/vm/overcommit_kbytes; fi
}
trap restore EXIT
committed=$(awk '/^Committed_AS/ {print $2}' /proc/meminfo)
echo "overcommit was mode $mode ratio $ratio kbytes $kbytes; committed ${committed} kB" | tee -a $S
if echo $((committed + 8 * 1024 * 1024)) > /proc/sys/vm/overcommit_kbytes &&
   echo 2 > /proc/sys/vm/overcommit_memory; then
  grep -E "^(CommitLimit|Committed_AS)" /proc/meminfo | tr '\n' ' ' | tee -a $S; echo | tee -a $S
  for t in host_memory_test host_memory_test_before; do
    (cd tests && timeout 120 $B/$t --gtest_filter='*Overcommit*:*AMoveRefused*:*Reservations*' \
      > $L/overcommit_$t.log 2>&1; echo "$t (overcommit 2) rc $?") | tee -a $S
    grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|Failure|Expected|Which is|Actual" $L/overcommit_$t.log \
      | head -30 | tee -a $S
  done
else
  echo "could not set vm.overcommit_memory=2 (not root?)" | tee -a $S
fi
restore
trap - EXIT
cat /proc/sys/vm/overcommit_memory | sed 's/^/overcommit restored to mode /' | tee -a $S
device_call_end
