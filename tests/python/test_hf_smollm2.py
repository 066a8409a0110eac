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

The full-length figures (1024 tokens, three rotation seeds) are in
docs/python.md.
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

TOKENS = 256
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
    """The report's perplexity rows {name: ppl at rotation seed 0} for this protocol."""
    out = tmp_path_factory.mktemp("report") / "report.json"
    command = [sys.executable, str(ROOT / "tools" / "quality" / "quality_report.py"),
               "--models", "smollm2", "--sections", "c", "--tokens", str(TOKENS),
               "--windows", "1", "--texts", "gpl3", "--chunk", str(CHUNK), "--presets", "fp16",
               "--recipes", RECIPE, "--vllm", "", "--boundary-rows", "", "--no-seeds",
               "--json", str(out)]
    env = dict(os.environ, TQKV_SERVER=server_binary())
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    rows = json.loads(out.read_text())["models"]["SmolLM2-135M-Instruct"]["perplexity"]
    return {r["name"]: r["ppl_per_seed"][0] for r in rows}


def served_perplexity(model, client, ids, cache):
    with tqkv.hf.TqkvCache(model, client, cache=cache, prefill="served") as kv:
        return tqkv.hf.perplexity(model, ids, cache=kv, chunk=CHUNK)


def test_smollm2_perplexity_agrees_with_the_quality_report(smollm2, token_ids, report):
    import torch
    model, _ = smollm2
    torch.set_num_threads(1)
    ids = torch.tensor([token_ids])
    fp16 = tqkv.hf.cache_config(model, preset="fp16", name="fp16", memory_budget_bytes=64 << 20)
    default = tqkv.hf.cache_config(model, name="default", memory_budget_bytes=64 << 20,
                                   pair_layout=pb.RotaryEmbedding.INTERLEAVED)
    with LocalServer(server_binary(), tqkv.hf.config_text(fp16, default), threads=2) as server, \
            server.client(timeout=120) as client:
        got = {"fp16": served_perplexity(model, client, ids, "fp16"),
               RECIPE: served_perplexity(model, client, ids, "default")}
    got["numpy float32 attention"] = tqkv.hf.perplexity(model, ids, chunk=CHUNK)
    for name, bound in (("numpy float32 attention", FP16_REL), ("fp16", FP16_REL),
                        (RECIPE, DEFAULT_REL)):
        rel = got[name] / report[name] - 1.0
        print("%s: transformers %.4f, report %.4f (%+.3f%%)"
              % (name, got[name], report[name], 100 * rel))
        assert abs(rel) < bound, (name, got[name], report[name])
