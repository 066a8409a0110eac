#!/usr/bin/env python3
"""Generates text with SmolLM2-135M-Instruct as a Hugging Face transformers
model whose attention tqkv serves, in a few lines of tqkv.hf:

    model, tokenizer = hf_smollm2.load()                  # transformers' GGUF loader
    config = tqkv.hf.cache_config(model, preset=...)      # the server's cache for it
    out = tqkv.hf.generate(model, client, **inputs, max_new_tokens=...)

    build/venv/bin/python examples/hf_generate.py --start-server --tokens 64 \\
        --prompt "Write a short story about a robot who learns to paint." "Name three rivers."

Several prompts go as one batch (left-padded, as a tokenizer pads for
generation). The prompt's attention runs here, exactly; its K/V go to the
server in one AppendStream per sequence; each decode step is one
DecodeStream message per layer for the whole batch (30 per step). It prints
the texts, decode tokens/s (and transformers' own eager attention's, with
--check, which also compares the tokens), the messages sent, and the bytes
the server held for the batch against the same tokens in bf16 (the
stored_bytes its replies counted; exact copies and centering means
included). The sequences are dropped at the end.

--start-server starts build/bin/tqkv-server (or --server-binary,
$TQKV_SERVER) on a loopback port with one cache made by
tqkv.hf.cache_config at --preset. Without it, --target must serve a cache
(--cache) of SmolLM2's shape; if it does not, the error prints one that
does.
"""
import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hf_smollm2  # noqa: E402

DEFAULT_PROMPTS = ["Write a short story about a robot who learns to paint.",
                   "What is the capital of France?",
                   "Explain in two sentences why the sky is blue."]


class StepClock:
    """A logits processor that notes the time of every generation step: the
    first is the end of the prefill, the rest are decode steps."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def decode_rate(self, batch):
        """Tokens/s over the decode steps (every sequence's token counted)."""
        if len(self.times) < 2:
            return float("nan")
        return batch * (len(self.times) - 1) / (self.times[-1] - self.times[0])


def encode(tokenizer, prompts, chat):
    """Left-padded input_ids and attention_mask of the prompts (chat
    template around each, unless raw)."""
    tokenizer.padding_side = "left"
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    else:
        texts = list(prompts)
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def run(model, tokenizer, inputs, client, args):
    """(output ids, StepClock, stats) of tqkv-served greedy generation."""
    import tqkv.hf
    from transformers import LogitsProcessorList

    clock, stats = StepClock(), {}
    out = tqkv.hf.generate(model, client, **inputs, cache=args.cache, stats=stats,
                           max_new_tokens=args.tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id,
                           logits_processor=LogitsProcessorList([clock]))
    return out, clock, stats


def eager(model, tokenizer, inputs, args):
    from transformers import LogitsProcessorList

    clock = StepClock()
    out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id,
                         logits_processor=LogitsProcessorList([clock]))
    return out, clock


def report(tokenizer, inputs, out, clock, stats, args):
    width = inputs["input_ids"].shape[1]
    for i, row in enumerate(out[:, width:]):
        print("[%d] %s" % (i, tokenizer.decode(row, skip_special_tokens=True).strip()))
    batch = out.shape[0]
    print("\ndecode: %.1f tokens/s over %d steps of %d sequences; %d DecodeStream messages"
          % (clock.decode_rate(batch), len(clock.times) - 1, batch, stats["messages"]))
    held, bf16 = stats["stored_bytes"], stats["stored_bytes_bf16"]
    tokens = int(stats["lengths"][0].sum())
    print("server held %d bytes for %d tokens x %d layers, bf16 %d bytes: %.2fx (%s)"
          % (held, tokens, len(stats["lengths"]), bf16, bf16 / max(held, 1), args.preset_shown))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", nargs="+", default=DEFAULT_PROMPTS)
    ap.add_argument("--raw", action="store_true", help="no chat template")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--start-server", action="store_true")
    ap.add_argument("--server-binary", default=os.environ.get("TQKV_SERVER") or
                    str(hf_smollm2.ROOT / "build" / "bin" / "tqkv-server"))
    ap.add_argument("--target", default="localhost:50051")
    ap.add_argument("--cache", default="smollm2")
    ap.add_argument("--preset", default=None, help="with --start-server (default: the "
                    "server's default, tqkv_k3v4u_csw)")
    ap.add_argument("--check", action="store_true", help="also run transformers' eager "
                    "attention and compare the tokens")
    args = ap.parse_args()

    import torch
    import tqkv
    import tqkv.hf
    from tqkv.testing import LocalServer

    torch.set_num_threads(1)
    model, tokenizer = hf_smollm2.load()
    inputs = encode(tokenizer, args.prompt, not args.raw)
    args.preset_shown = args.preset or tqkv.hf.DEFAULT_PRESET
    if args.start_server:
        config = tqkv.hf.cache_config(model, preset=args.preset_shown, name=args.cache,
                                      memory_budget_bytes=256 << 20)
        server = LocalServer(args.server_binary, tqkv.hf.config_text(config), threads=2)
        server.start()
        target = server.target
    else:
        server, target = None, args.target
    try:
        with tqkv.Client(target) as client:
            out, clock, stats = run(model, tokenizer, inputs, client, args)
        report(tokenizer, inputs, out, clock, stats, args)
        if args.check:
            want, eager_clock = eager(model, tokenizer, inputs, args)
            print("eager attention: %.1f tokens/s; tokens equal: %s"
                  % (eager_clock.decode_rate(out.shape[0]), bool(torch.equal(out, want))))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
