#include "service/server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <thread>
#include <string>
#include <utility>
#include <vector>

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/backend_factory.h"
#include "kernels/kv_layout.h"
#include "base/status_macros.h"
#include "service/config.h"
#include "service/device_watch.h"
#include "service/rpc_table.h"

namespace tqkv {
namespace service {
namespace {

// libprotobuf logs one line per string field with invalid UTF-8 that it
// parses: a client sending such requests (INVALID_ARGUMENT each) could flood
// the log. The first kBurst lines pass; after that one line a minute says how
// many were dropped and repeats the last.
void ThrottledProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                          const std::string& message) {
  constexpr int64_t kBurst = 10;
  static absl::Mutex mu(absl::kConstInit);
  static int64_t seen ABSL_GUARDED_BY(mu) = 0;
  static int64_t dropped ABSL_GUARDED_BY(mu) = 0;
  static absl::Time last_summary ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  static const char* const kLevels[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  const char* name = level >= 0 && level <= 3 ? kLevels[level] : "LOG";
  absl::MutexLock lock(&mu);
  if (++seen <= kBurst || level == google::protobuf::LOGLEVEL_FATAL) {
    fprintf(stderr, "[libprotobuf %s %s:%d] %s\n", name, filename, line, message.c_str());
    return;
  }
  ++dropped;
  const absl::Time now = absl::Now();
  if (now - last_summary < absl::Minutes(1)) return;
  last_summary = now;
  fprintf(stderr, "[libprotobuf %s %s:%d] %s (%lld similar lines dropped; at most one a minute from now on)\n", name,
          filename, line, message.c_str(), static_cast<long long>(dropped));
  dropped = 0;
}

// UNAVAILABLE with one clear line when something already listens on
// host:port (EADDRINUSE); OK otherwise, including when the probe itself
// cannot tell (the real bind then reports). Run before gRPC binds, which on a
// busy port logs about a kilobyte of its internals before failing. The probe
// binds with SO_REUSEADDR and closes at once, so a port in TIME_WAIT, which
// gRPC would take, is not reported busy; gRPC's SO_REUSEPORT is deliberately
// not set, so a port another server listens on is.
absl::Status CheckPortFree(const std::string& host, int port, const char* what, const char* flag) {
  if (port <= 0) return absl::OkStatus();
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* addresses = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &addresses) != 0) {
    return absl::OkStatus();
  }
  bool in_use = false;
  for (addrinfo* a = addresses; a != nullptr && !in_use; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) in_use = true;
    close(fd);
  }
  freeaddrinfo(addresses);
  if (!in_use) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, " port ", port, " on ", host,
                                             " is already in use (another tqkv-server?); stop that process "
                                             "or choose another port with ",
                                             flag));
}

// process_* (metrics.h): one per process, shared by every Server in it.
const std::shared_ptr<prometheus::Collectable>& ProcessCollector() {
  static const auto* const collector = new std::shared_ptr<prometheus::Collectable>(MakeProcessCollector());
  return *collector;
}

// For `--backend auto` when the backend taken is a device's: which caches
// go to the CPU backend instead, because the device backend cannot serve
// their layout (Backend::SupportsLayout). Logs one line per cache saying
// where it runs and why. Other choices: none (a cache the chosen backend
// refuses fails the start, in KvCache::Create). A layout that does not
// build stays put: KvCache::Create reports it.
std::vector<bool> ChooseCpuFallbacks(const std::string& choice, const Backend& backend,
                                     const std::vector<CacheOptions>& caches) {
  std::vector<bool> on_cpu(caches.size(), false);
  if (choice != "auto" || backend.name() == "cpu") return on_cpu;
  for (size_t i = 0; i < caches.size(); ++i) {
    absl::StatusOr<std::shared_ptr<const KvLayout>> layout = KvLayout::Create(caches[i].layout);
    if (!layout.ok()) continue;
    const absl::Status supported = backend.SupportsLayout(**layout);
    on_cpu[i] = !supported.ok();
    if (on_cpu[i]) {
      std::fprintf(stderr, "tqkv-server: cache '%s' runs on the CPU backend: the %s backend cannot serve it (%s)\n",
                   caches[i].name.c_str(), backend.name().c_str(), std::string(supported.message()).c_str());
    } else {
      std::fprintf(stderr, "tqkv-server: cache '%s' runs on the %s backend (%s)\n", caches[i].name.c_str(),
                   backend.name().c_str(), backend.device().c_str());
    }
  }
  return on_cpu;
}

}  // namespace

std::string ListenHost(const ServerOptions& options) {
  if (!options.host.empty()) return options.host;
  return options.auth.enabled() ? "0.0.0.0" : "127.0.0.1";
}

bool IsLoopbackHost(const std::string& host) {
  std::string address = host;
  if (address.size() > 2 && address.front() == '[' && address.back() == ']') {
    address = address.substr(1, address.size() - 2);
  }
  if (address == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, address.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, address.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;
}

std::string OpenAccessWarning(const ServerOptions& options, int port) {
  const std::string host = ListenHost(options);
  if (options.auth.enabled() || IsLoopbackHost(host)) return "";
  return absl::StrCat("tqkv-server: WARNING: serving ", host, ":", port,
                      " without authentication: any host that reaches this port can read, write and drop "
                      "every sequence; give --auth_token_file FILE (bearer tokens, service/auth.h) to require "
                      "a token, or --host 127.0.0.1 to serve this machine only");
}

namespace {

// Every range Start checks before it touches a port, a device or memory.
absl::Status CheckOptions(const ServerOptions& options) {
  RETURN_IF_ERROR(CheckRpcTable());
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port ", options.port, " is not in [0, 65535]"));
  }
  if (options.max_message_bytes < 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes is ", options.max_message_bytes, "; want >= 1024"));
  }
  if (options.metrics_port < -1 || options.metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics_port ", options.metrics_port, " is not in [-1, 65535]"));
  }
  if (options.executor.threads < 0 || options.executor.threads > 4096 || options.executor.max_pending < 1) {
    return absl::InvalidArgumentError(absl::StrCat("executor threads ", options.executor.threads,
                                                   " and max_pending_calls ", options.executor.max_pending,
                                                   "; want threads in [0, 4096] (0: 2 x cores) and "
                                                   "max_pending_calls >= 1"));
  }
  if (options.tls_cert_chain_pem.empty() != options.tls_private_key_pem.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate chain and a private key, or neither");
  }
  if (!options.data_dir.empty() && !(options.snapshot_interval_seconds >= 0)) {
    return absl::InvalidArgumentError("snapshot_interval_seconds must be >= 0 (0: only on shutdown and on demand)");
  }
  return absl::OkStatus();
}

// "[v6]" for an IPv6 literal, the host as it is otherwise.
std::string Bracketed(const std::string& host) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  RETURN_IF_ERROR(CheckOptions(options));
  ASSIGN_OR_RETURN(std::vector<CacheOptions> cache_options,
                   ToCacheOptions(options.config, options.memory_budget_bytes));
  const std::string listen_host = ListenHost(options);
  const std::string& raw_metrics_host = options.metrics_host.empty() ? listen_host : options.metrics_host;
  // Before the backend and the page pools: a busy port fails in a moment.
  RETURN_IF_ERROR(CheckPortFree(listen_host, options.port, "the gRPC", "--port"));
  if (options.metrics_port > 0) {
    RETURN_IF_ERROR(CheckPortFree(raw_metrics_host, options.metrics_port, "the /metrics", "--metrics_port"));
  }
  std::unique_ptr<Server> server(new Server());
  server->host_ = listen_host;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<KvCache>> caches, server->StartBackends(options, cache_options));
  server->executor_ = std::make_unique<CallExecutor>(options.executor);
  server->service_ = std::make_unique<KvCacheService>(std::move(caches), server->backend_.get(), server->metrics_.get(),
                                                      Authenticator(options.auth), server->executor_.get());
  server->service_->set_max_response_bytes(options.max_message_bytes);
  RETURN_IF_ERROR(server->OpenSnapshots(options));
  server->cache_collector_ = MakeCacheCollector(server->service_->caches());
  server->executor_collector_ = MakeExecutorCollector(server->executor_.get());
  server->tenant_collector_ = MakeTenantCollector(server->service_->auth().tenants());
  RETURN_IF_ERROR(server->StartGrpc(options, listen_host));
  if (options.metrics_port >= 0) RETURN_IF_ERROR(server->StartMetrics(options, raw_metrics_host));
  server->StartPeriodicSnapshots(options);
  server->SetHealthServing();
  return server;
}

absl::StatusOr<std::vector<std::unique_ptr<KvCache>>> Server::StartBackends(
    const ServerOptions& options, const std::vector<CacheOptions>& cache_options) {
  BackendOptions backend_options;
  backend_options.name = options.backend;
  backend_options.cpu_threads = options.threads;
  backend_options.cuda_device = options.cuda_device;
  backend_options.cuda_tensor_cores = options.cuda_tensor_cores;
  backend_options.cpu_integer_attention = options.cpu_integer_attention;
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, MakeBackend(backend_options, &why_not_cuda_));
  // With "auto" on a device, each cache whose layout the device backend
  // cannot serve goes to the CPU backend instead (one line each says why).
  const std::vector<bool> on_cpu = ChooseCpuFallbacks(options.backend, *backend, cache_options);
  std::unique_ptr<Backend> cpu;
  std::vector<std::string> labels = {backend->name()};
  if (std::find(on_cpu.begin(), on_cpu.end(), true) != on_cpu.end()) {
    BackendOptions cpu_options = backend_options;
    cpu_options.name = "cpu";
    ASSIGN_OR_RETURN(cpu, MakeBackend(cpu_options));
    labels.push_back(cpu->name());
  }
  metrics_ = std::make_unique<Metrics>(labels);
  backend = WithDeviceWatch(std::move(backend), [this](const absl::Status& lost) { OnDeviceLost(lost); });
  backend_ = WithKernelTimings(std::move(backend), metrics_.get(), 0);
  if (cpu != nullptr) cpu_fallback_ = WithKernelTimings(std::move(cpu), metrics_.get(), 1);
  std::vector<std::unique_ptr<KvCache>> caches;
  for (size_t i = 0; i < cache_options.size(); ++i) {
    const CacheOptions& c = cache_options[i];
    Backend* on = on_cpu[i] ? cpu_fallback_.get() : backend_.get();
    absl::StatusOr<std::unique_ptr<KvCache>> cache = KvCache::Create(c, on);
    if (!cache.ok()) {
      return absl::Status(cache.status().code(), absl::StrCat("cache '", c.name, "': ", cache.status().message()));
    }
    caches.push_back(*std::move(cache));
  }
  return caches;
}

absl::Status Server::OpenSnapshots(const ServerOptions& options) {
  if (options.data_dir.empty()) return absl::OkStatus();
  if (mkdir(options.data_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create the data directory '", options.data_dir, "': ", std::strerror(errno)));
  }
  ASSIGN_OR_RETURN(snapshotter_, Snapshotter::Open(options.data_dir, service_->caches(), &service_->auth()));
  for (const std::string& line : snapshotter_->LoadAll()) {
    std::fprintf(stderr, "tqkv-server: %s\n", line.c_str());
  }
  service_->set_snapshotter(snapshotter_.get());
  return absl::OkStatus();
}

absl::Status Server::StartGrpc(const ServerOptions& options, const std::string& listen_host) {
  // Process-wide switches; both must be set before the builder is created.
  static std::once_flag process_setup;
  std::call_once(process_setup, [] {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    google::protobuf::SetLogHandler(&ThrottledProtobufLog);
  });
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(Bracketed(listen_host), ":", options.port);
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!options.tls_cert_chain_pem.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({options.tls_private_key_pem, options.tls_cert_chain_pem});
    credentials = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(address, credentials, &port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  return absl::OkStatus();
}

absl::Status Server::StartMetrics(const ServerOptions& options, const std::string& raw_metrics_host) {
  const std::string metrics_address = absl::StrCat(Bracketed(raw_metrics_host), ":", options.metrics_port);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(metrics_address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve /metrics on ", metrics_address, ": ", e.what()));
  }
  exposer_->RegisterCollectable(metrics_->registry());
  exposer_->RegisterCollectable(cache_collector_);
  exposer_->RegisterCollectable(executor_collector_);
  exposer_->RegisterCollectable(tenant_collector_);
  exposer_->RegisterCollectable(ProcessCollector());
  const std::vector<int> ports = exposer_->GetListeningPorts();
  metrics_port_ = ports.empty() ? options.metrics_port : ports.front();
  // The wildcard addresses are reached on loopback.
  metrics_connect_host_ = raw_metrics_host == "0.0.0.0" || raw_metrics_host.empty() ? "127.0.0.1"
                          : raw_metrics_host == "::"                                ? "::1"
                                                                                    : raw_metrics_host;
  return absl::OkStatus();
}

void Server::StartPeriodicSnapshots(const ServerOptions& options) {
  if (snapshotter_ == nullptr || options.snapshot_interval_seconds <= 0) return;
  const absl::Duration every = absl::Seconds(options.snapshot_interval_seconds);
  snapshot_thread_ = std::thread([this, every] {
    while (!stop_snapshots_.WaitForNotificationWithTimeout(every)) {
      absl::StatusOr<v1::SaveSnapshotResponse> saved = snapshotter_->SaveAll();
      if (!saved.ok())
        std::fprintf(stderr, "tqkv-server: periodic snapshot failed: %s\n", saved.status().ToString().c_str());
    }
  });
}

void Server::SetHealthServing() {
  // Health: "" (the whole server) and the service by name are SERVING until
  // Shutdown, or until the device is lost (OnDeviceLost), which may happen
  // as soon as calls arrive.
  absl::MutexLock lock(&health_mu_);
  health_ = server_->GetHealthCheckService();
  if (health_ == nullptr) return;
  if (device_lost_) {
    health_->SetServingStatus(false);
  } else {
    health_->SetServingStatus(v1::KvCache::service_full_name(), true);
  }
}

void Server::OnDeviceLost(const absl::Status& lost) {
  std::fprintf(stderr,
               "tqkv-server: %s; health is NOT_SERVING, and every call that needs the device fails "
               "UNAVAILABLE until the server restarts\n",
               lost.ToString().c_str());
  absl::MutexLock lock(&health_mu_);
  device_lost_ = true;
  if (health_ != nullptr) health_->SetServingStatus(false);
}

Server::~Server() {
  if (server_ == nullptr) return;  // Start failed before listening
  Shutdown(absl::Now() + absl::Seconds(5));
  server_->Wait();
  StopMetrics();
}

void Server::StopMetrics() {
  if (exposer_ == nullptr) return;
  std::atomic<bool> stopped{false};
  const std::string host = metrics_connect_host_;
  const std::string port = std::to_string(metrics_port_);
  // Connects only once the stop has begun (the stop flag is set first
  // thing), so the connection wakes the listener rather than being served.
  std::thread wake([&stopped, host, port] {
    for (int i = 0; i < 400 && !stopped.load(); ++i) {
      absl::SleepFor(absl::Milliseconds(i == 0 ? 20 : 5));
      if (stopped.load()) break;
      addrinfo hints = {};
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_NUMERICSERV;
      addrinfo* addresses = nullptr;
      if (getaddrinfo(host.c_str(), port.c_str(), &hints, &addresses) != 0) return;
      for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        close(fd);
        if (connected) break;
      }
      freeaddrinfo(addresses);
    }
  });
  exposer_.reset();
  stopped.store(true);
  wake.join();
}

void Server::Shutdown(absl::Time deadline) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(false);
  }
  service_->BeginShutdown();
  StopServing(deadline);
  if (snapshot_thread_.joinable()) {
    stop_snapshots_.Notify();
    snapshot_thread_.join();
  }
  // No call is in flight now: the snapshot is every acknowledged append.
  if (snapshotter_ != nullptr) {
    absl::StatusOr<v1::SaveSnapshotResponse> saved = snapshotter_->SaveAll();
    if (!saved.ok()) {
      std::fprintf(stderr, "tqkv-server: the shutdown snapshot failed: %s\n", saved.status().ToString().c_str());
    } else {
      for (const v1::SnapshotFileInfo& f : saved->files()) {
        std::fprintf(stderr, "tqkv-server: saved %lld sequences of cache '%s' to %s (%lld bytes, %.2f s)\n",
                     static_cast<long long>(f.sequences()), f.cache().c_str(), f.path().c_str(),
                     static_cast<long long>(f.bytes()), f.seconds());
      }
    }
  }
}

void Server::StopServing(absl::Time deadline) {
  std::thread stop([this, deadline] { server_->Shutdown(absl::ToChronoTime(deadline)); });
  // gRPC's Shutdown returns once every connection is closed, and a client
  // may keep an idle connection, or a health Watch, open after the GOAWAY
  // until the deadline. Once no KvCache call is in flight nobody is owed an
  // answer: what is left open is cancelled then. The first look comes after
  // a pause, so that gRPC has begun to refuse new calls and has handed the
  // calls that just arrived to their handlers.
  do {
    absl::SleepFor(absl::Milliseconds(5));
  } while (metrics_->calls_in_flight() > 0 && absl::Now() < deadline);
  grpc_server_cancel_all_calls(server_->c_server());
  stop.join();
}

void Server::Wait() { server_->Wait(); }

std::string Server::MetricsText() const {
  return SerializeMetrics(
      {metrics_->registry(), cache_collector_, executor_collector_, tenant_collector_, ProcessCollector()});
}

}  // namespace service
}  // namespace tqkv
