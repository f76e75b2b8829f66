#!/usr/bin/env python3
"""Prints the build and recall figures of `kvrecall bench-index --json` outputs, one line group
per file: build seconds per layer (each layer's, when the JSON has them), page faults, the GPU
batch top-k's calls, the graph scope with the graphs' count and memory, per-index top-k and graph seconds with the graph's steps, and the recall /
scanned-fraction / search-time curve of the graph at its search width.

    python3 bench/index_summary.py index_llama128k_new_q4096.json ...
"""
import json
import os
import sys


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        g = d["methods"]["graph"]
        s = g.get("graph", {})
        print(f"{os.path.basename(path)}: build s per layer "
              f"{g.get('build_seconds_by_layer', g['build_seconds_per_layer'])}, page faults "
              f"{g.get('build_page_faults_per_layer', '-')}, GPU top-k {d.get('graph_topk_gpu')}, "
              f"graph scope {d.get('graph_params', {}).get('graph_scope', 'query_head')} "
              f"({g['indexes']} graphs, {g['memory_bytes_per_layer'] / 2**20:.1f} MiB per layer), "
              f"{d.get('threads')} threads, keys held {d.get('keys_held', 'f32')}")
        print(f"  per index: top-k {s.get('topk_seconds_per_index', 0):.4f} s, graph "
              f"{s.get('graph_seconds_per_index', 0):.4f} s "
              f"{s.get('graph_steps_seconds_per_index', '')}, pruning distances "
              f"{s.get('pruning_distances_per_index', '-')}")
        print("  search width %s, recall@%d / scanned / us per search:" % (
            d.get("graph_params", {}).get("search_width", 1), d["k"]), " ".join(
            "%d:%.4f/%.3f%%/%.0f" % (p["list_size"], p["recall"], 100 * p["scanned_fraction"],
                                     p.get("search_microseconds", float("nan")))
            for p in g["points"]))


if __name__ == "__main__":
    main()
