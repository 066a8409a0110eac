// tqkv-server: the KvCache gRPC service over a CUDA or CPU backend.
// Runs with no arguments: the embedded default config, port 50051.
// Listens on 127.0.0.1 unless --host or --auth_token_file says otherwise
// (ListenHost in service/server.h).
// SIGTERM / SIGINT shut it down gracefully: no new calls, calls in flight
// finish (up to --shutdown_grace_seconds), the snapshot is written (with
// --data_dir), then exit 0 (Server::Shutdown).
// Flags are spelled --snake_case (absl flags); --kebab-case names are the
// same flags. --help lists them, --version prints the build's version.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/malloc_tuning.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/server.h"
#include "version/version.h"

ABSL_FLAG(std::string, host, "",
          "Address to listen on. Unset: 127.0.0.1 (this machine only) without --auth_token_file, 0.0.0.0 "
          "(every interface) with it. 0.0.0.0 without --auth_token_file lets any host that reaches the port "
          "read, write and drop every sequence (a warning at start-up says so).");
ABSL_FLAG(int, port, 50051, "gRPC port (0: any free port, printed at start-up).");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port (0: any free port; -1: none).");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1",
          "Address /metrics listens on: plain HTTP without auth, so loopback by default; "
          "0.0.0.0 for a Prometheus elsewhere (empty: --host).");
ABSL_FLAG(std::string, config, "",
          "Text-format tqkv.v1.ServerConfig file; the embedded default (one Llama-3.1-8B "
          "cache) when empty.");
ABSL_FLAG(std::string, backend, "auto", "Compute backend: auto (CUDA when a device is usable, else CPU) | cpu | cuda.");
ABSL_FLAG(int, cuda_device, 0, "CUDA device ordinal for the CUDA backend.");
ABSL_FLAG(bool, cuda_tensor_cores, true,
          "CUDA decode on the tensor cores where the layout allows (TF32, outputs within about 2e-3 of "
          "fp32); false: the fp32 kernel.");
ABSL_FLAG(bool, cpu_integer_attention, true,
          "CPU TurboQuant attention through the integer kernel (int8 scores and values) where the CPU has "
          "AVX-512 VNNI, VBMI and VBMI2: about twice as fast, outputs within 2% of the fp32 kernel's error; "
          "false: fp32 attention everywhere.");
ABSL_FLAG(int, threads, 0, "CPU backend worker threads (0: hardware concurrency).");
ABSL_FLAG(int, executor_threads, 0, "Threads calls run on, off gRPC's own (0: 2 x hardware concurrency, at least 4).");
ABSL_FLAG(int, max_pending_calls, 1024,
          "Calls queued or running at once; past it a call is RESOURCE_EXHAUSTED at once.");
ABSL_FLAG(double, max_pending_gib, 1.0,
          "Request bytes those calls may hold, GiB; past it a call is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, max_message_bytes, 64 << 20, "Largest request or response, in bytes.");
ABSL_FLAG(double, memory_budget_gib, 4.0,
          "Page-pool memory, GiB, split equally among caches whose config gives no budget.");
ABSL_FLAG(double, shutdown_grace_seconds, 10.0,
          "On SIGTERM/SIGINT, how long calls in flight may take to finish; the exit comes as soon as they "
          "are answered (idle connections and idle DecodeStreams do not hold it), and what is still open "
          "at the deadline is cancelled.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File of bearer tokens, one per line ('#' comments and blank lines ignored), each "
          "optionally with tenant=NAME max_bytes=SIZE max_sequences=N (service/auth.h); when set, "
          "every KvCache rpc needs `authorization: Bearer <token>`, and a tenant's token reaches "
          "only ids starting with 'NAME:'.");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM certificate chain; with --tls_key_file, serve TLS.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, data_dir, "",
          "Directory of snapshots: sequences are loaded from it at start-up and written to it on "
          "SIGTERM/SIGINT, on SaveSnapshot and every --snapshot_interval_seconds (empty: memory only; a "
          "restart loses every sequence).");
ABSL_FLAG(double, snapshot_interval_seconds, 0,
          "With --data_dir, also snapshot every this many seconds (0: only on shutdown and on demand). A "
          "crash loses what was appended since the last snapshot.");
ABSL_FLAG(bool, print_default_config, false, "Print the embedded default config and exit.");

namespace {

int g_signal_pipe[2] = {-1, -1};

// Async-signal-safe: only write(2).
void OnSignal(int) {
  const char byte = 1;
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
}

// The whole file; NOT_FOUND when it cannot be read.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "tqkv-server: %s\n", what.c_str());
  return 1;
}

// Rewrites --kebab-case flag names to the --snake_case absl knows
// ("--metrics-port=9" -> "--metrics_port=9"); values, positional arguments
// and everything after "--" are left alone.
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    std::replace(arg.begin() + 2, arg.begin() + end, '-', '_');
  }
  return args;
}

// True when `args` (before any "--") holds one of `names`.
bool HasArg(const std::vector<std::string>& args, std::initializer_list<const char*> names) {
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    for (const char* name : names) {
      if (args[i] == name) return true;
    }
  }
  return false;
}

// `text` as lines of at most `width` characters (words longer than that stay
// whole), each starting with `indent`.
std::string Wrap(const std::string& text, size_t width, const std::string& indent) {
  std::string out, line;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, indent, line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, indent, line, "\n");
  return out;
}

// The --help text: this file's flags (absl's own --help lists only flags
// defined in a file named like the binary, which tqkv-server's are not),
// sorted, each with its help and default.
std::string Usage() {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && absl::StrContains(flag->Filename(), "server_main")) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) { return a->Name() < b->Name(); });
  std::string out = absl::StrCat(
      "usage: tqkv-server [flags]\n\n"
      "The tqkv KV-cache service: gRPC (tqkv.v1.KvCache, health, reflection) on --port,\n"
      "Prometheus metrics on --metrics_port. With no flags: the embedded default config\n"
      "(--print_default_config), gRPC on 127.0.0.1:50051 (0.0.0.0 with --auth_token_file),\n"
      "metrics on 127.0.0.1:9464.\n"
      "SIGINT/SIGTERM: exit 0 once the calls in flight are answered (--shutdown_grace_seconds)\n"
      "and the snapshot is written (--data_dir).\n\n"
      "flags (--name=value or --name value; --kebab-case spellings work too):\n");
  for (const absl::CommandLineFlag* flag : flags) {
    std::string default_value = flag->DefaultValue();
    if (flag->IsOfType<std::string>()) default_value = absl::StrCat("\"", default_value, "\"");
    absl::StrAppend(&out, "  --", flag->Name(), "\n",
                    Wrap(absl::StrCat(flag->Help(), " (default: ", default_value, ")"), 74, "      "));
  }
  absl::StrAppend(&out, "  --help\n      Print this help and exit.\n  --version\n      Print the version and exit.\n");
  return out;
}

// What to say when the CPU backend was taken because CUDA was not usable.
// With no NVIDIA device node at all, the CUDA runtime's reason ("CUDA driver
// version is insufficient for CUDA runtime version" where no driver is
// installed) is misleading: there is simply no GPU.
std::string WhyNotCuda(const std::string& why) {
  bool any_device = false;
  for (const char* node : {"/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"}) {
    if (access(node, F_OK) == 0) any_device = true;
  }
  if (!any_device) return "no GPU found (no /dev/nvidia* device); using the CPU backend";
  return "using the CPU backend; CUDA not usable: " + why;
}

}  // namespace

int main(int argc, char** argv) {
  tqkv::TuneMallocForLargeMessages();  // before any thread: see the header
  std::vector<std::string> args = NormalizeFlagNames(argc, argv);
  if (HasArg(args, {"--help", "-h", "--helpshort", "--helpfull", "-help"})) {
    std::fputs(Usage().c_str(), stdout);
    return 0;
  }
  if (HasArg(args, {"--version", "-version"})) {
    std::printf("tqkv-server %s\n", tqkv::VersionLine());
    return 0;
  }
  absl::SetProgramUsageMessage("tqkv-server [flags]; tqkv-server --help lists them");
  std::vector<char*> arg_pointers;
  for (std::string& arg : args) arg_pointers.push_back(arg.data());
  absl::ParseCommandLine(static_cast<int>(arg_pointers.size()), arg_pointers.data());
  if (absl::GetFlag(FLAGS_print_default_config)) {
    std::fputs(tqkv::service::DefaultServerConfigText(), stdout);
    return 0;
  }
  const double budget_gib = absl::GetFlag(FLAGS_memory_budget_gib);
  if (!(budget_gib > 0) || budget_gib > (1 << 20)) {
    return Fail("--memory_budget_gib must be in (0, 2^20]");
  }

  std::vector<std::string> config_warnings;
  absl::StatusOr<tqkv::v1::ServerConfig> config =
      tqkv::service::LoadServerConfig(absl::GetFlag(FLAGS_config), &config_warnings);
  if (!config.ok()) return Fail(config.status().ToString());
  for (const std::string& warning : config_warnings) std::fprintf(stderr, "tqkv-server: %s\n", warning.c_str());

  tqkv::service::ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.config = *std::move(config);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  options.cuda_tensor_cores = absl::GetFlag(FLAGS_cuda_tensor_cores);
  options.cpu_integer_attention = absl::GetFlag(FLAGS_cpu_integer_attention);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.executor.threads = absl::GetFlag(FLAGS_executor_threads);
  options.executor.max_pending = absl::GetFlag(FLAGS_max_pending_calls);
  const double pending_gib = absl::GetFlag(FLAGS_max_pending_gib);
  if (!(pending_gib > 0) || pending_gib > 1024) {
    return Fail("--max_pending_gib must be in (0, 1024]");
  }
  options.executor.max_pending_bytes = static_cast<size_t>(pending_gib * (uint64_t{1} << 30));
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.memory_budget_bytes = static_cast<uint64_t>(budget_gib * (uint64_t{1} << 30));
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.snapshot_interval_seconds = absl::GetFlag(FLAGS_snapshot_interval_seconds);

  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    absl::StatusOr<tqkv::service::AuthConfig> auth = tqkv::service::LoadAuthConfig(path);
    if (!auth.ok()) return Fail("--auth_token_file: " + auth.status().ToString());
    options.auth = *std::move(auth);
  }
  const std::string cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  const std::string key_file = absl::GetFlag(FLAGS_tls_key_file);
  if (cert_file.empty() != key_file.empty()) {
    return Fail("--tls_cert_file and --tls_key_file go together: give both or neither");
  }
  if (!cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadFile(cert_file);
    if (!cert.ok()) return Fail("--tls_cert_file: " + cert.status().ToString());
    absl::StatusOr<std::string> key = ReadFile(key_file);
    if (!key.ok()) return Fail("--tls_key_file: " + key.status().ToString());
    options.tls_cert_chain_pem = *std::move(cert);
    options.tls_private_key_pem = *std::move(key);
  }

  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return Fail("cannot create the signal pipe");
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  absl::StatusOr<std::unique_ptr<tqkv::service::Server>> server = tqkv::service::Server::Start(options);
  if (!server.ok()) return Fail(server.status().ToString());
  tqkv::service::Server& s = **server;
  if (!s.why_not_cuda().empty()) {
    std::fprintf(stderr, "tqkv-server: %s\n", WhyNotCuda(s.why_not_cuda()).c_str());
  }
  std::string auth;
  if (options.auth.enabled()) {
    auth = options.auth.tenants.empty()
               ? ", bearer-token auth"
               : absl::StrCat(", bearer-token auth, ", options.auth.tenants.size(), " tenants");
  }
  std::printf("tqkv-server listening on %s:%d (metrics %d), backend %s (%s)%s%s\n", s.host().c_str(), s.port(),
              s.metrics_port(), s.backend().name().c_str(), s.backend().device().c_str(),
              options.tls_cert_chain_pem.empty() ? "" : ", TLS", auth.c_str());
  std::fflush(stdout);
  if (const std::string warning = tqkv::service::OpenAccessWarning(options, s.port()); !warning.empty()) {
    std::fprintf(stderr, "%s\n", warning.c_str());
  }

  // Wait for a signal; meanwhile drop sequences past their idle TTL.
  for (;;) {
    pollfd fd = {g_signal_pipe[0], POLLIN, 0};
    const int ready = poll(&fd, 1, /*timeout_ms=*/1000);
    if (ready > 0) break;
    if (ready < 0 && errno != EINTR) break;
    s.service().EvictExpired();
  }
  std::printf("tqkv-server: shutting down\n");
  std::fflush(stdout);
  s.Shutdown(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds)));
  s.Wait();
  server->reset();
  return 0;
}
