// Fuzz target over the service's request path below gRPC: bytes -> a
// tqkv.v1 request (as the raw handlers parse it) -> validation, tensor
// decoding, the cache and the CPU kernels (KvCacheService::Do*). One input is
// a method selector byte, then the message's bytes. The service keeps its
// state across inputs (sequences, pages), so sequences of calls are fuzzed
// too; every 4096 inputs it drops every sequence, so memory stays bounded.
// The selector byte also picks the caller: an admin (selector < kMethods, as
// the seeds are), or one of two tenants with small quotas (service/auth.h),
// so authorization and quota accounting are fuzzed with the rest.
//
// Built two ways (tests/fuzz/CMakeLists.txt): with clang's libFuzzer
// (scripts/fuzz.sh: coverage-guided, ASan + UBSan), and with any compiler as
// a plain program (fuzz_driver.cc) that writes the seed corpus, replays it
// and runs seeded random mutations of it for a bounded time (the CTest entry).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/cpu/cpu_backend.h"
#include "service/config.h"
#include "service/kv_cache_service.h"
#include "tests/fuzz/request_fuzzer.h"

namespace tqkv {
namespace fuzz {
namespace {

// Two small caches: a compressed one with centering and exact recent tokens, and
// an fp16 one with a sliding-window layer; few pages, so a full pool is hit.
constexpr char kConfig[] = R"pb(
  caches {
    name: "default"
    num_layers: 3
    num_kv_heads: 2
    num_query_heads: 4
    head_dim: 32
    page_tokens: 4
    preset: "tqkv_k3v4u_csw"
    boundary_layers: 1
    memory_budget_bytes: 262144
    rope { base: 10000 }
  }
  caches {
    name: "plain"
    num_layers: 2
    num_kv_heads: 1
    num_query_heads: 2
    head_dim: 16
    page_tokens: 8
    preset: "fp16"
    memory_budget_bytes: 65536
    sliding_window_layers {
      layers: [ 1 ]
      window: 8
    }
  }
)pb";

struct Harness {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  std::unique_ptr<service::KvCacheService> service;
  int64_t inputs = 0;
  std::vector<const service::Tenant*> tenants;  // t, u

  Harness() {
    // Malformed strings make libprotobuf log a line each: silence it (the
    // server throttles it instead, service/server.cc).
    google::protobuf::SetLogHandler(nullptr);
    absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(kConfig);
    if (!config.ok()) abort();
    absl::StatusOr<std::vector<CacheOptions>> options = service::ToCacheOptions(*config, uint64_t{1} << 20);
    if (!options.ok()) abort();
    std::vector<std::unique_ptr<KvCache>> caches;
    for (const CacheOptions& o : *options) {
      absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(o, backend.get());
      if (!cache.ok()) abort();
      caches.push_back(*std::move(cache));
    }
    absl::StatusOr<service::AuthConfig> auth = service::ParseAuthConfig(
        "admin-token\n"
        "t-token tenant=t max_bytes=64KiB max_sequences=8\n"
        "u-token tenant=u max_sequences=3\n");
    if (!auth.ok()) abort();
    service = std::make_unique<service::KvCacheService>(std::move(caches), backend.get(), nullptr,
                                                        service::Authenticator(*auth));
    tenants = service->auth().tenants();
    service->set_max_response_bytes(1 << 20);
  }

  void Reset() {
    for (KvCache* cache : service->caches()) {
      for (const std::string& id : cache->ListSequences()) (void)cache->Drop(id);
    }
  }
};

template <typename Request, typename Response, typename Do>
void Run(const service::Caller& caller, const std::string& bytes, Do do_call) {
  Request request;
  if (!request.ParseFromString(bytes)) return;  // the handler answers INVALID_ARGUMENT
  Response response;
  (void)do_call(caller, request, &response);
}

}  // namespace

const char* HarnessConfig() { return kConfig; }

int RunOneInput(const uint8_t* data, size_t size) {
  static Harness* const h = new Harness();
  if (size < 1) return 0;
  if (++h->inputs % 4096 == 0) h->Reset();
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  service::KvCacheService& s = *h->service;
  const int who = (data[0] / kMethods) % 3;
  const service::Caller caller{who == 0 ? nullptr : h->tenants[who - 1]};
  switch (data[0] % kMethods) {
    case kAppend:
      Run<v1::AppendRequest, v1::AppendResponse>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoAppend(c, r, out); });
      break;
    case kScoreQuery:
      Run<v1::ScoreQueryRequest, v1::ScoreQueryResponse>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoScoreQuery(c, r, out); });
      break;
    case kAttend:
      Run<v1::AttendRequest, v1::AttendResponse>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoAttend(c, r, out); });
      break;
    case kAppendAttend:
      Run<v1::AppendAttendRequest, v1::AppendAttendResponse>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoAppendAttend(c, r, out); });
      break;
    case kCreateSequence:
      Run<v1::CreateSequenceRequest, v1::SequenceInfo>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoCreateSequence(c, r, out); });
      break;
    case kForkSequence:
      Run<v1::ForkSequenceRequest, v1::SequenceInfo>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoForkSequence(c, r, out); });
      break;
    case kDropSequence:
      Run<v1::DropSequenceRequest, v1::DropSequenceResponse>(
          caller, bytes, [&](const auto& c, const auto& r, auto*) { return s.DoDropSequence(c, r); });
      break;
    case kGetSequence:
      Run<v1::GetSequenceRequest, v1::SequenceInfo>(
          caller, bytes, [&](const auto& c, const auto& r, auto* out) { return s.DoGetSequence(c, r, out); });
      break;
  }
  return 0;
}

}  // namespace fuzz
}  // namespace tqkv

#ifdef TQKV_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return tqkv::fuzz::RunOneInput(data, size); }
#endif
