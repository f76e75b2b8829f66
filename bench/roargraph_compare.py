#!/usr/bin/python3
"""Exports one KV head of a kvrecall trace in RoarGraph's file formats, and tabulates a comparison.

`export`: the data `kvrecall bench-index` indexes and searches for one layer and KV head, with
its defaults (no sinks or recent tokens held out, one graph per KV head, 4096 build queries split
among the KV head's query heads, causal top-100 lists), written as RoarGraph's inputs:

  base.fbin      the KV head's keys [T, d], f32 (the trace's values widened; bf16 is exact in f32)
  train.fbin     the build queries bench-index's graph samples: per query head of the group,
                 ceil(build_queries / group) prompt queries at positions i * T / n
  train_gt.bin   their exact causal top-k (keys 0..position), DiskANN's ground-truth format
                 (n, k, ids, scores); RoarGraph's build reads only the ids. A query that sees
                 fewer than k keys (the first few) is left out: RoarGraph needs full lists.
  test.fbin      the group's decode queries (per head, per step, as bench-index orders them),
                 tiled `--repeat` times so that RoarGraph's millisecond clock resolves a query
  test_gt.bin    their exact top-k over all keys (the same ground truth bench-index computes)

`table`: reads RoarGraph's search CSVs (one per KV head) and bench-index JSONs (ours), and prints
the comparison as markdown: recall@k, keys scored, hops, keys per hop, us per query, ns per key.

fbin: uint32 n, uint32 d, then n*d float32 (big-ann's format, which RoarGraph reads).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

# The project's trace reader (kvrecall.needles) and bf16 widening (kvrecall.tensors).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'client',
                                'python'))
from kvrecall.needles import read_safetensors  # noqa: E402
from kvrecall.tensors import bf16_bits_to_f32  # noqa: E402


def read_tensors(path, names):
    """Returns {name: float32 array} for `names` of a trace (bf16, f16 or f32 tensors)."""
    header, _, arrays = read_safetensors(path)
    out = {}
    for name in names:
        a = arrays[name]
        out[name] = (bf16_bits_to_f32(a) if header[name]['dtype'] == 'BF16'
                     else np.asarray(a, dtype=np.float32))
    return out


def write_fbin(path, x):
    x = np.ascontiguousarray(x, dtype=np.float32)
    with open(path, 'wb') as f:
        f.write(struct.pack('<II', x.shape[0], x.shape[1]))
        f.write(x.tobytes())


def write_gt(path, ids, scores):
    with open(path, 'wb') as f:
        f.write(struct.pack('<II', ids.shape[0], ids.shape[1]))
        f.write(np.ascontiguousarray(ids, dtype=np.uint32).tobytes())
        f.write(np.ascontiguousarray(scores, dtype=np.float32).tobytes())


def top_k(queries, keys, k, visible=None):
    """Exact top-k by inner product (best first, ties by lower id), keys [0, visible) per query."""
    ids = np.empty((len(queries), k), dtype=np.int64)
    scores = np.empty((len(queries), k), dtype=np.float32)
    for begin in range(0, len(queries), 256):
        s = queries[begin:begin + 256] @ keys.T
        if visible is not None:
            cols = np.arange(keys.shape[0])
            s[cols[None, :] >= visible[begin:begin + 256, None]] = -np.inf
        part = np.argpartition(-s, k - 1, axis=1)[:, :k]
        for r in range(s.shape[0]):
            cand = part[r]
            order = np.lexsort((cand, -s[r, cand]))
            ids[begin + r] = cand[order]
            scores[begin + r] = s[r, cand[order]]
    return ids, scores


def export(args):
    layer = args.layer
    t = read_tensors(args.trace, [f'layer{layer}.prefill.q', f'layer{layer}.prefill.k',
                                  f'layer{layer}.decode.q'])
    pq = t[f'layer{layer}.prefill.q']
    pk = t[f'layer{layer}.prefill.k']
    dq = t[f'layer{layer}.decode.q']
    tokens, q_heads, dim = pq.shape
    kv_heads = pk.shape[1]
    group = q_heads // kv_heads
    keys = np.ascontiguousarray(pk[:, args.kv_head, :])
    heads = [args.kv_head * group + i for i in range(group)]

    # Build queries as GraphIndex::SampleQueries takes them for a KV-head graph.
    per_head = min(-(-args.build_queries // group), tokens)
    positions = np.array([i * tokens // per_head for i in range(per_head)], dtype=np.int64)
    train = np.concatenate([pq[positions, h, :] for h in heads])
    visible = np.tile(positions + 1, group)
    keep = visible >= args.k
    train, visible = train[keep], visible[keep]
    train_ids, train_scores = top_k(train, keys, args.k, visible)

    # Test queries in bench-index's order (per head, per step), tiled.
    test = np.concatenate([dq[:, h, :] for h in heads])
    test_ids, test_scores = top_k(test, keys, args.k)
    test = np.tile(test, (args.repeat, 1))
    test_ids = np.tile(test_ids, (args.repeat, 1))
    test_scores = np.tile(test_scores, (args.repeat, 1))

    out = args.out
    write_fbin(f'{out}/base.fbin', keys)
    write_fbin(f'{out}/train.fbin', train)
    write_gt(f'{out}/train_gt.bin', train_ids, train_scores)
    write_fbin(f'{out}/test.fbin', test)
    write_gt(f'{out}/test_gt.bin', test_ids, test_scores)
    print(f'kv_head {args.kv_head}: {tokens} keys x {dim}, {len(train)} build queries '
          f'({int((~keep).sum())} seeing fewer than {args.k} keys left out), '
          f'{len(test) // args.repeat} test queries x {args.repeat}')


def table(args):
    """Prints medians over runs (min-max of ns per key) per index and list size."""
    # RoarGraph's CSV rows: L, QPS, keys scored (its neighbors; the entry point's score is not
    # counted, so +1 here as bench-index counts it), ms per query, recall, hops. The CSVs come
    # run-major, `--heads` KV heads per run; a run's figures are the mean over its heads (each
    # head has as many queries).
    theirs = {}
    runs = [args.roargraph[i:i + args.heads] for i in range(0, len(args.roargraph), args.heads)]
    for run in runs:
        per_list = {}
        for path in run:
            for line in open(path):
                f = line.strip().split(',')
                if len(f) < 6:
                    continue
                per_list.setdefault(int(f[0]), []).append(
                    (float(f[4]), float(f[2]) + 1, float(f[5]), float(f[3]) * 1000))
        for lst, heads in per_list.items():
            theirs.setdefault(lst, []).append(tuple(np.mean(heads, axis=0)))
    # Ours: bench-index's points (means over all query heads and steps), one JSON per run, per
    # binary (--ours LABEL JSON...). A list size that a run passes more than once counts from its
    # second pass on, each as a run: the first is the warm-up (RoarGraph's search warms up on 100
    # queries before each list size).
    ours = []
    for group in args.ours:
        points = {}
        for path in group[1:]:
            report = json.load(open(path))
            run = {}
            for p in report['methods']['graph']['points']:
                run.setdefault(p['list_size'], []).append(
                    (p['recall'], p['scanned_fraction'] * report['keys'], p['hops'],
                     p['search_microseconds']))
            for lst, passes in run.items():
                points.setdefault(lst, []).extend(passes[1:] if len(passes) > 1 else passes)
        ours.append((group[0], points))

    def row(name, lst, runs):
        med = lambda i: float(np.median([r[i] for r in runs]))
        recall, scored, hops, us = med(0), med(1), med(2), med(3)
        ns = sorted(1000 * r[3] / r[1] for r in runs)
        spread = f' ({ns[0]:.0f}-{ns[-1]:.0f})' if len(ns) > 1 else ''
        return (f'| {name} | {lst} | {recall:.4f} | {scored:.0f} | {hops:.1f} '
                f'| {scored / hops:.2f} | {us:.1f} | {float(np.median(ns)):.0f}{spread} |')

    print('| index | list | recall@100 | keys scored | hops | keys/hop | us/query | ns/key |')
    print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
    for lst in sorted(set(theirs).union(*(set(points) for _, points in ours))):
        if lst in theirs:
            print(row('RoarGraph', lst, theirs[lst]))
        for label, points in ours:
            if lst in points:
                print(row(f'kvrecall ({label})', lst, points[lst]))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest='command', required=True)
    e = sub.add_parser('export')
    e.add_argument('--trace', required=True)
    e.add_argument('--out', required=True)
    e.add_argument('--layer', type=int, default=0)
    e.add_argument('--kv_head', type=int, default=0)
    e.add_argument('--k', type=int, default=100)
    e.add_argument('--build_queries', type=int, default=4096)
    e.add_argument('--repeat', type=int, default=20)
    e.set_defaults(run=export)
    t = sub.add_parser('table')
    t.add_argument('--roargraph', nargs='+', default=[],
                   help="test_search_roargraph's CSVs, run-major, --heads per run")
    t.add_argument('--heads', type=int, default=1)
    t.add_argument('--ours', nargs='+', action='append', default=[], metavar='LABEL JSON',
                   help="a label, then bench-index --json outputs (repeatable)")
    t.set_defaults(run=table)
    args = parser.parse_args()
    args.run(args)


if __name__ == '__main__':
    main()
