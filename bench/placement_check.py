#!/usr/bin/env python3
"""Checks `kvrecall replay --json` runs of one trace in the CPU, GPU and tiered placements against
each other (issue 13's fidelity criteria; tiered full against the trace) and prints them side by
side as a markdown table.

  placement_check.py replay.jsonl [--markdown table.md]

Criteria, per policy present in both placements:
  full:       GPU output cosine (against the trace's own full attention) >= 0.9999;
  exact_topk: the same supports as the CPU up to ties: support recall and output cosine within
              0.001 of the CPU's;
  retopk:     the CPU's path mix within 1 point (reuse, fallback, refresh) and output cosine
              within 0.001;
  streaming:  output cosine within 0.001 of the CPU's (same static set).
Tiered (issue 15): full (static set merged with the whole bulk) output cosine >= 0.9999; the
other tiered rows are reported beside tiered exact_topk of the same K (the "perfect index").
Exits 1 when a criterion fails.
"""
import argparse
import json
import sys


def key(r):
    rt = r.get("retopk", {})
    return (r["policy"], r["top_k"] if r["policy"] in ("exact_topk", "retopk", "index") else 0,
            bool(rt.get("auto_tau", False)))


def label(k):
    policy, top_k, auto = k
    s = policy + (f" K={top_k}" if top_k else "")
    return s + (" auto_tau" if auto else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    runs = {}
    for line in open(a.jsonl):
        line = line.strip()
        if line:
            r = json.loads(line)
            runs[(r["placement"], key(r))] = r
    keys = sorted({k for (_, k) in runs})
    rows = ["| policy | placement | output cosine | support recall | path mix reuse/fallback/refresh | "
            "server us p50 | e2e us p50 | prefill s | verdict |", "|" + " --- |" * 9]
    failed = []
    for k in keys:
        cpu, gpu = runs.get(("cpu", k)), runs.get(("gpu", k))
        verdict = "n/a"
        if gpu is not None:
            checks = []
            if k[0] == "full":
                checks.append(("cosine >= 0.9999", gpu["output_cosine"] >= 0.9999))
            if cpu is not None and k[0] in ("exact_topk", "retopk", "streaming"):
                checks.append(("cosine within 0.001 of cpu",
                               abs(gpu["output_cosine"] - cpu["output_cosine"]) <= 0.001))
            if cpu is not None and k[0] == "exact_topk":
                checks.append(("recall within 0.001 of cpu",
                               abs(gpu["support_recall"] - cpu["support_recall"]) <= 0.001))
            if cpu is not None and k[0] == "retopk":
                for p in ("reuse", "fallback", "refresh"):
                    checks.append((f"{p} within 1 point of cpu",
                                   abs(gpu["path_mix"][p] - cpu["path_mix"][p]) <= 0.01))
            bad = [c for c, ok in checks if not ok]
            verdict = "ok" if not bad else "FAIL: " + "; ".join(bad)
            if bad:
                failed.append(f"{label(k)}: {verdict}")
        tiered = runs.get(("tiered", k))
        tiered_verdict = ""
        if tiered is not None:
            if k[0] == "full":
                ok = tiered["output_cosine"] >= 0.9999
                tiered_verdict = "ok" if ok else "FAIL: cosine < 0.9999"
                if not ok:
                    failed.append(f"tiered {label(k)}: {tiered_verdict}")
            else:
                ref = runs.get(("tiered", ("exact_topk", k[1], False)))
                if ref is not None and k[0] != "exact_topk":
                    tiered_verdict = (f"cosine {tiered['output_cosine'] - ref['output_cosine']:+.4f} "
                                      f"vs tiered exact_topk")
        for placement, r in (("cpu", cpu), ("gpu", gpu), ("tiered", tiered)):
            if r is None:
                continue
            m = r["path_mix"]
            rows.append(f"| {label(k)} | {placement} | {r['output_cosine']:.6f} | "
                        f"{r['support_recall']:.4f} | {m['reuse']:.3f}/{m['fallback']:.3f}/"
                        f"{m['refresh']:.3f} | {r['server_us']['p50']:.1f} | "
                        f"{r['latency_us']['p50']:.1f} | {r['prefill_seconds']:.2f} | "
                        f"{verdict if placement == 'gpu' else tiered_verdict if placement == 'tiered' else ''} |")
    table = "\n".join(rows)
    print(table)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table + "\n")
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
