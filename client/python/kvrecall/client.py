"""Client of the kvrecall.v1 service for model runners: sessions, chunked prefill and decode
steps over one long-lived bidirectional Decode stream, batching several sequences per step.

Shapes (row-major, as in the .proto): prompt q [T, q_heads, head_dim], prompt k/v
[T, kv_heads, head_dim]; a decode step's q [q_heads, head_dim], k_new/v_new
[kv_heads, head_dim]; its output [q_heads, head_dim] and lse [q_heads]. Arrays are numpy arrays
or torch tensors; outputs are float32 numpy arrays. Every failed call raises KvRecallError with
the gRPC status code and message (FAILED_PRECONDITION for a call through a closed Client).
Arguments the client can check itself (a layer index, tensor shapes, chunk_tokens) raise
ValueError naming the argument before anything is sent.

    with Client("127.0.0.1:50051") as c:
        s = c.create_session(make_geometry(6, 8, 2, 64), make_policy("retopk", top_k=512))
        s.prefill([(q0, k0, v0), (q1, k1, v1), ...])          # one (q, k, v) per layer
        out = s.attend(layer, q, k_new, v_new).output         # [q_heads, head_dim]
        outs = c.attend_batch(layer, [(s1, q1, k1, v1), (s2, q2, k2, v2)])
"""
import argparse
import dataclasses
import math
import numbers
import operator
import os
import queue
import stat
import sys
import threading
import time
import weakref

import grpc
import numpy as np

from kvrecall import tensors
from kvrecall.v1 import kvrecall_pb2 as pb
from kvrecall.v1 import kvrecall_pb2_grpc as pb_grpc

SELECTORS = {"full": pb.SELECTOR_FULL, "exact_topk": pb.SELECTOR_EXACT_TOPK,
             "streaming": pb.SELECTOR_STREAMING, "index": pb.SELECTOR_INDEX,
             "retopk": pb.SELECTOR_RETOPK}
PLACEMENTS = {"cpu": pb.PLACEMENT_CPU, "gpu": pb.PLACEMENT_GPU, "tiered": pb.PLACEMENT_TIERED}
EXACT_SEARCHES = {"graph": pb.EXACT_SEARCH_GRAPH, "shortlist": pb.EXACT_SEARCH_SHORTLIST}
PATH_NAMES = {pb.PATH_EXACT: "exact", pb.PATH_REUSE: "reuse", pb.PATH_FALLBACK: "fallback",
              pb.PATH_REFRESH: "refresh"}


class KvRecallError(Exception):
    """A failed kvrecall call: `code` is the grpc.StatusCode, `message` the server's text."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, e):
        return cls(e.code(), e.details())


class _StreamEndedBeforeSend(KvRecallError):
    """A step refused before anything of it was sent: its stream had ended (another thread's
    failed step, or close())."""


def make_geometry(layers, q_heads, kv_heads, head_dim, dtype="f32", softmax_scale=0.0):
    return pb.Geometry(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                       dtype=tensors.dtype_of(dtype), softmax_scale=softmax_scale)


def make_policy(selector="full", placement="cpu", top_k=0, sinks=None, recent=None, retopk=None,
                index=None):
    """A pb.Policy from names ('full' | 'exact_topk' | 'streaming' | 'index' | 'retopk';
    'cpu' | 'gpu' | 'tiered'); `retopk` and `index` are dicts of ReTopKParams / IndexParams
    fields (index's exact_search by name too: 'graph' | 'shortlist'). A zero top_k, and the
    knobs left out, ask for the server's defaults; sinks and recent (and retopk's optional
    fields) left as None do, and 0 asks for none."""
    try:
        sel, place = SELECTORS[selector], PLACEMENTS[placement]
    except KeyError as e:
        raise ValueError(f"unknown selector or placement {e.args[0]!r}; selectors: "
                         f"{sorted(SELECTORS)}, placements: {sorted(PLACEMENTS)}") from None
    p = pb.Policy(placement=place, selector=sel, top_k=top_k)
    if sinks is not None:
        p.sinks = sinks
    if recent is not None:
        p.recent = recent
    if retopk:
        p.retopk.CopyFrom(pb.ReTopKParams(**retopk))
    if index:
        search = index.get("exact_search")
        if search in EXACT_SEARCHES:
            index = {**index, "exact_search": EXACT_SEARCHES[search]}
        p.index.CopyFrom(pb.IndexParams(**index))
    return p


STREAMING_SINKS = 128


def streaming_window(k):
    """(sinks, recent) of the streaming policy that the tools' run spec `streaming:K` names:
    STREAMING_SINKS sinks and K - STREAMING_SINKS recent tokens, so that its budget equals the
    top-K selectors' (K = STREAMING_SINKS: the sinks alone; make_policy sends recent 0 as set,
    not as "the server's default"). ValueError unless K >= STREAMING_SINKS."""
    if k < STREAMING_SINKS:
        raise ValueError(f"streaming:K needs K >= {STREAMING_SINKS} (it keeps {STREAMING_SINKS} "
                         f"sinks and K-{STREAMING_SINKS} recent tokens), got {k}")
    return STREAMING_SINKS, k - STREAMING_SINKS


@dataclasses.dataclass
class SequenceResult:
    """One sequence's answer to one decode step of one layer."""
    session_id: str
    output: np.ndarray        # [q_heads, head_dim], float32, read-only (copy it to write)
    lse: np.ndarray | None    # [q_heads], when return_lse
    heads: list               # pb.HeadDiagnostics per query head, when diagnostics/compare_exact
    position: int             # position of the token just appended in this layer


class _StepWire:
    """One session's SequenceStep on the wire, as the serialized bytes around its q, k_new and
    v_new data: protobuf serializes the fields (and the DecodeRequest.steps framing) once, with
    placeholder data of the geometry's size; a step then joins those pieces with the three
    tensors' bytes (tensors.WireBuffer), so the data is copied once, into the request bytes."""

    def __init__(self, session):
        g = session.geometry
        self.buffers = [tensors.WireBuffer(g.dtype, (g.q_heads, g.head_dim)),
                        tensors.WireBuffer(g.dtype, (g.kv_heads, g.head_dim)),
                        tensors.WireBuffer(g.dtype, (g.kv_heads, g.head_dim))]
        placeholders = {name: pb.Tensor(dtype=g.dtype, shape=b.shape, data=bytes(b.nbytes))
                        for name, b in zip(("q", "k_new", "v_new"), self.buffers)}
        parts = [pb.SequenceStep(session_id=session.id).SerializeToString()] + [
            pb.SequenceStep(**{name: t}).SerializeToString() for name, t in placeholders.items()]
        step = pb.SequenceStep(session_id=session.id, **placeholders)
        # Known fields serialize in field-number order, so the whole step is its fields' parts
        # in a row; each part ends with its tensor's data (Tensor.data is its last field set).
        if b"".join(parts) != step.SerializeToString():
            raise RuntimeError("protobuf serialized a SequenceStep out of field order")
        framed = pb.DecodeRequest(steps=[step]).SerializeToString()
        self._length = len(b"".join(parts))  # the step's bytes without a position
        frame = framed[:len(framed) - self._length]
        if frame != _STEP_TAG + _varint(self._length):
            raise RuntimeError("protobuf framed DecodeRequest.steps unlike field 3 of a message")
        cut = [len(p) - b.nbytes for p, b in zip(parts[1:], self.buffers)]
        self._first = parts[0] + parts[1][:cut[0]]  # the first head without its frame
        self.heads = [frame + self._first, parts[2][:cut[1]], parts[3][:cut[2]]]
        # float32 numpy inputs of a bf16 session are rounded in one pass over the three tensors
        # (a handful of numpy calls a step instead of a handful per tensor).
        self._batch = None
        if g.dtype == pb.DTYPE_BF16:
            ends = np.cumsum([0] + [b.count for b in self.buffers])
            f32, bits = np.empty(ends[-1], np.float32), np.empty(ends[-1], np.uint16)
            self._batch = (f32, bits, np.empty((2, ends[-1]), np.uint32),
                           [f32[a:e].reshape(b.shape) for a, e, b in zip(ends, ends[1:], self.buffers)],
                           [bits[a:e].reshape(b.shape) for a, e, b in zip(ends, ends[1:], self.buffers)])

    def append(self, pieces, q, k, v, position=None):
        """Appends the step's pieces to `pieces`; the views stay valid until the next append.
        `position` (SequenceStep.position, after the tensors: protobuf parses fields in any
        order) must have passed _check_position."""
        xs = (q, k, v)
        if (self._batch is not None and "torch" not in sys.modules
                and all(type(x) is np.ndarray and x.dtype == np.float32 for x in xs)):
            f32, bits, scratch, f32_parts, bits_parts = self._batch
            for buffer, part, x in zip(self.buffers, f32_parts, xs):
                buffer.check_fits(x)
                np.copyto(part, x.reshape(part.shape))
            tensors.f32_to_bf16_bits(f32, out=bits, scratch=scratch)
            views = bits_parts
        else:
            views = [buffer.view(x) for buffer, x in zip(self.buffers, xs)]
        heads = self.heads
        if position is not None:
            tail = _POSITION_TAG + _varint(position)
            heads = [_STEP_TAG + _varint(self._length + len(tail)) + self._first, *heads[1:]]
        for head, view in zip(heads, views):
            pieces.append(head)
            pieces.append(view)
        if position is not None:
            pieces.append(tail)


def _varint(n):
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# The tags of DecodeRequest.steps (field 3, length-delimited) and SequenceStep.position (field 5,
# a varint).
_STEP_TAG, _POSITION_TAG = b"\x1a", b"\x28"

# DecodeRequest's flags (fields 4, 5, 6: return_lse, diagnostics, compare_exact), serialized.
_FLAGS = {flags: b"".join(tag for tag, on in zip((b"\x20\x01", b"\x28\x01", b"\x30\x01"), flags) if on)
          for flags in [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]}


def _int_below(name, value, bound, bound_text):
    """`value` as an int; ValueError naming `name` unless it is an integer in [0, bound) (not a
    bool: True would be 1)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} "
                         f"{value!r}") from None
    if not 0 <= value < bound:
        raise ValueError(f"{name} must be in [0, {bound_text}), got {value}")
    return value


def _check_layer(layer):
    """`layer` as an int; ValueError unless it is an integer in [0, 2^31) (DecodeRequest.layer
    is an int32: the server reads the low 32 bits of a larger varint, so layer 2^32 + 5 would
    be layer 5; a negative layer is no session's)."""
    return _int_below("layer", layer, 1 << 31, "2^31")


def _check_position(position):
    """A step's `position` (None: the token goes at the end) as an int; ValueError unless None
    or an integer in [0, 2^63) (SequenceStep.position is an int64; the server refuses a negative
    one)."""
    return None if position is None else _int_below("position", position, 1 << 63, "2^63")


def _step_parts(step):
    """(session, q, k_new, v_new, position) of a step given as (session, q, k_new, v_new) or
    (session, q, k_new, v_new, position); ValueError otherwise."""
    if not isinstance(step, (tuple, list)) or len(step) not in (4, 5):
        raise ValueError("a step is (session, q, k_new, v_new) or (session, q, k_new, v_new, "
                         f"position), got {type(step).__name__} of "
                         f"{len(step) if isinstance(step, (tuple, list)) else 'no'} items")
    session, q, k, v, *position = step
    return session, q, k, v, _check_position(position[0] if position else None)


# The longest finite timeout: about 31 years (gRPC's deadlines fail at once past ~5e9 s).
_MAX_TIMEOUT_S = 1e9


def _check_timeout(name, value):
    """None for None or inf (no limit), else `value` in seconds; ValueError unless it is a
    positive number, finite ones at most _MAX_TIMEOUT_S."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 or \
            (value > _MAX_TIMEOUT_S and not math.isinf(value)):
        raise ValueError(f"{name} must be None or a positive number of seconds (at most "
                         f"{_MAX_TIMEOUT_S:g}; inf: no limit), got {value!r}")
    return None if math.isinf(value) else float(value)  # numpy scalars too


class _StepTimer:
    """Cancels a stream's call when an exchange outlasts `timeout_s`: a daemon thread that
    sleeps until the armed exchange's deadline, or for one timeout while none is armed (one
    armed meanwhile has a later deadline than that wake-up), so that arming costs a lock and
    no wake-up: a stream stepping without pause wakes it about once per timeout. It holds the
    stream weakly and ends with it (or at stop())."""

    def __init__(self, timeout_s, stream):
        self.timeout_s = timeout_s
        self._stream = weakref.ref(stream)
        self._lock = threading.Lock()
        self._deadline = None  # the armed exchange's, time.monotonic()
        self._fired = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="kvrecall-step-timer", daemon=True).start()

    def arm(self):
        with self._lock:
            self._fired = False
            self._deadline = time.monotonic() + self.timeout_s

    def disarm(self):
        """Ends the watch; whether it cancelled the exchange (no cancellation comes after)."""
        with self._lock:
            self._deadline = None
            return self._fired

    def stop(self):
        self._stop.set()

    def _run(self):
        while True:
            with self._lock:
                deadline = None if self._fired else self._deadline
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._fired = True
                    deadline = None
                    stream = self._stream()
                    if stream is not None:
                        stream._cancel_call()  # under the lock: disarm waits for it
                    del stream
            if self._stream() is None:
                return
            wait = self.timeout_s if deadline is None else deadline - now
            if self._stop.wait(min(wait, threading.TIMEOUT_MAX)):
                return


# What a step broken off by its timeout or by cancel() may have done, and what to do next.
_ABANDONED_STEP = ("A step the server had not begun when the cancellation reached it is not "
                   "applied; one it had begun, or read before (a stalled server), may be: "
                   "resend it with its position (ABORTED: it was applied). The next step goes "
                   "on a new stream")


def _request_head(request_id, layer, return_lse, diagnostics, compare_exact, max_reply_bytes=0):
    """A DecodeRequest's fields but its steps, serialized by hand (no message built per step);
    protobuf parses fields in any order, so the steps may follow. ValueError for a layer
    outside [0, 2^31) (_check_layer)."""
    layer = _check_layer(layer)
    head = b"\x08" + _varint(request_id) if request_id else b""
    if layer:
        head += b"\x10" + _varint(layer)
    if max_reply_bytes:
        head += b"\x38" + _varint(max_reply_bytes)  # field 7
    return head + _FLAGS[(bool(return_lse), bool(diagnostics), bool(compare_exact))]


class _LayerStepStream:
    """What DecodeStream and SharedDecodeStream (kvrecall.shared) share: a layer-step's request
    built from _request_head and the sessions' _StepWire pieces, one request in flight under a
    lock, and the reply checked and converted. A subclass sets up _lock, _next_id, broken and
    the last_* timings, and implements _exchange(pieces) -> pb.DecodeResponse (marking the
    stream broken when the server ended it) and _break(cancel) (marks it broken and lets go of
    what it holds; `cancel` also cancels a call the server still serves) and _cancel_call()
    (cancels the call from any thread, leaving the rest to the stepping thread); it calls
    _start_timer(step_timeout_s) once set up."""

    def _start_timer(self, step_timeout_s):
        self._cancelled = False
        self._timer = None
        if step_timeout_s is not None:
            self._timer = _StepTimer(step_timeout_s, self)

    def cancel(self):
        """Abandons the stream, from any thread: a step in flight (or the stream's opening or
        close) raises KvRecallError CANCELLED (whatever the server does with the step:
        _ABANDONED_STEP); Client opens a new stream for the next step."""
        self._cancelled = True
        self.broken = True
        self._cancel_call()

    def _stop_timer(self):
        if self._timer is not None:
            self._timer.stop()

    def _release(self):
        """Lets go of what a broken stream holds (its timer, a region): Client replaces it."""
        with self._lock:
            self._break()

    def __del__(self):
        # A stream dropped unclosed (a Client dropped without close()) ends its call, so that
        # gRPC's request-iterator thread and a region's mapping go with it.
        try:
            self._break(cancel=True)
        except Exception:  # half-made (its __init__ failed), or the interpreter is exiting
            pass

    def _watched(self, what, body, carries_step=True):
        """body() (an exchange: a step, the opening or the close) under the step timer's watch
        and cancel()'s reach: the failure either left (CANCELLED, or anything but a sent step's
        own answer) is restated (DEADLINE_EXCEEDED for the timer) naming `what`, with what
        became of the step when `carries_step`; an answer that came all the same is kept, the
        stream broken."""
        timer = self._timer
        if timer is not None:
            timer.arm()
        try:
            result = body()
        except KvRecallError as e:
            timed_out = timer is not None and timer.disarm()
            # A step's own answer (ABORTED: a resent step was applied) is kept; any other
            # failure is the cancellation's.
            if (timed_out or self._cancelled) and \
                    (e.code == grpc.StatusCode.CANCELLED or not carries_step):
                why = (f"no answer within step_timeout_s={timer.timeout_s:g}" if timed_out
                       else "cancelled by cancel()")
                message = f"{what}: {why}; the stream was cancelled ({e.message})."
                raise KvRecallError(grpc.StatusCode.DEADLINE_EXCEEDED if timed_out
                                    else grpc.StatusCode.CANCELLED,
                                    message + (" " + _ABANDONED_STEP if carries_step else "")
                                    ) from None
            raise
        except BaseException:
            if timer is not None:
                timer.disarm()
            raise
        if (timer is not None and timer.disarm()) or self._cancelled:
            self._break()  # the answer came before the cancellation; the call is over
        return result

    def step(self, layer, steps, return_lse=False, diagnostics=False, compare_exact=False):
        """Sends one layer of one decode step for several sequences.

        steps: [(session, q, k_new, v_new), ...]; returns one SequenceResult per step, in order.
        A step may add the position its token must take in the layer, (session, q, k_new, v_new,
        position): a layer holding another number of tokens refuses the request (ABORTED,
        nothing of it applied), so a step resent after a lost reply is not appended twice.
        ValueError (nothing sent) for a layer outside [0, 2^31), a tensor of the wrong shape or
        a position that is not an integer in [0, 2^63).
        """
        _check_layer(layer)
        steps = [_step_parts(step) for step in steps]
        with self._lock:
            if self.broken:
                self._break()  # cancel() from another thread leaves this to the stepper
                raise _StreamEndedBeforeSend(grpc.StatusCode.FAILED_PRECONDITION,
                                             "decode stream is closed")
            request_id = self._next_id
            pieces = [_request_head(request_id, layer, return_lse, diagnostics, compare_exact,
                                    self._max_reply_bytes)]
            for session, q, k, v, position in steps:
                session.step_wire().append(pieces, q, k, v, position)
            self._next_id += 1
            resp = self._watched("decode step", lambda: self._exchange(pieces))
        if resp.request_id != request_id or len(resp.results) != len(steps):
            self._break(cancel=True)  # the server still serves a call we no longer trust
            raise KvRecallError(grpc.StatusCode.INTERNAL,
                                f"reply {resp.request_id} with {len(resp.results)} results "
                                f"to request {request_id} with {len(steps)} steps")
        self.last_server_micros = resp.server_micros
        self.last_tier_micros = resp.tier_micros if resp.HasField("tier_micros") else None
        return [SequenceResult(r.session_id, tensors.from_tensor(r.output),
                               tensors.from_tensor(r.lse) if r.HasField("lse") else None,
                               list(r.heads), r.position) for r in resp.results]


class DecodeStream(_LayerStepStream):
    """One Decode call kept open: requests go through a queue that the call's request iterator
    drains, replies are read in lock step. Requests travel pre-serialized (_StepWire), replies
    are parsed by protobuf. After an error the stream is `broken` (the server ended the call)
    and Client opens a new one for the next step.

    gRPC drains the request iterator on a thread of its own, blocked in the queue's get() until
    a request or the None that ends the iterator arrives; the call's end does not wake it. So
    every way the stream ends puts None (_break, close), or each failed step would leave one
    thread behind for good."""

    _METHOD = "/{}/Decode".format(pb.DESCRIPTOR.services_by_name["KvRecall"].full_name)

    def __init__(self, channel, max_reply_bytes=0, step_timeout_s=None):
        """max_reply_bytes: the channel's receive limit, told to the server with every request
        (DecodeRequest.max_reply_bytes: a step whose reply could not arrive is refused before
        it is applied); 0: the server's limit alone. step_timeout_s: the longest a step waits
        for its reply, past which the stream is cancelled and the step raises
        DEADLINE_EXCEEDED (_ABANDONED_STEP); None: no limit (costs no thread)."""
        step_timeout_s = _check_timeout("step_timeout_s", step_timeout_s)
        self._max_reply_bytes = max_reply_bytes
        self._requests = queue.SimpleQueue()  # C-level put and get: a cheaper wake-up
        decode = channel.stream_stream(self._METHOD, request_serializer=None,
                                       response_deserializer=pb.DecodeResponse.FromString)
        self._responses = decode(iter(self._requests.get, None))
        self._lock = threading.Lock()
        self._next_id = 1
        self.broken = False
        self.last_server_micros = 0.0
        # The last reply's tier_micros (static_set, bulk, link_wait) for a tiered request; None
        # for the other placements, whose replies carry none.
        self.last_tier_micros = None
        self._start_timer(step_timeout_s)

    def _exchange(self, pieces):
        self._requests.put(b"".join(pieces))
        try:
            return next(self._responses)
        except grpc.RpcError as e:
            self._break()
            raise KvRecallError.from_rpc_error(e) from None
        except StopIteration:
            self._break()
            raise KvRecallError(grpc.StatusCode.UNKNOWN,
                                "decode stream ended without a reply") from None
        except BaseException:  # KeyboardInterrupt in the wait: the request may still be read
            self._break(cancel=True)
            raise

    def _break(self, cancel=False):
        """Marks the stream broken and ends the request iterator (its thread exits); `cancel`
        also cancels the call (nothing when it has ended)."""
        self.broken = True
        if cancel:
            self._responses.cancel()
        self._requests.put(None)
        self._stop_timer()

    def _cancel_call(self):
        self._responses.cancel()
        self._requests.put(None)  # the request iterator's thread would wait for it for good

    def close(self):
        """Half-closes the call and waits for the server to end it, within step_timeout_s
        (DEADLINE_EXCEEDED past it, the call cancelled)."""
        with self._lock:
            try:
                if self.broken:  # _break has ended the request iterator
                    return
                self.broken = True
                self._requests.put(None)
                self._watched("closing the decode stream", self._await_end, carries_step=False)
            except KvRecallError as e:
                if e.code != grpc.StatusCode.CANCELLED:  # the end of a cancelled stream
                    raise
            finally:
                self._stop_timer()

    def _await_end(self):
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as e:
            raise KvRecallError.from_rpc_error(e) from None


class Session:
    """One sequence's KV cache in the service. Create with Client.create_session."""

    def __init__(self, client, session_id, geometry, policy, prompt_queries=-1):
        self.client = client
        self.id = session_id
        self.geometry = geometry
        self.policy = policy  # the effective policy, defaults filled in by the server
        # The prompt's last tokens whose queries the server needs (CreateSessionResponse):
        # 0 none, -1 all; prefill sends q for those alone.
        self.prompt_queries = prompt_queries
        self._step_wire = None

    def step_wire(self):
        """This session's decode-step encoder (built on first use)."""
        if self._step_wire is None:
            self._step_wire = _StepWire(self)
        return self._step_wire

    def _check_layers(self, layers):
        """ValueError for a layer index outside the geometry or a q, k or v whose shape is not
        the geometry's (before the stream starts: an exception inside its request iterator
        reaches the caller as UNKNOWN "Exception iterating requests!", its message lost)."""
        g = self.geometry
        for layer, (q, k, v) in layers:
            try:
                if not 0 <= operator.index(layer) < g.layers:
                    raise TypeError
            except TypeError:
                raise ValueError(f"layers: layer {layer!r} is not in [0, {g.layers}) (the "
                                 "geometry's layers)") from None
            n = k.shape[0]
            if v.shape[0] != n or (q is not None and q.shape[0] != n) or \
                    (q is None and self.prompt_queries != 0):
                raise ValueError(f"layer {layer}: q, k and v have "
                                 f"{None if q is None else q.shape[0]}, {n} and {v.shape[0]} "
                                 "tokens (q may be None only for a session that needs none)")
            for name, x, heads in (("q", q, g.q_heads), ("k", k, g.kv_heads),
                                   ("v", v, g.kv_heads)):
                if x is not None and tuple(x.shape) != (n, heads, g.head_dim):
                    raise ValueError(f"layer {layer}: {name} has shape {list(x.shape)}, want "
                                     f"[{n}, {heads}, {g.head_dim}] ([tokens, "
                                     f"{'q_heads' if name == 'q' else 'kv_heads'}, head_dim])")

    def _queries_from(self, tokens):
        """The first of a layer's `tokens` prompt tokens whose query the session needs."""
        return 0 if self.prompt_queries < 0 else max(0, tokens - self.prompt_queries)

    def _chunks(self, layers, per_chunk):
        """The Prefill stream's chunks; per_chunk: [tokens a chunk without q, with q]."""
        g = self.geometry
        first = True
        for layer, (q, k, v) in layers:
            n = k.shape[0]
            # The tokens before the first needed query go in chunks of k and v alone (as many
            # tokens as the chunk limit holds without q), those from it on with q.
            queries_from = self._queries_from(n)
            off = 0
            while off < n:
                with_q = off >= queries_from
                e = min(n if with_q else queries_from, off + per_chunk[with_q])
                c = pb.PrefillChunk(session_id=self.id if first else "", layer=layer, offset=off)
                first = False
                if with_q:
                    tensors.to_tensor(q[off:e], g.dtype, (e - off, g.q_heads, g.head_dim),
                                      out=c.q)
                tensors.to_tensor(k[off:e], g.dtype, (e - off, g.kv_heads, g.head_dim), out=c.k)
                tensors.to_tensor(v[off:e], g.dtype, (e - off, g.kv_heads, g.head_dim), out=c.v)
                off = e
                yield c

    def prefill(self, layers, chunk_tokens=None, timeout_s=None):
        """Streams the prompt of several layers in one Prefill call, chunked under the message
        limit (or of `chunk_tokens` tokens), within `timeout_s` seconds as a whole (the commit's
        builds included; None: no limit; past it DEADLINE_EXCEEDED, and nothing is committed,
        but by a server that stalled with the whole call read, a stopped process that takes its
        deadline from when it wakes: it may commit the whole prompt, never part of it, and
        info().tokens or a retry, refused FAILED_PRECONDITION "already prefilled", tells).
        `layers`: a list of (q, k, v), one per layer from 0, or a dict {layer: (q, k, v)};
        q [T, q_heads, head_dim], k and v [T, kv_heads, head_dim].
        q goes with the tokens whose queries the session needs (prompt_queries) alone; it may be
        None when it needs none. Returns pb.PrefillResponse. ValueError (nothing sent) for a
        shape that is not the geometry's, a layer outside it, chunk_tokens not an int >= 1 or
        timeout_s not a positive number.
        """
        timeout_s = _check_timeout("timeout_s", timeout_s)
        items = sorted(layers.items()) if isinstance(layers, dict) else list(enumerate(layers))
        # Nested lists as decode takes them (an AttributeError here before: probe 28, 11).
        items = [(layer, tuple(tensors.as_array(x) for x in qkv)) for layer, qkv in items]
        self._check_layers(items)
        if self.geometry.dtype == pb.DTYPE_F16:
            # Here, where a value past f16's range can still be refused by name (decode's
            # check): what the chunks will send, q from the first needed query on.
            for layer, (q, k, v) in items:
                for name, x in (("q", None if q is None else q[self._queries_from(k.shape[0]):]),
                                ("k", k), ("v", v)):
                    if x is not None:
                        tensors.check_f16_range(x, f"layer {layer}: {name}")
        if chunk_tokens is not None:
            try:
                if isinstance(chunk_tokens, bool) or operator.index(chunk_tokens) < 1:
                    raise TypeError
            except TypeError:
                raise ValueError("chunk_tokens must be None or an integer >= 1, got "
                                 f"{chunk_tokens!r}") from None
            chunk_tokens = operator.index(chunk_tokens)
        self.client.check_open()
        if chunk_tokens is None:
            # Tokens per chunk without q and with it.
            g = self.geometry
            element = 4 if g.dtype == pb.DTYPE_F32 else 2
            per_chunk = [max(1, self.client.prefill_chunk_bytes //
                             ((heads + 2 * g.kv_heads) * g.head_dim * element))
                         for heads in (0, g.q_heads)]
        else:
            per_chunk = [chunk_tokens, chunk_tokens]
        try:
            return self.client.stub.Prefill(self._chunks(items, per_chunk), timeout=timeout_s)
        except grpc.RpcError as e:
            raise KvRecallError.from_rpc_error(e) from None

    def attend(self, layer, q, k_new, v_new, position=None, **options):
        """Attention of one decode step of one layer (options: return_lse, diagnostics,
        compare_exact); k_new/v_new are appended first. `position`, when given, is the position
        the token must take (the layer's length): otherwise the step is refused with ABORTED and
        appends nothing. Returns a SequenceResult."""
        return self.client.attend_batch(layer, [(self, q, k_new, v_new, position)],
                                        **options)[0]

    def info(self):
        return self.client.call("GetSession", pb.GetSessionRequest(session_id=self.id))

    def close(self):
        self.client.call("CloseSession", pb.CloseSessionRequest(session_id=self.id))


@dataclasses.dataclass
class Tls:
    """TLS for a channel to kvrecalld; paths name PEM files. `ca`: the roots that signed the
    server's certificate (None: the system's); `cert` and `key`: the client's certificate and
    key, for servers that require mutual TLS; `server_name`: the name checked against the
    server's certificate instead of the target's host."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


def _read_pem(path, what, kind):
    """The PEM file's bytes; it must hold a block of `kind` ("CERTIFICATE"; "PRIVATE KEY"
    matches "RSA PRIVATE KEY" too): a key given as the CA failed only as a server that never
    answered."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not a PEM file")
    if f" {kind}-----".encode() not in data:
        raise ValueError(f"{what}: {path} holds no PEM {kind} block")
    return data


def _check_token(token):
    """ValueError unless `token` can travel as an "authorization: Bearer" header: a str of
    printable ASCII without blanks, as kvrecalld's --auth_token_file lists them. A newline (a
    token file read whole) or a non-ASCII character failed every call as UNAVAILABLE "Illegal
    metadata", which a retry never mends."""
    if not isinstance(token, str):
        raise ValueError(f"token must be a str, got {type(token).__name__}")
    if not token:
        raise ValueError("token is empty (token=None sends none)")
    for i, c in enumerate(token):
        if not ("!" <= c <= "~"):
            raise ValueError(
                f"token: character {i + 1} of {len(token)} is not printable ASCII (a bearer "
                "token has no blanks or newlines: read_token_file takes a file's first line "
                "without them)")


def _channel_kind(target, tls, token):
    """How make_channel secures a channel to `target`: "plaintext", "local" (gRPC's local
    credentials on a Unix socket, carrying `token`) or "tls"; ValueError for a token alone to
    an abstract socket."""
    if tls is None and token is None:
        return "plaintext"
    if tls is None:  # a token alone: where it may go depends on the target
        if target.startswith("unix-abstract:"):
            raise ValueError(
                f"a bearer token to {target} without TLS: an abstract socket has no file "
                "permissions (any process of the network namespace may connect), so kvrecalld "
                "never serves one in plaintext; pass tls=, or connect to a unix:PATH socket")
        if target.startswith("unix:"):
            return "local"
    return "tls"


def _check_own_socket(target):
    """ValueError unless the Unix socket of `target` (unix:PATH, unix:///ABSOLUTE) is a socket,
    not a link, that this user owns: gRPC's local credentials authenticate no server, so a token
    alone would otherwise go in plaintext to whatever listens at the path (another user's process
    in a shared /tmp). kvrecalld makes its socket 0600, so a runner that may connect runs as its
    user. (Not the directory: a pod's emptyDir is 0777, shared by the pod's own containers.)"""
    path = target[len("unix:"):]
    if path.startswith("///"):
        path = path[2:]
    refuse = ("a bearer token goes in plaintext only to a Unix socket of this user's: {} {}; "
              "pass tls= to send it there")
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ValueError(refuse.format(path, f"cannot be read ({e.strerror})")) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(refuse.format(path, "is not a socket"))
    if st.st_uid != os.geteuid():
        raise ValueError(refuse.format(
            path, f"belongs to uid {st.st_uid}, this process is uid {os.geteuid()}"))


def check_server_address(target):
    """ValueError unless `target` can name a kvrecalld: HOST:PORT with a port in [1, 65535] (an
    IPv6 host in brackets; the port is always written, 443 behind an ingress included), or a target of one of gRPC's schemes (unix:PATH, unix-abstract:NAME,
    dns:, ipv4:, ipv6:, SCHEME://...), which its resolvers check. gRPC takes a port modulo 2^16
    and a missing one as 443: a typo reached another server. (kvrecall_client.h's
    CheckServerAddress.)"""
    if not isinstance(target, str):
        raise ValueError(f"server address must be a str, got {type(target).__name__}")
    if "://" in target or target.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return
    host, colon, port = target.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not colon or not host or bare_ipv6 or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"server address {target!r} must be HOST:PORT with a port in [1, 65535] (an IPv6 "
            "host in brackets: [::1]:50051), unix:PATH or unix-abstract:NAME (gRPC would take "
            "the port modulo 2^16, or 443 where none is given)")


def make_channel(target, options=(), tls=None, token=None):
    """A gRPC channel to `target`: plaintext, or TLS when `tls` is a Tls (or True: system roots),
    with a bearer `token` for servers started with --auth_token_file. A token alone (tls None)
    goes, by the target: to HOST:PORT over TLS with the system's roots (gRPC sends call
    credentials only over private channels: never in plaintext over TCP); to unix:PATH in
    plaintext, over gRPC's local credentials (which check that the connection is a Unix
    socket), for kvrecalld --plaintext_unix_sockets, when the socket is this user's
    (_check_own_socket); to unix-abstract:NAME nowhere (ValueError:
    such a socket has no file permissions, so kvrecalld serves it with TLS alone). ValueError
    also for unusable files."""
    check_server_address(target)
    if token is not None:
        _check_token(token)
    kind = _channel_kind(target, tls, token)
    if kind == "plaintext":
        return grpc.insecure_channel(target, options=list(options))
    if kind == "local":
        _check_own_socket(target)
        credentials = grpc.composite_channel_credentials(
            grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
            grpc.access_token_call_credentials(token))
        return grpc.secure_channel(target, credentials, options=list(options))
    tls = Tls() if tls in (None, True) else tls
    if (tls.cert is None) != (tls.key is None):
        raise ValueError("Tls.cert and Tls.key go together (a client certificate for mutual TLS)")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls.ca, "Tls.ca", "CERTIFICATE") if tls.ca else None,
        private_key=_read_pem(tls.key, "Tls.key", "PRIVATE KEY") if tls.key else None,
        certificate_chain=_read_pem(tls.cert, "Tls.cert", "CERTIFICATE") if tls.cert else None)
    if token is not None:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token))
    options = list(options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(target, credentials, options=options)


def read_token_file(path):
    """The bearer token in the file at `path`: its first line without the whitespace around it
    (a trailing newline, say), as in a Kubernetes Secret's file. The chart's co-located runner
    finds that path in $KVRECALL_TOKEN_FILE; Client reads no environment (the tools' --token-file
    defaults to it), so a runner passes token=read_token_file(os.environ["KVRECALL_TOKEN_FILE"]).
    ValueError naming `path` when it cannot be read, is empty or starts with a blank line."""
    try:
        with open(path) as f:
            line = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not text"
        raise ValueError(f"cannot read {path}: {reason}") from None
    if not line:
        raise ValueError(f"{path} is empty (its first line should be the bearer token)")
    token = line.strip()
    if not token:
        raise ValueError(f"{path} starts with an empty line (its first line should be the token)")
    return token


def add_connection_arguments(parser, server_required=False):
    """--server and the TLS / token flags of the kvrecall CLI, for a command-line tool's
    argparse parser; `connection_from_args` turns them into Client keyword arguments."""
    parser.add_argument("--server", required=server_required,
                        help="kvrecalld address, HOST:PORT or unix:PATH")
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS (implied by the other --tls-* flags, and by "
                             "--token-file to a HOST:PORT --server)")
    parser.add_argument("--tls-ca", help="PEM roots that signed the server's certificate")
    parser.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name",
                        help="the name to check the server's certificate against")
    parser.add_argument("--token-file",
                        help="a file whose first line is the bearer token (--auth_token_file "
                             "servers); default: $KVRECALL_TOKEN_FILE, as the chart's co-located "
                             "runner gets (--token-file '' sends none). Without --tls* flags it "
                             "goes over TLS to a HOST:PORT --server, in plaintext to a unix:PATH "
                             "one (kvrecalld --plaintext_unix_sockets), and to a "
                             "unix-abstract:NAME one not at all")
    parser.add_argument("--shared-memory", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("KVRECALL_SHARED_MEMORY") == "1",
                        help="decode through shared memory (DecodeShared; a runner on kvrecalld's "
                             "host, its --shared_memory_dir readable); default: on when "
                             "KVRECALL_SHARED_MEMORY=1, as the chart's co-located runner gets")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="the longest each unary call and each decode step may take "
                             "(past it: DEADLINE_EXCEEDED); default: no limit")


def connection_argv(args):
    """add_connection_arguments' flags as `args` holds them, as arguments for another tool's
    parser (a tool that runs another one passes its connection on)."""
    argv = ["--server", args.server] if args.server is not None else []
    if args.tls:
        argv.append("--tls")
    for flag, value in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key), ("--tls-server-name", args.tls_server_name),
                        ("--token-file", args.token_file)):
        if value is not None:  # --token-file '' (send none) included
            argv += [flag, value]
    argv.append("--shared-memory" if args.shared_memory else "--no-shared-memory")
    if args.timeout is not None:
        argv += ["--timeout", repr(args.timeout)]
    return argv


def connection_from_args(args):
    """The tls=, token=, shared_memory=, call_timeout_s= and step_timeout_s= keyword arguments
    of Client for add_connection_arguments' flags; the token from --token-file or, where that
    is not given, from the file $KVRECALL_TOKEN_FILE names. ValueError naming the flag (or the
    variable) for an unusable file or a --timeout that is not positive."""
    try:
        timeout = _check_timeout("--timeout", args.timeout)
    except ValueError as e:
        raise ValueError(str(e).replace("None or ", "")) from None
    path, source = args.token_file, "--token-file"
    if path is None:
        path, source = os.environ.get("KVRECALL_TOKEN_FILE"), "$KVRECALL_TOKEN_FILE"
    token = None
    if path:
        try:
            token = read_token_file(path)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = Tls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                  server_name=args.tls_server_name)
    return {"tls": tls, "token": token, "shared_memory": bool(args.shared_memory),
            "call_timeout_s": timeout, "step_timeout_s": timeout}


class Client:
    """A channel to kvrecalld. `max_message_bytes` bounds messages both ways; a prefill chunk
    carries at most `prefill_chunk_bytes` of tensors (at least one token's), to which its framing
    adds a few hundred bytes: the default (None) leaves 4 KiB of a 1 MiB message, the smallest
    --max_message_mb kvrecalld takes (64 MiB by default; a gRPC server's own default is 4 MiB),
    or of max_message_bytes when that is smaller.
    `tls` and `token` secure the channel (see make_channel: a token alone goes over TLS to
    HOST:PORT, in plaintext to a unix:PATH socket; the environment is not read, see
    read_token_file). `shared_memory`: decode steps go through
    a shared-memory region (DecodeShared, kvrecall.shared.SharedDecodeStream) instead of the
    Decode call, for a runner on the server's host (a server with --shared_memory_dir).

    `call_timeout_s` bounds each unary call (create_session, info, list_sessions' pages,
    close), `step_timeout_s` each decode step (past it the stream is cancelled: _ABANDONED_STEP
    says what that leaves); past either, KvRecallError DEADLINE_EXCEEDED. None: no limit (a
    wedged server blocks the runner). Session.prefill takes its own. `channel_options`: more
    gRPC channel arguments ((key, value) pairs: keepalive, reconnect backoff, a user agent; not
    the message limits or the TLS server name, which are the Client's: ValueError).

    Threads may share a Client: their decode steps go one at a time over its one decode stream
    (a step whose stream another thread's failed step ended before it was sent goes on the
    next stream); for steps in parallel, give each thread a Client of its own."""

    def __init__(self, target, max_message_bytes=64 << 20, prefill_chunk_bytes=None,
                 wait_ready_s=10.0, tls=None, token=None, shared_memory=False,
                 call_timeout_s=None, step_timeout_s=None, channel_options=()):
        self.call_timeout_s = _check_timeout("call_timeout_s", call_timeout_s)
        self.step_timeout_s = _check_timeout("step_timeout_s", step_timeout_s)
        own = {"grpc.max_send_message_length", "grpc.max_receive_message_length"}
        for key, _ in channel_options:
            if key in own or key == "grpc.ssl_target_name_override":
                raise ValueError(f"channel_options: {key} is the Client's to set "
                                 "(max_message_bytes, tls.server_name)")
        kind = _channel_kind(target, tls, token)
        self.channel = make_channel(target, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes), *channel_options],
            tls=tls, token=token)
        self.stub = pb_grpc.KvRecallStub(self.channel)
        # gRPC's -1 is "no limit": then none is told to the server (review 25).
        self.max_message_bytes = max(0, max_message_bytes)
        if prefill_chunk_bytes is None:  # a smaller limit's chunks were refused: probe 28, 10
            limit = 1 << 20 if max_message_bytes <= 0 else min(1 << 20, max_message_bytes)
            prefill_chunk_bytes = max(1, limit - 4096)
        self.prefill_chunk_bytes = prefill_chunk_bytes
        self.shared_memory = shared_memory
        self._stream = None
        self._stream_lock = threading.Lock()
        self._closed = False
        if wait_ready_s:
            try:
                grpc.channel_ready_future(self.channel).result(timeout=wait_ready_s)
            except grpc.FutureTimeoutError:
                self.channel.close()
                hint = {"plaintext": "", "local": " (or it speaks TLS on that socket: pass tls=)",
                        "tls": " (or the TLS handshake failed: check the CA, certificates and "
                               "server name)"}[kind]
                raise KvRecallError(grpc.StatusCode.UNAVAILABLE,
                                    f"no kvrecalld answered at {target} within {wait_ready_s} s"
                                    + hint)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Leaving on an exception, the decode stream's end (UNAVAILABLE from a server that went
        # away, say) must not replace it: the runner's own error is what it needs to see (it
        # was lost behind "kvrecalld is shutting down": probe 28, 6).
        try:
            self.close()
        except KvRecallError:
            if exc_type is None:
                raise

    def check_open(self):
        """KvRecallError FAILED_PRECONDITION once close() has run (gRPC itself raises
        ValueError for a closed channel, which the module promises not to)."""
        if self._closed:
            raise KvRecallError(grpc.StatusCode.FAILED_PRECONDITION,
                                "the client is closed (Client.close() was called)")

    def call(self, method, request):
        """A unary call by name; gRPC errors become KvRecallError."""
        self.check_open()
        try:
            return getattr(self.stub, method)(request, timeout=self.call_timeout_s)
        except grpc.RpcError as e:
            raise KvRecallError.from_rpc_error(e) from None

    def create_session(self, geometry, policy=None, label="", max_tokens=0, request_id=""):
        """A new session. max_tokens: the most tokens it will hold (prompt + decoded), when the
        runner knows it: their memory is set aside now (RESOURCE_EXHAUSTED when it does not
        fit), so that decoding up to it never grows a layer's KV (the server grows an array
        ahead of need, off the step, within the address space it reserved; one past it, or with
        --host_kv_growth_ahead=false, is copied and pinned again in the step, every layer at the
        same token). 0: not announced. request_id: makes a retry safe
        (CreateSessionRequest.request_id; a uuid.uuid4().hex, say): a call that failed without
        an answer, resent with the same request_id, gets the session the first one made, if it
        made one (ABORTED while that one is still being made: retry; ALREADY_EXISTS for another
        request under the id). "": none."""
        resp = self.call("CreateSession", pb.CreateSessionRequest(
            geometry=geometry, policy=policy or make_policy(), label=label,
            max_tokens=max_tokens, request_id=request_id))
        return Session(self, resp.session_id, geometry, resp.policy,
                       resp.prompt_queries if resp.HasField("prompt_queries") else -1)

    def list_sessions(self):
        """Every session of the caller, by id (following ListSessions' pages)."""
        sessions, token = [], ""
        while True:
            reply = self.call("ListSessions", pb.ListSessionsRequest(page_token=token))
            sessions.extend(reply.sessions)
            token = reply.next_page_token
            if not token:
                return sessions

    @property
    def decode_stream(self):
        """The client's Decode stream (a SharedDecodeStream when `shared_memory`), (re)opened
        on first use and after a failed step."""
        with self._stream_lock:  # threads racing to reopen it each opened one (probe 28, 4)
            self.check_open()
            if self._stream is None or self._stream.broken:
                broken, self._stream = self._stream, None
                if broken is not None:
                    broken._release()  # its timer and region (a cancel_step left them)
                if self.shared_memory:
                    from kvrecall.shared import SharedDecodeStream  # it imports this module

                    def publish(stream):  # before it waits: cancel_step reaches the wait
                        self._stream = stream
                    try:
                        SharedDecodeStream(self.channel, step_timeout_s=self.step_timeout_s,
                                           on_call=publish)
                    except BaseException:
                        self._stream = None
                        raise
                else:
                    self._stream = DecodeStream(self.channel, self.max_message_bytes,
                                                step_timeout_s=self.step_timeout_s)
            return self._stream

    def cancel_step(self):
        """Abandons the decode stream from any thread: a step in flight raises KvRecallError
        CANCELLED (_ABANDONED_STEP); the next step goes on a new stream. Nothing without one."""
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def attend_batch(self, layer, steps, **options):
        """One layer of one decode step for several sessions: steps [(session, q, k, v)], each
        optionally with the position its token must take, (session, q, k, v, position)
        (_LayerStepStream.step)."""
        _check_layer(layer)  # before decode_stream opens a stream (a shared region) for nothing
        steps = [_step_parts(step) for step in steps]
        while True:
            try:
                return self.decode_stream.step(layer, steps, **options)
            except _StreamEndedBeforeSend:
                # Another thread's failed step ended the stream while this one waited for it:
                # nothing of this step was sent, so it goes on the next stream (it failed
                # with that thread's stream: probe 28, 4). After close(), check_open raises.
                continue

    def close(self):
        with self._stream_lock:  # no stream reopened on the closing channel (review 25)
            self._closed = True
            stream, self._stream = self._stream, None
        try:
            if stream is not None:
                stream.close()
        finally:
            self.channel.close()


def path_mix(info):
    """Share of head-steps per path from a pb.SessionInfo: {'exact': ..., 'reuse': ...}."""
    p = info.paths
    counts = {"exact": p.exact, "reuse": p.reuse, "fallback": p.fallback, "refresh": p.refresh}
    total = sum(counts.values())
    return {k: (v / total if total else 0.0) for k, v in counts.items()}
