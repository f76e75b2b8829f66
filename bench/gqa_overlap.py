#!/usr/bin/env python3
"""How much the query heads of a KV group share their best keys, on a replay-format trace.

The question behind it (issue 15): a tiered step's exact heads each rescore their own shortlist
of N bulk keys on the host, and the host's DRAM bandwidth is the step's floor. If the G query
heads of a KV group rescored the union of their shortlists once, each key row would be read
once for the group. This measures the union's size: per decode step (a sample of them) and KV
group, the exact top-N of the bulk [sinks, T - recent) for each of the group's heads, and
|union| / (G * N), for the shortlist (N) and the support (K). 1.0: no key shared.

  /usr/bin/python3 bench/gqa_overlap.py TRACE [--layers 0,1] [--n 1024] [--k 512]
"""
import argparse
import json

import numpy as np

from pq_shortlist_study import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--layers", default="0")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=128)
    ap.add_argument("--recent", type=int, default=512)
    ap.add_argument("--samples", type=int, default=8, help="decode steps sampled per layer")
    a = ap.parse_args()
    for layer in (int(x) for x in a.layers.split(",")):
        _, t = load(a.trace, [f"layer{layer}.prefill.k", f"layer{layer}.decode.q"])
        keys, queries = t[f"layer{layer}.prefill.k"], t[f"layer{layer}.decode.q"]
        tokens, kv_heads = keys.shape[0], keys.shape[1]
        group = queries.shape[1] // kv_heads
        bulk = keys[a.sinks:tokens - a.recent]
        shares = {"n": [], "k": []}
        for step in range(0, queries.shape[0], max(1, queries.shape[0] // a.samples)):
            for g in range(kv_heads):
                scores = bulk[:, g, :] @ queries[step, g * group:(g + 1) * group, :].T
                for name, size in (("n", a.n), ("k", a.k)):
                    union = set()
                    for j in range(group):
                        union.update(np.argpartition(-scores[:, j], size)[:size].tolist())
                    shares[name].append(len(union) / (group * size))
        print(json.dumps({"trace": a.trace, "layer": layer, "tokens": tokens, "group": group,
                          **{f"union_share_top{getattr(a, name)}": {
                              "mean": round(float(np.mean(v)), 3), "min": round(float(np.min(v)), 3),
                              "max": round(float(np.max(v)), 3)} for name, v in shares.items()}}))


if __name__ == "__main__":
    main()
