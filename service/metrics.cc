#include "service/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include "kernels/forwarding_backend.h"
#include "version/version.h"

namespace tqkv {
namespace service {
namespace {

constexpr const char* kKernelNames[kNumKernels] = {"store", "score", "attend", "copy_page", "store_attend"};
constexpr const char* kCodeNames[kNumGrpcCodes] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

// 10 us .. ~42 s, x2.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1e-5; v < 50; v *= 2) b.push_back(v);
  return b;
}

// A counter's or gauge's sample with `value`, in the field its type reads.
void SetSample(prometheus::MetricType type, double value, prometheus::ClientMetric* m) {
  if (type == prometheus::MetricType::Counter) {
    m->counter.value = value;
  } else {
    m->gauge.value = value;
  }
}

// Families of one unlabelled sample each (the executor's and the process's).
struct ScalarMetric {
  const char* name;
  const char* help;
  prometheus::MetricType type;
  double value;
};

std::vector<prometheus::MetricFamily> ScalarFamilies(const std::vector<ScalarMetric>& metrics) {
  std::vector<prometheus::MetricFamily> families;
  for (const ScalarMetric& d : metrics) {
    prometheus::MetricFamily family;
    family.name = d.name;
    family.help = d.help;
    family.type = d.type;
    prometheus::ClientMetric m;
    SetSample(d.type, d.value, &m);
    family.metric.push_back(std::move(m));
    families.push_back(std::move(family));
  }
  return families;
}

class CacheCollector : public prometheus::Collectable {
 public:
  explicit CacheCollector(std::vector<KvCache*> caches) : caches_(std::move(caches)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    struct Def {
      const char* name;
      const char* help;
      MetricType type;
    };
    static constexpr Def kDefs[] = {
        {"tqkv_cache_stored_bytes",
         "Bytes of what the sequences hold: compressed tokens, exact copies of sink and recent tokens, "
         "key means (no page padding).",
         MetricType::Gauge},
        {"tqkv_cache_stored_bytes_bf16", "The same tokens stored as bf16, in bytes.", MetricType::Gauge},
        {"tqkv_cache_bytes_saved", "bf16-equivalent bytes minus compressed bytes.", MetricType::Gauge},
        {"tqkv_cache_compression_ratio", "bf16-equivalent bytes / stored bytes (0: empty).", MetricType::Gauge},
        {"tqkv_cache_pool_bytes_used",
         "Pool bytes the sequences' pages take (pages used x page bytes: padding and exact pages included).",
         MetricType::Gauge},
        {"tqkv_cache_pool_compression_ratio",
         "bf16-equivalent bytes / pool bytes used (0: empty): the capacity a pool of this size gains.",
         MetricType::Gauge},
        {"tqkv_cache_pages_total", "Pages in the cache's pool.", MetricType::Gauge},
        {"tqkv_cache_pages_used", "Pages in use by sequences.", MetricType::Gauge},
        {"tqkv_cache_sequences", "Sequences held.", MetricType::Gauge},
        {"tqkv_cache_tokens", "Tokens held, summed over sequences.", MetricType::Gauge},
        {"tqkv_cache_evictions_total", "Sequences dropped by LRU eviction or idle TTL.", MetricType::Counter},
        {"tqkv_cache_copy_on_writes_total", "Shared pages copied before a write.", MetricType::Counter},
        {"tqkv_cache_evicted_lookups_total",
         "Calls that named a sequence the cache had evicted (NOT_FOUND says when and why).", MetricType::Counter},
        {"tqkv_cache_rope_mismatches_total",
         "Layers of sequences whose keys did not rotate like the cache's RoPE says (pre-RoPE centering; "
         "the first 4 sequences of each layer are checked): the config's RoPE is not the model's.",
         MetricType::Counter},
    };
    constexpr int kDefsCount = sizeof(kDefs) / sizeof(kDefs[0]);
    std::vector<prometheus::MetricFamily> families(kDefsCount);
    for (int i = 0; i < kDefsCount; ++i) {
      families[i].name = kDefs[i].name;
      families[i].help = kDefs[i].help;
      families[i].type = kDefs[i].type;
    }
    for (KvCache* cache : caches_) {
      const CacheStats s = cache->Stats();
      const double stored = static_cast<double>(s.stored_bytes);
      const double bf16 = static_cast<double>(s.stored_bytes_bf16);
      const double pool = static_cast<double>(s.pages_used) * static_cast<double>(cache->layout().page_bytes());
      const double values[kDefsCount] = {stored,
                                         bf16,
                                         bf16 - stored,
                                         stored > 0 ? bf16 / stored : 0.0,
                                         pool,
                                         pool > 0 ? bf16 / pool : 0.0,
                                         static_cast<double>(s.pages_total),
                                         static_cast<double>(s.pages_used),
                                         static_cast<double>(s.sequences),
                                         static_cast<double>(s.tokens),
                                         static_cast<double>(s.evictions),
                                         static_cast<double>(s.copy_on_writes),
                                         static_cast<double>(s.evicted_lookups),
                                         static_cast<double>(s.rope_mismatches)};
      for (int i = 0; i < kDefsCount; ++i) {
        prometheus::ClientMetric m;
        m.label.push_back({"cache", cache->options().name});
        SetSample(kDefs[i].type, values[i], &m);
        families[i].metric.push_back(std::move(m));
      }
    }
    return families;
  }

 private:
  const std::vector<KvCache*> caches_;
};

class TimedBackend : public ForwardingBackend {
 public:
  TimedBackend(std::unique_ptr<Backend> inner, Metrics* metrics, int backend)
      : ForwardingBackend(std::move(inner)), metrics_(metrics), backend_(backend) {}

  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return Timed(Kernel::kCopyPage, [&] { return inner().CopyPage(pool, from, to); });
  }
  absl::Status Store(const StoreParams& params) override {
    return Timed(Kernel::kStore, [&] { return inner().Store(params); });
  }
  absl::Status Score(const ScoreParams& params) override {
    return Timed(Kernel::kScore, [&] { return inner().Score(params); });
  }
  absl::Status Attend(const AttendParams& params) override {
    return Timed(Kernel::kAttend, [&] { return inner().Attend(params); });
  }
  absl::Status StoreAndAttend(const StoreParams& store, const AttendParams& attend) override {
    return Timed(Kernel::kStoreAttend, [&] { return inner().StoreAndAttend(store, attend); });
  }

 private:
  template <typename F>
  absl::Status Timed(Kernel kernel, F f) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = f();
    metrics_->ObserveKernel(kernel, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                            backend_);
    if (status.ok()) metrics_->ObserveKernelParts(kernel, inner().LastCallTiming(), backend_);
    return status;
  }

  Metrics* metrics_;
  int backend_;
};

}  // namespace

Metrics::Metrics(const std::string& backend) : Metrics(std::vector<std::string>{backend}) {}

Metrics::Metrics(const std::vector<std::string>& backends)
    : registry_(std::make_shared<prometheus::Registry>()), kernel_duration_(backends.size()),
      kernel_device_(backends.size()), kernel_wait_(backends.size()) {
  auto& rpc_duration = prometheus::BuildHistogram()
                           .Name("tqkv_rpc_duration_seconds")
                           .Help("Wall time of each rpc, from handler start to finish.")
                           .Register(*registry_);
  for (int i = 0; i < kNumRpcs; ++i) {
    rpc_duration_[i] = &rpc_duration.Add({{"method", kRpcTable[i].label}}, LatencyBuckets());
  }
  requests_ = &prometheus::BuildCounter()
                   .Name("tqkv_rpc_requests_total")
                   .Help("Finished rpcs by method and status code.")
                   .Register(*registry_);
  errors_ = &prometheus::BuildCounter()
                 .Name("tqkv_rpc_errors_total")
                 .Help("Failed rpcs (status not OK) by method and status code.")
                 .Register(*registry_);
  auto& kernel_duration = prometheus::BuildHistogram()
                              .Name("tqkv_kernel_duration_seconds")
                              .Help("Wall time of each backend kernel call.")
                              .Register(*registry_);
  auto& kernel_device = prometheus::BuildHistogram()
                            .Name("tqkv_kernel_device_seconds")
                            .Help("Device time of each backend kernel call's kernels (CUDA events; CUDA only).")
                            .Register(*registry_);
  auto& kernel_wait = prometheus::BuildHistogram()
                          .Name("tqkv_kernel_wait_seconds")
                          .Help("Time each backend kernel call waited for a free workspace (CUDA only).")
                          .Register(*registry_);
  for (size_t b = 0; b < backends.size(); ++b) {
    for (int i = 0; i < kNumKernels; ++i) {
      const prometheus::Labels labels = {{"kernel", kKernelNames[i]}, {"backend", backends[b]}};
      kernel_duration_[b][i] = &kernel_duration.Add(labels, LatencyBuckets());
      kernel_device_[b][i] = &kernel_device.Add(labels, LatencyBuckets());
      kernel_wait_[b][i] = &kernel_wait.Add(labels, LatencyBuckets());
    }
  }
  tokens_stored_ = &prometheus::BuildCounter()
                        .Name("tqkv_tokens_stored_total")
                        .Help("Tokens stored, by cache: T tokens appended to k of L layers count T*k/L.")
                        .Register(*registry_);
  tokens_attended_ = &prometheus::BuildCounter()
                          .Name("tqkv_tokens_attended_total")
                          .Help("Query tokens attended, by cache: T queries in one of L layers count T/L.")
                          .Register(*registry_);
  auto& in_flight = prometheus::BuildGauge()
                        .Name("tqkv_rpc_in_flight")
                        .Help("Calls started and not yet finished, by method (an open stream counts).")
                        .Register(*registry_);
  for (int i = 0; i < kNumRpcs; ++i) in_flight_[i] = &in_flight.Add({{"method", kRpcTable[i].label}});
  prometheus::BuildGauge()
      .Name("tqkv_build_info")
      .Help("Always 1: the version, git revision and main compute backend of this server.")
      .Register(*registry_)
      .Add({{"version", ProjectVersion()}, {"revision", GitRevision()}, {"backend", backends.front()}})
      .Set(1);
  // Successful calls of every method show from the start.
  for (int i = 0; i < kNumRpcs; ++i) {
    CodeCounter(*requests_, &request_counters_[i][0], static_cast<Rpc>(i), grpc::StatusCode::OK);
  }
}

prometheus::Counter& Metrics::CodeCounter(prometheus::Family<prometheus::Counter>& family,
                                          std::atomic<prometheus::Counter*>* slot, Rpc rpc, grpc::StatusCode code) {
  prometheus::Counter* counter = slot->load(std::memory_order_acquire);
  if (counter != nullptr) return *counter;
  absl::MutexLock lock(&create_mu_);
  counter = slot->load(std::memory_order_relaxed);
  if (counter == nullptr) {
    counter = &family.Add({{"method", RowOf(rpc).label}, {"code", kCodeNames[static_cast<int>(code)]}});
    slot->store(counter, std::memory_order_release);
  }
  return *counter;
}

void Metrics::AddCache(const std::string& cache, int layers) {
  TokenCounters& c = token_counters_[cache];
  c.layers = layers > 0 ? layers : 1;
  c.stored = &tokens_stored_->Add({{"cache", cache}});
  c.attended = &tokens_attended_->Add({{"cache", cache}});
}

void Metrics::CountStored(const std::string& cache, int64_t layer_tokens) {
  auto it = token_counters_.find(cache);
  if (it != token_counters_.end()) it->second.stored->Increment(layer_tokens / it->second.layers);
}

void Metrics::CountAttended(const std::string& cache, int64_t layer_tokens) {
  auto it = token_counters_.find(cache);
  if (it != token_counters_.end()) it->second.attended->Increment(layer_tokens / it->second.layers);
}

Metrics::InFlight::InFlight(Metrics* metrics, Rpc rpc)
    : metrics_(metrics), gauge_(metrics == nullptr ? nullptr : metrics->in_flight_[static_cast<int>(rpc)]) {
  if (metrics_ == nullptr) return;
  gauge_->Increment();
  metrics_->calls_in_flight_.fetch_add(1, std::memory_order_acq_rel);
}

Metrics::InFlight::~InFlight() {
  if (metrics_ == nullptr) return;
  gauge_->Decrement();
  metrics_->calls_in_flight_.fetch_sub(1, std::memory_order_acq_rel);
}

void Metrics::ObserveRpc(Rpc rpc, grpc::StatusCode code, double seconds) {
  const int r = static_cast<int>(rpc);
  int c = static_cast<int>(code);
  if (c < 0 || c > 16) c = grpc::StatusCode::UNKNOWN;
  rpc_duration_[r]->Observe(seconds);
  CodeCounter(*requests_, &request_counters_[r][c], rpc, static_cast<grpc::StatusCode>(c)).Increment();
  if (c != grpc::StatusCode::OK) {
    CodeCounter(*errors_, &error_counters_[r][c], rpc, static_cast<grpc::StatusCode>(c)).Increment();
  }
}

void Metrics::ObserveKernel(Kernel kernel, double seconds, int backend) {
  kernel_duration_[backend][static_cast<int>(kernel)]->Observe(seconds);
}

void Metrics::ObserveKernelParts(Kernel kernel, const CallTiming& timing, int backend) {
  if (timing.device_seconds < 0) return;  // nothing measured (the CPU backend)
  kernel_device_[backend][static_cast<int>(kernel)]->Observe(timing.device_seconds);
  kernel_wait_[backend][static_cast<int>(kernel)]->Observe(timing.wait_seconds);
}

namespace {

// The histograms' totals; `name(i)` names histogram i.
template <size_t N, typename Name>
std::vector<Metrics::Total> Totals(const std::array<prometheus::Histogram*, N>& histograms, Name name) {
  std::vector<Metrics::Total> totals;
  for (size_t i = 0; i < N; ++i) {
    const prometheus::ClientMetric m = histograms[i]->Collect();
    totals.push_back({name(i), static_cast<int64_t>(m.histogram.sample_count), m.histogram.sample_sum});
  }
  return totals;
}

const char* KernelName(size_t i) { return kKernelNames[i]; }
const char* RpcLabel(size_t i) { return kRpcTable[i].label; }

}  // namespace

std::vector<Metrics::Total> Metrics::KernelTotals() const {
  std::vector<Total> totals = Totals(kernel_duration_[0], KernelName);
  for (size_t b = 1; b < kernel_duration_.size(); ++b) {
    const std::vector<Total> more = Totals(kernel_duration_[b], KernelName);
    for (size_t i = 0; i < totals.size(); ++i) {
      totals[i].calls += more[i].calls;
      totals[i].seconds += more[i].seconds;
    }
  }
  return totals;
}

std::vector<Metrics::Total> Metrics::RpcTotals() const { return Totals(rpc_duration_, RpcLabel); }

std::shared_ptr<prometheus::Collectable> MakeCacheCollector(std::vector<KvCache*> caches) {
  return std::make_shared<CacheCollector>(std::move(caches));
}

namespace {

class ExecutorCollector : public prometheus::Collectable {
 public:
  explicit ExecutorCollector(const CallExecutor* executor) : executor_(executor) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const CallExecutor::Stats s = executor_->GetStats();
    const std::vector<ScalarMetric> defs = {
        {"tqkv_executor_running", "Calls running on the executor's threads.", MetricType::Gauge,
         static_cast<double>(s.running)},
        {"tqkv_executor_queued", "Calls waiting for an executor thread.", MetricType::Gauge,
         static_cast<double>(s.queued)},
        {"tqkv_executor_pending_bytes", "Request bytes of the running and queued calls.", MetricType::Gauge,
         static_cast<double>(s.pending_bytes)},
        {"tqkv_executor_max_pending", "Bound on running + queued calls (--max_pending_calls).", MetricType::Gauge,
         static_cast<double>(s.max_pending)},
        {"tqkv_executor_rejected_total", "Calls refused with RESOURCE_EXHAUSTED: executor full.", MetricType::Counter,
         static_cast<double>(s.rejected)},
        {"tqkv_executor_completed_total", "Calls the executor ran.", MetricType::Counter,
         static_cast<double>(s.completed)},
    };
    return ScalarFamilies(defs);
  }

 private:
  const CallExecutor* executor_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeExecutorCollector(const CallExecutor* executor) {
  return std::make_shared<ExecutorCollector>(executor);
}

namespace {

// /proc/self/stat fields after the command (which may hold spaces and
// parentheses: split after its last ')'); empty when unreadable.
std::vector<std::string> ProcStatFields() {
  std::ifstream in("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(text.substr(close + 1));
  std::vector<std::string> fields;
  for (std::string f; rest >> f;) fields.push_back(f);
  return fields;  // fields[0] is field 3 of proc(5): the state
}

class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const std::vector<std::string> f = ProcStatFields();
    // proc(5): utime 14, stime 15, num_threads 20, starttime 22, vsize 23,
    // rss 24 (pages); fields[i] is field i + 3.
    if (f.size() < 22) return {};
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
    const auto field = [&f](int n) { return std::strtod(f[n - 3].c_str(), nullptr); };
    std::vector<ScalarMetric> defs = {
        {"process_cpu_seconds_total", "User and system CPU time of the process, in seconds.", MetricType::Counter,
         (field(14) + field(15)) / ticks},
        {"process_resident_memory_bytes", "Resident memory of the process, in bytes.", MetricType::Gauge,
         field(24) * page},
        {"process_virtual_memory_bytes", "Virtual memory size of the process, in bytes.", MetricType::Gauge, field(23)},
        {"process_threads", "Threads of the process.", MetricType::Gauge, field(20)},
    };
    // Start time: boot time (btime in /proc/stat) + starttime ticks.
    std::ifstream stat("/proc/stat");
    for (std::string line; std::getline(stat, line);) {
      if (line.rfind("btime ", 0) == 0) {
        defs.push_back({"process_start_time_seconds", "Start time of the process since the Unix epoch, in seconds.",
                        MetricType::Gauge, std::strtod(line.c_str() + 6, nullptr) + field(22) / ticks});
        break;
      }
    }
    if (DIR* dir = opendir("/proc/self/fd")) {
      int64_t fds = 0;
      while (dirent* e = readdir(dir)) {
        if (e->d_name[0] != '.') ++fds;
      }
      closedir(dir);
      defs.push_back({"process_open_fds", "Open file descriptors (one of them counting them).", MetricType::Gauge,
                      static_cast<double>(fds)});
    }
    rlimit limit = {};
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
      defs.push_back({"process_max_fds", "The limit on open file descriptors.", MetricType::Gauge,
                      static_cast<double>(limit.rlim_cur)});
    }
    return ScalarFamilies(defs);
  }
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeProcessCollector() { return std::make_shared<ProcessCollector>(); }

std::unique_ptr<Backend> WithKernelTimings(std::unique_ptr<Backend> inner, Metrics* metrics, int backend) {
  return std::make_unique<TimedBackend>(std::move(inner), metrics, backend);
}

std::string SerializeMetrics(const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
  std::vector<prometheus::MetricFamily> families;
  for (const auto& c : collectables) {
    std::vector<prometheus::MetricFamily> f = c->Collect();
    families.insert(families.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

namespace {

class TenantCollector : public prometheus::Collectable {
 public:
  explicit TenantCollector(std::vector<const Tenant*> tenants) : tenants_(std::move(tenants)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    if (tenants_.empty()) return {};
    struct Def {
      const char* name;
      const char* help;
      MetricType type;
      double (*value)(const UsageAccount&);
    };
    static constexpr Def kDefs[] = {
        {"tqkv_tenant_bytes", "Bytes of pool pages the tenant's sequences hold, over every cache.", MetricType::Gauge,
         [](const UsageAccount& a) { return static_cast<double>(a.bytes()); }},
        {"tqkv_tenant_max_bytes", "The tenant's max_bytes quota (0: no limit).", MetricType::Gauge,
         [](const UsageAccount& a) { return static_cast<double>(a.max_bytes()); }},
        {"tqkv_tenant_sequences", "Sequences the tenant holds.", MetricType::Gauge,
         [](const UsageAccount& a) { return static_cast<double>(a.sequences()); }},
        {"tqkv_tenant_max_sequences", "The tenant's max_sequences quota (0: no limit).", MetricType::Gauge,
         [](const UsageAccount& a) { return static_cast<double>(a.max_sequences()); }},
        {"tqkv_tenant_tokens", "Tokens the tenant's sequences hold (each in its longest layer).", MetricType::Gauge,
         [](const UsageAccount& a) { return static_cast<double>(a.tokens()); }},
        {"tqkv_tenant_quota_refusals_total", "Calls refused with RESOURCE_EXHAUSTED for the tenant's quota.",
         MetricType::Counter, [](const UsageAccount& a) { return static_cast<double>(a.refusals()); }},
    };
    std::vector<prometheus::MetricFamily> families;
    for (const Def& d : kDefs) {
      prometheus::MetricFamily f;
      f.name = d.name;
      f.help = d.help;
      f.type = d.type;
      for (const Tenant* tenant : tenants_) {
        prometheus::ClientMetric m;
        m.label.push_back({"tenant", tenant->name()});
        SetSample(d.type, d.value(*tenant->account()), &m);
        f.metric.push_back(std::move(m));
      }
      families.push_back(std::move(f));
    }
    prometheus::MetricFamily calls;
    calls.name = "tqkv_tenant_requests_total";
    calls.help = "Calls made with the tenant's tokens, by gRPC status code (errors: code != OK).";
    calls.type = MetricType::Counter;
    for (const Tenant* tenant : tenants_) {
      const std::array<uint64_t, kNumGrpcCodes> counts = tenant->Calls();
      for (int code = 0; code < kNumGrpcCodes; ++code) {
        if (counts[code] == 0 && code != 0) continue;
        prometheus::ClientMetric m;
        m.label.push_back({"code", kCodeNames[code]});
        m.label.push_back({"tenant", tenant->name()});
        m.counter.value = static_cast<double>(counts[code]);
        calls.metric.push_back(std::move(m));
      }
    }
    families.push_back(std::move(calls));
    return families;
  }

 private:
  std::vector<const Tenant*> tenants_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeTenantCollector(std::vector<const Tenant*> tenants) {
  return std::make_shared<TenantCollector>(std::move(tenants));
}

}  // namespace service
}  // namespace tqkv
