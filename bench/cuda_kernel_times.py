#!/usr/bin/env python3
"""Per-kernel GPU time from an `ncu --csv --metrics gpu__time_duration.sum` log: launches and
mean/median/max microseconds per kernel (idle launches, say of the exact path in a reuse step,
pull the mean down; the max is the launch that did the work) (template arguments shortened), to see where a step's time
goes on the GPU machine, where Nsight Systems does not run."""
import collections
import csv
import re
import sys


def short(name):
    name = re.sub(r"kvrecall::cuda::", "", name)
    name = re.sub(r"\(.*$", "", name)  # drop the parameter list
    return name[:110]


def main():
    rows = [r for r in csv.reader(line for line in open(sys.argv[1]) if line.startswith('"'))]
    header, rows = rows[0], rows[1:]
    name_at, value_at, unit_at = (header.index("Kernel Name"), header.index("Metric Value"),
                                  header.index("Metric Unit"))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    times = collections.defaultdict(list)
    for r in rows:
        times[short(r[name_at])].append(float(r[value_at].replace(",", "")) * scale[r[unit_at]])
    for name, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        ordered = sorted(ts)
        print(f"{len(ts):5d} launches  mean {sum(ts) / len(ts):9.2f} us  median "
              f"{ordered[len(ordered) // 2]:9.2f} us  max {ordered[-1]:9.2f} us  {name}")


if __name__ == "__main__":
    main()
