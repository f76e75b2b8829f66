#!/usr/bin/env bash
# Runs on the GPU machine through the device tool, from the repository root, with the binaries
# bundled here by ../shared/tools/device-bundle into .device/bundle (or shipped compressed as
# .device/ship/bundle.tar.xz, which is unpacked first; bench/results/*.md have the commands):
#   bench/device_run.sh [tests] [bench] [profile] [stride] [sanitize] [rpc] [index] [index_llama]
# tests/bench/profile/stride/sanitize: the CUDA kernels; rpc: a layer-step's round trip against
# the transport's floor on the host's idle cores; index: bench-index on a 128K-token synthetic
# trace (16-core build time); index_llama: issue 15's build target, a 128K-token layer of the
# Llama-3-8B geometry built as the server builds it, top-k lists on the GPU.
# Logs go to $OUT/logs.tgz; the benchmarks' JSON, summaries and plots to $OUT directly.
set -uo pipefail
# BUNDLE: another bundle folder (say, one of the CUDA programs alone).
. bench/device_env.sh
device_env "$PWD/.device" "$PWD/${BUNDLE:-.device/bundle}" logs
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
    stride)
      # Is the [tokens, kv_heads, head_dim] stride what bounds the key-reading kernels? The same
      # bytes with one KV head (each token's key contiguous with the next) for comparison.
      "$bin/cuda_decode_bench" --batches=1 --contexts=131072 --reps=20 \
        --out="$logs/stride_8kv.json" > /dev/null 2>&1 || status=1
      "$bin/cuda_decode_bench" --batches=1 --contexts=1048576 --q_heads=4 --kv_heads=1 --reps=20 \
        --out="$logs/stride_1kv.json" > /dev/null 2>&1 || status=1
      grep -hE "own_full|own_exact" "$logs/stride_8kv.json" "$logs/stride_1kv.json" ;;
    sanitize)
      # One geometry per kernel family plus the edge-case tests, each run bounded in time.
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        for spec in "cuda_partial_attention_test:*q16kv4d128bf16*:CudaMerge*:*Errors*" \
                    "cuda_exact_topk_test:*q16kv4d64f16*:*Ties*:*ActiveRows*:*Errors*:CudaRowTopK*" \
                    "cuda_retopk_test:*q8kv8d64f16*:*q64kv8d128bf16*:CudaBatchTopK*"; do
          t=${spec%%:*}
          timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/$t" \
            --gtest_filter="${spec#*:}" --gtest_brief=1 > "$logs/${tool}_$t.log" 2>&1
          rc=$?
          [ $rc -eq 0 ] || status=1
          echo "$tool $t (rc $rc): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' \
            "$logs/${tool}_$t.log" | tr '\n' ' ')"
        done
      done ;;
    rpc)
      # The transport's floor beside kvrecalld (bench/echo_floor.sh): echo_floor in the sync and
      # the callback API and kvrecalld, over TCP loopback and a Unix socket, C++ and Python
      # clients, with CPU time per round trip. The bundle's python/ holds the generated Python
      # modules (python/_gen as client/python/kvrecall/_gen, python/bench/echo_floor_pb2.py).
      # RPC_TAG names the run; RPC_VARIANTS="name:VAR=value,VAR=value ..." adds kvrecalld runs
      # (C++ client) under other environments, e.g. "omp1:OMP_NUM_THREADS=1".
      tag=${RPC_TAG:-default}
      if [ ! -d client/python/kvrecall/_gen ] && [ -d "$bundle/python/_gen" ]; then
        cp -r "$bundle/python/_gen" client/python/kvrecall/_gen
      fi
      ITERATIONS=${RPC_ITERATIONS:-10000} PY_ITERATIONS=${RPC_PY_ITERATIONS:-4000} \
        bash bench/echo_floor.sh "$bin" "$bundle/python" "$logs/rpc_$tag" || status=1
      for variant in ${RPC_VARIANTS:-}; do
        env ${variant#*:} SERVERS=kvrecalld CLIENTS=c++ ITERATIONS=${RPC_ITERATIONS:-10000} \
          bash bench/echo_floor.sh "$bin" "" "$logs/rpc_${tag}_${variant%%:*}" || status=1
      done
      python3 -c 'import json, os, sys
print(json.dumps({os.path.relpath(f, sys.argv[1]): json.load(open(f)) for f in sys.argv[2:]}))' \
        "$logs" "$logs"/rpc_"$tag"*/*_*_*.json > "$out/rpc_floor_$tag.json" || status=1
      cat "$logs"/rpc_"$tag"*/rpc_floor_table.md > "$out/rpc_floor_$tag.md" ;;
    index)
      # tinylm's geometry (8 query / 2 KV heads, d = 64), 128K prompt tokens, 2 layers.
      trace=$(mktemp -d)/synth128k.safetensors
      "$bin/kvrecall" synth --out="$trace" --context=131072 --decode_steps=64 \
        --layers=2 > "$logs/synth.log" 2>&1 || status=1
      "$bin/kvrecall" bench-index --trace="$trace" --k=100 --json \
        --lists=100,150,200,300,500,800,1200,2000 > "$out/index_synth128k.json" \
        2> "$logs/bench_index.log" || status=1
      # The graph alone with its top-k lists from cuBLAS, with the default and 4x the sampled
      # prefill queries.
      for queries in 4096 16384; do
        "$bin/kvrecall" bench-index --trace="$trace" --k=100 --json --methods=graph \
          --graph_topk=gpu --build_queries=$queries --lists=100,150,200,300,500,800,1200,2000 \
          > "$out/index_synth128k_gpu_q$queries.json" 2>> "$logs/bench_index.log" || status=1
      done
      tail -n 25 "$logs/bench_index.log"
      head -c 3000 "$out/index_synth128k.json"; echo ;;
    index_llama)
      # Issue 15's target: index build <= 0.5 s per layer at 128K tokens, Llama-3-8B geometry
      # (32 query / 8 KV heads, d = 128). bench-index builds each layer with the index
      # selector, as the server does (a KV head's 4 query heads' top-k lists in one GPU batch
      # top-k, the 32 head graphs side by side on the host's threads); two layers, the first
      # of which also pays the GPU's first allocations (build_seconds_by_layer). The default
      # build queries and 4x them (every 8th prompt query; the issue's "default should rise").
      # INDEX_BASE_BUNDLE: another bundle whose kvrecall runs the same, before / after in one call;
      # INDEX_CONTEXT, INDEX_QUERIES, INDEX_TOPK (gpu): smaller or CPU runs, for trying the step;
      # INDEX_WIDTHS: the graph search widths to measure (policy.index.search_width; default 1);
      # INDEX_SCOPES: the graph scopes (policy.index.graph_scope: kv_head, one graph per KV head
      # shared by its 4 query heads; query_head, one per query head; default both);
      # INDEX_THREADS: OMP_NUM_THREADS values (default the host's; 8 KV-head graphs on 8
      # threads build side by side, one thread each, on 16 one after another on all of them);
      # INDEX_KEYS: bench-index --keys values (f32, the default: keys widened to f32 in ordinary
      # memory; served: in the trace's dtype in mapped memory, as kvrecalld's KV store holds
      # them; a run with --keys other than f32 gets a _keys<value> suffix).
      trace=$(mktemp -d)/llama128k.safetensors
      /usr/bin/time -f "trace made in %e s" "$bin/kvrecall" synth --out="$trace" \
        --context=${INDEX_CONTEXT:-131072} --decode_steps=64 --layers=2 --q_heads=32 --kv_heads=8 \
        --head_dim=128 > "$logs/synth_llama.log" 2>&1 || status=1
      tail -n 1 "$logs/synth_llama.log"
      for run in "new:$bin" ${INDEX_BASE_BUNDLE:+"base:$INDEX_BASE_BUNDLE/bin"}; do
        name=${run%%:*}; dir=${run#*:}
        for queries in ${INDEX_QUERIES:-4096 16384}; do
          for width in ${INDEX_WIDTHS:-1}; do
            for scope in ${INDEX_SCOPES:-query_head kv_head}; do
              for threads in ${INDEX_THREADS:-$(nproc)}; do
                for keys in ${INDEX_KEYS:-f32}; do
                  suffix=$([ "$width" = 1 ] || echo "_w$width")_${scope}_t$threads
                  suffix=$suffix$([ "$keys" = f32 ] || echo "_keys$keys")
                  OMP_NUM_THREADS=$threads LD_LIBRARY_PATH=$(dirname "$dir")/lib "$dir/kvrecall" \
                    bench-index --trace="$trace" \
                    --k=100 --json --methods=graph --graph_topk=${INDEX_TOPK:-gpu} \
                    --build_queries=$queries --search_width=$width --graph_scope=$scope \
                    $([ "$keys" = f32 ] || echo "--keys=$keys") \
                    --lists=100,150,200,300,500,800,1200,2000 \
                    > "$out/index_llama128k_${name}_q$queries$suffix.json" \
                    2>> "$logs/bench_index_llama.log" \
                    || { status=1; tail -n 5 "$logs/bench_index_llama.log"; }
                done
              done
            done
          done
        done
      done
      python3 bench/index_summary.py "$out"/index_llama128k_*.json || status=1 ;;
  esac
done
tar czf "$out/${LOGS_NAME:-logs}.tgz" -C "$(dirname "$logs")" logs
exit $status
