#!/usr/bin/env bash
# Eighty-ninth call: what d88 left. (1) The Python client's tests again, with the one d88 failed
# mended (WireTest's NaN payload: once the hf tests have imported torch, numpy inputs convert
# through torch, which keeps a NaN's payload; the test now asks for a NaN, not numpy's payload).
# (2) The transformers backend with hf_demo's checks in force (d88's policies, as d82's, hold
# none): cpu `full` in f32 against SDPA (the tiered run of this f32 call was refused: a GPU
# tier serves bf16 and f16 only; d90 runs it in bf16).
# Carry: .device/b88/ship (d88's bundle), .device/model, client/python/kvrecall/_gen.
set -u
tar -C .device/b88 -xJf .device/b88/ship/bundle.tar.xz
B=$PWD/.device/b88/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b88/bundle/lib
. scripts/kvrecalld.sh
L=/tmp/d89; mkdir -p $L
S=$OUT/d89_summary.txt
(cd tests && KVRECALLD=$B/kvrecalld KVRECALL_CLI=$B/kvrecall PYTHONPATH=$PWD/../client/python \
  KVRECALL_SOURCE_DIR=$PWD/.. timeout 280 python3 -m unittest -v python_client_test \
  > $L/python_client_test.log 2>&1; echo "python_client_test rc $? t=$SECONDS" | tee -a $S)
tail -3 $L/python_client_test.log | tee -a $S
grep -E "HfBackendTest|skipped|FAIL|ERROR" $L/python_client_test.log | head -20 | tee -a $S
start_kvrecalld $B/kvrecalld $L/kvrecalld_hf.log --address=127.0.0.1:0 || exit 1
PYTHONPATH=client/python timeout 200 python3 -m kvrecall.hf_demo --server "$kvrecalld_address" \
  --model .device/model/tinylm-a.npz --text .device/model/prompt.txt --prompt 8192 --new 64 \
  --batch 2 --dtype f32 --exact-search graph --policies full index:512 tiered/index:512 \
  --out $OUT/hf_demo_d89.json > $L/hf.log 2>&1
echo "hf_demo rc $? t=$SECONDS" | tee -a $S
python3 -c 'import json,sys
d=json.load(open(sys.argv[1]))
print("ok", d.get("ok"), "checks", d.get("checks"))
for r in d["runs"]: print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"), r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"), r.get("first_divergence_from_cpu"), "must", r.get("must_match_cpu"), "s", round(r.get("seconds", 0), 2), "error" if "error" in r else "")' $OUT/hf_demo_d89.json 2>&1 | tee -a $S
tail -3 $L/hf.log | tee -a $S
kill $kvrecalld_pid; wait $kvrecalld_pid 2>/dev/null
cd $L && tar czf $OUT/d89_logs.tgz *.log 2>/dev/null
