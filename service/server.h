// The tqkv-server process minus its flags: builds the backend and the caches
// from a ServerConfig, registers the KvCache service, the standard health
// service (grpc.health.v1.Health) and server reflection, and listens. Both
// server_main.cc and the integration tests start the server through this.
// When the backend reports its device lost (Backend::DeviceStatus, a sticky
// CUDA error), health turns NOT_SERVING for good and the loss is logged; the
// calls that need the device fail UNAVAILABLE.
#ifndef TQKV_SERVICE_SERVER_H_
#define TQKV_SERVICE_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/kv_cache_service.h"
#include "service/metrics.h"
#include "service/snapshot.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {

struct ServerOptions {
  // Address to listen on (see ListenHost): empty means 127.0.0.1, this
  // machine only, without auth tokens and 0.0.0.0, every interface, with
  // them. An address other hosts reach without auth tokens serves every
  // sequence to anyone who reaches the port (OpenAccessWarning). Port 0
  // picks a free port (see Server::port()).
  std::string host;
  int port = 50051;
  // The caches; ParseServerConfig(DefaultServerConfigText()) for the default.
  v1::ServerConfig config;
  // "auto" (CUDA when built and a device is usable, else CPU; with CUDA,
  // each cache whose layout the CUDA backend cannot serve, by
  // Backend::SupportsLayout, runs on the CPU backend, and the start-up log
  // says where each cache runs and why), "cpu", or "cuda" (UNAVAILABLE
  // without a device; a cache it cannot serve fails the start with
  // UNIMPLEMENTED); see kernels/backend_factory.h.
  std::string backend = "auto";
  // CPU backend worker threads; 0 means the hardware concurrency.
  int threads = 0;
  // The executor calls run on (service/executor.h): its threads (0: 2 x the
  // hardware concurrency, at least 4) and its bounds on pending calls.
  ExecutorOptions executor;
  // CUDA device ordinal.
  int cuda_device = 0;
  // CUDA decode on the tensor cores where the layout allows (BackendOptions).
  bool cuda_tensor_cores = true;
  // CPU TurboQuant attention through the integer kernel where the CPU has
  // AVX-512 VNNI + VBMI + VBMI2 (BackendOptions::cpu_integer_attention).
  bool cpu_integer_attention = true;
  // Largest request or response, in bytes. A larger request fails with
  // RESOURCE_EXHAUSTED before it reaches a handler.
  int max_message_bytes = 64 << 20;
  // Split equally among caches whose config gives memory_budget_bytes 0.
  uint64_t memory_budget_bytes = uint64_t{4} << 30;
  // Prometheus /metrics on metrics_host:metrics_port; 0 picks a free port,
  // -1 serves none (the metrics are still kept: Server::MetricsText()).
  // /metrics is plain HTTP without auth, so it listens on loopback unless
  // told otherwise (a Prometheus in another container or host needs
  // "0.0.0.0" or the interface it scrapes; empty: `host`).
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 9464;
  // Bearer tokens, tenants and quotas (see service/auth.h); no tokens: no
  // authentication. Health and reflection stay open either way.
  AuthConfig auth;
  // Snapshots (service/snapshot.h): with a data directory, every cache's
  // sequences are loaded from it at start-up and written to it on Shutdown,
  // on SaveSnapshot and every snapshot_interval_seconds (0: not
  // periodically). Empty: nothing is written or read. The directory is
  // created if missing (its parent must exist).
  std::string data_dir;
  double snapshot_interval_seconds = 0;
  // TLS: the server's PEM certificate chain and private key (contents, not
  // paths). Both empty: plaintext; exactly one set is INVALID_ARGUMENT.
  std::string tls_cert_chain_pem;
  std::string tls_private_key_pem;
};

// The address `options` listens on: options.host when set; else 127.0.0.1
// without auth tokens (a server nobody else can call unless told so) and
// 0.0.0.0 with them.
std::string ListenHost(const ServerOptions& options);

// True for an address only this machine reaches: 127.0.0.0/8, ::1,
// "localhost". The wildcards (0.0.0.0, ::, empty) and every other address
// are not.
bool IsLoopbackHost(const std::string& host);

// One line for the start-up log when the server would accept calls without
// authentication from other hosts (no auth tokens, a host that is not
// loopback): what is open and how to close it. "" otherwise.
std::string OpenAccessWarning(const ServerOptions& options, int port);

class Server {
 public:
  // Builds everything and starts listening. Errors: the config's
  // (INVALID_ARGUMENT, NOT_FOUND), the backend's, the pool allocation's
  // (RESOURCE_EXHAUSTED), and UNAVAILABLE when the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  // Shuts down (5 s grace) if still running.
  ~Server();

  // The address listened on (ListenHost) and the port actually bound.
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  // The /metrics port actually bound; -1 when not served.
  int metrics_port() const { return metrics_port_; }
  // What /metrics serves.
  std::string MetricsText() const;
  KvCacheService& service() { return *service_; }
  // The backend taken (for "auto" on a device: the device's; some caches may
  // run on the CPU backend, see ServerOptions::backend).
  Backend& backend() { return *backend_; }
  // With backend "auto" on the CPU: why CUDA was not taken; "" otherwise.
  const std::string& why_not_cuda() const { return why_not_cuda_; }

  // Marks health NOT_SERVING, stops accepting calls, lets the calls in flight
  // finish until `deadline` and cancels the rest, then writes the snapshot
  // (with a data directory). Returns as soon as no KvCache call is in
  // flight: an open DecodeStream ends UNAVAILABLE once the steps it has
  // read are answered (KvCacheService::BeginShutdown); idle connections and
  // health Watch streams do not hold it. Idempotent.
  // REQUIRES: called from one thread (the process's main thread).
  void Shutdown(absl::Time deadline);
  // Blocks until the server has shut down.
  void Wait();

 private:
  Server() = default;

  // Stops /metrics without civetweb's wait: its listener polls with a
  // 2 s timeout before it notices a stop, so a connection to it is made
  // meanwhile to wake it (an idle server then exits in milliseconds).
  void StopMetrics();
  // gRPC's Shutdown(deadline), returning once no KvCache call is in flight
  // (or at the deadline), when what clients keep open is cancelled.
  void StopServing(absl::Time deadline);
  // Start's steps, in order: the backends (and metrics_, which labels
  // them) and the caches on them; the snapshots of data_dir loaded; gRPC
  // listening; /metrics; the periodic snapshot thread; health SERVING.
  absl::StatusOr<std::vector<std::unique_ptr<KvCache>>> StartBackends(const ServerOptions& options,
                                                                      const std::vector<CacheOptions>& cache_options);
  absl::Status OpenSnapshots(const ServerOptions& options);
  absl::Status StartGrpc(const ServerOptions& options, const std::string& listen_host);
  absl::Status StartMetrics(const ServerOptions& options, const std::string& raw_metrics_host);
  void StartPeriodicSnapshots(const ServerOptions& options);
  void SetHealthServing();
  // The backend found the device lost (service/device_watch.h): logs, and
  // health turns NOT_SERVING for good (the calls fail UNAVAILABLE already).
  void OnDeviceLost(const absl::Status& lost);

  std::string host_;
  int port_ = 0;
  int metrics_port_ = -1;
  std::string metrics_connect_host_;  // where StopMetrics connects
  bool shut_down_ = false;
  // Destroyed in reverse: the exposer first (it reads the caches), the
  // grpc::Server before the service, the service (and its caches) before the
  // backend, the backend (which times kernels into metrics_) before metrics_;
  // the executor joins after the grpc::Server and before the service.
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Backend> backend_;
  // With "auto" on a device: the CPU backend of the caches the device
  // backend cannot serve; null when every cache is on backend_.
  std::unique_ptr<Backend> cpu_fallback_;
  std::string why_not_cuda_;
  std::unique_ptr<KvCacheService> service_;
  // Reads the service's caches and tenants: after service_. The periodic
  // snapshot thread stops in Shutdown.
  std::unique_ptr<Snapshotter> snapshotter_;
  std::thread snapshot_thread_;
  absl::Notification stop_snapshots_;
  std::shared_ptr<prometheus::Collectable> cache_collector_;
  std::shared_ptr<prometheus::Collectable> tenant_collector_;  // reads the service's tenants
  // After service_ (its work calls the service) and before server_ (the
  // grpc::Server waits for the reactors the executor finishes).
  std::unique_ptr<CallExecutor> executor_;
  std::shared_ptr<prometheus::Collectable> executor_collector_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  // Set once listening; OnDeviceLost may run on any call's thread.
  absl::Mutex health_mu_;
  grpc::HealthCheckServiceInterface* health_ ABSL_GUARDED_BY(health_mu_) = nullptr;
  bool device_lost_ ABSL_GUARDED_BY(health_mu_) = false;
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_SERVER_H_
