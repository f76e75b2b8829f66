#!/usr/bin/env bash
# Runs on the GPU machine through the device tool, from the repository root, with the binaries
# bundled under .device/bundle (bench/results/cuda_decode.md has the exact commands):
#   bench/cuda_device_run.sh [tests] [bench] [profile] [sanitize]
# Logs go to $OUT/logs.tgz; the benchmark's JSON, summary and plot to $OUT directly.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/bundle/lib
bin=$PWD/.device/bundle/bin
out=${OUT:-/tmp/out}
logs=$(mktemp -d)/logs
mkdir -p "$out" "$logs"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
for step in "$@"; do
  case $step in
    tests)
      for t in cuda_partial_attention_test cuda_exact_topk_test cuda_retopk_test; do
        "$bin/$t" --gtest_brief=1 > "$logs/$t.log" 2>&1 || status=1
        tail -n 25 "$logs/$t.log"
      done ;;
    bench)
      "$bin/cuda_decode_bench" --out="$out/cuda_decode_own.json" > "$logs/bench.log" 2>&1 \
        || status=1
      tail -n 15 "$logs/bench.log"
      PYTHONUNBUFFERED=1 python3 bench/cuda_torch_baseline.py \
        --out="$out/cuda_decode_torch.json" > "$logs/torch.log" 2>&1 || status=1
      tail -n 15 "$logs/torch.log"
      python3 bench/cuda_plot.py --own="$out/cuda_decode_own.json" \
        --torch="$out/cuda_decode_torch.json" --png="$out/cuda_decode.png" \
        --summary="$out/cuda_decode_summary.json" --markdown="$out/cuda_decode_table.md" \
        || status=1 ;;
    profile)
      # Per-kernel times of one configuration of every path (ncu works on this machine type).
      for b in 1 8; do
        ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
          "$bin/cuda_decode_bench" --batches=$b --contexts=131072 --reps=3 \
          > "$logs/ncu_b$b.csv" 2> "$logs/ncu_b$b.err" || status=1
        echo "batch $b, context 131072:"
        python3 bench/cuda_kernel_times.py "$logs/ncu_b$b.csv"
      done | tee "$out/cuda_kernel_times.txt" ;;
    sanitize)
      # One geometry per kernel family plus the edge-case tests, each run bounded in time.
      for tool in memcheck racecheck; do
        for spec in "cuda_partial_attention_test:*q16kv4d128bf16*:CudaMerge*:*Errors*" \
                    "cuda_exact_topk_test:*q16kv4d64f16*:*Ties*:*ActiveRows*:*Errors*:CudaRowTopK*" \
                    "cuda_retopk_test:*q8kv8d64f16*:CudaBatchTopK*"; do
          t=${spec%%:*}
          timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/$t" \
            --gtest_filter="${spec#*:}" --gtest_brief=1 > "$logs/${tool}_$t.log" 2>&1
          rc=$?
          [ $rc -eq 0 ] || status=1
          echo "$tool $t (rc $rc): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' \
            "$logs/${tool}_$t.log" | tr '\n' ' ')"
        done
      done ;;
  esac
done
tar czf "$out/logs.tgz" -C "$(dirname "$logs")" logs
exit $status
