#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repository root, with binaries bundled here into
# .device/lead/bundle (shipped compressed as .device/lead/ship/bundle.tar.xz) and the tinylm-a
# model copied to .device/lead/model (tinylm-a.npz, tinylm_np.py):
#   bench/placement_device_run.sh [tests] [sanitize] [replay] [serving] [kernels] [match]
# tests: the server's GPU tests (gpu_placement_test, tiered_placement_test), the seam's and
# DeviceBuffer's ordering with the kernels' streams (cuda_device_buffer_test);
# sanitize: the GPU ones under compute-sanitizer memcheck; replay: `kvrecall replay` of a real
# tinylm-a trace (made here with numpy) through kvrecalld, CPU, GPU and tiered placements side by
# side (TIERED_RUNS: the tiered rows), checked by
# bench/placement_check.py; serving: bench/gpu_serving_bench against kvrecalld, one run per line
# of SERVING_RUNS (its flags), beside PyTorch SDPA / torch.topk and the kernels alone (kernels);
# match: where the tiered ReTopK cache match runs, host against GPU (bench/results/retopk_match.md):
# the match's parity tests, then bench/retopk_match_bench (MATCH_FLAGS: its flags).
# Outputs go to $OUT; logs to $OUT/placement_logs.tgz.
set -uo pipefail
lead=$PWD/.device/lead
. bench/device_env.sh
device_env "$lead" "$lead/bundle" placement_logs
. scripts/kvrecalld.sh
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
for step in "$@"; do
  case $step in
    tests)
      for t in cuda_device_buffer_test gpu_placement_test tiered_placement_test backend_seam_test; do
        timeout 400 "$bin/$t" --gtest_brief=1 > "$logs/$t.log" 2>&1 || status=1
        tail -n 30 "$logs/$t.log"
      done ;;
    sanitize)
      timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$bin/gpu_placement_test" --gtest_brief=1 \
        --gtest_filter="${SANITIZE_FILTER:-*BruteForce*:*Eight*:*BadInputs*:*ReTopK*}" \
        > "$logs/memcheck.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || status=1
      echo "memcheck gpu_placement_test (rc $rc): $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$logs/memcheck.log" | tr '\n' ' ')"
      timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$bin/tiered_placement_test" --gtest_brief=1 \
        --gtest_filter="${SANITIZE_TIERED_FILTER:-*WholeBulk*:*StaticSetAlone*:*Batch*}" \
        > "$logs/memcheck_tiered.log" 2>&1
      rc=$?; [ $rc -eq 0 ] || status=1
      echo "memcheck tiered_placement_test (rc $rc): $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$logs/memcheck_tiered.log" | tr '\n' ' ')" ;;
    replay)
      trace=$(mktemp -d)/tinylm.safetensors
      text=$(python3 -c 'import site; print(site.getsitepackages()[0])')
      /usr/bin/time -f "trace made in %e s" python3 "$lead/model/tinylm_np.py" trace \
        --model "$lead/model/tinylm-a.npz" --text "$text" --ctx "${TRACE_CTX:-16384}" \
        --decode "${TRACE_DECODE:-256}" --offset "${TRACE_OFFSET:-20000000}" --out "$trace" \
        > "$logs/trace.log" 2>&1 || { status=1; tail "$logs/trace.log"; }
      tail -n 2 "$logs/trace.log"
      start_kvrecalld "$bin/kvrecalld" "$logs/kvrecalld_replay.log" --address=127.0.0.1:0 || status=1
      server=$kvrecalld_pid
      : > "$out/placement_replay.jsonl"
      for placement in cpu gpu; do
        for run in "full" "exact_topk --k=512" "retopk --k=512" "retopk --k=512 --auto_tau" \
                   "streaming --sinks=128 --recent=512"; do
          set -- $run
          policy=$1; shift
          "$bin/kvrecall" replay --server="$kvrecalld_address" --trace="$trace" --json \
            --placement=$placement --policy=$policy "$@" >> "$out/placement_replay.jsonl" \
            2>> "$logs/replay.log" || { status=1; echo "replay $placement $run failed"; tail -n 3 "$logs/replay.log"; }
        done
      done
      while read -r run; do
        [ -n "$run" ] || continue
        set -- $run
        policy=$1; shift
        "$bin/kvrecall" replay --server="$kvrecalld_address" --trace="$trace" --json \
          --placement=tiered --policy=$policy "$@" >> "$out/placement_replay.jsonl" \
          2>> "$logs/replay.log" || { status=1; echo "replay tiered $run failed"; tail -n 3 "$logs/replay.log"; }
      done <<< "${TIERED_RUNS:-full
exact_topk --k=512
index --k=512
retopk --k=512 --auto_tau
exact_topk --k=2048
index --k=2048
retopk --k=2048 --auto_tau
streaming --sinks=128 --recent=512}"
      kill "$server"; wait "$server"
      python3 bench/placement_check.py "$out/placement_replay.jsonl" \
        --markdown "$out/placement_replay.md" || status=1 ;;
    serving)
      # SERVING_RUNS: one gpu_serving_bench per line (its flags), each its own JSON
      # (gpu_serving_TAGN.json) and at most SERVING_TIMEOUT seconds, so that one slow run keeps
      # the others' figures.
      # SERVING_SERVER_FLAGS: kvrecalld's flags for these runs; SERVING_TAG: a prefix of the
      # file names, so that calls with other flags keep their own.
      # SERVING_KVRECALLD: another kvrecalld to serve them (a baseline build, bundled apart).
      tag=${SERVING_TAG:-}
      start_kvrecalld "${SERVING_KVRECALLD:-$bin/kvrecalld}" "$logs/kvrecalld_serving$tag.log" \
        --address=127.0.0.1:0 ${SERVING_SERVER_FLAGS:-} || status=1
      server=$kvrecalld_pid
      n=0
      while read -r run; do
        [ -n "$run" ] || continue
        n=$((n + 1))
        echo "serving $n: $run"
        timeout "${SERVING_TIMEOUT:-300}" "$bin/gpu_serving_bench" --server="$kvrecalld_address" \
          --out="$out/gpu_serving_$tag$n.json" $run > /dev/null 2> "$logs/serving_$tag$n.log" ||
          { status=1; echo "serving $n failed or timed out"; }
        tail -n 40 "$logs/serving_$tag$n.log"
      done <<< "${SERVING_RUNS:-${SERVING_FLAGS:-}}"
      kill "$server"; wait "$server" ;;
    kernels)
      "$bin/cuda_decode_bench" --out="$out/cuda_decode_own.json" ${KERNEL_FLAGS:-} \
        > "$logs/kernels.log" 2>&1 || status=1
      tail -n 12 "$logs/kernels.log"
      PYTHONUNBUFFERED=1 python3 bench/cuda_torch_baseline.py --out="$out/cuda_decode_torch.json" \
        ${TORCH_FLAGS:-} > "$logs/torch.log" 2>&1 || status=1
      tail -n 12 "$logs/torch.log" ;;
    match)
      for t in cuda_retopk_match_test cuda_retopk_test; do
        timeout 300 "$bin/$t" --gtest_brief=1 > "$logs/$t.log" 2>&1 || status=1
        tail -n 5 "$logs/$t.log"
      done
      for tool in memcheck racecheck; do
        timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool $tool --error-exitcode 9 \
          "$bin/cuda_retopk_match_test" --gtest_brief=1 > "$logs/match_$tool.log" 2>&1
        rc=$?; [ $rc -eq 0 ] || status=1
        echo "$tool cuda_retopk_match_test (rc $rc): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$logs/match_$tool.log" | tr '\n' ' ')"
      done
      timeout "${MATCH_TIMEOUT:-420}" "$bin/retopk_match_bench" --out="$out/retopk_match.json" \
        ${MATCH_FLAGS:-} > /dev/null 2> "$logs/retopk_match.log" || status=1
      cat "$logs/retopk_match.log" ;;
  esac
done
tar czf "$out/placement_logs.tgz" -C "$(dirname "$logs")" placement_logs
exit $status
