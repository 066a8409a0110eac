#!/usr/bin/env bash
# The peers side by side (docs/quality.md, "Peers side by side"): llama.cpp's
# KV cache types and transformers' QuantizedCache on the quality report's
# models, texts and token ids, both protocols (tools/quality/peers.py;
# --models, --texts, --protocols, --peers, --json FILE; --help lists them).
# The peers are optional and live outside the venv, in build/peers_py
# (TQKV_PEERS_PY): TQKV_PEERS_INSTALL=1 installs them there first,
# llama-cpp-python built from source (CPU only, native, OpenMP; several
# minutes on 2 cores), optimum-quanto and hqq, without their dependencies
# (the venv has torch, transformers, numpy) but the few small ones they add.
# A peer that is missing is listed as skipped. CI installs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${TQKV_BUILD_DIR:-build}
TQKV_QUALITY_MODELS=${TQKV_QUALITY_MODELS:-all} scripts/python_env.sh >&2
target=${TQKV_PEERS_PY:-$build_dir/peers_py}
if [ "${TQKV_PEERS_INSTALL:-0}" = 1 ]; then
  CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_OPENMP=ON"} \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$build_dir/venv/bin/pip" install --no-deps --target "$target" \
    llama-cpp-python==0.3.36 diskcache optimum-quanto==0.2.7 ninja hqq==0.2.8.post1 einops termcolor >&2
fi
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
exec "$build_dir/venv/bin/python" tools/quality/peers.py "$@"
