#!/usr/bin/env python3
"""Per-preset quality report: synthetic keys, real K/V of two models, their
perplexity and long-context retrieval with attention served by tqkv, next to
vLLM's TurboQuant scheme emulated on the same K/V.

    scripts/quality_report.sh [--models smollm2,gemma3] [--tokens 1024] [--json out.json]

Models (--models): smollm2 = SmolLM2-135M-Instruct (llama.py; Llama-style,
head_dim 64, GQA 3:1, interleaved RoPE); gemma3 = Gemma 3 270M (gemma.py;
head_dim 256, 4 query heads on 1 KV head, QK-norm, half-split RoPE, full
attention on layers 5/11/17 and a 512-token sliding window on the others,
which tqkv serves as CacheConfig.sliding_window_layers; --sliding-layers fp16
keeps them fp16 in numpy in every row instead).

Sections (markdown on stdout):
  (a) `tqkv eval` on synthetic keys with 4 hot channels (x10) and a
      per-channel offset, Gaussian queries and values, 4096 x 64, head_dim 128.
  (b) `tqkv eval` on the real post-RoPE K/V of every layer and KV head of each
      model on the first --tokens tokens of the first text; queries = the
      model's own queries at --eval-queries positions (a codec diagnostic, not
      causal); means over (layer, KV head), and the served layers with the
      largest 3-bit output error.
  (c) Perplexity on every --texts text, --windows consecutive windows of
      --tokens tokens each, every full-attention layer served by a real
      tqkv-server (Append the layer's K/V, one causal Attend with every query
      token) per preset (rotated presets: mean and range over ROTATION_SEEDS),
      per --recipes recipe (recipes.py; rows the server rejects are listed),
      and vLLM's scheme (vllm_scheme.py, --vllm) applied to the same layers in
      numpy; bits per coordinate at the measured length (from the server's
      stored_bytes) and after a decode step at --bytes-at (8k, 32k: from
      kv_bytes.py, or with --server-bytes from the server's own counts), the
      ratio vs a bf16 cache that keeps each sliding window only (the honest
      one) and vs one that keeps every token of every layer.
      --prefix-reuse S: the prefix-reuse protocol instead: the window's last
      S tokens are a prefill over its stored first T - S (the prefix stored
      and attended exactly; the S tokens attend themselves exactly and read
      the prefix through Attend's first_query_position, merged by lse);
      perplexity over those S tokens.
  (d) Pass-key retrieval (passkey.py) at --passkey-contexts tokens, needle at
      10/50/90% depth, --passkey-prompts prompts per cell: prefill, then decode
      the answer one token per Append/Attend; change of the answer's
      log-probability vs fp16 (nats) and greedy accuracy, per context.
  --chart FILE: perplexity change vs bits per coordinate, per model (PNG).
Required check: the numpy pass with fp16 K/V and the pass served by tqkv's
fp16 cache agree to float rounding: per layer, attention outputs within
FP16_CHECK_REL of each other (relative Frobenius norm), and perplexities
within PPL_CHECK_REL. The command fails (exit 1) when they do not.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

# Single-threaded BLAS: the forward passes are many small products, and a
# threaded BLAS on a shared 2-core machine spins (measured: one-row products
# 60x slower with 2 threads under load). Set it to override.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import attention  # noqa: E402
import key_scales as key_scales_mod  # noqa: E402
import kv_bytes  # noqa: E402
import llama  # noqa: E402
import passkey as passkey_mod  # noqa: E402
import recipes as recipes_mod  # noqa: E402
import vllm_scheme  # noqa: E402
from bpe import ByteLevelBPE  # noqa: E402

FP16_CHECK_REL = 1e-5   # per-layer attention output, served fp16 vs numpy fp16
# Perplexity, served fp16 vs numpy fp16. Not tighter: float32 rounding that
# differs by under 1e-6 per layer (the kernels' own summation orders) moves
# SmolLM2's perplexity over 24-128 tokens by 2e-5 to 2e-4 (measured on
# 2026-12-02: scalar 2.2e-5 / 1.6e-4, AVX2 1.3e-4 / 2.0e-4, AVX-512 1.3e-4 /
# 1.4e-4 at 24 / 128 tokens, per-layer differences 3.5e-7 to 7.3e-7); numpy
# fp16 K/V itself sits 6e-5 from numpy float32. The per-layer check above is
# the tight one.
PPL_CHECK_REL = 1e-3

ALL_PRESETS = ["fp16", "bf16", "fp8", "turboquant_k8v4", "turboquant_4bit_nc",
               "turboquant_k3v4_nc", "turboquant_3bit_nc", "tqkv_k4v4", "tqkv_k3v4",
               "tqkv_k3p5v3", "tqkv_k3v3", "tqkv_k2p5v3", "eval_qjl_k3v4"]
# vLLM's published perplexity change (docs/turboquant.md section 4; their
# model and data, not ours).
VLLM_PPL_CHANGE = {"turboquant_k8v4": "+1.17%", "turboquant_4bit_nc": "+2.71%",
                   "turboquant_k3v4_nc": "+10.63%", "turboquant_3bit_nc": "+20.59%"}
# Rows with vLLM's protection: first and last 2 layers at fp16.
BOUNDARY_ROWS = ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
# Rotation seeds (CacheConfig.rotation_seed; 0 is the server's default seed)
# for presets with a rotated codec: perplexity on one text moves with the
# seed, so those rows give the mean and the range over these.
ROTATION_SEEDS = [0, 101, 202]
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
# --texts names: GPL-3 (a licence) and the Python reference manual's topics
# as pydoc ships them (pydoc_data.topics, in every CPython): prose about code.
TEXTS = {"gpl3": DEFAULT_TEXT, "pydoc": "pydoc:topics", "persuasion": "persuasion:3000"}
# persuasion: the excerpt of Jane Austen's Persuasion in ../shared/texts, from
# character 3000 skipped to the start of the next paragraph.
PERSUASION = ROOT.parent / "shared" / "texts" / "persuasion_excerpt.txt"
LONG_CONTEXT = 32768    # the second bytes column
# Context lengths of the bytes columns: the 8k and the long one,
# by the formula and (--server-bytes-at) from the server's own counts.
BYTES_AT = (8192, LONG_CONTEXT)
# How sliding-window layers are held (--sliding-layers): "served", by the
# tqkv cache (CacheConfig.sliding_window_layers: masked, older pages given
# back), or "fp16", in numpy at fp16 in every row (before the server took
# them). And how many caches hold the served layers (--rope-groups): "one",
# with the RoPE of the model's global layers, or "split", one cache per RoPE
# (Gemma 3's local layers rotate with base 1e4, its global ones with 1e6: a
# cache has one `rope`, so one cache centers the local layers with a RoPE
# not theirs, exact but with less gain).
SLIDING = {"layers": "served", "rope_groups": "one", "layer_ropes": "own"}
# (c) with --prefix-reuse S: each window's last S tokens are a prefill over a
# stored prefix (the window's first T - S tokens, stored and attended
# exactly by the prefill that made them): the S tokens attend their own
# tokens exactly (fp16 K/V) and read the prefix through the server (Attend
# with first_query_position, lse-merged); perplexity over those S tokens.
PROTOCOL = {"prefix_reuse": 0}
MODEL_KEYS = ("smollm2", "gemma3")
# Calibrated key scales per model name (key_scales.py), for recipes that ask
# for them: measured on --key-scales-text, never on the text under test.
KEY_SCALES = {}
PASSKEY_PRESETS = "fp16,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc"
PASSKEY_VLLM = "turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc"


def binary(env, name):
    path = os.environ.get(env) or str(ROOT / "build" / "bin" / name)
    if not os.path.exists(path):
        sys.exit("%s not found at %s: build first (scripts/build.sh) or set %s" % (name, path, env))
    return path


def read_text(spec):
    """A --texts entry: a name from TEXTS, a file path, or pydoc:topics."""
    spec = TEXTS.get(spec, spec)
    if spec.startswith("persuasion:"):
        text = PERSUASION.read_text()
        at = text.find("\n\n", int(spec.split(":")[1]))
        return text[at:].lstrip("\n")
    if spec == "pydoc:topics":
        import pydoc_data.topics as topics
        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return pathlib.Path(spec).read_text()


def load_model(key):
    """(model, tokenizer) for a --models key."""
    if key == "smollm2":
        m = llama.Llama()
        return m, ByteLevelBPE.from_gguf(m.reader)
    if key == "gemma3":
        import gemma
        from spm import SentencePieceBPE
        m = gemma.Gemma3()
        return m, SentencePieceBPE.from_gguf(m.reader)
    raise SystemExit("unknown model %r (known: %s)" % (key, ", ".join(MODEL_KEYS)))


def model_available(key):
    if key == "gemma3":
        import gemma
        return gemma.available()
    return True


def text_windows(model, tokenizer, text, tokens, windows):
    """`windows` consecutive token windows of `tokens` tokens (BOS first when
    the model has one)."""
    ids = tokenizer.encode(text)
    body = tokens - (1 if model.bos is not None else 0)
    if len(ids) < body * windows:
        raise SystemExit("text has %d tokens, want %d windows of %d" % (len(ids), windows, body))
    head = [model.bos] if model.bos is not None else []
    return [head + ids[w * body:(w + 1) * body] for w in range(windows)]


def served_layers(model):
    """The layers tqkv caches hold: every layer, or (--sliding-layers fp16)
    the full-attention ones."""
    if SLIDING["layers"] == "served":
        return list(range(model.config.layers))
    return model.full_attention_layers()


def cache_groups(model):
    """[(cache name suffix, model layers)]: one cache of every served layer,
    or (--rope-groups split) one per distinct RoPE of the served layers."""
    layers = served_layers(model)
    if SLIDING["rope_groups"] != "split":
        return [("", layers)]
    groups = {}
    for layer in layers:
        groups.setdefault(json.dumps(model.rope_spec(layer), sort_keys=True), []).append(layer)
    if len(groups) == 1:
        return [("", layers)]
    return [("/rope%d" % i, g) for i, g in enumerate(groups.values())]


def group_rope(model, layers):
    """The RoPE a cache of these layers is given: theirs when split by RoPE,
    else the global layers' (rope_spec())."""
    return model.rope_spec(layers[0]) if SLIDING["rope_groups"] == "split" else model.rope_spec()


def layout(model):
    c = model.config
    return kv_bytes.Layout(c.layers, c.kv_heads, c.head_dim, served_layers(model),
                           model.windows())


def last_append(tokens, chunk):
    """Tokens in the last append of a window fed in `chunk`-token steps (0:
    one append of all)."""
    return tokens - chunk * ((tokens - 1) // chunk) if chunk else tokens


# ---------------------------------------------------------------------------
# (a), (b): tqkv eval


def write_npy(path, array):
    np.save(path, np.ascontiguousarray(array, dtype=np.float32))


def run_eval(cli, keys, queries, values, presets, work):
    """`tqkv eval --json` on one head's keys/queries/values: {preset: row}."""
    write_npy(work / "k.npy", keys)
    write_npy(work / "q.npy", queries)
    write_npy(work / "v.npy", values)
    out = subprocess.run([cli, "eval", "--preset", ",".join(presets), "--keys", str(work / "k.npy"),
                          "--queries", str(work / "q.npy"), "--values", str(work / "v.npy"),
                          "--json"], check=True, capture_output=True, text=True, timeout=600)
    return {row["preset"]: row for row in json.loads(out.stdout)["presets"]}


def mean_rows(rows_per_head):
    """Mean over heads of every metric (needles per gap)."""
    presets = rows_per_head[0].keys()
    out = {}
    for p in presets:
        rows = [r[p] for r in rows_per_head]
        m = {k: float(np.mean([r[k] for r in rows])) for k in
             ("key_rel_mse", "value_rel_mse", "logit_rmse", "logit_std", "top1_agreement",
              "top8_agreement", "tv_distance", "output_rel_error")}
        m["bytes_per_token_head"] = rows[0]["bytes_per_token_head"]
        m["needles"] = []
        for g in range(len(rows[0]["needles"])):
            m["needles"].append({
                "gap": rows[0]["needles"][g]["gap"],
                "top1_rate": float(np.mean([r["needles"][g]["top1_rate"] for r in rows])),
                "exact_weight": float(np.mean([r["needles"][g]["exact_weight"] for r in rows])),
                "approx_weight": float(np.mean([r["needles"][g]["approx_weight"] for r in rows]))})
        out[p] = m
    return out


def synthetic_section(cli, presets, work):
    subprocess.run([cli, "synth", "--kind", "outlier-keys", "--rows", "4096", "--head-dim", "128",
                    "--seed", "1", "--out", str(work / "sk.npy")], check=True, timeout=120)
    subprocess.run([cli, "synth", "--kind", "gaussian", "--rows", "4096", "--head-dim", "128",
                    "--seed", "2", "--out", str(work / "sv.npy")], check=True, timeout=120)
    subprocess.run([cli, "synth", "--kind", "gaussian", "--rows", "64", "--head-dim", "128",
                    "--seed", "3", "--out", str(work / "sq.npy")], check=True, timeout=120)
    return run_eval(cli, np.load(work / "sk.npy"), np.load(work / "sq.npy"),
                    np.load(work / "sv.npy"), presets, work)


WORST_PRESET = "turboquant_k3v4_nc"


def capture_section(cli, model, tokens, presets, eval_queries, work):
    """Exact forward pass capturing post-RoPE Q/K/V; `tqkv eval` per (layer,
    KV head). Also the served layers ranked by WORST_PRESET's output error."""
    c = model.config
    group = c.heads // c.kv_heads
    captured = []
    model.forward(tokens, capture=lambda l, q, k, v: captured.append((l, q, k, v)))
    t = len(tokens)
    positions = np.unique(np.linspace(t // 2, t - 1, eval_queries).astype(int))
    rows, per_layer = [], {}
    for layer, q, k, v in captured:
        for h in range(c.kv_heads):
            qs = q[positions][:, h * group:(h + 1) * group].reshape(-1, c.head_dim)
            row = run_eval(cli, k[:, h], qs, v[:, h], presets, work)
            rows.append(row)
            if WORST_PRESET in row:
                per_layer.setdefault(layer, []).append(row[WORST_PRESET]["output_rel_error"])
    served = served_layers(model)
    ranked = sorted(((float(np.mean(per_layer[l])), i, l) for i, l in enumerate(served)
                     if l in per_layer), reverse=True)
    worst = [{"layer": l, "served_index": i, "output_rel_error": e} for e, i, l in ranked]
    return mean_rows(rows), len(captured) * c.kv_heads, len(positions) * group, worst


# ---------------------------------------------------------------------------
# Served attention


class ServedAttention:
    """attend(layer, q, k, v, start=0) through a tqkv-server: Append the new
    tokens' K/V at `start`, then one Attend with their queries (causal).
    Records stored bytes (the server's own count). With `exact_prefill`
    ({cache layer: window or None}), the first append (start 0) is only
    stored and its queries attend in numpy over the fp16 K/V, as a prefill
    node attends over the K/V it has just computed; later calls are served."""

    def __init__(self, client, cache, check=None, exact_prefill=None, prefix_reuse=False):
        self.client = client
        self.cache = cache
        self.sequence = "report/%s/%s" % (cache, uuid.uuid4().hex[:8])
        self.stored_bytes = 0
        self.check = check  # check(layer, q, k, v, served_output), prefill only
        self.exact_prefill = exact_prefill
        # PROTOCOL["prefix_reuse"]: calls after the first (start 0, stored and
        # attended exactly) store nothing; see suffix().
        self.prefix_reuse = prefix_reuse

    def suffix(self, layer, q, k, v, start):
        """New tokens at `start` over the stored prefix, as a prefill node
        reads it: the prefix's share from the server (first_query_position),
        their own tokens exactly at fp16, merged by lse."""
        import tqkv
        item = tqkv.AttendItem(self.sequence, layer, q, first_query_position=start)
        stored = self.client.attend([item], return_lse=True, cache=self.cache)[0]
        own, own_lse = attention.causal_attention_lse(
            q, attention.fp16_round(k), attention.fp16_round(v), self.exact_prefill.get(layer))
        return attention.merge_lse(stored.output, stored.lse, own, own_lse)

    def __call__(self, layer, q, k, v, start=0):
        if self.prefix_reuse and start > 0:
            return self.suffix(layer, q, k, v, start)
        result = self.client.append(self.sequence, k[None], v[None], start=start,
                                    layer_begin=layer, layer_end=layer + 1, cache=self.cache)
        self.stored_bytes += result.stored_bytes
        if self.exact_prefill is not None and start == 0:
            return attention.causal_attention(q, attention.fp16_round(k), attention.fp16_round(v),
                                              0, self.exact_prefill.get(layer))
        out = self.client.attend([(self.sequence, layer, q)], cache=self.cache)[0].output
        if self.check is not None and start == 0:
            self.check(layer, q, k, v, out)
        return out

    def held_bytes(self):
        """What the server says the cache holds now (GetServerInfo): this
        sequence's bytes when it is the cache's only one, exact copies and
        means included (what the Append replies' stored_bytes sum to)."""
        return self.held()["stored_bytes"]

    def held(self):
        """The cache's GetServerInfo counts: stored_bytes, stored_bytes_bf16
        (the same held tokens in bf16) and pool_bytes (pages in use x page
        bytes: padding, unfilled slots and stride included)."""
        for c in self.client.info().caches:
            if c.config.name == self.cache:
                return {"stored_bytes": int(c.stored_bytes),
                        "stored_bytes_bf16": int(c.stored_bytes_bf16),
                        "pool_bytes": int(c.pages_used) * int(c.page_bytes)}
        raise KeyError(self.cache)

    def drop(self):
        self.client.drop(self.sequence, cache=self.cache)


class ServedModel:
    """A model's served layers on the caches of cache_groups (one each):
    held() sums their counts, drop() drops the sequence from each."""

    def __init__(self, parts):
        self.parts = parts

    def held(self):
        out = {}
        for p in self.parts:
            for k, v in p.held().items():
                out[k] = out.get(k, 0) + v
        return out

    def held_bytes(self):
        return self.held()["stored_bytes"]

    def drop(self):
        for p in self.parts:
            p.drop()


def served_backend(model, client, cache, check=None, exact_prefill=False):
    """(backend for model.forward, what held()/drop() it). Each cache of
    cache_groups serves its layers; layers no cache holds (--sliding-layers
    fp16) run in numpy at fp16. check(model layer, q, k, v, output) sees
    every served layer's first append. exact_prefill: see ServedAttention."""
    groups = cache_groups(model)
    parts = []
    for suffix, layers in groups:
        layer_check = None
        if check is not None:
            layer_check = (lambda layers: lambda i, q, k, v, out: check(layers[i], q, k, v, out))(
                layers)
        reuse = bool(PROTOCOL["prefix_reuse"])
        exact = ({i: model.window(l) for i, l in enumerate(layers)}
                 if exact_prefill or reuse else None)
        parts.append(ServedAttention(client, cache + suffix, layer_check, exact, reuse))
    if len(parts) == 1 and len(groups[0][1]) == model.config.layers:
        return parts[0], parts[0]
    served = set(served_layers(model))
    rest = attention.fp16({l: w for l, w in model.windows().items() if l not in served})
    return (attention.Router([(layers, p) for (_, layers), p in zip(groups, parts)], rest),
            ServedModel(parts))


def cache_budget(model, tokens, layers, max_append=None):
    """Pool bytes for one sequence of `tokens` tokens in a cache of `layers`
    (model layers), appended at most max_append (default all) at a time:
    every token at fp16 in full-attention layers, window + append + two
    pages in sliding-window ones, doubled for exact pages and chunk strides.
    At least a page per 16 positions of the sequence: the server refuses an
    append past num_pages x page_tokens positions even in a cache of
    sliding-window layers only, which holds about its window (the pool is
    allocated lazily, so the unused pages cost address space only)."""
    c = model.config
    held = 0
    for layer in layers:
        w = model.window(layer) if SLIDING["layers"] == "served" else None
        n = tokens if not w else min(tokens, w + (max_append or tokens))
        held += (-(-n // 16) + 2) * 16
    fp = c.kv_heads * c.head_dim * 4
    positions = (-(-tokens // 16) + 2) * 16 * len(layers) * fp
    return max(2 * held * fp, positions) + (8 << 20)


def server_config(model, tokens, caches, recipes=None, max_append=None):
    """caches: [(name, preset, boundary, seed)], each one tqkv cache per
    cache_groups entry (name + suffix); recipes: {name: row} for rows with
    recipe fields. Sliding-window layers get sliding_window_layers."""
    c = model.config
    recipes = recipes or {}
    text = []
    for name, preset, boundary, seed in caches:
        for suffix, layers in cache_groups(model):
            extra = []
            if name in recipes:
                extra.append(row_extra(model, recipes[name], layers))
            if SLIDING["layers"] == "served":
                windows = {i: model.window(l) for i, l in enumerate(layers) if model.window(l)}
                if windows:
                    extra.append(recipes_mod.windows_text(windows))
            text.append(recipes_mod.cache_text(
                name + suffix, len(layers), c.kv_heads, c.heads, c.head_dim, preset, boundary,
                seed, cache_budget(model, tokens, layers, max_append),
                " ".join(e for e in extra if e)))
    return "\n".join(text) + "\n"


def probe_config(model, presets):
    """One-layer caches whose one-token Append gives a preset's bytes per (token, head)."""
    c = model.config
    return "".join(recipes_mod.cache_text("probe:%s" % p, 1, c.kv_heads, c.heads, c.head_dim, p, 0,
                                          0, 4 << 20) + "\n" for p in presets)


def probe_slots(client, model, presets):
    c = model.config
    out = {}
    for p in presets:
        seq = "probe/%s" % uuid.uuid4().hex[:8]
        z = np.zeros((1, 1, c.kv_heads, c.head_dim), dtype=np.float32)
        z[..., 0] = 1.0
        r = client.append(seq, z, z, start=0, layer_begin=0, layer_end=1, cache="probe:%s" % p)
        out[p] = r.stored_bytes // c.kv_heads
        client.drop(seq, cache="probe:%s" % p)
    return out


def preset_codecs(cli):
    """{preset: (key codec, value codec)} from `tqkv presets --json`."""
    out = subprocess.run([cli, "presets", "--json"], check=True, capture_output=True, text=True,
                         timeout=60)
    return {p["name"]: (p["keys"], p["values"]) for p in json.loads(out.stdout)["presets"]}


def rotated(codecs):
    """Whether a (keys, values) codec pair uses a seeded rotation (tq*, qjl*)."""
    return any(c.startswith(("tq", "qjl")) for c in codecs)


def split_presets(cli):
    """Presets whose keys are split into hot / cold channel groups: the server
    config has no field for their per-(layer, head) hot channels yet, so they
    cannot be served (tqkv eval calibrates them on the keys themselves)."""
    out = subprocess.run([cli, "presets", "--json"], check=True, capture_output=True, text=True,
                         timeout=60)
    return {p["name"] for p in json.loads(out.stdout)["presets"] if "split" in p["keys"]}


# ---------------------------------------------------------------------------
# Rows: what one line of (c) and (d) is


def row_specs(model, presets, boundary_rows, seeded, vllm, recipe_names, worst_layers=None):
    """[{name, kind, preset, boundary, seeds, recipe}] for (c) and (d)."""
    c = model.config
    served_count = len(served_layers(model))
    split = len(cache_groups(model)) > 1
    rows = [{"name": "numpy float32 attention", "kind": "exact"},
            {"name": "numpy fp16 K/V", "kind": "fp16"}]
    for p in presets:
        rows.append({"name": p, "kind": "served", "preset": p, "boundary": 0,
                     "seeds": ROTATION_SEEDS if p in seeded else [0], "recipe": {}})
    if 2 * 2 <= served_count and not split:  # boundary layers are per cache
        for p in boundary_rows:
            rows.append({"name": "%s+b2" % p, "kind": "served", "preset": p, "boundary": 2,
                         "seeds": ROTATION_SEEDS if p in seeded else [0], "recipe": {}})
    for p in vllm:
        if p not in vllm_scheme.PRESETS:
            raise SystemExit("unknown vLLM preset %r (known: %s)"
                             % (p, ", ".join(vllm_scheme.PRESETS)))
        if c.head_dim & (c.head_dim - 1):
            continue
        rows.append({"name": "vLLM scheme %s" % p, "kind": "vllm", "preset": p})
    for name in recipe_names:
        recipe = dict(recipes_mod.RECIPES[name])
        preset = recipe.pop("preset")
        boundary = recipe.pop("boundary_layers", 0)
        row = {"name": name, "kind": "served", "preset": preset, "boundary": boundary,
               "seeds": ROTATION_SEEDS if preset in seeded else [0], "recipe": recipe}
        if split and (boundary or recipe.get("protected_layers")):
            row["rejected"] = "protected layers are per cache: not with --rope-groups split"
        rows.append(row)
    if worst_layers:
        recipes_mod.MEASURED_PROTECTED[model.name] = worst_layers
    return rows


def row_extra(model, row, layers=None):
    """The recipe's CacheConfig fields for a cache of `layers` (model layers;
    default every served one)."""
    if not row.get("recipe"):
        return ""
    layers = layers or served_layers(model)
    rope = group_rope(model, layers)
    own = {}
    if SLIDING["layer_ropes"] == "own":
        own = {i: model.rope_spec(l) for i, l in enumerate(layers) if model.rope_spec(l) != rope}
    scales = None
    if row["recipe"].get("key_scales"):
        scales = key_scales_mod.config_text(KEY_SCALES[model.name], layers)
    return recipes_mod.fields_text(row["recipe"], rope, len(layers), model.name, own, scales)


def row_bytes(model, row, tokens, slots, last=1):
    """Formula bytes of a row at `tokens` tokens, the last append `last`
    tokens long (kv_bytes.py)."""
    lay = layout(model)
    fp = kv_bytes.fp16_slot(model.config.head_dim)
    if row["kind"] in ("exact", "fp16"):
        return kv_bytes.window_aware_bf16_bytes(lay, tokens)
    if row["kind"] == "vllm":
        # Held like the served rows: each window and the last append's queries' reach.
        return kv_bytes.row_bytes(lay, tokens,
                                  vllm_scheme.bytes_per_token_head(row["preset"],
                                                                   model.config.head_dim),
                                  last_append=last)
    r = recipes_mod.effective(row["preset"], row.get("recipe", {}))
    protected = {}
    for layers, preset in r.get("protected_layers", []):
        for i in recipes_mod.resolve_layers(layers, len(lay.served), model.name):
            protected[i] = slots.get(preset, fp)
    return kv_bytes.row_bytes(lay, tokens, slots[recipes_mod.slot_preset(row["preset"])], sinks=r.get("exact_sink_tokens", 0),
                              recent=r.get("exact_recent_tokens", 0), protected=protected,
                              boundary=row["boundary"],
                              centered=r.get("key_centering", "none") != "none", last_append=last,
                              mean_bytes=4 * model.config.head_dim * (2 if sequence_scales(r) else 1))


def sequence_scales(recipe):
    """Whether a served recipe keeps per-sequence key scales after its means
    (the *_csw presets' default, unless calibrated key scales replace them)."""
    return (recipe.get("sequence_key_scales", False) and not recipe.get("key_scales")
            and recipe.get("key_centering", "none") != "none")


def numpy_backend(model, row):
    if row["kind"] == "exact":
        return attention.exact(model.windows())
    if row["kind"] == "fp16":
        return attention.fp16(model.windows())
    return vllm_scheme.cache(row["preset"], model.config.head_dim, model.windows(),
                             served_layers(model))


def start_server(server_binary, config):
    from tqkv.testing import LocalServer
    return LocalServer(server_binary, config, threads=2, memory_budget_gib=4, start_timeout=60)


def recipe_accepted(server_binary, model, row, tokens):
    """Whether this server takes the recipe's cache config (None) or its error."""
    config = server_config(model, tokens, [("try", row["preset"], row["boundary"], 0)],
                           {"try": row})
    try:
        with start_server(server_binary, config):
            return None
    except Exception as error:  # the server exits on a config it rejects
        text = str(error).strip() or repr(error)
        return text.split("config is not a text-format tqkv.v1.ServerConfig: ")[-1][-300:]


def run_rows(server_binary, model, rows, tokens, log, run_one, check=None, exact_prefill=False):
    """Calls run_one(row, seed, backend, served) for every row and seed: numpy
    rows with served=None; plain served rows on one server; each recipe row on
    its own server (skipped with row['rejected'] when the server refuses it).
    Returns {preset: slot bytes}."""
    served_presets = sorted({recipes_mod.slot_preset(r["preset"]) for r in rows
                             if r["kind"] == "served"}
                            | {p for r in rows if r["kind"] == "served"
                               for _, p in r["recipe"].get("protected_layers", [])})
    for row in rows:
        if row["kind"] in ("exact", "fp16", "vllm"):
            run_one(row, 0, lambda: (numpy_backend(model, row), None))
    plain = [r for r in rows if r["kind"] == "served" and not r["recipe"]]
    caches = [("%s@%d" % (r["name"], s), r["preset"], r["boundary"], s) for r in plain
              for s in r["seeds"]]
    slots = {}
    config = server_config(model, tokens, caches) + probe_config(model, served_presets)
    with start_server(server_binary, config) as server:
        with server.client(timeout=600.0, max_message_bytes=256 << 20) as client:
            slots = probe_slots(client, model, served_presets)
            for row in plain:
                for seed in row["seeds"]:
                    cache = "%s@%d" % (row["name"], seed)
                    run_one(row, seed, lambda: served_backend(
                        model, client, cache, check if row["name"] == "fp16" else None,
                        exact_prefill))
    for row in rows:
        if row["kind"] != "served" or not row["recipe"] or row.get("rejected"):
            continue
        error = recipe_accepted(server_binary, model, row, tokens)
        if error is not None:
            row["rejected"] = error
            log("recipe %s: this server rejects it (%s)" % (row["name"], error))
            continue
        caches = [("%s@%d" % (row["name"], s), row["preset"], row["boundary"], s)
                  for s in row["seeds"]]
        recipes = {c[0]: row for c in caches}
        with start_server(server_binary, server_config(model, tokens, caches, recipes)) as server:
            with server.client(timeout=600.0, max_message_bytes=256 << 20) as client:
                for seed in row["seeds"]:
                    cache = "%s@%d" % (row["name"], seed)
                    run_one(row, seed, lambda: served_backend(model, client, cache,
                                                              exact_prefill=exact_prefill))
    return slots


# ---------------------------------------------------------------------------
# (c) perplexity


def window_nll(model, tokens, backend, chunk):
    """Per-token NLL of one window under the (c) protocol: every read
    (chunk 0), decode steps of `chunk` tokens, or (PROTOCOL["prefix_reuse"]
    S) the last S tokens over a stored prefix, the NLL of the tokens their
    own hidden states predict."""
    reuse = PROTOCOL["prefix_reuse"]
    if not reuse:
        return model.nll(forward_chunked(model, tokens, backend, chunk), tokens)
    split = len(tokens) - reuse
    model.forward(tokens[:split], backend)
    return model.nll(model.forward(tokens[split:], backend, start=split), tokens[split:])


def forward_chunked(model, tokens, backend, chunk):
    """Hidden states of a teacher-forced pass; with chunk > 0 the tokens go in
    chunks (one Append + Attend per layer each), as a server sees a decode:
    the exact recent tokens then cover each chunk's queries, where one
    whole-text Append leaves only the text's last W tokens exact."""
    if not chunk:
        return model.forward(tokens, backend)
    return np.concatenate([model.forward(tokens[s:s + chunk], backend, start=s)
                           for s in range(0, len(tokens), chunk)])


def e2e_section(server_binary, model, texts, rows, log, chunk=0):
    """texts: {name: [token windows]}. Fills each row with perplexities (pooled
    over every window of every text, and per text), per seed; bytes."""
    check = {"max_layer_rel": 0.0}
    tokens = len(next(iter(texts.values()))[0])

    def fp16_check(layer, q, k, v, out):
        want = attention.causal_attention(q, attention.fp16_round(k), attention.fp16_round(v), 0,
                                          model.window(layer))
        rel = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        check["max_layer_rel"] = max(check["max_layer_rel"], rel)

    def run_one(row, seed, make):
        t0 = time.time()
        sums = {}
        stored = None
        for text, windows in texts.items():
            for toks in windows:
                backend, served = make()
                nll = window_nll(model, toks, backend, chunk)
                if served is not None:
                    stored = served.held()
                    served.drop()
                s = sums.setdefault(text, [0.0, 0])
                s[0] += float(nll.sum())
                s[1] += len(nll)
        per_text = {t: float(np.exp(s[0] / s[1])) for t, s in sums.items()}
        pooled = float(np.exp(sum(s[0] for s in sums.values()) / sum(s[1] for s in sums.values())))
        row.setdefault("seeds_run", []).append(seed)
        row.setdefault("ppl_per_seed", []).append(pooled)
        row.setdefault("ppl_per_text_per_seed", []).append(per_text)
        if stored is not None:
            row["stored_bytes"] = stored["stored_bytes"]
            row["server_counts"] = stored
        log("(c) %s %-28s seed %3d ppl %.4f  %.1f s" % (model.name, row["name"], seed, pooled,
                                                        time.time() - t0))

    slots = run_rows(server_binary, model, rows, tokens, log, run_one, fp16_check)
    # The bytes at the measured length: what is stored (the prefix alone
    # with --prefix-reuse).
    stored = tokens - PROTOCOL["prefix_reuse"]
    finish_rows(model, rows, stored, slots, "ppl", stored if PROTOCOL["prefix_reuse"]
                else last_append(tokens, chunk))
    base = next(r for r in rows if r["name"] == "numpy fp16 K/V")
    served_fp16 = next((r for r in rows if r["name"] == "fp16" and "ppl" in r), None)
    ref = served_fp16 or base
    for r in rows:
        if "ppl" in r:
            r["ppl_per_text"] = {t: float(np.mean([p[t] for p in r["ppl_per_text_per_seed"]]))
                                 for t in r["ppl_per_text_per_seed"][0]}
    for r in rows:
        if "ppl" not in r:
            continue
        r["ppl_change_vs_fp16"] = r["ppl"] / ref["ppl"] - 1.0
        r["ppl_change_range"] = [min(r["ppl_per_seed"]) / ref["ppl"] - 1.0,
                                 max(r["ppl_per_seed"]) / ref["ppl"] - 1.0]
        r["ppl_change_per_seed"] = [p / ref["ppl"] - 1.0 for p in r["ppl_per_seed"]]
        r["ppl_change_median"] = float(np.median(r["ppl_change_per_seed"]))
        r["ppl_change_per_text"] = {t: r["ppl_per_text"][t] / ref["ppl_per_text"][t] - 1.0
                                    for t in r["ppl_per_text"]}
    check["ppl_rel"] = abs(served_fp16["ppl"] / base["ppl"] - 1.0) if served_fp16 else None
    check["passed"] = bool(served_fp16 and check["max_layer_rel"] <= FP16_CHECK_REL
                           and check["ppl_rel"] <= PPL_CHECK_REL)
    return check, slots


def finish_rows(model, rows, tokens, slots, metric, last=1):
    """Mean over seeds; bytes and bits per coordinate at `tokens` (each
    layer's last append `last` tokens long) and, as after a decode step, at
    BYTES_AT: vs a bf16 cache that keeps only each window (ratio_vs_bf16,
    the honest one) and vs one that keeps every token of every layer
    (ratio_vs_naive_bf16)."""
    lay = layout(model)
    unserved = kv_bytes.unserved_bytes(lay, tokens)
    for r in rows:
        if metric == "ppl" and "ppl_per_seed" in r:
            r["ppl"] = float(np.mean(r["ppl_per_seed"]))
        if r.get("rejected"):
            continue
        if r["kind"] == "served" and recipes_mod.slot_preset(r["preset"]) not in slots:
            continue
        formula = row_bytes(model, r, tokens, slots, last)
        r["bytes_formula"] = formula
        if "stored_bytes" in r:
            # The server's count for the layers it holds, plus the unserved
            # (sliding-window, fp16) layers' bytes from the formula.
            r["bytes_measured"] = r["stored_bytes"] + unserved
        measured = r.get("bytes_measured", formula)
        if measured != formula:
            print("[quality_report] %s: the server stored %d bytes, the formula says %d"
                  % (r["name"], measured, formula), file=sys.stderr)
        r["tokens"] = tokens
        r["bytes_per_token"] = measured / tokens
        r["bits_per_coord"] = kv_bytes.bits_per_coordinate(lay, tokens, measured)
        r["bits_per_coord_32k"] = kv_bytes.bits_per_coordinate(
            lay, LONG_CONTEXT, row_bytes(model, r, LONG_CONTEXT, slots))
        r["ratio_vs_bf16"] = kv_bytes.ratio_vs_bf16(r["bits_per_coord"])
        r["ratio_vs_bf16_32k"] = kv_bytes.ratio_vs_bf16(r["bits_per_coord_32k"])
        r["ratio_vs_naive_bf16"] = kv_bytes.naive_bf16_bytes(lay, tokens) / measured
        bytes_at(model, r, slots)


def bytes_at(model, r, slots):
    """r["at"][T] for T in BYTES_AT, after a decode step: the formula's bytes,
    the server's where server_bytes_section measured them (then the ratios
    are the server's), and both bf16 baselines."""
    lay = layout(model)
    at = r.setdefault("at", {})
    for t in BYTES_AT:
        formula = row_bytes(model, r, t, slots)
        cell = at.setdefault(str(t), {})
        cell.update({"bytes_formula": formula,
                     "bf16_window_aware": kv_bytes.window_aware_bf16_bytes(lay, t),
                     "bf16_naive": kv_bytes.naive_bf16_bytes(lay, t)})
        held = cell.get("server", {}).get("stored_bytes")
        b = formula if held is None else held + kv_bytes.unserved_bytes(lay, t)
        cell["bytes"] = b
        cell["bits_per_coord"] = kv_bytes.bits_per_coordinate(lay, t, b)
        cell["ratio_vs_bf16"] = cell["bf16_window_aware"] / b
        cell["ratio_vs_naive_bf16"] = cell["bf16_naive"] / b


def server_bytes_section(server_binary, model, rows, slots, lengths, log, step=512):
    """The server's own counts at each of `lengths` tokens for every served
    row (rotation seed 0): a fresh sequence of random K/V in every served
    layer, appended `step` tokens at a time up to length - 1 and then one
    token (a decode step: a sliding-window layer then holds its window).
    GetServerInfo's stored_bytes, stored_bytes_bf16 and pool bytes go to
    row["at"][length]["server"]; a difference from the formula is printed."""
    lay = layout(model)
    c = model.config
    rows = [r for r in rows if r["kind"] == "served" and not r.get("rejected") and "at" in r]
    names = ["bytes:%s" % r["name"] for r in rows]
    caches = [(n, r["preset"], r["boundary"], 0) for n, r in zip(names, rows)]
    recipes = {n: r for n, r in zip(names, rows) if r["recipe"]}
    top = max(lengths)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((c.layers, step, c.kv_heads, c.head_dim)).astype(np.float16)
    with start_server(server_binary, server_config(model, top, caches, recipes, step)) as server:
        with server.client(timeout=600.0, max_message_bytes=256 << 20) as client:
            for name, r in zip(names, rows):
                t0 = time.time()
                parts = [(ServedAttention(client, name + suffix), len(layers))
                         for suffix, layers in cache_groups(model)]
                held = ServedModel([p for p, _ in parts])
                pos = 0
                for length in sorted(lengths):
                    while pos < length:
                        n = min(step, length - 1 - pos) if pos < length - 1 else 1
                        for p, count in parts:
                            kv = block[:count, :n]
                            client.append(p.sequence, kv, kv, start=pos, cache=p.cache)
                        pos += n
                    counts = held.held()
                    r["at"].setdefault(str(length), {})["server"] = counts
                    formula = row_bytes(model, r, length, slots)
                    if counts["stored_bytes"] + kv_bytes.unserved_bytes(lay, length) != formula:
                        log("%s at %d tokens: the server stored %d bytes, the formula says %d"
                            % (r["name"], length, counts["stored_bytes"]
                               + kv_bytes.unserved_bytes(lay, length), formula))
                held.drop()
                bytes_at(model, r, slots)
                log("server bytes %-28s %s  %.1f s" % (r["name"], ", ".join(
                    "%d: %.2fx" % (t, r["at"][str(t)]["ratio_vs_bf16"]) for t in BYTES_AT),
                    time.time() - t0))


def row_label(r):
    if r["kind"] == "vllm":
        return "vLLM's scheme, `%s` (numpy)" % r["preset"]
    if r["kind"] != "served":
        return r["name"]
    label = "`%s`" % r["preset"]
    if r["boundary"]:
        label += " (first/last %d layers fp16)" % r["boundary"]
    if r["recipe"]:
        label = "%s: %s" % (r["name"], label)
    return label


def bytes_cells(r):
    """bytes / token | bits/coord (x vs bf16) at the measured length | per
    BYTES_AT length: x vs a window-aware bf16 cache / vs a naive one (an
    asterisk: the server's own count)."""
    if "bits_per_coord" not in r:
        return "| |" + " |" * (1 + len(BYTES_AT))
    cells = ["%.0f" % r["bytes_per_token"],
             "%.2f (%.2fx)" % (r["bits_per_coord"], r["ratio_vs_bf16"])]
    for t in BYTES_AT:
        a = r["at"][str(t)]
        cells.append("%.2f (%.2fx / %.2fx)%s" % (a["bits_per_coord"], a["ratio_vs_bf16"],
                                                 a["ratio_vs_naive_bf16"],
                                                 "*" if "server" in a else ""))
    return "| " + " | ".join(cells) + " |"


def e2e_table(rows, texts):
    at = " | ".join("at %dk: bits (x vs bf16 / vs naive bf16)" % (t // 1024) for t in BYTES_AT)
    head = ("| attention | bytes / token | bits/coord (x vs bf16) | %s | perplexity | "
            "change vs fp16 (range over seeds) | per seed (median) | %s | vLLM's published change |"
            % (at, " | ".join("change, %s" % t for t in texts)))
    lines = [head, "|" + "---|" * (8 + len(BYTES_AT) + len(texts))]
    for r in rows:
        if r.get("rejected"):
            lines.append("| %s | rejected by this server |%s" % (
                row_label(r), " |" * (6 + len(BYTES_AT) + len(texts))))
            continue
        if "ppl" not in r:
            continue
        spread, seeds = "", ""
        if len(r["seeds_run"]) > 1:
            spread = " (%+.1f%% to %+.1f%%)" % tuple(100 * x for x in r["ppl_change_range"])
            seeds = "%s (%+.2f%%)" % ("/".join("%+.2f" % (100 * x) for x in r["ppl_change_per_seed"]),
                                      100 * r["ppl_change_median"])
        per_text = " | ".join("%+.2f%%" % (100 * r["ppl_change_per_text"][t]) for t in texts)
        published = (VLLM_PPL_CHANGE.get(r.get("preset"), "")
                     if r["kind"] in ("served", "vllm") and not r.get("boundary")
                     and not r.get("recipe") else "")
        lines.append("| %s %s %.4f | %+.2f%%%s | %s | %s | %s |" % (
            row_label(r), bytes_cells(r), r["ppl"], 100 * r["ppl_change_vs_fp16"], spread, seeds,
            per_text, published))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# (d) pass key


def passkey_section(server_binary, model, prompts, rows, log, exact_prefill=False):
    tokens = max(p.context for p in prompts) + 16
    longest = max(prompts, key=lambda p: p.context)
    measured_at = longest.context + len(longest.answer) - 1  # tokens stored after the decode

    def run_one(row, seed, make):
        t0 = time.time()
        for p in prompts:
            backend, served = make()
            lp, ok = passkey_mod.score(model, p, backend)
            if served is not None:
                if p is longest:
                    row["stored_bytes"] = served.held_bytes()
                served.drop()
            row.setdefault("passkey", []).append(
                {"seed": seed, "context": p.context, "depth": p.depth, "key": p.key,
                 "logprob": lp, "greedy": bool(ok)})
        log("(d) %s %-28s seed %3d  %d prompts  %.1f s" % (model.name, row["name"], seed,
                                                           len(prompts), time.time() - t0))

    slots = run_rows(server_binary, model, rows, tokens, log, run_one,
                     exact_prefill=exact_prefill)
    base = {(e["context"], e["depth"], e["key"]): e["logprob"]
            for e in next(r for r in rows if r["kind"] == "fp16")["passkey"]}
    contexts = sorted({p.context for p in prompts})
    for r in rows:
        if "passkey" not in r:
            continue
        r["passkey_by_context"] = {}
        for c in contexts:
            cell = [e for e in r["passkey"] if e["context"] == c]
            deltas = [e["logprob"] - base[(e["context"], e["depth"], e["key"])] for e in cell]
            r["passkey_by_context"][c] = {
                "prompts": len(cell), "logprob": float(np.mean([e["logprob"] for e in cell])),
                "change_vs_fp16": float(np.mean(deltas)),
                "greedy": float(np.mean([e["greedy"] for e in cell]))}
    # The answer's tokens but the last go in one token at a time.
    finish_rows(model, rows, measured_at, slots, "passkey",
                1 if len(longest.answer) > 1 else longest.context)
    return contexts


def passkey_table(rows, contexts):
    tokens = next((r["tokens"] for r in rows if "tokens" in r), contexts[-1])
    head = ("| attention | bits/coord at %d tokens (at 32k) | %s |" % (tokens, " | ".join(
        "%d: change vs fp16, nats / greedy" % c for c in contexts)))
    lines = [head, "|" + "---|" * (2 + len(contexts))]
    for r in rows:
        if r.get("rejected"):
            lines.append("| %s | rejected by this server |%s" % (row_label(r), " |" * len(contexts)))
            continue
        if "passkey_by_context" not in r:
            continue
        bits = ("%.2f (%.2f)" % (r["bits_per_coord"], r["bits_per_coord_32k"])
                if "bits_per_coord" in r else "")
        cells = " | ".join("%+.2f / %.0f%%" % (r["passkey_by_context"][c]["change_vs_fp16"],
                                             100 * r["passkey_by_context"][c]["greedy"])
                           for c in contexts)
        lines.append("| %s | %s | %s |" % (row_label(r), bits, cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Tables (a), (b)


def needle_cells(row):
    tops = "/".join("%.2f" % n["top1_rate"] for n in row["needles"])
    ratios = "/".join("%.2f" % (n["approx_weight"] / n["exact_weight"]) if n["exact_weight"] else "-"
                      for n in row["needles"])
    return tops, ratios


def quality_table(rows):
    lines = ["| preset | bytes | key rel. MSE | logit RMSE (std) | top-1 | top-8 | TV | "
             "output rel. error | needle top-1 @3/5/7/9 | needle weight approx/exact @3/5/7/9 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p, r in rows.items():
        tops, ratios = needle_cells(r)
        lines.append("| `%s` | %d | %.4f | %.3f (%.2f) | %.2f | %.2f | %.3f | %.3f | %s | %s |" % (
            p, r["bytes_per_token_head"], r["key_rel_mse"], r["logit_rmse"], r["logit_std"],
            r["top1_agreement"], r["top8_agreement"], r["tv_distance"], r["output_rel_error"],
            tops, ratios))
    return "\n".join(lines)


def describe(model):
    c = model.config
    full = model.full_attention_layers()
    s = model.rope_spec()
    text = ("%s (GGUF weights dequantized to float32, numpy forward pass): %d layers, %d query "
            "heads, %d KV heads, head_dim %d, RoPE %s pairs over %d dims, base %g"
            % (model.name, c.layers, c.heads, c.kv_heads, c.head_dim, s["pair_layout"],
               s["rotary_dims"], s["base"]))
    if len(full) < c.layers and SLIDING["layers"] != "served":
        text += ("; tqkv serves its %d full-attention layers %s, the %d sliding-window layers "
                 "(%d tokens) stay fp16 in every row and count in the bytes"
                 % (len(full), full, c.layers - len(full), c.window))
    elif len(full) < c.layers:
        groups = cache_groups(model)
        text += ("; tqkv serves all %d layers, the %d sliding-window ones (%d tokens) as "
                 "CacheConfig.sliding_window_layers, the full-attention layers %s with full "
                 "attention, %s" % (
                     c.layers, c.layers - len(full), c.window, full,
                     ("in one cache, each layer centered with its own RoPE (`layer_ropes`: "
                      "local base %g, global %g)" % (model.rope_spec(0)["base"], s["base"])
                      if SLIDING["layer_ropes"] == "own" else
                      "in one cache given the global layers' RoPE (base %g)" % s["base"])
                     if len(groups) == 1 else "in %d caches, one per RoPE (%s)" % (
                         len(groups), ", ".join("layers %s: base %g" % (
                             l if len(l) < 6 else "%d of them" % len(l),
                             model.rope_spec(l[0])["base"]) for _, l in groups))))
    return text + "."


def strip_for_json(rows):
    return [{k: v for k, v in r.items()} for r in rows]


def main(argv=None, models=None):
    """`models`: {key: (model, tokenizer)} already loaded (tests); else loaded."""
    global BYTES_AT, ROTATION_SEEDS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_KEYS),
                    help="any of %s; gemma3 is skipped with a note when its package is absent"
                    % ", ".join(MODEL_KEYS))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per window (>= 16)")
    ap.add_argument("--texts", default="gpl3,pydoc",
                    help="(b, c): names (%s) or file paths; (b) uses the first"
                    % ", ".join("%s = %s" % kv for kv in TEXTS.items()))
    ap.add_argument("--text", help="one text file (the same as --texts FILE)")
    ap.add_argument("--windows", type=int, default=2, help="(c): windows per text")
    ap.add_argument("--chunk", type=int, default=0,
                    help="(c): feed each window in chunks of this many tokens (0: one Append "
                    "per layer); recipes with exact recent tokens need it (a whole-text Append keeps only "
                    "the text's last W tokens exact)")
    ap.add_argument("--prefix-reuse", type=int, default=0, metavar="S",
                    help="(c): the prefix-reuse protocol: each window's last S tokens are a "
                    "prefill over the stored first T - S (their own tokens attended exactly, "
                    "the prefix read through the server with first_query_position and merged "
                    "by lse); perplexity over those S tokens; no vLLM rows")
    ap.add_argument("--presets", default=",".join(ALL_PRESETS))
    ap.add_argument("--vllm", default=",".join(vllm_scheme.PRESETS),
                    help="(c): vLLM presets to emulate in numpy ('' for none)")
    ap.add_argument("--recipes", default="",
                    help="(c, d): recipes.py names, 'all', or PREFIX*; rows the server rejects "
                    "are listed as rejected")
    ap.add_argument("--eval-queries", type=int, default=32,
                    help="(b): token positions per KV head whose queries are evaluated")
    ap.add_argument("--sections", default="a,b,c", help="any of a, b, c, d")
    ap.add_argument("--passkey-contexts", default="1024,2048,4096")
    ap.add_argument("--passkey-prompts", type=int, default=1, help="(d): prompts per (context, depth)")
    ap.add_argument("--passkey-presets", default=PASSKEY_PRESETS)
    ap.add_argument("--passkey-vllm", default=PASSKEY_VLLM)
    ap.add_argument("--no-passkey-exact", dest="passkey_exact", action="store_false",
                    help="(d): no float32-attention row (fp16 is the baseline either way)")
    ap.add_argument("--passkey-prefill", choices=("served", "exact"), default="served",
                    help="(d): the prompt's own attention served (one Append + one causal "
                    "Attend) or exact (stored, then attended in numpy over fp16 K/V, as a "
                    "prefill node does); the answer is served either way")
    ap.add_argument("--passkey-seeds", action="store_true",
                    help="(d): every rotation seed (default: seed 0 only)")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    ap.add_argument("--chart", help="(c): write the perplexity-vs-bits chart to this PNG")
    ap.add_argument("--no-seeds", dest="seeds", action="store_false",
                    help="(c): one rotation seed per preset instead of %d" % len(ROTATION_SEEDS))
    ap.add_argument("--rotation-seeds", default=",".join(str(x) for x in ROTATION_SEEDS),
                    help="rotation seeds of rotated presets (CacheConfig.rotation_seed)")
    ap.add_argument("--boundary-rows", default=",".join(BOUNDARY_ROWS),
                    help="(c): presets that also get a first/last 2 layers fp16 row ('' for none)")
    ap.add_argument("--sliding-layers", choices=("served", "fp16"), default="served",
                    help="sliding-window layers served by tqkv (sliding_window_layers) or kept "
                    "fp16 in numpy in every row")
    ap.add_argument("--rope-groups", choices=("one", "split"), default="one",
                    help="served layers in one cache (the global layers' RoPE) or one cache per "
                    "RoPE (Gemma 3: local base 1e4, global 1e6)")
    ap.add_argument("--key-scales-text", default="pydoc",
                    help="recipes with key_scales: the calibration text (a --texts name or "
                    "file), its first --key-scales-tokens tokens")
    ap.add_argument("--key-scales-tokens", type=int, default=1024)
    ap.add_argument("--layer-ropes", choices=("own", "cache"), default="own",
                    help="pre-RoPE centering: layers whose RoPE differs from their cache's get "
                    "their own (CacheConfig.layer_ropes; Gemma 3's local layers, base 1e4) or "
                    "the cache's (the global layers' on Gemma 3: centering gains less)")
    ap.add_argument("--bytes-at", default=",".join(str(t) for t in BYTES_AT),
                    help="(c, d): context lengths of the bytes columns (after a decode step)")
    ap.add_argument("--server-bytes", action="store_true",
                    help="(c): measure the --bytes-at columns from the server's own counts "
                    "(random K/V appended to every served row's config) instead of the formula")
    args = ap.parse_args(argv)
    if args.prefix_reuse and not 2 <= args.prefix_reuse <= args.tokens - 16:
        ap.error("--prefix-reuse S wants 2 <= S <= --tokens - 16")
    BYTES_AT = tuple(int(t) for t in args.bytes_at.split(",") if t)
    ROTATION_SEEDS = [int(x) for x in args.rotation_seeds.split(",")]
    SLIDING.update(layers=args.sliding_layers, rope_groups=args.rope_groups,
                   layer_ropes=args.layer_ropes)
    presets = args.presets.split(",")
    sections = set(args.sections.split(","))
    texts = [args.text] if args.text else args.texts.split(",")
    cli = binary("TQKV_CLI", "tqkv")
    log = lambda msg: print("[quality_report] " + msg, file=sys.stderr, flush=True)
    report = {"presets": presets, "tokens": args.tokens, "texts": texts, "windows": args.windows,
              "command": sys.argv if argv is None else ["quality_report.py"] + list(argv),
              "models": {}}
    md = ["Run: `%s`" % " ".join(report["command"]), ""]
    recipe_names = recipes_mod.select(args.recipes)
    with tempfile.TemporaryDirectory(prefix="tqkv-quality-") as tmp:
        work = pathlib.Path(tmp)
        if "a" in sections:
            t0 = time.time()
            report["synthetic"] = synthetic_section(cli, presets, work)
            log("(a) synthetic: %.1f s" % (time.time() - t0))
            md += ["## (a) Synthetic keys: 4 hot channels (x10) + per-channel offset",
                   "", "4096 keys, 64 Gaussian queries, Gaussian values, head_dim 128 "
                   "(`tqkv synth --kind outlier-keys --seed 1`).", "",
                   quality_table(report["synthetic"]), ""]
        if not sections & {"b", "c", "d"}:
            print("\n".join(md))
            return write_json(report, args.json, sections)
        server = binary("TQKV_SERVER", "tqkv-server")
        codecs = preset_codecs(cli)
        unservable = split_presets(cli)
        for key in args.models.split(","):
            if models and key in models:
                model, tokenizer = models[key]
            elif not model_available(key):
                md += ["## %s: not installed" % key, "",
                       "Skipped: `TQKV_QUALITY_MODELS=all scripts/python_env.sh` installs it.", ""]
                log("%s: not installed, skipped" % key)
                continue
            else:
                t0 = time.time()
                model, tokenizer = load_model(key)
                log("%s loaded: %.1f s" % (model.name, time.time() - t0))
            entry = report["models"].setdefault(model.name, {"key": key})
            c = model.config
            entry["model"] = {"layers": c.layers, "heads": c.heads, "kv_heads": c.kv_heads,
                              "head_dim": c.head_dim, "rope": model.rope_spec(),
                              "full_attention_layers": model.full_attention_layers(),
                              "served_layers": served_layers(model),
                              "caches": [l for _, l in cache_groups(model)],
                              "windows": model.windows(), "path": model.path}
            about = describe(model)
            md += ["# %s" % model.name, "", about, ""]
            t0 = time.time()
            windows = {t: text_windows(model, tokenizer, read_text(t), args.tokens, args.windows)
                       for t in texts}
            log("tokenized %s: %.1f s" % (", ".join(texts), time.time() - t0))
            if any(recipes_mod.RECIPES[n].get("key_scales") for n in recipe_names):
                t0 = time.time()
                calibration = text_windows(model, tokenizer, read_text(args.key_scales_text),
                                           args.key_scales_tokens, 1)[0]
                KEY_SCALES[model.name] = key_scales_mod.measure(model, calibration)
                entry["key_scales_text"] = args.key_scales_text
                log("key scales from %d tokens of %s: %.1f s" % (
                    len(calibration), args.key_scales_text, time.time() - t0))
            worst = None
            if "b" in sections:
                t0 = time.time()
                rows, heads, queries, worst_layers = capture_section(
                    cli, model, windows[texts[0]][0], presets, args.eval_queries, work)
                entry["real_kv"] = rows
                entry["worst_layers"] = worst_layers
                worst = sorted(w["served_index"] for w in worst_layers[:2]) or None
                log("(b) %s real K/V: %.1f s" % (model.name, time.time() - t0))
                md += ["## (b) Real K/V: every layer and KV head", "",
                       "The first %d tokens of %s. Means over %d (layer, KV head) pairs; %d "
                       "queries per pair (the model's own queries of that KV head's query "
                       "heads), each against all keys." % (args.tokens, texts[0], heads, queries),
                       "", quality_table(rows), "",
                       "Served layers with the largest `%s` output error (the `measured` "
                       "protected layers of recipes.py): %s." % (
                           WORST_PRESET, ", ".join("layer %d (served index %d): %.3f" % (
                               w["layer"], w["served_index"], w["output_rel_error"])
                               for w in worst_layers[:4])), ""]
            served_presets = [p for p in presets if p not in unservable]
            # Every rotated preset, --presets or not: recipe rows use them too.
            seeded = {p for p in codecs if p not in unservable and rotated(codecs[p])}
            if "c" in sections:
                t0 = time.time()
                PROTOCOL["prefix_reuse"] = args.prefix_reuse
                rows = row_specs(model, served_presets,
                                 [p for p in args.boundary_rows.split(",") if p in served_presets],
                                 seeded if args.seeds else set(),
                                 [p for p in args.vllm.split(",") if p and not args.prefix_reuse],
                                 recipe_names, worst)
                check, slots = e2e_section(server, model, windows, rows, log, args.chunk)
                if args.server_bytes and BYTES_AT:
                    t1 = time.time()
                    server_bytes_section(server, model, rows, slots, BYTES_AT, log)
                    log("(c) %s server bytes at %s: %.1f s" % (
                        model.name, ",".join(map(str, BYTES_AT)), time.time() - t1))
                entry["perplexity"] = strip_for_json(rows)
                entry["chunk"] = args.chunk
                entry["prefix_reuse"] = args.prefix_reuse
                entry["preset_slot_bytes"] = slots
                entry["fp16_check"] = dict(check, layer_tolerance=FP16_CHECK_REL,
                                           ppl_tolerance=PPL_CHECK_REL)
                report.setdefault("fp16_checks", []).append(check["passed"])
                log("(c) %s perplexity: %.1f s" % (model.name, time.time() - t0))
                unserved = sorted(unservable & set(presets))
                md += ["## (c) Perplexity with attention served by tqkv", "",
                       "%d window(s) of %d tokens of each of %s; the first columns pool every "
                       "window of every text. Rows served by a real tqkv-server (CPU backend); "
                       "boundary_layers 0 unless the row says otherwise; rotated presets: mean "
                       "over rotation seeds %s and the range. vLLM's scheme: Gaussian-"
                       "approximation codebook, Hadamard without signs, norm correction, "
                       "min-max values, on the same layers in numpy. Bits per coordinate over "
                       "every K and V coordinate the layers need (a sliding-window layer needs "
                       "its window), so 16 / bits is the ratio against a bf16 cache that also "
                       "keeps only each window; at %d tokens from the server's stored_bytes "
                       "(the formula for numpy rows; fed %s), and at %s after a decode step "
                       "(a sliding-window layer then holds exactly its window) from %s, with "
                       "the ratio against a naive bf16 cache that keeps every token of every "
                       "layer next to it. Change vs served fp16. vLLM's published figures are "
                       "on another model and data." % (
                           args.windows, args.tokens, ", ".join(texts),
                           ROTATION_SEEDS if args.seeds else [0], args.tokens,
                           ("as a prefix of %d tokens, then %d prefilled over it (Attend with "
                            "first_query_position; perplexity over those)" % (
                                args.tokens - args.prefix_reuse, args.prefix_reuse)
                            if args.prefix_reuse else
                            "in %d-token appends" % args.chunk if args.chunk else "in one append"),
                           " and ".join(str(t) for t in BYTES_AT),
                           "the server's own counts (*: random K/V, seed 0)" if args.server_bytes
                           else "the formula")
                       + (" Not served: %s (split keys need per-(layer, head) hot channels)."
                          % ", ".join("`%s`" % p for p in unserved) if unserved else ""), "",
                       e2e_table(rows, texts), "",
                       "fp16 check: served fp16 vs numpy with fp16 K/V: largest per-layer "
                       "attention output difference %.2e (relative; tolerance %.0e), perplexity "
                       "%.2e (relative; tolerance %.0e): %s." % (
                           check["max_layer_rel"], FP16_CHECK_REL,
                           check["ppl_rel"] if check["ppl_rel"] is not None else float("nan"),
                           PPL_CHECK_REL, "passed" if check["passed"] else "FAILED"), ""]
            if "d" in sections:
                t0 = time.time()
                contexts = [int(x) for x in args.passkey_contexts.split(",")]
                prompts = passkey_mod.prompts(tokenizer.encode, contexts, args.passkey_prompts,
                                              bos=model.bos)
                pk_presets = [p for p in args.passkey_presets.split(",") if p in served_presets
                              or p == "fp16"]
                rows = row_specs(model, pk_presets, [],
                                 seeded if args.passkey_seeds else set(),
                                 [p for p in args.passkey_vllm.split(",") if p], recipe_names,
                                 worst)
                if not args.passkey_exact:
                    rows = [r for r in rows if r["kind"] != "exact"]
                contexts = passkey_section(server, model, prompts, rows, log,
                                           args.passkey_prefill == "exact")
                entry["passkey"] = strip_for_json(rows)
                log("(d) %s pass key: %.1f s" % (model.name, time.time() - t0))
                md += ["## (d) Pass-key retrieval", "",
                       "%d prompt(s) per (context, depth) at depths %s: a 5-digit key in filler "
                       "text, then \"%s\"; prefill (%s), then the answer decoded one token per "
                       "Append/Attend. Change of the answer's log-probability (sum over its %d "
                       "tokens, teacher-forced) vs numpy fp16, mean over prompts, in nats; "
                       "greedy: share of prompts whose greedy decode is the key. fp16 finds it "
                       "in %s." % (args.passkey_prompts, "/".join(
                           "%d%%" % (100 * d) for d in passkey_mod.DEPTHS), passkey_mod.QUESTION,
                           "stored, its own attention exact in numpy over fp16 K/V"
                           if args.passkey_prefill == "exact" else
                           "one Append + one causal Attend per layer",
                           len(prompts[0].answer), ", ".join(
                               "%.0f%% at %d" % (100 * next(r for r in rows if r["kind"] == "fp16")
                                                 ["passkey_by_context"][c]["greedy"], c)
                               for c in contexts)), "",
                       passkey_table(rows, contexts), ""]
    print("\n".join(md))
    if args.chart and report["models"]:
        import chart
        chart.plot(report, args.chart)
        log("chart: %s" % args.chart)
    return write_json(report, args.json, sections)


def write_json(report, path, sections):
    if path:
        pathlib.Path(path).write_text(json.dumps(report, indent=2, default=str))
    if "c" in sections and not all(report.get("fp16_checks", [True])):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
