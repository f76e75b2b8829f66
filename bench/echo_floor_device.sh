#!/usr/bin/env bash
# The per-layer hop on the GPU machine, in one device call (bench/results/rpc_floor.md and
# gpu_serving.md have the commands that make the bundle): run from the repository root with
# the bundle shipped as .device/hop/ship/bundle.tar.xz (bin/: echo_floor, rpc_overhead,
# kvrecalld, gpu_serving_bench; lib/; python/_gen and python/bench/echo_floor_pb2.py).
#   bench/echo_floor_device.sh [gputest] [floor] [alone] [queue] [work] [serving] [serving_queue]
# gputest: the GPU placement's tests (gpu_placement_test, GPU_TEST_FILTER) on the bundle's
# kvrecalld code;
# floor: bench/echo_floor.sh (echo sync / callback / kvrecalld, TCP and Unix, C++ and Python;
# also kvrecalld-base when the bundle has bin/kvrecalld-base, and kvrecalld-1t; FLOOR_S bounds it,
# default 100 s);
# alone: echo-callback and kvrecalld (TCP, C++ client), empty round trips with no layer-step
# between them, then layer-steps alone (rpc_overhead --count_only);
# queue: kvrecalld with --inline_decode_steps=0 (every step handed to a worker, as before),
# C++ client; work: the echo floor with the server busy for WORK_US (default "100 300") per
# layer-step, as a step's compute would keep it; serving: bench/gpu_serving_bench against
# kvrecalld (SERVING_FLAGS), serving_queue: the same against --inline_decode_steps=0
# (SERVING_QUEUE_FLAGS, default SERVING_FLAGS).
# Each step is bounded in time, and none starts after BUDGET_S (default 225) seconds from the
# start, so that the call ends inside the device tool's limit. Outputs go to $OUT (JSON, tables),
# logs to $OUT/hop_logs.tgz.
set -uo pipefail
hop=$PWD/.device/hop
. bench/device_env.sh
device_env "$hop" "$hop/bundle" hop_logs
. scripts/kvrecalld.sh
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
echo "host: $(nproc) CPUs, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1), $(uname -r)"
echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null);" \
  "vector: $(grep -o -w -E 'avx2|fma|avx512f' /proc/cpuinfo | sort -u | tr '\n' ' ')"
python3 -c 'import grpc, google.protobuf, numpy; print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "numpy", numpy.__version__)' || true
if [ ! -d client/python/kvrecall/_gen ] && [ -d "$bundle/python/_gen" ]; then
  cp -r "$bundle/python/_gen" client/python/kvrecall/_gen
fi
# cap SECONDS: SECONDS, or what is left of the budget if that is less.
cap() {
  local left=$(( ${BUDGET_S:-225} - SECONDS ))
  echo $(( left < $1 ? left : $1 ))
}
serving() {  # serving NAME FLAGS [KVRECALLD FLAG...]
  local name=$1 flags=$2
  shift 2
  start_kvrecalld "$bin/kvrecalld" "$logs/kvrecalld_$name.log" --address=127.0.0.1:0 "$@" \
    || { status=1; return; }
  local server=$kvrecalld_pid
  # shellcheck disable=SC2086
  timeout "$(cap 90)" "$bin/gpu_serving_bench" --server="$kvrecalld_address" \
    --out="$out/gpu_serving_$name.json" $flags > /dev/null 2> "$logs/$name.log" \
    || status=1
  echo "== gpu_serving_bench $name (kvrecalld $*)"
  cat "$logs/$name.log"
  kill "$server"
  wait "$server"
}
for step in "$@"; do
  if [ "$(cap 1000)" -lt 15 ]; then
    echo "== $step skipped: the time budget is spent"
    status=1
    continue
  fi
  case $step in
    gputest)
      timeout "$(cap 90)" "$bin/gpu_placement_test" --gtest_brief=1 \
        --gtest_filter="${GPU_TEST_FILTER:-*}" > "$logs/gpu_placement_test.log" 2>&1 || status=1
      grep -E '^\[  (FAILED|PASSED) |^\[==========\]|Failure' "$logs/gpu_placement_test.log" | head -n 20 ;;
    floor)
      # With the bundle's kvrecalld-base (an earlier build): before and after in one run.
      servers="echo-sync echo-callback kvrecalld kvrecalld-1t"
      [ -x "$bin/kvrecalld-base" ] && servers="echo-sync echo-callback kvrecalld-base kvrecalld kvrecalld-1t"
      SERVERS=${SERVERS:-$servers} ITERATIONS=${ITERATIONS:-3000} \
        PY_ITERATIONS=${PY_ITERATIONS:-1000} CLIENTS=${CLIENTS:-c++ python-numpy} \
        timeout "$(cap ${FLOOR_S:-100})" bash bench/echo_floor.sh "$bin" "$bundle/python" "$logs/floor" \
        > "$logs/floor.log" 2>&1 || status=1
      cp "$logs/floor/rpc_floor_table.md" "$out/rpc_floor_table.md" 2>/dev/null
      cat "$out/rpc_floor_table.md" ;;
    queue)
      KVRECALLD_FLAGS=--inline_decode_steps=0 SERVERS=kvrecalld CLIENTS=c++ \
        ITERATIONS=${ITERATIONS:-3000} timeout "$(cap 40)" bash bench/echo_floor.sh "$bin" "" \
        "$logs/queue" > "$logs/queue.log" 2>&1 || status=1
      cp "$logs/queue/rpc_floor_table.md" "$out/rpc_floor_queue_table.md" 2>/dev/null
      grep '^| c++' "$out/rpc_floor_queue_table.md" ;;
    work)
      mkdir -p "$logs/work"
      for api in sync callback; do
        "$bin/echo_floor" --api=$api --address=127.0.0.1:0 > "$logs/work/echo_$api.log" 2>&1 &
        pid=$!
        sleep 0.5
        address=$(sed -n 's/^echo_floor listening on \([^ ]*\).*/\1/p' "$logs/work/echo_$api.log")
        for w in ${WORK_US:-100 300}; do
          timeout "$(cap 20)" "$bin/rpc_overhead" --protocol=echo --server="$address" --server_pid=$pid \
            --label="echo-$api work $w" --echo_work_us=$w --iterations=${WORK_ITERATIONS:-2000} \
            --json_out="$logs/work/echo-${api}_work$w.json" > "$logs/work/echo-${api}_work$w.log" \
            2>&1 || status=1
          echo "echo-$api work $w us: $(grep -E '^  layer-step' "$logs/work/echo-${api}_work$w.log" | tr -s ' ' | tr '\n' ';')"
        done
        kill $pid
        wait $pid 2>/dev/null
      done ;;
    alone)
      # Empty round trips with no layer-step between them (the pairs alternate the two): whether
      # the step before slows kvrecalld's empty round trip (team wake-ups, caches) on this host.
      mkdir -p "$logs/alone"
      for server in echo-callback kvrecalld; do
        if [ $server = kvrecalld ]; then
          start_kvrecalld "$bin/kvrecalld" "$logs/alone/kvrecalld.log" --address=127.0.0.1:0 \
            || { status=1; continue; }
          pid=$kvrecalld_pid address=$kvrecalld_address protocol=kvrecall
        else
          "$bin/echo_floor" --api=callback --address=127.0.0.1:0 > "$logs/alone/echo.log" 2>&1 &
          pid=$!
          sleep 0.5
          address=$(sed -n 's/^echo_floor listening on \([^ ]*\).*/\1/p' "$logs/alone/echo.log")
          protocol=echo
        fi
        for kind in empty layer_step; do
          timeout "$(cap 30)" "$bin/rpc_overhead" --protocol=$protocol --server="$address" \
            --label=$server --count_only=$kind --iterations=${ITERATIONS:-3000} || status=1
        done
        kill $pid
        wait $pid 2>/dev/null
      done ;;
    serving) serving inline "${SERVING_FLAGS:-}" ;;
    serving_queue) serving queue "${SERVING_QUEUE_FLAGS:-${SERVING_FLAGS:-}}" --inline_decode_steps=0 ;;
  esac
done
python3 -c 'import json, os, sys
print(json.dumps({os.path.relpath(f, sys.argv[1]): json.load(open(f)) for f in sys.argv[2:]}))' \
  "$logs" $(find "$logs" -name '*.json') > "$out/rpc_floor_runs.json" || status=1
tar czf "$out/hop_logs.tgz" -C "$(dirname "$logs")" hop_logs
exit $status
