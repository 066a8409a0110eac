"""The cache a Hugging Face model needs: its shape, RoPE and sliding windows.

model_spec(model_or_config) reads a transformers model, config, config.json
dict, config.json path or model folder into a ModelSpec; cache_config()
turns it into the server's CacheConfig (proto/tqkv/v1/kvcache.proto);
mismatches() compares a spec with a cache as GetServerInfo reports it.

What is derived, and from where (transformers' own config classes, so that
the legacy spellings of config.json, rope_theta / rope_scaling, are read the
way the model reads them):
  * layers, KV heads, query heads, head_dim (the text config of a
    multimodal model);
  * RoPE: rotary_dims (partial_rotary_factor x head_dim; 0 when every
    coordinate rotates), the pair layout (probed from the model family's own
    rotate_half: HALF_SPLIT for Llama, Qwen, Gemma, Mistral, gpt-oss), base
    and scaling. "none" (rope_type default), "linear" and "llama3" map onto
    the proto's fields; any other type (yarn, longrope, dynamic, ...) is
    given as the explicit inv_freq transformers computes for it at its
    original length. Where layer types have their own RoPE (Gemma 3: local
    layers base 1e4, global 1e6) the cache's `rope` is the sliding-window
    layers' and `layer_ropes` gives the full-attention layers theirs
    (rope_of="full" swaps them), as `tqkv config --from-hf` does, so every
    layer is centered with its own (another RoPE keeps attention exact but
    centers less well; the server counts such layers in
    tqkv_cache_rope_mismatches_total);
  * sliding-window layers (layer_types, or every layer when only
    sliding_window is set, as in Mistral) and their window;
  * learned sink logits (gpt-oss) and attention logit soft-capping (Gemma 2):
    not part of a CacheConfig. Both travel with every Attend (sink_logits,
    logit_softcap).
"""
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from google.protobuf import text_format

from tqkv._errors import FailedPrecondition, InvalidArgument
from tqkv.v1 import kvcache_pb2 as pb

DEFAULT_PRESET = "tqkv_k3v4u_csw"  # the server's default preset
DEFAULT_PAGE_TOKENS = 16
# rope_type values the proto names; any other is sent as explicit inv_freq.
_NAMED_SCALING = {"default": "none", "linear": "linear", "llama3": "llama3"}


class Unsupported(InvalidArgument):
    """The model needs what a tqkv-server cannot do (layers of different
    head dims, beam search, ...)."""


class CacheMismatch(FailedPrecondition):
    """The server's cache does not have the model's shape or sliding windows:
    its attention would be wrong. The message lists each difference and a
    cache config that fits."""


class RopeMismatchWarning(UserWarning):
    """The cache centers keys before RoPE with a RoPE other than the model's:
    attention stays exact, but the compression error grows (SmolLM2 with
    Llama-3.1's RoPE: +14.4% perplexity where its own gives +9.5%)."""


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding in the proto's terms (RotaryEmbedding)."""
    rotary_dims: int              # 0: all of head_dim
    pair_layout: int              # pb.RotaryEmbedding.HALF_SPLIT or INTERLEAVED
    base: float
    scaling_type: str = "none"    # none | linear | llama3 | explicit
    scaling_factor: float = 0.0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position: int = 0
    inv_freq: Tuple[float, ...] = ()

    def proto(self) -> "pb.RotaryEmbedding":
        r = pb.RotaryEmbedding(rotary_dims=self.rotary_dims, pair_layout=self.pair_layout,
                               base=self.base)
        if self.inv_freq:
            r.inv_freq.extend(self.inv_freq)
            return r
        if self.scaling_type != "none":
            r.scaling_type = self.scaling_type
            r.scaling_factor = self.scaling_factor
        if self.scaling_type == "llama3":
            r.low_freq_factor = self.low_freq_factor
            r.high_freq_factor = self.high_freq_factor
            r.original_max_position = self.original_max_position
        return r


@dataclass
class ModelSpec:
    """What a tqkv cache must match to serve a model's attention."""
    model_type: str
    layers: int
    kv_heads: int
    query_heads: int
    head_dim: int
    rope: Optional[Rope]
    # The other layers' RoPE where sliding and full layers rotate differently
    # (Gemma 3): the cache's layer_ropes; rope_of says which type `rope` is.
    other_rope: Optional[Rope] = None
    rope_of: str = "sliding"
    windows: Dict[int, int] = field(default_factory=dict)  # layer -> window (sliding layers)
    sinks: bool = False                  # learned sink logits per query head (gpt-oss)
    softcap: Optional[float] = None      # attention logit soft-capping (Gemma 2)
    notes: List[str] = field(default_factory=list)

    def window(self, layer: int) -> Optional[int]:
        return self.windows.get(layer)


# -- reading a config -----------------------------------------------------------

def load_config(model_or_config):
    """The transformers text config of a model, a config, a config.json dict,
    or a path to config.json or to a model folder (read locally, never
    downloaded)."""
    from transformers import AutoConfig, PretrainedConfig

    obj = model_or_config
    if hasattr(obj, "config") and isinstance(getattr(obj, "config"), PretrainedConfig):
        obj = obj.config
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise InvalidArgument("no config.json at %s" % path)
        with open(path) as f:
            obj = json.load(f)
    if isinstance(obj, dict):
        data = dict(obj)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise InvalidArgument("config has no model_type: want a Hugging Face config.json")
        obj = AutoConfig.for_model(model_type, **data)
    if not isinstance(obj, PretrainedConfig):
        raise InvalidArgument("want a transformers model, config, config.json dict or path; "
                              "got %s" % type(obj).__name__)
    return obj.get_text_config(decoder=True)


def _head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    if not head_dim:
        head_dim = config.hidden_size // config.num_attention_heads
    return int(head_dim)


def _layer_types(config) -> List[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    window = getattr(config, "sliding_window", None)
    kind = "sliding_attention" if window else "full_attention"
    return [kind] * config.num_hidden_layers


def _windows(config, types) -> Dict[int, int]:
    out = {}
    for layer, kind in enumerate(types):
        if kind in ("sliding_attention", "chunked_attention"):
            if kind == "chunked_attention":
                raise Unsupported("layer %d has chunked attention (Llama 4): a tqkv cache has "
                                  "sliding windows, not chunks" % layer)
            window = getattr(config, "sliding_window", None)
            if not window:
                raise InvalidArgument("layer %d is sliding_attention but the config has no "
                                      "sliding_window" % layer)
            out[layer] = int(window)
        elif kind not in ("full_attention",):
            raise Unsupported("layer %d is %r: tqkv serves full and sliding-window attention"
                              % (layer, kind))
    return out


# -- RoPE -------------------------------------------------------------------------

def _rope_parameters(config, layer_type: str) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    return dict(params)


def pair_layout(model_type: str) -> int:
    """The pair layout of the family's rotate_half, probed on a vector:
    half-split rotate_half(x)[0] is -x[d/2], interleaved is -x[1]. Families
    whose modeling file has no rotate_half count as HALF_SPLIT."""
    import importlib

    import torch

    try:
        module = importlib.import_module("transformers.models.%s.modeling_%s"
                                         % (model_type, model_type))
    except ImportError:
        return pb.RotaryEmbedding.HALF_SPLIT
    rotate = getattr(module, "rotate_half", None)
    if rotate is None:
        return pb.RotaryEmbedding.HALF_SPLIT
    x = torch.arange(1.0, 9.0)
    first = float(rotate(x)[0])
    if first == -x[1]:
        return pb.RotaryEmbedding.INTERLEAVED
    return pb.RotaryEmbedding.HALF_SPLIT


def _explicit_inv_freq(config, rope_type: str, layer_type: str) -> Tuple[float, ...]:
    """transformers' own inverse frequencies for a RoPE type the proto does
    not name, at the model's original length."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None:
        raise Unsupported("RoPE type %r is unknown to transformers %s"
                          % (rope_type, __import__("transformers").__version__))
    params = getattr(config, "rope_parameters", None) or {}
    keyed = isinstance(params.get(layer_type), dict)
    inv_freq, _ = init(config, None, layer_type=layer_type if keyed else None)
    return tuple(float(f) for f in inv_freq.tolist())


def model_rope(config, model_type: str, head_dim: int, types: List[str],
               rope_of: str = "sliding") -> Optional[Rope]:
    """The RoPE of the model's sliding-window layers (rope_of="full": of its
    full-attention layers) when it has both, else of its first layer; None
    for a model without RoPE."""
    if rope_of not in ("sliding", "full"):
        raise InvalidArgument("rope_of is %r; want 'sliding' or 'full'" % rope_of)
    want = "sliding_attention" if rope_of == "sliding" else "full_attention"
    layer_type = want if want in types else types[0]
    params = _rope_parameters(config, layer_type)
    base = params.get("rope_theta", getattr(config, "rope_theta", None)
                      or getattr(config, "default_theta", None))
    if base is None:
        return None
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary = int(head_dim * float(factor or 1.0))
    rotary_dims = 0 if rotary >= head_dim else rotary
    layout = pair_layout(model_type)
    rope_type = params.get("rope_type", "default") or "default"
    scaling = _NAMED_SCALING.get(rope_type)
    if scaling is None:
        return Rope(rotary_dims, layout, float(base), "explicit",
                    inv_freq=_explicit_inv_freq(config, rope_type, layer_type))
    if scaling == "none":
        return Rope(rotary_dims, layout, float(base))
    if scaling == "linear":
        return Rope(rotary_dims, layout, float(base), "linear", float(params["factor"]))
    original = params.get("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None)
                          or config.max_position_embeddings)
    return Rope(rotary_dims, layout, float(base), "llama3", float(params["factor"]),
                float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                int(original))


# -- the spec and the config ---------------------------------------------------------

def model_spec(model_or_config, rope_of: str = "sliding") -> ModelSpec:
    """The ModelSpec of a transformers model, config, config.json dict or
    path; rope_of picks the RoPE of a model whose sliding and full layers
    rotate differently. Raises Unsupported for what no tqkv cache can serve
    (layers of another kind than full or sliding-window attention)."""
    config = load_config(model_or_config)
    model_type = getattr(config, "model_type", "")
    types = _layer_types(config)
    if len(types) != config.num_hidden_layers:
        raise InvalidArgument("layer_types has %d entries for %d layers"
                              % (len(types), config.num_hidden_layers))
    head_dim = _head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    spec = ModelSpec(model_type=model_type, layers=int(config.num_hidden_layers),
                     kv_heads=int(kv_heads), query_heads=int(config.num_attention_heads),
                     head_dim=head_dim, rope=model_rope(config, model_type, head_dim, types, rope_of),
                     windows=_windows(config, types),
                     sinks=model_type in ("gpt_oss",),
                     softcap=getattr(config, "attn_logit_softcapping", None) or None)
    if spec.rope is not None and spec.windows and _has_two_ropes(config):
        other = "full" if rope_of == "sliding" else "sliding"
        spec.other_rope = model_rope(config, model_type, head_dim, types, other)
        spec.rope_of = rope_of
        spec.notes.append("sliding-window layers rotate with base %s, full-attention layers with "
                          "base %s; the cache's rope is the %s layers' and layer_ropes the other "
                          "layers' (rope_of=%r swaps them)" % (_base_words(config, "sliding_attention"),
                                      _base_words(config, "full_attention"), rope_of, other))
    if spec.rope is None:
        spec.notes.append("no RoPE found in the config: the cache gets none")
    return spec


def _has_two_ropes(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return "sliding_attention" in params and "full_attention" in params and \
        params["sliding_attention"] != params["full_attention"]


def _base_words(config, layer_type: str) -> str:
    p = config.rope_parameters[layer_type]
    return "%g (%s)" % (p.get("rope_theta", 0), p.get("rope_type", "default"))


def cache_config(model_or_config, *, preset: str = DEFAULT_PRESET, name: str = "default",
                 page_tokens: int = DEFAULT_PAGE_TOKENS, boundary_layers: int = 0,
                 memory_budget_bytes: int = 0, pair_layout: Optional[int] = None,
                 rope_of: str = "sliding", key_scales=None) -> "pb.CacheConfig":
    """The server's CacheConfig for a Hugging Face model (see the module's
    docstring for what is derived). pair_layout (pb.RotaryEmbedding.
    HALF_SPLIT or INTERLEAVED; default the model's) is the layout keys are
    stored in: a TqkvCache permutes the coordinates of keys and queries
    (their products unchanged) to the cache's layout, so that a cache shared
    with a GGUF-layout engine holds the same vectors. rope_of ("sliding" or
    "full") picks the RoPE of a model whose sliding and full layers rotate
    differently (Gemma 3), as `tqkv config --rope-of`. Raises Unsupported for
    a model the server cannot serve as it is; learned sink logits and logit
    soft-capping are not part of a cache (tqkv.hf sends them with every
    Attend). key_scales (float [layers, kv_heads, head_dim] in the
    model's coordinate order, from calibrate_key_scales) become the cache's
    key_scales, moved to its pair layout."""
    spec = model_or_config if isinstance(model_or_config, ModelSpec) \
        else model_spec(model_or_config, rope_of)
    refuse_unservable(spec)
    config = pb.CacheConfig(name=name, num_layers=spec.layers, num_kv_heads=spec.kv_heads,
                            num_query_heads=spec.query_heads, head_dim=spec.head_dim,
                            page_tokens=page_tokens, preset=preset,
                            boundary_layers=boundary_layers,
                            memory_budget_bytes=memory_budget_bytes)
    if spec.rope is not None:
        config.rope.CopyFrom(spec.rope.proto())
        if pair_layout is not None:
            config.rope.pair_layout = pair_layout
    if spec.rope is not None and spec.other_rope is not None:
        # The other layer type's RoPE, for pre-RoPE centering with each
        # layer's own (CacheConfig.layer_ropes), as `tqkv config` writes it.
        sliding = spec.rope_of == "sliding"
        layers = [l for l in range(spec.layers) if (l in spec.windows) != sliding]
        entry = config.layer_ropes.add(layers=layers)
        entry.rope.CopyFrom(spec.other_rope.proto())
        if pair_layout is not None:
            entry.rope.pair_layout = pair_layout
    for window, layers in sorted(_layers_by_window(spec.windows).items()):
        config.sliding_window_layers.add(layers=layers, window=window)
    if key_scales is not None:
        from tqkv.hf._key_scales import add_to_config

        permutation = None
        if spec.rope is not None and pair_layout is not None:
            permutation = key_permutation(spec.head_dim, spec.rope.rotary_dims,
                                          spec.rope.pair_layout, pair_layout)
        add_to_config(config, key_scales, permutation)
    return config


def _layers_by_window(windows: Dict[int, int]) -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for layer, window in sorted(windows.items()):
        out.setdefault(window, []).append(layer)
    return out


def refuse_unservable(spec: ModelSpec):
    """Raises Unsupported for a model the server cannot serve: none today.
    Attention logit soft-capping (Gemma 2, spec.softcap) is not part of a
    cache: tqkv.hf sends it with every step (logit_softcap)."""


def config_text(*configs: "pb.CacheConfig") -> str:
    """A server config file (text-format tqkv.v1.ServerConfig) holding these caches."""
    return text_format.MessageToString(pb.ServerConfig(caches=list(configs)))


def key_permutation(head_dim: int, rotary_dims: int, model_layout: int,
                    cache_layout: int) -> Optional[List[int]]:
    """Indices idx with stored = model_vector[..., idx]: the model's
    rotating pairs moved to the cache's layout (None when they agree). The
    coordinates past rotary_dims (0: all rotate) stay where they are."""
    if model_layout == cache_layout:
        return None
    rotary = rotary_dims or head_dim
    half = rotary // 2
    interleaved_from_half = []
    for i in range(half):
        interleaved_from_half += [i, i + half]
    if model_layout == pb.RotaryEmbedding.HALF_SPLIT:
        idx = interleaved_from_half
    else:  # INTERLEAVED model, HALF_SPLIT cache: the inverse
        idx = [0] * rotary
        for position, source in enumerate(interleaved_from_half):
            idx[source] = position
    return idx + list(range(rotary, head_dim))


# -- comparing with a server's cache -------------------------------------------------

def find_cache(info, name: str):
    """The CacheInfo named `name` ("" for the server's first) in a ServerInfo."""
    caches = list(info.caches)
    if not caches:
        raise CacheMismatch("the server has no cache")
    if not name:
        return caches[0]
    for c in caches:
        if c.config.name == name:
            return c
    raise CacheMismatch("the server has no cache %r (it has %s)"
                        % (name, ", ".join(repr(c.config.name) for c in caches)))


def _server_windows(config) -> Dict[int, int]:
    out = {}
    for group in config.sliding_window_layers:
        for layer in group.layers:
            out[int(layer)] = int(group.window)
    return out


def mismatches(spec: ModelSpec, config) -> List[str]:
    """What makes the server cache `config` (a CacheConfig) serve this
    model's attention wrongly: shape and sliding windows, in words."""
    out = []
    for what, want, have in (("num_layers", spec.layers, config.num_layers),
                             ("num_kv_heads", spec.kv_heads, config.num_kv_heads),
                             ("num_query_heads", spec.query_heads, config.num_query_heads),
                             ("head_dim", spec.head_dim, config.head_dim)):
        if want != have:
            out.append("%s is %d, the model has %d" % (what, have, want))
    have_windows = _server_windows(config)
    for layer in range(spec.layers):
        want, have = spec.windows.get(layer), have_windows.get(layer)
        if want != have:
            out.append("layer %d: the cache has %s, the model %s"
                       % (layer, _window_words(have), _window_words(want)))
    return out


def _window_words(window):
    return "full attention" if window is None else "a %d-token sliding window" % window


def rope_differs(spec: ModelSpec, config) -> bool:
    """Whether a cache centering keys before RoPE does so with another RoPE
    than the model's (attention stays exact; compression suffers). The pair
    layout does not count: a TqkvCache sends keys in the cache's."""
    if config.key_centering != "pre_rope" or spec.rope is None:
        return False
    return all(_rope_differs(rope, spec.head_dim, config)
               for rope in (spec.rope, spec.other_rope) if rope is not None)


def _rope_differs(rope: Rope, head_dim: int, config) -> bool:
    want = rope.proto()
    want.pair_layout = config.rope.pair_layout  # a TqkvCache sends keys in the cache's layout
    have = pb.RotaryEmbedding()
    have.CopyFrom(config.rope)
    if have.rotary_dims == head_dim:
        have.rotary_dims = 0
    if have.scaling_type == "none":
        have.scaling_type = ""
    return have.SerializeToString(deterministic=True) != want.SerializeToString(
        deterministic=True)


def check_server_cache(spec: ModelSpec, info, name: str = ""):
    """Raises CacheMismatch when the server's cache `name` cannot serve the
    model, Unsupported when no cache can; warns (RopeMismatchWarning) when it
    centers keys with another RoPE than the model's. Returns its CacheInfo."""
    refuse_unservable(spec)
    cache = find_cache(info, name)
    problems = mismatches(spec, cache.config)
    if problems:
        want = cache_config(spec, preset=cache.config.preset or DEFAULT_PRESET,
                            name=cache.config.name)
        raise CacheMismatch("cache %r cannot serve this %s model: %s. A cache that can:\n%s"
                            % (cache.config.name, spec.model_type, "; ".join(problems),
                               config_text(want)))
    if rope_differs(spec, cache.config):
        warnings.warn("cache %r centers keys before RoPE with %s, but the model's RoPE is %s: "
                      "attention stays exact, the compression error grows (tqkv.hf."
                      "cache_config(model) gives the cache its own)"
                      % (cache.config.name, _rope_words(cache.config.rope),
                         _rope_words(spec.rope.proto())), RopeMismatchWarning, stacklevel=3)
    return cache


def _rope_words(rope) -> str:
    return text_format.MessageToString(rope, as_one_line=True) or "no rope"
