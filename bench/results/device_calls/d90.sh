#!/usr/bin/env bash
# Ninetieth call: hf_demo's second check, which d89's f32 call could not hold (a GPU tier
# serves bf16 and f16 only): tiered `index` with the cpu placement's search (the graph, asked
# for by name) must give the cpu placement's bytes, in bf16, through the transformers backend
# with the mask function it now registers.
# Carry: .device/b88/ship (d88's bundle), .device/model, client/python/kvrecall/_gen.
set -u
tar -C .device/b88 -xJf .device/b88/ship/bundle.tar.xz
B=$PWD/.device/b88/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b88/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d90; mkdir -p $L
S=$OUT/d90_summary.txt
start_kvrecalld $B/kvrecalld $L/kvrecalld_hf.log --address=127.0.0.1:0 || exit 1
PYTHONPATH=client/python timeout 200 python3 -m kvrecall.hf_demo --server "$kvrecalld_address" \
  --model .device/model/tinylm-a.npz --text .device/model/prompt.txt --prompt 8192 --new 64 \
  --batch 2 --dtype bf16 --exact-search graph --policies index:512 tiered/index:512 \
  --out $OUT/hf_demo_d90.json > $L/hf.log 2>&1
echo "hf_demo rc $? t=$SECONDS" | tee -a $S
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print("ok", d.get("ok"), "checks", d.get("checks"))
for r in d["runs"]: print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"), r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"), r.get("first_divergence_from_cpu"), "must", r.get("must_match_cpu"), "s", round(r.get("seconds", 0), 2), "error" if "error" in r else "")' $OUT/hf_demo_d90.json 2>&1 | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
