"""rpc_overhead.py: bench/rpc_overhead's measurement through the Python client (grpcio), the
client the Hugging Face backend pays per layer-step. On one open stream it alternates an empty
request with a layer-step-sized one (p50 / p99 of both round trips), then runs two phases of one
kind each for the CPU time per round trip of this process (grpcio's threads included) and, given
--server_pid, of the server.

--protocol=kvrecall: kvrecall.Client's Decode stream over a prefilled 64-token streaming session
(32 query / 8 KV heads, d=128, bf16: 12 KiB in, 8 KiB out), inputs as numpy float32 or torch
bf16 tensors (--inputs); with --shared_memory the steps go through a DecodeShared region
(kvrecall.shared; a kvrecalld on this host with --shared_memory_dir), the transport "shm".
--protocol=echo: bench/echo_floor with the same sizes and the client's
threading (a queue-fed request iterator, replies read in lock step), doing nothing else; with
--api=aio the same stream through grpc.aio on an event loop run by the calling thread.
--protocol=echo-unary: one EchoOnce call per round trip (grpcio runs a unary call on the
calling thread).

    PYTHONPATH=client/python:build/bench/python /usr/bin/python3 bench/rpc_overhead.py \
        --protocol=kvrecall --server=unix:/tmp/k.sock --server_pid=PID --json_out=out.json
"""
import argparse
import json
import os
import queue
import sys
import time

import grpc
import numpy as np


def process_cpu_us(pid):
    """User + system CPU of process `pid` (all its threads) in µs, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e6 / os.sysconf("SC_CLK_TCK")


def quantiles(us):
    a = np.asarray(us)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


class KvRecallStream:
    """A prefilled session and the client's Decode stream."""

    def __init__(self, address, args):
        import kvrecall
        from kvrecall.client import make_geometry, make_policy
        self.client = kvrecall.Client(address, wait_ready_s=30, shared_memory=args.shared_memory)
        g = make_geometry(1, args.q_heads, args.kv_heads, args.head_dim, args.dtype)
        ctx = args.context
        self.session = self.client.create_session(
            g, make_policy("streaming", sinks=min(16, ctx), recent=max(1, ctx - 16)),
            "rpc_overhead.py")
        rng = np.random.default_rng(1)
        normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
        self.session.prefill([(normal(ctx, args.q_heads, args.head_dim),
                               normal(ctx, args.kv_heads, args.head_dim),
                               normal(ctx, args.kv_heads, args.head_dim))])
        q = normal(args.q_heads, args.head_dim)
        k, v = normal(args.kv_heads, args.head_dim), normal(args.kv_heads, args.head_dim)
        if args.inputs == "torch":
            import torch
            dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
            q, k, v = (torch.from_numpy(x).to(dt) for x in (q, k, v))
        self.step = [(self.session, q, k, v)]
        self.server_micros = None

    def round_trip(self, layer_step):
        results = self.client.attend_batch(0, self.step if layer_step else [])
        self.server_micros = self.client.decode_stream.last_server_micros
        return results

    def close(self):
        self.session.close()
        self.client.close()


class EchoStream:
    """echo_floor's stream, driven as kvrecall.client.DecodeStream drives Decode."""

    def __init__(self, address, args):
        from bench import echo_floor_pb2 as pb
        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        echo = self.channel.stream_stream("/kvrecall.bench.EchoFloor/Echo",
                                          request_serializer=pb.EchoRequest.SerializeToString,
                                          response_deserializer=pb.EchoReply.FromString)
        self.requests = queue.SimpleQueue()  # as kvrecall.client.DecodeStream
        self.responses = echo(iter(self.requests.get, None))
        item = 4 if args.dtype == "f32" else 2
        self.payload = bytes((args.q_heads + 2 * args.kv_heads) * args.head_dim * item)
        self.reply_bytes = args.q_heads * args.head_dim * item
        self.server_micros = None

    def round_trip(self, layer_step):
        req = self.pb.EchoRequest(payload=self.payload, reply_bytes=self.reply_bytes) \
            if layer_step else self.pb.EchoRequest()
        self.requests.put(req)
        reply = next(self.responses)
        if len(reply.payload) != req.reply_bytes:
            raise RuntimeError(f"echo reply of {len(reply.payload)} bytes, asked for "
                               f"{req.reply_bytes}")
        return reply

    def close(self):
        self.requests.put(None)
        for _ in self.responses:
            pass
        self.channel.close()


class EchoAio:
    """echo_floor's stream through grpc.aio, its event loop run by the calling thread."""

    def __init__(self, address, args):
        import asyncio
        import grpc.aio
        from bench import echo_floor_pb2 as pb
        self.pb = pb
        self.loop = asyncio.new_event_loop()

        async def open_stream():
            channel = grpc.aio.insecure_channel(address)
            await asyncio.wait_for(channel.channel_ready(), 30)
            echo = channel.stream_stream("/kvrecall.bench.EchoFloor/Echo",
                                         request_serializer=pb.EchoRequest.SerializeToString,
                                         response_deserializer=pb.EchoReply.FromString)
            return channel, echo()
        self.channel, self.call = self.loop.run_until_complete(open_stream())
        item = 4 if args.dtype == "f32" else 2
        self.payload = bytes((args.q_heads + 2 * args.kv_heads) * args.head_dim * item)
        self.reply_bytes = args.q_heads * args.head_dim * item
        self.server_micros = None

    async def _exchange(self, req):
        await self.call.write(req)
        return await self.call.read()

    def round_trip(self, layer_step):
        req = self.pb.EchoRequest(payload=self.payload, reply_bytes=self.reply_bytes) \
            if layer_step else self.pb.EchoRequest()
        reply = self.loop.run_until_complete(self._exchange(req))
        if len(reply.payload) != req.reply_bytes:
            raise RuntimeError(f"echo reply of {len(reply.payload)} bytes, asked for "
                               f"{req.reply_bytes}")
        return reply

    def close(self):
        async def finish():
            await self.call.done_writing()
            await self.channel.close()
        self.loop.run_until_complete(finish())
        self.loop.close()


class EchoUnary:
    """One EchoOnce call per round trip."""

    def __init__(self, address, args):
        from bench import echo_floor_pb2 as pb
        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.once = self.channel.unary_unary("/kvrecall.bench.EchoFloor/EchoOnce",
                                             request_serializer=pb.EchoRequest.SerializeToString,
                                             response_deserializer=pb.EchoReply.FromString)
        item = 4 if args.dtype == "f32" else 2
        self.payload = bytes((args.q_heads + 2 * args.kv_heads) * args.head_dim * item)
        self.reply_bytes = args.q_heads * args.head_dim * item
        self.server_micros = None

    def round_trip(self, layer_step):
        req = self.pb.EchoRequest(payload=self.payload, reply_bytes=self.reply_bytes) \
            if layer_step else self.pb.EchoRequest()
        reply = self.once(req)
        if len(reply.payload) != req.reply_bytes:
            raise RuntimeError(f"echo reply of {len(reply.payload)} bytes, asked for "
                               f"{req.reply_bytes}")
        return reply

    def close(self):
        self.channel.close()


def cpu_phase(stream, layer_step, n, server_pid):
    s0 = process_cpu_us(server_pid) if server_pid else None
    p0, t0, w0 = time.process_time_ns(), time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        stream.round_trip(layer_step)
    w1, p1, t1 = time.perf_counter_ns(), time.process_time_ns(), time.thread_time_ns()
    return {"mean_round_trip_us": (w1 - w0) / 1e3 / n,
            "client_process_cpu_us": (p1 - p0) / 1e3 / n,
            "client_thread_cpu_us": (t1 - t0) / 1e3 / n,
            "server_process_cpu_us":
                (process_cpu_us(server_pid) - s0) / n if server_pid else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", choices=["kvrecall", "echo", "echo-unary"], default="kvrecall")
    ap.add_argument("--api", choices=["sync", "aio"], default="sync",
                    help="grpcio's API for --protocol=echo")
    ap.add_argument("--server", required=True, help="HOST:PORT or unix:PATH")
    ap.add_argument("--shared_memory", action="store_true",
                    help="--protocol=kvrecall's steps through a shared-memory region opened over "
                         "--server (DecodeShared; kvrecalld with --shared_memory_dir)")
    ap.add_argument("--server_pid", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--q_heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--inputs", choices=["numpy", "torch"], default="numpy",
                    help="the layer-step's q, k_new, v_new: numpy float32 or torch tensors of "
                         "the session dtype (what the Hugging Face backend passes)")
    ap.add_argument("--iterations", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--json_out", default="")
    args = ap.parse_args()

    if args.api == "aio" and args.protocol != "echo":
        ap.error("--api=aio is for --protocol=echo")
    if args.shared_memory and args.protocol != "kvrecall":
        ap.error("--shared_memory is for --protocol=kvrecall")
    kind = {"kvrecall": KvRecallStream, "echo-unary": EchoUnary,
            "echo": EchoAio if args.api == "aio" else EchoStream}[args.protocol]
    stream = kind(args.server, args)
    empty, step, server, transport = [], [], [], []
    clock = time.perf_counter_ns
    for i in range(args.warmup + args.iterations):
        t0 = clock()
        stream.round_trip(False)
        t1 = clock()
        stream.round_trip(True)
        t2 = clock()
        if i < args.warmup:
            continue
        empty.append((t1 - t0) / 1e3)
        step.append((t2 - t1) / 1e3)
        if stream.server_micros is not None:
            server.append(stream.server_micros)
            transport.append(step[-1] - stream.server_micros)
    cpu = {"empty": cpu_phase(stream, False, args.iterations, args.server_pid),
           "layer_step": cpu_phase(stream, True, args.iterations, args.server_pid)}
    stream.close()

    item = 4 if args.dtype == "f32" else 2
    client = f"python ({args.inputs})" if args.protocol == "kvrecall" else f"python ({args.api})"
    transport_name = ("shm" if args.shared_memory else
                      "unix" if args.server.startswith("unix:") else "tcp")
    j = {"protocol": args.protocol, "label": args.label, "client": client,
         "server": args.server, "transport": transport_name,
         "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
         "dtype": args.dtype, "context": args.context, "iterations": args.iterations,
         "request_bytes": (args.q_heads + 2 * args.kv_heads) * args.head_dim * item,
         "reply_bytes": args.q_heads * args.head_dim * item,
         "grpcio": grpc.__version__, "python": sys.version.split()[0],
         "empty_us": quantiles(empty), "layer_step_us": quantiles(step)}
    if server:
        j["layer_step_server_us"] = quantiles(server)
        j["layer_step_minus_server_us"] = quantiles(transport)
    j["cpu_per_round_trip"] = cpu
    through = " through shared memory" if args.shared_memory else ""
    print(f"{args.protocol} {args.label}, Python client ({args.inputs}), {args.iterations} pairs "
          f"on one stream to {args.server}{through}")
    print(f"  {'round trip (us)':34} {'p50':>9} {'p99':>9}")
    for name, key in [("empty request", "empty_us"), ("layer-step", "layer_step_us"),
                      ("  of which server compute", "layer_step_server_us"),
                      ("layer-step minus server compute", "layer_step_minus_server_us")]:
        if key in j:
            print(f"  {name:34} {j[key]['p50']:9.1f} {j[key]['p99']:9.1f}")
    print("  CPU us per round trip:")
    for kind, c in cpu.items():
        srv = "-" if c["server_process_cpu_us"] is None else f"{c['server_process_cpu_us']:.1f}"
        print(f"  {kind:34} client {c['client_process_cpu_us']:6.1f} "
              f"(thread {c['client_thread_cpu_us']:6.1f})  server {srv}")
    print(json.dumps(j))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(j, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
