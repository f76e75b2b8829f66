#!/usr/bin/env bash
# Written 2026-12-06 (sixteenth session) for device_tests.md and kv_growth.md.
# Hundred-and-thirty-eighth call: d137's suite at b137 (27e279d's arrays mapped from their
# first row) failed three tests. SessionIdleTtlTest compared budgets that growth ahead now
# changes (fixed after b137). The two learning tests found a real defect: the coding of a
# learning uploaded the bulk's keys by one cudaMemcpy straight from the host KV, which is
# pinned one range per growth made in place, and the driver refuses a copy from pinned memory
# that runs past its range (cudaErrorInvalidValue): the keys now go up from a copy. Also in
# b138: the address-space reservations held atomically, kept to a share of the bound, and what
# still fits taken (review 16). (1) the whole suite at b138; (2) the short prompts of d136 once
# with b138's kvrecalld. Bundle .device/b138; carry its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 138
bash bench/device_test_suite.sh $B $L $S
for prompt in 64 160; do
  name=mapped_${prompt}
  model_tokens_run $name $B/kvrecalld index --layers=32 --prompt=$prompt --from=0 --to=200 \
    > /dev/null
  model_tokens_slowest_held $name
done
tar -C $L -czf $OUT/d138_out.tgz out
device_call_end
