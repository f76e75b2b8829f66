#!/usr/bin/env bash
# Three load_test rounds against one kvrecalld (bench/load_test.cc), 64 sessions x 100 tokens each:
# does the server's RSS after closing every session plateau or grow from round to round?
#
#   bench/load_test_rounds.sh [BUILD_DIR] [OUT_DIR]   (prints the RSS line of each round)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build-h14}"
out="${2:-/tmp/load_test_rounds}"
mkdir -p "$out"
. "$root/scripts/kvrecalld.sh"
start_kvrecalld "$build/server/kvrecalld" "$out/kvrecalld.log" --address=127.0.0.1:0
trap 'kill "$kvrecalld_pid" 2>/dev/null; wait "$kvrecalld_pid" 2>/dev/null || true' EXIT
for r in 1 2 3; do
  "$build/bench/load_test" --server="$kvrecalld_address" --server_pid="$kvrecalld_pid" \
    --tokens=100 --baseline_tokens=50 --json="$out/round$r.json" > "$out/round$r.txt"
  grep "RSS" "$out/round$r.txt"
done
