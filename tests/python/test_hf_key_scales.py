"""tqkv.hf.calibrate_key_scales: per-channel key scales measured on a model's
own queries and keys, checked against the quality tools' independent
implementation (tools/quality/key_scales.py) and against the rule itself, and
served by a real tqkv-server through cache_config(key_scales=...).

Skipped, saying so, only where torch or transformers is not installed.
"""
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/python_env.sh "
                            "installs it unless TQKV_PYTHON_HF=off)")
pytest.importorskip("transformers", reason="transformers is not installed "
                    "(scripts/python_env.sh installs it unless TQKV_PYTHON_HF=off)")

import tqkv  # noqa: E402
import tqkv.hf  # noqa: E402
from conftest import server_binary  # noqa: E402
from test_hf import DEFAULT, GREEDY, LONG, batch, eager_logits, served_logits, tiny  # noqa: E402
from tqkv._errors import InvalidArgument  # noqa: E402
from tqkv.hf import _key_scales as ks  # noqa: E402
from tqkv.testing import LocalServer  # noqa: E402
from tqkv.v1 import kvcache_pb2 as pb  # noqa: E402

QUALITY_TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "quality"


def quality_tools():
    sys.path.insert(0, str(QUALITY_TOOLS))
    try:
        import key_scales as tool
        import rope as tool_rope
    finally:
        sys.path.remove(str(QUALITY_TOOLS))
    return tool, tool_rope


def roped(rope, head_dim, x):
    """x [T, heads, D] rotated to positions 0..T-1."""
    return ks.rotate(rope, head_dim, x, np.arange(len(x))).astype(np.float32)


def synthetic(rope, head_dim, tokens=300, kv_heads=2, group=3, seed=0):
    """Queries and keys with a pre-RoPE mean and per-channel spreads that
    differ between keys and queries, rotated by `rope` (post-RoPE)."""
    g = np.random.default_rng(seed)
    key_spread = np.exp(g.normal(0, 1, (kv_heads, head_dim)))
    query_spread = np.exp(g.normal(0, 1, (kv_heads * group, head_dim)))
    mean = g.normal(0, 3, (kv_heads, head_dim))
    keys = mean[None] + g.normal(size=(tokens, kv_heads, head_dim)) * key_spread[None]
    queries = g.normal(size=(tokens, kv_heads * group, head_dim)) * query_spread[None]
    if rope is not None:
        keys, queries = roped(rope, head_dim, keys), roped(rope, head_dim, queries)
    return queries.astype(np.float32), keys.astype(np.float32)


@pytest.mark.parametrize("layout,rotary_dims", [(pb.RotaryEmbedding.HALF_SPLIT, 0),
                                                (pb.RotaryEmbedding.INTERLEAVED, 0),
                                                (pb.RotaryEmbedding.HALF_SPLIT, 16)])
def test_scales_equal_the_quality_tools_rule(layout, rotary_dims):
    """The scales the quality report measured with (tools/quality/key_scales.py,
    its own RoPE code) on the same queries and keys, llama3-scaled RoPE."""
    tool, tool_rope = quality_tools()
    head_dim = 32
    rope = tqkv.hf.Rope(rotary_dims, layout, 10000.0, "llama3", 8.0, 1.0, 4.0, 64)
    queries, keys = synthetic(rope, head_dim)
    got = ks.layer_scales(rope, queries, keys)
    tool_spec = tool_rope.spec(rotary_dims or head_dim,
                               tool_rope.INTERLEAVED if layout == pb.RotaryEmbedding.INTERLEAVED
                               else tool_rope.HALF_SPLIT, 10000.0, "llama3", 8.0, 1.0, 4.0, 64)

    class Config:
        layers, kv_heads, heads = 1, keys.shape[1], queries.shape[1]

    Config.head_dim = head_dim

    class Model:
        config = Config

        def rope_spec(self, layer):
            return tool_spec

        def forward(self, tokens, capture):
            capture(0, queries, keys, None)

    want = tool.measure(Model(), None)[0]
    np.testing.assert_allclose(got, want, rtol=2e-5)
    a, b = ks.pair_index(rope, head_dim)
    np.testing.assert_array_equal(got[:, a], got[:, b])  # one scale per RoPE pair
    np.testing.assert_allclose(np.exp(np.log(got).mean(-1)), 1.0, rtol=1e-5)


def test_scales_balance_key_and_query_spreads_without_rope():
    """Without RoPE each coordinate is its own: s_j = sqrt(rms(r_j) / rms(q_j))
    up to a common factor, r the keys minus their mean."""
    g = np.random.default_rng(3)
    key_spread = np.array([[0.1, 1.0, 4.0, 0.5]])
    query_spread = np.array([[2.0, 1.0, 0.25, 1.0], [1.0, 3.0, 0.5, 0.5]])
    keys = 5.0 + g.normal(size=(20000, 1, 4)) * key_spread
    queries = g.normal(size=(20000, 2, 4)) * query_spread
    got = ks.layer_scales(None, queries, keys, centering_tokens=20000)
    rms_q = np.sqrt((query_spread ** 2).mean(0))
    want = np.sqrt(key_spread[0] / rms_q)
    want /= np.exp(np.log(want).mean())
    np.testing.assert_allclose(got[0], want, rtol=0.02)


def test_bad_inputs_are_refused():
    rope = tqkv.hf.Rope(0, pb.RotaryEmbedding.HALF_SPLIT, 1e4)
    q, k = synthetic(rope, 8, tokens=10, kv_heads=2, group=2)
    with pytest.raises(InvalidArgument):
        ks.layer_scales(rope, q[:5], k)  # token counts differ
    with pytest.raises(InvalidArgument):
        ks.layer_scales(rope, q[:4], k[:4])  # no tokens past the sinks
    config = pb.CacheConfig(num_layers=1, num_kv_heads=2, head_dim=8)
    for bad in (np.ones((1, 2, 4)), np.zeros((1, 2, 8)), np.full((1, 2, 8), np.nan)):
        with pytest.raises(InvalidArgument):
            ks.add_to_config(config, bad)


def skewed(kind):
    """tiny(kind) with each RoPE pair's key channels scaled by its own factor
    (0.2 to 5): random weights alone give keys and queries of about equal
    spread in every channel, nothing to balance."""
    model = tiny(kind)
    spec = tqkv.hf.model_spec(model)
    a, b = ks.pair_index(spec.rope, spec.head_dim)
    g = np.random.default_rng(5)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.self_attn.k_proj.weight.view(spec.kv_heads, spec.head_dim, -1)
            factor = torch.from_numpy(np.exp(g.uniform(-1.6, 1.6, (spec.kv_heads, len(a))))).float()
            weight[:, a] *= factor[..., None]
            weight[:, b] *= factor[..., None]
    return model


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_calibrated_scales_are_served(kind):
    """A model's scales (Gemma 3: each layer with its own RoPE) go into the
    cache; with fp16 codecs the stored r / s read with q * s still gives
    eager's tokens; with the default preset they bring the logits closer to
    eager's than the same cache without them."""
    model = skewed(kind)
    calibration = torch.randint(3, 256, (1, 160), generator=torch.Generator().manual_seed(9))
    scales = tqkv.hf.calibrate_key_scales(model, calibration)
    spec = tqkv.hf.model_spec(model)
    assert scales.shape == (spec.layers, spec.kv_heads, spec.head_dim)
    assert np.all(np.isfinite(scales)) and scales.min() > 0
    assert scales.max() / scales.min() > 3
    ids, mask = batch(LONG)
    with torch.no_grad():
        continuation = model.generate(ids, attention_mask=mask, **GREEDY)[:, ids.shape[1]:]
        want = eager_logits(model, ids, mask, continuation)
    exact = tqkv.hf.cache_config(model, preset="fp16", name="fp16-ks", key_scales=scales,
                                 memory_budget_bytes=16 << 20)
    exact.key_centering = "pre_rope"
    caches = [exact] + [tqkv.hf.cache_config(model, name=name, key_scales=s,
                                             memory_budget_bytes=16 << 20)
                        for name, s in (("ks", scales), ("plain", None))]
    assert [len(c.key_scales) for c in caches] == [spec.layers, spec.layers, 0]
    with LocalServer(server_binary(), tqkv.hf.config_text(*caches)) as server, \
            server.client() as client:
        served = {c.config.name: c.config for c in client.info().caches}
        np.testing.assert_allclose(served["ks"].key_scales[1].scales, scales[1].reshape(-1))
        got = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="fp16-ks", **GREEDY)
        assert torch.equal(got[:, ids.shape[1]:], continuation)
        with torch.no_grad():
            with_scales = served_logits(model, client, ids, mask, continuation, "ks")
            without = served_logits(model, client, ids, mask, continuation, "plain")
    scale = float(want.std())
    rms = float((with_scales - want).pow(2).mean().sqrt()) / scale
    rms_without = float((without - want).pow(2).mean().sqrt()) / scale
    print("%s: |dlogit| / std, %s: RMS %.3f with key scales, %.3f without"
          % (kind, DEFAULT, rms, rms_without))
    # Measured: llama 0.093 against 0.098, gemma3 0.021 against 0.025.
    assert rms < rms_without


def test_scales_follow_the_cache_pair_layout():
    model = tiny("llama")
    scales = np.random.default_rng(1).uniform(0.5, 2.0, (3, 2, 16)).astype(np.float32)
    config = tqkv.hf.cache_config(model, key_scales=scales,
                                  pair_layout=pb.RotaryEmbedding.INTERLEAVED)
    perm = tqkv.hf._config.key_permutation(16, 0, pb.RotaryEmbedding.HALF_SPLIT,
                                           pb.RotaryEmbedding.INTERLEAVED)
    got = np.array([list(e.scales) for e in config.key_scales]).reshape(3, 2, 16)
    np.testing.assert_array_equal(got, scales[..., perm])


def test_calibration_text_ships_with_python():
    text = tqkv.hf.calibration_text()
    assert len(text) > 100000 and "def " in text
