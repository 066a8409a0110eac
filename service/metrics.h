// Every Prometheus metric tqkv exports, defined once here (prefix tqkv_,
// served at /metrics on --metrics_port). The hot path touches only cached
// handles: histogram and counter pointers created at start-up (or once per
// (method, code) pair, on first use), never a family lookup.
//
//   tqkv_build_info{version,revision,backend}   1; the labels say what runs
//   tqkv_rpc_in_flight{method}                  calls started, not finished
//                                                (a stream counts while open)
//   tqkv_rpc_duration_seconds{method}           histogram, every call
//   tqkv_rpc_requests_total{method,code}        counter, every call by code
//   tqkv_rpc_errors_total{method,code}          counter, non-OK calls
//   tqkv_tokens_stored_total{cache}             tokens stored: an append of T
//                                                tokens to k of the cache's L
//                                                layers adds T * k / L, so a
//                                                token counts 1 once every layer
//                                                holds it (rate(): tokens/s)
//   tqkv_tokens_attended_total{cache}           query tokens attended, the
//                                                same way (T queries in one
//                                                layer add T / L)
//   tqkv_kernel_duration_seconds{kernel,backend} histogram: store, score,
//                                                attend, copy_page,
//                                                store_attend (wall)
//   tqkv_kernel_device_seconds{kernel,backend}  histogram: device time of the
//                                                call's kernels (CUDA events;
//                                                store, score, attend,
//                                                store_attend on the CUDA
//                                                backend only)
//   tqkv_kernel_wait_seconds{kernel,backend}    histogram: time the call
//                                                waited for a free workspace
//                                                (CUDA backend only)
//   (wall minus device minus wait: host planning, staging and copies)
//   tqkv_cache_stored_bytes{cache}              bytes held: compressed tokens,
//                                                exact copies, key means
//   tqkv_cache_stored_bytes_bf16{cache}         the same tokens in bf16
//   tqkv_cache_bytes_saved{cache}               bf16 minus stored
//   tqkv_cache_compression_ratio{cache}         bf16 / stored (0: empty)
//   tqkv_cache_pool_bytes_used{cache}           pages used x page bytes
//   tqkv_cache_pool_compression_ratio{cache}    bf16 / pool bytes used
//   tqkv_cache_pages_total{cache}, tqkv_cache_pages_used{cache}
//   tqkv_cache_sequences{cache}, tqkv_cache_tokens{cache}
//   tqkv_cache_evictions_total{cache}           LRU + TTL drops
//   tqkv_cache_copy_on_writes_total{cache}      pages copied on write
//   tqkv_cache_evicted_lookups_total{cache}     calls that named an evicted
//                                                sequence
//   tqkv_cache_rope_mismatches_total{cache}     (sequence, layer) key means whose
//                                                keys did not rotate like the
//                                                cache's RoPE (cache/rope_check.h)
//   tqkv_executor_running, tqkv_executor_queued  calls on the executor now
//   tqkv_executor_pending_bytes                  their request bytes
//   tqkv_executor_max_pending                    the bound on running + queued
//   tqkv_executor_rejected_total                 calls refused, queue full
//   tqkv_executor_completed_total                calls run
//   tqkv_tenant_bytes{tenant}, tqkv_tenant_max_bytes{tenant}   pages held, quota
//   tqkv_tenant_sequences{tenant}, tqkv_tenant_max_sequences{tenant}
//   tqkv_tenant_tokens{tenant}
//   tqkv_tenant_quota_refusals_total{tenant}     calls refused for a quota
//   tqkv_tenant_requests_total{tenant,code}      calls by the tenant's tokens
// The tqkv_cache_* and tqkv_tenant_* families are read from KvCache::Stats()
// and the tenants' counters at scrape time, so they cost nothing between
// scrapes. The process itself is described by the standard names every
// Prometheus client library uses (MakeProcessCollector, read from /proc at
// scrape time): process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_max_fds,
// process_threads, process_start_time_seconds.
//
// Thread safety: all methods are thread-safe.
#ifndef TQKV_SERVICE_METRICS_H_
#define TQKV_SERVICE_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/synchronization/mutex.h"
#include "cache/kv_cache.h"
#include "kernels/backend.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/rpc_table.h"

namespace tqkv {
namespace service {

// Rpc, kNumRpcs and the method labels: service/rpc_table.h.

// store_attend: a decode layer's store and attention in one backend call
// (Backend::StoreAndAttend).
enum class Kernel { kStore, kScore, kAttend, kCopyPage, kStoreAttend };
inline constexpr int kNumKernels = 5;

class Metrics {
 public:
  // `backend`: the label of the kernel histograms ("cpu", "cuda").
  explicit Metrics(const std::string& backend);
  // Several backends (`--backend auto` with some caches on the CPU): kernel
  // histograms for each label; ObserveKernel's `backend` indexes `backends`.
  // REQUIRES: backends non-empty.
  explicit Metrics(const std::vector<std::string>& backends);

  // Holds one call of `rpc` in tqkv_rpc_in_flight and calls_in_flight()
  // from construction to destruction: a member of each call's reactor.
  // `metrics` may be null (nothing is counted); it must outlive the InFlight.
  class InFlight {
   public:
    InFlight(Metrics* metrics, Rpc rpc);
    ~InFlight();
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;

   private:
    Metrics* metrics_;
    prometheus::Gauge* gauge_;
  };

  // KvCache calls open now, over every rpc: the reactors whose InFlight is
  // alive (a DecodeStream counts while it is open). Server::Shutdown waits
  // for 0 before it closes what clients leave open.
  int64_t calls_in_flight() const { return calls_in_flight_.load(std::memory_order_acquire); }

  // Creates the tqkv_tokens_* counters of a cache of `layers` layers.
  // REQUIRES: called for every cache before calls are served (the counters
  // are looked up without a lock afterwards); layers > 0.
  void AddCache(const std::string& cache, int layers);
  // Counts `layer_tokens` (tokens x layers) stored into, or query tokens x
  // layers attended in, `cache`; nothing for a cache AddCache never saw.
  void CountStored(const std::string& cache, int64_t layer_tokens);
  void CountAttended(const std::string& cache, int64_t layer_tokens);

  void ObserveRpc(Rpc rpc, grpc::StatusCode code, double seconds);
  void ObserveKernel(Kernel kernel, double seconds, int backend = 0);
  // The parts of one successful call that its backend measured
  // (Backend::LastCallTiming): device time when measured (>= 0), and the
  // wait, by backends that measure device time (they have workspaces).
  void ObserveKernelParts(Kernel kernel, const CallTiming& timing, int backend = 0);

  // Calls and summed seconds so far, from the histograms: by kernel name
  // (store, score, attend, copy_page; wall time, over every backend) and by
  // rpc method name.
  struct Total {
    std::string name;
    int64_t calls = 0;
    double seconds = 0;
  };
  std::vector<Total> KernelTotals() const;
  std::vector<Total> RpcTotals() const;

  // The counters and histograms above (not the per-cache families).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  prometheus::Counter& CodeCounter(prometheus::Family<prometheus::Counter>& family,
                                   std::atomic<prometheus::Counter*>* slot, Rpc rpc, grpc::StatusCode code);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* errors_;
  std::array<prometheus::Histogram*, kNumRpcs> rpc_duration_{};
  std::array<prometheus::Gauge*, kNumRpcs> in_flight_{};
  std::atomic<int64_t> calls_in_flight_{0};
  struct TokenCounters {
    double layers = 1;
    prometheus::Counter* stored = nullptr;
    prometheus::Counter* attended = nullptr;
  };
  prometheus::Family<prometheus::Counter>* tokens_stored_;
  prometheus::Family<prometheus::Counter>* tokens_attended_;
  std::map<std::string, TokenCounters> token_counters_;  // by cache; fixed once serving
  // [backend][kernel]
  using KernelHistograms = std::array<prometheus::Histogram*, kNumKernels>;
  std::vector<KernelHistograms> kernel_duration_;
  std::vector<KernelHistograms> kernel_device_;
  std::vector<KernelHistograms> kernel_wait_;
  // [rpc][code], created on first use.
  absl::Mutex create_mu_;
  std::array<std::array<std::atomic<prometheus::Counter*>, kNumGrpcCodes>, kNumRpcs> request_counters_{};
  std::array<std::array<std::atomic<prometheus::Counter*>, kNumGrpcCodes>, kNumRpcs> error_counters_{};
};

// The tqkv_cache_* families, read from each cache's Stats() when collected.
// REQUIRES: the caches outlive the collector's last Collect().
std::shared_ptr<prometheus::Collectable> MakeCacheCollector(std::vector<KvCache*> caches);

// The tqkv_executor_* families, read from the executor's stats when
// collected. REQUIRES: `executor` outlives the collector's last Collect().
std::shared_ptr<prometheus::Collectable> MakeExecutorCollector(const CallExecutor* executor);

// The tqkv_tenant_* families (none without tenants). REQUIRES: the tenants
// outlive the collector's last Collect().
std::shared_ptr<prometheus::Collectable> MakeTenantCollector(std::vector<const Tenant*> tenants);

// The process_* families (see the top of this file), from /proc/self at
// collection time; none where /proc is missing.
std::shared_ptr<prometheus::Collectable> MakeProcessCollector();

// A Backend that forwards to `inner` and records each kernel's wall time in
// `metrics` (which must outlive it), and, for calls that succeed, the device
// and wait times `inner` measured (LastCallTiming), under the label of
// `metrics`' backend number `backend`.
std::unique_ptr<Backend> WithKernelTimings(std::unique_ptr<Backend> inner, Metrics* metrics, int backend = 0);

// The text exposition of `collectables`, as /metrics serves it.
std::string SerializeMetrics(const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_METRICS_H_
