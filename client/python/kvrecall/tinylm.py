"""tinylm (a byte-level Llama-family model stored as .npz, see ../shared/models/README.md) in
numpy, with the decode-time attention of every layer served by kvrecall; and `ppl`, the
paper's protocol: prefill T bytes, then teacher-force S bytes through the service.

  PYTHONPATH=client/python python3 -m kvrecall.tinylm ppl --server 127.0.0.1:50051 \
      --model ../shared/models/tinylm-a.npz --text /usr/lib/python3.11 --offset 0 \
      --ctx 16384 --suffix 256 --policy retopk --k 512 --json

The prefill runs here with exact causal attention; its post-RoPE k and v of every layer are
uploaded, with the queries the session needs (CreateSessionResponse.prompt_queries), and all
three are cached on disk per model + text window, so policies share one prefill. Step i
then feeds byte T+i and scores byte T+i+1: all S predictions use the service's attention.
Text is read as ../shared/models/tinylm_np.py reads it (files in sorted order, binary files
skipped, a newline after each file). Layouts: activations [T, d_model]; q [T, q_heads, head_dim],
k and v [T, kv_heads, head_dim] (RoPE applied, rotate-half convention).
"""
import argparse
import ast
import hashlib
import json
import math
import os
import sys
import time
import zipfile

import numpy as np


def read_text(paths, limit):
    """The first `limit` bytes (fewer if there are not as many) of the regular files under
    `paths` in sorted order, binary files (any NUL byte) skipped and a newline after each: the
    same bytes tinylm_np.py reads. Files are read in chunks and kept only up to `limit`, so a
    large file costs no more memory than that (it was read whole: /dev/zero ran out of memory);
    what is not a regular file (a FIFO, a device) is skipped, and ValueError names such a path
    given directly (a FIFO hung the read)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                files += [os.path.join(root, n) for n in names]
        elif os.path.exists(p) and not os.path.isfile(p):
            raise ValueError(f"--text: {p} is neither a regular file nor a directory")
        else:
            files.append(p)
    buf = bytearray()
    for f in sorted(set(files)):
        if len(buf) >= limit:
            break
        if not os.path.isfile(f):  # gone, or a FIFO, socket or device found by the walk
            continue
        kept, binary = bytearray(), False
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    if b"\0" in chunk:  # the whole file is scanned, as tinylm_np.py does
                        binary = True
                        break
                    kept += chunk[:max(0, limit - len(buf) - len(kept))]
        except OSError:
            continue
        if not binary:
            buf += kept + b"\n"
    return np.frombuffer(bytes(buf[:limit]), dtype=np.uint8)


def log_softmax_at(logits, targets):
    """Natural-log probability of targets[i] under logits[i] ([N, vocab], [N])."""
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return logits[np.arange(len(targets)), targets] - lse


def causal_attention(q, k, v, scale, block=512):
    """Exact causal GQA attention: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    T, Hq, _ = q.shape
    group = Hq // k.shape[1]
    out = np.empty_like(q)
    for h in range(Hq):
        qh, kh, vh = q[:, h], k[:, h // group], v[:, h // group]
        for s in range(0, T, block):
            e = min(T, s + block)
            sc = (qh[s:e] @ kh[:e].T) * scale
            sc[np.arange(e)[None, :] > np.arange(s, e)[:, None]] = -np.inf
            sc -= sc.max(-1, keepdims=True)
            p = np.exp(sc)
            p /= p.sum(-1, keepdims=True)
            out[s:e, h] = p @ vh[:e]
    return out


class TinyLM:
    """The model: RMSNorm (eps 1e-6), RoPE, GQA attention, SwiGLU MLP, untied head."""

    def __init__(self, path):
        z = np.load(path)
        self.config = ast.literal_eval(str(z["__config__"]))
        w = {}
        for name in z.files:  # int8 rows with a float scale per row; the dequantized weights are the model
            if name.endswith(".q8"):
                w[name[:-3]] = z[name].astype(np.float32) * z[name[:-3] + ".scale"]
            elif name != "__config__" and not name.endswith(".scale"):
                w[name] = z[name].astype(np.float32)
        self.w = w
        c = self.config
        self.layers, self.q_heads, self.kv_heads = c["layers"], c["q_heads"], c["kv_heads"]
        self.head_dim, self.rope_base = c["head_dim"], c["rope_base"]
        self.scale = 1.0 / math.sqrt(self.head_dim)

    @staticmethod
    def _rmsnorm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

    def _rope(self, x, positions):  # x [T, H, D]
        D = x.shape[-1]
        inv = 1.0 / (self.rope_base ** (np.arange(0, D, 2, dtype=np.float64) / D))
        f = np.outer(np.asarray(positions, dtype=np.float64), inv)[:, None, :]
        c, s = np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def _qkv(self, layer, x, positions):
        p, T, D = f"blocks.{layer}.", x.shape[0], self.head_dim
        h = self._rmsnorm(x, self.w[p + "n1.w"])
        q = (h @ self.w[p + "q.weight"].T).reshape(T, self.q_heads, D)
        k = (h @ self.w[p + "k.weight"].T).reshape(T, self.kv_heads, D)
        v = (h @ self.w[p + "v.weight"].T).reshape(T, self.kv_heads, D)
        return self._rope(q, positions), self._rope(k, positions), v

    def _after_attention(self, layer, x, attn):  # attn [T, q_heads, head_dim]
        p = f"blocks.{layer}."
        x = x + attn.reshape(x.shape[0], -1) @ self.w[p + "o.weight"].T
        h = self._rmsnorm(x, self.w[p + "n2.w"])
        u = h @ self.w[p + "w1.weight"].T
        return x + ((u / (1 + np.exp(-u))) * (h @ self.w[p + "w3.weight"].T)) @ self.w[p + "w2.weight"].T

    def _logits(self, x):
        return self._rmsnorm(x, self.w["norm.w"]) @ self.w["head.weight"].T

    def forward(self, tokens, on_layer=None):
        """Logits [T, 256] of a whole sequence with exact local attention; on_layer(layer, q,
        k, v) sees each layer's post-RoPE q, k and v."""
        x = self.w["emb.weight"][np.asarray(tokens)]
        positions = np.arange(len(tokens))
        for layer in range(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            if on_layer is not None:
                on_layer(layer, q, k, v)
            x = self._after_attention(layer, x, causal_attention(q, k, v, self.scale))
        return self._logits(x)

    def decode_step(self, token, position, attend):
        """Logits [256] after feeding `token` at `position`; attend(layer, q [q_heads, D],
        k [kv_heads, D], v [kv_heads, D]) returns the layer's attention output [q_heads, D]
        over every earlier position and this one."""
        x = self.w["emb.weight"][[int(token)]]
        for layer in range(self.layers):
            q, k, v = self._qkv(layer, x, [position])
            x = self._after_attention(layer, x, np.asarray(attend(layer, q[0], k[0], v[0]))[None])
        return self._logits(x)[0]


def prefill_qkv(model, tokens, cache_dir=None, model_path=""):
    """[(q, k, v)] per layer for `tokens`, computed with exact attention, or read from
    cache_dir where an earlier run stored them for the same model file and bytes."""
    path = None
    if cache_dir:
        h = hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.uint8).tobytes())
        with open(model_path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
        path = os.path.join(cache_dir, f"prefill-{h.hexdigest()[:24]}.npz")
        if os.path.exists(path):
            try:
                with np.load(path) as z:
                    return [(z[f"q{l}"], z[f"k{l}"], z[f"v{l}"])
                            for l in range(model.layers)], True
            except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
                pass  # an entry cut short or not ours: computed again and stored over it
    caps = [None] * model.layers

    def keep(layer, q, k, v):
        caps[layer] = (q, k, v)

    model.forward(tokens, on_layer=keep)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp.npz"
        np.savez(tmp, **{f"{n}{l}": t for l, c in enumerate(caps) for n, t in zip("qkv", c)})
        os.replace(tmp, path)
    return caps, False


def policy_from_args(a):
    from kvrecall.client import make_policy
    retopk = {k: v for k, v in (("cache_capacity", a.cache_capacity),
                                ("reuse_neighbors", a.reuse_neighbors),
                                ("recent_window", a.recent_window), ("tau", a.tau),
                                ("refresh_interval", a.refresh_interval),
                                ("auto_tau", a.auto_tau), ("target_recall", a.target_recall),
                                ("exact_flat_scan", a.exact_flat_scan))
              if v is not None}
    index = {k: v for k, v in (("build_queries", a.build_queries), ("build_topk", a.build_topk),
                               ("max_degree", a.max_degree),
                               ("search_list_size", a.search_list_size),
                               ("search_width", a.search_width),
                               ("shortlist", a.shortlist),
                               ("exact_search", a.exact_search)) if v}
    return make_policy(a.policy, a.placement, top_k=a.k, sinks=a.sinks, recent=a.recent,
                       retopk=retopk, index=index)


def run_ppl(a):
    """The `ppl` protocol for parsed arguments (parser()); ValueError for text too short or a
    policy the client refuses, before the model is loaded or the prefill computed."""
    from kvrecall.client import Client, connection_from_args, make_geometry, path_mix
    policy = policy_from_args(a)
    if a.cache_dir and os.path.exists(a.cache_dir) and not os.path.isdir(a.cache_dir):
        raise ValueError(f"--cache-dir: {a.cache_dir} is not a directory ('' disables the cache)")
    need = a.offset + a.ctx + a.suffix + 1
    data = read_text(a.text, need)
    if len(data) < need:  # ValueError, not SystemExit: kvrecall.evaluate goes on to its next run
        raise ValueError(f"--text: only {len(data)} bytes of text; --offset + --ctx + --suffix "
                         f"+ 1 = {need}")
    model = TinyLM(a.model)
    seq = data[a.offset:need].astype(np.int64)
    t0 = time.perf_counter()
    caps, cached = prefill_qkv(model, seq[:a.ctx], a.cache_dir, a.model)
    prefill_compute_s = time.perf_counter() - t0

    geometry = make_geometry(model.layers, model.q_heads, model.kv_heads, model.head_dim, a.dtype)
    with Client(a.server, **connection_from_args(a)) as client:
        # The prompt and the suffix's steps: every layer's KV set aside now, never grown.
        session = client.create_session(geometry, policy, label=f"tinylm ppl {a.policy}",
                                        max_tokens=a.ctx + a.suffix)
        try:
            t0 = time.perf_counter()
            pre = session.prefill(caps)
            upload_s = time.perf_counter() - t0
            step_s, server_us = [], []

            def attend(layer, q, k, v):
                t = time.perf_counter()
                out = session.attend(layer, q, k, v).output
                step_s.append(time.perf_counter() - t)
                server_us.append(client.decode_stream.last_server_micros)
                return out

            logprob = np.empty(a.suffix)
            t0 = time.perf_counter()
            for i in range(a.suffix):
                pos = a.ctx + i
                logits = model.decode_step(seq[pos], pos, attend)
                logprob[i] = log_softmax_at(logits[None], seq[pos + 1:pos + 2])[0]
            decode_s = time.perf_counter() - t0
            info = session.info()
        finally:
            session.close()
    result = {
        "policy": a.policy, "placement": a.placement, "dtype": a.dtype,
        "k": int(session.policy.top_k) if a.policy in ("exact_topk", "index", "retopk") else None,
        "ctx": a.ctx, "suffix": a.suffix, "offset": a.offset, "text": a.text,
        "model": os.path.basename(a.model),
        "retopk": {"tau": session.policy.retopk.tau, "auto_tau": session.policy.retopk.auto_tau,
                   "exact_flat_scan": session.policy.retopk.exact_flat_scan}
                  if a.policy == "retopk" else None,
        "bits_per_byte": float(-logprob.mean() / math.log(2)),
        "path_mix": path_mix(info),
        "mean_candidates": info.mean_candidates,
        "layer_step_ms_p50": 1e3 * float(np.median(step_s)),
        "layer_step_ms_p99": 1e3 * float(np.percentile(step_s, 99)),
        "server_layer_step_ms_mean": 1e-3 * float(np.mean(server_us)),
        "token_ms_mean": 1e3 * decode_s / a.suffix,
        "prefill_compute_s": prefill_compute_s, "prefill_cached": cached,
        "prefill_upload_s": upload_s, "prefill_build_s": pre.build_seconds,
        "host_bytes": info.host_bytes, "gpu_bytes": info.gpu_bytes,
        "effective_policy": str(session.policy).replace("\n", " ").strip(),
    }
    if a.check_local:  # the same S predictions with exact local attention over the whole window
        logits = model.forward(seq[:a.ctx + a.suffix])[a.ctx:]
        local = log_softmax_at(logits, seq[a.ctx + 1:a.ctx + a.suffix + 1])
        result["local_bits_per_byte"] = float(-local.mean() / math.log(2))
    return result


def int_at_least(low):
    """An argparse type: an int >= low (argparse names the flag in its error)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def parser():
    ap = argparse.ArgumentParser(prog="python3 -m kvrecall.tinylm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["ppl"])
    from kvrecall.client import add_connection_arguments
    add_connection_arguments(ap, server_required=True)
    ap.add_argument("--model", required=True, help="tinylm .npz")
    ap.add_argument("--text", nargs="+", required=True, help="files or folders")
    # Checked here, before any work: a negative offset would slice from the text's end, and
    # an empty prompt or suffix fails only after the prefill upload.
    ap.add_argument("--offset", type=int_at_least(0), default=0,
                    help="first byte of the window in the text")
    ap.add_argument("--ctx", type=int_at_least(1), default=16384, help="prefilled bytes (T)")
    ap.add_argument("--suffix", type=int_at_least(1), default=256,
                    help="teacher-forced bytes (S)")
    ap.add_argument("--policy", default="full", help="full|exact_topk|streaming|index|retopk")
    ap.add_argument("--placement", default="cpu", help="cpu|gpu|tiered")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"],
                    help="the session's KV dtype: the prompt and every step travel in it (gpu "
                         "and tiered keep the KV in bf16 or f16 and refuse f32)")
    ap.add_argument("--k", type=int, default=0, help="top K (0: server default)")
    ap.add_argument("--sinks", type=int, default=None,
                    help="attention sinks of the static set (unset: server default, 128; 0: none)")
    ap.add_argument("--recent", type=int, default=None,
                    help="recent tokens of the static set (unset: server default, 512; 0: none)")
    ap.add_argument("--recent-window", type=int,
                    help="retopk's W (unset: server default, 32; 0: none)")
    for name, typ in (("cache-capacity", int), ("reuse-neighbors", int),
                      ("tau", float), ("refresh-interval", int), ("target-recall", float),
                      ("build-queries", int), ("build-topk", int), ("max-degree", int),
                      ("search-list-size", int), ("search-width", int), ("shortlist", int)):
        graph_knob = name in ("build-queries", "build-topk", "max-degree", "search-list-size",
                              "search-width")
        ap.add_argument("--" + name, type=typ,
                        help="the graph index's knob: set, asks for the graph" if graph_knob
                        else None)
    ap.add_argument("--auto-tau", action="store_true", default=None)
    ap.add_argument("--exact-search", choices=["graph", "shortlist"],
                    help="tiered index / retopk: how an exact step finds its top K (default: the "
                         "server's, the shortlist on a GPU and the graph without one or when a "
                         "graph knob is set)")
    ap.add_argument("--exact-flat-scan", action="store_true", default=None,
                    help="tiered retopk: the exact path scans the bulk instead of the exact search")
    ap.add_argument("--cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvrecall"),
        help="where prefill q/k/v are cached per model and text window ('' disables)")
    ap.add_argument("--check-local", action="store_true",
                    help="also compute the S predictions with exact local attention")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    from kvrecall.client import KvRecallError
    try:
        r = run_ppl(a)
    except (KvRecallError, ValueError) as e:
        print(f"kvrecall.tinylm: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a model, cache directory or text that cannot be read or written
        print(f"kvrecall.tinylm: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
