#!/usr/bin/env bash
# Written 2026-12-06 (sixteenth session) for device_tests.md.
# Hundred-and-thirty-eighth call: d137's suite at b137 (27e279d's arrays mapped from their
# first row) failed three tests. SessionIdleTtlTest compared budgets that growth ahead now
# changes (fixed after b137). The two learning tests found a real defect: the coding of a
# learning uploaded the bulk's keys by one cudaMemcpy straight from the host KV, which is
# pinned one range per growth made in place, and the driver refuses a copy from pinned memory
# that runs past its range (cudaErrorInvalidValue): the keys now go up from a copy. Also in
# b138: the address-space reservations held atomically, kept to a share of the bound, and what
# still fits taken (review 16). Trimmed to the session's last device minutes (~5, most of the
# rest spent on starts that found no machine): the binaries of the failures and of the host KV's
# growth on a GPU, not the whole suite. Bundle .device/b138; carry its ship/.
set -u
. bench/device_call.sh
device_call_begin 138
for t in service_errors_test service_limits_test tiered_codes_test tiered_shortlist_test \
         cuda_candidate_attention_test host_memory_test service_kv_store_test; do
  (cd tests && timeout 150 $B/$t --gtest_brief=1 > $L/$t.log 2>&1; echo "$t rc $?") | tee -a $S
  grep -E "^\[  (PASSED|FAILED)|tests ran" $L/$t.log | tee -a $S
done
device_call_end
