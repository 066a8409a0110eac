"""tqkv.hf: Hugging Face transformers models whose attention a real
tqkv-server serves, on small random-weight models built from configs (no
download), next to transformers' own eager attention.

Skipped, saying so, only where torch or transformers is not installed
(scripts/python_env.sh installs them; TQKV_PYTHON_HF=off leaves them out).
"""
import json
import os
import pathlib
import subprocess
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/python_env.sh "
                            "installs it unless TQKV_PYTHON_HF=off)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(scripts/python_env.sh installs it unless TQKV_PYTHON_HF=off)")

import tqkv  # noqa: E402
import tqkv.hf  # noqa: E402
from conftest import server_binary  # noqa: E402
from google.protobuf import text_format  # noqa: E402
from tqkv.testing import LocalServer  # noqa: E402
from tqkv.v1 import kvcache_pb2 as pb  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The published config.json files tests/cli/model_config_test.cc reads too.
CONFIGS = ROOT / "tests" / "data" / "model_configs"
DEFAULT = tqkv.hf.DEFAULT_PRESET
VOCAB = 256
# Prompt lengths of the batch of 3 (left-padded to the longest).
SHORT = (40, 31, 17)
# Past the default recipe's 4 sink + 64 recent exact tokens per layer, so
# that most of each sequence is read compressed.
LONG = (200, 160, 113)
# Weights drawn with std 0.08 (transformers' default is 0.02): attention
# then depends on the keys (at 0.02 it is nearly uniform, and even a logit
# scale 30% off moves the logits by under 1% of their spread).
INIT_STD = 0.08
# The default preset's logits, teacher-forced over 24 decode steps after the
# LONG prompts, against eager's: RMS and max of |logit - eager logit| /
# std(eager logits). Measured RMS 0.033-0.035 and max 0.18-0.21 on the three
# models (fp16: RMS 1.4e-4 to 3.4e-4); a logit scale 30% off gives RMS
# 0.09-0.13 and max 0.60-0.74.
DEFAULT_RMS_BOUND = 0.06
DEFAULT_MAX_BOUND = 0.5
FP16_RMS_BOUND = 2e-3


def tiny(kind, **overrides):
    """A small random-weight model of a family (fixed seed), float32, eager."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                  initializer_range=INIT_STD)
    if kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=3, **common)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(num_hidden_layers=3, **common)
    elif kind == "gemma3":
        # Sliding windows of 6 tokens on 3 of 4 layers: shorter than every prompt.
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=4, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"], **common)
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(num_hidden_layers=2, head_dim=16, sliding_window=8,
                                           num_local_experts=4, num_experts_per_tok=2, **common)
    elif kind == "gemma2":
        # Logit soft-capping at 2 with a logit scale of 1 (query_pre_attn_scalar
        # 1): logits reach well past the cap, so it changes the tokens
        # (test_soft_capped_gemma2_...); sliding windows of 6 on alternate layers.
        config = transformers.Gemma2Config(num_hidden_layers=2, head_dim=16, sliding_window=6,
                                           query_pre_attn_scalar=1, attn_logit_softcapping=2.0,
                                           **common)
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if kind == "gpt_oss":
        with torch.no_grad():  # learned sinks of a visible size (the init leaves them ~0)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    return model.eval()


def batch(lengths, seed=1):
    """(input_ids, attention_mask) [3, max(lengths)], left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    ids[mask == 0] = 0
    return ids, mask


def server_for(model, presets=("fp16", DEFAULT), **fields):
    caches = [tqkv.hf.cache_config(model, preset=p, name=p, memory_budget_bytes=16 << 20, **fields)
              for p in presets]
    return LocalServer(server_binary(), tqkv.hf.config_text(*caches))


GREEDY = dict(do_sample=False, pad_token_id=0, max_new_tokens=24)


def cache_counts(client):
    return {c.config.name: (c.sequences, c.tokens) for c in client.info().caches}


# -- cache_config from published config.json files --------------------------------------

def load(name):
    return json.loads((CONFIGS / name).read_text())


def windows(config):
    return {layer: g.window for g in config.sliding_window_layers for layer in g.layers}


def test_cache_config_of_llama_3_1_8b():
    c = tqkv.hf.cache_config(load("llama-3.1-8b.json"))
    assert (c.num_layers, c.num_kv_heads, c.num_query_heads, c.head_dim) == (32, 8, 32, 128)
    assert c.rope == pb.RotaryEmbedding(pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=500000,
                                        scaling_type="llama3", scaling_factor=8,
                                        low_freq_factor=1, high_freq_factor=4,
                                        original_max_position=8192)
    assert not c.sliding_window_layers and c.preset == DEFAULT and c.page_tokens == 16


def test_cache_config_of_qwen2_5_7b():
    c = tqkv.hf.cache_config(load("qwen2.5-7b.json"))
    assert (c.num_layers, c.num_kv_heads, c.num_query_heads, c.head_dim) == (28, 4, 28, 128)
    assert c.rope == pb.RotaryEmbedding(pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=1e6)
    assert not c.sliding_window_layers  # use_sliding_window: false


def test_cache_config_of_gemma_3_27b():
    c = tqkv.hf.cache_config(load("gemma-3-27b.json"))  # the text config of the multimodal one
    assert (c.num_layers, c.num_kv_heads, c.num_query_heads, c.head_dim) == (62, 16, 32, 128)
    # The sliding layers' RoPE, and the full-attention layers' as layer_ropes,
    # as `tqkv config --from-hf` writes them.
    assert c.rope == pb.RotaryEmbedding(pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=1e4)
    full = [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert windows(c) == {layer: 1024 for layer in range(62) if layer not in full}
    assert [list(e.layers) for e in c.layer_ropes] == [full]
    assert c.layer_ropes[0].rope == pb.RotaryEmbedding(pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=1e6,
                                                       scaling_type="linear", scaling_factor=8)
    spec = tqkv.hf.model_spec(load("gemma-3-27b.json"))
    assert spec.notes and "base 10000" in spec.notes[0] and "base 1e+06" in spec.notes[0]
    # The full-attention layers' RoPE by choice; a cache with either is the model's.
    swapped = tqkv.hf.cache_config(load("gemma-3-27b.json"), rope_of="full")
    assert swapped.rope == pb.RotaryEmbedding(pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=1e6,
                                              scaling_type="linear", scaling_factor=8)
    assert [list(e.layers) for e in swapped.layer_ropes] == [[l for l in range(62) if l not in full]]
    served = pb.CacheConfig(key_centering="pre_rope")
    served.rope.CopyFrom(swapped.rope)
    assert not tqkv.hf._config.rope_differs(spec, served)


def test_cache_config_of_mistral_7b():
    c = tqkv.hf.cache_config(load("mistral-7b-v0.1.json"))
    assert (c.num_layers, c.num_kv_heads, c.num_query_heads, c.head_dim) == (32, 8, 32, 128)
    assert c.rope == pb.RotaryEmbedding(pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=10000)
    assert windows(c) == {layer: 4096 for layer in range(32)}


def test_cache_config_of_gpt_oss_20b():
    config = load("gpt-oss-20b.json")
    c = tqkv.hf.cache_config(config)
    assert (c.num_layers, c.num_kv_heads, c.num_query_heads, c.head_dim) == (24, 8, 64, 64)
    assert windows(c) == {layer: 128 for layer in range(0, 24, 2)}
    # YaRN has no name in the proto: transformers' own inverse frequencies travel.
    assert c.rope.base == 150000 and not c.rope.scaling_type and len(c.rope.inv_freq) == 32
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    want, _ = ROPE_INIT_FUNCTIONS["yarn"](tqkv.hf._config.load_config(config), None)
    np.testing.assert_allclose(list(c.rope.inv_freq), want.numpy(), rtol=1e-7)
    assert tqkv.hf.model_spec(config).sinks


def test_cache_config_reads_a_model_folder(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "mistral-7b-v0.1.json").read_text())
    assert tqkv.hf.cache_config(tmp_path) == tqkv.hf.cache_config(load("mistral-7b-v0.1.json"))
    assert tqkv.hf.cache_config(tmp_path / "config.json", preset="fp16").preset == "fp16"


def test_cache_config_is_a_config_the_server_takes():
    """Every published model's config starts a server (inv_freq included)."""
    text = tqkv.hf.config_text(*[
        tqkv.hf.cache_config(load(name), name=name, memory_budget_bytes=1 << 20)
        for name in ("llama-3.1-8b.json", "gemma-3-27b.json", "gpt-oss-20b.json")])
    with LocalServer(server_binary(), text) as server, server.client() as client:
        got = {c.config.name: c.config for c in client.info().caches}
    assert got["gpt-oss-20b.json"].rope.inv_freq[:2] == pytest.approx([1.0, 0.68904430], 1e-6)
    assert windows(got["gemma-3-27b.json"])[0] == 1024


def cli_binary():
    return os.environ.get("TQKV_CLI") or str(ROOT / "build" / "bin" / "tqkv")


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_cache_config_equals_tqkv_config_from_hf(name):
    """The Python derivation and the CLI's (client/cli/hf_model_config.cc)
    give the same cache for every published config."""
    out = subprocess.run([cli_binary(), "config", "--from-hf", str(CONFIGS / name)],
                         check=True, capture_output=True, text=True).stdout
    (have,) = text_format.Parse(out, pb.ServerConfig()).caches
    want = tqkv.hf.cache_config(load(name))
    for rope in [have.rope] + [e.rope for e in have.layer_ropes]:
        if rope.rotary_dims == have.head_dim:
            rope.rotary_dims = 0
    # YaRN's frequencies: the CLI computes them in double, transformers in float32.
    assert list(have.rope.inv_freq) == pytest.approx(list(want.rope.inv_freq), rel=1e-6)
    for config in (have, want):
        config.ClearField("memory_budget_bytes")
        config.rope.ClearField("inv_freq")
    assert text_format.MessageToString(have) == text_format.MessageToString(want)


def test_soft_capping_is_no_cache_field():
    """Gemma 2's attn_logit_softcapping travels with every step, not in the
    cache: its config is a plain windowed cache."""
    config = transformers.Gemma2Config(num_hidden_layers=2, head_dim=16, hidden_size=64,
                                       num_attention_heads=4, num_key_value_heads=2)
    assert config.attn_logit_softcapping == 50.0
    got = tqkv.hf.cache_config(config)
    assert windows(got) == {0: config.sliding_window}


# -- generation served by tqkv ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_fp16_greedy_generation_equals_eager_for_a_padded_batch(kind):
    """Batch of 3 prompts of 40, 31 and 17 tokens (left-padded): the 24
    greedy tokens equal transformers' eager attention; the sequences hold
    their real tokens only and are dropped afterwards."""
    model = tiny(kind)
    ids, mask = batch(SHORT)
    want = model.generate(ids, attention_mask=mask, **GREEDY)
    with server_for(model) as server, server.client() as client:
        stats = {}
        got = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="fp16",
                               stats=stats, **GREEDY)
        assert cache_counts(client)["fp16"] == (0, 0)  # dropped
    assert torch.equal(got, want), (got[:, ids.shape[1]:], want[:, ids.shape[1]:])
    # Prompt + 23 decode tokens stored per row (the 24th token is never fed back).
    assert stats["lengths"].tolist() == [[n + 23 for n in SHORT]] * model.config.num_hidden_layers
    assert stats["messages"] == 23 * model.config.num_hidden_layers  # one per layer and step
    assert model.config._attn_implementation == "eager"  # restored


def served_logits(model, client, ids, mask, continuation, cache, prefill="local"):
    """Teacher-forced logits [batch, steps, vocab] of `continuation` [batch,
    steps] after the prompt, through a TqkvCache: the prompt's forward, then
    one token per forward (a plain forward pass, no generate)."""
    out = []
    with tqkv.hf.served(model), tqkv.hf.TqkvCache(model, client, cache=cache,
                                                  prefill=prefill) as kv:
        logits = model(ids, attention_mask=mask, cache=kv).logits[:, -1:]
        out.append(logits)
        for step in range(continuation.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(continuation[:, step:step + 1], attention_mask=mask, cache=kv).logits
            out.append(logits)
    return torch.cat(out, dim=1)


def eager_logits(model, ids, mask, continuation):
    full = torch.cat([ids, continuation], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(continuation)], dim=1)
    return model(full, attention_mask=full_mask).logits[:, ids.shape[1] - 1:-1]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_default_preset_logits_stay_within_the_bound(kind):
    """Prompts of 200, 160 and 113 tokens: the default preset generates, and
    its teacher-forced logits over eager's 24 greedy tokens stay within the
    stated bounds of eager's (in units of the logits' spread)."""
    model = tiny(kind)
    ids, mask = batch(LONG)
    with torch.no_grad():
        continuation = model.generate(ids, attention_mask=mask, **GREEDY)[:, ids.shape[1]:]
        want = eager_logits(model, ids, mask, continuation)
    scale = float(want.std())
    with server_for(model) as server, server.client() as client:
        got = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache=DEFAULT, **GREEDY)
        assert got.shape == (3, ids.shape[1] + 24)
        with torch.no_grad():
            fp16 = served_logits(model, client, ids, mask, continuation, "fp16")
            lossy = served_logits(model, client, ids, mask, continuation, DEFAULT)
        info = {c.config.name: c for c in client.info().caches}
    rms = float((lossy - want).pow(2).mean().sqrt()) / scale
    worst = float((lossy - want).abs().max()) / scale
    fp16_rms = float((fp16 - want).pow(2).mean().sqrt()) / scale
    print("%s: |dlogit| / std: fp16 RMS %.1e; %s RMS %.3f, max %.3f"
          % (kind, fp16_rms, DEFAULT, rms, worst))
    assert fp16_rms < FP16_RMS_BOUND
    assert rms < DEFAULT_RMS_BOUND and worst < DEFAULT_MAX_BOUND
    assert info[DEFAULT].sequences == 0 and info["fp16"].sequences == 0


def test_learned_sink_logits_are_served_gpt_oss():
    """gpt-oss: learned sink logits per query head travel with every message
    (and sliding windows of 8 on alternate layers, YaRN's inv_freq in the
    cache): fp16 greedy tokens equal eager's."""
    model = tiny("gpt_oss")
    ids, mask = batch(SHORT)
    want = model.generate(ids, attention_mask=mask, **GREEDY)
    with server_for(model, presets=("fp16",)) as server, server.client() as client:
        got = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="fp16", **GREEDY)
        with torch.no_grad():
            continuation = want[:, ids.shape[1]:]
            served = served_logits(model, client, ids, mask, continuation, "fp16")
    assert torch.equal(got, want)
    with torch.no_grad():
        eager = eager_logits(model, ids, mask, continuation)
    assert float((served - eager).pow(2).mean().sqrt()) / float(eager.std()) < FP16_RMS_BOUND


def without_softcap(model):
    """The same weights with the attention logits left uncapped."""
    import copy

    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    return plain


def test_soft_capped_gemma2_fp16_greedy_generation_equals_eager():
    """Gemma 2 with attn_logit_softcapping 2: the server caps every logit
    (logit_softcap on each DecodeStream step), so fp16 greedy tokens equal
    eager's and its teacher-forced logits stay within the fp16 bound of
    eager's; the same model uncapped generates other tokens, and its logits
    lie far outside that bound, so the cap is what makes them agree."""
    model = tiny("gemma2")
    ids, mask = batch(SHORT)
    want = model.generate(ids, attention_mask=mask, **GREEDY)
    continuation = want[:, ids.shape[1]:]
    with torch.no_grad():
        eager = eager_logits(model, ids, mask, continuation)
        uncapped = eager_logits(without_softcap(model), ids, mask, continuation)
    plain = without_softcap(model).generate(ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(plain, want)
    scale = float(eager.std())
    assert float((uncapped - eager).pow(2).mean().sqrt()) / scale > 20 * FP16_RMS_BOUND
    with server_for(model, presets=("fp16",)) as server, server.client() as client:
        got = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="fp16", **GREEDY)
        with torch.no_grad():
            served = served_logits(model, client, ids, mask, continuation, "fp16")
            served_prefill = served_logits(model, client, ids, mask, continuation, "fp16",
                                           prefill="served")
    assert torch.equal(got, want), (got[:, ids.shape[1]:], want[:, ids.shape[1]:])
    for logits in (served, served_prefill):
        assert float((logits - eager).pow(2).mean().sqrt()) / scale < FP16_RMS_BOUND


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_served_prefill_and_chunked_forwards(kind):
    """prefill="served": the prompt too goes through DecodeStream (one
    message per layer, every prompt token a query); then two chunks of 5
    tokens per forward. Logits match eager's full pass (fp16 K/V)."""
    model = tiny(kind)
    ids, mask = batch(SHORT)
    g = torch.Generator().manual_seed(7)
    more = torch.randint(3, VOCAB, (3, 10), generator=g)
    full = torch.cat([ids, more], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    with torch.no_grad():
        want = model(full, attention_mask=full_mask).logits
        with server_for(model, presets=("fp16",)) as server, server.client() as client, \
                tqkv.hf.served(model):
            for prefill in ("served", "local"):
                with tqkv.hf.TqkvCache(model, client, cache="fp16", prefill=prefill) as kv:
                    width = ids.shape[1]
                    parts = [model(ids, attention_mask=mask, cache=kv).logits]
                    for s in (0, 5):
                        step_mask = full_mask[:, :width + s + 5]
                        parts.append(model(more[:, s:s + 5], attention_mask=step_mask,
                                           cache=kv).logits)
                    got = torch.cat(parts, dim=1)
                    assert kv.lengths.tolist() == [[n + 10 for n in SHORT]] * len(kv.layers)
                real = full_mask.bool()
                rel = float((got - want)[real].pow(2).mean().sqrt()) / float(want[real].std())
                assert rel < FP16_RMS_BOUND, (prefill, rel)
                if prefill == "local":  # the prompt's own attention is exact
                    prompt = real[:, :width]
                    diff = (got[:, :width] - want[:, :width])[prompt].abs().max()
                    assert float(diff) < 1e-5 * float(want[real].std())


def test_kept_sequences_resume_a_conversation():
    """keep=True leaves the sequences on the server; a TqkvCache with
    resume=True continues them (the next turn's tokens served, the prefix
    not recomputed) and generates what eager generates on the whole text."""
    model = tiny("llama")
    ids, mask = batch(SHORT)
    with server_for(model, presets=("fp16",)) as server, server.client() as client:
        stats = {}
        first = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="fp16", keep=True,
                                 stats=stats, **GREEDY)
        assert cache_counts(client)["fp16"][0] == 3
        turn = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
        text = torch.cat([first, turn], dim=1)
        text_mask = torch.cat([mask, torch.ones((3, text.shape[1] - mask.shape[1]),
                                                dtype=mask.dtype)], dim=1)
        want = model.generate(text, attention_mask=text_mask, **GREEDY)
        with tqkv.hf.served(model), tqkv.hf.TqkvCache(model, client, cache="fp16",
                                                      sequence_ids=stats["sequence_ids"],
                                                      resume=True) as kv:
            assert kv.get_seq_length() == ids.shape[1] + 23
            got = model.generate(text, attention_mask=text_mask, cache=kv, **GREEDY)
        assert cache_counts(client)["fp16"] == (0, 0)  # this cache did not keep them
    assert torch.equal(got, want)


def test_a_cache_of_another_shape_is_refused_with_the_config_that_fits():
    model = tiny("gemma3")
    wrong = tqkv.hf.cache_config(tiny("llama"), preset="fp16", name="llama",
                                 memory_budget_bytes=1 << 20)
    no_windows = tqkv.hf.cache_config(model, preset="fp16", name="nowin",
                                      memory_budget_bytes=1 << 20)
    no_windows.ClearField("sliding_window_layers")
    with LocalServer(server_binary(), tqkv.hf.config_text(wrong, no_windows)) as server, \
            server.client() as client:
        with pytest.raises(tqkv.hf.CacheMismatch) as error:
            tqkv.hf.TqkvCache(model, client, cache="llama")
        message = str(error.value)
        assert "num_layers is 3, the model has 4" in message and "head_dim is 16" in message
        assert "sliding_window_layers" in message  # the config that fits
        with pytest.raises(tqkv.hf.CacheMismatch, match="layer 0: the cache has full attention, "
                           "the model a 6-token sliding window"):
            tqkv.hf.TqkvCache(model, client, cache="nowin")
        with pytest.raises(tqkv.hf.CacheMismatch, match="no cache 'nope'"):
            tqkv.hf.TqkvCache(model, client, cache="nope")


def test_a_cache_centering_with_another_rope_warns():
    model = tiny("llama")
    other = tqkv.hf.cache_config(model, name="other", memory_budget_bytes=1 << 20)
    other.rope.base = 500000
    own = tqkv.hf.cache_config(model, name="own", memory_budget_bytes=1 << 20)
    with LocalServer(server_binary(), tqkv.hf.config_text(other, own)) as server, \
            server.client() as client:
        with pytest.warns(tqkv.hf.RopeMismatchWarning, match="centers keys before RoPE"):
            tqkv.hf.TqkvCache(model, client, cache="other").close()
        with warnings.catch_warnings():
            warnings.simplefilter("error", tqkv.hf.RopeMismatchWarning)
            tqkv.hf.TqkvCache(model, client, cache="own").close()


def test_tqkv_attention_without_a_tqkv_cache_says_what_to_pass():
    model = tiny("llama")
    ids, mask = batch(SHORT)
    with tqkv.hf.served(model), pytest.raises(tqkv.FailedPrecondition, match="TqkvCache"):
        model(ids, attention_mask=mask)


def test_beam_search_is_refused():
    model = tiny("llama")
    ids, mask = batch(SHORT)
    with server_for(model, presets=("fp16",)) as server, server.client() as client:
        with pytest.raises(tqkv.hf.Unsupported, match="beam search"):
            tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="fp16",
                             num_beams=2, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert cache_counts(client)["fp16"] == (0, 0)  # dropped after the failure


def test_key_permutation_moves_half_split_pairs_to_interleaved_ones():
    """A key rotated by transformers' half-split RoPE, permuted, is the
    interleaved rotation of the permuted pre-RoPE key (and queries move the
    same way, so q.k is unchanged)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    head_dim, position, base = 16, 11, 10000.0
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, head_dim, generator=g, dtype=torch.float64)
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.cat([position * inv_freq] * 2)
    q_rot, k_rot = apply_rotary_pos_emb(q[None, None, None], k[None, None, None],
                                        angles.cos()[None, None], angles.sin()[None, None])
    idx = tqkv.hf._config.key_permutation(head_dim, 0, pb.RotaryEmbedding.HALF_SPLIT,
                                          pb.RotaryEmbedding.INTERLEAVED)
    stored = k_rot.flatten()[idx]
    pre = k[idx]
    want = torch.empty_like(pre)
    for i, theta in enumerate(position * inv_freq):
        c, s = torch.cos(theta), torch.sin(theta)
        want[2 * i] = pre[2 * i] * c - pre[2 * i + 1] * s
        want[2 * i + 1] = pre[2 * i] * s + pre[2 * i + 1] * c
    torch.testing.assert_close(stored, want)
    torch.testing.assert_close(q_rot.flatten()[idx] @ stored, q_rot.flatten() @ k_rot.flatten())
    back = tqkv.hf._config.key_permutation(head_dim, 0, pb.RotaryEmbedding.INTERLEAVED,
                                           pb.RotaryEmbedding.HALF_SPLIT)
    assert [idx[i] for i in back] == list(range(head_dim))


def test_a_cache_in_the_interleaved_layout_serves_a_half_split_model():
    """The cache stores keys as a GGUF engine would: tokens still equal eager's."""
    model = tiny("llama")
    ids, mask = batch(SHORT)
    want = model.generate(ids, attention_mask=mask, **GREEDY)
    config = tqkv.hf.cache_config(model, preset="fp16", name="il", memory_budget_bytes=8 << 20,
                                  pair_layout=pb.RotaryEmbedding.INTERLEAVED)
    with LocalServer(server_binary(), tqkv.hf.config_text(config)) as server, \
            server.client() as client:
        with tqkv.hf.TqkvCache(model, client, cache="il") as kv:
            assert kv._perm is not None
        got = tqkv.hf.generate(model, client, ids, attention_mask=mask, cache="il", **GREEDY)
    assert torch.equal(got, want)
