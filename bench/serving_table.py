#!/usr/bin/env python3
"""Tables of bench/gpu_serving_bench's layer-steps beside the kernels alone and PyTorch.

Reads gpu_serving_bench JSON files (--serving, any number: gpu and tiered runs), and from the
same device call cuda_decode_bench's (--own) and bench/cuda_torch_baseline.py's (--torch)
figures, and prints one markdown table per placement:

* gpu: per (selector, context, batch) the end-to-end and server p50 (p99), the kernels alone
  (own_full / own_exact_topk / the ReTopK step at a recorded tinylm-a path mix), the service's
  fixed cost (server - kernels: copies, launches, decode and encode, bookkeeping), the transport
  (e2e - server), in-process SDPA and torch.topk, and SDPA / e2e (> 1: the service is faster).
* tiered: the same without kernel columns, plus GPU and host bytes per session, their GPU share
  of full residency, and the prefill (index build included) seconds.

    serving_table.py --serving a.json b.json --own own.json --torch torch.json
    serving_table.py --serving bench/results/gpu_serving.json \
        --own bench/results/gpu_serving.json --torch bench/results/gpu_serving.json

With --tiers FILE... (the records of tiered device calls, one file a call, such as
bench/results/tiered_serving/*.json) it prints instead one table of their runs side by side: per
build, selector, context, batch and gap between requests, the end-to-end and server p50 (p99)
and the parts of the server's time the replies report (tier_micros: the static set's own time
on its tier, the bulk's on the host, the wait for the previous step's deferred linking). A file
may be one gpu_serving_bench run or hold several anywhere inside it (a call's `serving`, `runs`
or `result`); the build column names the file and, for a run inside it, the keys that lead there.

    serving_table.py --tiers bench/results/tiered_serving/whole_matrix_d175_h100.json
    serving_table.py --tiers bench/results/tiered_serving/*.json
"""
import argparse
import json
import os

# The kernel-only figure that a serving selector is compared with.
KERNEL_OF = {
    "full": "own_full",
    "exact_topk": "own_exact_topk",
    "retopk": "own_retopk_mix_tinylm_auto",
}


def kib(n):
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def ctx(n):
    return f"{n // 1024}K" if n < 1048576 else f"{n // 1048576}M"


def Load(path, key):
    """The records of a cuda_decode_bench / cuda_torch_baseline.py file, or of that key of one
    that holds several (bench/results/gpu_serving.json)."""
    doc = json.load(open(path))
    return (doc[key] if key in doc else doc)["records"]


def p50_p99(r, name):
    if f"{name}_p50_us" not in r:
        return "—"
    return f"{r[name + '_p50_us']:.1f} ({r[name + '_p99_us']:.1f})"


def build_seconds(r):
    """The server's build of the first session's layer, apart from the prompt's transfer (absent
    in records made before gpu_serving_bench reported it)."""
    b = r.get("build_seconds_first")
    return "—" if b is None else f"{b:.2f}"


def Runs(doc, path=()):
    """(keys, run) for each gpu_serving_bench run in doc: doc itself, or any dict or list inside it
    with records of selectors (not PyTorch's or the kernels'), the keys leading to it in order."""
    if isinstance(doc, dict):
        records = doc.get("records")
        if isinstance(records, list):
            if all(isinstance(r, dict) and "selector" in r for r in records):
                yield path, doc
            return
        items = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return
    for k, v in items:
        yield from Runs(v, path + (str(k),))


def Tiers(paths):
    print("| build | selector | context | batch | gap µs | e2e p50 (p99) | server p50 (p99) "
          "| static set p50 (p99) | bulk p50 (p99) | link wait p50 (p99) | prefill s "
          "| build s | ReTopK mix |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| --- |")
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        for keys, run in Runs(json.load(open(path))):
            build = " ".join([name, "/".join(keys)]) if keys else name
            for r in run["records"]:
                m = r.get("path_mix")
                mix = "" if not m else f"{m['reuse']:.2f}/{m['fallback']:.2f}/{m['refresh']:.2f}"
                print(f"| {build} | {r['selector']} | {ctx(r['context'])} | {r['batch']} "
                      f"| {r.get('gap_us', 0)} | {p50_p99(r, 'e2e')} | {p50_p99(r, 'server')} "
                      f"| {p50_p99(r, 'static_set')} | {p50_p99(r, 'bulk')} "
                      f"| {p50_p99(r, 'link_wait')} | {r['prefill_seconds']:.1f} "
                      f"| {build_seconds(r)} | {mix} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--serving", nargs="+")
    parser.add_argument("--own")
    parser.add_argument("--torch")
    parser.add_argument("--tiers", nargs="+")
    args = parser.parse_args()
    if args.tiers:
        Tiers(args.tiers)
        return
    if not (args.serving and args.own and args.torch):
        parser.error("--serving, --own and --torch are required without --tiers")
    own = {(r["kernel"], r["context"], r["batch"]): r for r in Load(args.own, "kernels_own")}
    torch = {(r["kernel"], r["context"], r["batch"]): r for r in Load(args.torch, "torch")}
    rows = {"gpu": [], "tiered": []}
    geometry = None
    for path in args.serving:
        doc = json.load(open(path))
        # A file may hold several runs (bench/results/gpu_serving.json): each key with records;
        # a tiered call's file (bench/results/tiered_serving/) holds them deeper.
        docs = [doc] if "records" in doc else [v for v in doc.values()
                                               if isinstance(v, dict) and "records" in v
                                               and "q_heads" in v]
        docs = docs or [run for _, run in Runs(doc)]
        for doc in docs:
            geometry = (doc["q_heads"], doc["kv_heads"], doc["head_dim"])
            for r in doc["records"]:
                if "placement" in r:
                    rows[r["placement"]].append(r)

    def torch_us(kernel, r):
        t = torch.get((kernel, r["context"], r["batch"]))
        return t["median_us"] if t else None

    def fmt(x):
        return "—" if x is None else f"{x:.1f}"

    def ratio(a, b):
        return "—" if a is None else f"{a / b:.2f}"

    def percent(a, b):
        return "—" if a is None else f"{100 * a / b:.2f} %"

    def mix(r):
        m = r.get("path_mix")
        return "" if not m else f"{m['reuse']:.2f}/{m['fallback']:.2f}/{m['refresh']:.2f}"

    order = {"full": 0, "exact_topk": 1, "retopk": 2, "index": 3}
    key = lambda r: (order.get(r["selector"], 9), r["context"], r["batch"])
    if rows["gpu"]:
        print("| selector | context | batch | e2e p50 (p99) | server p50 (p99) | kernels alone "
              "| service fixed cost: server − kernels | transport: e2e − server | SDPA | "
              "torch.topk | SDPA / e2e | ReTopK mix reuse/fallback/refresh |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in sorted(rows["gpu"], key=key):
            k = own.get((KERNEL_OF.get(r["selector"]), r["context"], r["batch"]))
            kernel = k["median_us"] if k else None
            sdpa = torch_us("torch_sdpa", r)
            topk = torch_us("torch_topk", r)
            print(f"| {r['selector']} | {ctx(r['context'])} | {r['batch']} "
                  f"| {r['e2e_p50_us']:.1f} ({r['e2e_p99_us']:.1f}) "
                  f"| {r['server_p50_us']:.1f} ({fmt(r.get('server_p99_us'))}) | {fmt(kernel)} "
                  f"| {fmt(None if kernel is None else r['server_p50_us'] - kernel)} "
                  f"| {r['e2e_minus_server_p50_us']:.1f} | {fmt(sdpa)} | {fmt(topk)} "
                  f"| {ratio(sdpa, r['e2e_p50_us'])} | {mix(r)} |")
    if rows["tiered"]:
        q_heads, kv_heads, head_dim = geometry
        print()
        print("| selector | context | batch | e2e p50 (p99) | server p50 (p99) | transport: e2e − "
              "server | SDPA (whole KV on the GPU) | GPU bytes / session | of full residency | "
              "host bytes / session | prefill s (index build included) | build s | ReTopK mix |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| --- |")
        for r in sorted(rows["tiered"], key=key):
            full_bytes = r["context"] * kv_heads * head_dim * 2 * 2  # bf16 keys and values
            gpu = r.get("session_gpu_bytes")
            host = r.get("session_host_bytes")
            print(f"| {r['selector']} | {ctx(r['context'])} | {r['batch']} "
                  f"| {r['e2e_p50_us']:.1f} ({r['e2e_p99_us']:.1f}) "
                  f"| {r['server_p50_us']:.1f} ({r['server_p99_us']:.1f}) "
                  f"| {r['e2e_minus_server_p50_us']:.1f} | {fmt(torch_us('torch_sdpa', r))} "
                  f"| {'—' if gpu is None else kib(gpu)} "
                  f"| {percent(gpu, full_bytes)} "
                  f"| {'—' if host is None else kib(host)} | {r['prefill_seconds']:.1f} "
                  f"| {build_seconds(r)} | {mix(r)} |")


if __name__ == "__main__":
    main()
