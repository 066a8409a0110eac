#!/usr/bin/env python3
"""Generates text with SmolLM2-135M-Instruct, every layer's attention served
by tqkv over one DecodeStream.

    build/venv/bin/python examples/generate.py --start-server --prompt "..." --tokens 32
    build/venv/bin/python examples/generate.py --target host:50051 --cache smollm2

The model is tools/quality/llama.py's numpy forward pass (30 layers, 9 query
heads on 3 KV heads, head_dim 64, interleaved RoPE with base 100000), with
the GGUF's byte-level BPE tokenizer (tools/quality/bpe.py). What runs where:

  * Prefill: the prompt's forward pass runs here, as an engine's prefill
    would, with attention over its fresh K/V rounded to fp16; then every
    layer's K/V of the prompt goes to tqkv in one AppendStream ([30, tokens,
    3, 64] in chunks).
  * Decode, greedy: for each new token, layer by layer, this process computes
    the layer's q, k, v from the previous layer's output, and sends one
    DecodeStream message (an AppendAttend of that layer: store the token's
    K/V at its position, attend with its query); the answer is the layer's
    attention output, which the next layer's projections need. 30 messages
    per token, each waited for: the dependent round trips a decode node makes.

It prints the text, decode tokens/s (and the time per message round trip
next to the local compute), and the bytes the server holds for the sequence
against the same tokens in bf16 (GetServerInfo; the stored_bytes of
AppendStream and AppendAttend, the changes each call made to that count,
sum to the same figure).

--start-server starts a local tqkv-server (--server-binary, $TQKV_SERVER, or
build/bin/tqkv-server) with one cache of SmolLM2's shape at --preset, the
model's RoPE in the config (pre-RoPE key centering needs it; the default
preset, tqkv_k3v4u_csw, centers keys that way). Without it, --target must
serve a cache (--cache) of that shape; the error says the config it needs.

With the fp16 preset the generated tokens equal local_greedy's, the same pass
with local attention over fp16-rounded K/V (tests/python/test_generate.py).
"""
import argparse
import os
import pathlib
import sys
import time
import uuid

# Single-threaded BLAS: the pass is many small products (as tools/quality does).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "quality"))

import attention  # noqa: E402
import llama  # noqa: E402
import recipes  # noqa: E402
import rope as rope_mod  # noqa: E402
from bpe import ByteLevelBPE  # noqa: E402

import tqkv  # noqa: E402

CACHE = "smollm2"
DEFAULT_PRESET = "tqkv_k3v4u_csw"  # the server's default preset
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PREFILL_CHUNK = 256  # tokens per AppendStream message


# -- model and tokenizer ----------------------------------------------------

def load_model():
    """(model, tokenizer), every weight dequantized (so timings see none of it)."""
    model = llama.Llama()
    tokenizer = ByteLevelBPE.from_gguf(model.reader)
    for name in model._tensors:
        model.weight(name)
    return model, tokenizer


def special(tokenizer, text):
    return tokenizer.ids[text]


def prompt_ids(tokenizer, prompt, chat=True):
    """Token ids of the prompt: SmolLM2's chat template around it (a system
    line, the user turn, the assistant's turn opened), or the raw text."""
    if not chat:
        return tokenizer.encode(prompt)
    start, end = special(tokenizer, "<|im_start|>"), special(tokenizer, "<|im_end|>")
    ids = []
    for role, content in (("system", SYSTEM), ("user", prompt)):
        ids += [start] + tokenizer.encode("%s\n%s" % (role, content)) + [end]
        ids += tokenizer.encode("\n")
    return ids + [start] + tokenizer.encode("assistant\n")


def next_token(model, hidden):
    """Greedy: the argmax of the last position's logits."""
    return int(np.argmax(model.logits(hidden[-1:])[0]))


def greedy(model, prefill, step, ids, tokens, stop=None):
    """Greedy decoding around two callables: prefill(ids) -> hidden states of
    the prompt, step(token, position) -> hidden [1, hidden] of one new token.
    Returns (generated ids, prefill seconds, decode seconds, decode steps)."""
    t0 = time.perf_counter()
    token = next_token(model, prefill(ids))
    t1 = time.perf_counter()
    out, position = [token], len(ids)
    while len(out) < tokens and token != stop:
        token = next_token(model, step(token, position))
        out.append(token)
        position += 1
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1, len(out) - 1


def local_greedy(model, ids, tokens, stop=None):
    """The reference: the same greedy loop with attention in numpy over
    K/V rounded to fp16 (what an fp16 KV cache holds)."""
    cache = attention.fp16()
    return greedy(model, lambda prompt: model.forward(prompt, attend=cache),
                  lambda token, position: model.forward([token], attend=cache, start=position),
                  ids, tokens, stop)[0]


# -- attention served by tqkv -----------------------------------------------

class ServedDecoder:
    """Prefill through AppendStream, then one DecodeStream message per layer
    of every decode step, for one sequence."""

    def __init__(self, model, client, cache=CACHE, sequence_id=None):
        self.model, self.client, self.cache = model, client, cache
        self.sequence_id = sequence_id or "generate/%s" % uuid.uuid4().hex[:12]
        self.stream = None
        self.stored_bytes = 0       # AppendStream + AppendAttend stored_bytes
        self.stored_bytes_bf16 = 0
        self.messages = 0
        self.wait_seconds = 0.0     # inside stream.step: the round trips

    def prefill(self, ids):
        layers = self.model.config.layers
        keys, values = [None] * layers, [None] * layers

        def attend(layer, q, k, v):
            keys[layer], values[layer] = k, v
            return attention.causal_attention(q, attention.fp16_round(k),
                                              attention.fp16_round(v))

        hidden = self.model.forward(ids, attend=attend)
        k, v = np.stack(keys), np.stack(values)  # [layers, tokens, kv_heads, head_dim]
        chunks = [(k[:, s:s + PREFILL_CHUNK], v[:, s:s + PREFILL_CHUNK])
                  for s in range(0, len(ids), PREFILL_CHUNK)]
        result = self.client.append_stream(self.sequence_id, chunks, cache=self.cache)
        self.stored_bytes += result.stored_bytes
        self.stored_bytes_bf16 += result.stored_bytes_bf16
        return hidden

    def step(self, token, position):
        """One decode step: the layer-by-layer loop, each layer's attention a
        DecodeStream message."""
        if self.stream is None:
            self.stream = self.client.decode_stream(cache=self.cache)
        m = self.model
        x = m.embed([token])
        positions = np.array([position])
        for layer in range(m.config.layers):
            q, k, v = m.qkv(layer, x, positions)  # q [1, 9, 64], k and v [1, 3, 64]
            t0 = time.perf_counter()
            result = self.stream.step(layer, [(self.sequence_id, position, k, v, q)])
            self.wait_seconds += time.perf_counter() - t0
            self.messages += 1
            item = result[0]
            if item.error is not None:
                raise item.error
            self.stored_bytes += result.stored_bytes
            self.stored_bytes_bf16 += result.stored_bytes_bf16
            x = m.finish_layer(layer, x, item.output)
        return m.final_norm(x)

    def held_bytes(self):
        """(stored_bytes, stored_bytes_bf16) the server reports for the cache
        (GetServerInfo: exact copies and means included); this sequence's
        when it is the cache's only one."""
        for c in self.client.info().caches:
            if c.config.name == self.cache:
                return int(c.stored_bytes), int(c.stored_bytes_bf16)
        raise KeyError(self.cache)

    def close(self, drop=True):
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if drop:
            self.client.drop(self.sequence_id, cache=self.cache)


def generate(model, client, ids, tokens, cache=CACHE, stop=None):
    """(generated ids, stats dict) with attention served by tqkv."""
    decoder = ServedDecoder(model, client, cache)
    try:
        out, prefill_s, decode_s, steps = greedy(model, decoder.prefill, decoder.step, ids,
                                                 tokens, stop)
        held, held_bf16 = decoder.held_bytes()
    finally:
        decoder.close()
    return out, dict(prompt_tokens=len(ids), generated=len(out), prefill_seconds=prefill_s,
                     decode_seconds=decode_s, decode_steps=steps,
                     tokens_per_second=steps / decode_s if decode_s > 0 else float("nan"),
                     messages=decoder.messages, wait_seconds=decoder.wait_seconds,
                     stored_bytes=decoder.stored_bytes,
                     stored_bytes_bf16=decoder.stored_bytes_bf16, held_bytes=held,
                     held_bytes_bf16=held_bf16)


# -- the server ----------------------------------------------------------------

def server_config(model, preset, max_tokens, name=CACHE):
    """A text-format ServerConfig with one cache of the model's shape at
    `preset` (no boundary layers) and the model's RoPE, room for max_tokens."""
    c = model.config
    pages = -(-max_tokens // 16) + 2
    budget = pages * 16 * c.layers * c.kv_heads * c.head_dim * 4 * 2 + (8 << 20)
    return recipes.cache_text(name, c.layers, c.kv_heads, c.heads, c.head_dim, preset, 0, 0,
                              budget, rope_mod.config_text(model.rope_spec())) + "\n"


def check_cache(client, model, cache):
    """SystemExit with the config to use when the server lacks the cache."""
    c = model.config
    want = (c.layers, c.kv_heads, c.heads, c.head_dim)
    for info in client.info().caches:
        if info.config.name == cache:
            got = (info.config.num_layers, info.config.num_kv_heads,
                   info.config.num_query_heads, info.config.head_dim)
            if got != want:
                raise SystemExit("cache %r is %s (layers, kv_heads, query_heads, head_dim), "
                                 "want %s" % (cache, got, want))
            return info.config.preset
    raise SystemExit("the server has no cache %r; serve one with this config (or pass "
                     "--start-server):\n%s" % (cache, server_config(model, DEFAULT_PRESET,
                                                                    8192, cache)))


def server_binary(path):
    path = path or os.environ.get("TQKV_SERVER") or str(ROOT / "build" / "bin" / "tqkv-server")
    if not os.path.exists(path):
        raise SystemExit("tqkv-server not found at %s: build it (scripts/build.sh) or pass "
                         "--server-binary" % path)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="localhost:50051", help="host:port of a tqkv-server")
    p.add_argument("--cache", default=CACHE, help="cache name (SmolLM2's shape)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--raw", action="store_true",
                   help="continue the prompt as plain text (no chat template, no stop token)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (at most)")
    p.add_argument("--start-server", action="store_true",
                   help="start a local tqkv-server with a SmolLM2-shaped cache")
    p.add_argument("--server-binary", default=None)
    p.add_argument("--preset", default=DEFAULT_PRESET, help="with --start-server")
    p.add_argument("--threads", type=int, default=2, help="with --start-server")
    p.add_argument("--check", action="store_true",
                   help="also run the local fp16 greedy pass and compare the tokens")
    args = p.parse_args(argv)
    if args.tokens < 1:
        raise SystemExit("--tokens must be >= 1")

    t0 = time.perf_counter()
    model, tokenizer = load_model()
    ids = prompt_ids(tokenizer, args.prompt, chat=not args.raw)
    stop = None if args.raw else special(tokenizer, "<|im_end|>")
    print("model: %s, loaded in %.1f s; prompt: %d tokens"
          % (model.name, time.perf_counter() - t0, len(ids)), file=sys.stderr)

    server, target = None, args.target
    try:
        if args.start_server:
            from tqkv.testing import LocalServer
            config = server_config(model, args.preset, len(ids) + args.tokens, args.cache)
            server = LocalServer(server_binary(args.server_binary), config,
                                 threads=args.threads, memory_budget_gib=1).start()
            target = server.target
        with tqkv.Client(target, cache=args.cache) as client:
            preset = check_cache(client, model, args.cache)
            out, stats = generate(model, client, ids, args.tokens, args.cache, stop)
    except tqkv.TqkvError as error:
        raise SystemExit("tqkv-server at %s: %s" % (target, error))
    finally:
        if server is not None:
            server.stop()

    text = tokenizer.decode([t for t in out if t != stop])
    print(text)
    s = stats
    per_message = s["wait_seconds"] / max(s["messages"], 1)
    print("\n--- %s, cache %r (preset %s) at %s" % (model.name, args.cache, preset,
                                                   "a local server" if server else target))
    print("prefill: %d tokens, forward pass here + one AppendStream of %d layers: %.2f s"
          % (s["prompt_tokens"], model.config.layers, s["prefill_seconds"]))
    print("decode: %d tokens in %.2f s = %.1f tokens/s; %d DecodeStream messages "
          "(%d per token), %.2f ms per message round trip, %.0f%% of the decode time"
          % (s["decode_steps"], s["decode_seconds"], s["tokens_per_second"], s["messages"],
             model.config.layers, 1e3 * per_message,
             100 * s["wait_seconds"] / max(s["decode_seconds"], 1e-9)))
    held_tokens = s["prompt_tokens"] + s["decode_steps"]
    print("server holds %d bytes for %d tokens x %d layers, bf16 would be %d: compression "
          "vs bf16 %.2fx (GetServerInfo: compressed slots, exact fp16 copies, means)"
          % (s["held_bytes"], held_tokens, model.config.layers, s["held_bytes_bf16"],
             s["held_bytes_bf16"] / max(s["held_bytes"], 1)))
    print("the AppendStream and AppendAttend replies' stored_bytes sum to %d bytes (%d as bf16)"
          % (s["stored_bytes"], s["stored_bytes_bf16"]))
    if s["held_bytes"] > s["held_bytes_bf16"]:
        print("(more than bf16 in all: a recipe's exact tokens, such as the *_csw presets' "
              "first 4 and last 64 per layer, are fp16 copies kept beside the compressed "
              "slots, and a sequence this short is mostly such tokens)")
    if args.check:
        want = local_greedy(model, ids, args.tokens, stop)
        same = want == out
        print("local fp16 greedy run: %s" % ("the same tokens" if same else
                                              "differs: %r" % tokenizer.decode(want)))
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
