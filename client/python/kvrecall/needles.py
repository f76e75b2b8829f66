"""Needle-in-a-haystack test of decode policies on synthetic replay traces (`kvrecall synth`),
whose __metadata__ "needles" lists planted key/value pairs: {"position", "decode_step"}. At a
needle's decode step the planted key outscores every other key by far, so under full attention
the needle holds nearly all of the softmax mass: a policy found it for a (layer, query head) when
its support keeps more than half of the mass that full attention gives (the server's
compare_exact `retained_mass`).

  PYTHONPATH=client/python python3 -m kvrecall.needles --server ADDR --trace t.safetensors \
      --runs full exact_topk:512 streaming:512 index:512 retopk:512 --json

A run is selector[:K][/placement][/knob=value...]: the CPU placement unless named (cpu, gpu,
tiered); knobs of policy.index (e.g. index:512/tiered/shortlist=2048,
index:512/tiered/exact_search=graph).

Every decode step of the trace is replayed in order (ReTopK's cache depends on the steps between
needles); only the needle steps ask the server for compare_exact diagnostics.
"""
import argparse
import json
import sys
import time

import numpy as np

from kvrecall.client import (PATH_NAMES, Client, add_connection_arguments, connection_from_args,
                             make_geometry, make_policy)

_DTYPES = {"BF16": ("<u2", "bf16"), "F16": ("<f2", "f16"), "F32": ("<f4", "f32")}


def read_safetensors(path):
    """(header, metadata, {name: array}) with arrays memory-mapped; bf16 tensors are uint16
    bit patterns (what kvrecall.tensors sends as bf16 without conversion)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    arrays = {}
    for name, h in header.items():
        dt = _DTYPES[h["dtype"]][0]
        b, e = h["data_offsets"]
        arrays[name] = raw[b:e].view(dt).reshape(h["shape"])
    return header, meta, arrays


def policy_for(spec):
    head, *rest = spec.split("/")
    selector, _, k = head.partition(":")
    placement = "cpu"
    index = {}
    for part in rest:
        if "=" in part:
            key, _, value = part.partition("=")
            index[key] = value if key == "exact_search" else int(value)
        else:
            placement = part
    if selector == "streaming" and k:
        return make_policy("streaming", placement, sinks=128, recent=int(k) - 128)
    return make_policy(selector, placement, top_k=int(k or 0), index=index or None)


def replay(client, trace, spec):
    header, meta, t = trace
    layers = int(meta["layers"]) if "layers" in meta else \
        1 + max(int(k.split(".")[0][5:]) for k in header)
    q0 = t["layer0.prefill.q"]
    T, hq, d = q0.shape
    hkv = t["layer0.prefill.k"].shape[1]
    n_steps = t["layer0.decode.q"].shape[0]
    dtype = _DTYPES[header["layer0.prefill.q"]["dtype"]][1]
    needles = {n["decode_step"]: n["position"] for n in json.loads(meta["needles"])}
    s = client.create_session(make_geometry(layers, hq, hkv, d, dtype), policy_for(spec),
                              label=f"needles {spec}")
    try:
        t0 = time.perf_counter()
        s.prefill([(t[f"layer{l}.prefill.q"], t[f"layer{l}.prefill.k"], t[f"layer{l}.prefill.v"])
                   for l in range(layers)])
        prefill_s = time.perf_counter() - t0
        mass, cosine, paths, step_s = [], [], [], []
        for step in range(n_steps):
            for l in range(layers):
                q, k, v = (t[f"layer{l}.decode.{x}"][step] for x in "qkv")
                t1 = time.perf_counter()
                r = s.attend(l, q, k, v, compare_exact=step in needles)
                step_s.append(time.perf_counter() - t1)
                if step in needles:
                    mass += [h.retained_mass for h in r.heads]
                    cosine += [h.output_cosine for h in r.heads]
                    paths += [PATH_NAMES.get(h.path, "unspecified") for h in r.heads]
        info = s.info()
    finally:
        s.close()
    mass = np.asarray(mass)
    return {"run": spec, "context": T, "needles": len(needles), "layers": layers,
            "found": float((mass > 0.5).mean()), "retained_mass_mean": float(mass.mean()),
            "output_cosine_mean": float(np.mean(cosine)),
            "needle_step_paths": {p: paths.count(p) / len(paths) for p in sorted(set(paths))},
            "mean_candidates": info.mean_candidates,
            "layer_step_ms_p50": 1e3 * float(np.median(step_s)), "prefill_s": prefill_s,
            "effective_policy": str(s.policy).replace("\n", " ").strip()}


def render(jsonl, md_path, commands):
    """A Markdown table from --jsonl results: a row per run, a column per context, cells
    'found share (mean retained mass)'; runs that failed are listed with their error."""
    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    contexts = sorted({r["context"] for r in rows if "error" not in r})
    runs = list(dict.fromkeys(r["run"] for r in rows))
    cell = {(r["run"], r["context"]): r for r in rows if "error" not in r}
    head = "| run | " + " | ".join(f"{c // 1024}K" for c in contexts) + " | paths at needle steps (largest context) |"
    lines = [head, "|---" * (len(contexts) + 2) + "|"]
    for run in runs:
        got = [cell.get((run, c)) for c in contexts]
        if not any(got):
            err = next(r["error"] for r in rows if r["run"] == run and "error" in r)
            lines.append(f"| {run} | " + " | ".join("—" for _ in contexts) + f" | not run: {err} |")
            continue
        last = next(g for g in reversed(got) if g)
        paths = ", ".join(f"{k} {v:.2f}" for k, v in last["needle_step_paths"].items())
        lines.append(f"| {run} | " + " | ".join(
            f"{g['found']:.3f} ({g['retained_mass_mean']:.3f})" if g else "—" for g in got) +
            f" | {paths} |")
    times = ["| run | " + " | ".join(f"{c // 1024}K" for c in contexts) + " |",
             "|---" * (len(contexts) + 1) + "|"]
    for run in runs:
        got = [cell.get((run, c)) for c in contexts]
        if any(got):
            times.append(f"| {run} | " + " | ".join(
                f"{g['layer_step_ms_p50']:.2f}" if g else "—" for g in got) + " |")
    with open(md_path, "w") as f:
        f.write("\n".join(["# Needles in a haystack: synthetic traces, every selector", "",
                           "Cell: share of (needle, layer, query head) whose support keeps > 1/2 of "
                           "the softmax mass full attention gives the needle step (mean retained "
                           "mass in brackets).", ""] + lines +
                          ["", "Median time per layer-step, ms (client side, end to end):", ""] +
                          times + ["", "Commands:", "", "```"] + commands + ["```", ""]))
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m kvrecall.needles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_arguments(ap)
    ap.add_argument("--trace")
    ap.add_argument("--runs", nargs="+", help="selector[:K] ...")
    ap.add_argument("--jsonl", help="append one JSON line per run")
    ap.add_argument("--render-md", metavar="PATH",
                    help="only render --jsonl into a Markdown table at PATH")
    a = ap.parse_args(argv)
    if a.render_md:
        render(a.jsonl, a.render_md, [])
        return 0
    if not (a.server and a.trace and a.runs):
        ap.error("--server, --trace and --runs are required (unless --render-md)")
    trace = read_safetensors(a.trace)
    failures = 0
    with Client(a.server, **connection_from_args(a)) as client:
        for spec in a.runs:
            try:
                r = replay(client, trace, spec)
            except Exception as e:  # a selector that is not served yet must not stop the rest
                failures += 1
                r = {"run": spec, "error": f"{type(e).__name__}: {e}"}
            r["trace"] = a.trace
            print(json.dumps(r), flush=True)
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
