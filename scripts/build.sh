#!/usr/bin/env bash
# Configures and builds kvrecall into ${KVRECALL_BUILD_DIR:-build} (Release-with-debug-info).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVRECALL_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
