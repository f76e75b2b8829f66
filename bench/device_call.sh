# Sourced by the device-call scripts (bench/results/device_calls/dNN.sh, from d98 on): what every
# call to the GPU machine (an H200, or an H100) does around its measurements, so that a script
# holds only those.
#
#   . bench/device_call.sh
#   device_call_begin 98        # unpacks .device/b98/ship/bundle.tar.xz; sets B (its bin/),
#                               # L (/tmp/d98, the logs), S ($OUT/d98_summary.txt), N (98),
#                               # R ($L/out: raw results a script tars into $OUT)
#   bash bench/device_test_suite.sh $B $L $S
#   serving_summary $L/x.json   # one line per gpu_serving_bench record, into $S
#   hf_demo_check NAME          # the transformers backend end to end, into $OUT/NAME.json
#   takeover_run NAME BIN [F..] # d98's take-over run against kvrecalld BIN with flags F
#   tiered_rows BIN CONTEXT...  # issue 15's headline rows (batch 1) at each context
#   rows_run NAME CONTEXT STEPS # one run of those rows against $kvrecalld_address (d145 on)
#   steps_tail FILE [slowest]   # a rows JSON's tail: p90, p99, slow steps (d145 on)
#   api_windows FILE            # bench/cuda_api_timer.c's heaviest windows of calls
#   timed_kvrecalld SHIM F US   # $L/kvrecalld_timed: kvrecalld under that shim
#   pq_encode_runs NAME BIN..   # pq_encode_bench of each BIN dir in turn, into $R (d118 on)
#   ncu_pq_encode NAME ROWS..   # ncu's report of PqEncodeKernel at ROWS rows, into $R
#   api_bursts FILE             # the shim's allocation bursts on the stepping threads
#   takeover_calls SHIM         # a batch-1 take-over run under the shim at 3 us, its bursts
#   model_tokens_run NAME BIN SELECTOR [ARGS..]  # bench/model_tokens.py against kvrecalld
#                               # BIN (d123 on), into $R/NAME.json
#                               # (KVRECALLD_FLAGS: flags for that kvrecalld, d127 on)
#   model_tokens_stretches NAME..  # each $R/NAME.json's stretches around the learning (d127 on;
#                               # the 32 layers' staggered take-overs from d130 on)
#   model_tokens_slowest_held NAME  # its slowest tokens by tokens held (--from=0; d138 on)
#   kv_growth_run BIN           # BIN/kv_growth_bench with the device, into $R/kv_growth.json
#   host_stalls_run NAME [F..]  # bench/host_stalls (flags F) on the idle host, into
#                               # $OUT/NAME.json, its rates to $S (d151 on)
#   load_test_server, load_test_state PHASE, load_test_round F.., load_test_server_stop
#                               # the load test on the GPU placements (d176 on)
#   test_binaries               # every *_test of the bundle, four at a time (d181 on)
#   device_call_end             # the logs to $OUT/dNN_logs.tgz
#
# Run from the repository root on the device machine, where the device tool sets $OUT.

. scripts/kvrecalld.sh

# kvrecalld's threads left out of the CUDA-call analyses below, which count every other thread's
# calls as the steps' (the step queue, the compute pool, gRPC's threads): the build, codes
# learning, growth, deferred linking and frees queues, and those named after the process (its
# main thread, the metrics endpoint, the reaper, and DecodeShared streams' threads, which do
# step, but which the analysed runs, all over gRPC, do not open). Before the eighteenth session
# only the codes learning's and the builds' threads and the main thread were left out.
background_threads="kvrecalld,kvrecall-build,kvrecall-codes,kvrecall-grow,kvrecall-link,kvrecall-free"

device_call_begin() {
  N=$1
  tar -C ".device/b$N" -xJf ".device/b$N/ship/bundle.tar.xz"
  B=$PWD/.device/b$N/bundle/bin
  export LD_LIBRARY_PATH=$PWD/.device/b$N/bundle/lib
  L=/tmp/d$N
  S=$OUT/d${N}_summary.txt
  R=$L/out
  mkdir -p "$L" "$R"
  cat /proc/loadavg | tee -a "$S"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
}

# One line per record of a gpu_serving_bench --out JSON: server and end-to-end p50 (p99), the
# bulk's p50, the device's exact heads, GPU bytes, build seconds, and per path a head's mean
# candidates and bulk p50.
serving_summary() {
  python3 - "$1" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    paths = " ".join("%s:%dc/%dus" % (k, v["candidates_mean"], v["bulk_p50_us"])
                     for k, v in r.get("head_bulk_by_path", {}).items())
    print(r["context"], r["batch"], r["selector"], r.get("exact_search"),
          "srv", round(r["server_p50_us"]), round(r["server_p99_us"]),
          "e2e", round(r["e2e_p50_us"]), "bulk", round(r.get("bulk_p50_us", 0)),
          "devheads", round(r.get("device_exact_heads_per_step", 0), 2),
          "gpuB", r.get("session_gpu_bytes"), "build", round(r.get("build_seconds_max", 0), 2),
          paths)
PY
}

# kvrecall.hf_demo against a kvrecalld of its own (tinylm-a from .device/model, 2 rows of an
# 8192-byte prompt, 64 greedy bytes, bf16; index and retopk in the cpu and tiered placements):
# whether each run's bytes are SDPA's and, tiered, the cpu placement's. Raw: $OUT/NAME.json.
hf_demo_check() {
  local name=$1
  start_kvrecalld "$B/kvrecalld" "$L/kvrecalld_hf.log" --address=127.0.0.1:0 || return 1
  PYTHONPATH=client/python timeout 150 python3 -m kvrecall.hf_demo \
    --server "$kvrecalld_address" --model .device/model/tinylm-a.npz \
    --text .device/model/prompt.txt --prompt 8192 --new 64 --batch 2 --dtype bf16 --auto-tau \
    --policies index:512 tiered/index:512 retopk:512 tiered/retopk:512 \
    --out "$OUT/$name.json" > "$L/hf.log" 2>&1
  echo "hf_demo rc $? t=$SECONDS" | tee -a "$S"
  python3 - "$OUT/$name.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
print("ok", d.get("ok"))
for r in d["runs"]:
    print(r["placement"], r["policy"], r["k"], "same_as_sdpa", r.get("same_bytes"),
          r.get("first_divergence"), "same_as_cpu", r.get("same_as_cpu"),
          r.get("first_divergence_from_cpu"), "s", round(r.get("seconds", 0), 2),
          "error" if "error" in r else "")
PY
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
}

# bench/model_tokens.py (ARGS: its flags) against a kvrecalld BIN of its own: a whole model's
# tokens, every layer of one session stepped in turn. Raw: $R/NAME.json; its first lines to $S.
model_tokens_run() {  # NAME KVRECALLD SELECTOR [ARGS...]
  local name=$1 binary=$2 selector=$3
  shift 3
  # shellcheck disable=SC2086  # KVRECALLD_FLAGS: kvrecalld's own flags, split on spaces
  start_kvrecalld "$binary" "$L/kvrecalld_$name.log" --address=127.0.0.1:0 ${KVRECALLD_FLAGS:-} \
    || return 1
  PYTHONPATH=client/python timeout 200 python3 bench/model_tokens.py \
    --server="$kvrecalld_address" --selector=$selector --out="$R/$name.json" "$@" \
    > "$L/$name.txt" 2>&1
  echo "$name rc $? t=$SECONDS" | tee -a "$S"
  head -4 "$L/$name.txt" | cut -c1-400 | tee -a "$S"
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
}

host_stalls_run() {  # NAME [FLAG...]
  local name=$1
  shift
  "$B/host_stalls" "$@" > "$OUT/$name.json" 2> "$L/$name.err"
  echo "host_stalls $name rc $? t=$SECONDS" | tee -a "$S"
  python3 - "$OUT/$name.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
print("threads", d["threads"], "s", d["seconds"], "rates/thread-s", d["per_thread_second"])
for k in ("preempted_stall_us", "not_preempted_stall_us", "threads_at_once_preempted",
          "threads_at_once_not_preempted"):
    print(k, d[k])
for t in d["per_thread"]:
    print(" cpu", t["cpu"], "n", t["stalls"], "pre", t["preempted_by_bin"], "not",
          t["not_preempted_by_bin"], "ms pre/not", round(t["preempted_ms"], 1),
          round(t["not_preempted_ms"], 1), "steal/irq/softirq ms", t.get("steal_ms"),
          t.get("irq_ms"), t.get("softirq_ms"))
PY
}

# The load test against the GPU placements (d176 on): load_test_server starts kvrecalld (its
# metrics URL in $metrics_url); load_test_state PHASE writes the server's session gauges, the
# process's device memory and its RSS to $S; load_test_round FLAG... runs one bench/load_test
# round over the gpu and tiered placements (Llama-3-8B's layer geometry, K = 512, 2 layers) into
# $R/load_N.json, then load_test_state; load_test_server_stop stops kvrecalld and logs its tail.
load_test_server() {
  start_kvrecalld "$B/kvrecalld" "$L/kvrecalld.log" --address=127.0.0.1:0 || return 1
  metrics_url=$(sed -n 's/^kvrecalld metrics on //p' "$L/kvrecalld.log")
  load_test_rounds=0
}
load_test_state() {
  python3 - "$metrics_url" "$1" <<'PY' 2>&1 | tee -a "$S"
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
keep = ("kvrecall_sessions_open", "kvrecall_gpu_memory_bytes", "kvrecall_host_memory_bytes",
        "kvrecall_tokens_held", "kvrecall_codes_learnings_total")
print(sys.argv[2], " ".join(l for l in text.splitlines()
                            if l.startswith(keep) and not l.startswith("#")))
PY
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$S"
  grep -E "VmRSS" "/proc/$kvrecalld_pid/status" | tee -a "$S"
}
load_test_round() {
  load_test_rounds=$((load_test_rounds + 1))
  local round=$load_test_rounds
  timeout 150 "$B/load_test" --server="$kvrecalld_address" --server_pid="$kvrecalld_pid" \
    --json="$R/load_$round.json" --placements=gpu,tiered --q_heads=32 --kv_heads=8 \
    --head_dim=128 --top_k=512 --layers=2 "$@" 2>&1 | tee -a "$S"
  echo "round $round rc ${PIPESTATUS[0]} t=$SECONDS" | tee -a "$S"
  load_test_state "after round $round"
}
load_test_server_stop() {
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid"
  echo "kvrecalld rc $? t=$SECONDS" | tee -a "$S"
  grep -v "^kvrecalld listening\|^kvrecalld metrics" "$L/kvrecalld.log" | tail -20 | tee -a "$S"
}

# Every *_test binary of the bundle, four at a time (KVRECALLD: the bundle's), each logged in
# $L: their exit codes and what each says passed or failed to $S (d181 on).
test_binaries() {
  ls "$B"/*_test | xargs -P4 -I{} sh -c \
    't=$(basename {}); KVRECALLD='"$B"'/kvrecalld KVRECALL_SOURCE_DIR='"$PWD"' timeout 200 {} \
     --gtest_brief=1 > '"$L"'/$t.log 2>&1; echo "$t rc $?"' | sort | tee -a "$S"
  for log in "$L"/*_test.log; do
    grep -H -E "^\[  (PASSED|FAILED)  \]|tests ran" "$log" | grep -v "listed below" | head -8
  done | tee -a "$S"
  echo "t=$SECONDS tests done" | tee -a "$S"
}

device_call_end() {
  (cd "$L" && tar czf "$OUT/d${N}_logs.tgz" ./*.log ./*.txt 2>/dev/null)
}

# d98's take-over run against BINARY with FLAGs: a prompt of 640 tokens stepped from bulk 900 to
# 1600 (its first codes, learned at bulk 1024, take over at 1536), index and retopk, batches 1 and
# 8. One line per record into $S: p50 (p99), the take-over step and its reserve / plan / launch,
# and the steps over twice the p50 inside the learning's window (bulk 1024-1535) and outside it.
# Raw: $OUT/takeover_NAME.json.
takeover_run() {  # NAME BINARY [FLAG...]
  local name=$1 binary=$2
  shift 2
  start_kvrecalld "$binary" "$L/kvrecalld_$name.log" --address=127.0.0.1:0 "$@" || return 1
  timeout 240 "$B/gpu_serving_bench" --server="$kvrecalld_address" \
    --out="$L/takeover_$name.json" --placement=tiered --contexts=640 --batches=1,8 \
    --selectors=index,retopk --auto_tau --steps=700 --warmup=900 \
    > /dev/null 2> "$L/takeover_$name.log"
  echo "take-over $name rc $? t=$SECONDS" | tee -a "$S"
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
  python3 - "$L/takeover_$name.json" "$name" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    t = r["server_us_by_step"]
    p50 = r["server_p50_us"]
    at = {s["step"]: s for s in r.get("slowest_steps", [])}.get(1536 - 900, {})
    window = t[1024 - 900:1536 - 900]
    outside = t[:1024 - 900] + t[1537 - 900:]
    print(sys.argv[2], r["selector"], "batch", r["batch"], "p50", round(p50),
          "p99", round(r["server_p99_us"]), "take-over step", round(t[1536 - 900]),
          "reserve", round(at.get("reserve_us", -1)), "plan", round(at.get("plan_us", -1)),
          "launch", round(at.get("launch_us", -1)),
          "over 2x p50: window", sum(x > 2 * p50 for x in window),
          "outside", sum(x > 2 * p50 for x in outside))
PY
  cp "$L/takeover_$name.json" "$OUT/"
}

# One run of issue 15's rows (tiered retopk and index, batch 1, K = 512, auto_tau, 8 warm-up
# steps) against the kvrecalld at $kvrecalld_address: CONTEXT, STEPS timed steps, into
# $L/NAME.json (its log beside it); its serving_summary and steps_tail lines into $S (d145 on).
rows_run() {  # NAME CONTEXT STEPS [slowest]
  local name=$1 context=$2 steps=$3
  timeout 200 "$B/gpu_serving_bench" --server="$kvrecalld_address" --out="$L/$name.json" \
    --placement=tiered --contexts="$context" --batches=1 --selectors=retopk,index \
    --auto_tau --steps="$steps" --warmup=8 > /dev/null 2> "$L/$name.log"
  echo "$name rc $? t=$SECONDS" | tee -a "$S"
  serving_summary "$L/$name.json"
  steps_tail "$L/$name.json" "${4:-}"
}

# The tail of each record of a gpu_serving_bench --out JSON, from its per-step server times: p50,
# p90, p99, max, the steps over twice the p50, and each path's head p99; with `slowest`, the
# slowest steps' phases and their two slowest host heads ([path, start, us, keys]; d147 on).
steps_tail() {  # FILE [slowest]
  python3 - "$1" "${2:-}" <<'PY' 2>&1 | tee -a "$S"
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    s = sorted(r["server_us_by_step"])
    p50 = s[len(s) // 2]
    paths = " ".join("%s p99 %d" % (k, v["bulk_p99_us"])
                     for k, v in r.get("head_bulk_by_path", {}).items())
    print("  ", r["selector"], r["context"], "p50", round(p50), "p90",
          round(s[int(0.9 * len(s))]), "p99", round(s[int(0.99 * len(s))]), "max", round(s[-1]),
          "over 2x p50:", sum(x > 2 * p50 for x in s), "|", paths)
    if sys.argv[2] != "slowest":
        continue
    for st in r["slowest_steps"]:
        heads = st.pop("heads", [])
        slow = sorted(heads, key=lambda h: -h[2])[:2]
        print("    ", {k: round(v) for k, v in st.items()}, "heads", len(heads),
              "slowest", [[round(x) for x in h] for h in slow])
PY
}

# Issue 15's headline rows on one kvrecalld (BINARY): rows_run at each CONTEXT, ${rows_steps:-60}
# steps. Raw: $OUT/sCONTEXT.json.
tiered_rows() {  # BINARY CONTEXT...
  local binary=$1 context
  shift
  start_kvrecalld "$binary" "$L/kvrecalld_rows.log" --address=127.0.0.1:0 || return 1
  for context in "$@"; do
    cat /proc/loadavg | tee -a "$S"
    rows_run "s$context" "$context" "${rows_steps:-60}"
    cp "$L/s$context.json" "$OUT/"
  done
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
}

# bench/cuda_api_timer.c's calls (FILE) on the stepping threads (all but $background_threads):
# how many, then the three 10 ms windows whose calls take longest, apart, by
# function, and their calls of 50 us or more.
api_windows() {  # FILE
  python3 - "$1" "$background_threads" <<'PY' 2>&1 | tee -a "$S"
import collections, sys
background = set(sys.argv[2].split(","))
rows = []
for l in open(sys.argv[1]):
    if l.startswith("#"):
        continue
    p = l.rstrip("\n").split(None, 3)
    rows.append((int(p[0]), int(p[1]), p[2], p[3] if len(p) > 3 else "?"))
steps = sorted(r for r in rows if r[3] not in background)
print(len(rows), "calls timed;", len(steps), "on the stepping threads")
j, total, windows = 0, 0, []
for i, r in enumerate(steps):
    while j < len(steps) and steps[j][0] < r[0] + 10000:
        total += steps[j][1]; j += 1
    windows.append((total, i, j))
    total -= r[1]
taken = []
for total, i, j in sorted(windows, reverse=True):
    if any(abs(steps[i][0] - steps[a][0]) < 20000 for _, a, _ in taken):
        continue
    taken.append((total, i, j))
    if len(taken) == 3:
        break
for total, i, j in taken:
    calls = steps[i:j]
    by = collections.defaultdict(lambda: [0, 0])
    for c in calls:
        by[c[2].split(":")[0]][0] += 1; by[c[2].split(":")[0]][1] += c[1]
    print("window at %.4f s: %d us in %d calls;" % (steps[i][0] / 1e6, total, len(calls)),
          ", ".join("%s %d/%dus" % (k, v[0], v[1])
                    for k, v in sorted(by.items(), key=lambda x: -x[1][1])))
    for c in calls:
        if c[1] >= 50:
            print("   %.4f %5d %s %s" % (c[0] / 1e6, c[1], c[2], c[3]))
PY
  grep "^#" "$1" | tee -a "$S"
}

# Writes $L/kvrecalld_timed: $B/kvrecalld under bench/cuda_api_timer.c (SHIM, LD_PRELOAD), its
# calls of THRESHOLD us or more into FILE. kvrecalld alone gets the shim (exec: the wrapper's
# PID is kvrecalld's); start it with start_kvrecalld or takeover_run.
timed_kvrecalld() {  # SHIM FILE THRESHOLD_US
  cat > "$L/kvrecalld_timed" <<SH
#!/bin/sh
export LD_PRELOAD=$1
export KVRECALL_API_TIMER_OUT=$2
export KVRECALL_API_TIMER_US=$3
exec $B/kvrecalld "\$@"
SH
  chmod +x "$L/kvrecalld_timed"
}

# pq_encode_bench (default rows) of each BIN directory in turn, its JSON into
# $R/pq_encode_NAME_<i>.json (i: the BIN's place, from 1) and its table into $S.
pq_encode_runs() {  # NAME BIN...
  local name=$1 i=0 bin
  shift
  for bin in "$@"; do
    i=$((i + 1))
    timeout 120 "$bin/pq_encode_bench" > "$R/pq_encode_${name}_$i.json" 2> "$L/pq_$name$i.log"
    echo "pq_encode_bench $name $i ($bin) rc $? t=$SECONDS" | tee -a "$S"
    tee -a "$S" < "$L/pq_$name$i.log"
  done
}

# ncu's sections of one PqEncodeKernel launch (every KV head at once, as served) at each row
# count: $R/ncu_pq_encode_NAME_ROWS.txt, its headline figures into $S. The launch skipped to is
# the bench's 17th: after two runs of its 8 launches a KV head (its default --kv_heads=8).
# (d114-d116 ran these commands inline.)
ncu_pq_encode() {  # NAME ROWS...
  local name=$1 rows
  shift
  for rows in "$@"; do
    timeout 90 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section LaunchStats -k regex:PqEncodeKernel --launch-skip 16 --launch-count 1 \
      "$B/pq_encode_bench" --rows="$rows" --reps=2 --warmup=0 \
      > "$R/ncu_pq_encode_${name}_$rows.txt" 2> "$L/ncu_$rows.err"
    echo "ncu $name rows $rows rc $? t=$SECONDS" | tee -a "$S"
    grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|"\
"Compute \(SM\) Th|Memory Th" "$R/ncu_pq_encode_${name}_$rows.txt" | head -20 | tee -a "$S"
  done
}

# bench/cuda_api_timer.c's calls (FILE) on the threads that step (all but $background_threads)
# that allocate, free, fill, copy
# synchronously, or make graphs, streams and events, in bursts (5 ms or more from the latest
# end of a call to the next call's start ends one): per burst, its start, its calls' time and
# span and, by function, its calls and microseconds. A step's allocations show as a burst (the
# first steps, a take-over, the close); d117 on.
api_bursts() {  # FILE
  python3 - "$1" "$background_threads" <<'PY' 2>&1 | tee -a "$S"
import collections, sys
background = set(sys.argv[2].split(","))
kinds = ("cudaMalloc", "cudaMemset", "cudaFree", "cudaHostAlloc", "cudaFreeHost",
         "cudaHostRegister", "cudaHostUnregister", "cudaGraphInstantiate",
         "cudaGraphExecDestroy", "cudaStreamCreateWithFlags", "cudaEventCreateWithFlags",
         "cudaMemcpy")
calls = []
for l in open(sys.argv[1]):
    if l.startswith("#"):
        continue
    p = l.rstrip("\n").split(None, 3)
    name, thread = p[2].split(":")[0], p[3] if len(p) > 3 else "?"
    if name in kinds and thread not in background:
        calls.append((int(p[0]), int(p[1]), name))
calls.sort()
bursts, last = [], None
for c in calls:
    if last is None or c[0] - last >= 5000:
        bursts.append([])
    bursts[-1].append(c)
    last = max(last, c[0] + c[1]) if last is not None else c[0] + c[1]
for b in bursts:
    by = collections.defaultdict(lambda: [0, 0])
    for c in b:
        by[c[2]][0] += 1
        by[c[2]][1] += c[1]
    print("burst at %.4f s, %d us in calls over %d us:" % (b[0][0] / 1e6, sum(c[1] for c in b),
          b[-1][0] + b[-1][1] - b[0][0]),
          ", ".join("%s %d/%dus" % (k, v[0], v[1]) for k, v in sorted(by.items(),
                                                                  key=lambda x: -x[1][1])))
PY
}

# d98's take-over run at batch 1 (index, retopk) against $B/kvrecalld under bench/cuda_api_timer.c
# (SHIM) at a 3 us threshold: the run's JSON to $R/takeover_3us.json, its allocation bursts
# (api_bursts) into $S, every timed call to $R/api_calls_3us_dN.txt.xz; d118 on.
takeover_calls() {  # SHIM
  rm -f "$L/api_calls_3us.txt"  # (the shim appends)
  timed_kvrecalld "$1" "$L/api_calls_3us.txt" 3
  start_kvrecalld "$L/kvrecalld_timed" "$L/kvrecalld_3us.log" --address=127.0.0.1:0 || return 1
  timeout 240 "$B/gpu_serving_bench" --server="$kvrecalld_address" --out="$R/takeover_3us.json" \
    --placement=tiered --contexts=640 --batches=1 --selectors=index,retopk --auto_tau \
    --steps=700 --warmup=900 > /dev/null 2> "$L/takeover_3us.log"
  echo "take-over under the shim rc $? t=$SECONDS" | tee -a "$S"
  kill "$kvrecalld_pid"
  wait "$kvrecalld_pid" 2>/dev/null
  api_bursts "$L/api_calls_3us.txt"
  xz -T4 -c "$L/api_calls_3us.txt" > "$R/api_calls_3us_d$N.txt.xz"
}

# The slowest tokens of a model_tokens_run run timed from the prompt's end (--from=0), by the
# tokens held after each: one line into $S.
model_tokens_slowest_held() {  # NAME
  python3 - "$R/$1.json" "$1" <<'PY' 2>&1 | tee -a "$S"
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
s = d["server_us_by_token"]
held = [d["prompt"] + 1 + i for i in range(len(s))]  # tokens held after each timed token
worst = sorted(range(len(s)), key=lambda i: -s[i])[:6]
print(sys.argv[2], "median %.1f ms" % (st.median(s) / 1000), "p99 %.1f" %
      (d["token_server_p99_us"] / 1000), "slowest (held, ms)",
      [(held[i], round(s[i] / 1000, 1)) for i in worst])
PY
}

kv_growth_run() {  # BIN
  "$1/kv_growth_bench" --rows=1728,16384,131072 --row_bytes=2048 --repeats=5 \
    > "$R/kv_growth.json" 2> "$L/kv_growth.err"
  echo "kv_growth rc $? t=$SECONDS" | tee -a "$S"
  python3 - "$R/kv_growth.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
print("pins", d["pins"], "huge", d["huge_pages"])
for l in d["lengths"]:
    print(l["rows"], {k: round(v["p50_ms"], 3) for k, v in l.items() if isinstance(v, dict)})
PY
}

# Per bench/model_tokens.py record $R/NAME.json: a token's server ms, median (max), over the
# stretches of a 640-token prompt's learning (bulk 900-1023, 1024-1535, the take-over at 1537,
# 1538-1539, 1540-1600), and its three slowest tokens.
model_tokens_stretches() {  # NAME...
  python3 - "$R" "$@" <<'PY' | tee -a "$S"
import json, statistics as st, sys
for n in sys.argv[2:]:
    try:
        d = json.load(open(f"{sys.argv[1]}/{n}.json"))
    except OSError:
        continue
    s, f = d["server_us_by_token"], d["bulk_from"]
    def seg(a, b):
        v = [s[i - f] for i in range(a, b + 1) if 0 <= i - f < len(s)]
        return "%.1f (%.1f)" % (st.median(v) / 1000, max(v) / 1000) if v else "-"
    # From d130 on a model's layers take over one a token: layer l's codes at bulk 1537 + l
    # (CodesLearning::TakeOverAt), so 32 layers' take-overs span 1537-1568.
    print(n, "pre", seg(900, 1023), "learn", seg(1024, 1535), "take", seg(1537, 1537),
          "next2", seg(1538, 1539), "after", seg(1540, 1600), "takes32", seg(1537, 1568),
          "after32", seg(1569, 1600), "slowest",
          [(t["bulk"], t["server_us"]) for t in d["slowest_tokens"][:3]])
PY
}
