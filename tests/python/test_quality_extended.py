"""Fast checks of the quality report's extended pieces (tools/quality/):
RoPE descriptions, the SentencePiece tokenizer on a toy vocabulary, the
pass-key prompts and one served pass-key decode, vLLM's scheme emulated in
numpy, the bytes formula, recipes as cache config text; Gemma 3 checks run
only where its package is installed (scripts/python_env.sh with
TQKV_QUALITY_MODELS=all)."""
import copy
import dataclasses
import math
import sys

import numpy as np
import pytest

from conftest import ROOT, server_binary
from tqkv.testing import LocalServer

sys.path.insert(0, str(ROOT / "tools" / "quality"))
import attention  # noqa: E402
import kv_bytes  # noqa: E402
import llama  # noqa: E402
import passkey  # noqa: E402
import quality_report  # noqa: E402
import recipes  # noqa: E402
import rope  # noqa: E402
import vllm_scheme  # noqa: E402
from bpe import ByteLevelBPE  # noqa: E402
from spm import SentencePieceBPE  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return llama.Llama()


@pytest.fixture(scope="module")
def tokenizer(model):
    return ByteLevelBPE.from_gguf(model.reader)


def sliced(model, layers):
    m = copy.copy(model)
    m.config = dataclasses.replace(model.config, layers=layers)
    return m


# --- RoPE -------------------------------------------------------------------

def test_smollm2_rope_description_reproduces_its_post_rope_keys(model, tokenizer):
    s = model.rope_spec()
    assert s == {"rotary_dims": 64, "pair_layout": "interleaved", "base": 100000.0,
                 "scaling_type": "none"}
    tokens = tokenizer.encode("The pass key is 12345. Remember it.")
    x = model.embed(tokens)
    positions = np.arange(len(tokens))
    q, k, v = model.qkv(0, x, positions)
    _, k_pre, _ = model.qkv_pre_rope(0, x)
    np.testing.assert_allclose(rope.apply(s, k_pre, positions), k, rtol=0, atol=1e-5)
    np.testing.assert_allclose(rope.apply(s, k, positions, inverse=True), k_pre, atol=1e-4)
    # The rotation keeps each pair's length: the pre-RoPE mean is what centering can use.
    np.testing.assert_allclose(np.linalg.norm(k, axis=-1), np.linalg.norm(k_pre, axis=-1),
                               rtol=1e-5)


def test_rope_layouts_scaling_and_config_text():
    x = np.arange(8, dtype=np.float32).reshape(1, 1, 8) + 1
    half = rope.spec(8, rope.HALF_SPLIT, 10000.0)
    inter = rope.spec(8, rope.INTERLEAVED, 10000.0)
    # Pair 0 at position 1 rotates by 1 radian: half-split pairs (0, 4), interleaved (0, 1).
    out = rope.apply(half, x, [1])[0, 0]
    assert out[0] == pytest.approx(1 * math.cos(1) - 5 * math.sin(1), abs=1e-5)
    assert out[4] == pytest.approx(1 * math.sin(1) + 5 * math.cos(1), abs=1e-5)
    out = rope.apply(inter, x, [1])[0, 0]
    assert out[1] == pytest.approx(1 * math.sin(1) + 2 * math.cos(1), abs=1e-5)
    l3 = rope.spec(128, rope.INTERLEAVED, 500000.0, "llama3", 8, 1, 4, 8192)
    plain, scaled = rope.inv_freq(rope.spec(128, rope.INTERLEAVED, 500000.0)), rope.inv_freq(l3)
    assert scaled[0] == plain[0]                      # high frequencies kept
    assert scaled[-1] == pytest.approx(plain[-1] / 8)  # low frequencies divided by the factor
    assert np.all(scaled <= plain)
    lin = rope.inv_freq(rope.spec(8, rope.HALF_SPLIT, 10000.0, "linear", 4))
    np.testing.assert_allclose(lin, rope.inv_freq(half) / 4)
    explicit = rope.spec(4, rope.INTERLEAVED, 1.0, inv_freq=[0.5, 0.25])
    np.testing.assert_allclose(rope.inv_freq(explicit), [0.5, 0.25])
    assert rope.config_text(l3) == (
        'rope { rotary_dims: 128 pair_layout: INTERLEAVED base: 500000.0 scaling_type: "llama3" '
        'scaling_factor: 8.0 low_freq_factor: 1.0 high_freq_factor: 4.0 '
        'original_max_position: 8192 }')
    assert "inv_freq: [0.5, 0.25]" in rope.config_text(explicit)


# --- SentencePiece BPE (Gemma 3's tokenizer) on a toy vocabulary -------------

def test_sentencepiece_bpe_merges_by_score_with_byte_fallback():
    tokens = ["<pad>", "<eos>", "<bos>", "\n", "  ", "\u2581", "a", "b", "c", "ab", "bc",
              "\u2581a", "\u2581ab", "ca"] + ["<0x%02X>" % b for b in range(256)]
    scores = [0, 0, 0, 0, 0, -1, -2, -2, -2, -5, -3, -4, -6, -8] + [0] * 256
    types = [3, 3, 3, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1] + [6] * 256
    t = SentencePieceBPE(tokens, scores, types)
    ids = lambda text: [t.tokens[i] for i in t.encode(text)]
    # "abc": bc (-3) beats ab (-5), then nothing merges a + bc.
    assert ids("abc") == ["a", "bc"]
    # "cab": ab (-5) beats ca (-8).
    assert ids("cab") == ["c", "ab"]
    # " ab": ▁a (-4) first, then ▁a + b = ▁ab (-6).
    assert ids(" ab") == ["\u2581ab"]
    # User-defined tokens are cut out first; unknown characters become bytes.
    assert ids("a\nb  c") == ["a", "\n", "b", "  ", "c"]
    assert ids("é") == ["<0xC3>", "<0xA9>"]
    for text in ("abc ab\n\nb", "é a  bc"):
        assert t.decode(t.encode(text)) == text


# --- pass key -----------------------------------------------------------------

def test_passkey_prompts_have_the_length_depth_and_answer_asked_for(tokenizer):
    for context in (96, 300):
        for depth in passkey.DEPTHS:
            p = passkey.make_prompt(tokenizer.encode, context, depth, "40917", seed=3)
            assert len(p.tokens) == context
            text = tokenizer.decode(p.tokens)
            assert text.count("The pass key is 40917.") == 1
            assert text.endswith(passkey.QUESTION)
            assert tokenizer.decode(p.answer) == " 40917"
            needle = text.index("The pass key is 40917")
            assert abs(needle / len(text) - depth) < 0.3
    deep = passkey.make_prompt(tokenizer.encode, 300, 0.9, "40917", seed=3)
    shallow = passkey.make_prompt(tokenizer.encode, 300, 0.1, "40917", seed=3)
    assert shallow.needle_at < deep.needle_at
    with pytest.raises(ValueError):
        passkey.make_prompt(tokenizer.encode, 40, 0.5, "40917")
    batch = passkey.prompts(tokenizer.encode, [96, 128], 2, bos=7)
    assert len(batch) == 2 * 3 * 2 and all(p.tokens[0] == 7 for p in batch)
    assert len({p.key for p in batch}) > 1 and all(len(p.key) == 5 for p in batch)
    assert batch == passkey.prompts(tokenizer.encode, [96, 128], 2, bos=7)  # deterministic


CONFIG = """
caches { name: "fp16" num_layers: 3 num_kv_heads: 3 num_query_heads: 9 head_dim: 64
         page_tokens: 16 preset: "fp16" boundary_layers: 0 memory_budget_bytes: 16777216 }
caches { name: "tq3" num_layers: 3 num_kv_heads: 3 num_query_heads: 9 head_dim: 64
         page_tokens: 16 preset: "turboquant_k3v4_nc" boundary_layers: 0
         memory_budget_bytes: 16777216 }
caches { name: "probe:turboquant_k3v4_nc" num_layers: 1 num_kv_heads: 3 num_query_heads: 9
         head_dim: 64 page_tokens: 16 preset: "turboquant_k3v4_nc" memory_budget_bytes: 1048576 }
"""


def test_served_passkey_decode_matches_numpy_fp16(model, tokenizer):
    m = sliced(model, 3)
    p = passkey.make_prompt(tokenizer.encode, 80, 0.5, "27182", seed=1)
    want_lp, want_greedy = passkey.score(m, p, attention.fp16())
    exact_lp, _ = passkey.score(m, p, attention.exact())
    assert abs(exact_lp - want_lp) < 1e-2
    with LocalServer(server_binary(), CONFIG) as server, server.client(timeout=60) as client:
        backend = quality_report.ServedAttention(client, "fp16")
        lp, greedy = passkey.score(m, p, backend)
        # Prefill, then one Append per answer token but the last.
        assert client.get_sequence(backend.sequence, cache="fp16").layer_tokens == \
            [80 + len(p.answer) - 1] * 3
        assert backend.stored_bytes == (80 + len(p.answer) - 1) * 3 * 3 * 256
        assert backend.held_bytes() == backend.stored_bytes
        backend.drop()
        tq = quality_report.ServedAttention(client, "tq3")
        tq_lp, _ = passkey.score(m, p, tq)
        slot = quality_report.probe_slots(client, m, ["turboquant_k3v4_nc"])
        tq.drop()
    assert abs(lp - want_lp) < 1e-3 and greedy == want_greedy
    assert tq_lp != lp
    assert slot == {"turboquant_k3v4_nc": 26 + 36}  # 3-bit keys + fp16 norm, 4-bit values


# --- vLLM's scheme --------------------------------------------------------------

def test_vllm_gaussian_codebook_and_hadamard():
    for d in (64, 128):
        c1 = vllm_scheme.gaussian_codebook(1, d)
        np.testing.assert_allclose(c1, [-math.sqrt(2 / math.pi) / math.sqrt(d),
                                        math.sqrt(2 / math.pi) / math.sqrt(d)], rtol=1e-12)
    # Max's 2-bit Gaussian quantizer: +-0.4528, +-1.5104 (unit variance).
    c2 = vllm_scheme.gaussian_codebook(2, 128) * math.sqrt(128)
    np.testing.assert_allclose(c2, [-1.5104, -0.4528, 0.4528, 1.5104], atol=2e-4)
    h = vllm_scheme.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-12)
    assert np.all(h[0] > 0) and np.all(h[:, 0] > 0)  # Sylvester order, no sign diagonal
    with pytest.raises(ValueError):
        vllm_scheme.hadamard(80)
    assert [vllm_scheme.bytes_per_token_head(p, 128) for p in vllm_scheme.PRESETS] == \
        [196, 134, 118, 102]


def test_vllm_key_and_value_codecs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 128)).astype(np.float32)
    for bits, model_error in ((3, 0.034), (4, 0.0093)):
        k = vllm_scheme.KeyCodec(bits, 128)(x)
        rel = np.mean(np.sum((k - x) ** 2, 1) / np.sum(x ** 2, 1))
        assert abs(rel - model_error) / model_error < 0.1
        # Norm correction: the decoded key has the (fp16) norm of the input.
        np.testing.assert_allclose(np.linalg.norm(k, axis=1),
                                   vllm_scheme.fp16(np.linalg.norm(x, axis=1)), rtol=1e-5)
    v = x * 3 + 1
    for bits in (3, 4):
        got = vllm_scheme.ValueCodec(bits)(v)
        step = (v.max(1) - v.min(1)) / (2 ** bits - 1)
        assert np.all(np.abs(got - v).max(1) <= step * 0.5 * 1.01 + 1e-2)
        assert np.all(got.min(1) >= v.min(1) - 1e-2)
    assert vllm_scheme.fp8_e4m3(np.array([1.06, 300.0, 1000.0, -2.3])).tolist() == \
        [1.0, 288.0, 448.0, -2.25]


def test_vllm_cache_applies_to_every_token_it_reads():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(5, 4, 64)).astype(np.float32)
    k = rng.normal(size=(5, 2, 64)).astype(np.float32)
    v = rng.normal(size=(5, 2, 64)).astype(np.float32)
    c = vllm_scheme.cache("turboquant_3bit_nc", 64)
    out = c(0, q, k, v)
    kc, vc = vllm_scheme.codecs("turboquant_3bit_nc", 64)
    np.testing.assert_allclose(out, attention.causal_attention(q, kc(k), vc(v)), atol=1e-6)
    # Decode one more token: the stored K/V and the new one, all through the codec.
    q1, k1, v1 = q[:1] * 2, k[:1] * 2, v[:1] * 2
    got = c(0, q1, k1, v1, start=5)
    want = attention.causal_attention(q1, np.concatenate([kc(k), kc(k1)]),
                                      np.concatenate([vc(v), vc(v1)]), start=5)
    np.testing.assert_allclose(got, want, atol=1e-6)


# --- bytes ----------------------------------------------------------------------

def test_bytes_formula_counts_recent_sinks_protected_and_sliding_layers():
    smol = kv_bytes.Layout(30, 3, 64, list(range(30)))
    fp = kv_bytes.fp16_slot(64)
    assert fp == 256
    t = 1024
    assert kv_bytes.bits_per_coordinate(smol, t, kv_bytes.row_bytes(smol, t, fp)) == 16.0
    plain = kv_bytes.row_bytes(smol, t, 62)
    assert plain == 30 * 3 * t * 62
    assert kv_bytes.bits_per_coordinate(smol, t, plain) == pytest.approx(62 * 8 / 128)
    # 4 sinks + 64 recent tokens at fp16, the rest at the preset; one layer protected.
    got = kv_bytes.row_bytes(smol, t, 62, sinks=4, recent=64, protected={0: 66})
    # (exact tokens keep their compressed slot too, as the server stores them)
    want = 29 * 3 * (68 * 256 + t * 62) + 3 * (68 * 256 + t * 66)
    assert got == want
    # A short context is all exact.
    assert kv_bytes.row_bytes(smol, 50, 62, sinks=4, recent=64) == 30 * 3 * 50 * (256 + 62)
    # At 32k the recent tokens' share shrinks.
    b32 = kv_bytes.bits_per_coordinate(smol, 32768, kv_bytes.row_bytes(smol, 32768, 62, 4, 64))
    b1k = kv_bytes.bits_per_coordinate(smol, t, got)
    assert 62 * 8 / 128 < b32 < b1k
    # Boundary layers at fp16; centered rows add one fp32 mean per (layer, head).
    assert kv_bytes.row_bytes(smol, t, 62, boundary=2) == 26 * 3 * t * 62 + 4 * 3 * t * 256
    assert kv_bytes.row_bytes(smol, t, 62, centered=True) == plain + 30 * 3 * 4 * 64
    # Gemma-like: 3 served layers, 15 sliding layers of 512 tokens kept fp16.
    gem = kv_bytes.Layout(18, 1, 256, [5, 11, 17], {l: 512 for l in range(18) if (l + 1) % 6})
    fp = kv_bytes.fp16_slot(256)
    for tokens in (100, 4096, 32768):
        assert kv_bytes.bits_per_coordinate(gem, tokens,
                                            kv_bytes.row_bytes(gem, tokens, fp)) == 16.0
    tq = kv_bytes.row_bytes(gem, 32768, 230)
    assert tq == 3 * 32768 * 230 + 15 * 512 * fp
    assert kv_bytes.ratio_vs_bf16(kv_bytes.bits_per_coordinate(gem, 32768, tq)) > 3


def test_bytes_formula_for_served_sliding_window_layers():
    # Gemma 3 270M's shape with every layer served: after a decode step a
    # windowed layer holds its window. The server's figures for this shape
    # (docs/cache.md, "Sliding-window layers": 8,256 tokens, turboquant_k3v4_nc).
    local = {l: 512 for l in range(18) if (l + 1) % 6}
    gem = kv_bytes.Layout(18, 1, 256, list(range(18)), local)
    assert kv_bytes.row_bytes(gem, 8256, 230) == 7463040
    assert kv_bytes.row_bytes(kv_bytes.Layout(18, 1, 256, list(range(18))), 8256, 230) == 34179840
    assert kv_bytes.naive_bf16_bytes(gem, 8256) == 152174592
    assert kv_bytes.window_aware_bf16_bytes(gem, 8256) == (3 * 8256 + 15 * 512) * 1024
    # A 16-token append keeps what its first query sees: window + 15 tokens;
    # a whole-text append keeps every token until the next append.
    assert kv_bytes.held_begin(1024, 512, 16) == 1008 + 1 - 512
    assert kv_bytes.held_begin(1024, 512, 1024) == 0 and kv_bytes.held_begin(1024, None) == 0
    # Exact tokens: sinks leave with their tokens, the recent tokens stay.
    fp = kv_bytes.fp16_slot(256)
    got = kv_bytes.row_bytes(gem, 8192, 230, sinks=4, recent=64, centered=True)
    want = (3 * (8192 * 230 + 68 * fp) + 15 * (512 * 230 + 64 * fp)) + 18 * 4 * 256
    assert got == want
    # Short of the window a windowed layer is a full one.
    assert kv_bytes.row_bytes(gem, 300, 230, 4, 64) == 18 * (300 * 230 + 68 * fp)
    assert quality_report.last_append(1024, 16) == 16
    assert quality_report.last_append(1000, 16) == 8
    assert quality_report.last_append(1024, 0) == 1024


def windowed(model, layers, windows):
    """A sliced model whose layers in `windows` ({layer: window}) attend over
    a sliding window: a Gemma-3-like layout on SmolLM2's weights."""
    m = sliced(model, layers)
    m.window = lambda layer: windows.get(layer)
    return m


def test_sliding_window_layers_are_served_and_counted(model, tokenizer):
    m = windowed(model, 3, {0: 16, 1: 16})
    tokens = tokenizer.encode("The pass key is 12345. Remember it. " * 8)[:60]
    assert quality_report.served_layers(m) == [0, 1, 2]
    config = quality_report.server_config(m, 64, [("fp16", "fp16", 0, 0)])
    assert "sliding_window_layers { layers: [0, 1] window: 16 }" in config
    want = quality_report.forward_chunked(m, tokens, attention.fp16(m.windows()), 8)
    checked = []

    def check(layer, q, k, v, out):
        ref = attention.causal_attention(q, attention.fp16_round(k), attention.fp16_round(v), 0,
                                         m.window(layer))
        checked.append(np.linalg.norm(out - ref) / np.linalg.norm(ref))

    with LocalServer(server_binary(), config) as server, server.client(timeout=60) as client:
        backend, served = quality_report.served_backend(m, client, "fp16", check)
        got = quality_report.forward_chunked(m, tokens, backend, 8)
        info = client.get_sequence(backend.sequence, cache="fp16")
        assert info.layer_tokens == [60] * 3
        held = served.held()
        served.drop()
    assert len(checked) == 3 and max(checked) <= quality_report.FP16_CHECK_REL
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    lay = quality_report.layout(m)
    assert held["stored_bytes"] == kv_bytes.row_bytes(lay, 60, 256, last_append=4)
    # The last append was 4 tokens at 56: windowed layers keep 56 + 1 - 16 on.
    assert held["stored_bytes"] == held["stored_bytes_bf16"] == (19 + 19 + 60) * 3 * 256
    assert held["pool_bytes"] >= held["stored_bytes"]


def test_exact_prefill_stores_the_prompt_and_serves_the_answer(model, tokenizer):
    m = windowed(model, 3, {0: 16, 1: 16})
    p = passkey.make_prompt(tokenizer.encode, 80, 0.5, "27182", seed=1)
    want_lp, want_greedy = passkey.score(m, p, attention.fp16(m.windows()))
    config = quality_report.server_config(m, 96, [("fp16", "fp16", 0, 0),
                                                  ("tq3", "turboquant_k3v4_nc", 0, 0)])
    with LocalServer(server_binary(), config) as server, server.client(timeout=60) as client:
        backend, served = quality_report.served_backend(m, client, "fp16", exact_prefill=True)
        lp, greedy = passkey.score(m, p, backend)
        held = served.held()
        served.drop()
        lps = []
        for exact in (True, False):
            backend, served = quality_report.served_backend(m, client, "tq3", exact_prefill=exact)
            lps.append(passkey.score(m, p, backend)[0])
            served.drop()
    assert abs(lp - want_lp) < 1e-3 and greedy == want_greedy
    # Prefill, then one-token appends: the windowed layers hold their window.
    tokens = 80 + len(p.answer) - 1
    assert held["stored_bytes"] == kv_bytes.row_bytes(quality_report.layout(m), tokens, 256)
    assert held["stored_bytes"] == (16 + 16 + tokens) * 3 * 256
    # The compressed cache: the prompt's attention exact or served differ.
    assert lps[0] != lps[1]


def test_fp16_sliding_layers_mode_and_split_caches(model):
    m = windowed(model, 3, {0: 16, 1: 16})
    try:
        quality_report.SLIDING.update(layers="fp16")
        assert quality_report.served_layers(m) == [2]
        assert "sliding_window_layers" not in quality_report.server_config(
            m, 64, [("a", "fp16", 0, 0)])
        lay = quality_report.layout(m)
        assert kv_bytes.row_bytes(lay, 60, 62) == 3 * 60 * 62 + 2 * 3 * 16 * 256
        quality_report.SLIDING.update(layers="served", rope_groups="split")
        m.rope_spec = lambda layer=None: rope.spec(64, rope.INTERLEAVED,
                                                   1e4 if layer is not None and layer < 2 else 1e5)
        assert quality_report.cache_groups(m) == [("/rope0", [0, 1]), ("/rope1", [2])]
        row = {"name": "csw", "kind": "served", "preset": "tqkv_k3v4u_csw", "boundary": 0,
               "seeds": [0], "recipe": {"rope": True}}
        config = quality_report.server_config(m, 64, [("csw", "tqkv_k3v4u_csw", 0, 0)],
                                              {"csw": row})
        assert 'name: "csw/rope0" num_layers: 2' in config and "base: 10000.0" in config
        assert 'name: "csw/rope1" num_layers: 1' in config and "base: 100000.0" in config
        assert config.count("sliding_window_layers") == 1
    finally:
        quality_report.SLIDING.update(layers="served", rope_groups="one")


def test_server_bytes_after_a_decode_step_equal_the_formula(model):
    m = windowed(model, 3, {0: 16, 1: 16})
    rows = [{"name": "tq3", "kind": "served", "preset": "turboquant_k3v4_nc", "boundary": 0,
             "seeds": [0], "recipe": {}},
            {"name": "csw", "kind": "served", "preset": "tqkv_k3v4u_csw", "boundary": 0,
             "seeds": [0], "recipe": {"rope": True, "exact_recent_tokens": 8}}]
    slots = {"turboquant_k3v4_nc": 62}
    old = quality_report.BYTES_AT
    try:
        quality_report.BYTES_AT = (40, 72)
        for r in rows:
            quality_report.bytes_at(m, r, slots)
        logged = []
        quality_report.server_bytes_section(server_binary(), m, rows, slots, (40, 72),
                                            logged.append, step=16)
    finally:
        quality_report.BYTES_AT = old
    assert not [msg for msg in logged if "formula says" in msg]
    lay = quality_report.layout(m)
    for r in rows:
        for t in ("40", "72"):
            cell = r["at"][t]
            assert cell["server"]["stored_bytes"] == cell["bytes_formula"]
            # After a decode step the server's bf16 count is the window-aware baseline.
            assert cell["server"]["stored_bytes_bf16"] == cell["bf16_window_aware"]
            assert cell["ratio_vs_naive_bf16"] > cell["ratio_vs_bf16"] > 1
    assert rows[0]["at"]["72"]["bytes"] == (72 + 16 + 16) * 3 * 62
    assert kv_bytes.window_aware_bf16_bytes(lay, 72) == (72 + 16 + 16) * 3 * 256


# --- recipes --------------------------------------------------------------------

def test_recipes_render_as_cache_config_fields(model):
    r = dict(recipes.RECIPES["k3v4+pre64+s4+r64+first_last@k4v4"])
    assert r.pop("preset") == "turboquant_k3v4_nc"
    text = recipes.fields_text(r, model.rope_spec(), 30, model.name)
    assert text == ('key_centering: "pre_rope" rope { rotary_dims: 64 pair_layout: INTERLEAVED '
                    'base: 100000.0 scaling_type: "none" } centering_tokens: 64 '
                    'exact_sink_tokens: 4 exact_recent_tokens: 64 '
                    'protected_layers { layers: [0, 29] preset: "tqkv_k4v4" }')
    assert recipes.select("k3v4+r*") == ["k3v4+r16", "k3v4+r32", "k3v4+r64", "k3v4+r128"]
    # The old "+wN" names (exact "window" tokens) still select the same rows.
    assert recipes.select("k3v4+w*") == recipes.select("k3v4+r*")
    assert recipes.select("k3v4+s4+w64,k3v4+w16") == ["k3v4+s4+r64", "k3v4+r16"]
    assert set(recipes.select("all")) == set(recipes.RECIPES)
    assert all(recipes.uses_new_fields(v) for v in recipes.RECIPES.values())
    with pytest.raises(SystemExit):
        recipes.select("nonsense")


def test_a_recipe_without_new_fields_is_served_by_todays_server(model):
    m = sliced(model, 2)
    row = {"name": "plain", "kind": "served", "preset": "turboquant_k3v4_nc", "boundary": 0,
           "seeds": [0], "recipe": {}}
    assert quality_report.row_extra(m, row) == ""
    assert quality_report.recipe_accepted(server_binary(), m, row, 64) is None


# --- Gemma 3 (only where its package is installed) ------------------------------

@pytest.fixture(scope="module")
def gemma():
    import gemma as gemma_mod
    if not gemma_mod.available():
        pytest.skip("Gemma 3 270M is not installed (TQKV_QUALITY_MODELS=all scripts/python_env.sh)")
    from spm import SentencePieceBPE as Spm
    m = gemma_mod.Gemma3()
    return m, Spm.from_gguf(m.reader)


def test_gemma3_layout_rope_and_greedy_continuation(gemma):
    m, tok = gemma
    c = m.config
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.window) == \
        (18, 640, 4, 1, 256, 512)
    assert m.full_attention_layers() == [5, 11, 17]
    assert m.rope_spec() == {"rotary_dims": 256, "pair_layout": "half_split", "base": 1e6,
                             "scaling_type": "none"}
    assert m.rope_spec(0)["base"] == 10000.0
    ids = [m.bos] + tok.encode("Paris is the capital of")
    assert [tok.tokens[i] for i in ids] == ["<bos>", "Paris", "\u2581is", "\u2581the",
                                            "\u2581capital", "\u2581of"]
    h = m.forward(ids)
    assert tok.decode([int(np.argmax(m.logits(h[-1:])[0]))]) == " France"
    h16 = m.forward(ids, attention.fp16(m.windows()))
    assert np.abs(h16 - h).max() / np.abs(h).max() < 1e-2


def test_chunked_teacher_forced_pass_equals_the_one_shot_pass(model, tokenizer):
    m = sliced(model, 2)
    tokens = tokenizer.encode("The pass key is 12345. Remember it. " * 6)[:50]
    whole = m.forward(tokens, attention.fp16())
    chunked = quality_report.forward_chunked(m, tokens, attention.fp16(), 16)
    np.testing.assert_allclose(chunked, whole, atol=2e-5 * np.abs(whole).max())
