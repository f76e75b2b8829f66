#!/usr/bin/env python3
"""PyTorch baselines on the shapes of cuda_decode_bench (Llama-3-8B geometry, bf16):
torch.nn.functional.scaled_dot_product_attention over the whole context (the fastest SDPA
backend that runs, all tried ones recorded) and an exact top-K attention built from torch.topk
(scores by matmul, topk, gather of the K values, softmax, weighted sum). Timed as the C++
bench times: a CUDA graph of one layer-step, replayed between two CUDA events, median of the
replays after warm-ups. Also measures the device-to-device copy bandwidth, the memory floor."""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, DIM = 32, 8, 128


def time_graph(fn, warmup, reps):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = sorted(start.elapsed_time(end) * 1000.0 for start, end in events)
    return {"median_us": us[len(us) // 2], "p10_us": us[len(us) // 10],
            "p90_us": us[(9 * len(us)) // 10]}


def copy_bandwidth():
    """Device-to-device copy of 4 GiB, counting bytes read plus written (as KINDS.md does)."""
    x = torch.randn(1 << 30, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    t = time_graph(lambda: y.copy_(x), 3, 10)
    return 2 * x.numel() * x.element_size() / (t["median_us"] * 1e-6) / 1e12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="16384,32768,65536,131072,262144,1048576")
    parser.add_argument("--top_k", type=int, default=512)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    records = []
    scale = DIM ** -0.5
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            q = torch.randn(batch, Q_HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(batch, KV_HEADS, context, DIM, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            kv_bytes = 2.0 * k.numel() * k.element_size()
            tried = {}
            for name, backend in [("flash", SDPBackend.FLASH_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
                def sdpa():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                try:
                    tried[name] = time_graph(sdpa, 8, args.reps)
                except Exception as e:  # a backend that does not serve this shape
                    tried[name] = {"error": str(e).splitlines()[0][:200]}
                torch.cuda.synchronize()
            ok = {n: t for n, t in tried.items() if "median_us" in t}
            best = min(ok, key=lambda n: ok[n]["median_us"])
            records.append(dict(batch=batch, context=context, kernel="torch_sdpa", backend=best,
                                bytes=kv_bytes, **ok[best],
                                backends={n: t.get("median_us", t.get("error"))
                                          for n, t in tried.items()}))

            group = Q_HEADS // KV_HEADS
            qg = q.view(batch, KV_HEADS, group, DIM)
            kt = k.transpose(-1, -2)
            index_shape = (batch, KV_HEADS, group, args.top_k, DIM)
            v_groups = v.unsqueeze(2).expand(batch, KV_HEADS, group, context, DIM)

            def topk_attention():
                scores = torch.matmul(qg, kt)                       # [B, Hkv, G, N] bf16
                top, idx = torch.topk(scores, args.top_k, dim=-1)   # [B, Hkv, G, K]
                chosen = torch.gather(v_groups, 3, idx.unsqueeze(-1).expand(index_shape))
                p = torch.softmax(top.float() * scale, dim=-1)
                return torch.matmul(p.unsqueeze(-2), chosen.float()).squeeze(-2)

            t = time_graph(topk_attention, 8, args.reps)
            records.append(dict(batch=batch, context=context, kernel="torch_topk",
                                bytes=kv_bytes / 2, **t))
            print(f"batch {batch} context {context}: sdpa ({best}) "
                  f"{ok[best]['median_us']:.1f} us, torch.topk {t['median_us']:.1f} us",
                  flush=True)
            del q, k, v, qg, kt, v_groups
            torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               copy_tbps=copy_bandwidth(), records=records)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
