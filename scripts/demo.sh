#!/usr/bin/env bash
# Installs what is missing, builds kvrecalld and the kvrecall CLI, starts kvrecalld on loopback
# and runs the demo client against it (CPU placement), then stops the server.
# KVRECALL_PORT: the port to serve on (default 0: a free one, printed); KVRECALL_BUILD_DIR: the
# build directory (default build/).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVRECALL_BUILD_DIR:-$root/build}"
port="${KVRECALL_PORT:-0}"
"$root/scripts/install_deps.sh"
KVRECALL_BUILD_DIR="$build" KVRECALL_BUILD_TARGETS="kvrecalld kvrecall" "$root/scripts/build.sh"

log="$(mktemp)"
kvrecalld_pid=""
trap 'kill "$kvrecalld_pid" 2>/dev/null; wait "$kvrecalld_pid" 2>/dev/null || true; rm -f "$log"' EXIT
. "$root/scripts/kvrecalld.sh"
start_kvrecalld "$build/server/kvrecalld" "$log" --address="127.0.0.1:$port"
echo "kvrecalld is serving on $kvrecalld_address (pid $kvrecalld_pid)"
"$build/client/kvrecall" demo --server="$kvrecalld_address"
