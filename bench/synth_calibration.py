#!/usr/bin/python3
"""Decode-query drift statistics of a replay trace (DESIGN.md's safetensors format), per head.

For issue 15 (bench/results/synth_calibration.md): calibrating `kvrecall synth` against a real
tinylm trace. Per (layer, query head) and averaged, from the trace alone:

  * q_cos1      cosine of consecutive decode queries of the head (step s vs s-1);
  * q_cos8      the same 8 steps apart;
  * best_cache  ReTopK's similarity test: the best cosine of the decode query with the C most
                recent queries of the head (the prompt's last ones, then the decode ones), which
                is what tau is compared with;
  * topk_keep   |exact top-K(s) ∩ exact top-K(s-1)| / K: how much of the support survives one step.

With --simulate it also replays ReTopK itself in numpy, per head (a cross-check of the server's
aggregate figures, not a replacement: `kvrecall replay` is the reference): path mix, support
recall vs exact top-K, and output cosine vs full attention of ReTopK and of exact top-K. The
simulation follows index/retopk.cc: cache seeded with the last C prompt queries and their exact
(causal) top-K, FIFO push after every step, refresh every `refresh` steps (step 0 included),
reuse when the best cosine >= tau over the union of the R most similar supports and the last W
positions, reranked with the current query.

  /usr/bin/python3 bench/synth_calibration.py TRACE [--layers 0,1] [--simulate] [--json OUT]
"""
import argparse
import json
import struct
import sys

import numpy as np


def read_trace(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
    meta = header.pop("__metadata__", {})
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def tensor(name):
        info = header[name]
        lo, hi = info["data_offsets"]
        raw = data[base + lo:base + hi]
        dt = info["dtype"]
        if dt == "BF16":
            u = raw.view(np.uint16).astype(np.uint32) << 16
            a = u.view(np.float32)
        elif dt == "F16":
            a = raw.view(np.float16).astype(np.float32)
        elif dt == "F32":
            a = np.array(raw.view(np.float32))
        else:
            raise ValueError(f"{name}: dtype {dt}")
        return a.reshape(info["shape"])

    layers = 1 + max(int(k.split(".")[0][5:]) for k in header)
    return meta, layers, tensor


def unit(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)


def topk(scores, k):
    k = min(k, scores.shape[-1])
    return np.argpartition(-scores, k - 1)[:k]


def attend(q, keys, values, idx, scale):
    s = (keys[idx] @ q) * scale
    w = np.exp(s - s.max())
    return (w[:, None] * values[idx]).sum(0) / w.sum()


def cos(a, b):
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def head_stats(pq, dq, pk, dk, pv, dv, args):
    """pq [T, d], dq [N, d]: one query head; pk/pv [T, d], dk/dv [N, d]: its KV head."""
    T, d = pq.shape
    N = dq.shape[0]
    K, C = args.k, args.C
    scale = 1.0 / np.sqrt(d)
    keys = np.concatenate([pk, dk])
    values = np.concatenate([pv, dv])
    udq = unit(dq)
    out = {
        "q_cos1": float(np.mean(np.sum(udq[1:] * udq[:-1], 1))),
        "q_cos8": float(np.mean(np.sum(udq[8:] * udq[:-8], 1))),
    }
    # Best cosine vs the C most recent queries of the head (the cache ReTopK would hold).
    history = unit(np.concatenate([pq[T - C:], dq]))
    best = [float(np.max(history[s:s + C] @ udq[s])) for s in range(N)]
    out["best_cache"] = float(np.mean(best))
    out["best_cache_ge_tau"] = float(np.mean(np.array(best) >= args.tau))
    exact = []
    for s in range(N):
        tokens = T + s + 1
        exact.append(topk(keys[:tokens] @ dq[s], K))
    keep = [len(np.intersect1d(exact[s], exact[s - 1])) / K for s in range(1, N)]
    out["topk_keep"] = float(np.mean(keep))
    if not args.simulate:
        return out

    # ReTopK, as index/retopk.cc does it (the seed's supports are exact and causal).
    cache_q, cache_s = [], []
    for p in range(T - C, T):
        cache_q.append(unit(pq[p]))
        cache_s.append(topk(pk[:p + 1] @ pq[p], K))
    paths = {"reuse": 0, "fallback": 0, "refresh": 0}
    recall, ocos, ocos_exact = [], [], []
    for s in range(N):
        tokens = T + s + 1
        u = unit(dq[s])
        cq = np.array(cache_q)
        c = cq @ u
        if args.refresh > 0 and s % args.refresh == 0:
            path = "refresh"
        elif c.max() >= args.tau:
            path = "reuse"
        else:
            path = "fallback"
        paths[path] += 1
        if path == "reuse":
            nb = np.argsort(-c)[:args.R]
            cand = np.unique(np.concatenate(
                [cache_s[i] for i in nb] + [np.arange(max(0, tokens - args.W), tokens)]))
            sel = cand[topk(keys[cand] @ dq[s], K)]
        else:
            sel = exact[s]
        recall.append(len(np.intersect1d(sel, exact[s])) / min(K, tokens))
        full = attend(dq[s], keys[:tokens], values[:tokens], np.arange(tokens), scale)
        ocos.append(cos(attend(dq[s], keys, values, sel, scale), full))
        ocos_exact.append(cos(attend(dq[s], keys, values, exact[s], scale), full))
        cache_q.append(u)
        cache_s.append(sel)
        if len(cache_q) > C:
            cache_q.pop(0)
            cache_s.pop(0)
    out.update({f"sim_{k}": v / N for k, v in paths.items()})
    out["sim_support_recall"] = float(np.mean(recall))
    out["sim_output_cosine"] = float(np.mean(ocos))
    out["sim_exact_output_cosine"] = float(np.mean(ocos_exact))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: all)")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--C", type=int, default=32)
    ap.add_argument("--R", type=int, default=4)
    ap.add_argument("--W", type=int, default=32)
    ap.add_argument("--tau", type=float, default=0.85)
    ap.add_argument("--refresh", type=int, default=128)
    ap.add_argument("--simulate", action="store_true", help="also replay ReTopK in numpy")
    ap.add_argument("--json", default="", help="write per-head and mean figures here")
    args = ap.parse_args()

    meta, n_layers, tensor = read_trace(args.trace)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(range(n_layers))
    rows = []
    for l in layers:
        pq, pk, pv = (tensor(f"layer{l}.prefill.{t}") for t in "qkv")
        dq, dk, dv = (tensor(f"layer{l}.decode.{t}") for t in "qkv")
        qh, kh = pq.shape[1], pk.shape[1]
        for h in range(qh):
            g = h // (qh // kh)
            r = head_stats(pq[:, h], dq[:, h], pk[:, g], dk[:, g], pv[:, g], dv[:, g], args)
            r.update(layer=l, head=h)
            rows.append(r)
            print(f"layer {l} head {h}: " +
                  " ".join(f"{k}={v:.3f}" for k, v in r.items() if k not in ("layer", "head")),
                  flush=True)
    keys = [k for k in rows[0] if k not in ("layer", "head")]
    mean = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    print("mean: " + " ".join(f"{k}={v:.3f}" for k, v in mean.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "metadata": meta, "layers": layers, "mean": mean,
                       "heads": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
