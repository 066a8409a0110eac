"""RoPE as the tqkv cache config describes it, applied in numpy.

A description is a dict with the fields of CacheConfig.rope:
    rotary_dims    coordinates that rotate (the first rotary_dims of a head)
    pair_layout    "interleaved": pairs (2i, 2i+1) (llama.cpp NORM; GGUF llama
                   weights are permuted to it); "half_split": pairs
                   (i, i + rotary_dims/2) (NEOX / HF rotate_half)
    base           theta_i = base^(-2i / rotary_dims)
    scaling_type   "none" | "linear" (theta_i / factor) | "llama3"
    scaling_factor, low_freq_factor, high_freq_factor, original_max_position
                   (llama3: Llama 3.1's frequency-dependent scaling)
    inv_freq       explicit per-pair inverse frequencies (overrides the above)
Pair i at position t rotates by angle t * inv_freq[i].
"""
import math

import numpy as np

INTERLEAVED, HALF_SPLIT = "interleaved", "half_split"


def spec(rotary_dims, pair_layout, base, scaling_type="none", scaling_factor=1.0,
         low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192, inv_freq=None):
    if pair_layout not in (INTERLEAVED, HALF_SPLIT):
        raise ValueError("pair_layout %r" % pair_layout)
    if scaling_type not in ("none", "linear", "llama3"):
        raise ValueError("scaling_type %r" % scaling_type)
    out = {"rotary_dims": int(rotary_dims), "pair_layout": pair_layout, "base": float(base),
           "scaling_type": scaling_type}
    if scaling_type != "none":
        out["scaling_factor"] = float(scaling_factor)
    if scaling_type == "llama3":
        out.update(low_freq_factor=float(low_freq_factor), high_freq_factor=float(high_freq_factor),
                   original_max_position=int(original_max_position))
    if inv_freq is not None:
        out["inv_freq"] = [float(x) for x in inv_freq]
    return out


def inv_freq(s):
    """float64 [rotary_dims / 2]."""
    if s.get("inv_freq") is not None:
        return np.asarray(s["inv_freq"], dtype=np.float64)
    d = s["rotary_dims"]
    f = s["base"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    kind = s.get("scaling_type", "none")
    if kind == "linear":
        f = f / s["scaling_factor"]
    elif kind == "llama3":
        factor, lo, hi = s["scaling_factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position"]
        wavelen = 2 * math.pi / f
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, f / factor, f)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        f = np.where(mid, (1 - smooth) * f / factor + smooth * f, scaled)
    return f


def pair_index(s):
    """(first, second) coordinate indices [rotary_dims / 2] of each pair."""
    d = s["rotary_dims"]
    if s["pair_layout"] == INTERLEAVED:
        return np.arange(0, d, 2), np.arange(1, d, 2)
    return np.arange(d // 2), np.arange(d // 2, d)


def apply(s, x, positions, inverse=False):
    """Rotate x [T, heads, head_dim] (float32) at positions [T]."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq(s)[None, :]
    if inverse:
        angles = -angles
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    a, b = pair_index(s)
    out = np.array(x, dtype=np.float32, copy=True)
    xa, xb = x[:, :, a], x[:, :, b]
    out[:, :, a] = xa * cos - xb * sin
    out[:, :, b] = xa * sin + xb * cos
    return out


def config_text(s):
    """The `rope { ... }` block of a text-format CacheConfig."""
    parts = ["rotary_dims: %d" % s["rotary_dims"],
             "pair_layout: %s" % s["pair_layout"].upper(), "base: %r" % s["base"],
             'scaling_type: "%s"' % s.get("scaling_type", "none")]
    if s.get("scaling_type", "none") != "none":
        parts.append("scaling_factor: %r" % s["scaling_factor"])
    if s.get("scaling_type") == "llama3":
        parts += ["low_freq_factor: %r" % s["low_freq_factor"],
                  "high_freq_factor: %r" % s["high_freq_factor"],
                  "original_max_position: %d" % s["original_max_position"]]
    if s.get("inv_freq") is not None:
        parts.append("inv_freq: [%s]" % ", ".join("%r" % x for x in s["inv_freq"]))
    return "rope { %s }" % " ".join(parts)
