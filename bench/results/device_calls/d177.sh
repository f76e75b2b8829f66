#!/usr/bin/env bash
# Written 2026-12-07 (thirtieth session). Hundred-and-seventy-seventh call: d175's script (issue
# 15's whole benchmark at the current step, 7777b7d's; no step code changed since) run again as
# it is, on an H200 machine (d175's was an H100; the targets are the H200's), right after
# d176 on the same machine. Bundle .device/b177: a copy of .device/b175's ship/ (carry it).
# Not run yet: the thirtieth session's one machine was an H100 (d176, d178), and the
# thirty-first's two were H100s too (d180, d181).
set -u
sed -e 's/^device_call_begin 175$/device_call_begin 177/' -e 's/d175_raw/d177_raw/' \
  bench/results/device_calls/d175.sh | bash
