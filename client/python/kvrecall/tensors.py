"""Conversion between kvrecall.v1.Tensor (raw little-endian bytes of a dtype) and arrays.

Arrays are numpy arrays or, when torch is installed, torch tensors (moved to the CPU); a uint16
numpy array sent as bf16 is taken as bf16 bit patterns. What comes back from the service is
always a float32 numpy array of the tensor's shape.

The decode path (`WireBuffer`) hands the client an array whose memory already holds the wire
bytes: the input itself when it is a contiguous CPU array of the wire dtype (no copy), otherwise
the input converted into a buffer kept from step to step (no allocation).
"""
import sys

import numpy as np

from kvrecall.v1 import kvrecall_pb2 as pb

DTYPES = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
_ITEM_BYTES = {pb.DTYPE_F32: 4, pb.DTYPE_F16: 2, pb.DTYPE_BF16: 2}
# numpy's array type holding each wire dtype's bytes (bf16: its bit patterns).
_WIRE_NUMPY = {pb.DTYPE_F32: np.dtype("<f4"), pb.DTYPE_F16: np.dtype("<f2"),
               pb.DTYPE_BF16: np.dtype("<u2")}


def dtype_of(name_or_enum):
    """The pb.DType for 'f32' | 'f16' | 'bf16' (or a pb.DType value, returned as is)."""
    if isinstance(name_or_enum, str):
        try:
            return DTYPES[name_or_enum]
        except KeyError:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name_or_enum!r}") from None
    return name_or_enum


def _is_torch(x):
    return type(x).__module__.startswith("torch")


_U32_16, _U32_1, _U32_ROUND = np.uint32(16), np.uint32(1), np.uint32(0x7FFF)


def _quiet_nans(a, u):
    """u (a's float32 bits as uint32), with every NaN made the quiet NaN 0x7FC00000, whose
    rounding cannot carry out of the exponent into ±0 as a NaN with a full mantissa would.
    One reduction when there is no NaN (its sum is then finite or ±inf)."""
    if np.isnan(np.add.reduce(a, axis=None)):
        return np.where(np.isnan(a), np.uint32(0x7FC00000), u)
    return u


def f32_to_bf16_bits(a, out=None, scratch=None):
    """bf16 bit patterns (uint16) of float32 values, rounded to nearest even.

    With `out` (uint16, a's shape) and `scratch` (uint32, shape (2,) + a.shape) nothing is
    allocated; the calls are few and cast nothing: each costs more than its 4K elements do."""
    if out is None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        u = _quiet_nans(a, a.view(np.uint32))
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    if a.dtype == np.float32 and a.flags.c_contiguous:
        u = _quiet_nans(a, a.view(np.uint32))
    else:
        np.copyto(scratch[1].view(np.float32), a, casting="unsafe")
        u = _quiet_nans(scratch[1].view(np.float32), scratch[1])
    r = np.right_shift(u, _U32_16, out=scratch[0])
    np.bitwise_and(r, _U32_1, out=r)
    np.add(r, _U32_ROUND, out=r)
    np.add(r, u, out=r)
    if np.little_endian:  # the rounded value's high half is the bf16
        np.copyto(out, r.view(np.uint16)[..., 1::2])
    else:
        np.right_shift(r, _U32_16, out=r)
        np.copyto(out, r, casting="unsafe")
    return out


def bf16_bits_to_f32(bits):
    """float32 values of bf16 bit patterns: each pattern is the high half of its float32
    (one widening shift, into a new array)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return np.left_shift(bits, _U32_16, dtype=np.uint32).view(np.float32)


def _raw_bytes(x, dtype):
    """The little-endian bytes of `x` in `dtype` (x: numpy array or torch tensor)."""
    if _is_torch(x):
        import torch
        t = x.detach().to("cpu").contiguous()
        if dtype == pb.DTYPE_BF16:
            return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        t = t.to(torch.float16 if dtype == pb.DTYPE_F16 else torch.float32)
        return t.numpy().tobytes()
    a = np.asarray(x)
    if dtype == pb.DTYPE_BF16:
        if a.dtype == np.uint16:  # already bf16 bit patterns (as safetensors stores them)
            return np.ascontiguousarray(a, dtype="<u2").tobytes()
        return f32_to_bf16_bits(a).tobytes()
    return np.ascontiguousarray(a, dtype=np.float16 if dtype == pb.DTYPE_F16 else "<f4").tobytes()


class WireBuffer:
    """The wire bytes of one tensor slot of fixed `shape` and `dtype` (a decode step's q, k_new
    or v_new), reused from step to step.

    view(x) returns a contiguous numpy array holding x's bytes in the wire dtype: x itself
    (a view, no copy) when x is a contiguous CPU numpy array or torch tensor of that dtype, else
    x converted into this buffer's own memory (one pass, nothing allocated). The result is valid
    until the next view(); copy it out (b"".join does) before then."""

    def __init__(self, dtype, shape):
        self.dtype = dtype_of(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.count = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.count * _ITEM_BYTES[self.dtype]
        self._wire = np.empty(self.shape, dtype=_WIRE_NUMPY[self.dtype])
        # bf16 rounding works on the float32 bit patterns in a uint32 scratch.
        self._scratch = (np.empty((2,) + self.shape, np.uint32) if self.dtype == pb.DTYPE_BF16
                         else None)
        self._torch_wire = None

    def check_fits(self, x):
        """ValueError unless x holds this buffer's elements in its row-major order as far as
        its shape tells: as many of them, and flat (one dimension of size > 1) or with this
        shape's last dimension (head_dim) as its own last one of size > 1 ([kv_heads, group,
        head_dim] for q is fine). (The count alone was checked: a transposed [head_dim, heads] q was read as
        [heads, head_dim], a silently wrong attention: probe 28, 2.)"""
        shape = tuple(int(d) for d in x.shape)
        count = 1
        for d in shape:
            count *= d
        rows = [d for d in shape if d != 1]
        want = [d for d in self.shape if d != 1]
        if count == self.count and (len(rows) <= 1 or rows[-1:] == want[-1:]):
            return
        raise ValueError(f"tensor of shape {list(x.shape)} does not fit shape "
                         f"{list(self.shape)}")

    def view(self, x):
        x = as_array(x)
        self.check_fits(x)
        if _is_torch(x):
            return self._view_torch(x)
        a = np.asarray(x)
        want = _WIRE_NUMPY[self.dtype]
        if a.dtype == want or (self.dtype == pb.DTYPE_BF16 and a.dtype == np.uint16):
            if a.flags.c_contiguous and a.dtype.byteorder in "<=|":
                return a
            np.copyto(self._wire, a.reshape(self.shape))
            return self._wire
        if self.dtype == pb.DTYPE_BF16:
            torch = sys.modules.get("torch")
            if torch is not None and a.flags.writeable and a.dtype.kind == "f":
                # Loaded anyway (a model runner): one conversion call instead of five.
                self._torch_view(torch).copy_(torch.from_numpy(a.reshape(self.shape)))
                return self._wire
            return f32_to_bf16_bits(a.reshape(self.shape), out=self._wire, scratch=self._scratch)
        if self.dtype == pb.DTYPE_F16:
            with np.errstate(over="ignore", invalid="ignore"):
                np.copyto(self._wire, a.reshape(self.shape), casting="unsafe")
            _raise_if_f16_overflow(a.reshape(self.shape), self._wire)
            return self._wire
        np.copyto(self._wire, a.reshape(self.shape), casting="unsafe")
        return self._wire

    def _view_torch(self, x):
        import torch
        want = {pb.DTYPE_F32: torch.float32, pb.DTYPE_F16: torch.float16,
                pb.DTYPE_BF16: torch.bfloat16}[self.dtype]
        t = x.detach()
        if t.device.type == "cpu" and t.dtype == want and t.is_contiguous():
            # bf16 has no numpy type: its bytes are read through an int16 view.
            return t.view(torch.int16).numpy() if want == torch.bfloat16 else t.numpy()
        # One copy (from the device, converting, or gathering strides) into the buffer.
        self._torch_view(torch).copy_(t.reshape(self.shape))
        if want == torch.float16 and np.isinf(self._wire).any():
            _raise_if_f16_overflow(t.reshape(self.shape).float().cpu().numpy(), self._wire)
        return self._wire

    def _torch_view(self, torch):
        """This buffer as a torch tensor of the wire dtype (sharing its memory)."""
        if self._torch_wire is None:
            if self.dtype == pb.DTYPE_BF16:
                self._torch_wire = torch.from_numpy(self._wire.view(np.int16)).view(torch.bfloat16)
            else:
                self._torch_wire = torch.from_numpy(self._wire)
        return self._torch_wire


def to_tensor(x, dtype, shape=None, out=None):
    """Fills `out` (or a new pb.Tensor) with `x` as raw bytes of `dtype`.

    `shape` overrides x's shape (it must hold the same number of elements)."""
    dtype = dtype_of(dtype)
    t = out if out is not None else pb.Tensor()
    t.dtype = dtype
    shape = list(x.shape) if shape is None else list(shape)
    t.shape[:] = shape
    t.data = _raw_bytes(x, dtype)
    if len(t.data) != int(np.prod(shape, dtype=np.int64)) * _ITEM_BYTES[dtype]:
        raise ValueError(f"tensor of shape {list(x.shape)} does not fit shape {shape}")
    return t


def as_array(x):
    """x as is when it is None, a numpy array or a torch tensor; else a float32 array of it (a
    sequence of numbers, nested lists; ValueError where it is not one, ragged say)."""
    if x is None or isinstance(x, np.ndarray) or _is_torch(x):
        return x
    return np.asarray(x, dtype=np.float32)


# The smallest magnitude that f16 rounds to inf (the midpoint of 65504 and 65536, to even).
_F16_OVERFLOW = 65520.0
# Elements of `x` looked at at once by check_f16_range (its temporaries' size).
_F16_CHECK_BLOCK = 1 << 20


def check_f16_range(x, what):
    """ValueError, prefixed with `what`, when a finite value of `x` (numpy array or torch tensor,
    rows along its first dimension) would become inf in f16. For a tensor that goes into a
    stream (a Prefill's) before the stream starts: an error raised while it is under way reaches
    the caller as gRPC's UNKNOWN "Exception iterating requests!" instead. Looks at blocks of
    rows, so that it holds no copy of `x`; an f16 `x` has nothing to check."""
    if _is_torch(x):
        import torch
        x, f16, isfinite = x.detach(), torch.float16, torch.isfinite
    else:
        x, f16, isfinite = np.asarray(x), np.float16, np.isfinite
    if x.dtype == f16 or x.shape[0] == 0:
        return
    row = max(1, int(np.prod(x.shape[1:], dtype=np.int64)))
    step = max(1, _F16_CHECK_BLOCK // row)
    for start in range(0, x.shape[0], step):
        block = x[start:start + step]
        with np.errstate(invalid="ignore"):
            overflowed = isfinite(block) & (abs(block) >= _F16_OVERFLOW)
        if bool(overflowed.any()):
            raise ValueError(f"{what}: value {float(block[overflowed][0])!r} is past f16's range "
                             "(at most 65504 in magnitude)")


def _raise_if_f16_overflow(source, f16):
    """ValueError naming the first finite value of `source` that became inf in its f16 copy
    `f16` (the server then refused it as a value the runner never sent: probe 28, 11)."""
    with np.errstate(invalid="ignore"):
        overflowed = np.isinf(f16) & np.isfinite(source)
    if overflowed.any():
        raise ValueError(f"value {float(source[overflowed][0])!r} is past f16's range (at most "
                         f"65504 in magnitude)")


def from_tensor(t):
    """A read-only float32 numpy array holding pb.Tensor `t` (raw data or plain values): f32
    data is viewed where it arrived, and every dtype reads the same (copy it to write; only
    f32's was read-only: probe 28, 9)."""
    shape = tuple(t.shape)
    if not t.data:
        a = np.asarray(t.values, dtype=np.float32)
    elif t.dtype == pb.DTYPE_F32:
        a = np.frombuffer(t.data, dtype="<f4")
    elif t.dtype == pb.DTYPE_F16:
        a = np.frombuffer(t.data, dtype="<f2").astype(np.float32)
    elif t.dtype == pb.DTYPE_BF16:
        a = bf16_bits_to_f32(np.frombuffer(t.data, dtype="<u2"))
    else:
        raise ValueError(f"tensor has no known dtype ({t.dtype})")
    a = a.reshape(shape)
    a.flags.writeable = False
    return a
