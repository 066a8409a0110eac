#include "client/cpp/tqkv_client.h"

#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/float_formats.h"
#include "proto/grpc_raw.h"

namespace tqkv {
namespace {

int64_t Product(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status CheckSize(const char* name, absl::Span<const float> data, absl::Span<const int64_t> shape) {
  if (static_cast<int64_t>(data.size()) != Product(shape)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s has %d floats but its shape holds %d", name, data.size(), Product(shape)));
  }
  return absl::OkStatus();
}

void Encode(absl::Span<const float> data, absl::Span<const int64_t> shape, v1::DType dtype, v1::Tensor* out) {
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_F32;
  out->set_dtype(dtype);
  for (int64_t d : shape) out->add_shape(d);
  std::string* bytes = out->mutable_data();
  if (dtype == v1::DTYPE_F32) {
    bytes->assign(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
    return;
  }
  bytes->resize(data.size() * 2);
  char* dst = bytes->data();
  FloatsToHalfBytes(data.data(), data.size(), dtype == v1::DTYPE_BF16, dst);
}

// Server responses are trusted to be consistent, but a short buffer must not
// read past the end.
absl::StatusOr<std::vector<float>> Decode(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0 || (d > 0 && n > (int64_t{1} << 40) / d))
      return absl::InternalError("server sent a tensor with a bad shape");
    n *= d;
  }
  const size_t elem = t.dtype() == v1::DTYPE_F32 ? 4 : 2;
  if (n < 0 || t.data().size() != static_cast<size_t>(n) * elem) {
    return absl::InternalError("server sent a tensor whose bytes do not match its shape");
  }
  std::vector<float> out(static_cast<size_t>(n));
  const char* src = t.data().data();
  if (t.dtype() == v1::DTYPE_F32) {
    if (n > 0) std::memcpy(out.data(), src, static_cast<size_t>(n) * 4);
    return out;
  }
  HalfBytesToFloats(src, static_cast<size_t>(n), t.dtype() == v1::DTYPE_BF16, out.data());
  return out;
}

SequenceState FromProto(const v1::SequenceInfo& info) {
  SequenceState s;
  s.cache = info.cache();
  s.sequence_id = info.sequence_id();
  s.layer_tokens.assign(info.layer_tokens().begin(), info.layer_tokens().end());
  s.pages = info.pages();
  s.layer_oldest_token.assign(info.layer_oldest_token().begin(), info.layer_oldest_token().end());
  s.stored_bytes = info.stored_bytes();
  s.stored_bytes_bf16 = info.stored_bytes_bf16();
  return s;
}

// The default idempotency key of an append: a 64-bit hash of what it
// appends (sequence, position, layers and the encoded K/V), so that a resend
// of the same append, by this client's retries or by its caller, carries the
// same key, and another writer's append at the same position does not.
std::string ContentRequestId(const std::string& sequence_id, int64_t start, int layer_begin, int layer_end,
                             const v1::Tensor& keys, const v1::Tensor& values) {
  const size_t h = absl::HashOf(sequence_id, start, layer_begin, layer_end, std::string_view(keys.data()),
                                std::string_view(values.data()), static_cast<int>(keys.dtype()));
  return absl::StrFormat("c%016x", static_cast<uint64_t>(h));
}

absl::Status FillAppendRequest(const AppendArgs& args, v1::AppendRequest* request) {
  if (absl::Status s = CheckSize("keys", args.keys, args.shape); !s.ok()) return s;
  if (absl::Status s = CheckSize("values", args.values, args.shape); !s.ok()) return s;
  request->set_cache(args.cache);
  request->set_sequence_id(args.sequence_id);
  request->set_start_position(args.start_position);
  request->set_layer_begin(args.layer_begin);
  request->set_layer_end(args.layer_end);
  request->set_do_not_create(!args.create_if_missing);
  Encode(args.keys, args.shape, args.wire_dtype, request->mutable_keys());
  Encode(args.values, args.shape, args.wire_dtype, request->mutable_values());
  request->set_request_id(!args.request_id.empty()
                              ? args.request_id
                              : ContentRequestId(args.sequence_id, args.start_position, args.layer_begin,
                                                 args.layer_end, request->keys(), request->values()));
  return absl::OkStatus();
}

AppendResult FromProto(const v1::AppendResponse& response) {
  AppendResult r;
  r.sequence = FromProto(response.sequence());
  r.stored_bytes = response.stored_bytes();
  r.stored_bytes_bf16 = response.stored_bytes_bf16();
  r.already_stored = response.already_stored();
  return r;
}

absl::Status ItemStatus(int code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  const absl::StatusCode c =
      (code > 0 && code <= 16) ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(c, message);
}

absl::StatusOr<AttendOutput> FromProto(const v1::Tensor& output, const v1::Tensor* lse) {
  AttendOutput out;
  absl::StatusOr<std::vector<float>> o = Decode(output);
  if (!o.ok()) return o.status();
  out.output = *std::move(o);
  for (int d = 0; d < 3 && d < output.shape_size(); ++d) out.shape[d] = output.shape(d);
  if (lse != nullptr) {
    absl::StatusOr<std::vector<float>> l = Decode(*lse);
    if (!l.ok()) return l.status();
    out.lse = *std::move(l);
  }
  return out;
}

}  // namespace

absl::Status FillAppendAttendRequest(const AppendAttendArgs& args, v1::AppendAttendRequest* request) {
  request->set_cache(args.cache);
  request->set_layer(args.layer);
  request->set_scale(args.scale);
  request->set_logit_softcap(args.logit_softcap);
  request->set_return_lse(args.return_lse);
  request->set_output_dtype(args.output_dtype);
  if (!args.sink_logits.empty()) {
    const int64_t heads = static_cast<int64_t>(args.sink_logits.size());
    Encode(args.sink_logits, {&heads, 1}, v1::DTYPE_F32, request->mutable_sink_logits());
  }
  for (size_t i = 0; i < args.items.size(); ++i) {
    const AppendAttendItemArgs& item = args.items[i];
    for (absl::Status s : {CheckSize("keys", item.keys, item.kv_shape), CheckSize("values", item.values, item.kv_shape),
                           CheckSize("queries", item.queries, item.query_shape)}) {
      if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("item ", i, ": ", s.message()));
    }
    v1::AppendAttendItem* out = request->add_items();
    out->set_sequence_id(item.sequence_id);
    out->set_start_position(item.start_position);
    out->set_do_not_create(!item.create_if_missing);
    Encode(item.keys, item.kv_shape, args.wire_dtype, out->mutable_keys());
    Encode(item.values, item.kv_shape, args.wire_dtype, out->mutable_values());
    out->set_request_id(!item.request_id.empty() ? item.request_id
                                                 : ContentRequestId(item.sequence_id, item.start_position, args.layer,
                                                                    args.layer + 1, out->keys(), out->values()));
    Encode(item.queries, item.query_shape, args.wire_dtype, out->mutable_queries());
  }
  return absl::OkStatus();
}

absl::StatusOr<AppendAttendResult> FromProto(const v1::AppendAttendResponse& response, bool with_lse) {
  AppendAttendResult result;
  result.stored_bytes = response.stored_bytes();
  result.stored_bytes_bf16 = response.stored_bytes_bf16();
  result.items.resize(response.results_size());
  for (int i = 0; i < response.results_size(); ++i) {
    const v1::AppendAttendItemResult& r = response.results(i);
    AppendAttendItemResult& item = result.items[i];
    item.status = ItemStatus(r.code(), r.message());
    item.layer_tokens = r.layer_tokens();
    item.already_stored = r.already_stored();
    if (!item.status.ok()) continue;
    absl::StatusOr<AttendOutput> out = FromProto(r.output(), with_lse ? &r.lse() : nullptr);
    if (!out.ok()) return out.status();
    item.attention = *std::move(out);
  }
  return result;
}

DecodeStream::~DecodeStream() {
  if (!finished_ && context_ != nullptr) {
    context_->TryCancel();
    stream_->Finish();
  }
}

absl::StatusOr<uint64_t> DecodeStream::Send(const AppendAttendArgs& step) {
  v1::AppendAttendRequest request;
  if (absl::Status s = FillAppendAttendRequest(step, &request); !s.ok()) return s;
  return Send(std::move(request), step.return_lse);
}

absl::StatusOr<uint64_t> DecodeStream::Send(v1::AppendAttendRequest step, bool with_lse) {
  if (finished_ || writes_done_) {
    return absl::FailedPreconditionError("the decode stream is closed; open a new one");
  }
  v1::DecodeStreamRequest request;
  const uint64_t id = next_id_++;
  request.set_request_id(id);
  *request.mutable_step() = std::move(step);
  with_lse_.push_back(with_lse);
  if (!stream_->Write(request)) {
    return absl::UnavailableError(
        "the decode stream broke; Receive gives its status, then resend the unanswered steps "
        "on a new stream");
  }
  return id;
}

absl::StatusOr<DecodeStream::Response> DecodeStream::Receive() {
  if (finished_) {
    return final_status_.ok() ? absl::FailedPreconditionError("the decode stream is closed") : final_status_;
  }
  v1::DecodeStreamResponse in;
  if (!stream_->Read(&in)) {
    finished_ = true;
    final_status_ = FromGrpcStatus(stream_->Finish());
    if (final_status_.ok()) {
      final_status_ = absl::UnavailableError("the server ended the decode stream");
    }
    return final_status_;
  }
  Response out;
  out.request_id = in.request_id();
  out.status = ItemStatus(in.code(), in.message());
  if (out.status.ok()) {
    const bool with_lse = in.request_id() >= 1 && in.request_id() <= with_lse_.size() && with_lse_[in.request_id() - 1];
    absl::StatusOr<AppendAttendResult> result = FromProto(in.step(), with_lse);
    if (!result.ok()) return result.status();
    out.result = *std::move(result);
  }
  return out;
}

absl::StatusOr<AppendAttendResult> DecodeStream::Step(const AppendAttendArgs& step) {
  absl::StatusOr<uint64_t> id = Send(step);
  if (!id.ok()) {
    absl::StatusOr<Response> ended = Receive();  // the stream's own status
    return ended.ok() ? id.status() : ended.status();
  }
  absl::StatusOr<Response> response = Receive();
  if (!response.ok()) return response.status();
  if (response->request_id != *id) {
    return absl::InternalError(absl::StrCat("decode stream answered request ", response->request_id, " while ", *id,
                                            " was expected (responses pending from Send?)"));
  }
  if (!response->status.ok()) return response->status;
  return std::move(response->result);
}

absl::Status DecodeStream::Close() {
  if (finished_) return final_status_;
  if (!writes_done_) {
    writes_done_ = true;
    stream_->WritesDone();
  }
  v1::DecodeStreamResponse discard;
  while (stream_->Read(&discard)) {
  }
  finished_ = true;
  final_status_ = FromGrpcStatus(stream_->Finish());
  return final_status_;
}

std::unique_ptr<DecodeStream> Client::OpenDecodeStream(absl::string_view route_id) {
  std::unique_ptr<DecodeStream> stream(new DecodeStream());
  stream->context_ = std::make_unique<grpc::ClientContext>();
  PrepareStream(stream->context_.get(), route_id);
  stream->stream_ = stub_->DecodeStream(stream->context_.get());
  return stream;
}

absl::StatusOr<AppendAttendResult> Client::AppendAttend(const AppendAttendArgs& args) {
  v1::AppendAttendRequest request;
  if (absl::Status s = FillAppendAttendRequest(args, &request); !s.ok()) return s;
  v1::AppendAttendResponse response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      args.items.empty() ? absl::string_view() : args.items[0].sequence_id,
      [&](grpc::ClientContext* c) { return stub_->AppendAttend(c, request, &response); }, &attempts);
  if (!status.ok()) return FromGrpcStatus(status);
  return FromProto(response, args.return_lse);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  const absl::StatusCode absl_code =
      (code >= 0 && code <= 16) ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(absl_code, status.error_message());
}

std::string RouteKey(absl::string_view sequence_id) {
  return std::string(sequence_id.substr(0, sequence_id.find('/')));
}

namespace {

// HTTP/2 header values: visible ASCII and inner spaces, no edge whitespace.
bool IsSendableHeaderValue(absl::string_view value) {
  if (value.empty() || value.front() == ' ' || value.back() == ' ') return false;
  for (char c : value) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

}  // namespace

Client::Client(ClientOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options_.max_message_bytes);
  arguments.SetMaxSendMessageSize(options_.max_message_bytes);
  std::shared_ptr<grpc::ChannelCredentials> credentials = options_.credentials;
  if (credentials == nullptr) {
    if (options_.use_tls || !options_.tls_root_certs_pem.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options_.tls_root_certs_pem;
      credentials = grpc::SslCredentials(ssl);
    } else {
      credentials = grpc::InsecureChannelCredentials();
    }
  }
  if (!options_.tls_server_name_override.empty()) {
    arguments.SetSslTargetNameOverride(options_.tls_server_name_override);
  }
  channel_ = grpc::CreateCustomChannel(options_.target, credentials, arguments);
  stub_ = v1::KvCache::NewStub(channel_);
}

Client::Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(std::move(options)), channel_(std::move(channel)), stub_(v1::KvCache::NewStub(channel_)) {}

void Client::Prepare(grpc::ClientContext* context, absl::string_view route_id) const {
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
  if (options_.send_route_key && !route_id.empty()) {
    std::string key = RouteKey(route_id);
    if (IsSendableHeaderValue(key)) context->AddMetadata(kRouteKeyMetadata, std::move(key));
  }
}

void Client::PrepareStream(grpc::ClientContext* context, absl::string_view route_id) const {
  Prepare(context, route_id);
  context->set_deadline(options_.stream_timeout == absl::InfiniteDuration()
                            ? std::chrono::system_clock::time_point::max()
                            : absl::ToChronoTime(absl::Now() + options_.stream_timeout));
}

template <typename Rpc>
grpc::Status Client::WithRetries(absl::string_view route_id, Rpc rpc, int* attempts) {
  thread_local std::minstd_rand jitter(std::random_device{}());
  absl::Duration backoff = options_.initial_backoff;
  grpc::Status status;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    Prepare(&context, route_id);
    status = rpc(&context);
    *attempts = attempt;
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || attempt >= options_.max_attempts) {
      return status;
    }
    const double factor = std::uniform_real_distribution<double>(0.8, 1.2)(jitter);
    absl::SleepFor(backoff * factor);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::StatusOr<AppendResult> Client::Append(const AppendArgs& args) {
  v1::AppendRequest request;
  if (absl::Status s = FillAppendRequest(args, &request); !s.ok()) return s;
  v1::AppendResponse response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      args.sequence_id, [&](grpc::ClientContext* c) { return stub_->Append(c, request, &response); }, &attempts);
  // A retry of an append that had landed is answered already_stored (the
  // request carries its request_id), so nothing needs reading back here.
  if (status.ok()) return FromProto(response);
  return FromGrpcStatus(status);
}

absl::StatusOr<AppendResult> Client::AppendStream(absl::Span<const AppendArgs> chunks) {
  grpc::ClientContext context;
  // Every chunk must name the first chunk's sequence (the server checks).
  Prepare(&context, chunks.empty() ? absl::string_view() : chunks[0].sequence_id);
  v1::AppendResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = stub_->AppendStream(&context, &response);
  for (const AppendArgs& chunk : chunks) {
    v1::AppendRequest request;
    if (absl::Status s = FillAppendRequest(chunk, &request); !s.ok()) {
      context.TryCancel();
      writer->Finish();
      return s;
    }
    // A failed write means the server ended the stream: Finish has its status.
    if (!writer->Write(request)) break;
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return FromProto(response);
}

absl::Status Client::ExportSequences(const v1::ExportRequest& request,
                                     const std::function<absl::Status(v1::ExportChunk&)>& sink) {
  grpc::ClientContext context;
  PrepareStream(&context, request.sequence_ids_size() > 0 ? absl::string_view(request.sequence_ids(0))
                                                          : absl::string_view(request.id_prefix()));
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = stub_->ExportSequences(&context, request);
  v1::ExportChunk chunk;
  absl::Status sunk;
  while (reader->Read(&chunk)) {
    sunk = sink(chunk);
    if (!sunk.ok()) {
      context.TryCancel();
      break;
    }
  }
  const grpc::Status status = reader->Finish();
  if (!sunk.ok()) return sunk;
  return FromGrpcStatus(status);
}

absl::StatusOr<v1::ImportResponse> Client::ImportSequences(
    const std::function<absl::StatusOr<bool>(v1::ExportChunk*)>& next) {
  grpc::ClientContext context;
  PrepareStream(&context, absl::string_view());
  v1::ImportResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::ExportChunk>> writer = stub_->ImportSequences(&context, &response);
  v1::ExportChunk chunk;
  absl::Status source;
  for (;;) {
    chunk.Clear();
    absl::StatusOr<bool> more = next(&chunk);
    if (!more.ok()) {
      source = more.status();
      context.TryCancel();
      break;
    }
    if (!*more) break;
    // A failed write means the server ended the stream: Finish has its status.
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!source.ok()) return source;
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

namespace {

// One message handed from the exporting thread to the importing one.
struct Mailbox {
  absl::Mutex mu;
  grpc::ByteBuffer message ABSL_GUARDED_BY(mu);
  bool full ABSL_GUARDED_BY(mu) = false;
  bool import_ended ABSL_GUARDED_BY(mu) = false;
  bool export_ended ABSL_GUARDED_BY(mu) = false;
  absl::Status export_status ABSL_GUARDED_BY(mu);

  bool CanPut() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !full || import_ended; }
  bool CanTake() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return full || export_ended; }
};

}  // namespace

absl::StatusOr<v1::ImportResponse> CopySequences(Client& from, Client& to, const v1::ExportRequest& request,
                                                 const std::string& target_cache) {
  // The messages are relayed as raw bytes (only the header is parsed, when
  // the target cache is renamed): the pages are never decoded here. The
  // export is read on a second thread and handed over one message at a time.
  Mailbox box;
  grpc::ClientContext export_context;
  from.PrepareStream(&export_context, request.sequence_ids_size() > 0 ? absl::string_view(request.sequence_ids(0))
                                                                      : absl::string_view(request.id_prefix()));
  std::thread exporter([&] {
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader =
        OpenRawServerStream(from.channel_.get(), "/tqkv.v1.KvCache/ExportSequences", &export_context, request);
    grpc::ByteBuffer message;
    bool first = true;
    absl::Status relay;
    while (relay.ok() && reader->Read(&message)) {
      if (first && !target_cache.empty()) {
        v1::ExportChunk header;
        if (!grpc::SerializationTraits<v1::ExportChunk>::Deserialize(&message, &header).ok() || !header.has_header()) {
          relay = absl::DataLossError("the export's first message is not its header");
          break;
        }
        header.mutable_header()->set_cache(target_cache);
        bool own = false;
        message.Clear();
        (void)grpc::SerializationTraits<v1::ExportChunk>::Serialize(header, &message, &own);
      }
      first = false;
      absl::MutexLock lock(&box.mu);
      box.mu.Await(absl::Condition(&box, &Mailbox::CanPut));
      if (box.import_ended) {
        relay = absl::CancelledError("the import ended");
        break;
      }
      box.message.Swap(&message);
      box.full = true;
    }
    if (!relay.ok()) export_context.TryCancel();
    const grpc::Status status = reader->Finish();
    absl::MutexLock lock(&box.mu);
    box.export_status = relay.ok() ? FromGrpcStatus(status) : relay;
    box.export_ended = true;
  });

  grpc::ClientContext import_context;
  to.PrepareStream(&import_context, absl::string_view());
  grpc::ByteBuffer response_bytes;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer =
      OpenRawClientStream(to.channel_.get(), "/tqkv.v1.KvCache/ImportSequences", &import_context, &response_bytes);
  absl::Status export_failed;
  for (;;) {
    grpc::ByteBuffer message;
    {
      absl::MutexLock lock(&box.mu);
      box.mu.Await(absl::Condition(&box, &Mailbox::CanTake));
      if (!box.full) {
        export_failed = box.export_status;
        break;
      }
      message.Swap(&box.message);
      box.full = false;
    }
    // A failed write means the server ended the stream: Finish has its status.
    if (!writer->Write(message)) break;
  }
  // An export that failed must not look like a complete stream: cancel
  // instead of half-closing.
  if (!export_failed.ok()) {
    import_context.TryCancel();
  } else {
    writer->WritesDone();
  }
  const grpc::Status status = writer->Finish();
  {
    absl::MutexLock lock(&box.mu);
    box.import_ended = true;
  }
  exporter.join();
  absl::MutexLock lock(&box.mu);
  // The export's own error explains an import cut short by it.
  if (!box.export_status.ok() && !absl::IsCancelled(box.export_status)) return box.export_status;
  if (!status.ok()) return FromGrpcStatus(status);
  v1::ImportResponse response;
  if (!grpc::SerializationTraits<v1::ImportResponse>::Deserialize(&response_bytes, &response).ok()) {
    return absl::DataLossError("the import's response does not parse");
  }
  return response;
}

absl::StatusOr<ScoreResult> Client::Score(const ScoreArgs& args) {
  if (absl::Status s = CheckSize("queries", args.queries, args.shape); !s.ok()) return s;
  v1::ScoreQueryRequest request;
  request.set_cache(args.cache);
  request.set_sequence_id(args.sequence_id);
  request.set_layer(args.layer);
  Encode(args.queries, args.shape, v1::DTYPE_F32, request.mutable_queries());
  request.set_token_begin(args.token_begin);
  request.set_token_end(args.token_end);
  request.set_scale(args.scale);
  request.set_top_k(args.top_k);
  request.set_logit_softcap(args.logit_softcap);
  v1::ScoreQueryResponse response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      args.sequence_id, [&](grpc::ClientContext* c) { return stub_->ScoreQuery(c, request, &response); }, &attempts);
  if (!status.ok()) return FromGrpcStatus(status);
  ScoreResult result;
  absl::StatusOr<std::vector<float>> logits = Decode(response.logits());
  if (!logits.ok()) return logits.status();
  result.logits = *std::move(logits);
  if (response.logits().shape_size() == 2) {
    result.query_heads = response.logits().shape(0);
    result.columns = response.logits().shape(1);
  }
  result.positions.assign(response.positions().begin(), response.positions().end());
  return result;
}

absl::StatusOr<std::vector<AttendOutput>> Client::Attend(const AttendArgs& args) {
  v1::AttendRequest request;
  request.set_cache(args.cache);
  request.set_scale(args.scale);
  request.set_logit_softcap(args.logit_softcap);
  request.set_return_lse(args.return_lse);
  request.set_output_dtype(args.output_dtype);
  if (!args.sink_logits.empty()) {
    const int64_t heads = static_cast<int64_t>(args.sink_logits.size());
    Encode(args.sink_logits, {&heads, 1}, v1::DTYPE_F32, request.mutable_sink_logits());
  }
  for (size_t i = 0; i < args.items.size(); ++i) {
    const AttendItemArgs& item = args.items[i];
    if (absl::Status s = CheckSize("queries", item.queries, item.shape); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("item ", i, ": ", s.message()));
    }
    v1::AttendItem* out = request.add_items();
    out->set_sequence_id(item.sequence_id);
    out->set_layer(item.layer);
    Encode(item.queries, item.shape, v1::DTYPE_F32, out->mutable_queries());
    if (item.first_query_position >= 0) out->set_first_query_position(item.first_query_position);
  }
  v1::AttendResponse response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      args.items.empty() ? absl::string_view() : args.items[0].sequence_id,
      [&](grpc::ClientContext* c) { return stub_->Attend(c, request, &response); }, &attempts);
  if (!status.ok()) return FromGrpcStatus(status);
  std::vector<AttendOutput> outputs(response.results_size());
  for (int i = 0; i < response.results_size(); ++i) {
    const v1::AttendResult& r = response.results(i);
    absl::StatusOr<std::vector<float>> output = Decode(r.output());
    if (!output.ok()) return output.status();
    outputs[i].output = *std::move(output);
    for (int d = 0; d < 3 && d < r.output().shape_size(); ++d) {
      outputs[i].shape[d] = r.output().shape(d);
    }
    if (args.return_lse) {
      absl::StatusOr<std::vector<float>> lse = Decode(r.lse());
      if (!lse.ok()) return lse.status();
      outputs[i].lse = *std::move(lse);
    }
  }
  return outputs;
}

absl::StatusOr<SequenceState> Client::CreateSequence(const std::string& cache, const std::string& id) {
  v1::CreateSequenceRequest request;
  request.set_cache(cache);
  request.set_sequence_id(id);
  v1::SequenceInfo response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      id, [&](grpc::ClientContext* c) { return stub_->CreateSequence(c, request, &response); }, &attempts);
  if (status.ok()) return FromProto(response);
  if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS && attempts > 1) {
    return GetSequence(cache, id);
  }
  return FromGrpcStatus(status);
}

absl::StatusOr<SequenceState> Client::ForkSequence(const std::string& cache, const std::string& parent,
                                                   const std::string& child) {
  v1::ForkSequenceRequest request;
  request.set_cache(cache);
  request.set_parent_id(parent);
  request.set_child_id(child);
  v1::SequenceInfo response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      parent, [&](grpc::ClientContext* c) { return stub_->ForkSequence(c, request, &response); }, &attempts);
  if (status.ok()) return FromProto(response);
  if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS && attempts > 1) {
    return GetSequence(cache, child);
  }
  return FromGrpcStatus(status);
}

absl::Status Client::DropSequence(const std::string& cache, const std::string& id) {
  v1::DropSequenceRequest request;
  request.set_cache(cache);
  request.set_sequence_id(id);
  v1::DropSequenceResponse response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      id, [&](grpc::ClientContext* c) { return stub_->DropSequence(c, request, &response); }, &attempts);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND && attempts > 1) {
    return absl::OkStatus();
  }
  return FromGrpcStatus(status);
}

absl::StatusOr<SequenceState> Client::GetSequence(const std::string& cache, const std::string& id) {
  v1::GetSequenceRequest request;
  request.set_cache(cache);
  request.set_sequence_id(id);
  v1::SequenceInfo response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      id, [&](grpc::ClientContext* c) { return stub_->GetSequence(c, request, &response); }, &attempts);
  if (!status.ok()) return FromGrpcStatus(status);
  return FromProto(response);
}

absl::StatusOr<v1::ServerInfo> Client::GetServerInfo() {
  v1::GetServerInfoRequest request;
  v1::ServerInfo response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      absl::string_view(), [&](grpc::ClientContext* c) { return stub_->GetServerInfo(c, request, &response); },
      &attempts);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<std::string> Client::InstanceFor(absl::string_view route_id) {
  v1::GetServerInfoRequest request;
  v1::ServerInfo response;
  int attempts = 0;
  const grpc::Status status = WithRetries(
      route_id, [&](grpc::ClientContext* c) { return stub_->GetServerInfo(c, request, &response); }, &attempts);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.instance_id();
}

absl::StatusOr<std::vector<std::string>> Client::ListSequences(const std::string& cache, const std::string& prefix) {
  std::vector<std::string> ids;
  v1::ListSequencesRequest request;
  request.set_cache(cache);
  request.set_id_prefix(prefix);
  request.set_max_ids(10000);
  for (;;) {
    v1::ListSequencesResponse response;
    int attempts = 0;
    const grpc::Status status = WithRetries(
        absl::string_view(), [&](grpc::ClientContext* c) { return stub_->ListSequences(c, request, &response); },
        &attempts);
    if (!status.ok()) return FromGrpcStatus(status);
    ids.insert(ids.end(), response.sequence_ids().begin(), response.sequence_ids().end());
    if (!response.more() || response.sequence_ids_size() == 0) return ids;
    request.set_start_after(ids.back());
  }
}

absl::StatusOr<v1::ImportResponse> Client::PullSequences(const v1::PullSequencesRequest& request) {
  grpc::ClientContext context;
  PrepareStream(&context, absl::string_view());
  v1::ImportResponse response;
  const grpc::Status status = stub_->PullSequences(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

}  // namespace tqkv
