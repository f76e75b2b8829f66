#!/usr/bin/env bash
# Sixth call: why a Decode step's compute over gRPC is 3.5x the same step over shared memory
# (OpenMP teams per gRPC thread?), and the empty round trip against the echo, ABAB, alone.
set -u
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
B=$PWD/.device/lead/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/lead/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d6; mkdir -p $L
echo "host: $(nproc) CPUs"
summ() { python3 -c 'import json,sys
r=json.load(open(sys.argv[1])); print(sys.argv[2], r["transport"], "empty", round(r["empty_us"]["p50"],1), "step", round(r["layer_step_us"]["p50"],1), "compute", round(r["layer_step_server_us"]["p50"],1), "step-compute", round(r["layer_step_minus_server_us"]["p50"],1), "srvcpu/step", r["cpu_per_round_trip"]["layer_step"]["server_process_cpu_us"], "alone1t", round(r["attention_alone_us"]["one_thread"]["p50"],1))' "$@"; }
variant() {  # variant NAME ENV... -- FLAGS...
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" bash -c '. scripts/kvrecalld.sh; start_kvrecalld "$0" "$1" --address=127.0.0.1:0 --shared_memory_dir=/dev/shm "${@:2}"; echo "$kvrecalld_pid $kvrecalld_address" > '$L'/srv; wait $kvrecalld_pid' $B/kvrecalld $L/$name.log "$@" &
  local w=$!; sleep 1.5; read pid address < $L/srv
  for t in tcp shm; do
    extra=""; [ $t = shm ] && extra=--shared_memory
    timeout 60 $B/rpc_overhead --server=$address --server_pid=$pid --iterations=3000 --warmup=500 $extra --json_out=$L/$name.$t.json > /dev/null 2>&1
    summ $L/$name.$t.json $name
    echo "$name threads after $t: $(ls /proc/$pid/task | wc -l)"
  done
  kill $pid; wait $w 2>/dev/null
}
variant default X=1 --
variant passive OMP_WAIT_POLICY=passive --
variant active OMP_WAIT_POLICY=active --
variant queue X=1 -- --inline_decode_steps=0
variant omp1 OMP_NUM_THREADS=1 --
variant default2 X=1 --
# The empty round trip alone, ABAB against the callback echo (both servers up, rounds alternate).
$B/echo_floor --api=callback --address=127.0.0.1:0 > $L/echo.log 2>&1 & epid=$!
start_kvrecalld $B/kvrecalld $L/k.log --address=127.0.0.1:0
sleep 0.5; eaddr=$(sed -n 's/^echo_floor listening on \([^ ]*\).*/\1/p' $L/echo.log)
for r in 1 2 3 4 5 6 7; do
  e=$(timeout 30 $B/rpc_overhead --protocol=echo --server=$eaddr --count_only=empty --iterations=3000 2>&1 | tr '\n' ' ')
  k=$(timeout 30 $B/rpc_overhead --protocol=kvrecall --server=$kvrecalld_address --count_only=empty --iterations=3000 2>&1 | tr '\n' ' ')
  echo "round $r echo: $e"; echo "round $r kvrecalld: $k"
done
kill $epid $kvrecalld_pid; wait 2>/dev/null
cd $L && tar czf $OUT/d6_out.tgz *.json *.log
