#!/usr/bin/env bash
# Configures and builds kvrecall into ${KVRECALL_BUILD_DIR:-build} (Release-with-debug-info):
# everything, or only the CMake targets named in ${KVRECALL_BUILD_TARGETS} (space-separated).
# Arguments go to the configure step (e.g. -DKVRECALL_WITH_CUDA=OFF).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVRECALL_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
targets=()
for t in ${KVRECALL_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j"$(nproc)" "${targets[@]}"
