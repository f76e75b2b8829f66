"""Summarizes bench/metrics_overhead.sh's runs: per round the p50/p99 of the layer-step round
trip and the server's CPU per round trip with metrics off and on, the medians over rounds, and
the on/off ratios of the medians. Prints JSON.

    python3 bench/metrics_overhead_table.py OUT_DIR ROUNDS
"""
import json
import statistics
import sys


def main(out, rounds):
    runs = {m: [json.load(open(f"{out}/metrics_{m}_r{r}.json")) for r in range(1, rounds + 1)]
            for m in ("off", "on")}

    def figures(run):
        return {"layer_step_p50_us": run["layer_step_us"]["p50"],
                "layer_step_p99_us": run["layer_step_us"]["p99"],
                "empty_p50_us": run["empty_us"]["p50"],
                "server_cpu_us_per_layer_step":
                    run["cpu_per_round_trip"]["layer_step"]["server_process_cpu_us"],
                "server_cpu_us_per_empty":
                    run["cpu_per_round_trip"]["empty"]["server_process_cpu_us"]}

    per_round = {m: [figures(r) for r in rs] for m, rs in runs.items()}
    medians = {m: {k: statistics.median(f[k] for f in fs) for k in fs[0]}
               for m, fs in per_round.items()}
    ratios = {k: medians["on"][k] / medians["off"][k] for k in medians["off"]
              if medians["off"][k]}
    print(json.dumps({"iterations": runs["off"][0]["iterations"], "rounds": rounds,
                      "per_round": per_round, "median": medians, "on_over_off": ratios},
                     indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
