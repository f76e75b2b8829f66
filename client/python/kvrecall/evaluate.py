"""Quality-vs-speed evaluation of decode policies on a real model: runs `kvrecall.tinylm ppl`
for a list of policies over one text window (sharing one cached prefill), appends each JSON
result to a .jsonl file, and renders a Markdown table and a PNG plot (matplotlib) from it.

  PYTHONPATH=client/python python3 -m kvrecall.evaluate run --server ADDR \
      --model ../shared/models/tinylm-a.npz --text /usr/lib/python3.11 --offset 2000000 \
      --ctx 16384 --suffix 512 --runs full exact_topk:512 streaming:512 retopk:2048 \
      --jsonl bench/results/ppl_tinylm_16k.jsonl
  PYTHONPATH=client/python python3 -m kvrecall.evaluate render \
      --jsonl bench/results/ppl_tinylm_16k.jsonl --md bench/results/ppl_tinylm_16k.md \
      --png bench/results/ppl_tinylm_16k.png

A run is `selector[:K][@placement]`; streaming:K keeps 128 sinks and K-128 recent tokens, so
its budget equals the top-K selectors' (K >= 128). Every spec and flag is checked before the
first run starts: a bad one is a usage error, and no run is made.
"""
import argparse
import json
import shlex
import sys

from kvrecall import tinylm
from kvrecall.client import (PLACEMENTS, SELECTORS, add_connection_arguments, connection_argv,
                             streaming_window)


def run_args(spec, common):
    """tinylm ppl arguments for one run spec 'selector[:K][@placement]'; ValueError naming the
    spec for an unknown selector or placement, or a K that is not an integer >= 1 (> 128 for
    streaming). Checked here because tinylm's parser would exit the whole process on it."""
    head, _, placement = spec.partition("@")
    selector, colon, k = head.partition(":")
    if selector not in SELECTORS:
        raise ValueError(f"{spec}: unknown selector {selector!r}; selectors: {sorted(SELECTORS)}")
    if placement and placement not in PLACEMENTS:
        raise ValueError(f"{spec}: unknown placement {placement!r}; placements: "
                         f"{sorted(PLACEMENTS)}")
    args = common + ["--policy", selector, "--placement", placement or "cpu"]
    if colon:
        try:
            k = int(k)
            if k < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"{spec}: K must be an integer >= 1, got {k!r}") from None
        if selector == "streaming":
            try:
                sinks, recent = streaming_window(k)
            except ValueError as e:
                raise ValueError(f"{spec}: {e}") from None
            args += ["--sinks", str(sinks), "--recent", str(recent)]
        else:
            args += ["--k", str(k)]
    return args


def cmd_run(a):
    common = ["ppl", *connection_argv(a), "--model", a.model, "--text", *a.text,
              "--offset", str(a.offset), "--ctx", str(a.ctx), "--suffix", str(a.suffix), "--json"]
    if a.cache_dir is not None:
        common += ["--cache-dir", a.cache_dir]
    failures = 0
    for spec in a.runs:
        args = run_args(spec, common)
        command = "PYTHONPATH=client/python python3 -m kvrecall.tinylm " + shlex.join(args)
        try:
            r = tinylm.run_ppl(tinylm.parser().parse_args(args))
        except Exception as e:  # one policy failing (not served yet) must not stop the others
            failures += 1
            r = {"run": spec, "error": f"{type(e).__name__}: {e}"}
        r["run"], r["command"] = spec, command
        print(json.dumps(r), flush=True)
        with open(a.jsonl, "a") as f:
            f.write(json.dumps(r) + "\n")
    return 1 if failures else 0


# The fields a rendered row reads, and their types (render checks them before writing).
ROW_FIELDS = {"run": str, "policy": str, "placement": str, "bits_per_byte": (int, float),
              "path_mix": dict, "mean_candidates": (int, float), "layer_step_ms_p50": (int, float),
              "server_layer_step_ms_mean": (int, float), "token_ms_mean": (int, float),
              "command": str}


def load(path):
    """The rows of the .jsonl at `path`; ValueError naming the file and line of one that is not
    a JSON object with the fields render reads (a failed run's row: run, error, command)."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            fields = ({"run": str, "error": str, "command": str}
                      if isinstance(r, dict) and "error" in r else ROW_FIELDS)
            if not isinstance(r, dict):
                raise ValueError(f"{path}:{n}: not a JSON object")
            for name, typ in fields.items():
                if not isinstance(r.get(name), typ) or isinstance(r.get(name), bool):
                    raise ValueError(f"{path}:{n}: field {name!r} missing or not "
                                     f"{getattr(typ, '__name__', 'a number')}")
            if "error" in r and not r["error"].strip():
                raise ValueError(f"{path}:{n}: field 'error' is empty")
            rows.append(r)
    return rows


def label(r):
    k = r["run"].partition(":")[2].partition("@")[0]
    return r["policy"] + (f" K={k}" if k else "")


def cmd_render(a):
    rows = load(a.jsonl)
    ok = [r for r in rows if "error" not in r]
    full = next((r["bits_per_byte"] for r in ok if r["policy"] == "full"), None)
    lines = ["| run | placement | bits/byte | Δ vs full | path mix (exact/reuse/fallback/refresh) "
             "| mean candidates | layer-step p50 ms (client) | server ms/layer-step | ms/token |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        pm = r["path_mix"]
        delta = f"{r['bits_per_byte'] - full:+.4f}" if full is not None else "n/a"
        lines.append(f"| {label(r)} | {r['placement']} | {r['bits_per_byte']:.4f} | {delta} | "
                     f"{pm['exact']:.2f}/{pm['reuse']:.2f}/{pm['fallback']:.2f}/{pm['refresh']:.2f} | "
                     f"{r['mean_candidates']:.0f} | {r['layer_step_ms_p50']:.2f} | "
                     f"{r['server_layer_step_ms_mean']:.2f} | {r['token_ms_mean']:.1f} |")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | — | not run: {r['error'].splitlines()[0]} | | | | | | |")
    first = ok[0] if ok else {}
    md = [f"# {a.title}", "",
          f"Model {first.get('model')}, text {first.get('text')} at byte {first.get('offset')}, "
          f"ctx {first.get('ctx')} bytes prefilled, {first.get('suffix')} bytes teacher-forced "
          "with every layer's attention computed by kvrecalld (f32).", ""] + lines + \
         ["", "Commands (one per row, from the repository root):", "", "```"] + \
         [r["command"] for r in rows] + ["```", ""]
    if a.notes:
        md += [a.notes, ""]
    with open(a.md, "w") as f:
        f.write("\n".join(md))
    if a.png and ok:
        plot(ok, full, a.title, a.png)
    print("\n".join(lines))
    return 0


def plot(rows, full, title, path):
    """bits/byte against server time per layer-step; the right panel zooms in around full."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    markers = {"full": "*", "exact_topk": "o", "streaming": "s", "index": "^", "retopk": "D"}
    near = [r for r in rows if full is None or abs(r["bits_per_byte"] - full) < 0.02]
    for ax, subset in zip(axes, (rows, near)):
        for r in subset:
            ax.scatter(r["server_layer_step_ms_mean"], r["bits_per_byte"], s=60, color=f"C{rows.index(r)}",
                       marker=markers.get(r["policy"], "o"),
                       label=f"{label(r)}: {r['bits_per_byte']:.4f}")
        if full is not None:
            ax.axhline(full, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("server compute per layer-step (ms, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("bits per byte (lower is better)")
    axes[0].legend(fontsize=8)
    axes[1].set_title("zoom: within 0.02 bits/byte of full", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def writable(path, what):
    """ValueError unless `path` can be opened for appending (created if missing): checked before
    anything runs, so that no run's result is lost to a path that cannot take it."""
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{what}: cannot write {path}: {e.strerror}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m kvrecall.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    add_connection_arguments(r, server_required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--text", nargs="+", required=True)
    r.add_argument("--offset", type=tinylm.int_at_least(0), default=0)
    r.add_argument("--ctx", type=tinylm.int_at_least(1), default=16384)
    r.add_argument("--suffix", type=tinylm.int_at_least(1), default=512)
    r.add_argument("--cache-dir")
    r.add_argument("--runs", nargs="+", required=True, help="selector[:K][@placement] ...")
    r.add_argument("--jsonl", required=True)
    d = sub.add_parser("render")
    d.add_argument("--jsonl", required=True)
    d.add_argument("--md", required=True)
    d.add_argument("--png")
    d.add_argument("--title", default="tinylm-a: bits per byte vs decode cost, by policy")
    d.add_argument("--notes", default="")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        for spec in a.runs:  # every spec before the first run: none is made for nothing
            try:
                run_args(spec, [])
            except ValueError as e:
                r.error(f"argument --runs: {e}")
        try:
            writable(a.jsonl, "--jsonl")
        except ValueError as e:
            r.error(str(e))
        return cmd_run(a)
    if a.png:  # before the .md is written: a plot that cannot be drawn leaves nothing half done
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            d.error("--png needs matplotlib (apt-get install python3-matplotlib), or leave it out")
    try:
        return cmd_render(a)
    except (OSError, ValueError) as e:
        print(f"python3 -m kvrecall.evaluate render: "
              f"{e if isinstance(e, ValueError) else f'{e.filename}: {e.strerror}'}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
