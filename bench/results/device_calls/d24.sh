#!/usr/bin/env bash
# Twenty-fourth call: the mend after the final read (ReportedErrors shared, the capture's
# bookkeeping simplified): the GPU tests only.
set -u
tar -C .device/b17 -xJf .device/b17/ship/bundle.tar.xz
B=$PWD/.device/b17/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b17/bundle/lib
for t in tiered_shortlist_test tiered_placement_test gpu_placement_test; do
  timeout 200 $B/$t > /tmp/$t.log 2>&1; echo "$t rc $?"
  grep -E "PASSED|FAILED|Failure" /tmp/$t.log | head -6
done
