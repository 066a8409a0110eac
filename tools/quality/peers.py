#!/usr/bin/env python3
"""The peers' KV cache quantization on the quality report's models, texts and
token ids: llama.cpp's KV cache types (through llama-cpp-python) and
transformers' QuantizedCache (optimum-quanto and HQQ backends), each against
its own unquantized run on the same weights.

    scripts/peers.sh [--models smollm2,gemma3] [--texts gpl3,persuasion]
                     [--protocols every,decode] [--json out.json]

Tokens: the quality report's (read_text, text_windows, its tokenizers:
bpe.py for SmolLM2, spm.py for Gemma 3), the first window of each text,
--tokens tokens long (default per text: TEXT_TOKENS). Each peer is given
these ids, never its own tokenization; the script checks that the peer's
tokenizer gives the same ids for the text and prints where it does not.

Protocols (--protocols), perplexity over the window's predicted tokens:
  every   the whole window in one forward: every attention read goes through
          the quantized cache.
  decode  the window fed in --step-token steps (default 16) through the
          cache, as a decode loop with teacher forcing.

Peers:
  llama.cpp  (pip install llama-cpp-python; it builds llama.cpp from source)
      the model's GGUF file (the one the report reads), K and V cache of the
      same type: f16 (the baseline), q8_0, q5_0, q4_1, q4_0, iq4_nl; flash
      attention on (llama.cpp requires it for a quantized V cache). llama.cpp
      writes a batch's K/V into its cache before attention reads them back,
      so both protocols read every token quantized, the current step's
      included: they differ in batch shapes only. `every` is one llama_decode
      of the window (n_batch = n_ubatch = window).
  transformers (pip install optimum-quanto hqq) QuantizedCache layers
      (QuantoQuantizedLayer int4 and int2, HQQQuantizedLayer 4-bit;
      q_group_size 64, axis 0: transformers' defaults) against a cache of
      DynamicLayer (what DynamicCache holds for a full-attention model) on
      the same float32 model: the GGUF dequantized by transformers' GGUF
      loader (converted once, kept under $TQKV_HF_CACHE, default
      ~/.cache/tqkv/hf). The caches are built as QuantizedCache builds them
      (Cache(layers=[...]) of one layer class), because QuantizedCache
      refuses models with sliding-window layers (Gemma 3); its quantized
      layers then keep every token and the model's sliding-window mask
      limits what a local layer reads (checked against DynamicCache's
      sliding layers: --check-sliding).
      decode: the stock layer, --hf-residual tokens (default 128,
      transformers' default) kept at full precision between flushes; the
      step being decoded is read at full precision too (the layer returns
      the new K/V as given), and a flush re-quantizes the dequantized older
      tokens with the new ones.
      every: the stock layer returns a prefill's K/V as given (unquantized),
      so a one-forward pass would read nothing quantized; this protocol
      reads back what the layer stored instead (EveryRead below: the first
      update returns _dequantize(_quantize(K/V))). residual_length plays no
      part in one forward (no flush), so it is the smallest there is: 0.

Bits per element (BITS): llama.cpp's block sizes (q4_0: 32 4-bit values and
an fp16 scale = 4.5); transformers': nbits + a 16-bit scale and a 16-bit
zero point per group of 64 at a half-precision model (4 + 32/64 = 4.5; the
float32 model here keeps float32 ones), plus the residual tokens at full
precision.

Missing optional packages: the rows of that peer are listed as skipped, with
the reason, and the others run.
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STEP = 16
TEXT_TOKENS = {"gpl3": 1024, "persuasion": 512}
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma-3-270M"}
TEXT_NAMES = {"gpl3": "GPL-3", "persuasion": "Persuasion"}
LLAMA_TYPES = ["f16", "q8_0", "q5_0", "q4_1", "q4_0", "iq4_nl"]
LLAMA_BASE = "f16"
HF_TYPES = {
    "quanto int4": {"backend": "quanto", "nbits": 4},
    "quanto int2": {"backend": "quanto", "nbits": 2},
    "HQQ 4-bit": {"backend": "hqq", "nbits": 4},
}
HF_BASE = "DynamicLayer"
HF_GROUP = 64
HF_RESIDUAL = 128
# Bits per stored element. llama.cpp: bytes per 32-element block * 8 / 32
# (q8_0 34, q5_0 22, q4_1 20, q4_0 18, iq4_nl 18 bytes).
BITS = {"f16": 16.0, "q8_0": 8.5, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5,
        HF_BASE: 32.0, "DynamicCache": 32.0}
for _name, _spec in HF_TYPES.items():
    BITS[_name] = _spec["nbits"] + 32.0 / HF_GROUP
PEERS = ("llama.cpp", "transformers")


# ---------------------------------------------------------------------------
# Pure logic (tests/python/test_peers.py)


def protocol_chunks(n, protocol, step=STEP):
    """[(start, end)] of a window of n tokens: one forward of all (every), or
    step-token steps (decode; the last one shorter)."""
    if n <= 0:
        raise ValueError("empty window")
    if protocol == "every":
        return [(0, n)]
    if protocol == "decode":
        if step <= 0:
            raise ValueError("step must be positive")
        return [(s, min(s + step, n)) for s in range(0, n, step)]
    raise ValueError("unknown protocol %r (every, decode)" % protocol)


def nll_from_logits(logits, ids, rows=128):
    """Per-position negative log-likelihood (nats, float64) of ids[1:] given
    the logits [len(ids), vocab] of each position (the last row unused):
    log-sum-exp in float64, as the report's model.nll does."""
    logits = np.asarray(logits)
    ids = np.asarray(ids)
    if logits.ndim != 2 or logits.shape[0] != len(ids):
        raise ValueError("logits %s for %d ids" % (logits.shape, len(ids)))
    out = []
    for s in range(0, len(ids) - 1, rows):  # rows at a time: Gemma's vocabulary is 262144
        e = min(s + rows, len(ids) - 1)
        x = logits[s:e].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
        out.append(lse - x[np.arange(e - s), ids[s + 1:e + 1]])
    return np.concatenate(out)


def perplexity(nll):
    return float(np.exp(np.mean(nll)))


def first_mismatch(ours, theirs):
    """Index of the first id where the peer's tokenization of the text differs
    from ours (over our length), or None when it agrees."""
    for i, a in enumerate(ours):
        if i >= len(theirs) or int(theirs[i]) != int(a):
            return i
    return None


def with_changes(results):
    """Each result with "change": ppl / (its peer's baseline ppl on the same
    model, text and protocol) - 1; None without a baseline."""
    base = {(r["peer"], r["model"], r["text"], r["protocol"]): r["ppl"]
            for r in results if r.get("baseline") and "ppl" in r}
    out = []
    for r in results:
        r = dict(r)
        if "ppl" in r:
            b = base.get((r["peer"], r["model"], r["text"], r["protocol"]))
            r["change"] = r["ppl"] / b - 1.0 if b else None
        out.append(r)
    return out


def cell_key(r):
    return (r["model"], r["text"], r["protocol"])


def table(results, skipped=()):
    """Markdown: a row per (peer, KV type), a column per (model, text,
    protocol) in first-seen order; a baseline row gives its perplexity, the
    others the change vs their peer's baseline."""
    results = with_changes(results)
    cells, rows = [], []
    for r in results:
        if cell_key(r) not in cells:
            cells.append(cell_key(r))
        row = (r["peer"], r["kv"])
        if row not in rows:
            rows.append(row)
    # baselines first within each peer, peers in the order first seen
    peers = []
    for p, _ in rows:
        if p not in peers:
            peers.append(p)
    base = {(r["peer"], r["kv"]) for r in results if r.get("baseline")}
    rows.sort(key=lambda pk: (peers.index(pk[0]), pk not in base))
    by = {(r["peer"], r["kv"], cell_key(r)): r for r in results}
    head = ["peer", "KV type", "bits/elem"] + [
        "%s, %s, %s" % (MODEL_NAMES.get(m, m), TEXT_NAMES.get(t, t), p) for m, t, p in cells]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for peer, kv in rows:
        out = [peer, kv + (" (baseline)" if (peer, kv) in base else ""),
               "%g" % BITS[kv] if kv in BITS else ""]
        for c in cells:
            r = by.get((peer, kv, c))
            if r is None or "ppl" not in r:
                out.append("")
            elif r.get("baseline"):
                out.append("ppl %.4f" % r["ppl"])
            elif r["change"] is None:
                out.append("ppl %.4f (no baseline)" % r["ppl"])
            else:
                out.append("%+.1f%%" % (100.0 * r["change"]))
        lines.append("| " + " | ".join(out) + " |")
    for s in skipped:
        lines.append("")
        lines.append("Skipped: %s %s: %s" % (s["peer"], s.get("kv", ""), s["reason"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# llama.cpp


def llama_cpp_module():
    """(module, None) or (None, why not)."""
    try:
        import llama_cpp
        return llama_cpp, None
    except Exception as error:  # ImportError, or a shared library that fails to load
        return None, "llama-cpp-python is not importable (%s: %s)" % (type(error).__name__, error)


class LlamaCppPeer:
    name = "llama.cpp"
    base = LLAMA_BASE

    def __init__(self, module, gguf, threads):
        self.m = module
        self.gguf = gguf
        self.threads = threads

    def types(self, wanted):
        return [LLAMA_BASE] + [t for t in wanted if t != LLAMA_BASE]

    def version(self):
        return "llama-cpp-python %s" % self.m.__version__

    def tokenize(self, text):
        llm = self.m.Llama(model_path=self.gguf, vocab_only=True, verbose=False)
        try:
            return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        finally:
            llm.close()

    def run(self, ids, kv, protocol, step):
        ggml_type = getattr(self.m, "GGML_TYPE_" + kv.upper())
        chunks = protocol_chunks(len(ids), protocol, step)
        batch = max(e - s for s, e in chunks)
        llm = self.m.Llama(model_path=self.gguf, n_ctx=len(ids), n_batch=batch, n_ubatch=batch,
                           logits_all=True, flash_attn=True, type_k=ggml_type, type_v=ggml_type,
                           n_threads=self.threads, n_threads_batch=self.threads, seed=0,
                           verbose=False)
        try:
            for s, e in chunks:
                llm.eval(list(ids[s:e]))
            assert llm.n_tokens == len(ids)
            return nll_from_logits(llm.scores[:len(ids)], ids)
        finally:
            llm.close()


# ---------------------------------------------------------------------------
# transformers


def hf_modules():
    """(missing backends {backend: why}, None) or (None, why transformers is
    unusable)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers.cache_utils import Cache, DynamicLayer  # noqa: F401
    except Exception as error:
        return None, "torch/transformers are not importable (%s: %s)" % (
            type(error).__name__, error)
    from transformers.utils import is_hqq_available, is_optimum_quanto_available
    missing = {}
    if not is_optimum_quanto_available():
        missing["quanto"] = "optimum-quanto is not installed (pip install optimum-quanto)"
    if not is_hqq_available():
        missing["hqq"] = "hqq is not installed (pip install hqq)"
    return missing, None


def every_read(layer_class):
    """A QuantizedLayer class whose first update (a prefill) returns the K/V
    it stored, dequantized, instead of the K/V as given: with one forward
    per window every attention read then goes through the quantized cache."""
    class EveryRead(layer_class):
        def update(self, key_states, value_states, *args, **kwargs):
            first = not self.is_initialized
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if first:
                keys = self._dequantize(self._quantized_keys).to(key_states.dtype)
                values = self._dequantize(self._quantized_values).to(value_states.dtype)
            return keys, values
    EveryRead.__name__ = "EveryRead" + layer_class.__name__
    return EveryRead


def hf_cache_dir():
    return pathlib.Path(os.environ.get("TQKV_HF_CACHE")
                        or pathlib.Path.home() / ".cache" / "tqkv" / "hf")


def hf_load(gguf, log):
    """(model, tokenizer): the GGUF dequantized to float32 by transformers'
    GGUF loader, converted once and kept as safetensors (examples/hf_smollm2.py
    does the conversion)."""
    sys.path.insert(0, str(HERE.parents[1] / "examples"))
    import hf_smollm2
    gguf = pathlib.Path(gguf)
    return hf_smollm2.load_gguf(gguf, hf_cache_dir() / gguf.stem, "sdpa", log)


class HfPeer:
    name = "transformers"
    base = HF_BASE

    def __init__(self, gguf, threads, missing, residual, log):
        import torch
        torch.set_num_threads(threads)
        self.torch = torch
        self.model, self.tokenizer = hf_load(gguf, log)
        self.missing = missing
        self.residual = residual

    def types(self, wanted):
        return [HF_BASE] + list(wanted)

    def version(self):
        import importlib.metadata as md
        out = ["transformers %s" % md.version("transformers"), "torch %s" % self.torch.__version__]
        for dist in ("optimum-quanto", "hqq"):
            try:
                out.append("%s %s" % (dist, md.version(dist)))
            except md.PackageNotFoundError:
                pass
        return ", ".join(out)

    def skip_reason(self, kv):
        if kv not in HF_TYPES:
            return None
        return self.missing.get(HF_TYPES[kv]["backend"])

    def tokenize(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def make_cache(self, kv, protocol):
        from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer,
                                              HQQQuantizedLayer, QuantoQuantizedLayer)
        layers = self.model.config.num_hidden_layers
        if kv == "DynamicCache":  # --check-sliding: sliding layers for Gemma 3
            return DynamicCache(config=self.model.config)
        if kv == HF_BASE:
            return Cache(layers=[DynamicLayer() for _ in range(layers)])
        spec = HF_TYPES[kv]
        cls = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}[spec["backend"]]
        if protocol == "every":
            cls = every_read(cls)
        residual = 0 if protocol == "every" else self.residual
        return Cache(layers=[cls(nbits=spec["nbits"], q_group_size=HF_GROUP,
                                 residual_length=residual) for _ in range(layers)])

    def run(self, ids, kv, protocol, step):
        torch = self.torch
        cache = self.make_cache(kv, protocol)
        logits = []
        with torch.inference_mode():
            for s, e in protocol_chunks(len(ids), protocol, step):
                out = self.model(input_ids=torch.tensor([ids[s:e]]), past_key_values=cache,
                                 use_cache=True)
                logits.append(out.logits[0].float().numpy())
        return nll_from_logits(np.concatenate(logits), ids)


# ---------------------------------------------------------------------------


def model_gguf(key):
    if key == "smollm2":
        import llama
        return llama.smollm2_path()
    if key == "gemma3":
        import gemma
        return gemma.gemma3_path()
    raise SystemExit("unknown model %r (known: %s)" % (key, ", ".join(MODEL_NAMES)))


def token_windows(key, texts, tokens):
    """{text: (ids, text string)}: the quality report's first window."""
    import quality_report as qr
    model, tokenizer = qr.load_model(key)
    out = {}
    for name in texts:
        n = tokens or TEXT_TOKENS.get(name, 1024)
        text = qr.read_text(name)
        out[name] = ([int(t) for t in qr.text_windows(model, tokenizer, text, n, 1)[0]], text,
                     model.bos)
    return out


def check_tokens(peer, windows, log):
    """[note] where the peer's tokenizer disagrees with our ids."""
    notes = []
    for name, (ids, text, bos) in windows.items():
        body = ids[1:] if bos is not None else ids
        try:
            theirs = peer.tokenize(text)
        except Exception as error:
            notes.append("%s: %s tokenizer not run (%s)" % (name, peer.name, error))
            continue
        at = first_mismatch(body, theirs)
        if at is None:
            log("tokens: %s's tokenizer gives the same %d ids on %s" % (peer.name, len(body), name))
        else:
            notes.append("%s: %s's tokenizer differs from ours at token %d of %d (ours %s, "
                         "theirs %s); our ids are used" % (
                             name, peer.name, at, len(body), body[at:at + 4],
                             list(theirs[at:at + 4])))
            log("tokens: " + notes[-1])
    return notes


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--texts", default="gpl3,persuasion")
    ap.add_argument("--protocols", default="every,decode")
    ap.add_argument("--tokens", type=int, default=0,
                    help="window length (0: per text, %s)" % TEXT_TOKENS)
    ap.add_argument("--step", type=int, default=STEP, help="decode step (tokens)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--llama-types", default=",".join(LLAMA_TYPES[1:]))
    ap.add_argument("--hf-types", default=",".join(HF_TYPES))
    ap.add_argument("--hf-residual", type=int, default=HF_RESIDUAL,
                    help="transformers' residual_length in the decode protocol")
    ap.add_argument("--check-sliding", action="store_true",
                    help="also run transformers' DynamicCache (sliding layers for Gemma 3) "
                         "as a row: it must match the DynamicLayer baseline")
    # 1: on a shared 2-core machine two spinning threads per stack were 6x
    # slower under load (transformers' 16-token steps: 58 s vs 10 s for 128
    # tokens of SmolLM2, load average 12). The figures do not depend on it.
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of llama.cpp and torch")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    def log(msg):
        print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)

    models = [m for m in args.models.split(",") if m]
    texts = [t for t in args.texts.split(",") if t]
    protocols = [p for p in args.protocols.split(",") if p]
    for p in protocols:
        protocol_chunks(1, p, args.step)  # validates
    peers = [p for p in args.peers.split(",") if p]
    llama_types = [t for t in args.llama_types.split(",") if t]
    hf_types = [t for t in args.hf_types.split(",") if t]
    for t in llama_types:
        if t not in BITS:
            raise SystemExit("unknown llama.cpp type %r (known: %s)" % (t, ", ".join(LLAMA_TYPES)))
    for t in hf_types:
        if t not in HF_TYPES:
            raise SystemExit("unknown transformers type %r (known: %s)" % (t, ", ".join(HF_TYPES)))
    if args.check_sliding:
        hf_types = hf_types + ["DynamicCache"]

    results, skipped, notes, versions = [], [], [], {}
    for key in models:
        log("%s: tokenizing %s" % (key, ",".join(texts)))
        windows = token_windows(key, texts, args.tokens)
        gguf = model_gguf(key)
        for peer_name in peers:
            if peer_name == "llama.cpp":
                module, why = llama_cpp_module()
                if module is None:
                    skipped.append({"peer": peer_name, "kv": ",".join([LLAMA_BASE] + llama_types),
                                    "reason": why})
                    continue
                peer = LlamaCppPeer(module, gguf, args.threads)
                kinds = peer.types(llama_types)
            elif peer_name == "transformers":
                missing, why = hf_modules()
                if missing is None:
                    skipped.append({"peer": peer_name, "kv": ",".join(hf_types), "reason": why})
                    continue
                peer = HfPeer(gguf, args.threads, missing, args.hf_residual, log)
                kinds = peer.types(hf_types)
            else:
                raise SystemExit("unknown peer %r (known: %s)" % (peer_name, ", ".join(PEERS)))
            versions[peer.name] = peer.version()
            notes += ["%s, %s" % (MODEL_NAMES[key], n) for n in check_tokens(peer, windows, log)]
            for kv in kinds:
                why = peer.skip_reason(kv) if hasattr(peer, "skip_reason") else None
                if why:
                    if not any(s["peer"] == peer.name and s["kv"] == kv for s in skipped):
                        skipped.append({"peer": peer.name, "kv": kv, "reason": why})
                    continue
                for text, (ids, _, _) in windows.items():
                    for protocol in protocols:
                        t0 = time.time()
                        nll = peer.run(ids, kv, protocol, args.step)
                        r = {"peer": peer.name, "kv": kv, "model": key, "text": text,
                             "protocol": protocol, "tokens": len(ids), "predicted": len(nll),
                             "ppl": perplexity(nll), "baseline": kv == peer.base,
                             "seconds": round(time.time() - t0, 1)}
                        if peer.name == "transformers" and kv in HF_TYPES:
                            r["residual_length"] = 0 if protocol == "every" else args.hf_residual
                        results.append(r)
                        log("%s %-12s %s %-10s %-6s ppl %.4f  %.1f s" % (
                            peer.name, kv, key, text, protocol, r["ppl"], r["seconds"]))
            del peer

    hf_ran = any(r["peer"] == "transformers" for r in results)
    print("Perplexity change vs each peer's own unquantized KV run (baseline rows: perplexity), "
          "every = the window in one forward, decode = %d-token steps%s." % (
              args.step, "; transformers' decode keeps residual_length %d tokens at full "
              "precision" % args.hf_residual if hf_ran else ""))
    print()
    print(table(results, skipped))
    if notes:
        print()
        for n in notes:
            print("Tokens: " + n)
    print()
    for peer, v in versions.items():
        print("%s: %s" % (peer, v))
    if args.json:
        now = datetime.datetime.now(datetime.timezone.utc)
        report = {"date": now.isoformat(timespec="seconds"), "machine": cpu_name(),
                  "versions": versions,
                  "step": args.step, "hf_residual": args.hf_residual, "hf_group": HF_GROUP,
                  "bits": BITS, "results": with_changes(results), "skipped": skipped,
                  "token_notes": notes}
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
