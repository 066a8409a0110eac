"""examples/generate.py against a real tqkv-server: SmolLM2-135M greedy
decoding with every layer's attention served over one DecodeStream.

With the fp16 preset the generated tokens equal the same pass with local
attention over fp16-rounded K/V; with the default compressed preset it
generates and the server holds fewer bytes than bf16."""
import importlib.util

import pytest

from conftest import ROOT, server_binary
from tqkv.testing import LocalServer

PROMPT = "The capital of France is"
TOKENS = 16
# About 200 tokens: past the default recipe's 4 + 64 exact fp16 tokens per
# layer, which make a short sequence cost more than bf16.
LONG_PROMPT = (
    "A key-value cache keeps, for every layer of a transformer, the keys and values of "
    "the tokens a sequence has seen, so that each new token attends over them without "
    "recomputing the past. Its size grows with the context: for a long conversation it "
    "outgrows the weights of a small model, and memory, not compute, bounds how many "
    "sequences a server can decode at once. Compressing the cache trades a little "
    "accuracy for room: keys rotated by a random orthogonal matrix have coordinates of "
    "similar spread, which a few bits each describe well, and values need fewer bits "
    "still because attention averages them. The first tokens, which soak up attention "
    "in most models, and the most recent ones, which the next tokens read most, are "
    "worth keeping exact. What matters in the end is whether the model still writes the "
    "same text, and how many more sequences fit in the same memory. Here is a summary "
    "of the idea in one sentence:")


def load_example():
    spec = importlib.util.spec_from_file_location("generate_example",
                                                  ROOT / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    gen = load_example()
    try:
        model, tokenizer = gen.load_model()
    except FileNotFoundError as error:  # the venv lacks the model package
        pytest.skip(str(error))
    return gen, model, tokenizer


@pytest.fixture(scope="module")
def smollm2_server(example):
    gen, model, _ = example
    config = (gen.server_config(model, "fp16", 256, name="fp16")
              + gen.server_config(model, gen.DEFAULT_PRESET, 256, name="default"))
    with LocalServer(server_binary(), config, threads=2, memory_budget_gib=1) as server:
        yield server


def test_fp16_cache_generates_the_local_fp16_greedy_tokens(example, smollm2_server):
    gen, model, tokenizer = example
    ids = tokenizer.encode(PROMPT)
    want = gen.local_greedy(model, ids, TOKENS)
    with smollm2_server.client(timeout=30) as client:
        got, stats = gen.generate(model, client, ids, TOKENS, cache="fp16")
    assert got == want, "served %r, local %r" % (tokenizer.decode(got), tokenizer.decode(want))
    layers = model.config.layers
    assert stats["generated"] == TOKENS and stats["messages"] == layers * (TOKENS - 1)
    # fp16 is bf16's size: every token of every layer, 2 bytes per coordinate.
    tokens = len(ids) + TOKENS - 1
    bf16 = tokens * layers * model.config.kv_heads * model.config.head_dim * 4
    assert stats["stored_bytes_bf16"] == bf16 and stats["stored_bytes"] == bf16
    assert stats["held_bytes"] == stats["held_bytes_bf16"] == bf16


def test_default_preset_generates_and_holds_fewer_bytes_than_bf16(example, smollm2_server):
    gen, model, tokenizer = example
    ids = tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 150
    with smollm2_server.client(timeout=30) as client:
        got, stats = gen.generate(model, client, ids, TOKENS, cache="default")
        assert client.info().caches[1].sequences == 0  # generate drops its sequence
    assert len(got) == TOKENS and all(0 <= t < model.config.vocab for t in got)
    assert tokenizer.decode(got).strip()
    assert 0 < stats["held_bytes"] < stats["held_bytes_bf16"]     # exact copies included
    assert stats["stored_bytes"] == stats["held_bytes"]           # the replies sum to the pool's count
    assert stats["stored_bytes_bf16"] == stats["held_bytes_bf16"]
