// Store path per preset at head_dim 128: normalize, rotate, search, pack, for
// the key and the value of each token (in runs of 64 through EncodeMany), next to a memcpy of the same token's
// bf16 bytes (the cost of storing it uncompressed).
//
//   build/bin/store_bench --benchmark_counter_table=true
//
// bytes_per_second counts bf16-equivalent input bytes (4 * head_dim per
// token-head) for every row, so the rows compare directly.
//
// layer_store/<preset> is the whole store path of the CPU backend on one
// thread: one Llama-3.1-8B layer (8 KV heads, d = 128) of kLayerTokens
// tokens, fp32 K and V in [token, head, d] as a server receives them (134 MB:
// from DRAM, not from cache), into a warm pool; items are tokens.
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/backend.h"
#include "kernels/codec.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kv_layout.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/float_formats.h"
#include "kernels/preset.h"
#include "base/random.h"

namespace tqkv {
namespace {

constexpr int kHeadDim = 128;
constexpr int kTokens = 4096;  // token-heads per iteration

std::vector<float> Inputs() {
  Random rng(1);
  std::vector<float> x(static_cast<size_t>(kTokens) * kHeadDim);
  for (float& v : x) v = static_cast<float>(rng.NextGaussian());
  return x;
}

void BM_StorePreset(benchmark::State& state, const Preset* preset) {
  CodecOptions options;
  options.head_dim = kHeadDim;
  options.seed = 7;
  const std::vector<float> keys = Inputs();
  const std::vector<float> values = Inputs();
  if (preset->key.NeedsCalibration()) {
    options.hot_channels = ChooseHotChannels(keys.data(), kTokens, kHeadDim, preset->key.HotChannels(kHeadDim));
  }
  auto key_codec = MakeCodec(preset->key, options);
  auto value_codec = MakeCodec(preset->value, options);
  if (!key_codec.ok() || !value_codec.ok()) {
    state.SkipWithError("codec creation failed");
    return;
  }
  const VectorCodec& k = **key_codec;
  const VectorCodec& v = **value_codec;
  std::vector<uint8_t> key_codes(static_cast<size_t>(kTokens) * k.code_bytes());
  std::vector<uint16_t> key_scalars(static_cast<size_t>(kTokens) * k.num_scalars() + 1);
  std::vector<uint8_t> value_codes(static_cast<size_t>(kTokens) * v.code_bytes());
  std::vector<uint16_t> value_scalars(static_cast<size_t>(kTokens) * v.num_scalars() + 1);
  // Runs of 64 token-heads through EncodeMany, as the CPU backend's Store
  // hands them to the codecs.
  constexpr int kRun = 64;
  const float* key_in[kRun];
  const float* value_in[kRun];
  uint8_t* key_out[kRun];
  uint8_t* value_out[kRun];
  uint16_t* key_side[kRun];
  uint16_t* value_side[kRun];
  for (auto _ : state) {
    for (int t0 = 0; t0 < kTokens; t0 += kRun) {
      for (int i = 0; i < kRun; ++i) {
        const int t = t0 + i;
        key_in[i] = &keys[t * kHeadDim];
        value_in[i] = &values[t * kHeadDim];
        key_out[i] = &key_codes[t * k.code_bytes()];
        value_out[i] = &value_codes[t * v.code_bytes()];
        key_side[i] = &key_scalars[t * k.num_scalars()];
        value_side[i] = &value_scalars[t * v.num_scalars()];
      }
      int failed = 0;
      benchmark::DoNotOptimize(k.EncodeMany(kRun, key_in, key_out, key_side, &failed));
      benchmark::DoNotOptimize(v.EncodeMany(kRun, value_in, value_out, value_side, &failed));
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.SetBytesProcessed(state.iterations() * kTokens * 4 * kHeadDim);
  state.counters["bytes_per_token_head"] = preset->BytesPerTokenHead(kHeadDim);
}

// The uncompressed baseline: the same token-heads as bf16, copied into place.
void BM_MemcpyBf16(benchmark::State& state) {
  std::vector<uint16_t> source(static_cast<size_t>(kTokens) * 2 * kHeadDim);
  std::vector<uint16_t> destination(source.size());
  for (size_t i = 0; i < source.size(); ++i) source[i] = FloatToBf16(static_cast<float>(i % 97));
  for (auto _ : state) {
    memcpy(destination.data(), source.data(), source.size() * sizeof(uint16_t));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.SetBytesProcessed(state.iterations() * kTokens * 4 * kHeadDim);
  state.counters["bytes_per_token_head"] = 4 * kHeadDim;
}

// Also converting fp32 activations to bf16, which an uncompressed store must do.
void BM_ConvertAndCopyBf16(benchmark::State& state) {
  const std::vector<float> keys = Inputs();
  const std::vector<float> values = Inputs();
  std::vector<uint16_t> destination(static_cast<size_t>(kTokens) * 2 * kHeadDim);
  for (auto _ : state) {
    for (size_t i = 0; i < keys.size(); ++i) {
      destination[2 * i] = FloatToBf16(keys[i]);
      destination[2 * i + 1] = FloatToBf16(values[i]);
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.SetBytesProcessed(state.iterations() * kTokens * 4 * kHeadDim);
}

constexpr int kLayerTokens = 16384;

std::vector<float> LayerInput(int heads, uint64_t seed) {
  Random rng(seed);
  std::vector<float> x(static_cast<size_t>(kLayerTokens) * heads * kHeadDim);
  for (float& v : x) v = static_cast<float>(rng.NextGaussian());
  return x;
}

void BM_LayerStore(benchmark::State& state, const Preset* preset) {
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = 8;
  options.num_query_heads = 32;
  options.head_dim = kHeadDim;
  options.preset = std::string(preset->name);
  options.boundary_layers = 0;
  if (preset->NeedsCalibration()) {
    state.SkipWithError("calibrated presets are timed by tqkv bench store");
    return;
  }
  auto layout = KvLayout::Create(options);
  if (!layout.ok()) {
    state.SkipWithError(std::string(layout.status().message()).c_str());
    return;
  }
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  const int32_t pages = kLayerTokens / (*layout)->page_tokens();
  auto pool = backend->AllocatePool(**layout, pages);
  if (!pool.ok()) {
    state.SkipWithError(std::string(pool.status().message()).c_str());
    return;
  }
  memset(pool->base, 0, pool->page_bytes * static_cast<size_t>(pool->num_pages));
  // One input for every preset (made once: 67 M Gaussian draws).
  static const std::vector<float> keys = LayerInput(options.num_kv_heads, 3);
  static const std::vector<float> values = LayerInput(options.num_kv_heads, 4);
  std::vector<int32_t> slots(kLayerTokens);
  std::iota(slots.begin(), slots.end(), 0);
  const StoreParams params{layout->get(), *pool, 0, 1, kLayerTokens, slots.data(), keys.data(), values.data()};
  for (auto _ : state) {
    absl::Status status = backend->Store(params);
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
    benchmark::ClobberMemory();
  }
  backend->FreePool(*pool);
  state.SetItemsProcessed(state.iterations() * kLayerTokens);
}

int RegisterAll() {
  benchmark::RegisterBenchmark("memcpy_bf16", BM_MemcpyBf16);
  benchmark::RegisterBenchmark("convert_copy_bf16", BM_ConvertAndCopyBf16);
  for (const Preset& preset : AllPresets()) {
    benchmark::RegisterBenchmark(("store/" + std::string(preset.name)).c_str(), BM_StorePreset, &preset);
  }
  for (const Preset& preset : AllPresets()) {
    if (preset.NeedsCalibration()) continue;
    benchmark::RegisterBenchmark(("layer_store/" + std::string(preset.name)).c_str(), BM_LayerStore, &preset)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  return 0;
}

const int kRegistered = RegisterAll();

}  // namespace
}  // namespace tqkv

BENCHMARK_MAIN();
