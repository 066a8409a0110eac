#include "client/cli/load_generator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/cli/load_common.h"
#include "base/random.h"

namespace tqkv {
namespace cli {
namespace {

enum Method { kAppend, kAppendStream, kAttend, kScoreQuery, kDropSequence, kNumMethods };
constexpr const char* kMethodNames[kNumMethods] = {"Append", "AppendStream", "Attend", "ScoreQuery", "DropSequence"};

struct Layout {
  int layers = 0;
  int kv_heads = 0;
  int query_heads = 0;
  int head_dim = 0;
};

// What every client shares: the stop condition and the counters.
struct Shared {
  const LoadOptions* options = nullptr;
  Layout layout;
  std::string run_tag;
  absl::Time deadline;
  std::atomic<bool> stop{false};
  // Since when (steady clock, ns) every call has failed with UNAVAILABLE; 0
  // while the server answers.
  std::atomic<int64_t> unavailable_since_ns{0};
  std::atomic<bool> lost{false};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int64_t> tokens{0};
  absl::Mutex mu;
  std::string first_error ABSL_GUARDED_BY(mu);
  absl::Status server_lost ABSL_GUARDED_BY(mu);
  // Latencies (seconds) and error counts, merged from the clients at the end.
  std::vector<double> latencies[kNumMethods] ABSL_GUARDED_BY(mu);
  int64_t method_errors[kNumMethods] ABSL_GUARDED_BY(mu) = {};
};

class LoadClient {
 public:
  LoadClient(Shared* shared, Client* client, int index)
      : shared_(shared), client_(client), index_(index),
        random_(DeriveSeed(shared->options->seed, static_cast<uint64_t>(index))) {
    const Layout& l = shared_->layout;
    const LoadOptions& o = *shared_->options;
    const int64_t chunk = std::min(o.prefill_tokens, o.prefill_chunk_tokens);
    const int64_t largest =
        std::max<int64_t>({int64_t{l.layers} * chunk * l.kv_heads * l.head_dim,
                           int64_t{l.layers} * l.kv_heads * l.head_dim, int64_t{l.query_heads} * l.head_dim});
    // Twice the largest tensor: every tensor is a window at a random offset.
    pool_.resize(static_cast<size_t>(2 * largest));
    for (float& x : pool_) x = static_cast<float>(random_.NextGaussian());
  }

  void Run() {
    const LoadOptions& o = *shared_->options;
    for (int64_t n = 0; o.sequences_per_client == 0 || n < o.sequences_per_client; ++n) {
      if (Stopped()) break;
      PlaySequence(absl::StrCat("load-", shared_->run_tag, "-c", index_, "-s", n));
    }
    absl::MutexLock lock(&shared_->mu);
    for (int m = 0; m < kNumMethods; ++m) {
      shared_->latencies[m].insert(shared_->latencies[m].end(), latencies_[m].begin(), latencies_[m].end());
      shared_->method_errors[m] += errors_[m];
    }
  }

 private:
  bool Stopped() {
    if (shared_->stop.load(std::memory_order_relaxed)) return true;
    const LoadOptions& o = *shared_->options;
    if ((o.requests > 0 && shared_->calls.load(std::memory_order_relaxed) >= o.requests) ||
        (o.duration_seconds > 0 && absl::Now() >= shared_->deadline)) {
      shared_->stop.store(true);
      return true;
    }
    return false;
  }

  absl::Span<const float> Window(int64_t n) {
    const uint64_t offset = random_.NextBelow(pool_.size() - static_cast<size_t>(n) + 1);
    return absl::MakeConstSpan(pool_.data() + offset, static_cast<size_t>(n));
  }

  // Times `call` (which returns a status) as one call of `method`; true on OK.
  template <typename F>
  bool Call(Method method, F call) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status status = call();
    latencies_[method].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    shared_->calls.fetch_add(1, std::memory_order_relaxed);
    if (status.ok()) {
      backoff_ = absl::ZeroDuration();
      shared_->unavailable_since_ns.store(0, std::memory_order_relaxed);
      return true;
    }
    ++errors_[method];
    shared_->errors.fetch_add(1, std::memory_order_relaxed);
    {
      absl::MutexLock lock(&shared_->mu);
      if (shared_->first_error.empty()) {
        shared_->first_error = absl::StrCat(kMethodNames[method], ": ", status.ToString());
      }
    }
    if (absl::IsUnavailable(status)) BackOff(status);
    return false;
  }

  // After an UNAVAILABLE: stops the run when the server has answered nothing
  // for give_up_seconds, else waits (50 ms doubling to 1 s) before the next
  // call, waking early when the run stops.
  void BackOff(const absl::Status& status) {
    const int64_t now =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    int64_t since = 0;
    if (!shared_->unavailable_since_ns.compare_exchange_strong(since, now)) {
      if (now - since >= static_cast<int64_t>(shared_->options->give_up_seconds * 1e9)) {
        absl::MutexLock lock(&shared_->mu);
        if (!shared_->lost.exchange(true)) shared_->server_lost = status;
        shared_->stop.store(true);
        return;
      }
    }
    backoff_ = backoff_ == absl::ZeroDuration() ? absl::Milliseconds(50) : std::min(2 * backoff_, absl::Seconds(1));
    const absl::Time until = absl::Now() + backoff_;
    while (!Stopped() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  }

  AppendArgs MakeAppend(const std::string& id, int64_t start, int64_t tokens) {
    const Layout& l = shared_->layout;
    AppendArgs a;
    a.cache = shared_->options->cache;
    a.sequence_id = id;
    a.start_position = start;
    a.layer_begin = 0;
    a.layer_end = l.layers;
    a.shape = {l.layers, tokens, l.kv_heads, l.head_dim};
    const int64_t n = int64_t{l.layers} * tokens * l.kv_heads * l.head_dim;
    a.keys = Window(n);
    a.values = Window(n);
    return a;
  }

  void PlaySequence(const std::string& id) {
    const LoadOptions& o = *shared_->options;
    const Layout& l = shared_->layout;
    int64_t length = 0;
    bool ok = true;
    if (o.prefill_tokens > 0) {
      if (o.prefill_tokens <= o.prefill_chunk_tokens) {
        const AppendArgs a = MakeAppend(id, 0, o.prefill_tokens);
        ok = Call(kAppend, [&] { return client_->Append(a).status(); });
      } else {
        std::vector<AppendArgs> chunks;
        for (int64_t t = 0; t < o.prefill_tokens; t += o.prefill_chunk_tokens) {
          chunks.push_back(MakeAppend(id, t, std::min(o.prefill_chunk_tokens, o.prefill_tokens - t)));
        }
        ok = Call(kAppendStream, [&] { return client_->AppendStream(chunks).status(); });
      }
      if (ok) {
        length = o.prefill_tokens;
        shared_->tokens.fetch_add(o.prefill_tokens, std::memory_order_relaxed);
      }
    }
    for (int64_t step = 0; ok && step < o.decode_steps && !Stopped(); ++step) {
      const AppendArgs a = MakeAppend(id, length, 1);
      ok = Call(kAppend, [&] { return client_->Append(a).status(); });
      if (!ok) break;
      ++length;
      shared_->tokens.fetch_add(1, std::memory_order_relaxed);
      AttendArgs attend;
      attend.cache = o.cache;
      for (int layer = 0; layer < l.layers; ++layer) {
        AttendItemArgs item;
        item.sequence_id = id;
        item.layer = layer;
        item.shape = {1, l.query_heads, l.head_dim};
        item.queries = Window(int64_t{l.query_heads} * l.head_dim);
        attend.items.push_back(item);
      }
      ok = Call(kAttend, [&] { return client_->Attend(attend).status(); });
      if (ok && o.score_every > 0 && (step + 1) % o.score_every == 0) {
        ScoreArgs score;
        score.cache = o.cache;
        score.sequence_id = id;
        score.layer = static_cast<int>(random_.NextBelow(static_cast<uint64_t>(l.layers)));
        score.shape = {l.query_heads, l.head_dim};
        score.queries = Window(int64_t{l.query_heads} * l.head_dim);
        score.top_k = o.top_k;
        ok = Call(kScoreQuery, [&] { return client_->Score(score).status(); });
      }
    }
    // Always clean up, even after a stop or an error (a failed prefill may
    // have created nothing: NOT_FOUND then is not an error of the run);
    // except when the server is gone.
    if (shared_->lost.load()) return;
    const auto start = std::chrono::steady_clock::now();
    const absl::Status dropped = client_->DropSequence(o.cache, id);
    if (length > 0 || dropped.code() != absl::StatusCode::kNotFound) {
      latencies_[kDropSequence].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      shared_->calls.fetch_add(1, std::memory_order_relaxed);
      if (!dropped.ok()) {
        ++errors_[kDropSequence];
        shared_->errors.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  Shared* const shared_;
  Client* const client_;
  const int index_;
  Random random_;
  std::vector<float> pool_;
  std::vector<double> latencies_[kNumMethods];
  int64_t errors_[kNumMethods] = {};
  absl::Duration backoff_ = absl::ZeroDuration();  // the wait after the last UNAVAILABLE
};

// name -> (calls, seconds)
std::map<std::string, std::pair<int64_t, double>> Timings(
    const google::protobuf::RepeatedPtrField<v1::TimingTotal>& totals) {
  std::map<std::string, std::pair<int64_t, double>> out;
  for (const v1::TimingTotal& t : totals) out[t.name()] = {t.calls(), t.seconds()};
  return out;
}

}  // namespace

absl::StatusOr<LoadReport> RunLoad(const LoadOptions& options) {
  if (options.clients < 1 || options.clients > 1024) {
    return absl::InvalidArgumentError("clients must be in [1, 1024]");
  }
  if (!(options.duration_seconds > 0) && options.requests <= 0) {
    return absl::InvalidArgumentError("give a duration or a request count: the run must end");
  }
  if (!(options.give_up_seconds > 0) || options.give_up_seconds > 86400) {
    return absl::InvalidArgumentError("give_up_seconds must be in (0, 86400]");
  }
  if (options.prefill_tokens < 0 || options.decode_steps < 0 || options.prefill_chunk_tokens < 1 ||
      options.sequences_per_client < 0 || options.score_every < 0 || options.top_k < 1) {
    return absl::InvalidArgumentError(
        "prefill_tokens, decode_steps, sequences_per_client and score_every must be >= 0; "
        "prefill_chunk_tokens and top_k >= 1");
  }
  ClientOptions client_options = options.client;
  client_options.max_attempts = 1;
  Client client(client_options);
  absl::StatusOr<v1::ServerInfo> before = client.GetServerInfo();
  if (!before.ok()) return before.status();
  const v1::CacheInfo* cache = FindCache(*before, options.cache);
  if (cache == nullptr) {
    return absl::NotFoundError(absl::StrCat("the server has no cache '", options.cache, "'"));
  }
  Shared shared;
  shared.options = &options;
  shared.layout = {cache->config().num_layers(), cache->config().num_kv_heads(), cache->config().num_query_heads(),
                   cache->config().head_dim()};
  if (options.layers < 0 || options.layers > shared.layout.layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers must be in [0, ", shared.layout.layers, "] for this cache"));
  }
  if (options.layers > 0) shared.layout.layers = options.layers;
  shared.run_tag = absl::StrCat(absl::ToUnixNanos(absl::Now()) % 1000000000, "-", options.seed);

  const absl::Time start = absl::Now();
  shared.deadline =
      options.duration_seconds > 0 ? start + absl::Seconds(options.duration_seconds) : absl::InfiniteFuture();
  std::vector<std::unique_ptr<LoadClient>> load_clients;
  for (int i = 0; i < options.clients; ++i) {
    load_clients.push_back(std::make_unique<LoadClient>(&shared, &client, i));
  }
  std::atomic<int> running{options.clients};
  std::vector<std::thread> threads;
  for (auto& c : load_clients) {
    threads.emplace_back([&running, c = c.get()] {
      c->Run();
      running.fetch_sub(1);
    });
  }
  // Progress once a second, until every client is done.
  absl::Time next = start + absl::Seconds(1);
  while (running.load() > 0) {
    absl::SleepFor(absl::Milliseconds(20));
    if (options.progress && absl::Now() >= next) {
      options.progress(absl::ToDoubleSeconds(absl::Now() - start), shared.calls.load(), shared.errors.load());
      next += absl::Seconds(1);
    }
  }
  for (std::thread& t : threads) t.join();

  LoadReport report;
  report.elapsed_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  report.calls = shared.calls.load();
  report.errors = shared.errors.load();
  report.tokens_appended = shared.tokens.load();
  {
    absl::MutexLock lock(&shared.mu);
    report.first_error = shared.first_error;
    report.server_lost = shared.server_lost;
    for (int m = 0; m < kNumMethods; ++m) {
      std::vector<double>& l = shared.latencies[m];
      if (l.empty()) continue;
      std::sort(l.begin(), l.end());
      MethodStats s;
      s.method = kMethodNames[m];
      s.calls = static_cast<int64_t>(l.size());
      s.errors = shared.method_errors[m];
      s.calls_per_second = report.elapsed_seconds > 0 ? s.calls / report.elapsed_seconds : 0;
      s.p50_ms = 1e3 * Percentile(l, 0.50);
      s.p99_ms = 1e3 * Percentile(l, 0.99);
      report.methods.push_back(s);
    }
  }
  absl::StatusOr<v1::ServerInfo> after = client.GetServerInfo();
  if (after.ok() && after->rpc_timings_size() > 0) {
    auto rpc0 = Timings(before->rpc_timings()), rpc1 = Timings(after->rpc_timings());
    auto k0 = Timings(before->kernel_timings()), k1 = Timings(after->kernel_timings());
    report.server_attend_seconds = rpc1["Attend"].second - rpc0["Attend"].second;
    const double kernel = k1["attend"].second - k0["attend"].second;
    if (report.server_attend_seconds > 0) {
      report.attend_kernel_share = kernel / report.server_attend_seconds;
    }
  }
  return report;
}

}  // namespace cli
}  // namespace tqkv
