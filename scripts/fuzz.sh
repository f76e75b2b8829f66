#!/usr/bin/env bash
# Runs the libFuzzer targets of tests/fuzz for a bounded time each, on the ASan + UBSan build of
# scripts/sanitize.sh (built here when needed):
#
#   scripts/fuzz.sh [--seconds=N] [--runs=N] [--target=request|safetensors]... [--json=FILE]
#                   [--no-build]
#
# --seconds: the time each target runs (default 60); --runs: stop a target after N inputs
# instead (the first bound reached ends it). Each target starts from its seed corpus (real
# requests and trace files, written by fuzz_seeds), tests/fuzz/regressions/ and the corpus that
# earlier runs grew in BUILD/fuzz-corpus/TARGET. An input that crashes, leaks, trips a sanitizer
# or breaks an invariant is saved as BUILD/fuzz-artifacts/TARGET-crash-* (add it to
# tests/fuzz/regressions/TARGET once fixed) and the script exits non-zero. It prints, and with
# --json writes, each target's executions, time and coverage. --no-build runs the binaries
# already built (while another build of that directory is under way, say).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds=60
runs=-1
targets=()
json=""
build_first=1
for arg in "$@"; do
  case "$arg" in
    --seconds=*) seconds="${arg#*=}" ;;
    --runs=*) runs="${arg#*=}" ;;
    --target=*) targets+=("${arg#*=}") ;;
    --json=*) json="${arg#*=}" ;;
    --no-build) build_first=0 ;;
    *) echo "usage: $0 [--seconds=N] [--runs=N] [--target=request|safetensors]... [--json=FILE] [--no-build]" >&2
       exit 2 ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(request safetensors)
build="${KVRECALL_ASAN_BUILD_DIR:-$root/build-asan}"

# The fuzzers and their seed corpora alone, not the whole suite.
[ "$build_first" = 0 ] || "$root/scripts/sanitize.sh" asan --build-only --target=fuzz_seed_corpora \
  --target=request_fuzzer_libfuzzer --target=safetensors_fuzzer_libfuzzer

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
# The fuzzed code's OpenMP regions on one thread: a team's spin-waits were a third of the request
# fuzzer's time (libomp, perf), for inputs of a few tokens. Races are ThreadSanitizer's job
# (scripts/sanitize.sh tsan), not the fuzzer's. KVRECALL_FUZZ_OMP_THREADS overrides it.
export OMP_NUM_THREADS="${KVRECALL_FUZZ_OMP_THREADS:-1}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
mkdir -p "$build/fuzz-artifacts"
status=0
results=()
for target in "${targets[@]}"; do
  binary="$build/tests/fuzz/${target}_fuzzer_libfuzzer"
  corpus="$build/fuzz-corpus/$target"
  mkdir -p "$corpus"
  log="$build/fuzz-artifacts/$target.log"
  # libFuzzer refuses a corpus directory that does not exist, and git keeps no empty one: a
  # clean clone has no tests/fuzz/regressions/TARGET until an input is added there.
  inputs=("$corpus" "$build/tests/fuzz/seeds/$target")
  [ -d "$root/tests/fuzz/regressions/$target" ] && inputs+=("$root/tests/fuzz/regressions/$target")
  set +e
  "$binary" -max_total_time="$seconds" -runs="$runs" -print_final_stats=1 -rss_limit_mb=2048 \
    -timeout=30 -artifact_prefix="$build/fuzz-artifacts/$target-" "${inputs[@]}" > "$log" 2>&1
  code=$?
  set -e
  execs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$" || echo 0)
  took=$(grep -oE "Done [0-9]+ runs in [0-9]+ second" "$log" | grep -oE "in [0-9]+" | grep -oE "[0-9]+" || echo "$seconds")
  cov=$(grep -oE "cov: [0-9]+" "$log" | tail -1 | grep -oE "[0-9]+" || echo 0)
  features=$(grep -oE "ft: [0-9]+" "$log" | tail -1 | grep -oE "[0-9]+" || echo 0)
  units=$(find "$corpus" -type f | wc -l)
  echo "fuzz.sh: $target: $execs executions in ${took} s, coverage $cov edges / $features features, corpus $units inputs, exit $code"
  results+=("{\"target\": \"$target\", \"executions\": $execs, \"seconds\": $took, \"edges\": $cov, \"features\": $features, \"corpus\": $units, \"exit_code\": $code}")
  if [ $code -ne 0 ]; then
    echo "fuzz.sh: $target failed; the end of $log:" >&2
    tail -40 "$log" >&2
    status=1
  fi
done
if [ -n "$json" ]; then
  (IFS=,; echo "{\"seconds_per_target\": $seconds, \"runs_per_target\": $runs, \"targets\": [${results[*]}]}") > "$json"
fi
exit $status
