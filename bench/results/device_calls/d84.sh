#!/usr/bin/env bash
# Eighty-fourth call: where a batch-8 tiered retopk step's `decide` goes (149-170 us in d79 and
# d82 for 256 decisions, against 35-55 for 32 at batch 1). bench/decide_bench with 256 heads
# (eight sequences' 32) beside 32, by thread count, kvrecalld's case (pool spinning 100 us, a
# small last loop, a 250 us round trip). Bundle: .device/b84 (decide_bench).
set -u
tar -C .device/b84 -xJf .device/b84/ship/bundle.tar.xz
B=$PWD/.device/b84/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b84/bundle/lib
S=$OUT/d84_summary.txt
cat /proc/loadavg | tee -a $S
n=0
for flags in "--q_heads=256 --threads=1,2,4,8,16" "--q_heads=32 --threads=1,4,16" \
             "--q_heads=256 --threads=1,4,16 --evict_mb=1 --gap_us=0"; do
  n=$((n + 1))
  echo "decide_bench $flags" | tee -a $S
  timeout 150 $B/decide_bench $flags --steps=60 > $OUT/decide_$n.json 2> $OUT/decide_$n.log
  echo "rc $? t=$SECONDS" | tee -a $S
  tail -n 12 $OUT/decide_$n.log | tee -a $S
done
