#include "client/cli/decode_load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/cli/load_common.h"
#include "base/random.h"

namespace tqkv {
namespace cli {
namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  int layers = 0;
  int kv_heads = 0;
  int query_heads = 0;
  int head_dim = 0;
};

// Summed kernel seconds (every kernel the server times).
double KernelSeconds(const v1::ServerInfo& info) {
  double total = 0;
  for (const v1::TimingTotal& t : info.kernel_timings()) total += t.seconds();
  return total;
}

// Summed handler seconds of the calls a decode step makes.
double DecodeHandlerSeconds(const v1::ServerInfo& info) {
  double total = 0;
  for (const v1::TimingTotal& t : info.rpc_timings()) {
    if (t.name() == "Append" || t.name() == "Attend" || t.name() == "AppendAttend" || t.name() == "DecodeStreamStep") {
      total += t.seconds();
    }
  }
  return total;
}

// What one variant's engines share.
struct Run {
  const DecodeLoadOptions* options = nullptr;
  Shape shape;
  DecodeVariant variant = DecodeVariant::kUnary;
  std::string tag;
  Clock::time_point deadline = Clock::time_point::max();
  std::atomic<int64_t> steps_done{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> messages{0};
  std::atomic<int64_t> errors{0};
  absl::Mutex mu;
  std::string first_error ABSL_GUARDED_BY(mu);
  std::vector<double> step_seconds ABSL_GUARDED_BY(mu);

  void Error(const absl::Status& status, const char* what) {
    errors.fetch_add(1);
    absl::MutexLock lock(&mu);
    if (first_error.empty()) first_error = absl::StrCat(what, ": ", status.ToString());
  }
};

// One engine: its batch of sequences, their data and positions.
class Engine {
 public:
  Engine(Run* run, Client* client, int index)
      : run_(run), client_(client), random_(DeriveSeed(run->options->seed, static_cast<uint64_t>(index))) {
    const DecodeLoadOptions& o = *run_->options;
    const Shape& s = run_->shape;
    for (int i = 0; i < o.batch; ++i) {
      ids_.push_back(absl::StrCat("decode-", run_->tag, "-e", index, "/s", i));
    }
    const int64_t chunk = std::min(o.context, o.prefill_chunk_tokens);
    const int64_t largest =
        std::max<int64_t>({int64_t{s.layers} * chunk * s.kv_heads * s.head_dim, int64_t{s.query_heads} * s.head_dim});
    pool_.resize(static_cast<size_t>(2 * largest + 1));
    for (float& x : pool_) x = static_cast<float>(random_.NextGaussian());
  }

  // Prefills every sequence with options.context tokens of all layers.
  absl::Status Prefill() {
    const DecodeLoadOptions& o = *run_->options;
    const Shape& s = run_->shape;
    // Chunks stay under 16 MiB, far below gRPC's message bound.
    const int64_t token_bytes =
        int64_t{2} * s.layers * s.kv_heads * s.head_dim * (o.wire_dtype == v1::DTYPE_F32 ? 4 : 2);
    const int64_t chunk_tokens =
        std::max<int64_t>(1, std::min(o.prefill_chunk_tokens, (int64_t{16} << 20) / token_bytes));
    for (const std::string& id : ids_) {
      if (o.context == 0) break;
      std::vector<AppendArgs> chunks;
      for (int64_t t = 0; t < o.context; t += chunk_tokens) {
        const int64_t n = std::min(chunk_tokens, o.context - t);
        AppendArgs a;
        a.cache = o.cache;
        a.sequence_id = id;
        a.start_position = t;
        a.layer_begin = 0;
        a.layer_end = s.layers;
        a.shape = {s.layers, n, s.kv_heads, s.head_dim};
        a.keys = Window(int64_t{s.layers} * n * s.kv_heads * s.head_dim);
        a.values = Window(int64_t{s.layers} * n * s.kv_heads * s.head_dim);
        a.wire_dtype = o.wire_dtype;
        chunks.push_back(a);
      }
      absl::StatusOr<AppendResult> r = client_->AppendStream(chunks);
      if (!r.ok()) return r.status();
    }
    length_ = o.context;
    return absl::OkStatus();
  }

  void Decode() {
    const DecodeLoadOptions& o = *run_->options;
    std::unique_ptr<DecodeStream> stream;
    if (run_->variant == DecodeVariant::kStream) stream = client_->OpenDecodeStream(ids_[0]);
    std::vector<double> steps;
    for (int64_t step = 0; step < o.steps && Clock::now() < run_->deadline; ++step) {
      const Clock::time_point start = Clock::now();
      bool ok = true;
      for (int layer = 0; ok && layer < run_->shape.layers; ++layer) ok = Layer(layer, stream.get());
      if (!ok) break;
      steps.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      ++length_;
      run_->steps_done.fetch_add(1);
    }
    if (stream != nullptr) {
      if (absl::Status s = stream->Close(); !s.ok()) run_->Error(s, "DecodeStream close");
    }
    absl::MutexLock lock(&run_->mu);
    run_->step_seconds.insert(run_->step_seconds.end(), steps.begin(), steps.end());
  }

  void Drop() {
    for (const std::string& id : ids_) {
      absl::Status s = client_->DropSequence(run_->options->cache, id);
      if (!s.ok() && !absl::IsNotFound(s)) run_->Error(s, "DropSequence");
    }
  }

 private:
  absl::Span<const float> Window(int64_t n) {
    const uint64_t offset = random_.NextBelow(pool_.size() - static_cast<size_t>(n) + 1);
    return absl::MakeConstSpan(pool_.data() + offset, static_cast<size_t>(n));
  }

  // One layer of the step for the whole batch; false on an error.
  bool Layer(int layer, DecodeStream* stream) {
    const DecodeLoadOptions& o = *run_->options;
    const Shape& s = run_->shape;
    const int64_t kv = int64_t{s.kv_heads} * s.head_dim;
    const int64_t q = int64_t{s.query_heads} * s.head_dim;
    if (run_->variant == DecodeVariant::kUnary) {
      for (const std::string& id : ids_) {
        AppendArgs a;
        a.cache = o.cache;
        a.sequence_id = id;
        a.start_position = length_;
        a.layer_begin = layer;
        a.layer_end = layer + 1;
        a.shape = {1, 1, s.kv_heads, s.head_dim};
        a.keys = Window(kv);
        a.values = Window(kv);
        a.wire_dtype = o.wire_dtype;
        run_->calls.fetch_add(1);
        if (absl::StatusOr<AppendResult> r = client_->Append(a); !r.ok()) {
          run_->Error(r.status(), "Append");
          return false;
        }
      }
      AttendArgs attend;
      attend.cache = o.cache;
      attend.output_dtype = o.wire_dtype;
      for (const std::string& id : ids_) {
        attend.items.push_back({id, layer, {1, s.query_heads, s.head_dim}, Window(q)});
      }
      run_->calls.fetch_add(1);
      if (absl::StatusOr<std::vector<AttendOutput>> r = client_->Attend(attend); !r.ok()) {
        run_->Error(r.status(), "Attend");
        return false;
      }
      return true;
    }
    AppendAttendArgs args;
    args.cache = o.cache;
    args.layer = layer;
    args.wire_dtype = o.wire_dtype;
    args.output_dtype = o.wire_dtype;
    for (const std::string& id : ids_) {
      AppendAttendItemArgs item;
      item.sequence_id = id;
      item.start_position = length_;
      item.kv_shape = {1, s.kv_heads, s.head_dim};
      item.query_shape = {1, s.query_heads, s.head_dim};
      item.keys = Window(kv);
      item.values = Window(kv);
      item.queries = Window(q);
      args.items.push_back(item);
    }
    absl::StatusOr<AppendAttendResult> r;
    if (stream != nullptr) {
      run_->messages.fetch_add(1);
      r = stream->Step(args);
    } else {
      run_->calls.fetch_add(1);
      r = client_->AppendAttend(args);
    }
    const char* what = stream != nullptr ? "DecodeStream" : "AppendAttend";
    if (!r.ok()) {
      run_->Error(r.status(), what);
      return false;
    }
    for (const AppendAttendItemResult& item : r->items) {
      if (!item.status.ok()) {
        run_->Error(item.status, what);
        return false;
      }
    }
    return true;
  }

  Run* const run_;
  Client* const client_;
  Random random_;
  std::vector<std::string> ids_;
  std::vector<float> pool_;
  int64_t length_ = 0;
};

// Runs `work(engine)` on one thread per engine; progress while they run.
template <typename Work>
void OnEveryEngine(Run& run, std::vector<std::unique_ptr<Engine>>& engines, const char* phase, Work work) {
  std::atomic<int> running{static_cast<int>(engines.size())};
  std::vector<std::thread> threads;
  for (auto& e : engines) {
    threads.emplace_back([&running, &work, e = e.get()] {
      work(*e);
      running.fetch_sub(1);
    });
  }
  absl::Time next = absl::Now() + absl::Seconds(1);
  while (running.load() > 0) {
    absl::SleepFor(absl::Milliseconds(5));
    if (run.options->progress && absl::Now() >= next) {
      run.options->progress(run.variant, phase, run.steps_done.load());
      next += absl::Seconds(1);
    }
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace

const char* DecodeVariantName(DecodeVariant variant) {
  switch (variant) {
    case DecodeVariant::kUnary:
      return "unary";
    case DecodeVariant::kFused:
      return "fused";
    case DecodeVariant::kStream:
      return "stream";
  }
  return "?";
}

absl::StatusOr<std::vector<DecodeVariant>> ParseDecodeVariants(const std::string& list) {
  std::vector<DecodeVariant> out;
  for (absl::string_view name : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    if (name == "unary") {
      out.push_back(DecodeVariant::kUnary);
    } else if (name == "fused") {
      out.push_back(DecodeVariant::kFused);
    } else if (name == "stream") {
      out.push_back(DecodeVariant::kStream);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown variant '", name, "'; want unary, fused or stream"));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("no variant given; want unary,fused,stream");
  return out;
}

absl::StatusOr<DecodeLoadReport> RunDecodeLoad(const DecodeLoadOptions& options) {
  if (options.clients < 1 || options.clients > 1024) {
    return absl::InvalidArgumentError("clients must be in [1, 1024]");
  }
  if (options.batch < 1 || options.batch > 4096) {
    return absl::InvalidArgumentError("batch must be in [1, 4096]");
  }
  if (options.context < 0 || options.steps < 1 || options.prefill_chunk_tokens < 1 ||
      options.max_seconds_per_variant < 0 || options.variants.empty()) {
    return absl::InvalidArgumentError(
        "context must be >= 0, steps and prefill_chunk_tokens >= 1, max_seconds_per_variant "
        ">= 0, and at least one variant");
  }
  ClientOptions client_options = options.client;
  client_options.max_attempts = 1;
  Client client(client_options);
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  const v1::CacheInfo* cache = FindCache(*info, options.cache);
  if (cache == nullptr) {
    return absl::NotFoundError(absl::StrCat("the server has no cache '", options.cache, "'"));
  }
  Shape shape{cache->config().num_layers(), cache->config().num_kv_heads(), cache->config().num_query_heads(),
              cache->config().head_dim()};
  if (options.layers < 0 || options.layers > shape.layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers must be in [0, ", shape.layers, "] for this cache"));
  }
  if (options.layers > 0) shape.layers = options.layers;

  DecodeLoadReport report;
  report.layers = shape.layers;
  report.kv_heads = shape.kv_heads;
  report.query_heads = shape.query_heads;
  report.head_dim = shape.head_dim;
  const std::string run_tag = absl::StrCat(absl::ToUnixNanos(absl::Now()) % 1000000000, "-", options.seed);
  for (const DecodeVariant variant : options.variants) {
    Run run;
    run.options = &options;
    run.shape = shape;
    run.variant = variant;
    run.tag = absl::StrCat(run_tag, "-", DecodeVariantName(variant));
    std::vector<std::unique_ptr<Engine>> engines;
    for (int i = 0; i < options.clients; ++i) {
      engines.push_back(std::make_unique<Engine>(&run, &client, i));
    }
    absl::Mutex prefill_mu;
    absl::Status prefill_status;
    OnEveryEngine(run, engines, "prefill", [&](Engine& e) {
      absl::Status s = e.Prefill();
      absl::MutexLock lock(&prefill_mu);
      if (!s.ok() && prefill_status.ok()) prefill_status = s;
    });
    if (!prefill_status.ok()) {
      for (auto& e : engines) e->Drop();
      return absl::Status(prefill_status.code(), absl::StrCat("prefill: ", prefill_status.message()));
    }
    absl::StatusOr<v1::ServerInfo> before = client.GetServerInfo();
    if (options.max_seconds_per_variant > 0) {
      run.deadline =
          Clock::now() + std::chrono::microseconds(static_cast<int64_t>(options.max_seconds_per_variant * 1e6));
    }
    const Clock::time_point start = Clock::now();
    OnEveryEngine(run, engines, "decode", [](Engine& e) { e.Decode(); });
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    absl::StatusOr<v1::ServerInfo> after = client.GetServerInfo();
    for (auto& e : engines) e->Drop();

    DecodeVariantReport r;
    r.variant = variant;
    r.steps = run.steps_done.load();
    r.errors = run.errors.load();
    {
      absl::MutexLock lock(&run.mu);
      r.first_error = run.first_error;
      std::sort(run.step_seconds.begin(), run.step_seconds.end());
      r.step_p50_ms = 1e3 * Percentile(run.step_seconds, 0.50);
      r.step_p99_ms = 1e3 * Percentile(run.step_seconds, 0.99);
      double sum = 0;
      for (double s : run.step_seconds) sum += s;
      r.step_mean_ms = run.step_seconds.empty() ? 0 : 1e3 * sum / run.step_seconds.size();
    }
    if (r.steps > 0) {
      r.rpcs_per_step = static_cast<double>(run.calls.load()) / r.steps;
      r.messages_per_step = static_cast<double>(run.messages.load()) / r.steps;
      r.tokens_per_second_per_sequence = static_cast<double>(r.steps) / options.clients / wall;
      r.tokens_per_second = static_cast<double>(r.steps) * options.batch / wall;
      if (before.ok() && after.ok() && after->kernel_timings_size() > 0) {
        const double kernels = KernelSeconds(*after) - KernelSeconds(*before);
        r.kernel_ms_per_step = 1e3 * kernels / r.steps;
        r.kernel_share = r.step_mean_ms > 0 ? r.kernel_ms_per_step / r.step_mean_ms : -1;
        r.outside_us_per_layer = 1e3 * std::max(0.0, r.step_mean_ms - r.kernel_ms_per_step) / shape.layers;
        const double handlers = DecodeHandlerSeconds(*after) - DecodeHandlerSeconds(*before);
        const double handler_ms_per_step = 1e3 * handlers / r.steps;
        r.server_us_per_layer = 1e3 * std::max(0.0, handler_ms_per_step - r.kernel_ms_per_step) / shape.layers;
        r.transport_us_per_layer = 1e3 * std::max(0.0, r.step_mean_ms - handler_ms_per_step) / shape.layers;
      }
    }
    report.variants.push_back(std::move(r));
  }
  return report;
}

}  // namespace cli
}  // namespace tqkv
