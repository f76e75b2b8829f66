#!/usr/bin/env bash
# Builds the project and its tests with clang's sanitizers and runs the test suite under them.
#
#   scripts/sanitize.sh [asan] [tsan] [--build-only] [--target=TARGET]... [-R REGEX] [-E REGEX]
#
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (leaks included; UB aborts), in
#         ${KVRECALL_ASAN_BUILD_DIR:-build-asan}. The build is also instrumented for libFuzzer
#         (scripts/fuzz.sh reuses it). hnswlib's SIMD distance is off there
#         (-DNO_MANUAL_VECTORIZATION): its prefetch reads one entry past a link list (upstream
#         nmslib/hnswlib issues 107 and 578), which ASan reports although the value is unused.
#   tsan  ThreadSanitizer, in ${KVRECALL_TSAN_BUILD_DIR:-build-tsan}. Debian's Abseil, gRPC and
#         OpenMP runtime are not instrumented, so TSan could see none of their synchronization;
#         here absl::Mutex calls are annotated (tests/sanitizers/absl_mutex_tsan.cc, linked in
#         with -Wl,--wrap), OpenMP is LLVM's libomp with its TSan tool (libarcher), and
#         tests/sanitizers/tsan.supp names what remains outside the project's reach.
#
# --target builds only those CMake targets (scripts/fuzz.sh builds the fuzzers alone this way).
# With neither, both run. -R/-E select tests (ctest regular expressions); the deploy tests
# (helm, manifests) never run here. Sanitizer reports go to BUILD/sanitizer-logs/; the script
# prints the tests that failed and the reports by kind, and exits non-zero on either.
# Needs clang-16, libclang-rt-16-dev and libomp-16-dev (scripts/install_deps.sh installs them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kinds=()
build_only=0
ctest_args=()
build_targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    asan | tsan) kinds+=("$1") ;;
    --build-only) build_only=1 ;;
    --target=*) build_targets+=(--target "${1#*=}") ;;
    -R | -E) ctest_args+=("$1" "$2"); shift ;;
    *) echo "usage: $0 [asan] [tsan] [--build-only] [--target=TARGET]... [-R REGEX] [-E REGEX]" >&2
       exit 2 ;;
  esac
  shift
done
[ ${#kinds[@]} -gt 0 ] || kinds=(asan tsan)

cc=$(command -v clang-16 || true)
cxx=$(command -v clang++-16 || true)
if [ -z "$cc" ] || [ -z "$cxx" ]; then
  echo "sanitize.sh: clang-16 is missing (scripts/install_deps.sh installs it)" >&2
  exit 2
fi
jobs="${KVRECALL_JOBS:-$(nproc)}"
# Reports name functions and lines only through llvm-symbolizer: clang-16's own, or whichever is
# on the PATH (LLVM 14's reads clang-16's DWARF 5 too).
symbolizer=""
for s in /usr/lib/llvm-16/bin/llvm-symbolizer "$(command -v llvm-symbolizer-16 || true)" \
  "$(command -v llvm-symbolizer || true)"; do
  if [ -n "$s" ] && [ -x "$s" ]; then symbolizer=$s; break; fi
done
[ -n "$symbolizer" ] || echo "sanitize.sh: no llvm-symbolizer; reports will be unsymbolized" >&2
export CCACHE_BASEDIR="$root"

configure_and_build() {  # KIND BUILD_DIR
  local kind=$1 build=$2 flags link_flags="" extra=()
  case "$kind" in
    asan)
      flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize=fuzzer-no-link"
      flags+=" -DNO_MANUAL_VECTORIZATION"
      extra=(-DKVRECALL_FUZZ=ON)
      ;;
    tsan)
      flags="-fsanitize=thread"
      local wraps="$root/tests/sanitizers/absl_mutex_wrap.txt"
      local absl_sync
      absl_sync=$(ls /usr/lib/x86_64-linux-gnu/libabsl_synchronization.so.* 2>/dev/null | head -1)
      local defined
      defined=$(nm -D --defined-only "$absl_sync")  # read once (grep -q in a pipe: SIGPIPE)
      while read -r sym; do
        [ -n "$sym" ] || continue
        if ! grep -q " $sym\$" <<< "$defined"; then
          echo "sanitize.sh: $absl_sync has no $sym (another Abseil than Debian 12's?)" >&2
          exit 2
        fi
        link_flags+=" -Wl,--wrap=$sym"
      done < "$wraps"
      mkdir -p "$build"
      "$cxx" -std=c++20 -O1 -g -fPIC -c "$root/tests/sanitizers/absl_mutex_tsan.cc" \
        -o "$build/absl_mutex_tsan.o"
      # An archive at the end of every C++ link: its wrappers are pulled in only where the
      # code references absl::Mutex (CMake's compiler probes do not, and would fail to link).
      rm -f "$build/libabsl_mutex_tsan.a"
      ar rcs "$build/libabsl_mutex_tsan.a" "$build/absl_mutex_tsan.o"
      extra=(-DCMAKE_CXX_STANDARD_LIBRARIES="$build/libabsl_mutex_tsan.a $absl_sync")
      ;;
  esac
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DKVRECALL_WITH_CUDA=OFF \
    -DCMAKE_C_FLAGS="$flags -fno-omit-frame-pointer" \
    -DCMAKE_CXX_FLAGS="$flags -fno-omit-frame-pointer" \
    -DCMAKE_EXE_LINKER_FLAGS="$link_flags" -DCMAKE_SHARED_LINKER_FLAGS="$link_flags" \
    "${extra[@]}" >/dev/null
  cmake --build "$build" -j"$jobs" ${build_targets[@]+"${build_targets[@]}"}
}

status=0
for kind in "${kinds[@]}"; do
  if [ "$kind" = asan ]; then
    build="${KVRECALL_ASAN_BUILD_DIR:-$root/build-asan}"
  else
    build="${KVRECALL_TSAN_BUILD_DIR:-$root/build-tsan}"
  fi
  start=$(date +%s)
  configure_and_build "$kind" "$build"
  built=$(date +%s)
  echo "sanitize.sh: $kind build took $((built - start)) s"
  [ "$build_only" = 1 ] && continue

  logs="$build/sanitizer-logs"
  rm -rf "$logs"
  mkdir -p "$logs"
  case "$kind" in
    asan)
      export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:log_path=$logs/asan${symbolizer:+:external_symbolizer_path=$symbolizer}"
      export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan${symbolizer:+:external_symbolizer_path=$symbolizer}"
      export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp"
      unset TSAN_OPTIONS OMP_TOOL_LIBRARIES || true
      ;;
    tsan)
      export TSAN_OPTIONS="halt_on_error=0:second_deadlock_stack=1:report_signal_unsafe=0:log_path=$logs/tsan:suppressions=$root/tests/sanitizers/tsan.supp${symbolizer:+:external_symbolizer_path=$symbolizer}"
      export OMP_TOOL_LIBRARIES=/usr/lib/llvm-16/lib/libarcher.so
      export ARCHER_OPTIONS="verbose=0"
      unset ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS || true
      ;;
  esac
  set +e
  # Left out under both: ClosedSessionsGiveTheirMemoryBack measures kvrecalld's RSS falling
  # after sessions close, which ASan's quarantine of freed blocks (256 MiB) and TSan's allocator
  # (it keeps freed memory and its shadow) prevent by design. Under TSan also
  # APrefillPastItsDeadlineFreesItsStagedPromptAtOnce, which must stage a 4096-token prompt
  # within its 500 ms deadline (TSan's 5-15x slowdown lets the deadline end the call first).
  exclude="deploy_|KvrecalldProcessTest.ClosedSessionsGiveTheirMemoryBack"
  [ "$kind" = tsan ] && exclude+="|DeadlineTest.APrefillPastItsDeadlineFreesItsStagedPromptAtOnce"
  (cd "$build" && ctest --output-on-failure -j"$jobs" --timeout 1800 -E "$exclude" \
    "${ctest_args[@]}" > "$logs/ctest.log" 2>&1)
  ctest_status=$?
  set -e
  tested=$(date +%s)
  summary=$(grep -E "tests passed|tests failed" "$logs/ctest.log" | tail -1)
  reports=$(cat "$logs"/asan.* "$logs"/ubsan.* "$logs"/tsan.* 2>/dev/null |
    grep -E "^(==[0-9]+==ERROR: [A-Za-z]+Sanitizer|WARNING: ThreadSanitizer|SUMMARY: )|runtime error:" |
    sed -E 's/==[0-9]+==//; s/ \(pid=[0-9]+\)//; s/^(SUMMARY: [A-Za-z]+Sanitizer: [a-z-]+).*/\1/' |
    sort | uniq -c | sort -rn || true)
  echo "sanitize.sh: $kind tests took $((tested - built)) s: $summary"
  if [ -n "$reports" ]; then
    echo "sanitize.sh: $kind reports (by kind; details in $logs):"
    echo "$reports"
  else
    echo "sanitize.sh: $kind reports: none"
  fi
  if [ $ctest_status -ne 0 ]; then
    grep -E "^\s+[0-9]+ - .*\((Failed|Subprocess|Timeout|SEGFAULT|Child aborted|Exception)" \
      "$logs/ctest.log" || true
    status=1
  fi
  [ -z "$reports" ] || status=1
done
exit $status
