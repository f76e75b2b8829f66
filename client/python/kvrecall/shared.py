"""A Decode stream whose steps travel through a shared-memory region instead of the gRPC call
(DecodeShared), for a runner on kvrecalld's host: the Python side of
proto/shared_decode_region.h (layout version 1), whose layout, step protocol and wait / wake
protocol this file follows.

SharedDecodeStream has DecodeStream's interface (step, close, broken, last_server_micros,
last_tier_micros) and encoding (client._LayerStepStream): a step's serialized DecodeRequest
(_request_head and the sessions' _StepWire pieces) is written straight into the region's
request area, its serialized DecodeResponse parsed from the reply area. The DecodeShared call that opened the region stays
open while the stream lives; its final status is the stream's end status.

Memory ordering. Linux on x86-64 only. Every header word is read and written through a
memoryview cast to 'I': one aligned 32-bit load or store each (CPython copies the item with a
4-byte memcpy, which compiles to one mov), so no word is ever torn. x86-64 keeps stores in
order with other stores and loads with other loads, so a plain store of request_seq publishes
the request bytes written before it (the release the header asks for) and a plain load of
reply_seq orders the reply bytes read after it. The one reordering x86-64 allows, a load
passing an earlier store, matters once: Signal's load of server_sleeping after its store to
request_signal (a sequentially consistent pair in the C++ side). A threading.Lock acquire and
release stands between them: CPython's lock is a locked read-modify-write on x86-64, a full
fence. Waiting needs no fence: futex(2) compares the signal word after its own full barrier, so
a wake-up the server skipped because it had not yet seen runner_sleeping still finds the signal
changed and returns at once.

The spin before sleeping holds the GIL (up to SPIN_NS); the futex sleep releases it (ctypes).
"""
import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import threading
import time

import grpc

from kvrecall.client import KvRecallError, _check_timeout, _LayerStepStream
from kvrecall.v1 import kvrecall_pb2 as pb

MAGIC = 0x5244564B  # "KVDR" in little-endian bytes
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
# RegionHeader's fields: magic, version, request_offset, request_capacity, reply_offset,
# reply_capacity (written once by the server), then 32-bit words by index (byte offset / 4).
_LAYOUT = struct.Struct("<IIQQQQ")
_REQUEST_SEQ, _REQUEST_BYTES, _CLOSING = 64 // 4, 68 // 4, 72 // 4
_REPLY_SEQ, _REPLY_BYTES, _STATUS_CODE, _ENDED = 128 // 4, 132 // 4, 136 // 4, 140 // 4
_REQUEST_SIGNAL, _SERVER_SLEEPING = 192 // 4, 196 // 4
_REPLY_SIGNAL, _RUNNER_SLEEPING = 256 // 4, 260 // 4
_WORD_MASK = 0xFFFFFFFF

# futex(2) on x86-64; shared futexes (no FUTEX_PRIVATE_FLAG): two processes map the words.
_SYS_FUTEX = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# absl::ErrnoToStatus's codes for the errors opening a region file can meet.
_ERRNO_CODES = {errno.ENOENT: grpc.StatusCode.NOT_FOUND,
                errno.EACCES: grpc.StatusCode.PERMISSION_DENIED,
                errno.EPERM: grpc.StatusCode.PERMISSION_DENIED,
                errno.ENOMEM: grpc.StatusCode.RESOURCE_EXHAUSTED,
                errno.EINVAL: grpc.StatusCode.INVALID_ARGUMENT}

_fence_lock = threading.Lock()
_libc = None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex(address, op, value, timeout):
    """futex(2) on the 32-bit word at `address`; every argument is passed as a C long (syscall
    is variadic). `timeout`: a _Timespec reference (relative) or None."""
    return _libc.syscall(ctypes.c_long(_SYS_FUTEX), address, ctypes.c_long(op),
                         ctypes.c_long(value), timeout, None, ctypes.c_long(0))


def _check_platform():
    global _libc
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        raise KvRecallError(grpc.StatusCode.UNIMPLEMENTED,
                            "the Python shared-memory Decode stream runs on Linux x86-64 only "
                            f"(futex number and store ordering), not {sys.platform} "
                            f"{platform.machine()}")
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long


def _map_region(region):
    """mmap of the region file (MAP_SHARED, read-write) after MappedRegion::Open's checks;
    KvRecallError with its codes."""
    path, size = region.path, region.bytes
    if region.layout_version != LAYOUT_VERSION:
        raise KvRecallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the server lays out shared decode regions in version "
                            f"{region.layout_version}; this client reads {LAYOUT_VERSION}")
    if size < HEADER_BYTES:
        raise KvRecallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"a shared decode region of {size} bytes holds no header")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise KvRecallError(_ERRNO_CODES.get(e.errno, grpc.StatusCode.UNKNOWN),
                            f"opening the shared decode region {path}: {e.strerror}") from None
    try:
        if os.fstat(fd).st_size < size:
            raise KvRecallError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the shared decode region {path} is shorter than {size} bytes")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise KvRecallError(_ERRNO_CODES.get(e.errno, grpc.StatusCode.UNKNOWN),
                            f"mapping {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    magic, version, request_offset, request_capacity, reply_offset, reply_capacity = \
        _LAYOUT.unpack_from(mm, 0)
    fits = lambda offset, capacity: (HEADER_BYTES <= offset <= size and
                                     capacity <= size - offset)
    problem = None
    if magic != MAGIC or version != LAYOUT_VERSION:
        problem = (f"{path} is not a shared decode region of layout version {LAYOUT_VERSION} "
                   f"(magic {magic:x}, version {version})")
    elif not fits(request_offset, request_capacity) or not fits(reply_offset, reply_capacity):
        problem = f"the shared decode region {path} lays out areas beyond its {size} bytes"
    if problem:
        mm.close()
        raise KvRecallError(grpc.StatusCode.FAILED_PRECONDITION, problem)
    return mm, (request_offset, request_capacity, reply_offset, reply_capacity)


class SharedDecodeStream(_LayerStepStream):
    """One DecodeShared call and its region: one request in flight, steps through the region.
    After an error the stream is `broken` (the server ended it) and Client opens a new one for
    the next step. `region` is the server's SharedDecodeRegion (path, bytes, capacities).

    Capacities of 0 take the server's --max_message_mb; a request larger than the granted
    request capacity raises RESOURCE_EXHAUSTED before anything is sent (the stream stays
    usable)."""

    _METHOD = "/{}/DecodeShared".format(pb.DESCRIPTOR.services_by_name["KvRecall"].full_name)
    SPIN_NS = 200_000   # polling for the reply before sleeping on reply_signal
    SLICE_NS = 2_000_000  # the longest sleep between looks at the call (a dead server)

    def __init__(self, channel, max_request_bytes=0, max_reply_bytes=0, step_timeout_s=None,
                 on_call=None):
        """step_timeout_s: as DecodeStream's (the wait for the region, each step and close()
        count as one each). on_call(stream), if given, is called once the call is made and
        before the wait for its region, so that the stream's cancel() reaches that wait (Client
        publishes the stream there)."""
        _check_platform()
        step_timeout_s = _check_timeout("step_timeout_s", step_timeout_s)
        self._max_reply_bytes = 0  # the region's reply area bounds the reply (the server checks)
        open_region = channel.unary_stream(
            self._METHOD, request_serializer=pb.SharedDecodeRequest.SerializeToString,
            response_deserializer=pb.SharedDecodeRegion.FromString)
        self._mm = None
        self.broken = False
        self._lock = threading.Lock()
        self._call = open_region(pb.SharedDecodeRequest(max_request_bytes=max_request_bytes,
                                                        max_reply_bytes=max_reply_bytes))
        self._start_timer(step_timeout_s)
        if on_call is not None:
            on_call(self)
        try:
            self.region = self._watched("opening the shared decode stream", self._await_region,
                                        carries_step=False)
            if self.broken:  # cancelled as the region came
                raise KvRecallError(grpc.StatusCode.CANCELLED,
                                    "opening the shared decode stream: cancelled as its region "
                                    "came")
            self._mm, (self._request_offset, self._request_capacity, reply_offset,
                       reply_capacity) = _map_region(self.region)
        except BaseException:
            self.broken = True
            self._call.cancel()
            self._stop_timer()
            raise
        self._words = memoryview(self._mm)[:HEADER_BYTES].cast("I")
        self._reply_area = memoryview(self._mm)[reply_offset:reply_offset + reply_capacity]
        self._anchor = ctypes.c_char.from_buffer(self._mm)  # the mapping's address, for futex
        base = ctypes.addressof(self._anchor)
        self._request_signal_address = ctypes.c_void_p(base + 4 * _REQUEST_SIGNAL)
        self._reply_signal_address = ctypes.c_void_p(base + 4 * _REPLY_SIGNAL)
        self._slice = _Timespec(0, self.SLICE_NS)
        self._seq = self._words[_REQUEST_SEQ]
        self._next_id = 1
        self.last_server_micros = 0.0
        self.last_tier_micros = None  # as DecodeStream's

    def _await_region(self):
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise KvRecallError.from_rpc_error(e) from None
        except StopIteration:
            raise KvRecallError(grpc.StatusCode.INTERNAL,
                                "DecodeShared ended without a region") from None

    @property
    def ended(self):
        """Whether the server has ended the stream (a drain, a revoked token, an error)."""
        return self._words is not None and bool(self._words[_ENDED])

    def close(self):
        """Ends the stream through the region (closing) and waits for the call's end, within
        step_timeout_s (DEADLINE_EXCEEDED past it, the call cancelled)."""
        with self._lock:
            try:
                if self._mm is None or self.broken:
                    return
                self.broken = True
                self._watched("closing the shared decode stream", self._close_through_region,
                              carries_step=False)
            except KvRecallError as e:
                if e.code != grpc.StatusCode.CANCELLED:  # the end of a cancelled stream
                    raise
            finally:
                self._unmap()
                self._stop_timer()

    def _close_through_region(self):
        words = self._words
        if not words[_ENDED]:
            words[_CLOSING] = 1
            seq = self._publish([])
            if self._wait_reply(seq) and words[_REPLY_SEQ] == seq:
                self._raise_on_failed_reply()
        code, details = self._call_end()
        if code != grpc.StatusCode.OK:
            raise KvRecallError(code, details)

    def _exchange(self, pieces):
        """Writes a request, waits for its reply; the parsed DecodeResponse, or KvRecallError
        (the stream broken unless the request did not fit)."""
        words = self._words
        if words[_ENDED]:
            self._end_from_call()
        seq = self._publish(pieces)
        try:
            replied = self._wait_reply(seq)
        except BaseException:  # KeyboardInterrupt in the wait: the request may still be read
            self._break(cancel=True)
            raise
        if not replied or words[_REPLY_SEQ] != seq:
            self._end_from_call()  # ended (drain, shutdown) or the call died without a reply
        self._raise_on_failed_reply()
        problem = None
        with self._reply_area[:words[_REPLY_BYTES]] as reply:
            try:
                return pb.DecodeResponse.FromString(reply)  # copies out of the region
            except Exception as e:  # protobuf's DecodeError
                problem = f"the shared decode reply does not parse: {e}"
        self._break(cancel=True)
        raise KvRecallError(grpc.StatusCode.INTERNAL, problem)

    def _publish(self, pieces):
        """Writes the request pieces (bytes and contiguous numpy arrays) into the request area,
        bumps request_seq and signals the server; returns the new request_seq."""
        sizes = [len(p) if type(p) is bytes else p.nbytes for p in pieces]
        total = sum(sizes)
        if total > self._request_capacity:
            raise KvRecallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"a decode request of {total} bytes exceeds the shared region's "
                                f"request capacity of {self._request_capacity} bytes")
        mm, position = self._mm, self._request_offset
        for piece, size in zip(pieces, sizes):
            mm[position:position + size] = piece
            position += size
        words = self._words
        words[_REQUEST_BYTES] = total
        seq = self._seq = (self._seq + 1) & _WORD_MASK
        words[_REQUEST_SEQ] = seq
        # Not an atomic increment: the server bumps this word too, but only to wake its own
        # thread at a cancellation or the drain, which that thread sees by other means, so a
        # bump this store overwrites loses nothing.
        words[_REQUEST_SIGNAL] = (words[_REQUEST_SIGNAL] + 1) & _WORD_MASK
        with _fence_lock:  # the store above before the load below (see the module's comment)
            pass
        if words[_SERVER_SLEEPING]:
            _futex(self._request_signal_address, _FUTEX_WAKE, _WAKE_ALL, None)
        return seq

    def _wait_reply(self, seq):
        """WaitUntil(reply_seq == seq or ended): spins SPIN_NS, then sleeps on reply_signal in
        slices, looking at the call between them. False when the call ended first."""
        words = self._words
        if words[_REPLY_SEQ] == seq or words[_ENDED]:
            return True
        clock = time.perf_counter_ns
        spin_end = clock() + self.SPIN_NS
        while clock() < spin_end:
            if words[_REPLY_SEQ] == seq or words[_ENDED]:
                return True
        slice_ref = ctypes.byref(self._slice)
        while True:
            seen = words[_REPLY_SIGNAL]
            words[_RUNNER_SLEEPING] = 1
            if words[_REPLY_SEQ] == seq or words[_ENDED]:
                words[_RUNNER_SLEEPING] = 0
                return True
            _futex(self._reply_signal_address, _FUTEX_WAIT, seen, slice_ref)
            words[_RUNNER_SLEEPING] = 0
            if words[_REPLY_SEQ] == seq or words[_ENDED]:
                return True
            if self._call.done():
                return bool(words[_REPLY_SEQ] == seq or words[_ENDED])

    def _raise_on_failed_reply(self):
        """KvRecallError with the status of a published reply whose status_code is not OK (the
        server ended the stream); checks reply_bytes against the reply capacity."""
        words = self._words
        size, code = words[_REPLY_BYTES], words[_STATUS_CODE]
        if size > len(self._reply_area):
            self._break(cancel=True)
            raise KvRecallError(grpc.StatusCode.INTERNAL,
                                f"a shared decode reply of {size} bytes exceeds the reply "
                                f"capacity of {len(self._reply_area)} bytes")
        if code == 0:
            return
        message = bytes(self._reply_area[:size]).decode("utf-8", "replace")
        cut = size == len(self._reply_area)  # before _break releases the area
        self._break()
        status = _STATUS_CODES.get(code if code < 1 << 31 else code - (1 << 32))
        if cut:
            # Cut to the reply area ("nothing of it was applied" lost from a 64-byte one: probe
            # 28, 7): the call ends with the same status, its message whole.
            end_code, details = self._call_end()
            if end_code == status and details:
                message = details
        raise KvRecallError(status or grpc.StatusCode.UNKNOWN, message)

    def _call_end(self):
        """The DecodeShared call's final (code, details), waiting for it."""
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    def _end_from_call(self):
        """Raises the call's final status: the stream ended without answering the request."""
        self._break()
        code, details = self._call_end()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNKNOWN, "shared decode stream ended without a reply"
        raise KvRecallError(code, details)

    def _break(self, cancel=False):
        """Marks the stream broken and unmaps the region; `cancel` also cancels the call (the
        client gives up on a stream the server still serves), else the server ends the call
        with the status the region carried."""
        self.broken = True
        self._unmap(cancel)
        self._stop_timer()

    def _cancel_call(self):
        self._call.cancel()  # a step waiting in _wait_reply sees the call done within a slice

    def _unmap(self, cancel=True):
        if self._mm is None:
            return
        if cancel:
            self._call.cancel()  # nothing when the call has ended
        self._words.release()
        self._reply_area.release()
        self._anchor = None
        try:
            self._mm.close()
        except BufferError:  # a reply view still referenced (a traceback): unmapped by the GC
            pass
        self._mm = None
