#!/usr/bin/env python3
"""What a short session costs the server end to end: --rounds times, create a session of
--layers layers (the Llama-3-8B layer geometry by default, bf16, cpu placement, full attention),
prefill a --prompt-token prompt, decode one token through every layer, close it. Prints one
JSON line: the wall time of each phase per round, p50 and p99, ms. Tiny sessions' host KV arrays
are mappings of their own since 27e279d (kv_growth.md); this is what that costs them.

  PYTHONPATH=client/python python3 bench/session_churn.py --server 127.0.0.1:50051
"""
import argparse
import json
import time

import numpy as np

from kvrecall.client import Client, make_geometry, make_policy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    g = make_geometry(a.layers, a.q_heads, a.kv_heads, a.head_dim, dtype="bf16")
    kv = rng.standard_normal((a.prompt, a.kv_heads, a.head_dim), dtype=np.float32)
    q = rng.standard_normal((a.prompt, a.q_heads, a.head_dim), dtype=np.float32)
    step_q, step_kv = q[0], kv[0]
    phases = {"create": [], "prefill": [], "decode": [], "close": []}
    with Client(a.server) as client:
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            session = client.create_session(g, make_policy("full", "cpu"))
            t1 = time.perf_counter()
            session.prefill([(q, kv, kv)] * a.layers)
            t2 = time.perf_counter()
            for layer in range(a.layers):
                client.attend_batch(layer, [(session, step_q, step_kv, step_kv)])
            t3 = time.perf_counter()
            session.close()
            t4 = time.perf_counter()
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(dt * 1e3)
    print(json.dumps({"label": a.label, "layers": a.layers, "prompt": a.prompt,
                      "rounds": a.rounds,
                      **{f"{name}_ms": {"p50": round(float(np.percentile(v, 50)), 3),
                                        "p99": round(float(np.percentile(v, 99)), 3)}
                         for name, v in phases.items()}}))


if __name__ == "__main__":
    main()
