#!/usr/bin/env bash
# Seventy-seventh call: the transformers backend end to end with the tiered exact search's new
# default (the shortlist of N = 2K on the GPU) against the cpu placement (the graph), and the
# graph asked for by name (what ppl_hf_backend_gpu.md's run 2 recorded): tinylm-a as
# LlamaForCausalLM in bf16 on the GPU, 2 prompts of 8192 bytes, 64 greedy bytes each.
# Carry: .device/b77/ship (kvrecalld), .device/model (tinylm-a.npz, prompt.txt: 32 KiB of
# /usr/lib/python3.11 from byte 3,000,000), client/python/kvrecall/_gen.
set -u
tar -C .device/b77 -xJf .device/b77/ship/bundle.tar.xz
B=$PWD/.device/b77/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b77/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d77; mkdir -p $L
S=$OUT/d77_summary.txt
start_kvrecalld $B/kvrecalld $L/kvrecalld.log --address=127.0.0.1:0 || exit 1
for search in default graph; do
  extra=""; [ $search = default ] || extra="--exact-search $search"
  PYTHONPATH=client/python timeout 280 python3 -m kvrecall.hf_demo --server "$kvrecalld_address" \
    --model .device/model/tinylm-a.npz --text .device/model/prompt.txt --prompt 8192 --new 64 \
    --batch 2 --dtype bf16 --auto-tau --policies index:512 tiered/index:512 retopk:512 \
    tiered/retopk:512 $extra --out $OUT/hf_demo_$search.json > $L/hf_$search.log 2>&1
  echo "$search rc $? t=$SECONDS" | tee -a $S
  python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
for r in d["runs"]: print(sys.argv[2], r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"), r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"), r.get("first_divergence_from_cpu"), "s", round(r.get("seconds", 0), 2), "error" if "error" in r else "")' $OUT/hf_demo_$search.json $search 2>&1 | tee -a $S
done
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
tail -5 $L/hf_*.log | tee -a $S
