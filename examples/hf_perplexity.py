#!/usr/bin/env python3
"""Perplexity of SmolLM2-135M with its KV cache held by tqkv (several
presets) and by transformers' own QuantizedCache (quanto and HQQ backends),
on the same model and text, printed as a table:

    build/venv/bin/python examples/hf_perplexity.py --start-server [--tokens 1024] [--text FILE]

The protocol is decode-like: the text goes through the model in forwards of
--chunk tokens (16), each chunk's queries attending over everything before
it as the cache holds it (tqkv.hf.perplexity); with tqkv every chunk is one
DecodeStream message per layer, the first one included (prefill="served"),
as the quality report's --chunk 16 rows. Each tqkv cache is made by
tqkv.hf.cache_config(model, preset=...): the model's shape and RoPE, so the
*_csw presets center keys with SmolLM2's own RoPE; a preset written P+ks also
gets per-channel key scales calibrated on the first --calibration-tokens
tokens of tqkv.hf.calibration_text() (Python's pydoc topics, never the text
measured).

Bits per element: tqkv's from the server's own count of what it held at the
end of the text (compressed tokens, the recipe's exact sink and recent
tokens at fp16, centering means; so short texts pay for the exact tokens),
over tokens x layers x KV heads x head_dim x 2; QuantizedCache's nominal
(n bits per element plus an fp16 scale and zero per group of 64: n + 0.5),
its last --residual tokens (128) kept in float32 besides.

QuantizedCache's backends are optional packages: `pip install
optimum-quanto hqq` (not installed by scripts/python_env.sh); a backend that
is missing gets a row saying so. --quantized picks the rows (backend:bits,
"" for none). quanto compiles its CPU extension on first use (about 3
minutes on 2 cores; cached by torch afterwards). transformers' own float32
attention (DynamicCache) is the baseline.
"""
import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hf_smollm2  # noqa: E402

TQKV_PRESETS = ["fp16", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                "tqkv_k3v4u_csw", "tqkv_k3v4u_csw+ks", "tqkv_k3v3u_csw"]
# A preset with this suffix gets key scales calibrated on calibration_text()
# (tqkv.hf.calibrate_key_scales), never on the text measured.
KEY_SCALES = "+ks"
QUANTIZED = "quanto:4,quanto:2,hqq:4,hqq:2"
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def text_ids(tokenizer, path, tokens):
    import torch
    ids = tokenizer(pathlib.Path(path).read_text(), add_special_tokens=True).input_ids
    if len(ids) < tokens:
        raise SystemExit("%s has %d tokens, want %d" % (path, len(ids), tokens))
    return torch.tensor([ids[:tokens]])


def tqkv_rows(model, ids, target, args):
    import tqkv
    import tqkv.hf

    rows = []
    with tqkv.Client(target, timeout=600) as client:
        for preset in args.presets.split(","):
            name = preset.replace("+", "-")
            name = name if args.start_server else "tqkv-" + name
            t0 = time.perf_counter()
            with tqkv.hf.TqkvCache(model, client, cache=name, prefill="served") as kv:
                ppl = tqkv.hf.perplexity(model, ids, cache=kv, chunk=args.chunk)
                elements = ids.shape[1] * kv.spec.layers * kv.spec.kv_heads * kv.spec.head_dim * 2
                bits = 8.0 * kv.stored_bytes / elements
            rows.append(("tqkv %s" % preset, bits, ppl, time.perf_counter() - t0))
    return rows


def cache_for(model, tokenizer, preset, args):
    """The CacheConfig of one tqkv row, named after it; P+ks: with key scales."""
    import tqkv.hf

    scales = None
    if preset.endswith(KEY_SCALES):
        ids = tokenizer(tqkv.hf.calibration_text(), return_tensors="pt").input_ids
        scales = tqkv.hf.calibrate_key_scales(model, ids[:, :args.calibration_tokens])
    return tqkv.hf.cache_config(model, preset=preset.removesuffix(KEY_SCALES),
                                name=preset.replace("+", "-"), key_scales=scales,
                                memory_budget_bytes=128 << 20)


def quantized_rows(model, ids, args):
    from transformers import QuantizedCache

    rows = []
    for item in filter(None, args.quantized.split(",")):
        backend, nbits = item.split(":")[0], int(item.split(":")[1])
        label = "QuantizedCache %s %d-bit" % (backend, nbits)
        t0 = time.perf_counter()
        try:
            cache = QuantizedCache(backend, model.config, nbits=nbits,
                                   residual_length=args.residual)
        except ImportError as error:
            rows.append((label, None, None, str(error).split(".")[0]))
            continue
        import tqkv.hf
        ppl = tqkv.hf.perplexity(model, ids, cache=cache, chunk=args.chunk)
        rows.append((label, nbits + 0.5, ppl, time.perf_counter() - t0))
    return rows


def print_table(rows, base, args, tokens):
    print("\nSmolLM2-135M-Instruct, %d tokens of %s, forwards of %d tokens; "
          "perplexity change against transformers' float32 attention (%.4f)\n"
          % (tokens, os.path.basename(args.text), args.chunk, base))
    print("| KV cache | bits per element | perplexity | change | seconds |")
    print("|---|---|---|---|---|")
    for label, bits, ppl, seconds in rows:
        if ppl is None:
            print("| %s | | | not run: %s | |" % (label, seconds))
            continue
        print("| %s | %.2f | %.4f | %+.2f%% | %.0f |"
              % (label, bits, ppl, 100 * (ppl / base - 1), seconds))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--presets", default=",".join(TQKV_PRESETS))
    ap.add_argument("--residual", type=int, default=128, help="QuantizedCache residual_length")
    ap.add_argument("--calibration-tokens", type=int, default=1024,
                    help="P+ks rows: tokens of calibration text for the key scales")
    ap.add_argument("--quantized", default=QUANTIZED, help="QuantizedCache rows, backend:bits "
                    "(\"\": none)")
    ap.add_argument("--start-server", action="store_true")
    ap.add_argument("--server-binary", default=os.environ.get("TQKV_SERVER") or
                    str(hf_smollm2.ROOT / "build" / "bin" / "tqkv-server"))
    ap.add_argument("--target", default="localhost:50051",
                    help="without --start-server: a server with a cache named tqkv-<preset> per "
                    "preset (tqkv.hf.cache_config(model, preset=P, name='tqkv-P'); P+ks: "
                    "tqkv-P-ks)")
    args = ap.parse_args()

    import torch
    import tqkv.hf
    from tqkv.testing import LocalServer

    torch.set_num_threads(1)
    model, tokenizer = hf_smollm2.load()
    ids = text_ids(tokenizer, args.text, args.tokens)
    t0 = time.perf_counter()
    base = tqkv.hf.perplexity(model, ids, chunk=args.chunk)
    rows = [("transformers float32 (DynamicCache)", 32.0, base, time.perf_counter() - t0)]
    server = None
    if args.start_server:
        caches = [cache_for(model, tokenizer, p, args) for p in args.presets.split(",")]
        server = LocalServer(args.server_binary, tqkv.hf.config_text(*caches), threads=2)
        server.start()
    try:
        rows += tqkv_rows(model, ids, server.target if server else args.target, args)
    finally:
        if server is not None:
            server.stop()
    rows += quantized_rows(model, ids, args)
    print_table(rows, base, args, ids.shape[1])


if __name__ == "__main__":
    main()
