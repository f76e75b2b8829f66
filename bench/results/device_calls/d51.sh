#!/usr/bin/env bash
# Fifty-first call (the session's last device minutes): host_gather_bench with --group_union,
# the step of 32 exact heads per head against each KV group's union scored once
# (cpu::ScoreTokensForQueries), at 1, 4, 8 and 16 threads, for unions of 0.7 (tinylm-a) and
# 0.96 (the synthetic trace) of the lists' sum.
set -u
tar -C .device/b51 -xJf .device/b51/ship/bundle.tar.xz
B=$PWD/.device/b51/bundle/bin
export LD_LIBRARY_PATH=$PWD/.device/b51/bundle/lib
S=$OUT/d51_summary.txt
cat /proc/loadavg | tee -a $S
for share in 0.7 0.96; do
  timeout 60 $B/host_gather_bench --tokens=131072 --threads=1,4,8,16 --steps=30 --warmup=4 \
    --group_union=$share > $OUT/d51_union_$share.json 2> $OUT/d51_union_$share.err
  echo "share $share rc $?" | tee -a $S
  cat $OUT/d51_union_$share.err | tee -a $S
done
echo "t=$SECONDS done" | tee -a $S
