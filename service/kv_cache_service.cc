#include "service/kv_cache_service.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/preset.h"
#include "kernels/status_macros.h"
#include "service/config.h"
#include "service/status_util.h"
#include "service/tensor_codec.h"

#ifndef TQKV_VERSION
#define TQKV_VERSION "unknown"
#endif

namespace tqkv {
namespace service {
namespace {

absl::Status CheckId(const std::string& id, const char* field) {
  if (id.empty() || id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is %d bytes; want 1..%d bytes", field, id.size(), kMaxSequenceIdBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckLayer(int layer, const KvLayout& layout, const char* what) {
  if (layer < 0 || layer >= layout.num_layers()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s %d is outside the cache's %d layers; want [0, %d)", what, layer,
        layout.num_layers(), layout.num_layers()));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputDType(v1::DType dtype) {
  if (dtype != v1::DTYPE_UNSPECIFIED && DTypeBytes(dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "output_dtype %d is unknown; want DTYPE_F32 (or unspecified), DTYPE_F16 or DTYPE_BF16",
        static_cast<int>(dtype)));
  }
  return absl::OkStatus();
}

void ToProto(const std::string& cache, const SequenceInfo& in, v1::SequenceInfo* out) {
  out->set_cache(cache);
  out->set_sequence_id(in.id);
  out->clear_layer_tokens();
  for (int64_t t : in.layer_tokens) out->add_layer_tokens(t);
  out->set_pages(in.pages);
}

using Clock = std::chrono::steady_clock;

grpc::Status Record(Metrics* metrics, Rpc rpc, Clock::time_point start, grpc::Status status) {
  if (metrics != nullptr) {
    metrics->ObserveRpc(rpc, status.error_code(),
                        std::chrono::duration<double>(Clock::now() - start).count());
  }
  return status;
}

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, Metrics* metrics,
                                      Rpc rpc, Clock::time_point start,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(Record(metrics, rpc, start, ToGrpcStatus(status)));
  return reactor;
}

// A long prefill in chunks: every chunk is one Append, stored as it arrives.
class AppendStreamReactor : public grpc::ServerReadReactor<v1::AppendRequest> {
 public:
  // `auth`: the call's authentication; when not OK the stream ends with it
  // before any chunk is read.
  AppendStreamReactor(KvCacheService* service, v1::AppendResponse* response,
                      const absl::Status& auth)
      : service_(service), response_(response), start_(Clock::now()) {
    if (!auth.ok()) {
      Finish(ToGrpcStatus(auth));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or the call is gone)
      if (chunks_ == 0) {
        Finish(ToGrpcStatus(absl::InvalidArgumentError(
            "AppendStream carried no AppendRequest; want at least one chunk")));
      } else {
        response_->set_stored_bytes(stored_bytes_);
        response_->set_stored_bytes_bf16(stored_bytes_bf16_);
        Finish(grpc::Status::OK);
      }
      return;
    }
    if (chunks_ > 0 && (request_.cache() != cache_ || request_.sequence_id() != sequence_id_)) {
      Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrFormat(
          "chunk %d is for cache '%s' sequence '%s'; want the stream's cache '%s' sequence '%s'",
          chunks_, request_.cache(), request_.sequence_id(), cache_, sequence_id_))));
      return;
    }
    v1::AppendResponse chunk;
    const absl::Status status = service_->DoAppend(request_, &chunk);
    if (!status.ok()) {
      Finish(ToGrpcStatus(
          absl::Status(status.code(), absl::StrCat("chunk ", chunks_, ": ", status.message()))));
      return;
    }
    if (chunks_ == 0) {
      cache_ = request_.cache();
      sequence_id_ = request_.sequence_id();
    }
    ++chunks_;
    stored_bytes_ += chunk.stored_bytes();
    stored_bytes_bf16_ += chunk.stored_bytes_bf16();
    *response_->mutable_sequence() = std::move(*chunk.mutable_sequence());
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void Finish(grpc::Status status) {
    grpc::ServerReadReactor<v1::AppendRequest>::Finish(
        Record(service_->metrics(), Rpc::kAppendStream, start_, std::move(status)));
  }

  KvCacheService* const service_;
  v1::AppendResponse* const response_;
  v1::AppendRequest request_;
  std::string cache_;
  std::string sequence_id_;
  int chunks_ = 0;
  int64_t stored_bytes_ = 0;
  int64_t stored_bytes_bf16_ = 0;
  const Clock::time_point start_;
};

}  // namespace

KvCacheService::KvCacheService(std::vector<std::unique_ptr<KvCache>> caches, Backend* backend,
                               Metrics* metrics, Authenticator auth)
    : backend_(backend), metrics_(metrics), auth_(std::move(auth)) {
  for (auto& cache : caches) {
    order_.push_back(cache.get());
    const std::string name = cache->options().name;
    caches_.emplace(name, std::move(cache));
  }
}

KvCacheService::~KvCacheService() = default;

absl::StatusOr<KvCache*> KvCacheService::Find(const std::string& name) const {
  if (name.empty()) {
    auto it = caches_.find("default");
    if (it != caches_.end()) return it->second.get();
    if (!order_.empty()) return order_.front();
  }
  auto it = caches_.find(name);
  if (it == caches_.end()) {
    std::vector<std::string> names;
    for (const KvCache* c : order_) names.push_back(c->options().name);
    return absl::NotFoundError(absl::StrFormat("cache '%s' not found; this server has: %s", name,
                                               absl::StrJoin(names, ", ")));
  }
  return it->second.get();
}

int KvCacheService::EvictExpired() {
  int dropped = 0;
  for (KvCache* cache : order_) dropped += cache->EvictExpired();
  return dropped;
}

absl::Status KvCacheService::FillSequenceInfo(KvCache& cache, const std::string& id,
                                              v1::SequenceInfo* info) {
  ASSIGN_OR_RETURN(SequenceInfo seq, cache.GetSequence(id));
  ToProto(cache.options().name, seq, info);
  return absl::OkStatus();
}

absl::Status KvCacheService::DoAppend(const v1::AppendRequest& request,
                                      v1::AppendResponse* response) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  const KvLayout& layout = cache->layout();
  const int layers = layout.num_layers();
  const int layer_begin = request.layer_begin();
  const int layer_end = request.layer_end() == 0 ? layers : request.layer_end();
  if (layer_begin < 0 || layer_begin >= layer_end || layer_end > layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer range [%d, %d) is not inside the cache's %d layers; want 0 <= layer_begin < "
        "layer_end <= %d (layer_end 0 means %d)",
        layer_begin, request.layer_end(), layers, layers, layers));
  }
  if (request.start_position() < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "start_position is %d; want the sequence's current length (>= 0)",
        request.start_position()));
  }
  const Axis axes[] = {{"layers", layer_end - layer_begin},
                       {"tokens", Axis::kAnySize},
                       {"kv_heads", layout.num_kv_heads()},
                       {"head_dim", layout.head_dim()}};
  std::vector<float> keys, values;
  std::vector<int64_t> shape;
  RETURN_IF_ERROR(DecodeTensor(request.keys(), "keys", axes, &keys, &shape));
  const int64_t tokens = shape[1];
  const Axis value_axes[] = {axes[0], {"tokens", tokens}, axes[2], axes[3]};
  RETURN_IF_ERROR(DecodeTensor(request.values(), "values", value_axes, &values));

  AppendRequest append;
  append.sequence_id = request.sequence_id();
  append.start_position = request.start_position();
  append.layer_begin = layer_begin;
  append.layer_end = layer_end;
  append.num_tokens = tokens;
  append.keys = keys.data();
  append.values = values.data();
  append.create_if_missing = !request.do_not_create();
  RETURN_IF_ERROR(cache->Append(append));

  int64_t stored = 0;
  for (int l = layer_begin; l < layer_end; ++l) stored += layout.token_bytes(l) * tokens;
  response->set_stored_bytes(stored);
  response->set_stored_bytes_bf16(static_cast<int64_t>(layout.token_bytes_bf16()) *
                                  (layer_end - layer_begin) * tokens);
  // The append landed; a concurrent Drop may already have removed the
  // sequence, in which case the response carries no sequence state.
  (void)FillSequenceInfo(*cache, request.sequence_id(), response->mutable_sequence());
  return absl::OkStatus();
}

absl::Status KvCacheService::DoScoreQuery(const v1::ScoreQueryRequest& request,
                                          v1::ScoreQueryResponse* response) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  const KvLayout& layout = cache->layout();
  RETURN_IF_ERROR(CheckLayer(request.layer(), layout, "layer"));
  if (request.token_begin() < 0 || request.token_end() < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "token range [%d, %d) is negative; want 0 <= token_begin <= token_end (token_end 0: the "
        "layer's length)",
        request.token_begin(), request.token_end()));
  }
  if (request.top_k() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("top_k is %d; want >= 0 (0: every logit)", request.top_k()));
  }
  const int heads = layout.num_query_heads();
  const Axis axes[] = {{"query_heads", heads}, {"head_dim", layout.head_dim()}};
  std::vector<float> queries;
  RETURN_IF_ERROR(DecodeTensor(request.queries(), "queries", axes, &queries));

  const int64_t begin = request.token_begin();
  int64_t end = request.token_end();
  if (end == 0) {
    ASSIGN_OR_RETURN(SequenceInfo seq, cache->GetSequence(request.sequence_id()));
    end = seq.layer_tokens[request.layer()];
    if (begin > end) {
      return absl::OutOfRangeError(absl::StrFormat(
          "token_begin %d is beyond sequence '%s' layer %d, which holds %d tokens", begin,
          request.sequence_id(), request.layer(), end));
    }
  } else if (end < begin) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "token range [%d, %d) ends before it begins; want token_begin <= token_end", begin, end));
  }
  const int64_t n = end - begin;
  std::vector<float> logits(static_cast<size_t>(heads * n));
  RETURN_IF_ERROR(cache->Score(request.sequence_id(), request.layer(), begin, end, queries.data(),
                               logits.data(), request.scale()));

  if (request.top_k() == 0) {
    return EncodeTensor(logits, {heads, n}, v1::DTYPE_F32, response->mutable_logits());
  }
  const int64_t k = std::min<int64_t>(request.top_k(), n);
  std::vector<float> top(static_cast<size_t>(heads * k));
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int h = 0; h < heads; ++h) {
    const float* row = logits.data() + h * n;
    std::iota(order.begin(), order.end(), 0);
    // Descending logit; ties go to the earlier token so results are stable.
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [row](int64_t a, int64_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    for (int64_t i = 0; i < k; ++i) {
      top[h * k + i] = row[order[i]];
      response->add_positions(begin + order[i]);
    }
  }
  return EncodeTensor(top, {heads, k}, v1::DTYPE_F32, response->mutable_logits());
}

absl::Status KvCacheService::DoAttend(const v1::AttendRequest& request,
                                      v1::AttendResponse* response) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckOutputDType(request.output_dtype()));
  const KvLayout& layout = cache->layout();
  const int heads = layout.num_query_heads();
  const int dim = layout.head_dim();
  const int num_items = request.items_size();
  std::vector<std::vector<float>> queries(num_items), outputs(num_items), lses(num_items);
  std::vector<int64_t> query_tokens(num_items);
  std::vector<AttendRequestItem> items(num_items);
  const Axis axes[] = {{"query_tokens", Axis::kAnySize}, {"query_heads", heads}, {"head_dim", dim}};
  for (int i = 0; i < num_items; ++i) {
    const v1::AttendItem& in = request.items(i);
    const auto at = [i](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("item ", i, ": ", s.message()));
    };
    if (absl::Status s = CheckId(in.sequence_id(), "sequence_id"); !s.ok()) return at(s);
    if (absl::Status s = CheckLayer(in.layer(), layout, "layer"); !s.ok()) return at(s);
    std::vector<int64_t> shape;
    const std::string name = absl::StrCat("item ", i, " queries");
    RETURN_IF_ERROR(DecodeTensor(in.queries(), name, axes, &queries[i], &shape));
    query_tokens[i] = shape[0];
    if (shape[0] > (int64_t{1} << 20)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s has %d query tokens; want at most 2^20", name, shape[0]));
    }
    outputs[i].resize(queries[i].size());
    AttendRequestItem& item = items[i];
    item.sequence_id = in.sequence_id();
    item.layer = in.layer();
    item.num_query_tokens = static_cast<int>(shape[0]);
    item.queries = queries[i].data();
    item.output = outputs[i].data();
    if (request.return_lse()) {
      lses[i].resize(static_cast<size_t>(shape[0] * heads));
      item.lse = lses[i].data();
    }
  }
  RETURN_IF_ERROR(cache->Attend(items, request.scale()));

  for (int i = 0; i < num_items; ++i) {
    v1::AttendResult* result = response->add_results();
    RETURN_IF_ERROR(EncodeTensor(outputs[i], {query_tokens[i], heads, dim},
                                 request.output_dtype(), result->mutable_output()));
    if (request.return_lse()) {
      RETURN_IF_ERROR(
          EncodeTensor(lses[i], {query_tokens[i], heads}, v1::DTYPE_F32, result->mutable_lse()));
    }
  }
  return absl::OkStatus();
}

absl::Status KvCacheService::DoCreateSequence(const v1::CreateSequenceRequest& request,
                                              v1::SequenceInfo* info) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  RETURN_IF_ERROR(cache->CreateSequence(request.sequence_id()));
  return FillSequenceInfo(*cache, request.sequence_id(), info);
}

absl::Status KvCacheService::DoForkSequence(const v1::ForkSequenceRequest& request,
                                            v1::SequenceInfo* info) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckId(request.parent_id(), "parent_id"));
  RETURN_IF_ERROR(CheckId(request.child_id(), "child_id"));
  RETURN_IF_ERROR(cache->Fork(request.parent_id(), request.child_id()));
  return FillSequenceInfo(*cache, request.child_id(), info);
}

absl::Status KvCacheService::DoDropSequence(const v1::DropSequenceRequest& request) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  return cache->Drop(request.sequence_id());
}

absl::Status KvCacheService::DoGetSequence(const v1::GetSequenceRequest& request,
                                           v1::SequenceInfo* info) {
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  return FillSequenceInfo(*cache, request.sequence_id(), info);
}

void KvCacheService::DoGetServerInfo(v1::ServerInfo* info) {
  info->set_version(TQKV_VERSION);
  info->set_backend(backend_->name());
  info->set_device(backend_->device());
  for (KvCache* cache : order_) {
    const CacheStats stats = cache->Stats();
    v1::CacheInfo* c = info->add_caches();
    CacheOptions options = cache->options();
    options.layout = cache->layout().options();  // resolved: no layout is rebuilt per call
    *c->mutable_config() = ToCacheConfig(options);
    c->set_page_bytes(static_cast<int64_t>(cache->layout().page_bytes()));
    c->set_pages_total(stats.pages_total);
    c->set_pages_used(stats.pages_used);
    c->set_sequences(stats.sequences);
    c->set_tokens(stats.tokens);
    c->set_stored_bytes(static_cast<int64_t>(stats.stored_bytes));
    c->set_stored_bytes_bf16(static_cast<int64_t>(stats.stored_bytes_bf16));
    c->set_evictions(static_cast<int64_t>(stats.evictions));
  }
  if (metrics_ != nullptr) {
    for (const Metrics::Total& t : metrics_->KernelTotals()) {
      v1::TimingTotal* k = info->add_kernel_timings();
      k->set_name(t.name);
      k->set_calls(t.calls);
      k->set_seconds(t.seconds);
    }
    for (const Metrics::Total& t : metrics_->RpcTotals()) {
      v1::TimingTotal* r = info->add_rpc_timings();
      r->set_name(t.name);
      r->set_calls(t.calls);
      r->set_seconds(t.seconds);
    }
  }
  for (const Preset& preset : AllPresets()) {
    v1::PresetInfo* p = info->add_presets();
    p->set_name(std::string(preset.name));
    p->set_keys(preset.key.Name());
    p->set_values(preset.value.Name());
    p->set_bytes_per_token_head(preset.BytesPerTokenHead(128));
    p->set_description(std::string(preset.description));
    p->set_servable(!preset.evaluation_only && !preset.NeedsCalibration());
    p->set_recipe(preset.recipe.Describe());
  }
}

grpc::ServerUnaryReactor* KvCacheService::Append(grpc::CallbackServerContext* context,
                                                 const v1::AppendRequest* request,
                                                 v1::AppendResponse* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoAppend(*request, response);
  return FinishUnary(context, metrics_, Rpc::kAppend, start, status);
}

grpc::ServerReadReactor<v1::AppendRequest>* KvCacheService::AppendStream(
    grpc::CallbackServerContext* context, v1::AppendResponse* response) {
  return new AppendStreamReactor(this, response, auth_.Check(*context));
}

grpc::ServerUnaryReactor* KvCacheService::ScoreQuery(grpc::CallbackServerContext* context,
                                                     const v1::ScoreQueryRequest* request,
                                                     v1::ScoreQueryResponse* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoScoreQuery(*request, response);
  return FinishUnary(context, metrics_, Rpc::kScoreQuery, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::Attend(grpc::CallbackServerContext* context,
                                                 const v1::AttendRequest* request,
                                                 v1::AttendResponse* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoAttend(*request, response);
  return FinishUnary(context, metrics_, Rpc::kAttend, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::CreateSequence(
    grpc::CallbackServerContext* context, const v1::CreateSequenceRequest* request,
    v1::SequenceInfo* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoCreateSequence(*request, response);
  return FinishUnary(context, metrics_, Rpc::kCreateSequence, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::ForkSequence(grpc::CallbackServerContext* context,
                                                       const v1::ForkSequenceRequest* request,
                                                       v1::SequenceInfo* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoForkSequence(*request, response);
  return FinishUnary(context, metrics_, Rpc::kForkSequence, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::DropSequence(grpc::CallbackServerContext* context,
                                                       const v1::DropSequenceRequest* request,
                                                       v1::DropSequenceResponse* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoDropSequence(*request);
  return FinishUnary(context, metrics_, Rpc::kDropSequence, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::GetSequence(grpc::CallbackServerContext* context,
                                                      const v1::GetSequenceRequest* request,
                                                      v1::SequenceInfo* response) {
  const auto start = Clock::now();
  absl::Status status = auth_.Check(*context);
  if (status.ok()) status = DoGetSequence(*request, response);
  return FinishUnary(context, metrics_, Rpc::kGetSequence, start, status);
}

grpc::ServerUnaryReactor* KvCacheService::GetServerInfo(grpc::CallbackServerContext* context,
                                                        const v1::GetServerInfoRequest* request,
                                                        v1::ServerInfo* response) {
  const auto start = Clock::now();
  const absl::Status status = auth_.Check(*context);
  if (status.ok()) DoGetServerInfo(response);
  return FinishUnary(context, metrics_, Rpc::kGetServerInfo, start, status);
}

}  // namespace service
}  // namespace tqkv
