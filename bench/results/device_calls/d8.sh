#!/usr/bin/env bash
# Eighth call: the compute pool's idle policy, tiered 128K and the hop, servers alternating:
# base (dcdc8f9), nolpt (the pool, polling 100 us: 5 us on the core, then yielding), new (the
# same + tiered heads longest-first), spin0 (new with --compute_spin_us=0: sleep at once),
# pause (new polling 100 us on the core, no yields).
set -u
tar -C .device/lead -xJf .device/lead/ship/bundle.tar.xz
B=$PWD/.device/lead/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/lead/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d8; mkdir -p $L
echo "host: $(nproc) CPUs; $(lscpu | grep -E 'Thread|Core|Socket' | tr -s ' ' | tr '\n' ';')"
n=0
for v in base nolpt new spin0 pause base nolpt new spin0 pause; do
  n=$((n + 1))
  case $v in base) k=$B/kvrecalld-base f="";; nolpt) k=$B/kvrecalld-nolpt f="";; new) k=$B/kvrecalld f="";; spin0) k=$B/kvrecalld f=--compute_spin_us=0;; pause) k=$B/kvrecalld-pause f="";; esac
  start_kvrecalld $k $L/k$n.log --address=127.0.0.1:0 $f || continue
  timeout 60 $B/rpc_overhead --server=$kvrecalld_address --server_pid=$kvrecalld_pid --iterations=2000 --warmup=300 --label=$v --json_out=$L/hop$n.json > /dev/null 2>&1
  timeout 120 $B/gpu_serving_bench --server=$kvrecalld_address --out=$L/serving$n.json --placement=tiered --contexts=131072 --batches=1 --selectors=retopk,index --auto_tau --steps=40 --warmup=5 > /dev/null 2> $L/serving$n.log
  kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
  python3 -c 'import json,sys
h=json.load(open(sys.argv[1])); c=h["cpu_per_round_trip"]["layer_step"]
print(sys.argv[3], "hop tcp: empty", round(h["empty_us"]["p50"],1), "step", round(h["layer_step_us"]["p50"],1), "compute", round(h["layer_step_server_us"]["p50"],1), "srv cpu/step", round(c["server_process_cpu_us"]))
for r in json.load(open(sys.argv[2]))["records"]: print(sys.argv[3], r["selector"], "srv", round(r["server_p50_us"]), round(r["server_p99_us"]), "e2e", round(r["e2e_p50_us"]), "ss", round(r["static_set_p50_us"]), "bulk", round(r["bulk_p50_us"]), {k:(round(v["bulk_p50_us"]),round(v["candidates_mean"])) for k,v in r["head_bulk_by_path"].items()}, "build", round(r["build_seconds_max"],3))' $L/hop$n.json $L/serving$n.json "$n $v"
done
# Empty round trips interleaved with layer-steps (the floor table's pairs), TCP, C++: the
# callback echo against the new kvrecalld, three rounds ABAB.
$B/echo_floor --api=callback --address=127.0.0.1:0 > $L/echo.log 2>&1 & epid=$!
start_kvrecalld $B/kvrecalld $L/knew.log --address=127.0.0.1:0
sleep 0.3; eaddr=$(sed -n 's/^echo_floor listening on \([^ ]*\).*/\1/p' $L/echo.log)
for r in 1 2 3; do
  timeout 60 $B/rpc_overhead --protocol=echo --server=$eaddr --server_pid=$epid --iterations=3000 --warmup=500 --json_out=$L/pairs_echo$r.json > /dev/null 2>&1
  timeout 60 $B/rpc_overhead --server=$kvrecalld_address --server_pid=$kvrecalld_pid --iterations=3000 --warmup=500 --json_out=$L/pairs_new$r.json > /dev/null 2>&1
  python3 -c 'import json,sys
for f in sys.argv[1:]:
  h=json.load(open(f)); print(f.split("/")[-1], "empty", round(h["empty_us"]["p50"],1), round(h["empty_us"]["p99"],1), "step", round(h["layer_step_us"]["p50"],1), round(h["layer_step_us"]["p99"],1), "compute", round((h.get("layer_step_server_us") or {}).get("p50", 0),1))' $L/pairs_echo$r.json $L/pairs_new$r.json
done
kill $epid $kvrecalld_pid; wait 2>/dev/null
cd $L && tar czf $OUT/d8.tgz *.json *.log
