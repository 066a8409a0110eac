"""Cache recipes: a preset plus the CacheConfig fields that protect quality
(docs/turboquant.md section 7), and the text-format cache config for a row.

A recipe is a dict: "preset" (and optionally "boundary_layers") plus any of
the new CacheConfig fields, written inside `caches { ... }` after the existing
ones:
    key_centering: "none" | "post_rope" | "pre_rope"
    rope { ... }             filled in from the model (rope.py) whenever
                             key_centering is "pre_rope"
    centering_tokens: N      mean of the first N tokens after the sinks
    centering_pairs: P       pre-RoPE: top-P frequency pairs of the mean exact (0: all)
    exact_sink_tokens: S     first S tokens at fp16
    exact_recent_tokens: R   last R tokens of each layer at fp16
    protected_layers         [(layers, preset)]: layers given as a list, or
                             "first_last" (first and last served layer) or
                             "measured" (MEASURED_PROTECTED for the model)
    key_scales: "calibrated" per-channel key scales (key_scales.py) measured
                             on the calibration text (--key-scales-text)
    sequence_key_scales: B   key scales each sequence measures on its own keys
A recipe without any new field is a plain preset row: today's server takes it.
"""
import re
import sys

import rope as rope_mod

NEW_FIELDS = ("key_centering", "rope", "centering_tokens", "centering_pairs",
              "centering_includes_sinks", "exact_sink_tokens", "exact_recent_tokens",
              "protected_layers", "key_scales", "sequence_key_scales")
# What a preset implies when its recipe leaves a field unset (the server's
# *_csw presets: pre-RoPE centering, 4 exact sinks, the last 64 tokens exact,
# per-sequence key scales where no calibrated ones are given).
CSW = dict(key_centering="pre_rope", exact_sink_tokens=4, exact_recent_tokens=64,
           sequence_key_scales=True)


# The preset with the same codecs and no recipe: its slot is the csw preset's.
CSW_BASE = {"tqkv_k3v4u_csw": "turboquant_k3v4_nc", "tqkv_k3v3u_csw": "turboquant_3bit_nc",
            "tqkv_k3v4_csw": "tqkv_k3v4", "tqkv_k4v4u_csw": "turboquant_4bit_nc"}


def slot_preset(preset):
    return CSW_BASE.get(preset, preset)


def implied(preset):
    return dict(CSW) if preset.endswith("_csw") else {}


def effective(preset, recipe):
    """The recipe's fields over what its preset implies."""
    out = implied(preset)
    out.update(recipe)
    return out

K3 = "turboquant_k3v4_nc"
# The recipes to measure once the server takes the new fields. Names are the
# row labels in the report; --recipes takes names, "all", or a prefix + "*".
# "+rN": the last N tokens exact (exact_recent_tokens; "+wN" before).
RECIPES = {
    # the headline combination and its ablations
    "k3v4+pre64+s4+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                              exact_sink_tokens=4, exact_recent_tokens=64),
    "k3v4+pre64+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                           exact_recent_tokens=64),
    "k3v4+pre64+s4": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                          exact_sink_tokens=4),
    "k3v4+pre64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64),
    "k3v4+post64": dict(preset=K3, key_centering="post_rope", centering_tokens=64),
    "k3v4+s4": dict(preset=K3, exact_sink_tokens=4),
    "k3v4+s4+r64": dict(preset=K3, exact_sink_tokens=4, exact_recent_tokens=64),
    # recent tokens alone
    "k3v4+r16": dict(preset=K3, exact_recent_tokens=16),
    "k3v4+r32": dict(preset=K3, exact_recent_tokens=32),
    "k3v4+r64": dict(preset=K3, exact_recent_tokens=64),
    "k3v4+r128": dict(preset=K3, exact_recent_tokens=128),
    # how many tokens the mean needs (sinks kept exact and out of the mean)
    "k3v4+pre32+s4+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=32,
                              exact_sink_tokens=4, exact_recent_tokens=64),
    "k3v4+pre128+s4+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=128,
                               exact_sink_tokens=4, exact_recent_tokens=64),
    # sinks in the mean vs out of it (the default: the mean is over tokens
    # 4..67 when 4 sinks are exact)
    "k3v4+pre64+s4in+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                                centering_includes_sinks=True, exact_sink_tokens=4,
                                exact_recent_tokens=64),
    # exact frequency pairs of the mean (0: all)
    "k3v4+pre64p0+s4+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                                centering_pairs=0, exact_sink_tokens=4, exact_recent_tokens=64),
    "k3v4+pre64p8+s4+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                                centering_pairs=8, exact_sink_tokens=4, exact_recent_tokens=64),
    "k3v4+pre64p16+s4+r64": dict(preset=K3, key_centering="pre_rope", centering_tokens=64,
                                 centering_pairs=16, exact_sink_tokens=4,
                                 exact_recent_tokens=64),
    # the same without exact tokens: what the kept pairs buy on their own
    "k3v4+pre64p1": dict(preset=K3, key_centering="pre_rope", centering_tokens=64, centering_pairs=1),
    "k3v4+pre64p2": dict(preset=K3, key_centering="pre_rope", centering_tokens=64, centering_pairs=2),
    "k3v4+pre64p4": dict(preset=K3, key_centering="pre_rope", centering_tokens=64, centering_pairs=4),
    "k3v4+pre64p8": dict(preset=K3, key_centering="pre_rope", centering_tokens=64, centering_pairs=8),
    "k3v4+pre64p16": dict(preset=K3, key_centering="pre_rope", centering_tokens=64, centering_pairs=16),
    "k3v4+pre64p0": dict(preset=K3, key_centering="pre_rope", centering_tokens=64, centering_pairs=0),
    # protected layers on top of the best combination
    "k3v4+pre64+s4+r64+first_last@k4v4": dict(
        preset=K3, key_centering="pre_rope", centering_tokens=64, exact_sink_tokens=4,
        exact_recent_tokens=64, protected_layers=[("first_last", "tqkv_k4v4")]),
    "k3v4+pre64+s4+r64+measured@k4v4": dict(
        preset=K3, key_centering="pre_rope", centering_tokens=64, exact_sink_tokens=4,
        exact_recent_tokens=64, protected_layers=[("measured", "tqkv_k4v4")]),
    # 4-bit keys and all-3-bit with the same protection
    "k4v4+pre64": dict(preset="turboquant_4bit_nc", key_centering="pre_rope",
                       centering_tokens=64),
    "k4v4+pre64+s4+r64": dict(preset="turboquant_4bit_nc", key_centering="pre_rope",
                              centering_tokens=64, exact_sink_tokens=4, exact_recent_tokens=64),
    "3bit+pre64+s4+r64": dict(preset="turboquant_3bit_nc", key_centering="pre_rope",
                              centering_tokens=64, exact_sink_tokens=4, exact_recent_tokens=64),
    # the server's presets with the headline recipe built in (they need the
    # model's rope for pre-RoPE centering)
    "csw:tqkv_k3v4u_csw": dict(preset="tqkv_k3v4u_csw", rope=True),
    "csw:tqkv_k3v3u_csw": dict(preset="tqkv_k3v3u_csw", rope=True),
    "csw:tqkv_k3v4_csw": dict(preset="tqkv_k3v4_csw", rope=True),
    "csw:tqkv_k4v4u_csw": dict(preset="tqkv_k4v4u_csw", rope=True),
    # the same with key scales calibrated on other text (key_scales.py), and
    # with every centering pair
    "csw:tqkv_k3v4u_csw+ks": dict(preset="tqkv_k3v4u_csw", rope=True, key_scales="calibrated"),
    "csw:tqkv_k3v4u_csw+p0": dict(preset="tqkv_k3v4u_csw", rope=True, centering_pairs=0),
    "csw:tqkv_k3v4u_csw+p0+ks": dict(preset="tqkv_k3v4u_csw", rope=True, centering_pairs=0,
                                     key_scales="calibrated"),
    "csw:tqkv_k4v4u_csw+ks": dict(preset="tqkv_k4v4u_csw", rope=True, key_scales="calibrated"),
    # key scales each sequence measures on its own keys (CacheConfig.sequence_key_scales),
    # and explicitly without them (the rows above as the presets had them before)
    "csw:tqkv_k3v4u_csw+sks": dict(preset="tqkv_k3v4u_csw", rope=True, sequence_key_scales=True),
    "csw:tqkv_k3v4u_csw-sks": dict(preset="tqkv_k3v4u_csw", rope=True, sequence_key_scales=False),
    "csw:tqkv_k4v4u_csw+sks": dict(preset="tqkv_k4v4u_csw", rope=True, sequence_key_scales=True),
    # fewer exact recent tokens: the bytes of a sliding-window layer at 8k
    "csw:tqkv_k3v4u_csw+r32": dict(preset="tqkv_k3v4u_csw", rope=True, exact_recent_tokens=32),
    "csw:tqkv_k3v4u_csw+r48": dict(preset="tqkv_k3v4u_csw", rope=True, exact_recent_tokens=48),
}

# Served-layer indices to protect per model, to be chosen by measurement
# (docs/turboquant.md section 7: protection must be chosen by measurement, not
# by position). Placeholders until the report's per-layer loss measurement
# picks them: the layers with the largest served-vs-fp16 attention error.
MEASURED_PROTECTED = {"SmolLM2-135M-Instruct": [0, 29], "Gemma-3-270M": [0, 2]}


def uses_new_fields(recipe):
    return any(k in recipe for k in NEW_FIELDS)


def resolve_layers(spec, served_count, model_name):
    if spec == "first_last":
        return [0, served_count - 1]
    if spec == "measured":
        return list(MEASURED_PROTECTED.get(model_name, [0, served_count - 1]))
    return [int(x) for x in spec]


def fields_text(recipe, rope_spec, served_count=0, model_name="", layer_ropes=None,
                key_scales=None):
    """The new fields of a recipe as text-format CacheConfig fields.
    layer_ropes: {cache layer: RoPE spec} for layers whose RoPE is not
    rope_spec (CacheConfig.layer_ropes; Gemma 3's sliding-window layers).
    key_scales: the CacheConfig.key_scales text when the recipe asks for them."""
    out = []
    if recipe.get("key_scales") and key_scales:
        out.append(key_scales)
    if "key_centering" in recipe:
        out.append('key_centering: "%s"' % recipe["key_centering"])
    if recipe.get("key_centering") == "pre_rope" or recipe.get("rope"):
        out.append(rope_mod.config_text(rope_spec))
        out += layer_ropes_text(layer_ropes or {})
    for name in ("centering_tokens", "centering_pairs", "exact_sink_tokens",
                 "exact_recent_tokens"):
        if name in recipe:
            out.append("%s: %d" % (name, recipe[name]))
    for name in ("centering_includes_sinks", "sequence_key_scales"):
        if name in recipe:
            out.append("%s: %s" % (name, "true" if recipe[name] else "false"))
    for layers, preset in recipe.get("protected_layers", []):
        ids = resolve_layers(layers, served_count, model_name)
        out.append('protected_layers { layers: [%s] preset: "%s" }'
                   % (", ".join(str(i) for i in ids), preset))
    return " ".join(out)


def layer_ropes_text(layer_ropes):
    """CacheConfig.layer_ropes for {cache layer: RoPE spec}, one entry per RoPE."""
    groups = {}
    for layer, spec in sorted(layer_ropes.items()):
        groups.setdefault(rope_mod.config_text(spec), []).append(layer)
    return ["layer_ropes { layers: [%s] %s }" % (", ".join(str(l) for l in layers), text)
            for text, layers in groups.items()]


def windows_text(windows):
    """CacheConfig.sliding_window_layers for {cache layer: window}, one entry
    per window size."""
    by_size = {}
    for layer, w in sorted(windows.items()):
        by_size.setdefault(w, []).append(layer)
    return " ".join("sliding_window_layers { layers: [%s] window: %d }"
                    % (", ".join(str(l) for l in layers), w) for w, layers in by_size.items())


def cache_text(name, layers, kv_heads, query_heads, head_dim, preset, boundary, seed, budget,
               extra=""):
    return ('caches { name: "%s" num_layers: %d num_kv_heads: %d num_query_heads: %d '
            'head_dim: %d page_tokens: 16 preset: "%s" boundary_layers: %d '
            'boundary_preset: "fp16" rotation_seed: %d memory_budget_bytes: %d%s }'
            % (name, layers, kv_heads, query_heads, head_dim, preset, boundary, seed, budget,
               (" " + extra) if extra else ""))


def _renamed(name):
    """A recipe name as it reads now: "+wN" (and "+w*") was the old spelling
    of "+rN" (exact recent tokens; "window" is sliding-window attention's)."""
    new = re.sub(r"\+w(?=\d|\*)", "+r", name)
    if new != name:
        print("recipes: %r is deprecated; use %r" % (name, new), file=sys.stderr)
    return new


def select(names):
    """Recipe names from a --recipes value (old "+wN" names read as "+rN")."""
    if not names:
        return []
    out = []
    for n in map(_renamed, names.split(",")):
        if n == "all":
            out += list(RECIPES)
        elif n.endswith("*"):
            out += [r for r in RECIPES if r.startswith(n[:-1])]
        elif n in RECIPES:
            out.append(n)
        else:
            raise SystemExit("unknown recipe %r (known: %s)" % (n, ", ".join(RECIPES)))
    return list(dict.fromkeys(out))
