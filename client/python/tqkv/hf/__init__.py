"""tqkv for Hugging Face transformers: every layer's attention served by a
tqkv-server (pip install "tqkv[hf]": torch and transformers).

    import tqkv, tqkv.hf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tqkv")
    print(tqkv.hf.config_text(tqkv.hf.cache_config(model)))   # the server's cache for it
    with tqkv.Client("localhost:50051") as client:
        out = tqkv.hf.generate(model, client, **inputs, max_new_tokens=32)

Importing tqkv.hf registers attn_implementation "tqkv" (its attention
function and mask function) with transformers. A forward with that
implementation needs a TqkvCache (tqkv/hf/_cache.py says what each forward
sends); generate() makes one, runs model.generate with it and drops the
sequences afterwards (keep=True keeps them).

cache_config(model) is the server's CacheConfig for a model (shape, RoPE,
sliding windows; tqkv/hf/_config.py says what is derived and how);
config_text() writes it as a server config file. calibrate_key_scales(model,
ids) measures per-channel key scales on calibration tokens (one forward;
tqkv/hf/_key_scales.py), and cache_config(model, key_scales=...) puts them in
the cache: at 3 bits the largest quality lever when reads fall outside the
exact recent tokens (docs/quality.md). A TqkvCache compares it
with the server's cache at construction: CacheMismatch (shape or windows
differ: attention would be wrong), RopeMismatchWarning (pre-RoPE centering
with another RoPE: exact, but compresses worse), Unsupported (what no
server can do). Gemma 2's attention logit soft-capping travels with every
step (logit_softcap).

Tested with transformers 5.25.0 and torch 2.15.0 (scripts/python_env.sh).
"""
try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("tqkv.hf needs torch and transformers: pip install 'tqkv[hf]' (%s)"
                      % error) from error

from tqkv.hf._attention import ATTN_IMPLEMENTATION, register, tqkv_attention, tqkv_mask
from tqkv.hf._cache import TqkvCache, TqkvLayer
from tqkv.hf._config import (DEFAULT_PRESET, CacheMismatch, ModelSpec, Rope,
                             RopeMismatchWarning, Unsupported, cache_config, config_text,
                             model_spec)
from tqkv.hf._helpers import generate, perplexity, served, token_nll
from tqkv.hf._key_scales import calibrate_key_scales, calibration_text

register()

__all__ = ["ATTN_IMPLEMENTATION", "CacheMismatch", "DEFAULT_PRESET", "ModelSpec", "Rope",
           "RopeMismatchWarning", "TqkvCache", "TqkvLayer", "Unsupported", "cache_config",
           "calibrate_key_scales", "calibration_text", "config_text", "generate", "model_spec", "perplexity", "register", "served", "token_nll",
           "tqkv_attention", "tqkv_mask"]
