#include "service/kv_cache_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <functional>
#include <new>
#include <numeric>
#include <random>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/descriptor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/preset.h"
#include "base/status_macros.h"
#include "service/call_reactors.h"
#include "service/config.h"
#include "service/raw_message.h"
#include "service/sequence_transfer.h"
#include "service/status_util.h"
#include "service/tensor_codec.h"
#include "version/version.h"

namespace tqkv {
namespace service {
namespace {

absl::Status CheckId(const std::string& id, const char* field) {
  if (id.empty() || id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is %d bytes; want 1..%d bytes", field, id.size(), kMaxSequenceIdBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckLayer(int layer, const KvLayout& layout, const char* what) {
  if (layer < 0 || layer >= layout.num_layers()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s %d is outside the cache's %d layers; want [0, %d)", what,
                                                      layer, layout.num_layers(), layout.num_layers()));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputDType(v1::DType dtype) {
  if (dtype != v1::DTYPE_UNSPECIFIED && DTypeBytes(dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("output_dtype %d is unknown; want DTYPE_F32 (or unspecified), DTYPE_F16 or DTYPE_BF16",
                        static_cast<int>(dtype)));
  }
  return absl::OkStatus();
}

// Bytes per output element of an output_dtype (unspecified: f32).
int OutputBytes(v1::DType dtype) { return dtype == v1::DTYPE_UNSPECIFIED ? 4 : DTypeBytes(dtype); }

// An optional idempotency key: empty, or 1..64 bytes.
absl::Status CheckRequestId(const std::string& id) {
  if (id.size() > 64) {
    return absl::InvalidArgumentError(absl::StrFormat("request_id has %d bytes; want at most 64 (or none)", id.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckScale(float scale) {
  if (!std::isfinite(scale) || scale < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scale is %g; want a finite value >= 0 (0 means 1 / sqrt(head_dim))", scale));
  }
  return absl::OkStatus();
}

// logit_softcap: 0 (none) or a finite cap > 0.
absl::Status CheckLogitSoftcap(float cap) {
  if (!std::isfinite(cap) || cap < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("logit_softcap is %g; want a finite value >= 0 (0 means no soft-capping)", cap));
  }
  return absl::OkStatus();
}

// sink_logits: absent (no dtype, shape or data) means none; otherwise f32 /
// f16 / bf16 [query_heads], finite.
absl::Status DecodeSinkLogits(const v1::Tensor& tensor, int heads, std::vector<float>* sinks) {
  sinks->clear();
  if (tensor.dtype() == v1::DTYPE_UNSPECIFIED && tensor.shape_size() == 0 && tensor.data().empty()) {
    return absl::OkStatus();
  }
  const Axis axes[] = {{"query_heads", heads}};
  return DecodeTensor(tensor, "sink_logits", axes, sinks);
}

// Each head's sink joins its softmax as one more logit with a zero value:
// the output scales by e^lse / (e^lse + e^sink) and lse becomes
// log(e^lse + e^sink). `lse` [tokens, heads] as the kernel returned it.
void ApplySinkLogits(absl::Span<const float> sinks, int64_t tokens, int heads, int dim, float* output, float* lse) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      const double l = lse[t * heads + h];
      const double sink = sinks[h];
      const double m = std::max(l, sink);
      const double total = m + std::log(std::exp(l - m) + std::exp(sink - m));
      const float factor = static_cast<float>(std::exp(l - total));
      float* row = output + (t * heads + h) * dim;
      for (int d = 0; d < dim; ++d) row[d] *= factor;
      lse[t * heads + h] = static_cast<float>(total);
    }
  }
}

void ToProto(const std::string& cache, const SequenceInfo& in, v1::SequenceInfo* out) {
  out->set_cache(cache);
  out->set_sequence_id(in.id);
  out->clear_layer_tokens();
  for (int64_t t : in.layer_tokens) out->add_layer_tokens(t);
  out->set_pages(in.pages);
  out->clear_layer_oldest_token();
  for (int64_t t : in.layer_held_begin) out->add_layer_oldest_token(t);
  out->set_stored_bytes(static_cast<int64_t>(in.stored_bytes));
  out->set_stored_bytes_bf16(static_cast<int64_t>(in.stored_bytes_bf16));
}

}  // namespace

KvCacheService::KvCacheService(std::vector<std::unique_ptr<KvCache>> caches, Backend* backend, Metrics* metrics,
                               Authenticator auth, CallExecutor* executor)
    : backend_(backend), metrics_(metrics), auth_(std::move(auth)), executor_(executor) {
  std::random_device random;
  instance_id_ = absl::StrFormat("%08x%08x", random(), random());
  for (auto& cache : caches) {
    order_.push_back(cache.get());
    const std::string name = cache->options().name;
    if (metrics_ != nullptr) metrics_->AddCache(name, cache->layout().num_layers());
    caches_.emplace(name, std::move(cache));
  }
  RegisterHandlers();
}

void KvCacheService::RegisterHandlers() {
  ServeUnary<v1::AppendRequest, v1::AppendResponse>(
      Rpc::kAppend, [this](const Caller& c, const auto& r, auto* out) { return DoAppend(c, r, out); });
  ServeUnary<v1::ScoreQueryRequest, v1::ScoreQueryResponse>(
      Rpc::kScoreQuery, [this](const Caller& c, const auto& r, auto* out) { return DoScoreQuery(c, r, out); });
  ServeUnary<v1::AttendRequest, v1::AttendResponse>(
      Rpc::kAttend, [this](const Caller& c, const auto& r, auto* out) { return DoAttend(c, r, out); });
  ServeUnary<v1::AppendAttendRequest, v1::AppendAttendResponse>(
      Rpc::kAppendAttend, [this](const Caller& c, const auto& r, auto* out) { return DoAppendAttend(c, r, out); });
  ServeUnary<v1::CreateSequenceRequest, v1::SequenceInfo>(
      Rpc::kCreateSequence, [this](const Caller& c, const auto& r, auto* out) { return DoCreateSequence(c, r, out); });
  ServeUnary<v1::ForkSequenceRequest, v1::SequenceInfo>(
      Rpc::kForkSequence, [this](const Caller& c, const auto& r, auto* out) { return DoForkSequence(c, r, out); });
  ServeUnary<v1::DropSequenceRequest, v1::DropSequenceResponse>(
      Rpc::kDropSequence, [this](const Caller& c, const auto& r, auto*) { return DoDropSequence(c, r); });
  ServeUnary<v1::GetSequenceRequest, v1::SequenceInfo>(
      Rpc::kGetSequence, [this](const Caller& c, const auto& r, auto* out) { return DoGetSequence(c, r, out); });
  // ExportSequences: one request, then a stream of chunks; like the unary
  // rpcs, served so that the token is checked before the request is read.
  MarkMethodStreamed(
      MethodIndex(Rpc::kExportSequences),
      NewStreamedHandler([this](grpc::CallbackServerContext* context) { return NewExportReactor(this, context); }));
  ServeUnary<v1::PullSequencesRequest, v1::ImportResponse>(
      Rpc::kPullSequences,
      [this](const Caller& c, const auto& r, auto* out) { return service::PullSequences(this, c, r, out); });
  ServeUnary<v1::ListSequencesRequest, v1::ListSequencesResponse>(
      Rpc::kListSequences, [this](const Caller& c, const auto& r, auto* out) { return DoListSequences(c, r, out); });
  ServeUnary<v1::SaveSnapshotRequest, v1::SaveSnapshotResponse>(
      Rpc::kSaveSnapshot, [this](const Caller& c, const auto&, auto* out) { return DoSaveSnapshot(c, out); });
  ServeUnary<v1::GetServerInfoRequest, v1::ServerInfo>(Rpc::kGetServerInfo,
                                                       [this](const Caller& c, const auto&, v1::ServerInfo* out) {
                                                         DoGetServerInfo(c, out);
                                                         return absl::OkStatus();
                                                       });
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
    return absl::NotFoundError(
        absl::StrFormat("cache '%s' not found; this server has: %s", name, absl::StrJoin(names, ", ")));
  }
  return it->second.get();
}

void KvCacheService::BeginShutdown() {
  absl::MutexLock lock(&streams_mu_);
  shutting_down_ = true;
  for (ShutdownListener* stream : streams_) stream->EndForShutdown();
}

bool KvCacheService::AddStream(ShutdownListener* stream) {
  absl::MutexLock lock(&streams_mu_);
  if (shutting_down_) return false;
  streams_.insert(stream);
  return true;
}

void KvCacheService::RemoveStream(ShutdownListener* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

int KvCacheService::EvictExpired() {
  int dropped = 0;
  for (KvCache* cache : order_) dropped += cache->EvictExpired();
  return dropped;
}

absl::Status KvCacheService::FillSequenceInfo(KvCache& cache, const std::string& id, v1::SequenceInfo* info) {
  ASSIGN_OR_RETURN(SequenceInfo seq, cache.GetSequence(id));
  ToProto(cache.options().name, seq, info);
  return absl::OkStatus();
}

template <typename Request, typename Response, typename Do>
void KvCacheService::ServeUnary(Rpc rpc, Do do_work) {
  // Parses a Request (INVALID_ARGUMENT when the bytes are not one), runs
  // do_work(caller, request, &response), serializes the response; both
  // messages on one arena (CallArenaOptions).
  unary_work_[static_cast<int>(rpc)] = [do_work](const Caller& caller, const grpc::ByteBuffer& in,
                                                 grpc::ByteBuffer* out) -> absl::Status {
    google::protobuf::Arena arena(CallArenaOptions());
    Request* request = google::protobuf::Arena::CreateMessage<Request>(&arena);
    Response* response = google::protobuf::Arena::CreateMessage<Response>(&arena);
    RETURN_IF_ERROR(ParseMessage(in, request, "the request"));
    RETURN_IF_ERROR(do_work(caller, *request, response));
    return SerializeMessage(*response, out);
  };
  // GetServerInfo takes no sequence lock and runs no kernel: inline.
  CallExecutor* executor = rpc == Rpc::kGetServerInfo ? nullptr : executor_;
  const UnaryWork* work = &unary_work_[static_cast<int>(rpc)];
  MarkMethodStreamed(MethodIndex(rpc), NewStreamedHandler([this, rpc, executor, work](grpc::CallbackServerContext* c) {
                       return NewUnaryCallReactor(auth_.Authenticate(*c), rpc, metrics_, executor, work);
                     }));
}

absl::Status KvCacheService::DoAppend(const Caller& caller, const v1::AppendRequest& request,
                                      v1::AppendResponse* response) {
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.sequence_id(), "sequence_id"));
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  const KvLayout& layout = cache->layout();
  const int layers = layout.num_layers();
  const int layer_begin = request.layer_begin();
  const int layer_end = request.layer_end() == 0 ? layers : request.layer_end();
  if (layer_begin < 0 || layer_begin >= layer_end || layer_end > layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer range [%d, %d) is not inside the cache's %d layers; want 0 <= layer_begin < "
                        "layer_end <= %d (layer_end 0 means %d)",
                        layer_begin, request.layer_end(), layers, layers, layers));
  }
  if (request.start_position() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("start_position is %d; want the sequence's current length (>= 0)", request.start_position()));
  }
  const Axis axes[] = {{"layers", layer_end - layer_begin},
                       {"tokens", Axis::kAnySize},
                       {"kv_heads", layout.num_kv_heads()},
                       {"head_dim", layout.head_dim()}};
  FloatTensor keys, values;
  std::vector<int64_t> shape;
  RETURN_IF_ERROR(DecodeTensorView(request.keys(), "keys", axes, &keys, &shape));
  const int64_t tokens = shape[1];
  const Axis value_axes[] = {axes[0], {"tokens", tokens}, axes[2], axes[3]};
  RETURN_IF_ERROR(DecodeTensorView(request.values(), "values", value_axes, &values));

  AppendRequest append;
  append.sequence_id = request.sequence_id();
  append.start_position = request.start_position();
  append.layer_begin = layer_begin;
  append.layer_end = layer_end;
  append.num_tokens = tokens;
  append.keys = keys.values.data();
  append.values = values.values.data();
  append.create_if_missing = !request.do_not_create();
  append.request_id = request.request_id();
  append.account = auth_.AccountOf(request.sequence_id());
  append.finite_checked = true;  // DecodeTensorView checked them
  AppendOutcome outcome;
  RETURN_IF_ERROR(cache->Append(append, &outcome));

  if (outcome.already_stored) {
    response->set_already_stored(true);
  } else {
    if (metrics_ != nullptr) metrics_->CountStored(cache->options().name, tokens * (layer_end - layer_begin));
    response->set_stored_bytes(outcome.stored_bytes);
    response->set_stored_bytes_bf16(outcome.stored_bytes_bf16);
  }
  // The append landed; a concurrent Drop may already have removed the
  // sequence, in which case the response carries no sequence state.
  (void)FillSequenceInfo(*cache, request.sequence_id(), response->mutable_sequence());
  return absl::OkStatus();
}

absl::Status KvCacheService::CheckResponseBytes(int64_t bytes, const char* advice) const {
  // Protobuf framing: field tags, lengths, shapes; a few dozen bytes per tensor.
  constexpr int64_t kFraming = 4096;
  if (max_response_bytes_ <= 0 || bytes + kFraming <= max_response_bytes_) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrFormat("the response would be about %d bytes, above the server's limit of %d (--max_message_bytes); %s",
                      bytes + kFraming, max_response_bytes_, advice));
}

absl::Status KvCacheService::DoScoreQuery(const Caller& caller, const v1::ScoreQueryRequest& request,
                                          v1::ScoreQueryResponse* response) {
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.sequence_id(), "sequence_id"));
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  const KvLayout& layout = cache->layout();
  RETURN_IF_ERROR(CheckLayer(request.layer(), layout, "layer"));
  if (request.token_begin() < 0 || request.token_end() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("token range [%d, %d) is negative; want 0 <= token_begin <= token_end (token_end 0: the "
                        "layer's length)",
                        request.token_begin(), request.token_end()));
  }
  if (request.top_k() < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("top_k is %d; want >= 0 (0: every logit)", request.top_k()));
  }
  RETURN_IF_ERROR(CheckLogitSoftcap(request.logit_softcap()));
  const int heads = layout.num_query_heads();
  const Axis axes[] = {{"query_heads", heads}, {"head_dim", layout.head_dim()}};
  std::vector<float> queries;
  RETURN_IF_ERROR(DecodeTensor(request.queries(), "queries", axes, &queries));

  const int64_t begin = request.token_begin();
  int64_t end = request.token_end();
  if (end != 0 && end < begin) {
    return absl::InvalidArgumentError(
        absl::StrFormat("token range [%d, %d) ends before it begins; want token_begin <= token_end", begin, end));
  }
  // The range is checked against what the layer holds before anything is
  // sized from it, so a request's cost is bounded by the stored tokens. A
  // layer only grows (or gives back tokens below its window, which Score
  // reports), so the range stays inside it.
  ASSIGN_OR_RETURN(SequenceInfo seq, cache->GetSequence(request.sequence_id()));
  const int64_t length = seq.layer_tokens[request.layer()];
  if (end == 0) end = length;
  if (begin > length || end > length) {
    return absl::OutOfRangeError(
        absl::StrFormat("token range [%d, %d) is beyond sequence '%s' layer %d, which holds %d tokens", begin, end,
                        request.sequence_id(), request.layer(), length));
  }
  const int64_t n = end - begin;
  const int64_t kept = request.top_k() > 0 ? std::min<int64_t>(request.top_k(), n) : n;
  RETURN_IF_ERROR(CheckResponseBytes(heads * kept * (request.top_k() > 0 ? 4 + 10 : 4),
                                     "ask for a shorter token range or a top_k"));
  if (n == 0) {  // an empty range: no logits, no positions
    return EncodeTensor({}, {heads, 0}, v1::DTYPE_F32, response->mutable_logits());
  }
  std::vector<float> logits(static_cast<size_t>(heads * n));
  RETURN_IF_ERROR(
      cache->Score(request.sequence_id(), request.layer(), begin, end, queries.data(), logits.data(), request.scale()));
  // Score's logits are whole (the add-back included): the cap is elementwise.
  if (const float cap = request.logit_softcap(); cap > 0.0f) {
    for (float& x : logits) x = static_cast<float>(cap * std::tanh(static_cast<double>(x) / cap));
  }

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
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [row](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    for (int64_t i = 0; i < k; ++i) {
      top[h * k + i] = row[order[i]];
      response->add_positions(begin + order[i]);
    }
  }
  return EncodeTensor(top, {heads, k}, v1::DTYPE_F32, response->mutable_logits());
}

absl::Status KvCacheService::DoAttend(const Caller& caller, const v1::AttendRequest& request,
                                      v1::AttendResponse* response) {
  // Every item's id is authorized before anything else: a batch naming a
  // sequence outside the caller's namespace is refused whole.
  for (int i = 0; i < request.items_size(); ++i) {
    const std::string& id = request.items(i).sequence_id();
    if (absl::Status s = Authenticator::Authorize(caller, id, "sequence_id"); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("item ", i, ": ", s.message()));
    }
  }
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(CheckOutputDType(request.output_dtype()));
  RETURN_IF_ERROR(CheckLogitSoftcap(request.logit_softcap()));
  const KvLayout& layout = cache->layout();
  const int heads = layout.num_query_heads();
  const int dim = layout.head_dim();
  std::vector<float> sinks;
  RETURN_IF_ERROR(DecodeSinkLogits(request.sink_logits(), heads, &sinks));
  const bool want_lse = request.return_lse() || !sinks.empty();
  const int num_items = request.items_size();
  std::vector<FloatTensor> queries(num_items);
  std::vector<std::vector<float>> outputs(num_items), lses(num_items);
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
    RETURN_IF_ERROR(DecodeTensorView(in.queries(), name, axes, &queries[i], &shape));
    query_tokens[i] = shape[0];
    if (shape[0] > (int64_t{1} << 20)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s has %d query tokens; want at most 2^20", name, shape[0]));
    }
    outputs[i].resize(queries[i].values.size());
    AttendRequestItem& item = items[i];
    item.sequence_id = in.sequence_id();
    item.layer = in.layer();
    item.num_query_tokens = static_cast<int>(shape[0]);
    if (in.has_first_query_position()) {
      if (in.first_query_position() < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("item %d: first_query_position is %d; want >= 0 (unset: the query tokens are the "
                            "layer's last stored ones)",
                            i, in.first_query_position()));
      }
      item.first_query_position = in.first_query_position();
    }
    item.queries = queries[i].values.data();
    item.output = outputs[i].data();
    if (want_lse) {
      lses[i].resize(static_cast<size_t>(shape[0] * heads));
      item.lse = lses[i].data();
    }
  }
  int64_t response_bytes = 0;
  for (int i = 0; i < num_items; ++i) {
    response_bytes += query_tokens[i] * heads * (dim * OutputBytes(request.output_dtype()) + (want_lse ? 4 : 0));
  }
  RETURN_IF_ERROR(CheckResponseBytes(response_bytes, "split the batch or ask for a 2-byte output_dtype"));
  RETURN_IF_ERROR(cache->Attend(items, request.scale(), request.logit_softcap()));
  if (metrics_ != nullptr) {
    int64_t attended = 0;
    for (int i = 0; i < num_items; ++i) attended += query_tokens[i];
    metrics_->CountAttended(cache->options().name, attended);
  }

  for (int i = 0; i < num_items; ++i) {
    if (!sinks.empty()) {
      ApplySinkLogits(sinks, query_tokens[i], heads, dim, outputs[i].data(), lses[i].data());
    }
    v1::AttendResult* result = response->add_results();
    RETURN_IF_ERROR(
        EncodeTensor(outputs[i], {query_tokens[i], heads, dim}, request.output_dtype(), result->mutable_output()));
    if (request.return_lse()) {
      RETURN_IF_ERROR(EncodeTensor(lses[i], {query_tokens[i], heads}, v1::DTYPE_F32, result->mutable_lse()));
    }
  }
  return absl::OkStatus();
}

namespace {

// An AppendAttend item as decoded and checked, and where its output goes.
struct DecodedItem {
  FloatTensor keys, values, queries;
  std::vector<float> output_storage, lse;
  float* output = nullptr;  // the response's bytes (f32 out) or output_storage
  int64_t tokens = 0;
};

// Everything a malformed item can get wrong, checked before any item is
// stored: ids (one item per sequence), start positions, tensor shapes and
// values. The first error names its item.
absl::Status DecodeItems(const v1::AppendAttendRequest& request, const KvLayout& layout,
                         std::vector<DecodedItem>* items) {
  const int heads = layout.num_query_heads(), kv_heads = layout.num_kv_heads(), dim = layout.head_dim();
  items->resize(request.items_size());
  absl::flat_hash_map<std::string_view, int> first_item;
  for (int i = 0; i < request.items_size(); ++i) {
    const v1::AppendAttendItem& in = request.items(i);
    const auto at = [i](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("item ", i, ": ", s.message()));
    };
    if (absl::Status s = CheckId(in.sequence_id(), "sequence_id"); !s.ok()) return at(s);
    if (absl::Status s = CheckRequestId(in.request_id()); !s.ok()) return at(s);
    if (auto [it, inserted] = first_item.emplace(in.sequence_id(), i); !inserted) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: sequence '%s' is also item %d; want at most one item per sequence (send "
                          "a sequence's tokens in one item)",
                          i, in.sequence_id(), it->second));
    }
    if (in.start_position() < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: start_position is %d; want the sequence's current length in layer %d (>= 0)", i,
                          in.start_position(), request.layer()));
    }
    DecodedItem& item = (*items)[i];
    // The tensors' names for messages, "item 12 values", formatted on the
    // stack: a decode layer has many items and these are read only on error.
    char name[32];
    const auto named = [&name, i](const char* tensor) {
      const int n = absl::SNPrintF(name, sizeof(name), "item %d %s", i, tensor);
      return std::string_view(name, std::min<size_t>(n, sizeof(name) - 1));
    };
    const Axis key_axes[] = {{"tokens", Axis::kAnySize}, {"kv_heads", kv_heads}, {"head_dim", dim}};
    std::vector<int64_t> shape;
    RETURN_IF_ERROR(DecodeTensorView(in.keys(), named("keys"), key_axes, &item.keys, &shape));
    item.tokens = shape[0];
    const Axis value_axes[] = {{"tokens", item.tokens}, {"kv_heads", kv_heads}, {"head_dim", dim}};
    RETURN_IF_ERROR(DecodeTensorView(in.values(), named("values"), value_axes, &item.values));
    const Axis query_axes[] = {{"tokens", item.tokens}, {"query_heads", heads}, {"head_dim", dim}};
    RETURN_IF_ERROR(DecodeTensorView(in.queries(), named("queries"), query_axes, &item.queries));
  }
  return absl::OkStatus();
}

// The cache's requests for the decoded items: item i's append of its tokens
// to the layer, and its attention. An f32 output is written by the kernel
// straight into the response's result i (added here, in order).
void PlanCacheCalls(const v1::AppendAttendRequest& request, const KvLayout& layout, const Authenticator& auth,
                    bool want_lse, std::vector<DecodedItem>& items, std::vector<AppendRequest>* appends,
                    std::vector<AttendRequestItem>* attends, v1::AppendAttendResponse* response) {
  const int heads = layout.num_query_heads(), dim = layout.head_dim();
  const bool f32_output = request.output_dtype() == v1::DTYPE_F32 || request.output_dtype() == v1::DTYPE_UNSPECIFIED;
  appends->resize(items.size());
  attends->resize(items.size());
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    const v1::AppendAttendItem& in = request.items(i);
    DecodedItem& item = items[i];
    AppendRequest& append = (*appends)[i];
    append.sequence_id = in.sequence_id();
    append.start_position = in.start_position();
    append.layer_begin = request.layer();
    append.layer_end = request.layer() + 1;
    append.num_tokens = item.tokens;
    append.keys = item.keys.values.data();
    append.values = item.values.values.data();
    append.create_if_missing = !in.do_not_create();
    append.request_id = in.request_id();
    append.account = auth.AccountOf(in.sequence_id());
    // A retry of an append that landed attends without storing again.
    append.landed_is_stored = true;
    append.finite_checked = true;  // DecodeTensorView checked them
    response->add_results();
    if (f32_output) {
      item.output = PrepareF32Tensor({item.tokens, heads, dim}, response->mutable_results(i)->mutable_output());
    }
    if (item.output == nullptr) {
      item.output_storage.resize(item.queries.values.size());
      item.output = item.output_storage.data();
    }
    AttendRequestItem& a = (*attends)[i];
    a.sequence_id = in.sequence_id();
    a.layer = request.layer();
    a.num_query_tokens = static_cast<int>(item.tokens);
    a.queries = item.queries.values.data();
    a.output = item.output;
    if (want_lse) {
      item.lse.resize(static_cast<size_t>(item.tokens * heads));
      a.lse = item.lse.data();
    }
  }
}

// The response's results from the cache's answers: per-item errors, the
// sink logits applied, outputs not written in place encoded; the bytes
// stored and the tokens counted in `metrics` (null: none).
absl::Status AnswerItems(const KvCache& cache, const v1::AppendAttendRequest& request, absl::Span<const float> sinks,
                         std::vector<DecodedItem>& items, absl::Span<const absl::Status> statuses,
                         absl::Span<const AppendOutcome> outcomes, Metrics* metrics,
                         v1::AppendAttendResponse* response) {
  const int heads = cache.layout().num_query_heads(), dim = cache.layout().head_dim();
  int64_t stored = 0, stored_bf16 = 0;
  int64_t stored_tokens = 0, attended_tokens = 0;  // in this one layer
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    DecodedItem& item = items[i];
    v1::AppendAttendItemResult* result = response->mutable_results(i);
    if (!statuses[i].ok()) {
      result->Clear();
      result->set_code(static_cast<int>(statuses[i].code()));
      result->set_message(std::string(statuses[i].message()));
      continue;
    }
    if (!sinks.empty()) ApplySinkLogits(sinks, item.tokens, heads, dim, item.output, item.lse.data());
    if (item.output_storage.data() == item.output) {
      RETURN_IF_ERROR(EncodeTensor(item.output_storage, {item.tokens, heads, dim}, request.output_dtype(),
                                   result->mutable_output()));
    }
    if (request.return_lse()) {
      RETURN_IF_ERROR(EncodeTensor(item.lse, {item.tokens, heads}, v1::DTYPE_F32, result->mutable_lse()));
    }
    result->set_layer_tokens(request.items(i).start_position() + item.tokens);
    result->set_already_stored(outcomes[i].already_stored);
    stored_tokens += outcomes[i].already_stored ? 0 : item.tokens;
    attended_tokens += item.tokens;
    stored += outcomes[i].stored_bytes;
    stored_bf16 += outcomes[i].stored_bytes_bf16;
  }
  response->set_stored_bytes(stored);
  response->set_stored_bytes_bf16(stored_bf16);
  if (metrics != nullptr) {
    metrics->CountStored(cache.options().name, stored_tokens);
    metrics->CountAttended(cache.options().name, attended_tokens);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KvCacheService::DoAppendAttend(const Caller& caller, const v1::AppendAttendRequest& request,
                                            v1::AppendAttendResponse* response) {
  // As in Attend: one item outside the caller's namespace refuses the batch.
  for (int i = 0; i < request.items_size(); ++i) {
    const std::string& id = request.items(i).sequence_id();
    if (absl::Status s = Authenticator::Authorize(caller, id, "sequence_id"); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("item ", i, ": ", s.message()));
    }
  }
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  const KvLayout& layout = cache->layout();
  RETURN_IF_ERROR(CheckLayer(request.layer(), layout, "layer"));
  RETURN_IF_ERROR(CheckOutputDType(request.output_dtype()));
  RETURN_IF_ERROR(CheckScale(request.scale()));
  RETURN_IF_ERROR(CheckLogitSoftcap(request.logit_softcap()));
  const int heads = layout.num_query_heads();
  std::vector<float> sinks;
  RETURN_IF_ERROR(DecodeSinkLogits(request.sink_logits(), heads, &sinks));
  const bool want_lse = request.return_lse() || !sinks.empty();
  std::vector<DecodedItem> items;
  RETURN_IF_ERROR(DecodeItems(request, layout, &items));
  int64_t response_bytes = 0;
  for (const DecodedItem& item : items) {
    response_bytes +=
        item.tokens * heads * (layout.head_dim() * OutputBytes(request.output_dtype()) + (want_lse ? 4 : 0));
  }
  RETURN_IF_ERROR(CheckResponseBytes(response_bytes, "split the batch or ask for a 2-byte output_dtype"));

  // One cache call for the layer: every item's append, all-or-nothing on
  // its own, then one attention batch over the items stored, in one backend
  // call.
  std::vector<AppendRequest> appends;
  std::vector<AttendRequestItem> attends;
  PlanCacheCalls(request, layout, auth_, want_lse, items, &appends, &attends, response);
  std::vector<absl::Status> statuses(items.size());
  std::vector<AppendOutcome> outcomes(items.size());
  cache->AppendAttend(appends, attends, request.scale(), absl::MakeSpan(statuses), absl::MakeSpan(outcomes),
                      request.logit_softcap());
  return AnswerItems(*cache, request, sinks, items, statuses, outcomes, metrics_, response);
}

absl::Status KvCacheService::DoCreateSequence(const Caller& caller, const v1::CreateSequenceRequest& request,
                                              v1::SequenceInfo* info) {
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.sequence_id(), "sequence_id"));
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(cache->CreateSequence(request.sequence_id(), auth_.AccountOf(request.sequence_id())));
  return FillSequenceInfo(*cache, request.sequence_id(), info);
}

absl::Status KvCacheService::DoForkSequence(const Caller& caller, const v1::ForkSequenceRequest& request,
                                            v1::SequenceInfo* info) {
  RETURN_IF_ERROR(CheckId(request.parent_id(), "parent_id"));
  RETURN_IF_ERROR(CheckId(request.child_id(), "child_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.parent_id(), "parent_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.child_id(), "child_id"));
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  RETURN_IF_ERROR(cache->Fork(request.parent_id(), request.child_id(), auth_.AccountOf(request.child_id())));
  return FillSequenceInfo(*cache, request.child_id(), info);
}

absl::Status KvCacheService::DoDropSequence(const Caller& caller, const v1::DropSequenceRequest& request) {
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.sequence_id(), "sequence_id"));
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  return cache->Drop(request.sequence_id());
}

absl::Status KvCacheService::DoGetSequence(const Caller& caller, const v1::GetSequenceRequest& request,
                                           v1::SequenceInfo* info) {
  RETURN_IF_ERROR(CheckId(request.sequence_id(), "sequence_id"));
  RETURN_IF_ERROR(Authenticator::Authorize(caller, request.sequence_id(), "sequence_id"));
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  return FillSequenceInfo(*cache, request.sequence_id(), info);
}

void KvCacheService::DoGetServerInfo(const Caller& caller, v1::ServerInfo* info) {
  const auto fill_tenant = [](const Tenant& tenant, v1::TenantInfo* out) {
    const UsageAccount& account = *tenant.account();
    out->set_name(tenant.name());
    out->set_sequence_prefix(tenant.prefix());
    out->set_max_bytes(static_cast<int64_t>(account.max_bytes()));
    out->set_max_sequences(account.max_sequences());
    out->set_bytes(static_cast<int64_t>(account.bytes()));
    out->set_sequences(account.sequences());
    out->set_tokens(account.tokens());
    out->set_quota_refusals(static_cast<int64_t>(account.refusals()));
  };
  if (caller.admin()) {
    for (const Tenant* tenant : auth_.tenants()) fill_tenant(*tenant, info->add_tenants());
  } else {
    fill_tenant(*caller.tenant, info->mutable_tenant());
  }
  info->set_version(VersionLine());
  info->set_instance_id(instance_id_);
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
    const KvLayout& layout = cache->layout();
    if (absl::StatusOr<const Preset*> preset = FindPreset(layout.options().preset); preset.ok()) {
      c->set_bytes_per_token_head((*preset)->BytesPerTokenHead(layout.head_dim()));
    }
    int64_t per_token = 0;
    for (int l = 0; l < layout.num_layers(); ++l) per_token += static_cast<int64_t>(layout.token_bytes(l));
    c->set_bytes_per_token(per_token);
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
  if (executor_ != nullptr) {
    const CallExecutor::Stats e = executor_->GetStats();
    v1::ExecutorInfo* x = info->mutable_executor();
    x->set_threads(e.threads);
    x->set_max_pending_calls(e.max_pending);
    x->set_max_pending_bytes(static_cast<int64_t>(e.max_pending_bytes));
    x->set_running(e.running);
    x->set_queued(e.queued);
    x->set_rejected(static_cast<int64_t>(e.rejected));
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

grpc::ServerReadReactor<grpc::ByteBuffer>* KvCacheService::AppendStream(grpc::CallbackServerContext* context,
                                                                        Raw* response) {
  return NewAppendStreamReactor(this, response, auth_.Authenticate(*context));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::DecodeStream(
    grpc::CallbackServerContext* context) {
  return NewDecodeStreamReactor(this, auth_.Authenticate(*context));
}

absl::Status KvCacheService::DoListSequences(const Caller& caller, const v1::ListSequencesRequest& request,
                                             v1::ListSequencesResponse* response) {
  if (request.max_ids() < 0 || request.max_ids() > 100000) {
    return absl::InvalidArgumentError(absl::StrFormat("max_ids is %d; want 0..100000 (0: 1000)", request.max_ids()));
  }
  std::string prefix = request.id_prefix();
  if (!caller.admin()) {
    if (prefix.empty()) prefix = caller.tenant->prefix();
    RETURN_IF_ERROR(Authenticator::Authorize(caller, prefix, "id_prefix"));
  }
  ASSIGN_OR_RETURN(KvCache * cache, Find(request.cache()));
  const size_t limit = request.max_ids() == 0 ? 1000 : static_cast<size_t>(request.max_ids());
  for (const std::string& id : cache->ListSequences()) {  // sorted
    if (!absl::StartsWith(id, prefix) || (!request.start_after().empty() && id <= request.start_after())) continue;
    if (static_cast<size_t>(response->sequence_ids_size()) == limit) {
      response->set_more(true);
      break;
    }
    response->add_sequence_ids(id);
  }
  return absl::OkStatus();
}

absl::Status KvCacheService::DoSaveSnapshot(const Caller& caller, v1::SaveSnapshotResponse* response) {
  if (!caller.admin()) {
    return absl::PermissionDeniedError(
        absl::StrFormat("SaveSnapshot writes every tenant's sequences: it takes an admin token, not tenant '%s''s",
                        caller.tenant->name()));
  }
  if (snapshotter_ == nullptr) {
    return absl::FailedPreconditionError("this server has no data directory (start it with --data_dir)");
  }
  ASSIGN_OR_RETURN(*response, snapshotter_->SaveAll());
  return absl::OkStatus();
}

grpc::ServerReadReactor<grpc::ByteBuffer>* KvCacheService::ImportSequences(grpc::CallbackServerContext* context,
                                                                           Raw* response) {
  return NewImportReactor(this, context, response);
}

}  // namespace service
}  // namespace tqkv
