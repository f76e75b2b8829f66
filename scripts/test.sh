#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA code too when nvcc is present) and runs
# every test. GPU tests skip themselves on machines without a GPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVRECALL_BUILD_DIR:-$root/build}"
"$root/scripts/install_deps.sh"
KVRECALL_BUILD_DIR="$build" "$root/scripts/build.sh"
cd "$build"
ctest --output-on-failure -j"$(nproc)" --timeout 900
