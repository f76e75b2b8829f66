#!/usr/bin/env bash
# Seventh call: the process-wide compute pool (kernels/cpu/thread_pool.h) against the base
# (dcdc8f9, OpenMP regions from whichever thread serves a step): the hop over TCP and shared
# memory, the empty round trip alone ABAB against the callback echo, and tiered 128K.
set -u
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
B=$PWD/.device/lead/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/lead/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d7; mkdir -p $L
echo "host: $(nproc) CPUs; $(date -u)"
summ() { python3 -c 'import json,sys
r=json.load(open(sys.argv[1])); print(sys.argv[2], r["transport"], "empty", round(r["empty_us"]["p50"],1), "step", round(r["layer_step_us"]["p50"],1), "p99", round(r["layer_step_us"]["p99"],1), "compute", round(r["layer_step_server_us"]["p50"],1), "step-compute", round(r["layer_step_minus_server_us"]["p50"],1), "cpu/step client", round(r["cpu_per_round_trip"]["layer_step"]["client_process_cpu_us"],1), "server", r["cpu_per_round_trip"]["layer_step"]["server_process_cpu_us"], "alone 1t/team", round(r["attention_alone_us"]["one_thread"]["p50"],1), round(r["attention_alone_us"]["team"]["p50"],1))' "$@"; }
for round in 1 2; do
  for srv in base new; do
    bin=$B/kvrecalld; [ $srv = base ] && bin=$B/kvrecalld-base
    start_kvrecalld $bin $L/$srv$round.log --address=127.0.0.1:0 --shared_memory_dir=/dev/shm || continue
    for t in tcp shm; do
      extra=""; [ $t = shm ] && extra=--shared_memory
      timeout 60 $B/rpc_overhead --server=$kvrecalld_address --server_pid=$kvrecalld_pid --iterations=3000 --warmup=500 $extra --label=$srv --json_out=$L/hop_${srv}${round}_$t.json > /dev/null 2>&1
      summ $L/hop_${srv}${round}_$t.json $srv$round
    done
    echo "$srv threads: $(ls /proc/$kvrecalld_pid/task | wc -l)"
    kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  done
done
# Empty round trips alone (TCP, C++), rounds alternating the callback echo, new and base.
$B/echo_floor --api=callback --address=127.0.0.1:0 > $L/echo.log 2>&1 & epid=$!
start_kvrecalld $B/kvrecalld $L/knew.log --address=127.0.0.1:0; npid=$kvrecalld_pid naddr=$kvrecalld_address
start_kvrecalld $B/kvrecalld-base $L/kbase.log --address=127.0.0.1:0; bpid=$kvrecalld_pid baddr=$kvrecalld_address
sleep 0.3; eaddr=$(sed -n 's/^echo_floor listening on \([^ ]*\).*/\1/p' $L/echo.log)
for r in 1 2 3 4 5 6 7; do
  for s in echo new base; do
    case $s in echo) a=$eaddr p=echo;; new) a=$naddr p=kvrecall;; base) a=$baddr p=kvrecall;; esac
    echo "alone $r $s: $(timeout 30 $B/rpc_overhead --protocol=$p --server=$a --count_only=empty --iterations=3000 2>&1 | tr '\n' ' ')"
  done
done
kill $epid $npid $bpid; wait 2>/dev/null
cd $L && tar czf $OUT/d7_hop.tgz *.json *.log; cd - > /dev/null
# Tiered 128K, new then base.
for tag in new base; do
  k=$B/kvrecalld; [ $tag = base ] && k=$B/kvrecalld-base
  SERVING_KVRECALLD=$k SERVING_TAG=$tag SERVING_TIMEOUT=150 SERVING_RUNS="--placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5" \
    timeout 170 bash bench/placement_device_run.sh serving 2>&1 | grep -vE "^\s*$" | tail -n 12
done
for f in $OUT/gpu_serving_*.json; do python3 -c 'import json,sys
for r in json.load(open(sys.argv[1]))["records"]: print(sys.argv[1].split("/")[-1], r["selector"], r["context"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, r.get("path_mix"), "build", round(r["build_seconds_max"],3))' "$f"; done
cd "$OUT" && tar czf /tmp/d7_out.tgz . && find . -mindepth 1 -maxdepth 1 ! -name 'd7_hop.tgz' ! -name 'd7_out.tgz' -exec rm -rf {} + ; mv /tmp/d7_out.tgz "$OUT/d7_out.tgz"
