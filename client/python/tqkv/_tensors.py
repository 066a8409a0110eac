"""numpy arrays <-> tqkv.v1.Tensor (raw little-endian bytes, dtype, shape).

Wire dtypes and their numpy forms:
  f32  <-> numpy.float32
  f16  <-> numpy.float16
  bf16 <-> numpy.uint16 holding the raw bfloat16 bits (numpy has no bfloat16);
           to_bf16 / from_bf16 convert to and from float32.
"""
import numpy as np

from tqkv._errors import InvalidArgument
from tqkv.v1 import kvcache_pb2 as pb

F32 = "f32"
F16 = "f16"
BF16 = "bf16"

_PROTO = {F32: pb.DTYPE_F32, F16: pb.DTYPE_F16, BF16: pb.DTYPE_BF16}
_NUMPY = {F32: np.dtype("<f4"), F16: np.dtype("<f2"), BF16: np.dtype("<u2")}
_FROM_PROTO = {v: k for k, v in _PROTO.items()}


def to_bf16(x):
    """float array -> uint16 bfloat16 bits, rounded to nearest even (NaN kept NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def from_bf16(bits):
    """uint16 bfloat16 bits -> float32 (exact)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def dtype_name(dtype):
    """'f32' | 'f16' | 'bf16' for a dtype name or a numpy dtype of an accepted array."""
    if dtype in _PROTO:
        return dtype
    d = np.dtype(dtype)
    if d == np.float32:
        return F32
    if d == np.float16:
        return F16
    if d == np.uint16:
        return BF16
    raise InvalidArgument("unsupported dtype %s: want float32, float16, or uint16 "
                          "(raw bfloat16 bits), or wire_dtype 'f32' | 'f16' | 'bf16'" % d)


def encode(name, array, ndim, wire_dtype=None):
    """A tqkv.v1.Tensor from an array of `ndim` dims.

    The array travels in its own dtype (float32, float16, uint16 = bf16 bits)
    unless `wire_dtype` names another; then floats are converted (float64 and
    other float arrays are converted to float32 by default).
    """
    a = np.asarray(array)
    if a.ndim != ndim:
        raise InvalidArgument("%s has %d dims, want %d" % (name, a.ndim, ndim))
    if wire_dtype is None:
        if a.dtype in (np.float32, np.float16, np.uint16):
            wire = dtype_name(a.dtype)
        elif np.issubdtype(a.dtype, np.floating):
            wire = F32
        else:
            raise InvalidArgument("%s has dtype %s: want float32, float16 or uint16 (bf16 bits)"
                                  % (name, a.dtype))
    else:
        wire = dtype_name(wire_dtype)
    if wire == BF16 and a.dtype != np.uint16:
        data = to_bf16(a)
    elif wire == BF16:
        data = a
    elif a.dtype == np.uint16:
        raise InvalidArgument("%s is uint16 (bf16 bits) but wire_dtype is %s" % (name, wire))
    else:
        data = a.astype(_NUMPY[wire], copy=False)
    data = np.ascontiguousarray(data, dtype=_NUMPY[wire])
    return pb.Tensor(dtype=_PROTO[wire], shape=list(a.shape), data=data.tobytes())


def decode(tensor):
    """numpy array of a Tensor: float32, float16, or uint16 bf16 bits."""
    name = _FROM_PROTO.get(tensor.dtype)
    if name is None:
        raise InvalidArgument("server sent a tensor of unknown dtype %d" % tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    dtype = _NUMPY[name]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(tensor.data) != count * dtype.itemsize:
        raise InvalidArgument("server sent %d bytes for a %s tensor of shape %s"
                              % (len(tensor.data), name, list(shape)))
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape).copy()
