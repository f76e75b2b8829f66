#!/usr/bin/env bash
# The load test (bench/load_test.cc) against a kvrecalld of this build:
#
#   bench/load_test.sh BUILD_DIR OUT_DIR [load_test flags...]
#
# starts BUILD_DIR/server/kvrecalld on a free loopback port (more flags in KVRECALLD_FLAGS),
# runs BUILD_DIR/bench/load_test against it and writes OUT_DIR/load_test.json, the printed
# figures in OUT_DIR/load_test.txt and the server's log in OUT_DIR/kvrecalld.log.
set -euo pipefail
build=$(cd "${1:?usage: load_test.sh BUILD_DIR OUT_DIR [flags]}" && pwd)
out=${2:?usage: load_test.sh BUILD_DIR OUT_DIR [flags]}
shift 2
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/kvrecalld.sh"
mkdir -p "$out"
# shellcheck disable=SC2086
start_kvrecalld "$build/server/kvrecalld" "$out/kvrecalld.log" --address=127.0.0.1:0 \
  ${KVRECALLD_FLAGS:-}
trap 'kill "$kvrecalld_pid" 2>/dev/null; wait "$kvrecalld_pid" 2>/dev/null || true' EXIT
"$build/bench/load_test" --server="$kvrecalld_address" --server_pid="$kvrecalld_pid" \
  --json="$out/load_test.json" "$@" | tee "$out/load_test.txt"
