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
// AppendStream is not retried (its chunks are not replayable by the client
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
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
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
};

struct AppendResult {
  SequenceState sequence;
  int64_t stored_bytes = 0;       // compressed bytes this call stored
  int64_t stored_bytes_bf16 = 0;  // the same tokens in bf16
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
};

struct ScoreResult {
  int64_t query_heads = 0;
  int64_t columns = 0;          // tokens, or top-k entries per head
  std::vector<float> logits;    // [query_heads, columns]
  std::vector<int64_t> positions;  // with top_k: token of each logit
};

struct AttendItemArgs {
  std::string sequence_id;
  int layer = 0;
  // [query_tokens, query_heads, head_dim] of `shape`.
  std::array<int64_t, 3> shape = {1, 0, 0};
  absl::Span<const float> queries;
};

struct AttendArgs {
  std::string cache;
  std::vector<AttendItemArgs> items;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  bool return_lse = false;
  v1::DType output_dtype = v1::DTYPE_F32;  // converted back to float32 here
};

struct AttendOutput {
  std::array<int64_t, 3> shape = {0, 0, 0};  // [query_tokens, query_heads, head_dim]
  std::vector<float> output;
  std::vector<float> lse;  // [query_tokens, query_heads] with return_lse
};

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

  absl::StatusOr<SequenceState> CreateSequence(const std::string& cache, const std::string& id);
  absl::StatusOr<SequenceState> ForkSequence(const std::string& cache, const std::string& parent,
                                             const std::string& child);
  absl::Status DropSequence(const std::string& cache, const std::string& id);
  absl::StatusOr<SequenceState> GetSequence(const std::string& cache, const std::string& id);
  absl::StatusOr<v1::ServerInfo> GetServerInfo();

  v1::KvCache::Stub& stub() { return *stub_; }

 private:
  // Deadline, auth and routing metadata of every call; `route_id` is the
  // sequence id whose routing key the call carries ("" for none).
  void Prepare(grpc::ClientContext* context, absl::string_view route_id) const;
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
