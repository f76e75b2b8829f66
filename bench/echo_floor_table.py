"""echo_floor_table.py: the markdown tables of bench/echo_floor.sh's runs (one JSON per server x
transport x client, written by rpc_overhead and rpc_overhead.py), with the issue-12 targets
read off the same run.

    /usr/bin/python3 bench/echo_floor_table.py OUT_DIR/*_*_*.json > rpc_floor_table.md
"""
import json
import os
import sys

# kvrecalld-base: an earlier build in the same run; kvrecalld-1t: OMP_NUM_THREADS=1.
SERVERS = ["echo-sync", "echo-callback", "kvrecalld-base", "kvrecalld", "kvrecalld-1t"]
FLOORS = SERVERS[:2]


def fmt(x, digits=1):
    return "–" if x is None else f"{x:.{digits}f}"


def main(paths):
    runs = {}
    for p in paths:
        with open(p) as f:
            j = json.load(f)
        server, transport, client = os.path.basename(p)[:-len(".json")].split("_", 2)
        runs[(server, transport, client)] = j
    clients = sorted({c for _, _, c in runs}, key=lambda c: (c != "c++", c))
    print("| client | transport | server | empty p50 | empty p99 | layer-step p50 | layer-step p99 "
          "| server compute p50 | step − compute p50 | CPU/empty client | CPU/empty server "
          "| CPU/step client | CPU/step server |")
    print("| --- | --- | --- | " + " | ".join(["---:"] * 10) + " |")
    for client in clients:
        for transport in ["tcp", "unix", "shm"]:
            for server in SERVERS:
                j = runs.get((server, transport, client))
                if j is None:
                    continue
                cpu = j["cpu_per_round_trip"]
                compute = j.get("layer_step_server_us", {}).get("p50")
                minus = j.get("layer_step_minus_server_us", {}).get("p50")
                print(f"| {client} | {transport} | {server} | {fmt(j['empty_us']['p50'])} "
                      f"| {fmt(j['empty_us']['p99'])} | {fmt(j['layer_step_us']['p50'])} "
                      f"| {fmt(j['layer_step_us']['p99'])} | {fmt(compute)} | {fmt(minus)} "
                      f"| {fmt(cpu['empty']['client_process_cpu_us'])} "
                      f"| {fmt(cpu['empty']['server_process_cpu_us'])} "
                      f"| {fmt(cpu['layer_step']['client_process_cpu_us'])} "
                      f"| {fmt(cpu['layer_step']['server_process_cpu_us'])} |")
    print()
    print("All figures µs; p50/p99 from the alternating pairs, CPU time per round trip (process "
          "user + system, all threads) from one phase of each kind.")
    print()
    # The targets, from this run: the floor is the faster echo API per transport and client.
    for client in clients:
        for transport, kvrecalld in [(t, s) for t in ["tcp", "unix", "shm"] for s in SERVERS[2:]]:
            k = runs.get((kvrecalld, transport, client))
            # The floor of a client is the echo through the same gRPC path (torch inputs or
            # numpy, Python's echo is the same); shared memory is set against the gRPC floor of
            # the co-located path, the Unix socket's.
            same = "python-numpy" if client == "python-torch" else client
            via = "unix" if transport == "shm" else transport
            floors = [runs[(s, via, same)] for s in FLOORS if (s, via, same) in runs]
            if k is None or not floors:
                continue
            floor = min(floors, key=lambda j: j["empty_us"]["p50"])
            ratio = k["empty_us"]["p50"] / floor["empty_us"]["p50"]
            step_floor = min(f["layer_step_us"]["p50"] for f in floors)
            line = (f"- {client}, {transport}: {kvrecalld} empty {fmt(k['empty_us']['p50'])} µs = "
                    f"{ratio:.2f}× the floor ({floor['label']}, {fmt(floor['empty_us']['p50'])} "
                    f"µs{', over the Unix socket' if transport == 'shm' else ''}); "
                    f"layer-step − server compute "
                    f"{fmt(k.get('layer_step_minus_server_us', {}).get('p50'))} µs (the floor's "
                    f"12K/8K round trip: {fmt(step_floor)} µs)")
            print(line)
    # The server's compute for the step against the attention alone, timed in the C++ client's
    # process on the same shapes (issue 12: within 2x of the step's arithmetic on one core).
    for (server, transport, client), j in sorted(runs.items()):
        alone = j.get("attention_alone_us")
        if alone and "layer_step_server_us" in j:
            compute = j["layer_step_server_us"]["p50"]
            one = alone["one_thread"]["p50"]
            print(f"- {server}, {transport}: server compute {fmt(compute)} µs; attention alone "
                  f"{fmt(one)} µs on one thread ({compute / one:.2f}×), "
                  f"{fmt(alone['team']['p50'])} µs on a team")
    for client in clients:
        t, u = runs.get(("kvrecalld", "tcp", client)), runs.get(("kvrecalld", "unix", client))
        if t and u:
            print(f"- {client}: kvrecalld empty over the Unix socket "
                  f"{fmt(u['empty_us']['p50'])} µs vs TCP {fmt(t['empty_us']['p50'])} µs")


if __name__ == "__main__":
    main(sys.argv[1:])
