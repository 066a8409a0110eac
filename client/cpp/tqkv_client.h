// tqkv::Client: a typed C++ client for the tqkv.v1.KvCache service.
//
// Tensors go in as float32 spans with an explicit shape and come back as
// float32 vectors, whatever dtype travelled on the wire. Errors come back as
// absl::Status with the server's canonical code and message.
//
// Retries. A call that fails with UNAVAILABLE (server restarting, connection
// lost) is retried with exponential backoff and jitter, up to
// ClientOptions::max_attempts tries. That is safe for every rpc:
//  * reads (Score, Attend, GetSequence, GetServerInfo) change nothing;
//  * Append carries its start position, so an append that landed before the
//    connection broke is refused on retry with FAILED_PRECONDITION; the
//    client then reads the sequence and reports success when every layer of
//    the range holds at least start_position + tokens tokens (stored_bytes
//    are then 0: the bytes of the first, unacknowledged attempt are unknown);
//  * CreateSequence / ForkSequence answered ALREADY_EXISTS, and DropSequence
//    answered NOT_FOUND, on a retry count as success.
//  * AppendAttend carries its items' start positions: an item whose append
//    landed on an earlier attempt comes back already_stored, attended over
//    what is stored, not stored twice.
// AppendStream and DecodeStream are not retried (its chunks are not replayable by the client
// library); resend the missing tail with Append, from GetSequence's lengths.
//
// Routing. Every call that names a sequence carries the gRPC metadata
// `tqkv-route-key: RouteKey(id)` so that a proxy in front of several
// tqkv-servers can hash on it (deploy/haproxy/haproxy.cfg: consistent hashing
// on that header) and keep every call of a sequence on one server:
//  * calls that name one sequence (Append, AppendStream, ScoreQuery,
//    CreateSequence, DropSequence, GetSequence) send that sequence's key;
//  * ForkSequence sends the *parent's* key: name children `parent/child` and
//    they land on the parent's server, where the parent's pages are;
//  * Attend sends the key of its first item: a batch is routed as one, so
//    behind a router batch only sequences that share a routing key
//    ("chat-7/beam-0" with "chat-7/beam-1");
//  * GetServerInfo sends none (the proxy picks any server).
// The Python client sends the same header by the same rule. A key that is
// empty or holds bytes outside printable ASCII (or starts or ends with a
// space) cannot travel as an HTTP/2 header value: such calls go without the
// header, which a single server never needs.
//
// Thread safety: a Client is thread-safe; share one per process and target.
#ifndef TQKV_CLIENT_CPP_TQKV_CLIENT_H_
#define TQKV_CLIENT_CPP_TQKV_CLIENT_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "tqkv/v1/kvcache.grpc.pb.h"

namespace tqkv {

// The reverse of the server's conversion: same code, same message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// The gRPC metadata key that carries a call's routing key (lower case, as
// HTTP/2 requires). Contract: proxies and the Python client use the same.
inline constexpr char kRouteKeyMetadata[] = "tqkv-route-key";

// The routing key of a sequence id: the id's text before its first '/', or
// the whole id when it has none. "chat-7/beam-2" -> "chat-7"; "chat-7" ->
// "chat-7"; "/x" -> "" (no usable key: ids should not start with '/').
std::string RouteKey(absl::string_view sequence_id);

struct ClientOptions {
  // host:port of a tqkv-server.
  std::string target = "localhost:50051";
  // Channel credentials. When null: TLS if use_tls or tls_root_certs_pem is
  // set, else plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // TLS with these PEM root certificates (contents, not a path); empty with
  // use_tls: the system's roots.
  bool use_tls = false;
  std::string tls_root_certs_pem;
  // The name the server's certificate must carry, when it differs from the
  // target's host (tests with a self-signed "localhost" cert on 127.0.0.1).
  std::string tls_server_name_override;
  // Bearer token sent as `authorization: Bearer <token>` on every call;
  // empty: none.
  std::string auth_token;
  // Tries per call on UNAVAILABLE (1: no retry).
  int max_attempts = 4;
  // Backoff before retry n is min(initial * 2^(n-1), max), +-20% jitter.
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  // Deadline of each attempt.
  absl::Duration timeout = absl::Seconds(60);
  // Deadline of a DecodeStream (it lives for many steps): none by default.
  absl::Duration stream_timeout = absl::InfiniteDuration();
  // Largest message either way, bytes (match the server's --max_message_bytes).
  int max_message_bytes = 64 << 20;
  // Send the `tqkv-route-key` metadata (see "Routing" above). Costs one short
  // header per call; turn off only for a proxy that must not see ids.
  bool send_route_key = true;
};

struct SequenceState {
  std::string cache;
  std::string sequence_id;
  std::vector<int64_t> layer_tokens;  // per layer
  int32_t pages = 0;
  // Oldest token held per layer (0 but in sliding-window layers).
  std::vector<int64_t> layer_oldest_token;
  // The bytes the sequence holds as the pool counts them (compressed tokens,
  // exact copies, key means), and its tokens in bf16.
  int64_t stored_bytes = 0;
  int64_t stored_bytes_bf16 = 0;
};

struct AppendArgs {
  std::string cache;  // "" means "default"
  std::string sequence_id;
  int64_t start_position = 0;
  int layer_begin = 0;  // [layer_begin, layer_end); layer_end 0 means all
  int layer_end = 0;
  // [layers, tokens, kv_heads, head_dim] row-major, both of `shape`.
  std::array<int64_t, 4> shape = {0, 0, 0, 0};
  absl::Span<const float> keys;
  absl::Span<const float> values;
  bool create_if_missing = true;
  // Wire dtype: f16 / bf16 halve the bytes sent (rounded to nearest even).
  v1::DType wire_dtype = v1::DTYPE_F32;
  // Idempotency key sent with every attempt (AppendRequest.request_id). ""
  // derives one from the append's content (sequence, position, layers, the
  // encoded K/V): a resend of the same append, by the client's retries or by
  // the caller, is then answered already_stored, and another writer's append
  // at the same position is not mistaken for this one.
  std::string request_id;
};

struct AppendResult {
  SequenceState sequence;
  int64_t stored_bytes = 0;       // the change to the sequence's bytes as the pool counts them
  int64_t stored_bytes_bf16 = 0;  // the same for its tokens in bf16 (see the proto)
  // A retry found this call's append already stored (by its request_id):
  // nothing was stored again, and the byte counts are 0.
  bool already_stored = false;
};

struct ScoreArgs {
  std::string cache;
  std::string sequence_id;
  int layer = 0;
  // [query_heads, head_dim] of `shape`.
  std::array<int64_t, 2> shape = {0, 0};
  absl::Span<const float> queries;
  int64_t token_begin = 0;
  int64_t token_end = 0;  // 0: the layer's length
  float scale = 0.0f;     // 0: 1 / sqrt(head_dim)
  int top_k = 0;          // 0: every logit
  // > 0: logits returned soft-capped, cap * tanh(x / cap) (see the proto).
  float logit_softcap = 0.0f;
};

struct ScoreResult {
  int64_t query_heads = 0;
  int64_t columns = 0;             // tokens, or top-k entries per head
  std::vector<float> logits;       // [query_heads, columns]
  std::vector<int64_t> positions;  // with top_k: token of each logit
};

struct AttendItemArgs {
  std::string sequence_id;
  int layer = 0;
  // [query_tokens, query_heads, head_dim] of `shape`.
  std::array<int64_t, 3> shape = {1, 0, 0};
  absl::Span<const float> queries;
  // -1: the query tokens are the layer's last stored ones. >= 0: query token
  // i sits at this position + i and sees the stored tokens up to it (see the
  // proto's AttendItem.first_query_position).
  int64_t first_query_position = -1;
};

struct AttendArgs {
  std::string cache;
  std::vector<AttendItemArgs> items;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  bool return_lse = false;
  v1::DType output_dtype = v1::DTYPE_F32;  // converted back to float32 here
  // [query_heads] learned sink logits (see the proto); empty: none.
  std::vector<float> sink_logits;
  // > 0: Gemma 2's logit soft-capping, cap * tanh(x / cap) on every logit
  // before the softmax (see the proto); 0: none.
  float logit_softcap = 0.0f;
};

struct AttendOutput {
  std::array<int64_t, 3> shape = {0, 0, 0};  // [query_tokens, query_heads, head_dim]
  std::vector<float> output;
  std::vector<float> lse;  // [query_tokens, query_heads] with return_lse
};

// One sequence of an AppendAttend: its new tokens for the call's layer.
struct AppendAttendItemArgs {
  std::string sequence_id;
  int64_t start_position = 0;
  // keys and values [tokens, kv_heads, head_dim] of kv_shape; queries
  // [tokens, query_heads, head_dim] of query_shape (the same tokens).
  std::array<int64_t, 3> kv_shape = {1, 0, 0};
  std::array<int64_t, 3> query_shape = {1, 0, 0};
  absl::Span<const float> keys;
  absl::Span<const float> values;
  absl::Span<const float> queries;
  bool create_if_missing = true;
  // As AppendArgs::request_id ("" derives one from the item's content).
  std::string request_id;
};

struct AppendAttendArgs {
  std::string cache;
  int layer = 0;
  std::vector<AppendAttendItemArgs> items;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  bool return_lse = false;
  v1::DType output_dtype = v1::DTYPE_F32;
  // Wire dtype of keys, values and queries.
  v1::DType wire_dtype = v1::DTYPE_F32;
  // [query_heads] learned sink logits; empty: none.
  std::vector<float> sink_logits;
  // As AttendArgs::logit_softcap.
  float logit_softcap = 0.0f;
};

struct AppendAttendItemResult {
  // The item's own status: NOT_FOUND, FAILED_PRECONDITION (position),
  // RESOURCE_EXHAUSTED... Its append did not happen unless OK.
  absl::Status status;
  AttendOutput attention;    // with an OK status
  int64_t layer_tokens = 0;  // tokens the layer holds after the call
  bool already_stored = false;
};

struct AppendAttendResult {
  std::vector<AppendAttendItemResult> items;  // one per item, in order
  int64_t stored_bytes = 0;
  int64_t stored_bytes_bf16 = 0;
};

// The request an AppendAttendArgs describes (INVALID_ARGUMENT when a span's
// size does not match its shape); for callers that build DecodeStream
// requests once and resend them.
absl::Status FillAppendAttendRequest(const AppendAttendArgs& args, v1::AppendAttendRequest* request);
absl::StatusOr<AppendAttendResult> FromProto(const v1::AppendAttendResponse& response, bool with_lse);

// A DecodeStream: an engine's decode loop, one AppendAttend per message (see
// the proto for ordering, flow control, errors and resuming). Send may run
// ahead of Receive (pipelining); responses come back in the order sent.
// Thread safety: one thread may Send while another Receives; neither method
// may be called from two threads at once.
class DecodeStream {
 public:
  struct Response {
    uint64_t request_id = 0;
    // The request's status: OK, or why the whole request failed (malformed,
    // server queue full); per-item errors are in result.items.
    absl::Status status;
    AppendAttendResult result;
  };

  ~DecodeStream();  // cancels the stream if it was not closed

  // Sends one step; returns its request id (1, 2, ...). Fails when the
  // stream has ended (Receive or Close tell why).
  absl::StatusOr<uint64_t> Send(const AppendAttendArgs& step);
  // The same with a prepared request (its request_id is set here).
  absl::StatusOr<uint64_t> Send(v1::AppendAttendRequest step, bool with_lse);
  // The next response, in order. An error: the stream ended, with its status.
  absl::StatusOr<Response> Receive();
  // Send, then Receive: the result, or the request's or the stream's error.
  absl::StatusOr<AppendAttendResult> Step(const AppendAttendArgs& step);
  // Half-closes, reads what is still in flight (discarded) and returns the
  // stream's final status.
  absl::Status Close();

 private:
  friend class Client;
  DecodeStream() = default;

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeStreamRequest, v1::DecodeStreamResponse>> stream_;
  uint64_t next_id_ = 1;
  std::vector<bool> with_lse_;  // by request id - 1: decode lse?
  bool writes_done_ = false;
  bool finished_ = false;
  absl::Status final_status_;
};

class Client;

// Moves sequences between servers at their compressed size: exports
// `request` from `from` and imports it into `to` (into `target_cache`; empty:
// the exported cache's name), relaying message by message (one message in
// memory). The sequences stay on `from`: drop them there once the move is
// confirmed.
absl::StatusOr<v1::ImportResponse> CopySequences(Client& from, Client& to, const v1::ExportRequest& request,
                                                 const std::string& target_cache = "");

class Client {
 public:
  explicit Client(ClientOptions options);
  // Over an existing channel (tests, custom channel arguments).
  Client(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  absl::StatusOr<AppendResult> Append(const AppendArgs& args);
  // One stream; chunks in order (start positions advancing). Not retried.
  absl::StatusOr<AppendResult> AppendStream(absl::Span<const AppendArgs> chunks);
  absl::StatusOr<ScoreResult> Score(const ScoreArgs& args);
  absl::StatusOr<std::vector<AttendOutput>> Attend(const AttendArgs& args);
  // One layer of a decode step for a batch of sequences. The call's errors
  // as the status; each item's in its result.
  absl::StatusOr<AppendAttendResult> AppendAttend(const AppendAttendArgs& args);
  // Opens a decode stream; `route_id` is a sequence id whose routing key the
  // stream carries (see "Routing"; "" for none).
  std::unique_ptr<DecodeStream> OpenDecodeStream(absl::string_view route_id = "");

  absl::StatusOr<SequenceState> CreateSequence(const std::string& cache, const std::string& id);
  absl::StatusOr<SequenceState> ForkSequence(const std::string& cache, const std::string& parent,
                                             const std::string& child);
  absl::Status DropSequence(const std::string& cache, const std::string& id);
  absl::StatusOr<SequenceState> GetSequence(const std::string& cache, const std::string& id);
  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  // PullSequences: this client's server exports from request.source and
  // imports it, with no relay (admin token). Under stream_timeout.
  absl::StatusOr<v1::ImportResponse> PullSequences(const v1::PullSequencesRequest& request);
  // GetServerInfo routed by `route_id`'s routing key: behind a router, the
  // instance_id of the server that key goes to.
  absl::StatusOr<std::string> InstanceFor(absl::string_view route_id);
  // Every sequence id of `cache` starting with `prefix`, in byte order
  // (ListSequences, page by page).
  absl::StatusOr<std::vector<std::string>> ListSequences(const std::string& cache, const std::string& prefix = "");

  // ExportSequences: `sink` gets every message of the stream in order (a
  // header, per sequence its state and pages, a trailer); an error from the
  // sink cancels the stream and is returned. Under stream_timeout.
  absl::Status ExportSequences(const v1::ExportRequest& request,
                               const std::function<absl::Status(v1::ExportChunk&)>& sink);
  // ImportSequences fed by `next`, which fills the next message and returns
  // true, or returns false at the end of the stream. Under stream_timeout.
  absl::StatusOr<v1::ImportResponse> ImportSequences(const std::function<absl::StatusOr<bool>(v1::ExportChunk*)>& next);

  v1::KvCache::Stub& stub() { return *stub_; }

 private:
  friend absl::StatusOr<v1::ImportResponse> CopySequences(Client& from, Client& to, const v1::ExportRequest& request,
                                                          const std::string& target_cache);
  // Deadline, auth and routing metadata of every call; `route_id` is the
  // sequence id whose routing key the call carries ("" for none).
  void Prepare(grpc::ClientContext* context, absl::string_view route_id) const;
  // Prepare, with stream_timeout as the deadline (streams live long).
  void PrepareStream(grpc::ClientContext* context, absl::string_view route_id) const;
  // Runs `rpc(context)` up to max_attempts times while it returns
  // UNAVAILABLE; *attempts receives the number of tries.
  template <typename Rpc>
  grpc::Status WithRetries(absl::string_view route_id, Rpc rpc, int* attempts);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

}  // namespace tqkv

#endif  // TQKV_CLIENT_CPP_TQKV_CLIENT_H_
