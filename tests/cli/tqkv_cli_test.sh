#!/usr/bin/env bash
# End-to-end checks of the tqkv CLI binary: every offline subcommand, its JSON
# output, and its exit codes for usage and data errors.
# Usage: tqkv_cli_test.sh /path/to/tqkv
set -euo pipefail
tqkv=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
check() {  # check <description> <command...>: the command must succeed
  local what=$1; shift
  if ! "$@" >"$work/out" 2>&1; then
    echo "FAIL: $what"; sed 's/^/    /' "$work/out"; failures=$((failures + 1))
  fi
}
expect_code() {  # expect_code <code> <description> <command...>
  local code=$1 what=$2; shift 2
  set +e; "$@" >"$work/out" 2>&1; local got=$?; set -e
  if [ "$got" != "$code" ]; then
    echo "FAIL: $what: exit $got, want $code"; sed 's/^/    /' "$work/out"; failures=$((failures + 1))
  fi
}
contains() {  # contains <text> <file>
  grep -q -- "$1" "$2" || { echo "FAIL: '$1' not in output"; sed 's/^/    /' "$2"; failures=$((failures + 1)); }
}

check "synth keys" "$tqkv" synth --kind outlier-keys --rows 512 --head-dim 96 --seed 1 --out "$work/k.npy"
check "synth values" "$tqkv" synth --kind gaussian --rows 512 --head-dim 96 --seed 2 --out "$work/v.npy"
check "synth queries" "$tqkv" synth --rows 8 --head-dim 96 --seed 3 --out "$work/q.npy"

check "roundtrip" "$tqkv" roundtrip --preset tqkv_k3v3 --part keys --in "$work/k.npy" --out "$work/k_hat.npy"
contains "relative MSE 0.0" "$work/out"
contains "bytes per vector 38" "$work/out"  # 96 coordinates x 3 bits = 36 bytes + fp16 norm
[ -s "$work/k_hat.npy" ] || { echo "FAIL: roundtrip wrote no output"; failures=$((failures + 1)); }
check "roundtrip of its own output" "$tqkv" roundtrip --preset fp16 --part values --in "$work/k_hat.npy" --out "$work/k_hat2.npy"

check "eval json" "$tqkv" eval --preset all --keys "$work/k.npy" --queries "$work/q.npy" --values "$work/v.npy" --json
contains '"preset": "turboquant_3bit_nc"' "$work/out"
contains '"logit_rmse"' "$work/out"
contains '"tv_distance"' "$work/out"
check "eval table" "$tqkv" eval --preset fp8,tqkv_k2p5v3 --keys "$work/k.npy" --queries "$work/q.npy"
contains "tqkv_k2p5v3" "$work/out"

check "distortion" "$tqkv" distortion --head-dim 128 --json
contains '"d_mse": 0.3608' "$work/out"
check "codebook" "$tqkv" codebook --head-dim 128 --bits 2
contains "1.5051" "$work/out"  # outer 2-bit centroid x sqrt(128)
check "presets" "$tqkv" presets --head-dim 80
check "capacity" "$tqkv" capacity --memory-gib 1 --layout llama3-70b --json
contains '"ratio_to_bf16"' "$work/out"
# The recipe's exact copies take pages of their own (cache/footprint.h).
check "capacity recipe" "$tqkv" capacity --memory-gib 1 --preset tqkv_k3v4u_csw --context 1000 --boundary-layers 0 --json
contains '"exact_pages_per_sequence": 24' "$work/out"
contains '"context": 1000' "$work/out"
models=$(dirname "$0")/../data/model_configs
check "config from hf" "$tqkv" config --from-hf "$models/llama-3.1-8b.json"
contains 'scaling_type: "llama3"' "$work/out"
contains 'pair_layout: HALF_SPLIT' "$work/out"
mkdir -p "$work/gemma" && cp "$models/gemma-3-27b.json" "$work/gemma/config.json"
check "config from a model dir" "$tqkv" config --from-hf "$work/gemma" --preset turboquant_k3v4_nc --name gemma
contains 'window: 1024' "$work/out"
contains '# Per-layer RoPE' "$work/out"
expect_code 2 "config without a source" "$tqkv" config
expect_code 2 "config with two sources" "$tqkv" config --from-hf "$work/gemma" --from-gguf x.gguf
expect_code 2 "config with an unknown preset" "$tqkv" config --from-hf "$work/gemma" --preset nope
expect_code 2 "config with a bad --rope-of" "$tqkv" config --from-hf "$work/gemma" --rope-of middle
expect_code 1 "config of a missing file" "$tqkv" config --from-gguf "$work/missing.gguf"
echo '{"model_type": "llama", "num_hidden_layers": 2}' >"$work/broken.json"
expect_code 1 "config of an incomplete config.json" "$tqkv" config --from-hf "$work/broken.json"
contains "num_attention_heads is missing" "$work/out"
check "bench attend" "$tqkv" bench attend --preset tqkv_k3v3,turboquant_3bit_nc --context 64,200 --min-seconds 0.01 --json
contains '"speedup_vs_bf16"' "$work/out"
contains '"fraction_of_memory_bound"' "$work/out"
check "bench attend plain" "$tqkv" bench attend --preset tqkv_k3v4u_csw --context 200 --min-seconds 0.01 --compare-plain
contains "vs_plain" "$work/out"
# The recipe as the server holds it (tests/cli/served_layer_test.cc pins it to the server's config).
contains "tqkv_k3v4u_csw reads: pre-RoPE centering (8 of 64 pairs), 4 sinks + 64 recent exact; plain: plain" "$work/out"
check "bench store" "$tqkv" bench store --preset turboquant_k3v4_nc --tokens 256 --json
contains '"tokens_per_second"' "$work/out"
check "bench transport" "$tqkv" bench transport --batch 2 --wire-dtype bf16 --messages 20 --json
contains '"request_bytes": 24576' "$work/out"  # 2 x (2 x 8 x 128 + 32 x 128) x 2 bytes
contains '"p50_us"' "$work/out"
expect_code 2 "bench transport bad dtype" "$tqkv" bench transport --wire-dtype f64

# calibrate: a 3-layer capture made with synth, layer 1 with outlier-channel keys
# (values with offsets everywhere, as real values have).
cap="$work/capture"; mkdir -p "$cap"
echo '{"layers": 3, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 32, "tokens": 96}' >"$cap/meta.json"
for l in 0 1 2; do
  n=$(printf %03d "$l"); kind=gaussian; [ "$l" = 1 ] && kind=outlier-keys
  check "capture q $l" "$tqkv" synth --shape 96,4,32 --seed $((10 + l)) --out "$cap/layer_${n}_q.npy"
  check "capture k $l" "$tqkv" synth --kind $kind --shape 96,2,32 --seed $((20 + l)) --out "$cap/layer_${n}_k.npy"
  check "capture v $l" "$tqkv" synth --kind outlier-keys --shape 96,2,32 --seed $((30 + l)) --out "$cap/layer_${n}_v.npy"
done
# 4.25 bits at base, 4.5 per tqkv_k4v4 layer: 4.4 buys exactly one, the outlier layer.
check "calibrate plan" "$tqkv" calibrate --capture "$cap" --positions 8 \
  --presets turboquant_k3v4_nc,tqkv_k4v4,fp16 --budget-bits 4.4
contains '| bytes/token | 68 | 72 | 256 |' "$work/out"
contains 'protected_layers { layers: \[1\] preset: "tqkv_k4v4" }' "$work/out"
check "calibrate json" "$tqkv" calibrate --capture "$cap" --positions 4 --presets fp16 \
  --base-preset fp16 --budget-ratio 1 --json
contains '"kl_divergence"' "$work/out"
contains '"ratio_vs_bf16": 1' "$work/out"
# 4.25 bits + 10 exact tokens and an fp32 key mean per 96 tokens = 6.083 at base.
check "calibrate with a recipe" "$tqkv" calibrate --capture "$cap" --positions 4 \
  --presets turboquant_k3v4_nc,tqkv_k4v4 --key-centering post_rope --centering-tokens 16 \
  --sinks 2 --recent 8 --budget-bits 7 --context 96
contains "# measured with key centering post_rope, 2 sink + 8 recent tokens exact" "$work/out"
contains "| recipe | post_rope, 10 exact | post_rope, 10 exact |" "$work/out"
# --window, the old name of --recent, still works and says so.
check "calibrate with the deprecated --window" "$tqkv" calibrate --capture "$cap" --positions 4 \
  --presets turboquant_k3v4_nc,tqkv_k4v4 --key-centering post_rope --centering-tokens 16 \
  --sinks 2 --window 8 --budget-bits 7 --context 96
contains "tqkv: --window is deprecated; use --recent" "$work/out"
contains "# measured with key centering post_rope, 2 sink + 8 recent tokens exact" "$work/out"
expect_code 2 "calibrate with --window and --recent" "$tqkv" calibrate --capture "$cap" --window 8 --recent 8
contains "give only --recent" "$work/out"
expect_code 2 "calibrate with an unknown centering" "$tqkv" calibrate --capture "$cap" --key-centering middle
contains "must be none, post_rope or pre_rope" "$work/out"
expect_code 2 "calibrate with recent tokens the layout refuses" "$tqkv" calibrate --capture "$cap" --recent 5000
expect_code 2 "calibrate with two budgets" "$tqkv" calibrate --capture "$cap" --budget-bits 4 --budget-ratio 4
expect_code 1 "calibrate below the base" "$tqkv" calibrate --capture "$cap" --positions 2 --budget-bits 3
contains "below the 4.250" "$work/out"
expect_code 1 "calibrate without a capture" "$tqkv" calibrate --capture "$work/nothing"
contains "meta.json: no such file" "$work/out"
cp "$cap/layer_000_k.npy" "$cap/layer_002_q.npy"
expect_code 1 "calibrate on a wrong shape" "$tqkv" calibrate --capture "$cap" --positions 2
contains "layer_002_q.npy has shape \[96, 2, 32\], want \[tokens 96, num_query_heads 4" "$work/out"

expect_code 2 "unknown subcommand" "$tqkv" frobnicate
expect_code 2 "misspelt subcommand" "$tqkv" atend
contains "unknown subcommand 'atend'; did you mean 'attend'?" "$work/out"
expect_code 2 "unknown flag" "$tqkv" distortion --head-dmi 128
contains "unknown flag --head-dmi for 'tqkv distortion'; did you mean --head-dim?" "$work/out"
expect_code 2 "missing required flag" "$tqkv" codebook --head-dim 128
contains "'tqkv codebook' requires --bits (missing)" "$work/out"
expect_code 2 "bad integer" "$tqkv" codebook --head-dim 12x --bits 2
contains "--head-dim: expected an integer, got '12x'" "$work/out"
expect_code 2 "missing value" "$tqkv" codebook --head-dim --bits 2
contains "--head-dim: missing value (.--bits. is a flag)" "$work/out"
expect_code 2 "stray argument" "$tqkv" presets extra
contains "unexpected argument 'extra'" "$work/out"
# Both spellings, both value forms, a switch set explicitly; integers stay integers in --json.
check "snake_case and --name=value" "$tqkv" codebook --head_dim=128 --bits 2 --json=true
python3 -c 'import json, sys; j = json.load(open(sys.argv[1]))
assert j["head_dim"] == 128 and isinstance(j["bits"], int) and len(j["centroids"]) == 4, j' "$work/out" ||
  { echo "FAIL: codebook --json"; sed 's/^/    /' "$work/out"; failures=$((failures + 1)); }
check "subcommand help" "$tqkv" codebook --help
contains "Usage: tqkv codebook \[OPTIONS\]" "$work/out"
contains "--head-dim INT REQUIRED" "$work/out"
check "subcommand -h" "$tqkv" bench attend -h
contains "--context INT,..." "$work/out"
expect_code 2 "unknown preset" "$tqkv" eval --preset nope --keys "$work/k.npy" --queries "$work/q.npy"
expect_code 1 "missing file" "$tqkv" eval --keys "$work/missing.npy" --queries "$work/q.npy"
expect_code 1 "mismatched head dims" "$tqkv" eval --keys "$work/k.npy" --queries "$work/k.npy" --values "$work/q.npy"
expect_code 0 "help" "$tqkv" --help

if [ "$failures" -ne 0 ]; then echo "$failures CLI check(s) failed"; exit 1; fi
echo "CLI checks passed"
