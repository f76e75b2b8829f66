#!/usr/bin/env bash
# Written 2026-12-06 (fifteenth session) for tiered_serving.md ("A model's layers in turn",
# "What a captured step holds") and device_tests.md.
# Hundred-and-thirty-first call:
# (1) bench/model_tokens.py, 32 layers, a 640-token prompt, bulk 900 -> 4100, no max_tokens,
# index: b130's kvrecalld (a host KV array reserves 4x its allocation, so all 64 arrays move at
# 4609 rows, bulk 3969: 155 ms in d130) against b131's (each array reserves address space for
# the most tokens its layer will hold, up to 1 GiB: no move), alternating;
# (2) driver_call_bench's spelled graphs, each in a process of its own (d130 measured them in
# one process, where the driver's pool, grown for the first, served the rest), 1 and 256
# executable copies: the device memory one takes;
# (3) the whole suite at b131 (captured steps charged to the GPU budget, tried again, dropped
# when stale: GpuExactHeadsTest.ACapturedStepIsChargedWhileKeptAndRunsEagerlyWithoutRoom,
# .AStaleCapturedStepGivesItsChargeBack, GpuPlacementTest.AKeptCapturedStepIsChargedToTheGpuBudget).
# Bundles: .device/b130 and .device/b131. Carry both ship/ and client/python/kvrecall/_gen.
set -u
. bench/device_call.sh
tar -C .device/b130 -xJf .device/b130/ship/bundle.tar.xz
OLD=$PWD/.device/b130/bundle/bin
device_call_begin 131
for binary in moves:$OLD reserves:$B; do
  model_tokens_run index_${binary%%:*} ${binary#*:}/kvrecalld index --layers=32 --prompt=640 \
    --from=900 --to=4100
done
python3 - $R <<'PY' 2>&1 | tee -a $S
import json, statistics as st, sys
for name in ("moves", "reserves"):
    d = json.load(open(f"{sys.argv[1]}/index_{name}.json"))
    s = d["server_us_by_token"]
    print(name, "median %.1f ms" % (st.median(s) / 1000),
          "p99 %.1f" % (d["token_server_p99_us"] / 1000), "slowest",
          [(t["bulk"], round(t["server_us"] / 1000, 1)) for t in d["slowest_tokens"][:5]])
PY
for graph in served=euKKKKKdekKKKccde served_no_small_copies=euKKKKKdekKKKde \
    served_no_events=uKKKKKdkKKKccd served_kernels_only=KKKKKkKKK step5=eukde \
    nine_big_parameter_kernels=PPPPPPPPP; do
  for copies in 1 256; do
    $B/driver_call_bench --reps=20 --warmup=2 --pool_graphs= --graphs=$graph \
      --graph_copies=$copies > $R/graph_memory_${graph%%=*}_$copies.json 2>> $L/graph_memory.err
    python3 - $R/graph_memory_${graph%%=*}_$copies.json <<'PY' 2>&1 | tee -a $S
import json, sys
d = json.load(open(sys.argv[1]))
for name, m in d["graph_device_bytes"].items():
    print("graph", name, d["graph_launch_us"][name]["graph_nodes"], "nodes", m["copies"],
          "copies", m["bytes"], "B", m["bytes_each"], "B each")
PY
  done
done
bash bench/device_test_suite.sh $B $L $S
tar -C $L -czf $OUT/d131_out.tgz out
device_call_end
