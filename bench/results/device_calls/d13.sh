#!/usr/bin/env bash
# Thirteenth call (d12 again, the table built once per row, GPU and host parts split): candidate scoring off the host. The GPU shortlist's parity test, then
# pq_shortlist_bench (graph search vs PQ shortlist + host rescoring) at 128K and 512K.
set -u
tar -C .device/b11 -xJf .device/b11/ship/bundle.tar.xz
B=$PWD/.device/b11/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b11/bundle/lib
L=/tmp/d13; mkdir -p $L
nvidia-smi --query-gpu=name,memory.used --format=csv > $L/gpu.txt
lscpu | head -20 > $L/cpu.txt
timeout 120 $B/cuda_pq_shortlist_test > $L/test.log 2>&1; echo "test rc $?" | tee -a $OUT/d13_summary.txt
tail -4 $L/test.log | tee -a $OUT/d13_summary.txt
timeout 240 $B/pq_shortlist_bench --context=131072 --shortlists=1024,2048,4096 > $L/bench128k.json 2> $L/bench128k.log; echo "128k rc $?" | tee -a $OUT/d13_summary.txt
timeout 300 $B/pq_shortlist_bench --context=524288 --shortlists=2048,4096,8192 --steps=24 > $L/bench512k.json 2> $L/bench512k.log; echo "512k rc $?" | tee -a $OUT/d13_summary.txt
timeout 120 $B/pq_shortlist_bench --context=131072 --graph=false --shortlists=2048 --threads=1 --steps=8 > $L/bench128k_1t.json 2> $L/bench128k_1t.log; echo "128k 1t rc $?" | tee -a $OUT/d13_summary.txt
for f in $L/bench128k.json $L/bench512k.json $L/bench128k_1t.json; do
python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
print(sys.argv[1], {k:r.get(k) for k in ["context","graph_build_s","pq_train_s","pq_encode_s","pq_device_bytes","full_kv_device_bytes"]})
for n,v in r["variants"].items():
  print(" ", n, "total p50/p90", round(v["total_us"]["p50"]), round(v["total_us"]["p90"]), "gpu p50", round(v.get("gpu_us",{}).get("p50",0)), "kernels", round(v.get("gpu_kernels_us",{}).get("p50",0)), "select", round(v.get("gpu_select_alone_us",{}).get("p50",0)), "host p50", round(v["host_us"]["p50"]), "head score/topk/attend", [round(v.get(x,{}).get("p50",0)) for x in ["head_score_us","head_topk_us","head_attend_us"]], "keys", round(v["keys_scored_per_head"]["mean"]), "recall", round(v["recall_at_k"]["mean"],3), "mass", round(v["mass_of_exact_topk"]["mean"],3))' $f 2>&1 | tee -a $OUT/d13_summary.txt
done
cd $L && tar czf $OUT/d13.tgz *
