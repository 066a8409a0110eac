"""Per-channel key scales that balance key and query magnitudes
(CacheConfig.key_scales), measured on calibration text.

The codec's error on a stored key residual r (after centering) is about
isotropic with a size set by |r|, so a logit q . r loses most where q is large
and r is not. Storing r / s and reading with q * s gives the same logit
exactly and moves the codec's error to where the query is small: for one
(layer, KV head), E[(q * s) . e]^2 |r / s|^2 is least at s_j^2 = rms(r_j) /
rms(q_j). Measured on real keys, one scale per RoPE pair (the pair's two
channels share the root mean square of both) holds up better than one per
channel: post-RoPE, the two channels of a pair trade energy as the position
moves, and a pair scale commutes with RoPE.

measure(model, tokens): an fp16 forward pass over calibration tokens; per
layer and KV head, the residual r_t = k_t - R_t m as a served cache computes
it (m the mean of tokens [sinks, sinks + centering_tokens), its strongest
centering_pairs pairs, the layer's own RoPE), the model's queries of that KV
head's query heads; s = sqrt(rms_r / rms_q) per RoPE pair, divided by its
geometric mean over the head (the codec does not care about a common factor).
Returns float32 [layers, kv_heads, head_dim].
"""
import numpy as np

import rope as rope_mod


def key_mean(spec, keys, sinks=4, centering_tokens=64, centering_pairs=8):
    """The served cache's mean rule (cache/kv_cache_append.cc): keys [T, KVH, D]
    post-RoPE at positions 0..T-1 -> m [KVH, D] in the pre-RoPE frame."""
    n = len(keys)
    begin = min(sinks, n)
    if begin >= n:
        begin = 0
    end = min(n, begin + centering_tokens)
    pre = rope_mod.apply(spec, keys[begin:end], np.arange(begin, end), inverse=True)
    m = pre.astype(np.float64).mean(0)
    if centering_pairs:
        a, b = rope_mod.pair_index(spec)
        for h in range(m.shape[0]):
            energy = m[h, a] ** 2 + m[h, b] ** 2
            drop = np.argsort(-energy, kind="stable")[centering_pairs:]
            m[h, a[drop]] = 0.0
            m[h, b[drop]] = 0.0
    return m.astype(np.float32)


def pair_rms(spec, rms):
    """rms [KVH, D] -> each pair's two channels set to the pair's root mean square."""
    a, b = rope_mod.pair_index(spec)
    out = rms.copy()
    p = np.sqrt((rms[:, a] ** 2 + rms[:, b] ** 2) / 2)
    out[:, a] = p
    out[:, b] = p
    return out


def measure(model, tokens, sinks=4, centering_tokens=64, centering_pairs=8):
    c = model.config
    group = c.heads // c.kv_heads
    out = np.ones((c.layers, c.kv_heads, c.head_dim), dtype=np.float32)

    def capture(layer, q, k, v):
        spec = model.rope_spec(layer)
        positions = np.arange(len(k))
        m = key_mean(spec, k, sinks, centering_tokens, centering_pairs)
        rotated = rope_mod.apply(spec, np.broadcast_to(m[None], k.shape), positions)
        r = (k - rotated)[sinks:].astype(np.float64)
        qs = q[sinks:].reshape(-1, c.kv_heads, group, c.head_dim).astype(np.float64)
        rms_r = pair_rms(spec, np.sqrt((r ** 2).mean(0)) + 1e-12)
        rms_q = pair_rms(spec, np.sqrt((qs ** 2).mean((0, 2))) + 1e-12)
        s = np.sqrt(rms_r / rms_q)
        out[layer] = s / np.exp(np.log(s).mean(-1, keepdims=True))

    model.forward(tokens, capture=capture)
    return out


def config_text(scales, layers=None):
    """CacheConfig.key_scales entries for cache layers 0.. (model layers
    `layers`, default all)."""
    layers = range(len(scales)) if layers is None else layers
    return " ".join("key_scales { layer: %d scales: [%s] }" % (
        i, ", ".join("%.6g" % x for x in scales[l].reshape(-1))) for i, l in enumerate(layers))
