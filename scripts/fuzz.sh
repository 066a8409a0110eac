#!/usr/bin/env bash
# The coverage-guided fuzzer of the request path (tests/fuzz/request_fuzzer.cc):
# builds it with clang's libFuzzer, ASan and UBSan in build-fuzz/ (its own
# build: every library carries the instrumentation), then runs it from the
# seed corpus. The suite runs the same target without libFuzzer for a bounded
# time (Fuzz.* in ctest); this is the long run.
#
#   scripts/fuzz.sh [RUNS]       # default 1000000 executions; 0: until stopped
#
# Needs clang and its runtime (Debian: clang, libclang-rt-14-dev). The seeds
# are generated into build-fuzz/seeds (request_fuzz_driver --write-seeds); new
# inputs go to build-fuzz/corpus; a crash writes build-fuzz/crash-* and exits
# non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:-1000000}
dir=${TQKV_FUZZ_BUILD_DIR:-build-fuzz}
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2
  exit 1
fi
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -g -O1"
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DTQKV_CUDA=OFF -DTQKV_BUILD_BENCHMARKS=OFF -DTQKV_LIBFUZZER=ON >/dev/null
fi
cmake --build "$dir" --target request_fuzzer request_fuzz_driver -j "$(nproc)"
mkdir -p "$dir/corpus"
cd "$dir"
# Leaks are not findings here: the harness keeps one service for the run.
export ASAN_OPTIONS=detect_leaks=0
./bin/request_fuzz_driver --write-seeds seeds >&2
exec ./bin/request_fuzzer -runs="$runs" -max_len=8192 -print_final_stats=1 corpus seeds
