"""Bytes per token, counted honestly, for a KV-cache row at any context length.

The cache stores, per (layer, KV head, token), the preset's slot; the first
`sinks` tokens and the last `window` tokens of a layer also have an fp16 K+V
copy (4 * head_dim bytes), which attention reads (tqkv keeps every token
compressed, so a token leaving the window is read compressed; this is how
the server counts them, kernels/kv_layout.cc KvLayout::layer_bytes). The
layers named in `protected` use their own preset, the first/last `boundary`
layers the boundary preset (fp16 by default).
Layers a tqkv cache does not serve (sliding-window layers: Gemma 3's local
layers) hold min(T, their window) tokens at fp16. A centered recipe also keeps
one mean key per (layer, KV head): counted as `mean_bytes` (fp32 by default).

    bits/coordinate = 8 * bytes(T) / (2 * kv_heads * head_dim * held(T))

where held(T) counts the token slots the model needs kept: T on every
full-attention layer, min(T, window) on a sliding-window layer. So fp16 and
bf16 are 16 at every length, and the ratio vs bf16 is 16 / bits.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class Layout:
    layers: int                   # all layers of the model
    kv_heads: int
    head_dim: int
    served: list                  # layers the tqkv cache holds, in order
    windows: Dict[int, int] = field(default_factory=dict)  # unserved layers' windows


def fp16_slot(head_dim):
    return 4 * head_dim


def row_bytes(layout, tokens, slot, sinks=0, window=0, protected=None, boundary=0,
              boundary_slot=None, mean_bytes=None, centered=False):
    """Total bytes at `tokens` tokens. slot: bytes per (token, head) of the
    preset; protected: {served-layer index: slot}; boundary: first/last layers
    (of the served ones) at boundary_slot (default fp16)."""
    d, h = layout.head_dim, layout.kv_heads
    fp = fp16_slot(d)
    exact = min(tokens, sinks + window)
    total = 0
    n = len(layout.served)
    for i in range(n):
        s = slot
        if boundary and (i < boundary or i >= n - boundary):
            s = fp if boundary_slot is None else boundary_slot
        if protected and i in protected:
            s = protected[i]
        total += h * (tokens * s + exact * fp)
        if centered:
            total += h * (4 * d if mean_bytes is None else mean_bytes)
    for layer, w in layout.windows.items():
        total += h * min(tokens, w) * fp
    return total


def held_tokens(layout, tokens):
    """Token slots over all layers that attention reads at context `tokens`."""
    return (tokens * (layout.layers - len(layout.windows))
            + sum(min(tokens, w) for w in layout.windows.values()))


def bits_per_coordinate(layout, tokens, total_bytes):
    return 8.0 * total_bytes / (held_tokens(layout, tokens) * layout.kv_heads * layout.head_dim * 2)


def ratio_vs_bf16(bits):
    return 16.0 / bits
