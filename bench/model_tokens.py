#!/usr/bin/env python3
"""A whole model's tokens: every layer of one tiered session steps in turn, as a runner sends them.

gpu_serving_bench times one-layer sessions. A model's layers step in turn through one Decode
stream, which shares per-stream state (a GPU's captured steps) between them, and they cross the
same lengths together (a short prompt's codes take-over, server/backends/codes_learning.h). This
times the token: a session of --layers layers (the Llama-3-8B layer geometry by default, bf16,
N(0, 1) keys and values, each layer its own), a --prompt-token prompt prefilled layer by layer,
then one Decode per layer per token, the layers in order, until the bulk (the tokens past the
static set's sinks and ring, 128 and 512 by default) holds --to rows; the tokens from bulk
--from on are timed. --max-tokens announces the session's length (its KV set aside at
creation, never grown). Per token: the server time summed over the layers (each reply's
server_micros) and the wall time of its requests; per layer-step the server time; the tokens
whose sum is largest.

  PYTHONPATH=client/python python3 bench/model_tokens.py --server 127.0.0.1:50051 \
      --layers 32 --selector index --prompt 640 --from 900 --to 1600 --out tokens.json
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
    ap.add_argument("--selector", default="index", choices=["index", "retopk"])
    ap.add_argument("--prompt", type=int, default=640, help="prompt tokens (640: no bulk)")
    ap.add_argument("--from", dest="first", type=int, default=900,
                    help="bulk rows after the first timed token")
    ap.add_argument("--to", type=int, default=1600, help="bulk rows after the last token")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="announced at creation (0: not announced; the KV then grows as it fills)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not 0 <= a.first < a.to:
        ap.error(f"--from must be in [0, --to), got {a.first} and {a.to}")

    g = make_geometry(a.layers, a.q_heads, a.kv_heads, a.head_dim, dtype="bf16")
    retopk = {"auto_tau": True} if a.selector == "retopk" else None
    policy = make_policy(a.selector, "tiered", top_k=512, retopk=retopk)
    rng = np.random.default_rng(a.seed)

    def rows(n, heads):
        return rng.standard_normal((n, heads, a.head_dim), dtype=np.float32)

    with Client(a.server) as client:
        session = client.create_session(g, policy, label="model_tokens",
                                        max_tokens=a.max_tokens)
        static_set = session.policy.sinks + session.policy.recent  # the effective policy's
        # Layer by layer, so that a long prompt's f32 arrays are made one layer at a time. The
        # queries the session needs (prompt_queries: ReTopK's seeds) are random rows; the rest
        # of q is never written (np.empty: no memory behind it), since the client sends q for
        # the needed tokens alone.
        t0 = time.perf_counter()
        build_s = 0.0
        needed = a.prompt if session.prompt_queries < 0 else min(a.prompt, session.prompt_queries)
        for layer in range(a.layers):
            q = None
            if needed > 0:
                q = np.empty((a.prompt, a.q_heads, a.head_dim), np.float32)
                q[a.prompt - needed:] = rows(needed, a.q_heads)
            built = session.prefill({layer: (q, rows(a.prompt, a.kv_heads),
                                             rows(a.prompt, a.kv_heads))})
            build_s = max(build_s, built.build_seconds)
        prefill_s = time.perf_counter() - t0
        tokens = []
        bulk = max(0, a.prompt - static_set)  # bulk rows before the token's step
        # One token's inputs, drawn once and reused: a decode token's content does not matter.
        q, k, v = rows(1, a.q_heads)[0], rows(1, a.kv_heads)[0], rows(1, a.kv_heads)[0]
        tokens_held = a.prompt
        while bulk < a.to:
            server = []
            t0 = time.perf_counter()
            for layer in range(a.layers):
                client.attend_batch(layer, [(session, q, k, v)])
                server.append(client.decode_stream.last_server_micros)
            wall = (time.perf_counter() - t0) * 1e6
            tokens_held += 1
            bulk = max(0, tokens_held - static_set)
            if bulk >= a.first:
                tokens.append({"bulk": bulk, "server_us": sum(server), "wall_us": wall,
                               "layers_us": server})
        info = session.info()
        session.close()

    sums = np.array([t["server_us"] for t in tokens])
    walls = np.array([t["wall_us"] for t in tokens])
    steps = np.array([us for t in tokens for us in t["layers_us"]])
    slowest = sorted(tokens, key=lambda t: -t["server_us"])[:8]
    record = {
        "layers": a.layers, "selector": a.selector, "prompt": a.prompt,
        "max_tokens": a.max_tokens,
        "bulk_from": a.first, "bulk_to": a.to, "prefill_s": prefill_s,
        "build_seconds_max": build_s, "tokens": len(tokens),
        "token_server_p50_us": float(np.percentile(sums, 50)),
        "token_server_p99_us": float(np.percentile(sums, 99)),
        "token_wall_p50_us": float(np.percentile(walls, 50)),
        "token_wall_p99_us": float(np.percentile(walls, 99)),
        "layer_step_server_p50_us": float(np.percentile(steps, 50)),
        "layer_step_server_p99_us": float(np.percentile(steps, 99)),
        "slowest_tokens": [{"bulk": t["bulk"], "server_us": round(t["server_us"]),
                            "wall_us": round(t["wall_us"]),
                            "slowest_layers": [[layer, round(us)] for layer, us in sorted(
                                enumerate(t["layers_us"]), key=lambda x: -x[1])[:4]],
                            "layers_over_2x_median": int(np.sum(
                                np.array(t["layers_us"]) > 2 * np.median(t["layers_us"])))}
                           for t in slowest],
        "server_us_by_token": [round(t["server_us"]) for t in tokens],
        "gpu_bytes": info.gpu_bytes,
        "host_bytes": info.host_bytes,
    }
    print(json.dumps({k: v for k, v in record.items()
                      if k not in ("server_us_by_token", "slowest_tokens")}))
    for t in record["slowest_tokens"]:
        print(json.dumps(t))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
