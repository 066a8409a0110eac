"""The attention function registered as attn_implementation "tqkv", its mask
function, and the exact local attention a prefill node computes.

transformers calls, per layer: cache.update(key, value, layer) and then the
attention function with the layer's queries and what update returned. A
TqkvCache's update returns the new tokens' K/V unchanged and leaves a note
(_PENDING: the cache, the layer and those very tensors); the attention
function picks the note up and lets the cache attend: locally over the
prompt's own K/V on the prefill forward, else by one DecodeStream message.
Without a TqkvCache there is no note, and the function says what to pass.

Masks. For attn_implementation "tqkv" transformers builds its masks with
tqkv_mask: the sdpa boolean mask [batch, 1, query tokens, kv tokens], always
materialized (True: attend), over the padded token axis that the cache's
layers report (every token seen, pads included; sliding windows and padding
applied by transformers' own mask functions). From it the cache reads which
new tokens are real: token i of the query block is real when it may attend
to itself (the diagonal), a pad otherwise (its column is masked for every
query). Pads are neither stored nor attended; their output rows are zero.
"""
import contextvars
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tqkv._errors import FailedPrecondition
from tqkv.hf._config import Unsupported

ATTN_IMPLEMENTATION = "tqkv"


@dataclass
class Pending:
    """What TqkvLayer.update left for the attention call that follows it."""
    cache: object
    layer: int
    key: torch.Tensor
    value: torch.Tensor


_PENDING: "contextvars.ContextVar[Optional[Pending]]" = contextvars.ContextVar(
    "tqkv_hf_pending", default=None)


def leave_note(pending: Pending):
    _PENDING.set(pending)


def take_note(layer: int, key: torch.Tensor) -> Pending:
    """The note of the TqkvCache update for this layer and key, or a
    FailedPrecondition saying how to serve the model."""
    pending = _PENDING.get()
    _PENDING.set(None)
    if pending is None or pending.key is not key or pending.layer != layer:
        raise FailedPrecondition(
            "attn_implementation %r serves attention from a tqkv-server and needs a "
            "tqkv.hf.TqkvCache: pass cache=TqkvCache(model, client) to the forward or to "
            "generate() (or use tqkv.hf.generate)" % ATTN_IMPLEMENTATION)
    return pending


def tqkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """transformers' attention interface: query [batch, query_heads, tokens,
    head_dim], key/value [batch, kv_heads, tokens, head_dim] (the new tokens,
    post-RoPE), attention_mask from tqkv_mask. Returns (output [batch,
    tokens, query_heads, head_dim], None). softcap (Gemma 2's
    attn_logit_softcapping) travels with every message as logit_softcap.
    Raises Unsupported for training-time dropout."""
    if dropout and getattr(module, "training", False):
        raise Unsupported("attention dropout (training) is not served; call model.eval()")
    pending = take_note(module.layer_idx, key)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    output = pending.cache.attend(pending.layer, query, key, value, attention_mask,
                                  float(scaling), sinks, kwargs.get("softcap"))
    return output, None


def tqkv_mask(**kwargs):
    """The mask function for attn_implementation "tqkv": transformers' sdpa
    boolean mask, never skipped (the cache reads the padding from it)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(**kwargs)


def register():
    """Registers "tqkv" with transformers' AttentionInterface and
    AttentionMaskInterface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tqkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, tqkv_mask)


# -- masks ----------------------------------------------------------------------------

def allowed(mask, tokens: int, kv_tokens: int, window: Optional[int]) -> torch.Tensor:
    """Boolean [batch or 1, 1, tokens, kv_tokens], True where a query may
    attend: the mask as given (bool, or an additive float mask whose masked
    entries are hugely negative), or causal (and windowed) when None."""
    if mask is None:
        q = torch.arange(kv_tokens - tokens, kv_tokens).view(-1, 1)
        k = torch.arange(kv_tokens).view(1, -1)
        ok = k <= q
        if window:
            ok &= k > q - window
        return ok.view(1, 1, tokens, kv_tokens)
    if mask.dtype == torch.bool:
        return mask[..., -kv_tokens:]
    return mask[..., -kv_tokens:] > torch.finfo(mask.dtype).min / 2


def real_tokens(mask, batch: int, tokens: int) -> np.ndarray:
    """bool [batch, tokens]: which new tokens are real (may attend to
    themselves) rather than padding."""
    if mask is None:
        return np.ones((batch, tokens), dtype=bool)
    ok = allowed(mask, tokens, mask.shape[-1], None)[:, 0]
    kv = ok.shape[-1]
    i = torch.arange(tokens)
    diagonal = ok[:, i, kv - tokens + i]
    return np.ascontiguousarray(diagonal.expand(batch, tokens).cpu().numpy())


# -- exact local attention --------------------------------------------------------------

def exact_attention(query, key, value, mask, scaling: float, sinks=None,
                    window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Attention of the new tokens over themselves, as transformers' eager
    attention computes it (products in the model's dtype, logits soft-capped
    with a softcap, softmax in float32): what a prefill node computes before
    it stores the prompt. Returns [batch, tokens, query_heads, head_dim]."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    ok = allowed(mask, query.shape[2], key.shape[2], window).to(scores.device)
    scores = scores.masked_fill(~ok, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


# -- tensors on the wire ------------------------------------------------------------------

_OUTPUT_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def wire_dtype(dtype: torch.dtype) -> str:
    """The wire dtype tensors of this torch dtype travel in (f32 otherwise)."""
    return _OUTPUT_DTYPE.get(dtype, "f32")


def to_wire(tensor: torch.Tensor) -> np.ndarray:
    """numpy of a tensor as tqkv's client sends it: float32 and float16 as they
    are, bfloat16 as uint16 bits, anything else as float32."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype not in (torch.float32, torch.float16):
        t = t.float()
    return t.numpy()


def from_wire(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` from a decoded output (uint16: bfloat16 bits)."""
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(array).to(dtype)
