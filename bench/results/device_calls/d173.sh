#!/usr/bin/env bash
# Written 2026-12-07 (twenty-seventh session) for device_tests.md. Hundred-and-seventy-third
# call, at 71b7114 (the gRPC port's TLS over validated in-memory copies, SIGHUP reading the TLS
# files; no GPU code changed since d170): the whole suite.
# Bundle .device/b173; carry its ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
device_call_begin 173
bash bench/device_test_suite.sh $B $L $S
device_call_end
