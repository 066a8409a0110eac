// One decode layer through the service's handler, in process (no gRPC, no
// network): an AppendAttend of --batch sequences of --context tokens, one new
// token each, parsed from its wire bytes (in 16 KiB slices, as gRPC hands
// them over) and answered into a gRPC buffer, as the server does. Prints, per layer, the handler's time and the
// backend's time (Store, Attend, CopyPage, as the server's kernel timings count them), and the difference: the server's
// time outside the kernels, per layer and per item, with the request's parse and the response's serialization per item
// (parts of it). Medians over --steps decode steps of every layer.
//
//   build/bin/decode_layer_bench --batch 8,64 --context 1024
//
// A figure from a loaded machine is not a figure: the program prints the
// load average it started at.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cache/kv_cache.h"
#include "google/protobuf/arena.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/forwarding_backend.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/kv_cache_service.h"
#include "service/raw_message.h"

ABSL_FLAG(std::string, batch, "8,64", "sequences per AppendAttend (comma-separated: one run each)");
ABSL_FLAG(int64_t, context, 1024, "tokens prefilled per sequence");
ABSL_FLAG(int, steps, 4, "decode steps (every layer each)");
ABSL_FLAG(int, threads, 2, "CPU backend threads");
ABSL_FLAG(std::string, preset, "", "the default cache's preset instead of its own (empty: the default config's)");

namespace tqkv {
namespace {

using Clock = std::chrono::steady_clock;

// Adds up the wall time of every kernel call.
class TimedBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Store(const StoreParams& p) override {
    return Time([&] { return inner().Store(p); });
  }
  absl::Status Attend(const AttendParams& p) override {
    return Time([&] { return inner().Attend(p); });
  }
  absl::Status StoreAndAttend(const StoreParams& s, const AttendParams& a) override {
    return Time([&] { return inner().StoreAndAttend(s, a); });
  }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return Time([&] { return inner().CopyPage(pool, from, to); });
  }
  double TakeSeconds() { return std::chrono::duration<double>(Clock::duration(total_.exchange(0))).count(); }

 private:
  template <typename F>
  absl::Status Time(F f) {
    const Clock::time_point start = Clock::now();
    absl::Status s = f();
    total_ += (Clock::now() - start).count();
    return s;
  }
  std::atomic<Clock::rep> total_{0};
};

std::vector<float> Normal(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void SetF32(const std::vector<float>& data, std::vector<int64_t> shape, v1::Tensor* t) {
  t->set_dtype(v1::DTYPE_F32);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::string(reinterpret_cast<const char*>(data.data()), data.size() * 4));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run(int batch) {
  absl::StatusOr<v1::ServerConfig> config = service::LoadServerConfig("");
  if (!config.ok()) return std::fprintf(stderr, "%s\n", config.status().ToString().c_str()), 1;
  v1::CacheConfig& c = *config->mutable_caches(0);
  if (!absl::GetFlag(FLAGS_preset).empty()) c.set_preset(absl::GetFlag(FLAGS_preset));
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int steps = absl::GetFlag(FLAGS_steps);
  auto timed = std::make_unique<TimedBackend>(MakeCpuBackend(CpuBackendOptions{absl::GetFlag(FLAGS_threads)}));
  TimedBackend* backend = timed.get();
  absl::StatusOr<std::vector<CacheOptions>> options = service::ToCacheOptions(*config, uint64_t{1} << 30);
  if (!options.ok()) return std::fprintf(stderr, "%s\n", options.status().ToString().c_str()), 1;
  CacheOptions& o = (*options)[0];
  std::shared_ptr<const KvLayout> layout = *KvLayout::Create(o.layout);
  o.memory_budget_bytes =
      layout->page_bytes() * (static_cast<size_t>(batch) * ((context + steps) / o.layout.page_tokens + 8) * 2 + 64);
  absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(o, backend);
  if (!cache.ok()) return std::fprintf(stderr, "%s\n", cache.status().ToString().c_str()), 1;
  KvCache* raw = cache->get();
  std::vector<std::unique_ptr<KvCache>> caches;
  caches.push_back(*std::move(cache));
  service::KvCacheService service(std::move(caches), backend);
  const int layers = layout->num_layers(), kv = layout->num_kv_heads(), qh = layout->num_query_heads(),
            dim = layout->head_dim();
  std::mt19937 rng(1);
  // Prefill through the cache, one chunk of every layer at a time.
  // One block of normal samples, read at a different offset by each chunk
  // (drawing every chunk's own would take most of the run).
  const int64_t chunk = 256;
  const size_t chunk_floats = static_cast<size_t>(layers) * chunk * kv * dim;
  const std::vector<float> samples = Normal(chunk_floats + 4096, rng);
  for (int s = 0; s < batch; ++s) {
    for (int64_t at = 0; at < context; at += chunk) {
      const int64_t n = std::min(chunk, context - at);
      const float* k = samples.data() + (s * 61 + at / chunk * 7) % 4096;
      AppendRequest r;
      r.sequence_id = absl::StrCat("seq-", s);
      r.start_position = at;
      r.layer_end = layers;
      r.num_tokens = n;
      r.keys = k;
      r.values = k;
      if (absl::Status st = raw->Append(r); !st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
    }
  }
  std::fprintf(stderr, "prefilled %d sequences of %lld tokens; decoding\n", batch, static_cast<long long>(context));
  backend->TakeSeconds();
  std::vector<double> handler_us, kernel_us, parse_us, serialize_us;
  const std::vector<float> token = Normal(static_cast<size_t>(kv) * dim, rng);
  const std::vector<float> query = Normal(static_cast<size_t>(qh) * dim, rng);
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < layers; ++layer) {
      v1::AppendAttendRequest request;
      request.set_layer(layer);
      for (int s = 0; s < batch; ++s) {
        v1::AppendAttendItem* item = request.add_items();
        item->set_sequence_id(absl::StrCat("seq-", s));
        item->set_start_position(context + step);
        SetF32(token, {1, kv, dim}, item->mutable_keys());
        SetF32(token, {1, kv, dim}, item->mutable_values());
        SetF32(query, {1, qh, dim}, item->mutable_queries());
      }
      // The request as gRPC hands it to the server: 16 KiB slices (HTTP/2
      // frames' payloads).
      const std::string wire = request.SerializeAsString();
      std::vector<grpc::Slice> slices;
      for (size_t at = 0; at < wire.size(); at += 16 << 10) {
        slices.emplace_back(wire.data() + at, std::min<size_t>(16 << 10, wire.size() - at));
      }
      const grpc::ByteBuffer bytes(slices.data(), slices.size());
      const Clock::time_point start = Clock::now();
      // On one arena, as the server's unary handlers do.
      google::protobuf::Arena arena(service::CallArenaOptions());
      auto* parsed = google::protobuf::Arena::CreateMessage<v1::AppendAttendRequest>(&arena);
      if (absl::Status p = service::ParseMessage(bytes, parsed, "the request"); !p.ok()) {
        return std::fprintf(stderr, "%s\n", p.ToString().c_str()), 1;
      }
      const Clock::time_point parsed_at = Clock::now();
      auto* response = google::protobuf::Arena::CreateMessage<v1::AppendAttendResponse>(&arena);
      const absl::Status status = service.DoAppendAttend(service::Caller::Admin(), *parsed, response);
      const Clock::time_point worked_at = Clock::now();
      grpc::ByteBuffer out;
      (void)service::SerializeMessage(*response, &out);
      const Clock::time_point end = Clock::now();
      handler_us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
      parse_us.push_back(std::chrono::duration<double, std::micro>(parsed_at - start).count());
      serialize_us.push_back(std::chrono::duration<double, std::micro>(end - worked_at).count());
      kernel_us.push_back(backend->TakeSeconds() * 1e6);
      if (!status.ok() || response->results(0).code() != 0) {
        std::fprintf(stderr, "step %d layer %d: %s %s\n", step, layer, status.ToString().c_str(),
                     response->results(0).message().c_str());
        return 1;
      }
    }
  }
  const double handler = Median(handler_us), kernel = Median(kernel_us);
  std::vector<double> outside(handler_us.size());
  for (size_t i = 0; i < outside.size(); ++i) outside[i] = handler_us[i] - kernel_us[i];
  const double out = Median(outside);
  std::printf("%-16s %6d %8lld %11.1f %11.1f %11.1f %13.2f %9.1f %9.1f\n", c.preset().c_str(), batch,
              static_cast<long long>(context), handler, kernel, out, out / batch, Median(parse_us) / batch,
              Median(serialize_us) / batch);
  return 0;
}

}  // namespace
}  // namespace tqkv

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string load;
  std::getline(std::ifstream("/proc/loadavg"), load);
  std::printf("decode layer in process, one AppendAttend per layer; load average at start: %s\n", load.c_str());
  std::printf("%-16s %6s %8s %11s %11s %11s %13s %9s %9s\n", "preset", "batch", "context", "handler_us", "kernel_us",
              "outside_us", "outside/item", "parse/it", "write/it");
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batch), ',', absl::SkipEmpty())) {
    int batch = 0;
    if (!absl::SimpleAtoi(b, &batch) || batch < 1)
      return std::fprintf(stderr, "bad --batch %s\n", std::string(b).c_str()), 2;
    if (int code = tqkv::Run(batch); code != 0) return code;
  }
  return 0;
}
