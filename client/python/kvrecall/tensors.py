"""Conversion between kvrecall.v1.Tensor (raw little-endian bytes of a dtype) and arrays.

Arrays are numpy arrays or, when torch is installed, torch tensors (moved to the CPU); a uint16
numpy array sent as bf16 is taken as bf16 bit patterns. What comes back from the service is
always a float32 numpy array of the tensor's shape.
"""
import numpy as np

from kvrecall.v1 import kvrecall_pb2 as pb

DTYPES = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
_ITEM_BYTES = {pb.DTYPE_F32: 4, pb.DTYPE_F16: 2, pb.DTYPE_BF16: 2}


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


def f32_to_bf16_bits(a):
    """bf16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


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


def from_tensor(t):
    """A float32 numpy array holding pb.Tensor `t` (raw data or plain values)."""
    shape = tuple(t.shape)
    if not t.data:
        return np.asarray(t.values, dtype=np.float32).reshape(shape)
    if t.dtype == pb.DTYPE_F32:
        a = np.frombuffer(t.data, dtype="<f4")
    elif t.dtype == pb.DTYPE_F16:
        a = np.frombuffer(t.data, dtype="<f2").astype(np.float32)
    elif t.dtype == pb.DTYPE_BF16:
        a = bf16_bits_to_f32(np.frombuffer(t.data, dtype="<u2"))
    else:
        raise ValueError(f"tensor has no known dtype ({t.dtype})")
    return a.reshape(shape)
