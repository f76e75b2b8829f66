"""Needle-in-a-haystack test of decode policies on synthetic replay traces (`kvrecall synth`),
whose __metadata__ "needles" lists planted key/value pairs: {"position", "decode_step"}. At a
needle's decode step the planted key outscores every other key by far, so under full attention
the needle holds nearly all of the softmax mass: a policy found it for a (layer, query head) when
its support keeps more than half of the mass that full attention gives (the server's
compare_exact `retained_mass`).

  PYTHONPATH=client/python python3 -m kvrecall.needles --server ADDR --trace t.safetensors \
      --runs full exact_topk:512 streaming:512 index:512 retopk:512 --jsonl runs.jsonl

A run is selector[:K][/placement][/knob=value...]: the CPU placement unless named (cpu, gpu,
tiered); knobs of policy.index (e.g. index:512/tiered/shortlist=2048,
index:512/tiered/exact_search=graph). streaming:K keeps 128 sinks and K-128 recent tokens
(K >= 128). Every spec, and the trace, is checked before the first run.

Every decode step of the trace is replayed in order (ReTopK's cache depends on the steps between
needles); only the needle steps ask the server for compare_exact diagnostics.
"""
import argparse
import json
import math
import os
import re
import stat
import sys
import time

import numpy as np

from kvrecall.client import (PATH_NAMES, Client, add_connection_arguments, connection_from_args,
                             make_geometry, make_policy, streaming_window)

_DTYPES = {"BF16": ("<u2", "bf16"), "F16": ("<f2", "f16"), "F32": ("<f4", "f32")}
_ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _int_at_least(text, what, low):
    """int(text); ValueError naming `what` unless it is an integer >= low."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {text!r}")
    return value


def read_safetensors(path):
    """(header, metadata, {name: array}) with arrays memory-mapped; bf16 tensors are uint16
    bit patterns (what kvrecall.tensors sends as bf16 without conversion). ValueError naming
    the file (and the tensor) for anything that is not a well-formed safetensors file: the
    header length, JSON and entries are checked before a byte of data is mapped."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        size = st.st_size
        first = f.read(8)
        if len(first) < 8:
            raise ValueError(f"{path}: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(first, "little")
        if n > size - 8:  # read before allocating: a bogus length would take n bytes of memory
            raise ValueError(f"{path}: header length {n} exceeds the {size - 8} bytes after it")
        try:
            header = json.loads(f.read(n))
        except RecursionError:
            raise ValueError(f"{path}: the header's JSON is nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: __metadata__ is not an object of strings")
    data_bytes = size - 8 - n
    # np.memmap refuses an empty mapping; a file of empty tensors has no data to map.
    raw = (np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if data_bytes
           else np.zeros(0, np.uint8))
    arrays = {}
    for name, h in header.items():
        what = f"{path}: tensor {name!r}"
        if not isinstance(h, dict) or h.get("dtype") not in _DTYPES:
            dtype = h.get("dtype") if isinstance(h, dict) else None
            raise ValueError(f"{what}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        shape, offsets = h.get("shape"), h.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
            raise ValueError(f"{what}: shape {shape!r} is not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
                and 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ValueError(f"{what}: data_offsets {offsets!r} are not [begin, end] within "
                             f"the {data_bytes} data bytes")
        b, e = offsets
        want = math.prod(shape) * _ITEM_BYTES[h["dtype"]]
        if e - b != want:
            raise ValueError(f"{what}: shape {shape} of {h['dtype']} takes {want} bytes, "
                             f"data_offsets [{b}, {e}] hold {e - b}")
        arrays[name] = raw[b:e].view(_DTYPES[h["dtype"]][0]).reshape(shape)
    return header, meta, arrays


def needle_trace(trace, path="the trace"):
    """The geometry and needles of a trace (read_safetensors) as replay needs them: a dict of
    layers, context, q_heads, kv_heads, head_dim, decode_steps, dtype and needles
    ({decode_step: position}). ValueError naming the tensor or field that is missing or does
    not fit, or for a trace without needles (they are what is measured)."""
    header, meta, t = trace
    if "layers" in meta:
        # Digits alone: int() reads "1_0" as 10 and " 2" as 2.
        layers = int(meta["layers"]) if re.fullmatch(r"[0-9]+", str(meta["layers"])) else 0
        if layers < 1:
            raise ValueError(f"{path}: __metadata__ layers {meta['layers']!r} is not an "
                             "integer >= 1")
    else:
        found = [int(m.group(1)) for m in map(re.compile(r"layer(\d+)\.").match, header) if m]
        if not found:
            raise ValueError(f"{path}: no layer<N>.* tensors")
        layers = 1 + max(found)
    first = {}  # part: layer 0's [q, k, v] shapes, which every layer must have
    for l in range(layers):
        for part in ("prefill", "decode"):
            shapes = []
            for x in "qkv":
                name = f"layer{l}.{part}.{x}"
                if name not in t:
                    raise ValueError(f"{path}: tensor {name!r} is missing (the trace has "
                                     f"{layers} layers)")
                if t[name].ndim != 3:
                    raise ValueError(f"{path}: tensor {name!r} has shape {list(t[name].shape)}, "
                                     "want [tokens, heads, head_dim]")
                shapes.append(tuple(t[name].shape))
            (n, _, d), (nk, _, dk), shape_v = shapes
            if (nk, dk) != (n, d) or shape_v != shapes[1]:
                raise ValueError(f"{path}: layer{l}.{part}.q, k and v have shapes "
                                 f"{[list(x) for x in shapes]}, want [n, q_heads, head_dim], "
                                 "[n, kv_heads, head_dim] and [n, kv_heads, head_dim]")
            first.setdefault(part, shapes)
            if shapes != first[part]:
                raise ValueError(f"{path}: layer{l}.{part} has shapes {[list(x) for x in shapes]}"
                                 f", layer0.{part} {[list(x) for x in first[part]]}")
    (T, hq, d), (_, hkv, _), _ = first["prefill"]
    (steps, hq_decode, d_decode), (_, hkv_decode, _), _ = first["decode"]
    if (hq_decode, hkv_decode, d_decode) != (hq, hkv, d):
        raise ValueError(f"{path}: decode tensors have {hq_decode} q heads, {hkv_decode} kv heads "
                         f"and head_dim {d_decode}, prefill ones {hq}, {hkv} and {d}")
    # The geometry __metadata__ declares must be the tensors' (as the C++ Trace::Validate holds
    # it): a replay would otherwise measure something other than what the file says it holds.
    for key, actual in (("layers", layers), ("q_heads", hq), ("kv_heads", hkv),
                        ("head_dim", d), ("context", T), ("decode", steps)):
        if key in meta and str(meta[key]) != str(actual):
            raise ValueError(f"{path}: __metadata__ {key} is {meta[key]!r} but the tensors say "
                             f"{actual}")
    dtypes = {h["dtype"] for name, h in header.items() if name.startswith("layer")}
    if len(dtypes) != 1:
        raise ValueError(f"{path}: the layer tensors mix dtypes {sorted(dtypes)}")
    if "needles" not in meta:
        raise ValueError(f"{path}: not a needle trace (no \"needles\" in __metadata__; make one "
                         "with kvrecall synth --needles N)")
    try:
        listed = json.loads(meta["needles"])
        needles = {n["decode_step"]: n["position"] for n in listed}
        if not all(_is_int(s) and 0 <= s < steps and _is_int(p) and 0 <= p < T
                   for s, p in needles.items()):
            raise ValueError
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise ValueError(f"{path}: __metadata__ needles {meta['needles']!r} is not a list of "
                         f"{{\"decode_step\": 0..{steps - 1}, \"position\": 0..{T - 1}}} (a "
                         "needle is a prompt position)") from None
    if len(needles) != len(listed):
        raise ValueError(f"{path}: __metadata__ needles {meta['needles']!r} lists a decode step "
                         "twice (one needle a step)")
    if not needles:
        raise ValueError(f"{path}: the trace has no needles (make one with kvrecall synth "
                         "--needles N, N >= 1)")
    return {"layers": layers, "context": T, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "decode_steps": steps, "dtype": _DTYPES[dtypes.pop()][1], "needles": needles}


def policy_for(spec):
    """The pb.Policy of a run spec; ValueError naming the spec for a K or knob value that is
    not an integer, streaming:K with K <= 128, or an unknown selector, placement or knob."""
    head, *rest = spec.split("/")
    selector, colon, k = head.partition(":")
    placement = "cpu"
    index = {}
    try:
        for part in rest:
            if "=" in part:
                key, _, value = part.partition("=")
                index[key] = value if key == "exact_search" else _int_at_least(value, key, 0)
            else:
                placement = part
        if colon:
            k = _int_at_least(k, "K", 1)
        if selector == "streaming" and colon:
            sinks, recent = streaming_window(k)
            return make_policy("streaming", placement, sinks=sinks, recent=recent)
        return make_policy(selector, placement, top_k=int(k or 0), index=index or None)
    except ValueError as e:
        raise ValueError(f"run {spec!r}: {e}") from None


def replay(client, trace, spec):
    """One run: the trace (read_safetensors) replayed in a session of `spec`'s policy; its
    result as a dict. ValueError (before a session is made) for a trace needle_trace refuses
    or a spec policy_for refuses."""
    t = trace[2]
    g = needle_trace(trace)
    layers, T, hq, hkv, d = g["layers"], g["context"], g["q_heads"], g["kv_heads"], g["head_dim"]
    n_steps, dtype, needles = g["decode_steps"], g["dtype"], g["needles"]
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
    for spec in a.runs:  # every spec before the first run: none is made for nothing
        try:
            policy_for(spec)
        except ValueError as e:
            ap.error(f"argument --runs: {e}")
    try:
        trace = read_safetensors(a.trace)
        needle_trace(trace, a.trace)
    except (OSError, ValueError) as e:
        print(f"kvrecall.needles: {e}", file=sys.stderr)
        return 1
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
