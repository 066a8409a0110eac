"""vLLM's TurboQuant KV-cache scheme, emulated in numpy (offline), for a
side-by-side column in the quality report (docs/turboquant.md section 4):

  keys    n = ||k|| (fp16); y = H (k / n) with the orthonormal Walsh-Hadamard
          matrix H and NO random sign diagonal; every coordinate quantized with
          the b-bit Lloyd-Max codebook of a GAUSSIAN N(0, 1/d) (vLLM's
          approximation of the sphere-coordinate density); norm correction:
          k_hat = n * H^T (c / ||c||).  k8v4: FP8 e4m3 keys, no rotation, no scale.
  values  per-vector uniform min-max: scale = (max - min) / (2^b - 1) and
          zero = min, both fp16; v_hat = round((v - zero) / scale) * scale + zero.

PRESETS maps vLLM's preset names to (key bits or "fp8", value bits).
`cache(preset)` returns an attention backend (attention.NumpyCache) that passes
every K/V the attention reads, the current token included, through the codec.
Bytes per (token, head): vLLM's slot [key indices | fp16 norm | value codes |
fp16 scale | fp16 zero], padded to an even byte count.
"""
import math

import numpy as np

import attention

PRESETS = {"turboquant_k8v4": ("fp8", 4), "turboquant_4bit_nc": (4, 4),
           "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3)}


def _phi(x):
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x):
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def gaussian_codebook(bits, d, iterations=500):
    """Lloyd-Max centroids (sorted, float64) of N(0, 1/d) with 2^bits levels."""
    levels = 2 ** bits
    sigma = 1.0 / math.sqrt(d)
    # Start from quantiles; iterate centroid = conditional mean of its cell.
    c = np.array([sigma * math.sqrt(2) * _erfinv(2 * (i + 0.5) / levels - 1)
                  for i in range(levels)])
    for _ in range(iterations):
        edges = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]]) / sigma
        new = np.empty_like(c)
        for i in range(levels):
            a, b = edges[i], edges[i + 1]
            pa = _phi(a) if np.isfinite(a) else 0.0
            pb = _phi(b) if np.isfinite(b) else 0.0
            mass = (_Phi(b) if np.isfinite(b) else 1.0) - (_Phi(a) if np.isfinite(a) else 0.0)
            new[i] = sigma * (pa - pb) / mass
        if np.max(np.abs(new - c)) < 1e-15:
            c = new
            break
        c = new
    return c


def _erfinv(y):
    # Newton on erf; enough for a starting point.
    x = 0.0
    for _ in range(100):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def hadamard(d):
    """Orthonormal Sylvester Walsh-Hadamard matrix [d, d] (d a power of two)."""
    if d & (d - 1):
        raise ValueError("vLLM's scheme needs a power-of-two head_dim, got %d" % d)
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def fp16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def fp8_e4m3(x):
    """Round to FP8 e4m3 (3 mantissa bits, bias 7, max 448, subnormals), nearest-even."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    e = np.floor(np.log2(np.maximum(a, 1e-30)))
    e = np.maximum(e, -6)  # subnormal spacing below 2^-6
    step = 2.0 ** (e - 3)
    r = np.round(a / step) * step
    return (np.sign(x) * np.minimum(r, 448.0)).astype(np.float32)


class KeyCodec:
    def __init__(self, bits, d):
        self.bits, self.d = bits, d
        self.centroids = gaussian_codebook(bits, d)
        self.midpoints = (self.centroids[1:] + self.centroids[:-1]) / 2
        self.h = hadamard(d)

    def __call__(self, k):
        k = np.asarray(k, dtype=np.float64)
        norm = np.linalg.norm(k, axis=-1, keepdims=True)
        u = k / np.where(norm > 0, norm, 1.0)
        y = u @ self.h.T
        c = self.centroids[np.searchsorted(self.midpoints, y)]
        c /= np.linalg.norm(c, axis=-1, keepdims=True)  # norm correction
        return (fp16(norm) * (c @ self.h)).astype(np.float32)


class ValueCodec:
    def __init__(self, bits):
        self.bits = bits

    def __call__(self, v):
        v = np.asarray(v, dtype=np.float32)
        lo = v.min(axis=-1, keepdims=True)
        hi = v.max(axis=-1, keepdims=True)
        top = 2 ** self.bits - 1
        scale = fp16((hi - lo) / top)
        zero = fp16(lo)
        safe = np.where(scale > 0, scale, 1.0)
        code = np.clip(np.round((v - zero) / safe), 0, top)
        return (code * scale + zero).astype(np.float32)


def codecs(preset, d):
    key_bits, value_bits = PRESETS[preset]
    keys = fp8_e4m3 if key_bits == "fp8" else KeyCodec(key_bits, d)
    return keys, ValueCodec(value_bits)


def bytes_per_token_head(preset, d):
    key_bits, value_bits = PRESETS[preset]
    key = d if key_bits == "fp8" else -(-d * key_bits // 8) + 2
    slot = key + -(-d * value_bits // 8) + 4
    return slot + (slot % 2)


def cache(preset, d, windows=None, codec_layers=None):
    """Attention backend: every K/V of `codec_layers` (None: all) through the
    scheme, the other layers fp16."""
    k, v = codecs(preset, d)
    return attention.NumpyCache(k, v, windows=windows, codec_layers=codec_layers)
