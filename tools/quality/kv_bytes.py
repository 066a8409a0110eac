"""Bytes per token, counted honestly, for a KV-cache row at any context length.

The cache stores, per (layer, KV head, token), the preset's slot; the first
`sinks` tokens and the last `recent` tokens of a layer also have an fp16 K+V
copy (4 * head_dim bytes), which attention reads (tqkv keeps every token
compressed, so a token no longer among the recent ones is read compressed; this is how
the server counts them, kernels/kv_layout.cc KvLayout::layer_bytes). The
layers named in `protected` use their own preset, the first/last `boundary`
layers the boundary preset (fp16 by default). A centered recipe also keeps
one mean key per (layer, KV head): counted as `mean_bytes` (fp32 by default).

Sliding-window layers (Layout.windows: Gemma 3's local layers). One the
cache serves (it is in Layout.served) holds tokens [held_begin, T) with
held_begin = s + 1 - window, s the first position of the layer's last append
(cache/kv_cache.h): exactly `window` tokens after a one-token decode step,
window + n - 1 after an n-token append, all T after a whole-text prefill
(`last_append`, default 1). Its exact sink copies go with the sinks. One the
cache does not serve holds min(T, window) tokens at fp16.

    bits/coordinate = 8 * bytes(T) / (2 * kv_heads * head_dim * held(T))

where held(T) counts the token slots the model needs kept: T on every
full-attention layer, min(T, window) on a sliding-window layer. So fp16 and
bf16 are 16 at every length, and 16 / bits is the ratio against a bf16 cache
that also keeps only each window (window_aware_bf16_bytes: the honest
baseline, what vLLM's hybrid allocator or any window-aware cache holds).
naive_bf16_bytes keeps every token in every layer, as a cache that ignores
windows must: a ratio against it credits the window to the codec.
"""
from dataclasses import dataclass, field
from typing import Dict


@dataclass
class Layout:
    layers: int                   # all layers of the model
    kv_heads: int
    head_dim: int
    served: list                  # layers the tqkv cache holds, in order
    windows: Dict[int, int] = field(default_factory=dict)  # sliding-window layers' windows


def fp16_slot(head_dim):
    return 4 * head_dim


def held_begin(tokens, window, last_append=1):
    """First token a served sliding-window layer holds after its last append
    of `last_append` tokens (0 for a full-attention layer: window None/0)."""
    if not window:
        return 0
    start = tokens - min(max(last_append, 1), tokens)
    return max(0, start + 1 - window)


def row_bytes(layout, tokens, slot, sinks=0, recent=0, protected=None, boundary=0,
              boundary_slot=None, mean_bytes=None, centered=False, last_append=1):
    """Total bytes at `tokens` tokens. slot: bytes per (token, head) of the
    preset; protected: {served-layer index: slot}; boundary: first/last layers
    (of the served ones) at boundary_slot (default fp16); last_append: tokens
    in each layer's last append (sliding-window layers, see above)."""
    d, h = layout.head_dim, layout.kv_heads
    fp = fp16_slot(d)
    sink_end = min(tokens, sinks)
    recent_begin = max(sink_end, tokens - recent)
    total = 0
    n = len(layout.served)
    for i, layer in enumerate(layout.served):
        s = slot
        if boundary and (i < boundary or i >= n - boundary):
            s = fp if boundary_slot is None else boundary_slot
        if protected and i in protected:
            s = protected[i]
        begin = held_begin(tokens, layout.windows.get(layer), last_append)
        exact = max(0, sink_end - begin) + (tokens - max(recent_begin, begin))
        total += h * ((tokens - begin) * s + exact * fp)
        if centered:
            total += h * (4 * d if mean_bytes is None else mean_bytes)
    return total + unserved_bytes(layout, tokens)


def unserved_bytes(layout, tokens):
    """fp16 bytes of the sliding-window layers the cache does not serve."""
    served = set(layout.served)
    return sum(layout.kv_heads * min(tokens, w) * fp16_slot(layout.head_dim)
               for layer, w in layout.windows.items() if layer not in served)


def held_tokens(layout, tokens):
    """Token slots over all layers that attention needs at context `tokens`."""
    return (tokens * (layout.layers - len(layout.windows))
            + sum(min(tokens, w) for w in layout.windows.values()))


def window_aware_bf16_bytes(layout, tokens):
    return held_tokens(layout, tokens) * layout.kv_heads * fp16_slot(layout.head_dim)


def naive_bf16_bytes(layout, tokens):
    return layout.layers * tokens * layout.kv_heads * fp16_slot(layout.head_dim)


def bits_per_coordinate(layout, tokens, total_bytes):
    return 8.0 * total_bytes / (held_tokens(layout, tokens) * layout.kv_heads * layout.head_dim * 2)


def ratio_vs_bf16(bits):
    return 16.0 / bits
