#!/usr/bin/env python3
"""Renders replay_matrix.sh's JSON lines (one `kvrecall replay --json` object each) as a
markdown table: fidelity against full attention, path mix and server time per layer-step."""
import json
import sys


def row(o):
    mix = o.get("path_mix", {})
    paths = ""
    if any(mix.values()):
        paths = "{:.0%} / {:.0%} / {:.0%}".format(mix["reuse"], mix["fallback"], mix["refresh"])
    return "| `{}` | {:.4f} | {:.4f} | {:.5f} | {:.4f} | {:.4f} | {} | {:.0f} | {:.0f} | {:.2f} / {:.2f} |".format(
        o["flags"], o["support_recall"], o["retained_mass"], o["output_cosine"],
        o["output_cosine_p05"], o["rel_l2"], paths, o["mean_candidates"], o["mean_support"],
        o["server_us"]["p50"] / 1000, o["server_us"]["p99"] / 1000)


def main():
    print("| replay flags | support recall | retained mass | output cosine | cosine p05 | rel L2 "
          "| reuse / fallback / refresh | scored/head | support/head | server ms p50 / p99 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in sys.argv[1:]:
        with open(path) as f:
            for line in f:
                if line.strip():
                    print(row(json.loads(line)))


if __name__ == "__main__":
    main()
