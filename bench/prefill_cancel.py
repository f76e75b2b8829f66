"""How long kvrecalld keeps building after a Prefill ends early: a one-layer graph-index prompt
(probe 8's case: 24K tokens, 8 / 2 heads of 64 dims, 16384 build queries) ended while its layer
builds by its deadline, a client cancel or a CloseSession. For each: what the client heard, and
the seconds and CPU-seconds the server went on working after the call ended (read from the
process's CPU time: idle once it burns under 5 % of a core for 0.3 s). The deadline, and the
cancel and close 0.5 s after the last chunk was sent, fall inside the build. Then probe 8's retry
storm: `--retries` attempts of the Prefill with a deadline shorter than its build, each followed
by its CloseSession, and right after them a 100-token Prefill of another session, whose time is
what a runner beside the storm waits (beside the same Prefill on the idle server). Beside a
whole Prefill of the same prompt. Prints JSON.

    python3 bench/prefill_cancel.py [--server build/server/kvrecalld] [--tokens 24576]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "client", "python"))
import grpc  # noqa: E402
import numpy as np  # noqa: E402
import kvrecall  # noqa: E402,F401  (puts the generated modules on the path)
from kvrecall.v1 import kvrecall_pb2 as pb  # noqa: E402
from kvrecall.v1 import kvrecall_pb2_grpc as pb_grpc  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def until_idle(pid, since):
    """Seconds from `since` until the server went idle, and the CPU-seconds it burnt then."""
    start_cpu = cpu_seconds(pid)
    while True:
        a, t = cpu_seconds(pid), time.time()
        time.sleep(0.3)
        if cpu_seconds(pid) - a < 0.015 or time.time() - since > 60:
            return t - since, cpu_seconds(pid) - start_cpu


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="build/server/kvrecalld")
    parser.add_argument("--tokens", type=int, default=24576)
    parser.add_argument("--retries", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([args.server, f"--address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                        options=[("grpc.max_send_message_length", 64 << 20)])
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.KvRecallStub(channel)
        geometry = pb.Geometry(layers=1, q_heads=8, kv_heads=2, head_dim=64, dtype=pb.DTYPE_F32)
        policy = pb.Policy(selector=pb.SELECTOR_INDEX, top_k=64, sinks=16, recent=64,
                           index=pb.IndexParams(build_queries=16384))
        rng = np.random.default_rng(0)
        t = args.tokens

        def tensor(n, heads):
            x = rng.standard_normal((n, heads, 64), dtype=np.float32)
            return pb.Tensor(shape=list(x.shape), dtype=pb.DTYPE_F32, data=x.tobytes())

        chunks = [pb.PrefillChunk(layer=0, offset=p, k=tensor(min(4096, t - p), 2),
                                  v=tensor(min(4096, t - p), 2), q=tensor(min(4096, t - p), 8))
                  for p in range(0, t, 4096)]

        def new_session():
            sid = stub.CreateSession(pb.CreateSessionRequest(geometry=geometry,
                                                             policy=policy)).session_id
            chunks[0].session_id = sid
            return sid

        small = [pb.PrefillChunk(layer=0, offset=0, k=tensor(100, 2), v=tensor(100, 2),
                                 q=tensor(100, 8))]

        def small_prefill_seconds():
            small[0].session_id = stub.CreateSession(pb.CreateSessionRequest(
                geometry=geometry, policy=policy)).session_id
            sent = time.time()
            stub.Prefill(iter(small))
            seconds = time.time() - sent
            stub.CloseSession(pb.CloseSessionRequest(session_id=small[0].session_id))
            return seconds

        results = {"tokens": t, "cpus": os.cpu_count()}
        sid = new_session()
        sent = time.time()
        response = stub.Prefill(iter(chunks))
        results["whole_prefill_seconds"] = time.time() - sent
        results["whole_build_seconds"] = response.build_seconds
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        until_idle(server.pid, time.time())
        # A deadline that passes while the layer builds (about 40 % into its build).
        deadline = max(0.5, results["whole_prefill_seconds"] - 0.6 * results["whole_build_seconds"])
        results["deadline_s"] = round(deadline, 3)
        results["small_prefill_alone_s"] = round(small_prefill_seconds(), 4)
        for how in ("deadline", "cancel", "close"):
            sid = new_session()
            streamed = threading.Event()

            def stream():
                yield from chunks
                streamed.set()

            outcome = {}

            def call():
                try:
                    stub.Prefill(stream(), timeout=deadline if how == "deadline" else None)
                    outcome["status"] = "OK"
                except grpc.RpcError as e:
                    outcome["status"] = e.code().name
                outcome["ended"] = time.time()

            if how == "cancel":
                future = stub.Prefill.future(stream())
                streamed.wait()
                time.sleep(0.5)
                future.cancel()
                outcome = {"status": "CANCELLED (by the client)", "ended": time.time()}
            else:
                thread = threading.Thread(target=call)
                thread.start()
                streamed.wait()
                time.sleep(0.5)
                if how == "close":
                    closed = time.time()
                    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                thread.join()
            seconds, cpu = until_idle(server.pid, outcome["ended"])
            row = {"client_heard": outcome["status"],
                   "server_busy_after_the_call_ended_s": round(seconds, 3),
                   "server_cpu_s_after_the_call_ended": round(cpu, 3)}
            if how == "close":
                row["answered_after_the_close_s"] = round(outcome["ended"] - closed, 3)
            results[how] = row
            try:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            except grpc.RpcError:
                pass
        # The retry storm: each attempt's deadline passes while its layer builds.
        storm = {"attempts": []}
        for _ in range(args.retries):
            sid = new_session()
            try:
                stub.Prefill(iter(chunks), timeout=deadline)
                storm["attempts"].append("OK")
            except grpc.RpcError as e:
                storm["attempts"].append(e.code().name)
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        storm["small_prefill_right_after_s"] = round(small_prefill_seconds(), 4)
        results["retry_storm"] = storm
        print(json.dumps(results, indent=1))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()
