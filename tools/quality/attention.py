"""Attention backends for the numpy forward passes (llama.py, gemma.py).

A backend is called as attend(layer, q, k, v, start=0): q [n, H, D] are the
queries of positions start..start+n-1, k and v [n, KVH, D] the new tokens'
keys and values (post-RoPE). A stateful backend keeps every layer's K/V, so a
prefill (start 0) followed by one-token calls (start = tokens so far) is a
decode through a cache. Query t sees tokens 0..t, or only the last `window`
of them on a sliding-window layer (window includes the query's own token).
"""
import numpy as np


def causal_attention(q, k, v, start=0, window=None, block=256):
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, KVH, D].
    float32 with a float64 softmax denominator; scale 1/sqrt(D). Query blocks
    read only the keys they can see (causal, and the window)."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = np.float32(1.0 / np.sqrt(d))
    out = np.empty((n, heads, d), dtype=np.float32)
    for s in range(0, n, block):
        e = min(n, s + block)
        first = 0 if not window else max(0, start + s - window + 1)
        last = start + e  # keys [first, last)
        qpos = np.arange(start + s, start + e)[:, None]
        kpos = np.arange(first, last)[None, :]
        mask = kpos > qpos
        if window:
            mask |= kpos <= qpos - window
        for h in range(kv_heads):
            qs = np.ascontiguousarray(q[s:e, h * group:(h + 1) * group]).reshape(-1, d)
            logits = (qs @ k[first:last, h].T).reshape(e - s, group, -1)
            logits *= scale
            logits[np.broadcast_to(mask[:, None, :], logits.shape)] = -np.inf
            logits -= logits.max(axis=2, keepdims=True)
            np.exp(logits, out=logits)
            logits /= logits.sum(axis=2, keepdims=True, dtype=np.float64).astype(np.float32)
            out[s:e, h * group:(h + 1) * group] = (
                logits.reshape(-1, last - first) @ v[first:last, h]).reshape(e - s, group, d)
    return out


def causal_attention_lse(q, k, v, window=None):
    """(out, lse) of q [n, H, D] over k, v [n, KVH, D], the same n tokens
    (causal among them, the last `window` on a sliding-window layer): out
    float32, lse float64 [n, H] of the scaled logits (scale 1/sqrt(D)), so
    it merges with another part by merge_lse."""
    n, heads, d = q.shape
    group = heads // k.shape[1]
    pos = np.arange(n)
    mask = pos[None, :] > pos[:, None]
    if window:
        mask |= pos[None, :] <= pos[:, None] - window
    out = np.empty((n, heads, d), dtype=np.float32)
    lse = np.empty((n, heads))
    for h in range(k.shape[1]):
        qs = q[:, h * group:(h + 1) * group].astype(np.float64)
        logits = np.einsum("ngd,td->ngt", qs, k[:, h].astype(np.float64)) / np.sqrt(d)
        logits[np.broadcast_to(mask[:, None, :], logits.shape)] = -np.inf
        top = logits.max(axis=2, keepdims=True)
        w = np.exp(logits - top)
        total = w.sum(axis=2, keepdims=True)
        out[:, h * group:(h + 1) * group] = np.einsum("ngt,td->ngd", w / total, v[:, h])
        lse[:, h * group:(h + 1) * group] = (top + np.log(total))[..., 0]
    return out, lse


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint sets of tokens from each set's (out, lse)
    [n, H, D] / [n, H]; a part with lse -inf (no tokens) weighs 0."""
    lse_a = np.asarray(lse_a, dtype=np.float64)
    lse_b = np.asarray(lse_b, dtype=np.float64)
    top = np.maximum(lse_a, lse_b)
    a, b = np.exp(lse_a - top), np.exp(lse_b - top)
    return ((out_a * a[..., None] + out_b * b[..., None]) / (a + b)[..., None]).astype(np.float32)


def fp16_round(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


class NumpyCache:
    """Stateful numpy attention: every K/V goes through key_codec / value_codec
    ([tokens, KVH, D] -> same shape; identity when None) once, when it is
    appended, and attention reads the stored (decoded) K/V. `codec_layers`:
    the layers the codecs apply to (None: all); other layers store fp16 when
    `other_fp16`, else float32. `windows`: {layer: sliding window}."""

    def __init__(self, key_codec=None, value_codec=None, windows=None, codec_layers=None,
                 other_fp16=True):
        self.key_codec, self.value_codec = key_codec, value_codec
        self.windows = windows or {}
        self.codec_layers = None if codec_layers is None else set(codec_layers)
        self.other_fp16 = other_fp16
        self.k, self.v = {}, {}

    def _codecs(self, layer):
        if self.codec_layers is None or layer in self.codec_layers:
            return self.key_codec, self.value_codec
        return (fp16_round, fp16_round) if self.other_fp16 else (None, None)

    def __call__(self, layer, q, k, v, start=0):
        kc, vc = self._codecs(layer)
        k = np.asarray(k, dtype=np.float32) if kc is None else kc(k)
        v = np.asarray(v, dtype=np.float32) if vc is None else vc(v)
        if start == 0:
            self.k[layer], self.v[layer] = k, v
        else:
            if self.k[layer].shape[0] != start:
                raise ValueError("layer %d holds %d tokens, append at %d"
                                 % (layer, self.k[layer].shape[0], start))
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
        return causal_attention(q, self.k[layer], self.v[layer], start, self.windows.get(layer))

    def copy(self):
        other = NumpyCache(self.key_codec, self.value_codec, self.windows, self.codec_layers,
                           self.other_fp16)
        other.k, other.v = dict(self.k), dict(self.v)
        return other


def exact(windows=None):
    """float32 K/V, no rounding: the reference."""
    return NumpyCache(windows=windows, other_fp16=False)


def fp16(windows=None):
    """K/V rounded to fp16: what an fp16 KV cache holds."""
    return NumpyCache(fp16_round, fp16_round, windows=windows)


class Router:
    """Routes each layer to one of several backends. `groups`: [(layers,
    backend)]; a layer of a group goes to its backend renumbered to its index
    in that group's list (a cache that holds only those layers); any other
    layer to `rest` (e.g. a NumpyCache at fp16 for layers no cache serves)."""

    def __init__(self, groups, rest=None):
        self.route = {}
        for layers, backend in groups:
            for i, layer in enumerate(layers):
                self.route[layer] = (backend, i)
        self.rest = rest

    def __call__(self, layer, q, k, v, start=0):
        if layer in self.route:
            backend, index = self.route[layer]
            return backend(index, q, k, v, start=start)
        return self.rest(layer, q, k, v, start=start)
