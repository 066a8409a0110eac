// `tqkv load`: a load generator over tqkv::Client that plays a realistic
// prefill/decode mix against a tqkv-server.
//
// Each of `clients` threads loops over sequences: a prefill (one Append of all
// layers, or an AppendStream in chunks when the prefill is longer than
// prefill_chunk_tokens), then decode_steps steps of { Append one token to all
// layers; one Attend call with one item per layer (one query token each) },
// with a ScoreQuery (top_k) every score_every steps, then DropSequence. Data
// comes from tqkv::Random seeded by (seed, client): the same options give the
// same bytes.
//
// The run stops at whichever bound comes first: duration_seconds of wall time
// or `requests` calls in total (0: that bound is off; at least one must be on).
// A sequence interrupted by the stop is still dropped.
//
// A server that goes away does not get hammered: after a call fails with
// UNAVAILABLE (nothing answered, or the server said it cannot serve), that
// client waits before its next call, 50 ms doubling to 1 s, until a call
// succeeds. When no call has succeeded for give_up_seconds since the first
// such failure, the run stops and LoadReport::server_lost says why.
//
// Thread safety: RunLoad is reentrant; it blocks until the run is over.
#ifndef TQKV_CLIENT_CLI_LOAD_GENERATOR_H_
#define TQKV_CLIENT_CLI_LOAD_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cpp/tqkv_client.h"

namespace tqkv {
namespace cli {

struct LoadOptions {
  // Where and how to connect (target, TLS, token). max_attempts is forced to
  // 1: the load generator counts errors rather than hiding them in retries.
  ClientOptions client;
  std::string cache;  // "" means the server's default cache
  int clients = 8;
  double duration_seconds = 10;
  int64_t requests = 0;
  int64_t prefill_tokens = 512;
  // Prefills longer than this go as an AppendStream of chunks this long.
  int64_t prefill_chunk_tokens = 64;
  int64_t decode_steps = 64;
  // Sequences each client plays before it stops (0: until a bound is hit).
  int64_t sequences_per_client = 0;
  // Layers appended and attended, [0, layers); 0: all the cache's layers.
  int layers = 0;
  // A ScoreQuery every this many decode steps (0: never), top_k logits.
  int score_every = 16;
  int top_k = 8;
  uint64_t seed = 1;
  // Stop the run once calls have failed with UNAVAILABLE, and none has
  // succeeded, for this long (> 0).
  double give_up_seconds = 10;
  // Called about once a second from the calling thread with the elapsed
  // seconds, calls and errors so far (the live progress line). May be empty.
  std::function<void(double elapsed, int64_t calls, int64_t errors)> progress;
};

struct MethodStats {
  std::string method;  // "Append", "AppendStream", "Attend", "ScoreQuery", "DropSequence"
  int64_t calls = 0;   // including errors
  int64_t errors = 0;
  double calls_per_second = 0;
  double p50_ms = 0;  // latency of successful and failed calls alike
  double p99_ms = 0;
};

struct LoadReport {
  double elapsed_seconds = 0;
  int64_t calls = 0;
  int64_t errors = 0;
  int64_t tokens_appended = 0;
  std::vector<MethodStats> methods;  // only methods that were called
  std::string first_error;           // "" when none
  // Set when the run stopped because the server stopped answering (see
  // give_up_seconds): the last UNAVAILABLE status; OK otherwise.
  absl::Status server_lost;
  // Server-side, over the run (from GetServerInfo before and after): summed
  // Attend rpc seconds and the attend kernel's share of them; -1 when the
  // server did not report timings.
  double server_attend_seconds = -1;
  double attend_kernel_share = -1;
};

// Plays the load. Fails only when the run cannot start (bad options,
// GetServerInfo fails, unknown cache); errors during the run are counted in
// the report.
absl::StatusOr<LoadReport> RunLoad(const LoadOptions& options);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_LOAD_GENERATOR_H_
