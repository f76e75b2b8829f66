#!/usr/bin/env bash
# Installs what is missing, builds, starts kvrecalld on loopback and runs the demo client
# against it (CPU placement), then stops the server.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVRECALL_BUILD_DIR:-$root/build}"
port="${KVRECALL_PORT:-50051}"
"$root/scripts/install_deps.sh"
KVRECALL_BUILD_DIR="$build" "$root/scripts/build.sh"

log="$(mktemp)"
"$build/server/kvrecalld" --address="127.0.0.1:$port" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do
  grep -q "listening" "$log" && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
echo "kvrecalld is serving on 127.0.0.1:$port (pid $server)"
"$build/client/kvrecall" demo --server="127.0.0.1:$port"
