#!/usr/bin/env python3
"""How well a product-quantized copy of the bulk keys shortlists each decode query's exact top-K.

The question behind it (issue 15): can candidate scoring move off the host, to compressed keys
small enough for the tiered placement's GPU budget (8 bytes per key and KV head: 8 MiB per layer
at 128K for 8 KV heads), with the host rescoring only a shortlist exactly? This measures the
shortlist's side of that on a replay-format trace: per KV head, a PQ of `--subspaces` codebooks
of 256 centroids (k-means on a sample of the bulk keys), every bulk key encoded, each decode
query's asymmetric (ADC) scores over the bulk, and the share of its exact top-K among its best
N ADC scores (recall), and of the exact top-K's softmax mass, for each N in --shortlists.

  /usr/bin/python3 bench/pq_shortlist_study.py TRACE [--k 512] [--shortlists 512,1024,2048,4096]
"""
import argparse
import json
import struct
import sys

import numpy as np


def load(path, names):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name in names:
            meta = header[name]
            begin, end = meta["data_offsets"]
            f.seek(base + begin)
            raw = np.frombuffer(f.read(end - begin), dtype=np.uint16 if meta["dtype"] in ("BF16", "F16") else np.float32)
            if meta["dtype"] == "BF16":
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            elif meta["dtype"] == "F16":
                raw = raw.view(np.float16).astype(np.float32)
            out[name] = raw.reshape(meta["shape"])
        return header["__metadata__"], out


def kmeans(x, k, iters, rng):
    centroids = x[rng.choice(len(x), k, replace=False)].copy()
    for _ in range(iters):
        d = (x * x).sum(1)[:, None] - 2 * x @ centroids.T + (centroids * centroids).sum(1)[None, :]
        a = d.argmin(1)
        for c in range(k):
            members = x[a == c]
            if len(members):
                centroids[c] = members.mean(0)
            else:
                centroids[c] = x[rng.integers(len(x))]
    return centroids


def encode(x, centroids):
    d = -2 * x @ centroids.T + (centroids * centroids).sum(1)[None, :]
    return d.argmin(1).astype(np.uint8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=128)
    ap.add_argument("--recent", type=int, default=512)
    ap.add_argument("--subspaces", type=int, default=8)
    ap.add_argument("--train", type=int, default=16384, help="sampled bulk keys per codebook")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--shortlists", default="512,1024,2048,4096")
    ap.add_argument("--steps", type=int, default=16, help="decode steps measured")
    ap.add_argument("--kv_heads_used", type=int, default=0, help="0: all")
    ap.add_argument("--center", action="store_true", help="quantize keys minus their mean")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    L = args.layer
    if args.trace.endswith(".npz"):
        # A prefill cache of kvrecall.tinylm (q{L}, k{L}: [T, heads, d] of a real prompt): its
        # last --steps queries stand in for decode queries, over the keys before them.
        z = np.load(args.trace)
        meta = {"generator": "tinylm prefill cache"}
        T = z[f"k{L}"].shape[0]
        T0 = T - args.steps
        keys_all = z[f"k{L}"]
        dq = z[f"q{L}"][T0:]
    else:
        meta, t = load(args.trace, [f"layer{L}.prefill.k", f"layer{L}.decode.q", f"layer{L}.decode.k"])
        keys_all = np.concatenate([t[f"layer{L}.prefill.k"], t[f"layer{L}.decode.k"]], 0)
        dq = t[f"layer{L}.decode.q"]
        T0 = t[f"layer{L}.prefill.k"].shape[0]
    q_heads, kv_heads, d = dq.shape[1], keys_all.shape[1], dq.shape[2]
    group = q_heads // kv_heads
    shortlists = [int(s) for s in args.shortlists.split(",")]
    scale = 1.0 / np.sqrt(d)
    rng = np.random.default_rng(1)
    M = args.subspaces
    sub = d // M
    steps = list(range(min(args.steps, dq.shape[0])))
    used = kv_heads if args.kv_heads_used == 0 else args.kv_heads_used
    recall = {n: [] for n in shortlists}
    mass = {n: [] for n in shortlists}
    for h in range(used):
        bulk_end = T0 - args.recent  # the prompt's bulk (decode steps move it by < 64 tokens)
        bulk = keys_all[args.sinks:bulk_end, h, :]
        mean = bulk.mean(0) if args.center else np.zeros(d, np.float32)
        x = bulk - mean
        sample = x[rng.choice(len(x), min(args.train, len(x)), replace=False)]
        books = []
        codes = np.empty((len(x), M), np.uint8)
        for m in range(M):
            c = kmeans(sample[:, m * sub:(m + 1) * sub], 256, args.iters, rng)
            books.append(c)
            for b in range(0, len(x), 65536):
                codes[b:b + 65536, m] = encode(x[b:b + 65536, m * sub:(m + 1) * sub], c)
        for g in range(group):
            qh = h * group + g
            for s in steps:
                q = dq[s, qh]
                exact = bulk @ q
                top = np.argpartition(-exact, args.k)[: args.k]
                lut = np.stack([books[m] @ q[m * sub:(m + 1) * sub] for m in range(M)])  # [M, 256]
                adc = lut[np.arange(M)[None, :], codes].sum(1)
                w = np.exp((exact - exact.max()) * scale)
                top_mass = w[top].sum()
                for n in shortlists:
                    short = np.argpartition(-adc, n)[:n]
                    rescored = short[np.argsort(-exact[short])[: args.k]]
                    recall[n].append(len(np.intersect1d(rescored, top)) / args.k)
                    mass[n].append(w[rescored].sum() / top_mass)
        print(f"kv head {h}: " + ", ".join(f"N={n} recall {np.mean(recall[n]):.3f}" for n in shortlists),
              file=sys.stderr, flush=True)
    rows = []
    for n in shortlists:
        rows.append({"trace": args.trace, "layer": L, "generator": meta.get("generator", ""), "context": T0,
                     "k": args.k, "subspaces": M, "bytes_per_key": M, "center": args.center,
                     "shortlist": n, "recall": round(float(np.mean(recall[n])), 4),
                     "recall_p10": round(float(np.percentile(recall[n], 10)), 4),
                     "mass_of_exact_topk": round(float(np.mean(mass[n])), 4),
                     "queries": len(recall[n])})
        print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
