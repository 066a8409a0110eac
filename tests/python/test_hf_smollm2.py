"""SmolLM2-135M as a transformers model (loaded through transformers' GGUF
support, examples/hf_smollm2.py) with every layer's attention served by a
real tqkv-server, against the quality report's own served figures: the same
tokens (the first TOKENS of GPL-3, the report's tokenizer), the same
decode-like protocol (16-token forwards, each one DecodeStream message per
layer here, one Append + one Attend per layer there, the first chunk served
too), the same cache config. Two independent forward passes (transformers'
torch model and the report's numpy one) must agree.

The compressed preset is the default recipe with the model's RoPE (the
report's csw:tqkv_k3v4u_csw row). Its keys are stored in the GGUF's
interleaved pair layout as the report stores them (tqkv.hf permutes
transformers' half-split coordinates to the cache's layout; q.k unchanged),
so that the server quantizes the same vectors up to float rounding.

TQKV_HF_PPL_TOKENS=1024 TQKV_HF_PPL_SEEDS=0,101,202 runs the full-length
comparison (the means over the seeds compared) that docs/hf.md reports;
TQKV_HF_PPL_INFO=turboquant_k3v4_nc,... adds presets whose figures are
printed (pytest -s) but not bounded.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed (scripts/python_env.sh installs it "
                    "unless TQKV_PYTHON_HF=off)")
pytest.importorskip("transformers", reason="transformers is not installed "
                    "(scripts/python_env.sh installs it unless TQKV_PYTHON_HF=off)")
pytest.importorskip("accelerate", reason="accelerate (transformers' GGUF loader needs it) is not "
                    "installed (scripts/python_env.sh installs it unless TQKV_PYTHON_HF=off)")

import tqkv.hf  # noqa: E402
from conftest import ROOT, server_binary  # noqa: E402
from tqkv.testing import LocalServer  # noqa: E402
from tqkv.v1 import kvcache_pb2 as pb  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tools" / "quality"))

TOKENS = int(os.environ.get("TQKV_HF_PPL_TOKENS", "256"))
SEEDS = [int(x) for x in os.environ.get("TQKV_HF_PPL_SEEDS", "0").split(",")]
INFO = [p for p in os.environ.get("TQKV_HF_PPL_INFO", "").split(",") if p]
CHUNK = 16
RECIPE = "csw:tqkv_k3v4u_csw"  # the report's row of the default preset with the model's RoPE
FP16_REL = 1e-3      # fp16 served, and float32 eager: rounding only (the report's PPL_CHECK_REL)
DEFAULT_REL = 5e-3   # the bound for the compressed preset


@pytest.fixture(scope="module")
def smollm2():
    import hf_smollm2
    try:
        return hf_smollm2.load(log=lambda *_: None)
    except FileNotFoundError as error:  # the venv lacks the model package
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def token_ids():
    """The report's tokens: BOS + the first TOKENS - 1 of GPL-3, by its tokenizer."""
    import llama
    import quality_report
    from bpe import ByteLevelBPE
    model = llama.Llama()
    tokenizer = ByteLevelBPE.from_gguf(model.reader)
    text = quality_report.read_text("gpl3")
    return quality_report.text_windows(model, tokenizer, text, TOKENS, 1)[0]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The report's perplexity rows {name: [ppl per seed of SEEDS]} for this
    protocol (the rows without a rotation: one figure)."""
    out = tmp_path_factory.mktemp("report") / "report.json"
    command = [sys.executable, str(ROOT / "tools" / "quality" / "quality_report.py"),
               "--models", "smollm2", "--sections", "c", "--tokens", str(TOKENS),
               "--windows", "1", "--texts", "gpl3", "--chunk", str(CHUNK),
               "--presets", ",".join(["fp16"] + INFO), "--recipes", RECIPE, "--vllm", "",
               "--boundary-rows", "", "--rotation-seeds", ",".join(map(str, SEEDS)),
               "--json", str(out)]
    env = dict(os.environ, TQKV_SERVER=server_binary())
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, timeout=3000)
    rows = json.loads(out.read_text())["models"]["SmolLM2-135M-Instruct"]["perplexity"]
    return {r["name"]: r["ppl_per_seed"] for r in rows}


def caches(model):
    """{report row: [(cache config, seed)]}: the rows' configs as tqkv.hf makes them."""
    out = {"fp16": [(tqkv.hf.cache_config(model, preset="fp16", name="fp16"), 0)]}
    for row in [RECIPE] + INFO:
        preset = row.split(":")[-1]
        out[row] = []
        for seed in SEEDS:
            config = tqkv.hf.cache_config(model, preset=preset, name="%s@%d" % (row, seed),
                                          pair_layout=pb.RotaryEmbedding.INTERLEAVED)
            config.rotation_seed = seed
            out[row].append((config, seed))
    for configs in out.values():
        for config, _ in configs:
            config.memory_budget_bytes = max(64 << 20, TOKENS * 30 * 3 * 64 * 16)
    return out


def served_perplexity(model, client, ids, cache):
    with tqkv.hf.TqkvCache(model, client, cache=cache, prefill="served") as kv:
        return tqkv.hf.perplexity(model, ids, cache=kv, chunk=CHUNK)


def mean(values):
    return sum(values) / len(values)


def test_smollm2_perplexity_agrees_with_the_quality_report(smollm2, token_ids, report):
    import torch
    model, _ = smollm2
    torch.set_num_threads(1)
    ids = torch.tensor([token_ids])
    rows = caches(model)
    text = tqkv.hf.config_text(*[c for configs in rows.values() for c, _ in configs])
    got = {}
    with LocalServer(server_binary(), text, threads=2) as server, \
            server.client(timeout=600) as client:
        for row, configs in rows.items():
            got[row] = [served_perplexity(model, client, ids, c.name) for c, _ in configs]
    got["numpy float32 attention"] = [tqkv.hf.perplexity(model, ids, chunk=CHUNK)]
    bounds = {"numpy float32 attention": FP16_REL, "fp16": FP16_REL, RECIPE: DEFAULT_REL}
    for row in bounds.keys() | set(INFO):
        rel = mean(got[row]) / mean(report[row]) - 1.0
        print("%s: transformers %s, report %s; means %+.3f%%"
              % (row, " ".join("%.4f" % p for p in got[row]),
                 " ".join("%.4f" % p for p in report[row]), 100 * rel))
        if row in bounds:
            assert abs(rel) < bounds[row], (row, got[row], report[row])


def test_server_reports_keys_that_do_not_rotate_like_its_rope(smollm2, token_ids):
    """The issue's trap: SmolLM2's keys in a cache carrying Llama-3.1's RoPE
    (the default config reshaped). The server logs one line per layer
    (cache/rope_check.h; also counted in tqkv_cache_rope_mismatches_total);
    a cache with SmolLM2's own RoPE logs none."""
    import torch
    model, _ = smollm2
    torch.set_num_threads(1)
    ids = torch.tensor([token_ids[:256]])
    own = tqkv.hf.cache_config(model, name="own", memory_budget_bytes=32 << 20)
    llama = tqkv.hf.cache_config(model, name="llama", memory_budget_bytes=32 << 20)
    llama.rope.CopyFrom(pb.RotaryEmbedding(
        pair_layout=pb.RotaryEmbedding.HALF_SPLIT, base=500000, scaling_type="llama3",
        scaling_factor=8, low_freq_factor=1, high_freq_factor=4, original_max_position=8192))
    with LocalServer(server_binary(), tqkv.hf.config_text(own, llama), threads=2) as server, \
            server.client(timeout=120) as client:
        for cache in ("own", "llama"):
            with pytest.warns(tqkv.hf.RopeMismatchWarning) if cache == "llama" else \
                    _no_warning(), tqkv.hf.TqkvCache(model, client, cache=cache) as kv:
                tqkv.hf.perplexity(model, ids, cache=kv, chunk=0)  # one 256-token prefill
        log = server.read_log()
    if isinstance(log, bytes):
        log = log.decode("utf-8", "replace")
    lines = [line for line in log.splitlines() if "do not rotate like the cache's RoPE" in line]
    assert not [line for line in lines if "cache 'own'" in line], lines
    layers = {line.split(" layer ")[1].split(":")[0] for line in lines if "cache 'llama'" in line}
    print("\n".join(lines[:3]))
    assert len(layers) == model.config.num_hidden_layers, lines


class _no_warning:
    def __enter__(self):
        import warnings
        self.catcher = warnings.catch_warnings()
        self.catcher.__enter__()
        warnings.simplefilter("error", tqkv.hf.RopeMismatchWarning)

    def __exit__(self, *exc):
        return self.catcher.__exit__(*exc)


def run_example(name, *args):
    command = [sys.executable, str(ROOT / "examples" / name), "--start-server",
               "--server-binary", server_binary(), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_hf_generate_example_runs(smollm2):
    """examples/hf_generate.py, short: two prompts, 4 new tokens, --check."""
    out = run_example("hf_generate.py", "--tokens", "4", "--preset", "fp16",
                      "--prompt", "Name a river.", "Say hello.", "--check")
    assert "[1] " in out and "tokens/s over 3 steps of 2 sequences" in out, out
    assert "server held" in out and "eager attention:" in out, out


def test_hf_perplexity_example_runs(smollm2):
    """examples/hf_perplexity.py, short: 48 tokens, three presets (one with
    key scales calibrated on 64 tokens), one QuantizedCache row (run where
    hqq is installed, 'not run' otherwise)."""
    out = run_example("hf_perplexity.py", "--tokens", "48", "--presets",
                      "fp16,tqkv_k3v4u_csw,tqkv_k3v4u_csw+ks", "--calibration-tokens", "64",
                      "--quantized", "hqq:4")
    for row in ("| transformers float32 (DynamicCache) | 32.00 |", "| tqkv fp16 |",
                "| tqkv tqkv_k3v4u_csw |", "| tqkv tqkv_k3v4u_csw+ks |",
                "| QuantizedCache hqq 4-bit |"):
        assert row in out, out
