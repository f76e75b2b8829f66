#!/usr/bin/env bash
# The load test (bench/load_test.cc, 64 sessions x 100 decode tokens) against kvrecalld at several
# --malloc_mmap_threshold_kb values, interleaved ROUNDS times so that a busy host's drift spreads
# over all of them: the server's RSS after closing every session, and the decode throughput.
#
#   bench/load_test_malloc.sh [BUILD_DIR] [OUT_DIR] [ROUNDS] [THRESHOLDS...]
#   (defaults: build /tmp/load_test_malloc 2, thresholds 0 256 1024 4096; 0 = glibc's default)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
out="${2:-/tmp/load_test_malloc}"
rounds="${3:-2}"
shift $(( $# < 3 ? $# : 3 ))
thresholds=("$@")
[ ${#thresholds[@]} -gt 0 ] || thresholds=(0 256 1024 4096)
mkdir -p "$out"
. "$root/scripts/kvrecalld.sh"
kvrecalld_pid=""
trap '[ -z "$kvrecalld_pid" ] || kill "$kvrecalld_pid" 2>/dev/null || true' EXIT
for round in $(seq "$rounds"); do
  for t in "${thresholds[@]}"; do
    start_kvrecalld "$build/server/kvrecalld" "$out/kvrecalld-$t.log" --address=127.0.0.1:0 \
      --malloc_mmap_threshold_kb="$t"
    "$build/bench/load_test" --server="$kvrecalld_address" --server_pid="$kvrecalld_pid" \
      --tokens=100 --baseline_tokens=50 --json="$out/t$t-r$round.json" > "$out/t$t-r$round.txt"
    echo "threshold_kb=$t round=$round $(grep -o '[0-9]* steps/s' "$out/t$t-r$round.txt")," \
      "$(grep 'server RSS' "$out/t$t-r$round.txt" | sed 's/^ *//'), load $(cut -d' ' -f1 /proc/loadavg)"
    kill "$kvrecalld_pid"; wait "$kvrecalld_pid" 2>/dev/null || true
    kvrecalld_pid=""
  done
done
