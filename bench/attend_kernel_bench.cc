// The fused CPU attention kernels alone, per (item, KV head) call: one KV head
// of a Llama-3.1-8B-shaped layer (8 KV heads per page, so a head's planes are
// strided as in a real cache), 4 query rows (GQA 4, one decode token), per
// preset, context and ISA. No query rotation, no merge: the kernel's own time,
// for work on the kernels (tqkv bench attend times whole Attend calls).
//
//   build/bin/attend_kernel_bench --benchmark_counter_table=true
//
// ns_per_token is per token of one KV head (its 4 rows' scores, softmax and
// values).
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/kv_layout.h"
#include "kernels/preset.h"
#include "base/random.h"

namespace tqkv {
namespace {

struct Fixture {
  std::shared_ptr<const KvLayout> layout;
  std::unique_ptr<Backend> backend;
  PagePool pool{};
  std::vector<int32_t> block_table;
  std::vector<float> queries;
  ~Fixture() {
    if (backend && pool.base) backend->FreePool(pool);
  }
};

std::unique_ptr<Fixture> MakeFixture(const Preset& preset, int64_t context) {
  auto f = std::make_unique<Fixture>();
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = 8;
  options.num_query_heads = 32;
  options.head_dim = 128;
  options.page_tokens = 16;
  options.preset = std::string(preset.name);
  options.boundary_layers = 0;
  Random rng(3);
  const int row = 8 * 128;
  std::vector<float> keys(context * row), values(context * row);
  for (float& x : keys) x = static_cast<float>(rng.NextGaussian());
  for (float& x : values) x = static_cast<float>(rng.NextGaussian());
  if (preset.NeedsCalibration()) {
    for (int h = 0; h < 8; ++h) {
      std::vector<float> sample(256 * 128);
      for (int t = 0; t < 256; ++t) std::copy_n(&keys[t * row + h * 128], 128, &sample[t * 128]);
      options.hot_channels.push_back(ChooseHotChannels(sample.data(), 256, 128, preset.key.HotChannels(128)));
    }
  }
  auto layout = KvLayout::Create(options);
  if (!layout.ok()) return nullptr;
  f->layout = *layout;
  f->backend = MakeCpuBackend(1);
  const int32_t pages = static_cast<int32_t>((context + 15) / 16);
  auto pool = f->backend->AllocatePool(*f->layout, pages);
  if (!pool.ok()) return nullptr;
  f->pool = *pool;
  f->block_table.resize(pages);
  std::iota(f->block_table.begin(), f->block_table.end(), 0);
  std::vector<int32_t> slots(context);
  std::iota(slots.begin(), slots.end(), 0);
  if (!f->backend->Store({f->layout.get(), f->pool, 0, 1, context, slots.data(), keys.data(), values.data()}).ok()) {
    return nullptr;
  }
  f->queries.resize(4 * 128);
  for (float& x : f->queries) x = static_cast<float>(0.1 * rng.NextGaussian());
  return f;
}

void BM_AttendKernel(benchmark::State& state, const char* preset_name, cpu_internal::AttendKernel kernel,
                     bool (*supported)(const cpu_internal::FieldReader&, const cpu_internal::FieldReader&, int)) {
  const int64_t context = state.range(0);
  const Preset* preset = *FindPreset(preset_name);
  std::unique_ptr<Fixture> f = MakeFixture(*preset, context);
  if (f == nullptr) {
    state.SkipWithError("fixture");
    return;
  }
  cpu_internal::FieldReader key = cpu_internal::DescribeField(f->layout->key_codec(0, 0));
  cpu_internal::FieldReader value = cpu_internal::DescribeField(f->layout->value_codec(0, 0));
  const KvLayout::HeadPlanes& planes = f->layout->planes(0, 0);
  key.codes_offset = planes.key_codes;
  key.scalars_offset = planes.key_scalars;
  value.codes_offset = planes.value_codes;
  value.scalars_offset = planes.value_scalars;
  if (!supported(key, value, 128)) {
    state.SkipWithError("no fused kernel for this preset at this ISA");
    return;
  }
  std::vector<int64_t> visible(4, context);
  std::vector<float> out(4 * 128), lse(4);
  cpu_internal::HeadAttendParams p;
  p.head_dim = 128;
  p.page_tokens = 16;
  p.pool_base = f->pool.base;
  p.page_bytes = f->pool.page_bytes;
  p.block_table = f->block_table.data();
  p.key = key;
  p.value = value;
  p.rows = 4;
  p.queries = f->queries.data();
  p.visible = visible.data();
  p.out = out.data();
  p.lse = lse.data();
  for (auto _ : state) {
    kernel(p);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["ns_per_token"] = benchmark::Counter(static_cast<double>(state.iterations()) * context,
                                                      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void Register() {
  struct Isa {
    const char* name;
    cpu_internal::AttendKernel kernel;
    bool (*supported)(const cpu_internal::FieldReader&, const cpu_internal::FieldReader&, int);
    bool usable;
  };
  const Isa isas[] = {
      {"avx2", cpu_internal::AttendHeadAvx2, cpu_internal::AttendHeadAvx2Supported,
       __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")},
      {"avx512", cpu_internal::AttendHeadAvx512, cpu_internal::AttendHeadAvx512Supported,
       __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq")},
      {"avx512_vnni", cpu_internal::AttendHeadAvx512Vnni, cpu_internal::AttendHeadAvx512VnniSupported,
       DetectedSimdLevel() >= SimdLevel::kAvx512Vnni},
  };
  for (const Isa& isa : isas) {
    if (!isa.usable) continue;
    for (const char* preset : {"bf16", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc",
                               "tqkv_k3v4", "tqkv_k3v3", "tqkv_k2p5v3"}) {
      benchmark::RegisterBenchmark((std::string(isa.name) + "/" + preset).c_str(), BM_AttendKernel, preset, isa.kernel,
                                   isa.supported)
          ->Arg(512)
          ->Arg(8192)
          ->Arg(32768)
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace
}  // namespace tqkv

int main(int argc, char** argv) {
  tqkv::Register();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
