"""Tests of the Python client (client/python/kvrecall) against a real kvrecalld on loopback:
chunked prefill, decode steps over one stream (the Decode call, and a shared-memory region:
DecodeShared), batching, errors, and the tinylm runner's agreement with exact local attention. Run by CTest (client/python/CMakeLists.txt) as
`python3 -m unittest -v python_client_test` with KVRECALLD and PYTHONPATH set."""
import contextlib
import importlib.util
import io
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import struct
import tempfile
import threading
import time
import types
import unittest
import urllib.request

import grpc
import numpy as np

import kvrecall
from kvrecall import evaluate, needles, tensors, tinylm
from kvrecall.client import Session, make_geometry, make_policy, streaming_window
from kvrecalld_process import Kvrecalld

SOURCE_DIR = os.environ.get("KVRECALL_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tools' --token-file defaults to $KVRECALL_TOKEN_FILE: the tests' calls send no token unless
# a test says so, whatever the environment running them holds.
os.environ.pop("KVRECALL_TOKEN_FILE", None)
MODELS_DIR = os.path.join(os.path.dirname(SOURCE_DIR), "shared", "models")


def reference_attention(q, k, v, scale):
    """Full GQA attention of one query per head over all keys: q [Hq, D], k/v [T, Hkv, D]."""
    group = q.shape[0] // k.shape[1]
    out, lse = np.empty_like(q), np.empty(q.shape[0], dtype=np.float64)
    for h in range(q.shape[0]):
        s = k[:, h // group].astype(np.float64) @ q[h].astype(np.float64) * scale
        m = s.max()
        p = np.exp(s - m)
        lse[h] = m + math.log(p.sum())
        out[h] = (p / p.sum()) @ v[:, h // group]
    return out, lse


def decode_one_step_checked(test, client, label="python test"):
    """Makes a 1-layer full-attention session on `client`, prefills 20 random tokens, decodes one
    more and checks its output against reference_attention and its position; returns the
    session."""
    g = make_geometry(1, 4, 2, 16)
    s = client.create_session(g, make_policy("full"), label=label)
    rng = np.random.default_rng(9)
    k0 = rng.standard_normal((20, 2, 16), dtype=np.float32)
    v0 = rng.standard_normal((20, 2, 16), dtype=np.float32)
    s.prefill([(rng.standard_normal((20, 4, 16), dtype=np.float32), k0, v0)])
    q = rng.standard_normal((4, 16), dtype=np.float32)
    k = rng.standard_normal((2, 16), dtype=np.float32)
    v = rng.standard_normal((2, 16), dtype=np.float32)
    r = s.attend(0, q, k, v)
    want, _ = reference_attention(q, np.concatenate([k0, k[None]]),
                                  np.concatenate([v0, v[None]]), 1 / math.sqrt(16))
    np.testing.assert_allclose(r.output, want, rtol=0, atol=2e-5)
    test.assertEqual(r.position, 20)
    return s


class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        binary = os.environ.get("KVRECALLD", os.path.join(SOURCE_DIR, "build", "server", "kvrecalld"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cls.address = f"127.0.0.1:{port}"
        cls.log = tempfile.TemporaryFile()
        cls.server = subprocess.Popen([binary, f"--address={cls.address}",
                                       "--metrics_address=127.0.0.1:0"], stdout=cls.log,
                                      stderr=subprocess.STDOUT)
        try:
            cls.client = kvrecall.Client(cls.address, wait_ready_s=30)
        except Exception:
            cls.server.kill()
            cls.log.seek(0)
            sys.stderr.write(cls.log.read().decode(errors="replace"))
            raise

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.terminate()
        try:
            cls.server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            cls.server.kill()
        cls.log.close()


class ClientTest(ServerTest):
    L, HQ, HKV, D, T = 2, 4, 2, 16, 300

    def prompt(self, seed, d=None):
        rng, d = np.random.default_rng(seed), d or self.D
        return [(rng.standard_normal((self.T, self.HQ, d), dtype=np.float32),
                 rng.standard_normal((self.T, self.HKV, d), dtype=np.float32),
                 rng.standard_normal((self.T, self.HKV, d), dtype=np.float32))
                for _ in range(self.L)]

    def new_session(self, dtype="f32", seed=0, chunk_tokens=64):
        g = make_geometry(self.L, self.HQ, self.HKV, self.D, dtype)
        s = self.client.create_session(g, make_policy("full"), label="python test")
        self.addCleanup(s.close)
        layers = self.prompt(seed)
        r = s.prefill(layers, chunk_tokens=chunk_tokens)  # 5 chunks per layer
        self.assertEqual((r.layers_committed, r.tokens), (self.L, self.T))
        return s, layers

    def step_inputs(self, seed, d=None):
        rng, d = np.random.default_rng(seed), d or self.D
        return (rng.standard_normal((self.HQ, d), dtype=np.float32),
                rng.standard_normal((self.HKV, d), dtype=np.float32),
                rng.standard_normal((self.HKV, d), dtype=np.float32))

    def check_full_attention(self, result, layers, layer, q, k, v):
        """`result` (with lse) against reference_attention over the layer's keys and values
        with this step's appended; `layers` ([(q, k, v)] per layer) takes the step's k and v."""
        _, kl, vl = layers[layer]
        kl, vl = np.concatenate([kl, k[None]]), np.concatenate([vl, v[None]])
        layers[layer] = (None, kl, vl)
        want, want_lse = reference_attention(q, kl, vl, 1 / math.sqrt(self.D))
        np.testing.assert_allclose(result.output, want, rtol=0, atol=2e-5)
        np.testing.assert_allclose(result.lse, want_lse, rtol=0, atol=2e-5)

    def test_chunked_prefill_then_decode_steps_match_full_attention(self):
        s, layers = self.new_session()
        stream = self.client.decode_stream
        for step in range(3):
            for layer in range(self.L):
                q, k, v = self.step_inputs(100 * step + layer)
                r = s.attend(layer, q, k, v, return_lse=True)
                self.check_full_attention(r, layers, layer, q, k, v)
                self.assertEqual(r.position, self.T + step)
        self.assertIs(self.client.decode_stream, stream)  # every step went over one stream
        info = s.info()
        self.assertEqual(info.tokens, self.T + 3)
        self.assertEqual(info.decode_steps, 3 * self.L)

    def test_the_default_chunks_fit_the_smallest_message_limit(self):
        # --max_message_mb=1: 2 MiB chunks, and chunks of exactly 1 MiB of tensors with their
        # framing, were refused (probe 25, 4): 1000 tokens of k and v, 8 KiB each.
        with Kvrecalld("--max_message_mb=1") as server, \
                kvrecall.Client(server.address, wait_ready_s=30) as c:
            s = c.create_session(make_geometry(1, 8, 8, 128), make_policy("full"))
            k = np.ones((1000, 8, 128), np.float32)
            s.prefill([(None, k, k)])
            self.assertEqual(s.info().prompt_tokens, 1000)
        # A client's own smaller limit shrinks its default chunks too (they were refused as
        # "Sent message larger than max (1044532 vs. 262144)": probe 28, 10).
        with Kvrecalld() as server, kvrecall.Client(server.address, wait_ready_s=30,
                                                    max_message_bytes=256 << 10) as c:
            s = c.create_session(make_geometry(1, 8, 8, 128), make_policy("full"))
            k = np.ones((1000, 8, 128), np.float32)
            s.prefill([(None, k, k)])
            self.assertEqual(s.info().prompt_tokens, 1000)

    def test_prefill_sends_only_the_queries_the_session_needs(self):
        # CreateSession's prompt_queries: none for exact_topk, ReTopK's last C = 32, every one
        # for the graph index; the chunks carry q from the first needed one on, and the server
        # commits each prompt (it refuses one that lacks needed queries).
        g = make_geometry(self.L, self.HQ, self.HKV, self.D, "f32")
        for policy, needed in (("exact_topk", 0), ("retopk", 32), ("index", -1)):
            with self.subTest(policy=policy):
                s = self.client.create_session(g, make_policy(policy))
                self.addCleanup(s.close)
                self.assertEqual(s.prompt_queries, needed)
                layers = self.prompt(5)
                if needed == 0:
                    layers = [(None, k, v) for _, k, v in layers]
                # 300 tokens in chunks of at most 64, q with the last `needed` alone.
                chunks = list(s._chunks(enumerate(layers), [64, 64]))
                with_q = self.T if needed < 0 else needed
                layer0 = [(c.offset, c.k.shape[0], c.HasField("q"))
                          for c in chunks if c.layer == 0]
                self.assertEqual(sum(n for _, n, q in layer0 if q), with_q)
                self.assertTrue(all(q == (off >= self.T - with_q) for off, _, q in layer0))
                self.assertEqual(len(chunks), self.L * len(layer0))
                r = s.prefill(layers, chunk_tokens=64)
                self.assertEqual((r.layers_committed, r.tokens), (self.L, self.T))
        s = self.client.create_session(g, make_policy("retopk"))
        self.addCleanup(s.close)
        with self.assertRaisesRegex(ValueError, "q may be None only for a session that needs"):
            s.prefill([(None, k, v) for _, k, v in self.prompt(5)])

    def test_a_create_session_resent_with_its_request_id_gets_the_same_session(self):
        g = make_geometry(self.L, self.HQ, self.HKV, self.D)
        first = self.client.create_session(g, make_policy("full"), request_id="py-retry-1")
        self.addCleanup(first.close)
        again = self.client.create_session(g, make_policy("full"), request_id="py-retry-1")
        self.assertEqual(again.id, first.id)
        with self.assertRaises(kvrecall.KvRecallError) as refused:
            self.client.create_session(g, make_policy("full"), label="other",
                                       request_id="py-retry-1")
        self.assertEqual(refused.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        self.assertIn(f"made session {first.id}", refused.exception.message)

    def test_streaming_k_of_the_sinks_alone_keeps_no_recent_window(self):
        # review 24, 3: streaming:128 was refused, said to ask for the server's default window,
        # but make_policy sends recent 0 as set and the server serves it.
        self.assertEqual(streaming_window(128), (128, 0))
        sinks, recent = streaming_window(128)
        g = make_geometry(self.L, self.HQ, self.HKV, self.D)
        s = self.client.create_session(g, make_policy("streaming", sinks=sinks, recent=recent))
        self.addCleanup(s.close)
        self.assertEqual((s.policy.sinks, s.policy.recent), (128, 0))
        self.assertTrue(s.policy.HasField("recent"))

    def test_a_tiered_reply_says_where_its_time_went(self):
        # bf16 at d = 64: on a machine with a GPU the tiered placement keeps its static set in the
        # model's 16-bit dtype (it refuses f32) and serves d = 64 and 128 (without one, the CPU
        # stand-in takes any).
        g = make_geometry(self.L, self.HQ, self.HKV, 64, dtype="bf16")
        tiered = self.client.create_session(
            g, make_policy("full", placement="tiered", sinks=4, recent=8), label="tiered")
        self.addCleanup(tiered.close)
        tiered.prefill(self.prompt(3, d=64))
        tiered.attend(0, *self.step_inputs(7, d=64))
        micros = self.client.decode_stream.last_tier_micros
        self.assertIsNotNone(micros)
        self.assertGreater(micros.static_set, 0)
        self.assertGreater(micros.bulk, 0)
        self.assertLessEqual(micros.bulk + micros.link_wait,
                             self.client.decode_stream.last_server_micros)
        cpu, _ = self.new_session(seed=4)
        cpu.attend(0, *self.step_inputs(7))
        self.assertIsNone(self.client.decode_stream.last_tier_micros)

    def test_batch_of_two_sessions_in_one_request(self):
        (a, la), (b, lb) = self.new_session(seed=1), self.new_session(seed=2)
        qa, ka, va = self.step_inputs(7)
        qb, kb, vb = self.step_inputs(8)
        ra, rb = self.client.attend_batch(1, [(a, qa, ka, va), (b, qb, kb, vb)])
        scale = 1 / math.sqrt(self.D)
        for r, s, (q, k, v), layers in ((ra, a, (qa, ka, va), la), (rb, b, (qb, kb, vb), lb)):
            self.assertEqual(r.session_id, s.id)
            want, _ = reference_attention(q, np.concatenate([layers[1][1], k[None]]),
                                          np.concatenate([layers[1][2], v[None]]), scale)
            np.testing.assert_allclose(r.output, want, rtol=0, atol=2e-5)

    def test_bf16_session_returns_bf16_outputs(self):
        s, layers = self.new_session(dtype="bf16", chunk_tokens=1000)
        q, k, v = self.step_inputs(3)
        r = s.attend(0, q, k, v)
        as_bf16 = lambda a: tensors.bf16_bits_to_f32(tensors.f32_to_bf16_bits(a)).reshape(a.shape)
        want, _ = reference_attention(as_bf16(q), np.concatenate([as_bf16(layers[0][1]), as_bf16(k)[None]]),
                                      np.concatenate([as_bf16(layers[0][2]), as_bf16(v)[None]]),
                                      1 / math.sqrt(self.D))
        np.testing.assert_allclose(r.output, want, rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(r.output, as_bf16(r.output))  # travelled as bf16

    def test_a_reply_past_the_clients_own_limit_is_refused_before_the_step_applies(self):
        # probe 28, 3: gRPC refused such a reply on the client, after the server had applied the
        # step, so a resend without a position appended the token twice. The client now tells
        # the server its limit (DecodeRequest.max_reply_bytes).
        with kvrecall.Client(self.address, wait_ready_s=30, max_message_bytes=3 << 10) as c:
            g = make_geometry(1, 64, 1, 16, "bf16")
            s = c.create_session(g, make_policy("full"))
            rng = np.random.default_rng(90)
            k = rng.standard_normal((8, 1, 16), dtype=np.float32)
            s.prefill([(None, k, k)])
            q = rng.standard_normal((64, 16), dtype=np.float32)
            kv = rng.standard_normal((1, 16), dtype=np.float32)
            with self.assertRaises(kvrecall.KvRecallError) as e:
                s.attend(0, q, kv, kv, return_lse=True, diagnostics=True, compare_exact=True)
            self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("over the client's max_reply_bytes of 3072 bytes; nothing of it was "
                          "applied", e.exception.message)
            self.assertEqual(s.info().tokens, 8)
            self.assertEqual(s.attend(0, q, kv, kv).position, 8)  # a smaller reply fits
            s.close()

    def test_prefill_takes_nested_lists_as_decode_does(self):
        # probe 28, 11: decode took lists, prefill raised AttributeError on them.
        g = make_geometry(1, self.HQ, self.HKV, self.D)
        layer = self.prompt(93)[0]
        as_lists = self.client.create_session(g, make_policy("full"))
        self.addCleanup(as_lists.close)
        as_arrays = self.client.create_session(g, make_policy("full"))
        self.addCleanup(as_arrays.close)
        as_lists.prefill([tuple(x[:8].tolist() for x in layer)])
        as_arrays.prefill([tuple(x[:8] for x in layer)])
        q, k, v = self.step_inputs(94)
        np.testing.assert_array_equal(as_lists.attend(0, q, k, v).output,
                                      as_arrays.attend(0, q, k, v).output)
        with self.assertRaises(ValueError):
            as_lists.prefill([([[1.0]], [[1.0, 2.0], [3.0]], [[1.0]])])  # ragged

    def test_outputs_are_read_only_in_every_dtype_and_f16_names_its_overflow(self):
        # probe 28, 9 and 11: only f32's outputs were read-only; an f16 session's finite 70000
        # was refused by the server as "a non-finite value (inf)", the client's conversion.
        q, k, v = self.step_inputs(91)
        for dtype in ("f32", "f16", "bf16"):
            with self.subTest(dtype=dtype):
                s, _ = self.new_session(dtype=dtype, seed=92)
                r = s.attend(0, q, k, v, return_lse=True)
                self.assertFalse(r.output.flags.writeable)
                self.assertFalse(r.lse.flags.writeable)
                if dtype == "f16":
                    big = q.copy()
                    big[2, 5] = 70000.0
                    with self.assertRaisesRegex(ValueError, r"70000.0 is past f16's range"):
                        s.attend(0, big, k, v)
                    self.assertEqual(s.info().tokens, self.T + 1)
                    # A prompt's too, before its stream starts (it was UNKNOWN "Exception
                    # iterating requests!"), numpy and lists alike; 65504 itself fits.
                    fresh = self.client.create_session(
                        make_geometry(1, self.HQ, self.HKV, self.D, "f16"), make_policy("full"))
                    self.addCleanup(fresh.close)
                    layer = [x[:4].copy() for x in self.prompt(93)[0]]
                    layer[2][3, 1, 7] = -1e6
                    with self.assertRaisesRegex(ValueError,
                                                r"^layer 0: v: value -1000000.0 is past f16's"):
                        fresh.prefill([layer])
                    with self.assertRaisesRegex(ValueError, r"^layer 0: v: value -1000000.0"):
                        fresh.prefill([[x.tolist() for x in layer]])
                    self.assertEqual(fresh.info().tokens, 0)
                    layer[2][3, 1, 7] = 65504.0
                    # Only what is sent is checked: a full-attention session needs no prompt
                    # queries, so its q goes nowhere (review 27, 3).
                    self.assertEqual(fresh.prompt_queries, 0)
                    layer[0][0, 0, 0] = 1e5
                    self.assertEqual(fresh.prefill([layer]).tokens, 4)

    def test_threads_sharing_a_client_see_only_their_own_failures(self):
        # probe 28, 4: one thread's failed step ended the shared stream under the steps other
        # threads were waiting to send (FAILED_PRECONDITION "decode stream is closed", never
        # sent), and threads racing to reopen it each opened one that nobody closed.
        sessions = [self.new_session(seed=80 + i)[0] for i in range(3)]
        q, k, v = self.step_inputs(83)
        bad_q = q.copy()
        bad_q[0, 0] = np.nan
        errors, refused = [], []

        def run(session, bad):
            for _ in range(40):
                try:
                    session.attend(0, bad_q if bad else q, k, v)
                    if bad:
                        errors.append("a NaN step was served")
                except kvrecall.KvRecallError as e:
                    (refused if bad and e.code == grpc.StatusCode.INVALID_ARGUMENT
                     else errors).append(e)

        self.new_session(seed=84)[0].attend(0, q, k, v)  # the stream open, and gRPC's threads
        threads_before = threading.active_count()
        workers = [threading.Thread(target=run, args=(s, i == 0)) for i, s in enumerate(sessions)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(len(refused), 40)
        for s in sessions[1:]:
            self.assertEqual(s.info().tokens, self.T + 40)
        self.assertEqual(sessions[0].info().tokens, self.T)
        # One stream open (its request thread), not one per racing reopen.
        deadline = time.monotonic() + 5
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertLessEqual(threading.active_count(), threads_before)

    def test_errors_carry_status_code_and_message_and_the_stream_recovers(self):
        s, _ = self.new_session()
        q, k, v = self.step_inputs(4)
        with self.assertRaises(ValueError) as e:  # a wrong shape never leaves the client
            s.attend(0, q[:, :8], k, v)
        self.assertIn("does not fit shape [4, 16]", str(e.exception))
        with self.assertRaises(ValueError) as e:  # nested lists too (an AttributeError before)
            s.attend(0, q[:, :8].tolist(), k.tolist(), v.tolist())
        self.assertIn("does not fit shape [4, 16]", str(e.exception))
        with self.assertRaises(ValueError):
            s.attend(0, [[1.0, 2.0], [3.0]], k, v)  # ragged
        # The right element count in another shape: a transposed q was read as [heads, d], a
        # silently wrong attention (probe 28, 2); so were k and v of [2, kv_heads * d / 2].
        for args in ((q.T.copy(), k, v), (q.T, k, v), (q.reshape(2, -1), k, v),
                     (q, k.reshape(-1, 8), v), (q, k, v.reshape(-1, 4))):
            with self.assertRaisesRegex(ValueError, r"does not fit shape \[\d+, 16\]"):
                s.attend(0, *args)
        bad = q.copy()
        bad[1, 3] = np.nan
        with self.assertRaises(kvrecall.KvRecallError) as e:
            s.attend(0, bad, k, v)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("steps[0].q", e.exception.message)
        r = s.attend(0, q, k, v)  # a new stream; the rejected step appended nothing
        self.assertEqual(r.position, self.T)
        as_lists = s.attend(0, q.tolist(), k.tolist(), v.tolist())  # lists are numbers too
        self.assertEqual(as_lists.position, self.T + 1)
        self.assertEqual(as_lists.output.shape, r.output.shape)

        gone = self.client.create_session(make_geometry(self.L, self.HQ, self.HKV, self.D))
        gone.close()
        with self.assertRaises(kvrecall.KvRecallError) as e:
            gone.attend(0, q, k, v)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn(gone.id, e.exception.message)

        with self.assertRaises(kvrecall.KvRecallError) as e:
            self.client.create_session(make_geometry(self.L, 4, 3, self.D))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("kv_heads", e.exception.message)

    def test_a_token_rejected_in_one_layer_is_resent_on_a_new_stream(self):
        # Layer 0 takes the token, layer 1 rejects it (NaN): the session's layers are a token
        # apart, GetSession's layer_tokens says so, and resending layer 1 continues the session.
        s, layers = self.new_session(seed=5)
        q, k, v = self.step_inputs(6)
        self.assertEqual(s.attend(0, q, k, v).position, self.T)
        first = self.client.decode_stream
        bad = q.copy()
        bad[0, 0] = np.nan
        with self.assertRaises(kvrecall.KvRecallError) as e:
            s.attend(1, bad, k, v)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertTrue(first.broken)
        self.assertEqual(list(s.info().layer_tokens), [self.T + 1, self.T])
        r = s.attend(1, q, k, v)
        self.assertIsNot(self.client.decode_stream, first)  # a new stream
        self.assertEqual(r.position, self.T)
        want, _ = reference_attention(q, np.concatenate([layers[1][1], k[None]]),
                                      np.concatenate([layers[1][2], v[None]]),
                                      1 / math.sqrt(self.D))
        np.testing.assert_allclose(r.output, want, rtol=1e-4, atol=1e-5)
        self.assertEqual(list(s.info().layer_tokens), [self.T + 1, self.T + 1])

    def test_a_step_that_says_its_position_is_not_appended_twice(self):
        s, layers = self.new_session(seed=8)
        other, _ = self.new_session(seed=9)
        q, k, v = self.step_inputs(10)
        r = s.attend(0, q, k, v, position=self.T, return_lse=True)
        self.check_full_attention(r, layers, 0, q, k, v)
        self.assertEqual(r.position, self.T)
        # Resent as it was (its reply lost, say): refused before anything of the batch applies.
        with self.assertRaises(kvrecall.KvRecallError) as e:
            self.client.attend_batch(0, [(other, q, k, v, self.T), (s, q, k, v, self.T)])
        self.assertEqual(e.exception.code, grpc.StatusCode.ABORTED)
        self.assertIn(f"steps[1].position {self.T}: session '{s.id}' layer 0 holds "
                      f"{self.T + 1} tokens", e.exception.message)
        self.assertEqual(list(s.info().layer_tokens), [self.T + 1, self.T])
        self.assertEqual(list(other.info().layer_tokens), [self.T, self.T])
        r = s.attend(1, q, k, v, position=self.T, return_lse=True)  # on a new stream
        self.check_full_attention(r, layers, 1, q, k, v)
        # Checked here, nothing sent: not an integer, negative, beyond int64, a malformed step.
        for position, message in ((1.5, "position must be an integer, got float 1.5"),
                                  (-1, "position must be in [0, 2^63), got -1"),
                                  (2 ** 63, f"position must be in [0, 2^63), got {2 ** 63}")):
            with self.assertRaisesRegex(ValueError, "^" + re.escape(message) + "$"):
                s.attend(0, q, k, v, position=position)
        with self.assertRaisesRegex(ValueError, r"a step is \(session, q, k_new, v_new\) or"):
            self.client.attend_batch(0, [(s, q, k)])
        self.assertEqual(list(s.info().layer_tokens), [self.T + 1, self.T + 1])

    def test_list_sessions_follows_the_pages(self):
        g = make_geometry(1, self.HQ, self.HKV, self.D)
        before = {info.session_id for info in self.client.list_sessions()}
        made = set()
        for i in range(230):
            session = self.client.create_session(g, label=f"page test {i}")
            self.addCleanup(session.close)
            made.add(session.id)
        listed = [info.session_id for info in self.client.list_sessions()]
        self.assertEqual(len(listed), len(set(listed)))
        self.assertEqual(set(listed), before | made)
        self.assertEqual(listed, sorted(listed))
        first = self.client.call("ListSessions", kvrecall.client.pb.ListSessionsRequest())
        self.assertEqual(len(first.sessions), 100)
        self.assertTrue(first.next_page_token)
        with self.assertRaises(kvrecall.KvRecallError) as e:
            self.client.call("ListSessions", kvrecall.client.pb.ListSessionsRequest(page_size=501))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("page_size", e.exception.message)
        with self.assertRaises(kvrecall.KvRecallError) as e:
            self.client.create_session(g, label="x" * 257)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("label must be at most 256 bytes", e.exception.message)

    def test_policy_names_are_checked_here(self):
        with self.assertRaises(ValueError) as e:
            make_policy("nearest")
        self.assertIn("nearest", str(e.exception))

    def test_max_tokens_sets_the_kv_aside_at_creation(self):
        # 2 layers x 1000 tokens x (k + v) x 1 KV head x d = 8 x f32: 128000 bytes set aside
        # before any prompt, and nothing without max_tokens; a max_tokens past what a layer can
        # hold is the server's INVALID_ARGUMENT.
        g = make_geometry(2, 2, 1, 8)
        plain = self.client.create_session(g, make_policy("full"))
        self.addCleanup(plain.close)
        announced = self.client.create_session(g, make_policy("full"), max_tokens=1000)
        self.addCleanup(announced.close)
        self.assertEqual(plain.info().host_budget_bytes, 0)
        self.assertGreaterEqual(announced.info().host_budget_bytes, 2 * 1000 * 2 * 8 * 4)
        with self.assertRaises(kvrecall.KvRecallError) as e:
            self.client.create_session(g, make_policy("full"), max_tokens=1 << 40)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("max_tokens", e.exception.message)

    def test_a_zero_window_is_sent_and_none_takes_the_default(self):
        # sinks, recent and retopk's recent_window are proto3 optional: None leaves them unset
        # (the server's defaults), 0 is served as sent.
        g = make_geometry(1, 2, 1, 8)
        unset = self.client.create_session(g, make_policy("streaming"))
        self.addCleanup(unset.close)
        self.assertEqual((unset.policy.sinks, unset.policy.recent), (128, 512))
        zero = self.client.create_session(
            g, make_policy("retopk", sinks=0, recent=16, retopk={"recent_window": 0}))
        self.addCleanup(zero.close)
        self.assertEqual((zero.policy.sinks, zero.policy.recent), (0, 16))
        self.assertEqual(zero.policy.retopk.recent_window, 0)
        with self.assertRaises(kvrecall.KvRecallError) as e:
            self.client.create_session(g, make_policy("streaming", sinks=0, recent=0))
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("policy.sinks + policy.recent must be >= 1", e.exception.message)


class ArgumentCheckTest(ServerTest):
    """What the client checks itself: bad arguments raise ValueError naming them before anything
    is sent; a closed client raises KvRecallError; a failed step leaves no thread behind."""
    HQ, HKV, D, T = 2, 1, 8, 4

    def small_session(self, client=None, layers=1, prefill=True):
        s = (client or self.client).create_session(
            make_geometry(layers, self.HQ, self.HKV, self.D), make_policy("full"),
            label="python argument checks")
        # Closed through the class's client: the session's own may be closed by then.
        self.addCleanup(self.client.call, "CloseSession",
                        kvrecall.client.pb.CloseSessionRequest(session_id=s.id))
        prompt = self.prompt(layers)
        if prefill:
            s.prefill(prompt)
        return s, prompt

    def prompt(self, layers, seed=0):
        rng = np.random.default_rng(seed)
        return [tuple(rng.standard_normal((self.T, h, self.D), dtype=np.float32)
                      for h in (self.HQ, self.HKV, self.HKV)) for _ in range(layers)]

    def step(self, seed=1):
        rng = np.random.default_rng(seed)
        return tuple(rng.standard_normal((h, self.D), dtype=np.float32)
                     for h in (self.HQ, self.HKV, self.HKV))

    def test_a_server_address_whose_port_grpc_would_wrap_is_refused(self):
        # gRPC takes a port modulo 2^16 (:113657 reached the server on 48121) and a missing one
        # as 443 (probe 21, 8): the client refuses both before making a channel.
        for target in ("127.0.0.1:113657", "127.0.0.1:0", "localhost", "::1", "[::1]:70000"):
            with self.subTest(target=target), self.assertRaisesRegex(
                    ValueError, re.escape(f"server address {target!r} must be HOST:PORT")):
                kvrecall.Client(target, wait_ready_s=0)
        for target in ("[::1]:1", "unix:/nonexistent.sock", "dns:///localhost:1"):
            kvrecall.Client(target, wait_ready_s=0).close()

    def test_a_layer_outside_int32_is_refused_before_it_is_sent(self):
        # DecodeRequest.layer is an int32: a hand-encoded 2^32 + 1 reached the server as layer 1
        # (its low 32 bits), and 2^31 as -2^31.
        s, _ = self.small_session(layers=2)
        for layer, message in ((2 ** 32 + 1, "layer must be in [0, 2^31), got 4294967297"),
                               (2 ** 31, "layer must be in [0, 2^31), got 2147483648"),
                               (-1, "layer must be in [0, 2^31), got -1"),
                               (1.0, "layer must be an integer, got float 1.0")):
            with self.subTest(layer=layer):
                with self.assertRaises(ValueError) as e:
                    s.attend(layer, *self.step())
                self.assertEqual(str(e.exception), message)
                with self.assertRaises(ValueError) as e:
                    self.client.decode_stream.step(layer, [(s, *self.step())])
                self.assertEqual(str(e.exception), message)
        self.assertEqual(list(s.info().layer_tokens), [self.T, self.T])  # nothing appended
        self.assertEqual(s.attend(np.int64(1), *self.step()).position, self.T)

    def test_prefill_checks_shapes_layers_and_chunk_tokens_before_sending(self):
        # A wrong head count or head_dim (or chunk_tokens <= 0) was found inside the request
        # iterator, where gRPC turns it into UNKNOWN "Exception iterating requests!".
        s, _ = self.small_session(prefill=False)
        q, k, v = self.prompt(1)[0]
        wide_k = np.concatenate([k, k], axis=1)
        cases = [([(q, wide_k, v)], {}, "layer 0: k has shape [4, 2, 8], want [4, 1, 8] "
                                        "([tokens, kv_heads, head_dim])"),
                 ([(q[:, :, :4], k, v)], {}, "layer 0: q has shape [4, 2, 4], want [4, 2, 8] "
                                             "([tokens, q_heads, head_dim])"),
                 ([(q, k, v[:, :, :, None])], {}, "layer 0: v has shape [4, 1, 8, 1], want "
                                                  "[4, 1, 8] ([tokens, kv_heads, head_dim])"),
                 ({1: (q, k, v)}, {}, "layers: layer 1 is not in [0, 1) (the geometry's layers)"),
                 ([(q, k, v)], {"chunk_tokens": -1},
                  "chunk_tokens must be None or an integer >= 1, got -1"),
                 ([(q, k, v)], {"chunk_tokens": 0},
                  "chunk_tokens must be None or an integer >= 1, got 0"),
                 ([(q, k, v)], {"chunk_tokens": 2.5},
                  "chunk_tokens must be None or an integer >= 1, got 2.5")]
        for layers, kwargs, message in cases:
            with self.subTest(message):
                with self.assertRaises(ValueError) as e:
                    s.prefill(layers, **kwargs)
                self.assertEqual(str(e.exception), message)
        self.assertEqual(s.info().tokens, 0)  # nothing reached the session
        r = s.prefill([(q, k, v)], chunk_tokens=1)
        self.assertEqual((r.layers_committed, r.tokens), (1, self.T))

    def test_failed_steps_leave_no_thread_behind(self):
        # gRPC drains a Decode call's requests on a thread blocked in the stream's queue; a step
        # the server refuses ends the call, and before the fix that thread waited forever.
        with kvrecall.Client(self.address, wait_ready_s=30) as c:
            s, _ = self.small_session(client=c)
            q, k, v = self.step()
            bad = q.copy()
            bad[0, 0] = np.nan
            before = set(threading.enumerate())
            streams = []
            for i in range(10):
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    if i % 2:
                        s.attend(0, bad, k, v)
                    else:
                        s.attend(5, q, k, v)  # a layer the session does not have
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                streams.append(c._stream)
                self.assertTrue(c._stream.broken)
            self.assertEqual(len(set(map(id, streams))), 10)  # each failure ended its stream
            self.assertEqual(s.attend(0, q, k, v).position, self.T)  # a new stream serves
            c.decode_stream.close()
            # With no call left, every thread started since `before` ends (each call's request
            # consumer, and gRPC's channel thread that lives while calls do); the client, still
            # open, is not what ends them.
            new = lambda: [t.name for t in threading.enumerate() if t not in before]
            deadline = time.monotonic() + 10
            while new() and time.monotonic() < deadline:
                time.sleep(0.02)
            self.assertEqual(new(), [])

    def test_a_closed_client_raises_kvrecall_error(self):
        # The module's docstring promises KvRecallError for every failed call; gRPC's own
        # answer for a closed channel is ValueError.
        c = kvrecall.Client(self.address, wait_ready_s=30)
        s, prompt = self.small_session(client=c)
        s.attend(0, *self.step())
        c.close()
        for name, call in (("attend", lambda: s.attend(0, *self.step())),
                           ("info", s.info), ("close", s.close),
                           ("prefill", lambda: s.prefill(prompt)),
                           ("list_sessions", c.list_sessions),
                           ("create_session", lambda: c.create_session(s.geometry))):
            with self.subTest(name):
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    call()
                self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
                self.assertEqual(e.exception.message,
                                 "the client is closed (Client.close() was called)")
        c.close()  # a second close does nothing
        # The session itself is still there: nothing reached the server after the close.
        self.assertEqual(self.client.call("GetSession", kvrecall.client.pb.GetSessionRequest(
            session_id=s.id)).tokens, self.T + 1)


@unittest.skipUnless(sys.platform.startswith("linux") and platform.machine() == "x86_64",
                     "kvrecall.shared runs on Linux x86-64 only")
class SharedMemoryTest(ClientTest):
    """ClientTest's tests again with Client(shared_memory=True): every decode step through a
    DecodeShared region of a kvrecalld started with --shared_memory_dir; then what is the shared
    stream's own: agreement with the Decode call bit for bit, failed steps, the region's end."""

    @classmethod
    def setUpClass(cls):
        cls.region_dir = tempfile.TemporaryDirectory(prefix="kvrecall-shm-")
        cls.kvrecalld = Kvrecalld(f"--shared_memory_dir={cls.region_dir.name}")
        cls.address = cls.kvrecalld.address
        try:
            cls.client = kvrecall.Client(cls.address, wait_ready_s=30, shared_memory=True)
            cls.grpc_client = kvrecall.Client(cls.address, wait_ready_s=30)
        except Exception:
            sys.stderr.write(cls.kvrecalld.log())
            cls.kvrecalld.stop()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.grpc_client.close()
        cls.kvrecalld.stop()
        cls.region_dir.cleanup()

    def regions(self):
        return sorted(os.listdir(self.region_dir.name))

    def wait_for_regions(self, want):
        """The region files once they are `want` (the server removes a region's file when its
        stream ends, which may follow the call's status by a moment)."""
        deadline = time.monotonic() + 10
        while self.regions() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.regions()

    def test_decode_steps_go_through_the_region(self):
        from kvrecall.shared import SharedDecodeStream
        s, _ = self.new_session(seed=11)
        s.attend(0, *self.step_inputs(12))
        stream = self.client.decode_stream
        self.assertIsInstance(stream, SharedDecodeStream)
        self.assertEqual(os.path.dirname(stream.region.path), self.region_dir.name)
        # Mapped by both and stepped, the region has no file left for another process to open
        # (probe 26, 4).
        self.assertNotIn(os.path.basename(stream.region.path), self.regions())

    def test_steps_match_the_decode_call_bit_for_bit(self):
        # The same prompts in two pairs of sessions; one of each pair stepped over the Decode
        # call, the other over the region, two sessions per request, with lse.
        for dtype in ("f32", "bf16"):
            pairs = []
            for seed in (21, 22):
                g = make_geometry(self.L, self.HQ, self.HKV, self.D, dtype)
                twins = [c.create_session(g, make_policy("full"), label="shm twin")
                         for c in (self.grpc_client, self.client)]
                layers = self.prompt(seed)
                for twin in twins:
                    self.addCleanup(twin.close)
                    twin.prefill(layers, chunk_tokens=1000)
                pairs.append((twins, layers))
            for step in range(3):
                for layer in range(self.L):
                    inputs = [self.step_inputs(1000 * seed + 10 * step + layer)
                              for seed in (21, 22)]
                    over_grpc = self.grpc_client.attend_batch(
                        layer, [(twins[0], *x) for (twins, _), x in zip(pairs, inputs)],
                        return_lse=True)
                    over_shm = self.client.attend_batch(
                        layer, [(twins[1], *x) for (twins, _), x in zip(pairs, inputs)],
                        return_lse=True)
                    for a, b, (twins, layers), (q, k, v) in zip(over_grpc, over_shm, pairs,
                                                                inputs):
                        self.assertEqual((a.session_id, b.session_id), (twins[0].id, twins[1].id))
                        np.testing.assert_array_equal(b.output, a.output)
                        np.testing.assert_array_equal(b.lse, a.lse)
                        self.assertEqual(b.position, a.position)
                        self.assertEqual(b.position, self.T + step)
                        if dtype == "f32":
                            self.check_full_attention(b, layers, layer, q, k, v)
            self.assertGreater(self.client.decode_stream.last_server_micros, 0)

    def failing_step(self, client, steps, layer=0):
        """The KvRecallError of a step that must fail."""
        with self.assertRaises(kvrecall.KvRecallError) as e:
            client.attend_batch(layer, steps)
        return e.exception

    def test_a_failed_step_raises_the_servers_status_and_appends_nothing(self):
        good, _ = self.new_session(seed=31)
        q, k, v = self.step_inputs(32)
        self.assertEqual(good.attend(0, q, k, v).position, self.T)
        gone = self.grpc_client.create_session(make_geometry(self.L, self.HQ, self.HKV, self.D))
        gone.close()
        # The session's id with a geometry it does not have: q [HQ, 2 D] reaches the server.
        wide = Session(None, good.id, make_geometry(self.L, self.HQ, self.HKV, 2 * self.D), None)
        wide_inputs = (np.tile(q, 2), np.tile(k, 2), np.tile(v, 2))
        for name, steps in [("a closed session", [(good, q, k, v), (gone, q, k, v)]),
                            ("a wrong shape", [(wide, *wide_inputs)])]:
            with self.subTest(name):
                stream = self.client.decode_stream
                path = stream.region.path
                before = list(good.info().layer_tokens)
                over_shm = self.failing_step(self.client, steps)
                over_grpc = self.failing_step(self.grpc_client, steps)
                self.assertNotEqual(over_shm.code, grpc.StatusCode.OK)
                self.assertEqual((over_shm.code, over_shm.message),
                                 (over_grpc.code, over_grpc.message))
                if name == "a closed session":
                    self.assertEqual(over_shm.code, grpc.StatusCode.NOT_FOUND)
                    self.assertIn(gone.id, over_shm.message)
                else:
                    self.assertEqual(over_shm.code, grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertIn("steps[0]", over_shm.message)
                self.assertTrue(stream.broken)
                # The call ends with the status the region carried; the region goes with it.
                self.assertEqual((stream._call.code(), stream._call.details()),
                                 (over_shm.code, over_shm.message))
                self.assertNotIn(os.path.basename(path), self.wait_for_regions(
                    [r for r in self.regions() if r != os.path.basename(path)]))
                self.assertEqual(list(good.info().layer_tokens), before)
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    stream.step(0, [(good, q, k, v)])
                self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        # The next step opens a new region and goes on where the session was.
        r = good.attend(1, q, k, v)
        self.assertIsNot(self.client.decode_stream, stream)
        self.assertFalse(self.client.decode_stream.broken)
        self.assertEqual(r.position, self.T)
        self.assertEqual(list(good.info().layer_tokens), [self.T + 1, self.T + 1])

    def test_the_cli_flag_and_the_charts_environment_choose_shared_memory(self):
        import argparse
        from kvrecall.client import add_connection_arguments, connection_from_args
        saved = os.environ.pop("KVRECALL_SHARED_MEMORY", None)

        def restore():
            os.environ.pop("KVRECALL_SHARED_MEMORY", None)
            if saved is not None:
                os.environ["KVRECALL_SHARED_MEMORY"] = saved
        self.addCleanup(restore)

        def parse(*argv):
            ap = argparse.ArgumentParser()
            add_connection_arguments(ap)
            return connection_from_args(ap.parse_args(list(argv)))["shared_memory"]

        self.assertFalse(parse())
        self.assertTrue(parse("--shared-memory"))
        os.environ["KVRECALL_SHARED_MEMORY"] = "1"  # what colocatedRunner.sharedMemory sets
        self.assertTrue(parse())
        self.assertFalse(parse("--no-shared-memory"))
        # A client made from the flags steps through a region of its own.
        before = self.regions()
        ap = argparse.ArgumentParser()
        add_connection_arguments(ap)
        with kvrecall.Client(self.address, wait_ready_s=30,
                             **connection_from_args(ap.parse_args([]))) as client:
            g = make_geometry(self.L, self.HQ, self.HKV, self.D)
            s = client.create_session(g, make_policy("full"), label="python cli flags")
            layers = self.prompt(31)
            s.prefill(layers)
            q, k, v = self.step_inputs(5)
            r = s.attend(0, q, k, v, return_lse=True)
            self.check_full_attention(r, layers, 0, q, k, v)
            from kvrecall.shared import SharedDecodeStream
            self.assertIsInstance(client.decode_stream, SharedDecodeStream)
            s.close()
        self.wait_for_regions(before)

    def test_close_ends_the_stream_and_removes_its_region(self):
        from kvrecall.shared import SharedDecodeStream
        s, _ = self.new_session(seed=41)
        before = self.regions()
        stream = SharedDecodeStream(self.client.channel)
        name = os.path.basename(stream.region.path)
        self.assertEqual(self.regions(), sorted(before + [name]))
        self.assertEqual(stream.step(0, [(s, *self.step_inputs(42))])[0].position, self.T)
        self.assertEqual(stream.step(0, []), [])  # an empty request is answered too
        stream.close()
        self.assertTrue(stream.broken)
        self.assertEqual(stream._call.code(), grpc.StatusCode.OK)
        self.assertEqual(self.wait_for_regions(before), before)
        with self.assertRaises(kvrecall.KvRecallError) as e:
            stream.step(0, [])
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        stream.close()  # a second close does nothing
        self.assertEqual(s.info().tokens, self.T + 1)

    def test_capacities_are_granted_and_a_request_beyond_them_is_not_sent(self):
        from kvrecall.shared import SharedDecodeStream
        s, _ = self.new_session(seed=51)
        step_bytes = (self.HQ + 2 * self.HKV) * self.D * 4  # the step's f32 tensor data
        stream = SharedDecodeStream(self.client.channel, max_request_bytes=step_bytes,
                                    max_reply_bytes=4096)
        self.addCleanup(stream.close)
        self.assertEqual((stream.region.max_request_bytes, stream.region.max_reply_bytes),
                         (step_bytes, 4096))
        with self.assertRaises(kvrecall.KvRecallError) as e:
            stream.step(0, [(s, *self.step_inputs(52))])  # the data and its framing
        self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn(f"request capacity of {step_bytes} bytes", e.exception.message)
        self.assertFalse(stream.broken)
        self.assertEqual(s.info().tokens, self.T)
        self.assertEqual(stream.step(0, []), [])
        with self.assertRaises(kvrecall.KvRecallError) as e:
            SharedDecodeStream(self.client.channel, max_request_bytes=1 << 40)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("max_request_bytes", e.exception.message)

    def test_a_failure_longer_than_the_reply_area_is_told_whole(self):
        # probe 28, 7: the message was cut to the reply area, losing "nothing of it was applied"
        from kvrecall.shared import SharedDecodeStream
        s, _ = self.new_session(seed=53)
        stream = SharedDecodeStream(self.client.channel, max_reply_bytes=64)
        self.addCleanup(stream.close)
        with self.assertRaises(kvrecall.KvRecallError) as e:
            stream.step(0, [(s, *self.step_inputs(54))])  # its reply could take more than 64
        self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("over the reply area of 64 bytes; nothing of it was applied",
                      e.exception.message)
        self.assertEqual(s.info().tokens, self.T)

    def test_a_runner_whose_step_failed_reopens_in_the_one_slot_at_once(self):
        # --max_shared_streams=1: a failed step ends its stream, and the client's next step opens
        # another at once, which finds the slot free (probe 8: the slot was given back only
        # after the failure reached the runner, and 6-14 of 100 next steps were refused).
        with tempfile.TemporaryDirectory(prefix="kvrecall-shm-") as d, \
                Kvrecalld(f"--shared_memory_dir={d}", "--max_shared_streams=1") as server, \
                kvrecall.Client(server.address, wait_ready_s=30, shared_memory=True) as c:
            s = c.create_session(make_geometry(1, self.HQ, self.HKV, self.D))
            s.prefill([tuple(x[:8] for x in self.prompt(73)[0])])
            for i in range(60):
                q, k, v = self.step_inputs(200 + i)
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    s.attend(0, q, k, v, position=8 + i + 5)  # not the layer's length
                self.assertEqual(e.exception.code, grpc.StatusCode.ABORTED, e.exception.message)
                self.assertEqual(s.attend(0, q, k, v, position=8 + i).position, 8 + i,
                                 f"cycle {i}")

    def test_a_drained_or_killed_server_ends_the_stream_with_the_calls_status(self):
        with tempfile.TemporaryDirectory(prefix="kvrecall-shm-") as d:
            for ending in ("drain", "kill"):
                with self.subTest(ending), Kvrecalld(f"--shared_memory_dir={d}") as server, \
                        kvrecall.Client(server.address, wait_ready_s=30, shared_memory=True) as c:
                    s = c.create_session(make_geometry(1, self.HQ, self.HKV, self.D))
                    s.prefill([tuple(x[:8] for x in self.prompt(71)[0])])
                    q, k, v = self.step_inputs(72)
                    self.assertEqual(s.attend(0, q, k, v).position, 8)
                    stream = c.decode_stream
                    if ending == "drain":  # SIGTERM: idle streams end UNAVAILABLE, `ended` set
                        server.process.send_signal(signal.SIGTERM)
                        deadline = time.monotonic() + 10
                        while not stream.ended and time.monotonic() < deadline:
                            time.sleep(0.01)
                        self.assertTrue(stream.ended)
                        self.assertEqual(os.listdir(d), [])
                    else:  # no `ended`: the waiting runner notices the call's end
                        server.process.kill()
                    t = time.monotonic()
                    with self.assertRaises(kvrecall.KvRecallError) as e:
                        s.attend(0, q, k, v)
                    self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE,
                                     e.exception.message)
                    self.assertLess(time.monotonic() - t, 10)
                    self.assertTrue(stream.broken)
                    server.process.wait(30)

    def test_leaving_the_client_on_an_error_keeps_that_error_when_the_server_is_gone(self):
        # probe 28, 6: the decode stream's UNAVAILABLE from close() replaced the runner's own
        # exception as it left `with Client(...)`; leaving without one, it is still raised.
        for raising in (True, False):
            with self.subTest(raising=raising), Kvrecalld() as server:
                with self.assertRaises(RuntimeError if raising else kvrecall.KvRecallError) as e:
                    with kvrecall.Client(server.address, wait_ready_s=30) as c:
                        s = c.create_session(make_geometry(1, self.HQ, self.HKV, self.D))
                        s.prefill([tuple(x[:8] for x in self.prompt(73)[0])])
                        s.attend(0, *self.step_inputs(74))
                        server.process.send_signal(signal.SIGTERM)
                        server.process.wait(30)
                        if raising:
                            raise RuntimeError("the runner's own error")
                if raising:
                    self.assertEqual(str(e.exception), "the runner's own error")
                else:
                    self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_a_server_without_a_shared_memory_dir_refuses(self):
        from kvrecall.shared import SharedDecodeStream
        with Kvrecalld() as plain, kvrecall.Client(plain.address, wait_ready_s=30,
                                                   shared_memory=True) as c:
            with self.assertRaises(kvrecall.KvRecallError) as e:
                SharedDecodeStream(c.channel)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("--shared_memory_dir", e.exception.message)
            s = c.create_session(make_geometry(1, self.HQ, self.HKV, self.D))
            with self.assertRaises(kvrecall.KvRecallError) as e:
                s.attend(0, *self.step_inputs(61))
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)


@unittest.skipUnless(os.path.exists(os.path.join(MODELS_DIR, "tinylm-a.npz")),
                     f"no tinylm-a.npz in {MODELS_DIR}")
class TinyLMTest(ServerTest):
    MODEL = os.path.join(MODELS_DIR, "tinylm-a.npz")
    TEXT = os.path.join(MODELS_DIR)  # README.md, tinylm.py, tinylm_np.py: real text

    def test_read_text_reads_what_the_reference_tool_reads(self):
        sys.path.insert(0, MODELS_DIR)
        try:
            import tinylm_np
        finally:
            sys.path.pop(0)
        np.testing.assert_array_equal(tinylm.read_text([self.TEXT], 1 << 20),
                                      tinylm_np.read_text([self.TEXT], 1 << 20))

    def test_ppl_with_full_attention_through_the_service_matches_local(self):
        with tempfile.TemporaryDirectory() as cache:
            args = ["ppl", "--server", self.address, "--model", self.MODEL, "--text", self.TEXT,
                    "--offset", "1000", "--ctx", "384", "--suffix", "24", "--policy", "full",
                    "--cache-dir", cache, "--check-local", "--json"]
            t = time.perf_counter()
            first = tinylm.run_ppl(tinylm.parser().parse_args(args))
            again = tinylm.run_ppl(tinylm.parser().parse_args(args))  # prefill read back from the cache
        print(f"\n  service {first['bits_per_byte']:.6f} bits/byte, local "
              f"{first['local_bits_per_byte']:.6f} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
        self.assertLess(abs(first["bits_per_byte"] - first["local_bits_per_byte"]), 1e-3)
        self.assertFalse(first["prefill_cached"])
        self.assertTrue(again["prefill_cached"])
        self.assertAlmostEqual(again["bits_per_byte"], first["bits_per_byte"], places=5)
        self.assertEqual(first["path_mix"]["exact"], 1.0)
        self.assertEqual((first["ctx"], first["suffix"], first["policy"]), (384, 24, "full"))

    def test_ppl_in_bf16_on_the_tiered_placement_matches_local(self):
        # The dtype the GPU placements need (they refuse f32): the prompt and the steps travel in
        # bf16, the tiered static set runs on the CPU stand-in here; full attention over the
        # rounded KV stays within bf16's error of local f32 attention.
        with tempfile.TemporaryDirectory() as cache:
            args = ["ppl", "--server", self.address, "--model", self.MODEL, "--text", self.TEXT,
                    "--offset", "1000", "--ctx", "384", "--suffix", "24", "--policy", "full",
                    "--placement", "tiered", "--dtype", "bf16", "--sinks", "16", "--recent", "32",
                    "--cache-dir", cache, "--check-local", "--json"]
            r = tinylm.run_ppl(tinylm.parser().parse_args(args))
        self.assertEqual((r["placement"], r["dtype"]), ("tiered", "bf16"))
        self.assertLess(abs(r["bits_per_byte"] - r["local_bits_per_byte"]), 5e-3)
        self.assertNotEqual(r["bits_per_byte"], r["local_bits_per_byte"])  # bf16 did round

    def test_ppl_command_prints_one_json_object_and_reports_errors(self):
        with tempfile.TemporaryDirectory() as cache:
            base = [sys.executable, "-m", "kvrecall.tinylm", "ppl", "--server", self.address,
                    "--model", self.MODEL, "--text", self.TEXT, "--ctx", "128", "--suffix", "4",
                    "--cache-dir", cache, "--json"]
            out = subprocess.run(base + ["--policy", "exact_topk", "--k", "16"],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(out.returncode, 0, out.stderr)
            r = json.loads(out.stdout)
            self.assertEqual((r["policy"], r["placement"], r["k"], r["ctx"], r["suffix"]),
                             ("exact_topk", "cpu", 16, 128, 4))
            self.assertGreater(r["bits_per_byte"], 0)
            self.assertEqual(r["path_mix"]["exact"], 1.0)
            bad = subprocess.run(base + ["--policy", "retopk", "--auto-tau", "--target-recall", "1.5"],
                                 capture_output=True, text=True, timeout=300)
            self.assertEqual(bad.returncode, 1)
            self.assertIn("kvrecall.tinylm: INVALID_ARGUMENT: policy.retopk.target_recall", bad.stderr)


def write_safetensors(path, tensors_by_name, metadata=None):
    """A safetensors file of float32 arrays (and __metadata__ strings)."""
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, a in tensors_by_name.items():
        data = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


class ToolInputTest(ServerTest):
    """The command-line tools (kvrecall.needles, kvrecall.evaluate, kvrecall.tinylm) refuse bad
    input with a message naming the flag, spec or file, before any work: no traceback, no NaN
    in their JSON, and one bad run spec does not cost the others their work."""
    HQ, HKV, D, T, STEPS = 2, 1, 8, 16, 3

    def setUp(self):
        tmp = tempfile.TemporaryDirectory(prefix="kvrecall-tools-")
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def test_hf_demo_without_torch_says_what_to_install(self):
        # probe 28, 11: its JSON carried a traceback. torch hidden, installed or not.
        code = ("import sys; sys.modules['torch'] = None; from kvrecall import hf_demo; "
                "sys.exit(hf_demo.main(sys.argv[1:]))")
        text = os.path.join(self.tmp, "prompt.txt")
        with open(text, "w") as f:
            f.write("def f():\n    return 1\n")
        r = subprocess.run([sys.executable, "-c", code, "--server", self.address,
                            "--model", "absent.npz", "--text", text],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        report = json.loads(r.stdout)
        self.assertEqual(report["error"], "torch is not installed: the transformers backend "
                                          "needs torch and transformers (pip install "
                                          "'./client/python[hf]')")
        self.assertFalse(report["ok"])
        # Installed but too old (review 27, 4: "not installed" was said of it): stand-ins for
        # torch and a transformers without what the backend imports.
        fakes = ("import sys, types; t = types.ModuleType('torch'); t.__version__ = '2.0.0'; "
                 "t.float32, t.float16, t.bfloat16 = 'f32', 'f16', 'bf16'; "
                 "t.cuda = types.SimpleNamespace(is_available=lambda: False); "
                 "sys.modules['torch'] = t; x = types.ModuleType('transformers'); "
                 "x.__version__ = '4.30.0'; sys.modules['transformers'] = x; ")
        r = subprocess.run([sys.executable, "-c", fakes + code.split("; ", 2)[2],
                            "--server", self.address, "--model", "absent.npz", "--text", text],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        report = json.loads(r.stdout)
        self.assertRegex(report["error"], r"^transformers 4.30.0 lacks what the transformers "
                                          r"backend uses \(cannot import name ")

    def trace(self, name, needles_meta='[{"decode_step": 1, "position": 5}]', layers=1):
        rng = np.random.default_rng(3)
        arrays = {}
        for l in range(layers):
            for part, n in (("prefill", self.T), ("decode", self.STEPS)):
                for x, h in (("q", self.HQ), ("k", self.HKV), ("v", self.HKV)):
                    arrays[f"layer{l}.{part}.{x}"] = rng.standard_normal((n, h, self.D))
        meta = {"layers": str(layers)}
        if needles_meta is not None:
            meta["needles"] = needles_meta
        path = os.path.join(self.tmp, name)
        write_safetensors(path, arrays, meta)
        return path

    def raw_file(self, name, data):
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_needles_reads_only_well_formed_traces(self):
        def header(h, data=b""):
            raw = json.dumps(h).encode()
            return struct.pack("<Q", len(raw)) + raw + data
        entry = {"dtype": "F32", "shape": [2, 1, 2], "data_offsets": [0, 16]}
        depth = 100000
        cases = [
            ("empty.st", b"", "0 bytes, shorter than the 8-byte header length"),
            ("huge.st", struct.pack("<Q", 1 << 40) + b"{}",
             "header length 1099511627776 exceeds the 2 bytes after it"),
            ("badjson.st", struct.pack("<Q", 6) + b'{"a": ', "the header is not JSON: "),
            ("deep.st", struct.pack("<Q", 2 * depth) + b"[" * depth + b"]" * depth,
             "the header's JSON is nested too deeply"),
            ("list.st", header([1, 2]), "the header is not a JSON object"),
            ("dtype.st", header({"t": {**entry, "dtype": "I8"}}, bytes(16)),
             "tensor 't': dtype 'I8' is not one of ['BF16', 'F16', 'F32']"),
            ("shape.st", header({"t": {**entry, "shape": [2, -1]}}, bytes(16)),
             "tensor 't': shape [2, -1] is not a list of integers >= 0"),
            ("truncated.st", header({"t": entry}, bytes(7)),
             "tensor 't': data_offsets [0, 16] are not [begin, end] within the 7 data bytes"),
            ("disagree.st", header({"t": {**entry, "shape": [4, 1, 2]}}, bytes(16)),
             "tensor 't': shape [4, 1, 2] of F32 takes 32 bytes, data_offsets [0, 16] hold 16"),
        ]
        for name, data, message in cases:
            with self.subTest(name):
                path = self.raw_file(name, data)
                with self.assertRaises(ValueError) as e:
                    needles.read_safetensors(path)
                self.assertTrue(str(e.exception).startswith(f"{path}: {message}"),
                                str(e.exception))
        good = needles.read_safetensors(self.trace("good.st"))
        self.assertEqual(needles.needle_trace(good)["needles"], {1: 5})
        self.assertEqual(good[2]["layer0.decode.k"].shape, (self.STEPS, self.HKV, self.D))

    def test_needles_refuses_a_trace_without_needles_before_a_session_is_made(self):
        # A trace of --needles=0 gave "found": NaN (not JSON); one without the metadata a
        # KeyError as the run's error.
        cases = [(self.trace("none.st", needles_meta="[]"), "the trace has no needles (make one "
                  "with kvrecall synth --needles N, N >= 1)"),
                 (self.trace("absent.st", needles_meta=None), 'not a needle trace (no "needles" '
                  "in __metadata__; make one with kvrecall synth --needles N)"),
                 (self.trace("late.st", needles_meta='[{"decode_step": 3, "position": 5}]'),
                  "__metadata__ needles")]  # step 3 of a trace of 3 decode steps
        before = {i.session_id for i in self.client.list_sessions()}
        for path, message in cases:
            with self.subTest(os.path.basename(path)):
                trace = needles.read_safetensors(path)
                with self.assertRaises(ValueError) as e:
                    needles.replay(self.client, trace, "full")
                self.assertIn(message, str(e.exception))
                with self.assertRaises(ValueError) as e:
                    needles.needle_trace(trace, path)
                self.assertTrue(str(e.exception).startswith(f"{path}: {message}"))
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = needles.main(["--server", self.address, "--trace", path,
                                       "--runs", "full"])
                self.assertEqual((rc, out.getvalue()), (1, ""))
                self.assertEqual(err.getvalue(), f"kvrecall.needles: {path}: "
                                 f"{str(e.exception)[len(path) + 2:]}\n")
        self.assertEqual({i.session_id for i in self.client.list_sessions()}, before)
        r = needles.replay(self.client, needles.read_safetensors(self.trace("two.st", layers=2)),
                           "full")
        self.assertEqual((r["needles"], r["layers"], r["context"]), (1, 2, self.T))
        self.assertFalse(math.isnan(r["retained_mass_mean"]))
        self.assertAlmostEqual(r["retained_mass_mean"], 1.0, places=5)

    def test_needles_and_evaluate_check_every_run_spec_before_the_first_run(self):
        trace = self.trace("good.st")
        jsonl = os.path.join(self.tmp, "runs.jsonl")
        text = self.raw_file("text.txt", b"tiny text\n")
        ev = ["run", "--server", self.address, "--model", os.path.join(self.tmp, "none.npz"),
              "--text", text, "--ctx", "4", "--suffix", "2", "--jsonl", jsonl]
        streaming = "streaming:K needs K >= 128 (it keeps 128 sinks and K-128 recent tokens), got 64"
        cases = [
            (needles.main, ["--server", self.address, "--trace", trace, "--jsonl", jsonl,
                            "--runs", "full", "streaming:64"],
             f"python3 -m kvrecall.needles: error: argument --runs: run 'streaming:64': "
             f"{streaming}"),
            (needles.main, ["--server", self.address, "--trace", trace, "--jsonl", jsonl,
                            "--runs", "exact_topk:abc", "full"],
             "error: argument --runs: run 'exact_topk:abc': K must be an integer >= 1, "
             "got 'abc'"),
            (evaluate.main, ev + ["--runs", "full", "streaming:64"],
             f"python3 -m kvrecall.evaluate run: error: argument --runs: streaming:64: "
             f"{streaming}"),
            (evaluate.main, ev + ["--runs", "exact_topk:abc", "full"],
             "python3 -m kvrecall.evaluate run: error: argument --runs: exact_topk:abc: K must "
             "be an integer >= 1, got 'abc'"),
            (evaluate.main, ev + ["--runs", "nearest:64"],
             "argument --runs: nearest:64: unknown selector 'nearest'"),
            (evaluate.main, ev + ["--runs", "full@moon"],
             "argument --runs: full@moon: unknown placement 'moon'"),
            (evaluate.main, ev + ["--runs", "full", "--ctx", "0"],
             "python3 -m kvrecall.evaluate run: error: argument --ctx: must be >= 1, got 0"),
            (evaluate.main, ev + ["--runs", "full", "--offset", "-1"],
             "argument --offset: must be >= 0, got -1"),
        ]
        for main, argv, message in cases:
            with self.subTest(" ".join(argv[-3:])):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    with self.assertRaises(SystemExit) as e:
                        main(argv)
                self.assertEqual(e.exception.code, 2)
                self.assertIn(message, err.getvalue())
                self.assertNotIn("Traceback", err.getvalue())
                self.assertFalse(os.path.exists(jsonl))  # no run was made

    def test_evaluate_records_a_failed_run_and_goes_on(self):
        # tinylm's "not enough text" was a SystemExit, which `except Exception` let through:
        # the first run ended the tool and the others were never tried.
        jsonl = os.path.join(self.tmp, "runs.jsonl")
        text = self.raw_file("text.txt", b"tiny text\n")  # 10 bytes and the newline after
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = evaluate.main(["run", "--server", self.address, "--model",
                                os.path.join(self.tmp, "none.npz"), "--text", text,
                                "--ctx", "16", "--suffix", "4", "--jsonl", jsonl,
                                "--runs", "full", "exact_topk:16", "streaming:256@tiered"])
        self.assertEqual(rc, 1)
        rows = evaluate.load(jsonl)
        self.assertEqual([r["run"] for r in rows],
                         ["full", "exact_topk:16", "streaming:256@tiered"])
        for r in rows:
            self.assertEqual(r["error"], "ValueError: --text: only 11 bytes of text; --offset + "
                             "--ctx + --suffix + 1 = 21")
        self.assertIn("--sinks 128 --recent 128", rows[2]["command"])

    def test_needle_metadata_that_does_not_fit_the_tensors_is_refused(self):
        # A needle past the prompt was "found", two at one step became one, a context the
        # tensors do not have was ignored and layers "1_0" read as 10 (probe 21, 9).
        cases = [('[{"decode_step": 1, "position": 999999}]', {},
                  "(a needle is a prompt position)"),
                 ('[{"decode_step": 1, "position": 5}, {"decode_step": 1, "position": 7}]', {},
                  "lists a decode step twice"),
                 ('[{"decode_step": 1, "position": 5}]', {"context": "512"},
                  f"__metadata__ context is '512' but the tensors say {self.T}"),
                 ('[{"decode_step": 1, "position": 5}]', {"layers": "1_0"},
                  "__metadata__ layers '1_0' is not an integer >= 1")]
        for i, (needles_meta, extra, message) in enumerate(cases):
            with self.subTest(message):
                path = self.trace(f"meta{i}.st", needles_meta=needles_meta)
                header, meta, t = needles.read_safetensors(path)
                with self.assertRaises(ValueError) as e:
                    needles.needle_trace((header, {**meta, **extra}, t), path)
                self.assertIn(message, str(e.exception))

    def test_tinylm_reads_text_in_bounded_memory_and_names_what_it_cannot_read(self):
        # /dev/zero was read whole (out of memory) and a FIFO hung the read; a model that does
        # not exist, or a corrupt cache entry, ended in a traceback (probe 21, 2 and 4).
        fifo = os.path.join(self.tmp, "fifo")
        os.mkfifo(fifo)
        for path in (fifo, "/dev/zero"):
            with self.assertRaisesRegex(ValueError, re.escape(
                    f"--text: {path} is neither a regular file nor a directory")):
                tinylm.read_text([path], 10)
        self.assertEqual(tinylm.read_text([self.raw_file("a.txt", b"abc"),
                                           self.raw_file("b.txt", b"x\0y"),
                                           self.raw_file("c.txt", b"defgh")], 7).tobytes(),
                         b"abc\ndef")  # b.txt is binary: skipped whole, as tinylm_np.py does
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = tinylm.main(["ppl", "--server", self.address, "--model",
                              os.path.join(self.tmp, "none.npz"), "--text",
                              self.raw_file("text.txt", b"x" * 200), "--ctx", "90",
                              "--suffix", "20", "--cache-dir", ""])
        self.assertEqual(rc, 1)
        self.assertIn("none.npz: No such file or directory", err.getvalue())
        err = io.StringIO()
        not_a_dir = self.raw_file("not-a-dir", b"")
        with contextlib.redirect_stderr(err):
            rc = tinylm.main(["ppl", "--server", self.address, "--model", "m.npz", "--text",
                              self.raw_file("t2.txt", b"x" * 200), "--ctx", "90", "--suffix",
                              "20", "--cache-dir", not_a_dir])
        self.assertEqual(rc, 1)
        self.assertIn(f"--cache-dir: {not_a_dir} is not a directory", err.getvalue())

    def test_evaluate_checks_its_files_before_any_run(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
            evaluate.main(["run", "--server", self.address, "--model", "m.npz", "--text", "t",
                           "--runs", "full", "--jsonl", os.path.join(self.tmp, "no", "x.jsonl")])
        self.assertEqual(e.exception.code, 2)
        self.assertIn("--jsonl: cannot write", err.getvalue())
        empty_error = '{"run": "full", "error": "", "command": "c"}\n'
        for name, text, message in (("bad.jsonl", "notjson\n", "bad.jsonl:1: not JSON"),
                                    ("empty.jsonl", empty_error, "field 'error' is empty"),
                                    ("short.jsonl", '{"run": "full"}\n', "field 'policy' missing")):
            with self.subTest(name):
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    rc = evaluate.main(["render", "--jsonl", self.raw_file(name, text.encode()),
                                        "--md", os.path.join(self.tmp, "x.md")])
                self.assertEqual(rc, 1)
                self.assertIn(message, err.getvalue())

    def test_tinylm_refuses_bad_window_flags_before_any_work(self):
        # A negative offset sliced from the text's end; --suffix 0 ended in a traceback after
        # the whole prefill upload. The model path does not exist: any work would fail on it.
        base = ["ppl", "--server", self.address, "--model", os.path.join(self.tmp, "none.npz"),
                "--text", self.raw_file("text.txt", b"x" * 100)]
        for flags, message in ((["--ctx", "0"], "argument --ctx: must be >= 1, got 0"),
                               (["--suffix", "0"], "argument --suffix: must be >= 1, got 0"),
                               (["--suffix", "-3"], "argument --suffix: must be >= 1, got -3"),
                               (["--offset", "-1"], "argument --offset: must be >= 0, got -1"),
                               (["--ctx", "x"], "argument --ctx: invalid int value: 'x'")):
            with self.subTest(flags):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
                    tinylm.main(base + flags)
                self.assertEqual(e.exception.code, 2)
                self.assertIn(f"python3 -m kvrecall.tinylm: error: {message}", err.getvalue())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = tinylm.main(base + ["--ctx", "90", "--suffix", "20"])
        self.assertEqual(rc, 1)
        self.assertEqual(err.getvalue(), "kvrecall.tinylm: --text: only 101 bytes of text; "
                         "--offset + --ctx + --suffix + 1 = 111\n")


@unittest.skipUnless(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"),
                     "kvrecall.hf needs torch and transformers")
class HfBackendTest(ServerTest):
    """kvrecall.hf's KvRecallBackend: sessions are never left open on the server, and what the
    service cannot serve (a padded batch, a second generation in one backend) is refused."""

    def label(self):
        return f"hf test {self.id().rsplit('.', 1)[-1]}"

    def open_sessions(self):
        """Ids of this test's sessions the server still holds."""
        return sorted(i.session_id for i in self.client.list_sessions()
                      if i.label.startswith(self.label()))

    def model(self):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from kvrecall import hf
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256)
        model = LlamaForCausalLM(config).float().eval()
        hf.set_attn_implementation(model, "kvrecall")
        return model

    def test_a_failed_create_closes_the_rows_made_before_it(self):
        import torch
        from kvrecall import hf
        client, calls = self.client, []

        class ThirdCreateFails:  # the third row's label is one the server refuses
            def create_session(self, geometry, policy, label, max_tokens=0):
                calls.append(label)
                return client.create_session(geometry, policy,
                                             label if len(calls) != 3 else label + "x" * 300,
                                             max_tokens=max_tokens)

        backend = hf.KvRecallBackend(ThirdCreateFails(), make_policy("full"), label=self.label())
        module = types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=2),
                                       layer_idx=0)
        q, kv = torch.zeros(4, 2, 3, 8), torch.zeros(4, 1, 3, 8)
        with self.assertRaises(kvrecall.KvRecallError) as e, backend:
            backend.attention(module, q, kv, kv, None)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("label must be at most 256 bytes", e.exception.message)
        self.assertEqual(len(calls), 3)
        self.assertIsNone(backend.sessions)
        self.assertEqual(self.open_sessions(), [])  # rows 0 and 1 were closed

    def test_close_sessions_closes_every_session_and_keeps_the_bodys_error(self):
        from kvrecall import hf
        backend = hf.KvRecallBackend(self.client, make_policy("full"), label=self.label())
        g = make_geometry(1, 2, 1, 8)
        backend.sessions = [self.client.create_session(g, label=f"{self.label()} {i}")
                             for i in range(3)]
        gone = backend.sessions[0]
        gone.close()  # its close in close_sessions fails: NOT_FOUND
        with self.assertRaises(kvrecall.KvRecallError) as e:
            backend.close_sessions()
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn(gone.id, e.exception.message)
        self.assertIsNone(backend.sessions)
        self.assertEqual(self.open_sessions(), [])  # the others were closed all the same
        # Leaving the block with an error: that error, not the close's, reaches the caller.
        backend.sessions = [self.client.create_session(g, label=f"{self.label()} {i}")
                            for i in range(2)]
        backend.sessions[0].close()
        with self.assertRaisesRegex(RuntimeError, "^the body's error$"), backend:
            raise RuntimeError("the body's error")
        self.assertEqual(self.open_sessions(), [])

    def test_a_padded_batch_is_refused_before_a_session_is_made(self):
        import torch
        from transformers import DynamicCache
        from kvrecall import hf
        model = self.model()
        ids = torch.randint(0, 64, (2, 6))
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[0, :2] = 0  # row 0 left-padded by two
        backend = hf.KvRecallBackend(self.client, make_policy("full"), label=self.label())
        with torch.no_grad(), self.assertRaises(ValueError) as e, backend:
            model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(),
                  use_cache=True)
        self.assertIn("layer 0: attention_mask hides or biases position 0 from query",
                      str(e.exception))
        self.assertIn("batch row 0; the kvrecall backend takes unpadded batches only",
                      str(e.exception))
        self.assertEqual(self.open_sessions(), [])

    def test_decode_matches_sdpa_and_a_second_generation_is_refused(self):
        import torch
        from transformers import DynamicCache
        from kvrecall import hf
        model = self.model()
        ids = torch.randint(0, 64, (2, 12))
        with torch.no_grad():
            hf.set_attn_implementation(model, "sdpa")
            want = model(input_ids=ids, use_cache=False).logits[:, -3:]
            hf.set_attn_implementation(model, "kvrecall")
            backend = hf.KvRecallBackend(self.client, make_policy("full"), label=self.label())
            with backend:
                out = model(input_ids=ids[:, :9], past_key_values=DynamicCache(), use_cache=True)
                got = []
                for t in range(9, 12):  # one token at a time, every layer through the service
                    out = model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values,
                                use_cache=True)
                    got.append(out.logits[:, -1])
                self.assertEqual(len(self.open_sessions()), 2)
                self.assertEqual([list(s.info().layer_tokens) for s in backend.sessions],
                                 [[12, 12], [12, 12]])
                with self.assertRaises(ValueError) as e:  # a new prompt, a fresh cache
                    model(input_ids=ids[:, :5], past_key_values=DynamicCache(), use_cache=True)
                self.assertEqual(str(e.exception), (
                    "layer 0: the model's cache holds 0 tokens before these 5, the service's "
                    "sessions 12; one backend serves one generation (leave `with backend:` or "
                    "call close_sessions() before the next)"))
                self.assertEqual([list(s.info().layer_tokens) for s in backend.sessions],
                                 [[12, 12], [12, 12]])  # nothing appended
        torch.testing.assert_close(torch.stack(got, dim=1), want, rtol=1e-4, atol=1e-4)
        self.assertEqual(self.open_sessions(), [])


CLI = os.environ.get("KVRECALL_CLI", "")


@unittest.skipUnless(os.path.exists(CLI) and
                     os.path.exists(os.path.join(SOURCE_DIR, "client", "cli", "synth.cc")),
                     "needs the kvrecall CLI with its synth subcommand (KVRECALL_CLI)")
class NeedleTest(ServerTest):
    def test_needles_are_found_by_exact_selectors_and_missed_by_a_short_window(self):
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "needles.safetensors")
            subprocess.run([CLI, "synth", f"--out={trace}", "--context=2048", "--decode_steps=32",
                            "--layers=1", "--needles=2", "--seed=3"], check=True,
                           capture_output=True, timeout=120)
            t = needles.read_safetensors(trace)
            self.assertEqual(len(json.loads(t[1]["needles"])), 2)
            full = needles.replay(self.client, t, "full")
            topk = needles.replay(self.client, t, "exact_topk:64")
            window = needles.replay(self.client, t, "streaming:256")
        print(f"\n  needles found: full {full['found']}, exact_topk K=64 {topk['found']}, "
              f"streaming 128+128 {window['found']}", file=sys.stderr)
        self.assertEqual(full["found"], 1.0)
        self.assertAlmostEqual(full["retained_mass_mean"], 1.0, places=5)
        self.assertEqual(topk["found"], 1.0)
        self.assertLess(window["found"], 0.5)  # needles sit in the prompt's middle, out of the window


def stop_process(pid):
    """SIGSTOP, then waits until every thread of `pid` is stopped (kill returns before they are:
    a shared stream's polling thread can answer one more step)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"kvrecalld {pid} did not stop")


@unittest.skipUnless(sys.platform.startswith("linux"), "stops the server through /proc")
class DeadlineTest(unittest.TestCase):
    """call_timeout_s, step_timeout_s, prefill's timeout_s and cancel_step against a kvrecalld
    stopped with SIGSTOP (a wedged server), over the Decode call and a shared region."""

    def setUp(self):
        self.region_dir = tempfile.TemporaryDirectory(prefix="kvrecall-shm-")
        self.addCleanup(self.region_dir.cleanup)
        self.kvrecalld = Kvrecalld(f"--shared_memory_dir={self.region_dir.name}")
        self.addCleanup(self.kvrecalld.stop)
        self.addCleanup(os.kill, self.kvrecalld.process.pid, signal.SIGCONT)  # runs first

    def transports(self):
        shared = sys.platform.startswith("linux") and platform.machine() == "x86_64"
        return [False, True] if shared else [False]

    def prefilled(self, client, seed):
        rng = np.random.default_rng(seed)
        s = client.create_session(make_geometry(1, 4, 2, 16), make_policy("full"))
        s.prefill([(rng.standard_normal((20, 4, 16), dtype=np.float32),
                    rng.standard_normal((20, 2, 16), dtype=np.float32),
                    rng.standard_normal((20, 2, 16), dtype=np.float32))])
        step = (rng.standard_normal((4, 16), dtype=np.float32),
                rng.standard_normal((2, 16), dtype=np.float32),
                rng.standard_normal((2, 16), dtype=np.float32))
        return s, step

    def wait_for_calls_done(self, method, count, timeout_s=20):
        """Waits until kvrecalld's kvrecall_rpcs_total counts `count` calls of `method` (every
        code): gRPC has said each is done, and the service has finished with it."""
        pattern = re.compile(r'^kvrecall_rpcs_total\{[^}]*method="%s"[^}]*\} (\S+)$' % method,
                             re.M)
        deadline = time.monotonic() + timeout_s
        done = 0
        while time.monotonic() < deadline:
            with urllib.request.urlopen(self.kvrecalld.metrics_url, timeout=10) as r:
                done = sum(float(x) for x in pattern.findall(r.read().decode()))
            if done >= count:
                return
            time.sleep(0.05)
        self.fail(f"{method}: {done} calls done of {count} after {timeout_s} s")

    def test_a_wedged_server_fails_each_call_by_its_timeout(self):
        pid = self.kvrecalld.process.pid
        self.prefills_sent = 0
        for shared in self.transports():
            with self.subTest(shared_memory=shared), \
                    kvrecall.Client(self.kvrecalld.address, shared_memory=shared,
                                    call_timeout_s=0.5, step_timeout_s=0.5) as c:
                s, step = self.prefilled(c, 1)
                self.prefills_sent += 2  # that one, and the one past its deadline below
                other = c.create_session(make_geometry(1, 4, 2, 16), make_policy("full"))
                self.assertEqual(s.attend(0, *step, position=20).position, 20)
                stop_process(pid)
                start = time.monotonic()
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    s.attend(0, *step, position=21)
                self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                self.assertIn("no answer within step_timeout_s=0.5", e.exception.message)
                self.assertIn("resend it with its position", e.exception.message)
                self.assertLess(time.monotonic() - start, 5)
                # The next step needs a new stream from a server that does not answer.
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    s.attend(0, *step, position=21)
                self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    s.info()
                self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                rng = np.random.default_rng(2)
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    other.prefill([(rng.standard_normal((20, 4, 16), dtype=np.float32),
                                    rng.standard_normal((20, 2, 16), dtype=np.float32),
                                    rng.standard_normal((20, 2, 16), dtype=np.float32))],
                                  timeout_s=0.5)
                self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
                self.assertLess(time.monotonic() - start, 20)
                os.kill(pid, signal.SIGCONT)
                # Awake: the step resent with its position is applied once (ABORTED: it was).
                try:
                    self.assertEqual(s.attend(0, *step, position=21).position, 21)
                except kvrecall.KvRecallError as resent:
                    self.assertEqual(resent.code, grpc.StatusCode.ABORTED)
                self.assertEqual(list(s.info().layer_tokens), [22])
                # The prefill past its deadline: the stalled server read its headers, chunks and
                # the client's cancellation at once on waking, and took its deadline from then
                # (gRPC sends a timeout, not a time), so it may have committed it before it
                # read the cancellation. What is promised: all of the prompt or none, and
                # info() and a retry tell which (client.py, Session.prefill). Once the server
                # is done with the call (counted), an OK it could not deliver has been taken
                # back.
                self.wait_for_calls_done("kvrecall.v1.KvRecall/Prefill", self.prefills_sent)
                tokens = other.info().tokens
                self.assertIn(tokens, (0, 20))
                retry = [(rng.standard_normal((20, 4, 16), dtype=np.float32),
                          rng.standard_normal((20, 2, 16), dtype=np.float32),
                          rng.standard_normal((20, 2, 16), dtype=np.float32))]
                if tokens == 0:
                    other.prefill(retry)
                    self.prefills_sent += 1
                else:
                    with self.assertRaises(kvrecall.KvRecallError) as refused:
                        other.prefill(retry)
                    self.prefills_sent += 1
                    self.assertEqual(refused.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
                    self.assertIn("is already prefilled", refused.exception.message)
                self.assertEqual(other.info().tokens, 20)

    def test_cancel_step_ends_a_step_in_flight(self):
        pid = self.kvrecalld.process.pid
        for shared in self.transports():
            with self.subTest(shared_memory=shared), \
                    kvrecall.Client(self.kvrecalld.address, shared_memory=shared) as c:
                s, step = self.prefilled(c, 3)
                s.attend(0, *step, position=20)
                stop_process(pid)
                canceller = threading.Timer(0.3, c.cancel_step)
                canceller.start()
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    s.attend(0, *step, position=21)
                canceller.join()
                self.assertEqual(e.exception.code, grpc.StatusCode.CANCELLED)
                self.assertIn("decode step: cancelled by cancel()", e.exception.message)
                os.kill(pid, signal.SIGCONT)
                try:
                    s.attend(0, *step, position=21)
                except kvrecall.KvRecallError as resent:
                    self.assertEqual(resent.code, grpc.StatusCode.ABORTED)
                self.assertEqual(list(s.info().layer_tokens), [22])
                # Cancelled between steps: the next step goes on a new stream.
                before = c.decode_stream
                c.cancel_step()
                s.attend(0, *step, position=22)
                self.assertIsNot(c.decode_stream, before)

    def test_close_on_a_wedged_server_ends_by_the_step_timeout(self):
        # review 26, 2: close() waited for the server with no bound.
        pid = self.kvrecalld.process.pid
        for shared in self.transports():
            with self.subTest(shared_memory=shared):
                c = kvrecall.Client(self.kvrecalld.address, shared_memory=shared,
                                    step_timeout_s=0.5)
                s, step = self.prefilled(c, 5)
                s.attend(0, *step, position=20)
                stop_process(pid)
                start = time.monotonic()
                with self.assertRaisesRegex(kvrecall.KvRecallError,
                                            r"DEADLINE_EXCEEDED: closing the (shared )?decode "
                                            r"stream: no answer within step_timeout_s=0.5"):
                    c.close()
                self.assertLess(time.monotonic() - start, 5)
                os.kill(pid, signal.SIGCONT)

    def test_cancel_step_reaches_a_shared_stream_being_opened(self):
        # review 26, 3: the wait for a new stream's region was out of cancel_step's reach.
        if True not in self.transports():
            self.skipTest("kvrecall.shared runs on Linux x86-64 only")
        pid = self.kvrecalld.process.pid
        with kvrecall.Client(self.kvrecalld.address, shared_memory=True) as c:
            s, step = self.prefilled(c, 6)
            s.attend(0, *step, position=20)
            c.cancel_step()  # between steps: the next opens a new stream
            stop_process(pid)
            outcome = []

            def attend():
                try:
                    s.attend(0, *step, position=21)
                    outcome.append("ok")
                except kvrecall.KvRecallError as e:
                    outcome.append(e)
            stepper = threading.Thread(target=attend)
            stepper.start()
            time.sleep(0.3)
            c.cancel_step()
            stepper.join(5)
            self.assertFalse(stepper.is_alive())
            os.kill(pid, signal.SIGCONT)
            self.assertEqual(outcome[0].code, grpc.StatusCode.CANCELLED, outcome)
            self.assertIn("opening the shared decode stream: cancelled by cancel()",
                          outcome[0].message)
            s.attend(0, *step, position=21)
            self.assertEqual(list(s.info().layer_tokens), [22])

    def test_cancelled_streams_leave_nothing_behind(self):
        # review 26, 1: each cancel_step between steps left the stream's timer thread (and a
        # shared region's mapping) behind for good, even after close().
        def timers():
            return sum(t.name == "kvrecall-step-timer" for t in threading.enumerate())

        def regions():
            with open("/proc/self/maps") as f:
                return sum(self.region_dir.name in line for line in f)
        for shared in self.transports():
            with self.subTest(shared_memory=shared):
                before = (timers(), regions())
                with kvrecall.Client(self.kvrecalld.address, shared_memory=shared,
                                     step_timeout_s=5) as c:
                    s, step = self.prefilled(c, 7)
                    for position in range(20, 40):
                        c.cancel_step()
                        s.attend(0, *step, position=position)
                    self.assertLessEqual(timers(), before[0] + 2)
                    self.assertLessEqual(regions(), before[1] + 2)
                deadline = time.monotonic() + 10
                while timers() > before[0] and time.monotonic() < deadline:
                    time.sleep(0.01)  # a stopped timer thread ends within its wait
                self.assertEqual((timers(), regions()), before)

    def test_an_infinite_timeout_is_no_limit(self):
        # review 26, 4: inf failed every call at once, and killed the timer thread.
        with kvrecall.Client(self.kvrecalld.address, call_timeout_s=math.inf,
                             step_timeout_s=float("inf")) as c:
            self.assertIsNone(c.call_timeout_s)
            s, step = self.prefilled(c, 8)
            self.assertEqual(s.attend(0, *step, position=20).position, 20)
        with kvrecall.Client(self.kvrecalld.address, call_timeout_s=1e9,
                             step_timeout_s=1e9) as c:
            s, step = self.prefilled(c, 9)
            self.assertEqual(s.attend(0, *step, position=20).position, 20)
        with self.assertRaisesRegex(ValueError,
                                    r"at most 1e\+09; inf: no limit\), got 10000000000.0"):
            kvrecall.Client(self.kvrecalld.address, call_timeout_s=1e10)

    def test_steps_within_their_timeout_are_served_as_without(self):
        for shared in self.transports():
            with self.subTest(shared_memory=shared), \
                    kvrecall.Client(self.kvrecalld.address, shared_memory=shared,
                                    step_timeout_s=0.25) as c:
                s, step = self.prefilled(c, 4)
                stream, position, end = None, 20, time.monotonic() + 1.0
                while time.monotonic() < end:
                    self.assertEqual(s.attend(0, *step, position=position).position, position)
                    stream = stream or c.decode_stream
                    position += 1
                self.assertIs(c.decode_stream, stream)  # one stream throughout

    def test_the_tools_timeout_flag(self):
        import argparse
        from kvrecall.client import add_connection_arguments, connection_argv, connection_from_args
        ap = argparse.ArgumentParser()
        add_connection_arguments(ap)
        args = ap.parse_args(["--server", self.kvrecalld.address, "--timeout", "0.5"])
        kwargs = connection_from_args(args)
        self.assertEqual((kwargs["call_timeout_s"], kwargs["step_timeout_s"]), (0.5, 0.5))
        self.assertEqual(connection_from_args(ap.parse_args(connection_argv(args))), kwargs)
        self.assertIsNone(connection_from_args(ap.parse_args([]))["call_timeout_s"])
        self.assertIsNone(connection_from_args(ap.parse_args(["--timeout", "inf"]))
                          ["step_timeout_s"])
        with self.assertRaisesRegex(ValueError, r"^--timeout must be a positive number of "
                                                r"seconds \(at most 1e\+09; inf: no limit\), "
                                                r"got 0.0"):
            connection_from_args(ap.parse_args(["--timeout", "0"]))
        with kvrecall.Client(self.kvrecalld.address, **kwargs) as c:
            c.list_sessions()
            stop_process(self.kvrecalld.process.pid)
            with self.assertRaises(kvrecall.KvRecallError) as e:
                c.list_sessions()
            self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
            os.kill(self.kvrecalld.process.pid, signal.SIGCONT)

    def test_channel_options_reach_the_channel(self):
        # One whose effect shows: replies' headers past a 1-byte metadata limit (the soft and,
        # in newer gRPC, where the soft one only warns, the hard one: d165's grpcio 1.84).
        with kvrecall.Client(self.kvrecalld.address,
                             channel_options=[("grpc.max_metadata_size", 1),
                                              ("grpc.absolute_max_metadata_size", 1)]) as c:
            with self.assertRaisesRegex(kvrecall.KvRecallError, "^RESOURCE_EXHAUSTED: "):
                c.list_sessions()
        with kvrecall.Client(self.kvrecalld.address,
                             channel_options=[("grpc.primary_user_agent", "runner/1")]) as c:
            self.assertEqual(c.list_sessions(), [])
        for key in ("grpc.max_send_message_length", "grpc.max_receive_message_length",
                    "grpc.ssl_target_name_override"):
            with self.assertRaisesRegex(ValueError, f"channel_options: {key} is the Client's"):
                kvrecall.Client(self.kvrecalld.address, channel_options=[(key, 1)])

    def test_timeouts_must_be_positive_numbers(self):
        with kvrecall.Client(self.kvrecalld.address, call_timeout_s=np.float32(2),
                             step_timeout_s=np.int64(3)) as c:  # numpy scalars are numbers
            self.assertEqual((c.call_timeout_s, c.step_timeout_s), (2.0, 3.0))
        for bad in (0, -1, "1", True, float("nan")):
            with self.assertRaisesRegex(ValueError, "call_timeout_s must be None or a positive"):
                kvrecall.Client(self.kvrecalld.address, call_timeout_s=bad)
            with self.assertRaisesRegex(ValueError, "step_timeout_s must be None or a positive"):
                kvrecall.Client(self.kvrecalld.address, step_timeout_s=bad)
        with kvrecall.Client(self.kvrecalld.address) as c:
            s = c.create_session(make_geometry(1, 4, 2, 16), make_policy("full"))
            with self.assertRaisesRegex(ValueError, "timeout_s must be None or a positive"):
                s.prefill([(np.zeros((2, 4, 16), np.float32), np.zeros((2, 2, 16), np.float32),
                            np.zeros((2, 2, 16), np.float32))], timeout_s=0)
            self.assertEqual(s.info().tokens, 0)


class WireTest(unittest.TestCase):
    """The decode path's encoding (tensors.WireBuffer, client._StepWire) against protobuf's."""

    def test_the_f16_range_check_agrees_with_the_conversion(self):
        # check_f16_range looks at blocks of rows (no copy of the tensor): a value in the last
        # block is found, and the boundary is f16's own rounding (65519.99 -> 65504, 65520 ->
        # inf); NaN and inf were not finite values to begin with.
        x = np.zeros((3000, 8, 64), np.float32)  # 1.5M elements: two blocks
        tensors.check_f16_range(x, "t")
        for value, overflows in ((65519.99, False), (-65519.99, False), (65520.0, True),
                                 (-1e30, True), (np.nan, False), (np.inf, False)):
            with self.subTest(value=value):
                x[2999, 7, 63] = value
                self.assertEqual(bool(np.isinf(np.float16(np.float32(value))) and
                                      np.isfinite(np.float32(value))), overflows)
                if overflows:
                    with self.assertRaisesRegex(ValueError, r"^t: value .* is past f16's range"):
                        tensors.check_f16_range(x, "t")
                else:
                    tensors.check_f16_range(x, "t")
        tensors.check_f16_range(np.full((4, 2), 7e4, np.float32)[:0], "empty")
        tensors.check_f16_range(np.full((4, 2), np.inf, np.float16), "already f16")

    def test_wire_buffers_hold_the_bytes_to_tensor_writes(self):
        rng = np.random.default_rng(5)
        x = rng.standard_normal((8, 16)).astype(np.float32)
        u = x.view(np.uint32)  # specials, a subnormal and exact bf16 ties (both parities)
        u.flat[:9] = [0x7F800000, 0xFF800000, 0x7FC00000, 0, 0x80000000, 0x00000001,
                      0x3F808000, 0x3F818000, 0xBF808000]
        # Bit for bit, but a NaN only as a NaN: with torch loaded (a model runner) bf16 converts
        # through it, whose NaN payload is its own (the server refuses NaN inputs either way).
        bits = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16}
        floats = {"f32": lambda b: b.view(np.float32), "f16": lambda b: b.view(np.float16),
                  "bf16": tensors.bf16_bits_to_f32}
        for dtype in ("f32", "f16", "bf16"):
            w = tensors.WireBuffer(dtype, (8, 16))
            want = np.frombuffer(tensors.to_tensor(x, dtype).data, bits[dtype])
            nan = np.isnan(floats[dtype](want))
            for variant in (x, np.asfortranarray(x), x.astype(np.float64), x[None], x.ravel()):
                got = np.frombuffer(bytes(w.view(variant)), bits[dtype])
                self.assertEqual(got[~nan].tobytes(), want[~nan].tobytes(), (dtype, variant.shape))
                self.assertTrue(np.isnan(floats[dtype](got)[nan]).all(), (dtype, variant.shape))
            with self.assertRaisesRegex(ValueError, r"shape \[8, 15\] does not fit shape \[8, 16\]"):
                w.view(x[:, :15])
        bits = tensors.f32_to_bf16_bits(x)
        self.assertEqual(list(bits.flat[6:9]), [0x3F80, 0x3F82, 0xBF80])  # ties to even
        # A NaN whose mantissa is all ones stays a NaN (rounding it naively carries into ±0).
        nan = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001], np.uint32).view(np.float32)
        w = tensors.WireBuffer("bf16", (3,))
        for b in (tensors.f32_to_bf16_bits(nan), w.view(nan), w.view(nan.astype(np.float64))):
            self.assertTrue(np.isnan(tensors.bf16_bits_to_f32(b)).all(), [hex(v) for v in b])

    def test_inputs_already_in_the_wire_dtype_are_not_copied(self):
        w = tensors.WireBuffer("bf16", (4, 8))
        bits = tensors.f32_to_bf16_bits(np.ones((4, 8), np.float32))
        self.assertIs(w.view(bits), bits)
        converted = w.view(np.ones((4, 8), np.float32))
        self.assertIs(w.view(np.zeros((4, 8), np.float32)), converted)  # one buffer, reused
        f32 = tensors.WireBuffer("f32", (4, 8))
        a = np.arange(32, dtype=np.float32).reshape(4, 8)
        self.assertIs(f32.view(a), a)

    @unittest.skipUnless(importlib.util.find_spec("torch"), "torch is not installed")
    def test_torch_tensors(self):
        import torch
        x = torch.randn(8, 16)
        for dtype, tdt in (("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)):
            w = tensors.WireBuffer(dtype, (8, 16))
            want = tensors.to_tensor(x, dtype).data
            for variant in (x, x.t().contiguous().t(), x.to(tdt)):
                self.assertEqual(bytes(w.view(variant)), want, (dtype, variant.dtype))
            same = x.to(tdt)
            self.assertEqual(w.view(same).ctypes.data, same.data_ptr())  # no copy
        # numpy float32 to bf16 through torch (loaded) rounds as f32_to_bf16_bits does.
        a = np.random.default_rng(6).standard_normal((8, 16)).astype(np.float32)
        self.assertEqual(bytes(tensors.WireBuffer("bf16", (8, 16)).view(a)),
                         tensors.f32_to_bf16_bits(a).tobytes())

    @unittest.skipUnless(importlib.util.find_spec("torch"), "torch is not installed")
    def test_the_f16_range_check_of_torch_tensors(self):
        # check_f16_range's torch branch (the prefill of a runner's tensors), on the GPU too.
        import torch
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            with self.subTest(device=device):
                x = torch.zeros((3000, 8, 64), device=device)  # two blocks
                tensors.check_f16_range(x, "t")
                x[2999, 7, 63] = -65520.0
                with self.assertRaisesRegex(ValueError, r"^t: value -65520.0 is past f16's"):
                    tensors.check_f16_range(x, "t")
                x[2999, 7, 63] = 65519.0
                tensors.check_f16_range(x, "t")
                x[0, 0, 0] = float("inf")  # not a finite value to begin with
                tensors.check_f16_range(x, "t")
                tensors.check_f16_range(x.to(torch.bfloat16)[:0], "empty")

    def test_pre_serialized_requests_parse_as_protobuf_builds_them(self):
        from kvrecall.client import Session, _StepWire
        from kvrecall.v1 import kvrecall_pb2 as pb
        rng = np.random.default_rng(7)
        sessions = [Session(None, "a" * 32, make_geometry(1, 4, 2, 8, "bf16"), None),
                    Session(None, "b", make_geometry(1, 6, 3, 16, "f32"), None),
                    Session(None, "", make_geometry(1, 2, 1, 4, "f16"), None)]
        want = pb.DecodeRequest(request_id=2 ** 40 + 3, layer=5, return_lse=True,
                                compare_exact=True)
        pieces = [pb.DecodeRequest(request_id=2 ** 40 + 3, layer=5, return_lse=True,
                                   compare_exact=True).SerializeToString()]
        for s in sessions:
            g = s.geometry
            q = rng.standard_normal((g.q_heads, g.head_dim)).astype(np.float32)
            k = rng.standard_normal((g.kv_heads, g.head_dim)).astype(np.float32)
            v = rng.standard_normal((g.kv_heads, g.head_dim)).astype(np.float32)
            step = want.steps.add(session_id=s.id)
            tensors.to_tensor(q, g.dtype, out=step.q)
            tensors.to_tensor(k, g.dtype, out=step.k_new)
            tensors.to_tensor(v, g.dtype, out=step.v_new)
            s.step_wire().append(pieces, q, k, v)
        self.assertEqual(pb.DecodeRequest.FromString(b"".join(pieces)), want)
        # With positions (SequenceStep.position after the tensors; the step's frame grows).
        for position in (0, 1, 127, 128, 2 ** 40 + 3, 2 ** 63 - 1):
            positioned, pieces_with = pb.DecodeRequest(), []
            positioned.CopyFrom(want)
            for s, step in zip(sessions, positioned.steps):
                step.position = position
                s.step_wire().append(pieces_with, *(tensors.from_tensor(t) for t in
                                                    (step.q, step.k_new, step.v_new)), position)
            pieces_with.insert(0, pieces[0])
            self.assertEqual(pb.DecodeRequest.FromString(b"".join(pieces_with)), positioned,
                             position)
        self.assertIsInstance(sessions[0].step_wire(), _StepWire)
        # The head the client writes by hand, with the steps after it.
        from kvrecall.client import _request_head
        steps = b"".join(pieces[1:])
        for request_id in (0, 1, 127, 128, 300, 2 ** 40 + 3, 2 ** 64 - 1):
            for layer in (0, 1, 5, 127, 128, 2 ** 31 - 1):
                for flags in ((False, False, False), (True, False, True), (True, True, True)):
                    expected = pb.DecodeRequest(request_id=request_id, layer=layer,
                                                return_lse=flags[0], diagnostics=flags[1],
                                                compare_exact=flags[2])
                    expected.steps.extend(want.steps)
                    self.assertEqual(
                        pb.DecodeRequest.FromString(_request_head(request_id, layer, *flags) + steps),
                        expected, (request_id, layer, flags))
        # int32's range only: the server would read 2^32 + 5 as layer 5 (its low 32 bits).
        for layer in (-1, -2 ** 31, 2 ** 31, 2 ** 32 + 5, 2 ** 64):
            with self.assertRaisesRegex(ValueError,
                                        rf"^layer must be in \[0, 2\^31\), got {layer}$"):
                _request_head(1, layer, False, False, False)

    def test_float32_inputs_of_a_bf16_session_are_rounded_in_one_batch(self):
        from kvrecall.client import Session
        g = make_geometry(1, 4, 2, 8, "bf16")
        rng = np.random.default_rng(8)
        q = rng.standard_normal((4, 8)).astype(np.float32)
        k, v = (rng.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
        q.flat[:3] = np.array([0x7FFFFFFF, 0x3F808000, 0x3F818000], np.uint32).view(np.float32)
        pieces = []
        Session(None, "s", g, None).step_wire().append(pieces, q, k.T.copy().T, v)
        for x, got in zip((q, k, v), pieces[1::2]):
            got = np.frombuffer(bytes(got), np.uint16)
            want = tensors.f32_to_bf16_bits(x).reshape(-1)
            # A NaN stays a NaN, its payload is the converter's: numpy's path quiets it to
            # 0x7FC0, torch's (taken once torch is imported, as the hf tests do) keeps its own.
            nan = np.isnan(x.reshape(-1))
            self.assertTrue(np.all((got[nan] & 0x7F80) == 0x7F80) and np.all(got[nan] & 0x7F))
            np.testing.assert_array_equal(got[~nan], want[~nan])
        with self.assertRaisesRegex(ValueError, r"does not fit shape \[2, 8\]"):
            Session(None, "s", g, None).step_wire().append([], q, k[:1], v)


class SharedRegionLayoutTest(unittest.TestCase):
    """kvrecall.shared's copy of the region's layout against proto/shared_decode_region.h's."""

    def test_offsets_and_constants_match_the_header(self):
        from kvrecall import shared
        with open(os.path.join(SOURCE_DIR, "proto", "shared_decode_region.h")) as f:
            header = f.read()
        offsets = {name: int(offset) for name, offset in re.findall(
            r"offsetof\(RegionHeader, (\w+)\) == (\d+)", header)}
        words = {"request_seq": shared._REQUEST_SEQ, "request_bytes": shared._REQUEST_BYTES,
                 "closing": shared._CLOSING, "reply_seq": shared._REPLY_SEQ,
                 "reply_bytes": shared._REPLY_BYTES, "status_code": shared._STATUS_CODE,
                 "ended": shared._ENDED, "request_signal": shared._REQUEST_SIGNAL,
                 "server_sleeping": shared._SERVER_SLEEPING, "reply_signal": shared._REPLY_SIGNAL,
                 "runner_sleeping": shared._RUNNER_SLEEPING}
        self.assertEqual({n: o for n, o in offsets.items() if n in words},
                         {n: 4 * w for n, w in words.items()})
        self.assertEqual((offsets["request_offset"], offsets["reply_capacity"]),
                         (8, 8 + 3 * 8))  # the four uint64s after magic and version
        self.assertEqual(shared._LAYOUT.size, 40)
        constants = dict(re.findall(r"inline constexpr \w+ (k\w+) = (0x[0-9A-Fa-f]+|\d+);",
                                    header))
        self.assertEqual((int(constants["kMagic"], 0), int(constants["kLayoutVersion"]),
                          int(constants["kHeaderBytes"])),
                         (shared.MAGIC, shared.LAYOUT_VERSION, shared.HEADER_BYTES))
        self.assertEqual(shared.MAGIC.to_bytes(4, "little"), b"KVDR")


class UnixSocketTest(unittest.TestCase):
    """The Python client reaches a kvrecalld listening on a Unix domain socket."""

    def test_decode_over_a_unix_socket_matches_full_attention(self):
        binary = os.environ.get("KVRECALLD", os.path.join(SOURCE_DIR, "build", "server", "kvrecalld"))
        with tempfile.TemporaryDirectory(prefix="kvrecall-py-") as d:
            address = f"unix:{d}/kvrecalld.sock"
            log = tempfile.TemporaryFile()
            server = subprocess.Popen([binary, f"--address={address}",
                                       "--metrics_address=127.0.0.1:0"], stdout=log,
                                      stderr=subprocess.STDOUT)
            try:
                with kvrecall.Client(address, wait_ready_s=30) as c:
                    decode_one_step_checked(self, c)
            finally:
                server.terminate()
                server.wait(timeout=20)
                log.seek(0)
                output = log.read().decode(errors="replace")
                log.close()
            self.assertIn(f"kvrecalld listening on {address}", output)
            self.assertEqual(server.returncode, 0, output)



class TokenOverPlaintextSocketTest(unittest.TestCase):
    """kvrecalld --plaintext_unix_sockets with TLS and tokens (the chart's co-located runner): a
    token alone to the unix:PATH socket travels over gRPC's local credentials with access-token
    call credentials (it implied TLS, whose handshake the plaintext socket fails), while to
    HOST:PORT a token still means TLS; the tools read $KVRECALL_TOKEN_FILE."""

    @classmethod
    def setUpClass(cls):
        from auth_pki import make_pki
        cls.dir = tempfile.TemporaryDirectory(prefix="kvrecall-py-token-")
        cls.pki = make_pki(cls.dir.name)
        cls.socket = f"unix:{cls.dir.name}/kvrecall.sock"
        cls.server = Kvrecalld(f"--address=127.0.0.1:0,{cls.socket}",
                               f"--tls_cert={cls.pki['server.pem']}",
                               f"--tls_key={cls.pki['server.key']}",
                               f"--auth_token_file={cls.pki['tokens']}", "--plaintext_unix_sockets")
        cls.tcp = cls.server.address

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.dir.cleanup()

    def set_token_file_variable(self, path):
        """$KVRECALL_TOKEN_FILE for the rest of the test (None: unset)."""
        os.environ.pop("KVRECALL_TOKEN_FILE", None)
        if path is not None:
            os.environ["KVRECALL_TOKEN_FILE"] = path
        self.addCleanup(os.environ.pop, "KVRECALL_TOKEN_FILE", None)

    def test_a_token_alone_goes_only_to_a_socket_of_this_users(self):
        # Local credentials authenticate no server (review 4): the token would go to whatever
        # listens at the path. Refused, before a channel is made, for a path that is no socket
        # (a link to the real one) and, as root here, for a socket another user owns.
        from auth_pki import ALICE_TOKEN
        path = self.socket[len("unix:"):]
        link = f"{self.dir.name}/link.sock"
        if not os.path.islink(link):
            os.symlink(path, link)
        prefix = "a bearer token goes in plaintext only to a Unix socket of this user's: "
        for target, why in ((f"unix:{self.dir.name}/absent.sock",
                             "cannot be read (No such file or directory)"),
                            (f"unix:{link}", "is not a socket")):
            with self.assertRaisesRegex(ValueError, "^" + re.escape(prefix + target[5:] + " " + why)):
                kvrecall.Client(target, token=ALICE_TOKEN)
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534)
            try:
                with self.assertRaisesRegex(ValueError, re.escape(
                        f"{path} belongs to uid 65534, this process is uid 0")):
                    kvrecall.Client(self.socket, token=ALICE_TOKEN)
            finally:
                os.chown(path, 0, 0)
        with kvrecall.Client(self.socket, token=ALICE_TOKEN, wait_ready_s=30) as c:
            self.assertIsInstance(c.list_sessions(), list)

    @unittest.skipUnless(os.path.exists(os.path.join(MODELS_DIR, "tinylm-a.npz")),
                         f"no tinylm-a.npz in {MODELS_DIR}")
    def test_evaluate_passes_its_connection_flags_to_each_run(self):
        # Probe 25, 3: `evaluate run` took --server alone, so it could not reach a server with
        # TLS of a private CA (nor send a token but through $KVRECALL_TOKEN_FILE).
        from auth_pki import ALICE_TOKEN
        self.set_token_file_variable(None)
        token_file = os.path.join(self.dir.name, "alice.token")
        with open(token_file, "w") as f:
            f.write(ALICE_TOKEN + "\n")
        jsonl = os.path.join(self.dir.name, "evaluate.jsonl")
        base = ["run", "--server", self.tcp, "--model", os.path.join(MODELS_DIR, "tinylm-a.npz"),
                "--text", MODELS_DIR, "--ctx", "96", "--suffix", "4", "--runs", "full",
                "--jsonl", jsonl]
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(evaluate.main(base + ["--tls-ca", self.pki["ca.pem"],
                                                   "--token-file", token_file]), 0)
            self.assertEqual(evaluate.main(base + ["--token-file", token_file]), 1)
        with open(jsonl) as f:
            trusted, untrusted = [json.loads(line) for line in f]
        self.assertGreater(trusted["bits_per_byte"], 0)
        self.assertIn("--tls-ca", trusted["command"])
        self.assertNotIn("error", trusted)
        self.assertIn("UNAVAILABLE", untrusted["error"])  # the private CA is not the system's

    def test_a_token_alone_goes_over_the_plaintext_socket(self):
        from auth_pki import ALICE_TOKEN, BOB_TOKEN
        Tls = kvrecall.Tls  # exported by the package, as the READMEs write it (probe 25, 9)
        with kvrecall.Client(self.socket, token=ALICE_TOKEN, wait_ready_s=30) as c:
            s = decode_one_step_checked(self, c, label="over the socket")
            # The session is alice's over the TLS port too, and not bob's.
            with kvrecall.Client(self.tcp, tls=Tls(ca=self.pki["ca.pem"]), token=ALICE_TOKEN,
                                 wait_ready_s=30) as over_tls:
                self.assertEqual([i.session_id for i in over_tls.list_sessions()], [s.id])
            with kvrecall.Client(self.socket, token=BOB_TOKEN, wait_ready_s=30) as bob:
                self.assertEqual(bob.list_sessions(), [])
            s.close()

    def test_without_a_token_or_with_a_wrong_one_the_socket_answers_unauthenticated(self):
        from auth_pki import ALICE_TOKEN
        for token, message in ((None, "this server requires a bearer token"),
                               ("not-a-token-of-this-server", "unknown bearer token"),
                               (ALICE_TOKEN[:20], "unknown bearer token")):
            with self.subTest(token=token), \
                    kvrecall.Client(self.socket, token=token, wait_ready_s=30) as c:
                with self.assertRaises(kvrecall.KvRecallError) as e:
                    c.list_sessions()
                self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
                self.assertIn(message, e.exception.message)

    def test_a_token_alone_to_host_port_still_goes_over_tls(self):
        from auth_pki import ALICE_TOKEN
        from kvrecall.client import Tls
        # TLS with the system's roots, which do not trust the suite's CA: no answer.
        with self.assertRaises(kvrecall.KvRecallError) as e:
            kvrecall.Client(self.tcp, token=ALICE_TOKEN, wait_ready_s=2)
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("the TLS handshake failed", e.exception.message)
        with kvrecall.Client(self.tcp, tls=Tls(ca=self.pki["ca.pem"]), token=ALICE_TOKEN,
                             wait_ready_s=30) as c:
            c.list_sessions()
        # What such a client sends a plaintext listener: a TLS ClientHello, never HTTP/2's
        # plaintext preface with the token in a header.
        received = []
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            listener.settimeout(20)

            def record():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.settimeout(10)
                    data = b""
                    try:
                        while chunk := conn.recv(4096):
                            data += chunk
                    except OSError:
                        pass
                    received.append(data)
            thread = threading.Thread(target=record)
            thread.start()
            with self.assertRaises(kvrecall.KvRecallError):
                kvrecall.Client(f"127.0.0.1:{listener.getsockname()[1]}", token=ALICE_TOKEN,
                                wait_ready_s=2)
            thread.join()
        self.assertEqual(len(received), 1)
        self.assertEqual(received[0][:2], b"\x16\x03")  # a TLS handshake record
        self.assertNotIn(ALICE_TOKEN.encode(), received[0])

    def test_a_token_alone_to_an_abstract_socket_is_refused(self):
        from auth_pki import ALICE_TOKEN
        from kvrecall.client import Tls
        target = f"unix-abstract:kvrecall-py-token-{os.getpid()}"
        with self.assertRaisesRegex(ValueError,
                                    f"^a bearer token to {target} without TLS: an abstract "
                                    "socket has no file permissions"):
            kvrecall.Client(target, token=ALICE_TOKEN, wait_ready_s=0)
        # With TLS asked for, or without a token, the channel is made (nothing connects here).
        kvrecall.Client(target, tls=Tls(ca=self.pki["ca.pem"]), token=ALICE_TOKEN,
                        wait_ready_s=0).close()
        kvrecall.Client(target, tls=True, token=ALICE_TOKEN, wait_ready_s=0).close()
        kvrecall.Client(target, wait_ready_s=0).close()

    def test_a_token_or_pem_file_the_channel_cannot_use_is_refused_at_once(self):
        # A newline or a non-ASCII character failed every call as UNAVAILABLE "Illegal
        # metadata", a code a runner retries (probe 20, 11); a key given as the CA failed as a
        # server that never answered.
        from auth_pki import ALICE_TOKEN
        from kvrecall.client import Tls
        for token, message in ((ALICE_TOKEN + "\n", f"character {len(ALICE_TOKEN) + 1} of "),
                               ("tok\u00e9-0123456789abcdef", "character 4 of "),
                               ("two words", "character 4 of 9 is not printable ASCII"),
                               ("", "token is empty"), (b"bytes", "token must be a str")):
            with self.subTest(token=token), self.assertRaisesRegex(ValueError, re.escape(message)):
                kvrecall.Client(self.tcp, tls=Tls(ca=self.pki["ca.pem"]), token=token,
                                wait_ready_s=0)
        key = self.pki["server.key"]
        with self.assertRaisesRegex(ValueError, re.escape(
                f"Tls.ca: {key} holds no PEM CERTIFICATE block")):
            kvrecall.Client(self.tcp, tls=Tls(ca=key), wait_ready_s=0)
        with self.assertRaisesRegex(ValueError, re.escape(
                f"Tls.key: {self.pki['client.pem']} holds no PEM PRIVATE KEY block")):
            kvrecall.Client(self.tcp, tls=Tls(ca=self.pki["ca.pem"], cert=self.pki["client.pem"],
                                              key=self.pki["client.pem"]), wait_ready_s=0)

    def test_the_tools_read_the_token_file_the_variable_names(self):
        import argparse
        from auth_pki import ALICE_TOKEN, BOB_TOKEN
        from kvrecall.client import add_connection_arguments, connection_from_args

        def parse(*argv):
            ap = argparse.ArgumentParser()
            add_connection_arguments(ap)
            return connection_from_args(ap.parse_args(list(argv)))

        self.set_token_file_variable(None)
        self.assertIsNone(parse()["token"])
        self.set_token_file_variable(self.pki["alice.token"])  # what the chart's runner gets
        self.assertEqual((parse()["token"], parse()["tls"]), (ALICE_TOKEN, None))
        self.assertEqual(parse("--token-file", self.pki["bob.token"])["token"], BOB_TOKEN)
        self.assertIsNone(parse("--token-file", "")["token"])  # none, whatever the variable says
        empty, blank = os.path.join(self.dir.name, "empty"), os.path.join(self.dir.name, "blank")
        with open(empty, "w"), open(blank, "w") as f:
            f.write("\n" + ALICE_TOKEN + "\n")
        missing = os.path.join(self.dir.name, "absent.token")
        for argv, variable, message in (
                ((), missing, f"$KVRECALL_TOKEN_FILE: cannot read {missing}: No such file or "
                              "directory"),
                ((), empty, f"$KVRECALL_TOKEN_FILE: {empty} is empty (its first line should be "
                            "the bearer token)"),
                (("--token-file", blank), self.pki["alice.token"],
                 f"--token-file: {blank} starts with an empty line"),
                (("--token-file", missing), None, f"--token-file: cannot read {missing}")):
            with self.subTest(argv=argv, variable=variable):
                self.set_token_file_variable(variable)
                with self.assertRaisesRegex(ValueError, "^" + re.escape(message)):
                    parse(*argv)

        # A client from the flags, and a tool, reach the plaintext socket with the variable's
        # token; without it the tool's run is UNAUTHENTICATED.
        self.set_token_file_variable(self.pki["alice.token"])
        with kvrecall.Client(self.socket, wait_ready_s=30, **parse()) as c:
            c.list_sessions()
        rng = np.random.default_rng(5)
        trace = os.path.join(self.dir.name, "needles.safetensors")
        write_safetensors(trace, {f"layer0.{part}.{x}": rng.standard_normal((n, h, 8))
                                  for part, n in (("prefill", 16), ("decode", 3))
                                  for x, h in (("q", 2), ("k", 1), ("v", 1))},
                          {"layers": "1", "needles": '[{"decode_step": 1, "position": 5}]'})
        for variable, rc in ((self.pki["alice.token"], 0), (None, 1)):
            with self.subTest(variable=variable):
                self.set_token_file_variable(variable)
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    got = needles.main(["--server", self.socket, "--trace", trace,
                                        "--runs", "full"])
                self.assertEqual(got, rc, out.getvalue())
                r = json.loads(out.getvalue())
                if rc == 0:
                    self.assertEqual((r["run"], r["needles"]), ("full", 1))
                else:
                    self.assertIn("UNAUTHENTICATED: this server requires a bearer token",
                                  r["error"])

if __name__ == "__main__":
    unittest.main(verbosity=2)
