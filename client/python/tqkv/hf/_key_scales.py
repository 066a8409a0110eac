"""Per-channel key scales (CacheConfig.key_scales) calibrated on a model's
own queries and keys.

A cache that centers keys stores each key's residual r_t = k_t - R_t m (m
the sequence's key mean, R_t its rotary embedding at position t) through a
3- or 4-bit codec whose error is about isotropic with a size set by |r|. A
logit q . r then loses most where q is large and r is not. With scales s the
cache stores r / s and reads it with q * s: the same logit exactly, but the
codec's error moves to where queries are small. For one (layer, KV head),
E[((q * s) . e)^2] with e the error of r / s is least at
s_j^2 = rms(r_j) / rms(q_j). One scale per RoPE pair (both coordinates of a
pair share their joint root mean square) commutes with RoPE and measured
better than one per coordinate; coordinates outside the rotary dims keep
their own. Each head's scales are divided by their geometric mean (a common
factor changes nothing). docs/quality.md measures what they buy.

calibrate_key_scales(model, input_ids) runs the model once over calibration
tokens (any text but the one to be served; calibration_text() is one every
Python has) with eager attention, captures every layer's queries and keys
(post-RoPE, as a TqkvCache sends them), forms the residual the server forms
(cache/kv_cache_append.cc: the mean of tokens [sinks, sinks + centering_tokens)
rotated back by the layer's RoPE, its strongest centering_pairs pairs kept)
and returns float32 [layers, kv_heads, head_dim] in the model's coordinate
order. cache_config(model, key_scales=scales) writes them into the cache
(moved to the cache's pair layout when it differs from the model's).
"""
import math
import sys
from typing import Dict, Optional, Tuple

import numpy as np

from tqkv._errors import InvalidArgument
from tqkv.v1 import kvcache_pb2 as pb

CAPTURE_IMPLEMENTATION = "tqkv_key_scales"
# The *_csw presets' recipe (kernels/preset.cc; CacheConfig's defaults).
DEFAULT_SINKS = 4
DEFAULT_CENTERING_TOKENS = 64
DEFAULT_CENTERING_PAIRS = 8


def calibration_text() -> str:
    """About 0.5 MB of English prose and code that ships with every Python
    (the pydoc topics): calibration text no served text is likely to be."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


# -- RoPE, as the server's RopeTable computes it (kernels/key_centering.h) ----

def inv_freq(rope, head_dim: int) -> np.ndarray:
    """float64 [rotary_dims / 2]: each pair's frequency for a Rope of _config."""
    if rope.inv_freq:
        return np.asarray(rope.inv_freq, dtype=np.float64)
    d = rope.rotary_dims or head_dim
    f = rope.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if rope.scaling_type == "linear":
        return f / rope.scaling_factor
    if rope.scaling_type == "llama3":
        factor, lo, hi = rope.scaling_factor, rope.low_freq_factor, rope.high_freq_factor
        old = rope.original_max_position
        wavelen = 2 * math.pi / f
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, f / factor, f)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return np.where(mid, (1 - smooth) * f / factor + smooth * f, scaled)
    return f


def pair_index(rope, head_dim: int) -> Tuple[np.ndarray, np.ndarray]:
    """(first, second) coordinates of each rotary pair."""
    d = rope.rotary_dims or head_dim
    if rope.pair_layout == pb.RotaryEmbedding.INTERLEAVED:
        return np.arange(0, d, 2), np.arange(1, d, 2)
    return np.arange(d // 2), np.arange(d // 2, d)


def rotate(rope, head_dim: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [T, heads, head_dim] rotated by R_t at each position t (negative
    positions rotate back)."""
    angles = positions.astype(np.float64)[:, None] * inv_freq(rope, head_dim)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = pair_index(rope, head_dim)
    out = np.array(x, dtype=np.float64, copy=True)
    out[:, :, a] = x[:, :, a] * cos - x[:, :, b] * sin
    out[:, :, b] = x[:, :, a] * sin + x[:, :, b] * cos
    return out


# -- the rule -------------------------------------------------------------------------

def key_mean(rope, keys: np.ndarray, sinks: int, centering_tokens: int,
             centering_pairs: int) -> np.ndarray:
    """The server's mean of a first append of keys [T, kv_heads, head_dim]
    (post-RoPE, positions 0..T-1): float64 [kv_heads, head_dim], pre-RoPE."""
    n, head_dim = len(keys), keys.shape[-1]
    begin = sinks if sinks < n else 0
    end = min(n, begin + centering_tokens)
    positions = np.arange(begin, end)
    m = rotate(rope, head_dim, keys[begin:end], -positions).mean(0)
    if centering_pairs:
        a, b = pair_index(rope, head_dim)
        for h in range(m.shape[0]):
            energy = m[h, a] ** 2 + m[h, b] ** 2
            drop = np.argsort(-energy, kind="stable")[centering_pairs:]
            m[h, a[drop]] = 0.0
            m[h, b[drop]] = 0.0
    return m


def pair_rms(rope, head_dim: int, rms: np.ndarray) -> np.ndarray:
    """rms [..., head_dim] with both coordinates of each rotary pair set to
    the pair's root mean square."""
    if rope is None:
        return rms
    a, b = pair_index(rope, head_dim)
    out = rms.copy()
    joint = np.sqrt((rms[..., a] ** 2 + rms[..., b] ** 2) / 2)
    out[..., a] = joint
    out[..., b] = joint
    return out


def layer_scales(rope, queries: np.ndarray, keys: np.ndarray, *, sinks: int = DEFAULT_SINKS,
                 centering_tokens: int = DEFAULT_CENTERING_TOKENS,
                 centering_pairs: int = DEFAULT_CENTERING_PAIRS) -> np.ndarray:
    """One layer's scales, float32 [kv_heads, head_dim], from its queries
    [T, query_heads, head_dim] and keys [T, kv_heads, head_dim] at positions
    0..T-1 (post-RoPE; rope None: the layer has none, keys centered as they
    are). Statistics over the tokens after the sinks."""
    tokens, kv_heads, head_dim = keys.shape
    if queries.shape[0] != tokens or queries.shape[1] % kv_heads or queries.shape[2] != head_dim:
        raise InvalidArgument("queries %s do not match keys %s" % (queries.shape, keys.shape))
    if tokens <= sinks + 1:
        raise InvalidArgument("%d calibration tokens: want more than the %d sinks + 1"
                              % (tokens, sinks))
    keys = keys.astype(np.float64)
    if rope is None:
        mean = keys[min(sinks, tokens - 1):][:centering_tokens].mean(0)
        residual = keys - mean[None]
    else:
        mean = key_mean(rope, keys, sinks, centering_tokens, centering_pairs)
        positions = np.arange(tokens)
        residual = keys - rotate(rope, head_dim, np.broadcast_to(mean[None], keys.shape), positions)
    r = residual[sinks:]
    group = queries.shape[1] // kv_heads
    q = queries[sinks:].astype(np.float64).reshape(-1, kv_heads, group, head_dim)
    rms_r = pair_rms(rope, head_dim, np.sqrt((r ** 2).mean(0)) + 1e-12)
    rms_q = pair_rms(rope, head_dim, np.sqrt((q ** 2).mean((0, 2))) + 1e-12)
    s = np.sqrt(rms_r / rms_q)
    s /= np.exp(np.log(s).mean(-1, keepdims=True))
    return s.astype(np.float32)


# -- capturing a model's queries and keys ---------------------------------------------

def _capture_attention(store: Dict[int, Tuple[np.ndarray, np.ndarray]]):
    def attention(module, query, key, value, attention_mask, **kwargs):
        # query [batch, query_heads, T, D], key [batch, kv_heads, T, D]: row 0.
        store[module.layer_idx] = (query[0].transpose(0, 1).detach().float().cpu().numpy(),
                                   key[0].transpose(0, 1).detach().float().cpu().numpy())
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise InvalidArgument("%s has no eager_attention_forward to calibrate with"
                                  % type(module).__module__)
        return eager(module, query, key, value, attention_mask, **kwargs)
    return attention


def capture(model, input_ids) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    """layer -> (queries [T, query_heads, D], keys [T, kv_heads, D]) of one
    forward of input_ids' first row, eager attention, no cache."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    store: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_attention(store))
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, eager_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        with torch.no_grad():
            model(torch.as_tensor(input_ids)[:1], use_cache=False)
    finally:
        model.set_attn_implementation(before)
    return store


def calibrate_key_scales(model, input_ids, *, sinks: int = DEFAULT_SINKS,
                         centering_tokens: int = DEFAULT_CENTERING_TOKENS,
                         centering_pairs: int = DEFAULT_CENTERING_PAIRS,
                         spec=None) -> np.ndarray:
    """float32 [layers, kv_heads, head_dim]: each layer's key scales (see the
    module's docstring) measured on one forward of input_ids (its first row;
    about 1024 tokens of text other than the served one). sinks,
    centering_tokens and centering_pairs are the cache's recipe (the *_csw
    presets' by default); spec, the model's ModelSpec (derived when None),
    gives each layer its RoPE."""
    from tqkv.hf._config import model_spec

    spec = spec or model_spec(model)
    store = capture(model, input_ids)
    if len(store) != spec.layers:
        raise InvalidArgument("the forward reached %d of %d layers" % (len(store), spec.layers))
    out = np.ones((spec.layers, spec.kv_heads, spec.head_dim), dtype=np.float32)
    for layer, (queries, keys) in store.items():
        out[layer] = layer_scales(layer_rope(spec, layer), queries, keys, sinks=sinks,
                                  centering_tokens=centering_tokens, centering_pairs=centering_pairs)
    return out


def layer_rope(spec, layer: int):
    """The RoPE a layer's keys carry: the spec's, or its other one for the
    layers of the other type (Gemma 3)."""
    if spec.rope is None or spec.other_rope is None:
        return spec.rope
    sliding = layer in spec.windows
    return spec.rope if sliding == (spec.rope_of == "sliding") else spec.other_rope


def add_to_config(config, scales: np.ndarray, permutation: Optional[list] = None):
    """Writes scales [layers, kv_heads, head_dim] into a CacheConfig's
    key_scales (coordinates moved by `permutation`, key_permutation's, when
    the cache's pair layout is not the model's)."""
    scales = np.asarray(scales, dtype=np.float32)
    want = (config.num_layers, config.num_kv_heads, config.head_dim)
    if scales.shape != want:
        raise InvalidArgument("key scales have shape %s, the cache %s" % (scales.shape, want))
    if not np.all(np.isfinite(scales)) or np.any(scales <= 0):
        raise InvalidArgument("key scales must be finite and > 0")
    if permutation is not None:
        scales = scales[..., permutation]
    del config.key_scales[:]
    for layer in range(scales.shape[0]):
        config.key_scales.add(layer=layer, scales=scales[layer].reshape(-1).tolist())
