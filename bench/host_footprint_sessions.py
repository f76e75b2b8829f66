#!/usr/bin/env python3
# What the host memory budget charges per session against what the process holds: a kvrecalld's
# RSS and its kvrecall_host_memory_bytes gauge before and after N sessions of L layers x T tokens
# (full selector, 2 query heads / 1 KV head of 16, f32; probe 17's t20.py, trimmed), one line per
# row. Usage (a kvrecalld of your own, serving metrics):
#   /usr/bin/python3 bench/host_footprint_sessions.py ADDRESS METRICS_ADDRESS KVRECALLD_PID
import sys, time, urllib.request
sys.path.insert(0, "/work/main/client/python")
import numpy as np
from kvrecall.client import Client, make_geometry, make_policy
addr, metrics, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
def rss(): return int([l for l in open(f"/proc/{pid}/status").read().splitlines() if l.startswith("VmRSS")][0].split()[1])
def hm(): return int([l for l in urllib.request.urlopen(f"http://{metrics}/metrics").read().decode().splitlines() if l.startswith("kvrecall_host_memory_bytes")][0].split()[1])
def rnd(seed, *shape): return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
c = Client(addr)
for L, T, N in [(32, 16, 300), (32, 512, 100), (32, 4096, 30)]:
    g = make_geometry(L, 2, 1, 16)
    P = [(rnd(3*l, T, 2, 16), rnd(3*l+1, T, 1, 16), rnd(3*l+2, T, 1, 16)) for l in range(L)]
    r0, h0 = rss(), hm(); ss = []
    for i in range(N):
        s = c.create_session(g, make_policy("full")); s.prefill(P); ss.append(s)
    time.sleep(1)
    r1, h1 = rss(), hm()
    print(f"L={L} T={T}: RSS +{(r1-r0)/N:.0f} KiB/session, host_memory_bytes +{(h1-h0)/N/1024:.1f} KiB/session, KV {L*T*16*4*2/1024:.1f} KiB", flush=True)
    for s in ss: s.close()
    time.sleep(1)
