#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA code too when nvcc is present) and runs
# every test. GPU tests skip themselves on machines without a GPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVRECALL_BUILD_DIR:-$root/build}"
"$root/scripts/install_deps.sh"
KVRECALL_BUILD_DIR="$build" KVRECALL_BUILD_TARGETS= "$root/scripts/build.sh"  # everything
cd "$build"
ctest --output-on-failure -j"$(nproc)" --timeout 900
# A short bounded fuzz run (issue 14) on an ASan + UBSan build of the fuzzers alone (under 11
# minutes to build on the loaded 2-core dev machine; KVRECALL_CI_FUZZ_SECONDS=0 skips it). The seed
# corpora are also replayed in every build above (fuzz_replay_*).
fuzz_seconds="${KVRECALL_CI_FUZZ_SECONDS:-30}"
if [ "$fuzz_seconds" -gt 0 ] && command -v clang++-16 >/dev/null; then
  "$root/scripts/fuzz.sh" --seconds="$fuzz_seconds"
fi
