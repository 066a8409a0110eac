// `tqkv load` (its default mode): a decode node's loop, as engines run it.
//
// Each of `clients` engines owns a batch of `batch` sequences. It prefills
// every one with `context` tokens of all layers (AppendStream in chunks, not
// timed), then plays `steps` decode steps. A step goes layer by layer, in
// order, and each layer stores one new token of every sequence and attends
// with that layer's query, in one of three shapes (variants):
//   unary   per layer: one Append per sequence (1 token, that layer), then
//           one Attend with an item per sequence: (batch + 1) calls a layer;
//   fused   per layer: one AppendAttend with an item per sequence;
//   stream  per layer: one DecodeStream message (an AppendAttend), on one
//           stream per engine opened before the first step.
// The client waits for each layer's answer before it sends the next layer,
// as an engine must (layer l's query depends on layer l-1's output).
//
// Every variant runs on fresh sequences of the same shape, one after the
// other in the same run, so the figures compare side by side. Between the
// prefill and the decode phase, and after it, the server's kernel timings
// (GetServerInfo: store, attend) are read: their difference is the kernels'
// time in the decode phase, and what the step time holds beyond it is the
// time outside the kernels (gRPC, serialization, validation, scheduling,
// the client).
//
// Thread safety: RunDecodeLoad is reentrant; it blocks until the run is over.
#ifndef TQKV_CLIENT_CLI_DECODE_LOAD_H_
#define TQKV_CLIENT_CLI_DECODE_LOAD_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cpp/tqkv_client.h"

namespace tqkv {
namespace cli {

enum class DecodeVariant { kUnary, kFused, kStream };
// "unary", "fused", "stream".
const char* DecodeVariantName(DecodeVariant variant);
// Parses a comma-separated list of variant names ("unary,fused,stream").
absl::StatusOr<std::vector<DecodeVariant>> ParseDecodeVariants(const std::string& list);

struct DecodeLoadOptions {
  // max_attempts is forced to 1: errors are counted, not retried away.
  ClientOptions client;
  std::string cache;  // "" means the server's default cache
  std::vector<DecodeVariant> variants = {DecodeVariant::kUnary, DecodeVariant::kFused, DecodeVariant::kStream};
  int clients = 1;         // engines, each with its own batch, concurrently
  int batch = 8;           // sequences per engine, attended together
  int64_t context = 1024;  // tokens prefilled per sequence
  int64_t steps = 16;      // decode steps per variant
  // Stop a variant's decode phase after this long (0: no time bound).
  double max_seconds_per_variant = 0;
  int layers = 0;  // [0, layers); 0: all the cache's layers
  int64_t prefill_chunk_tokens = 256;
  // Wire dtype of keys, values, queries and the attention outputs.
  v1::DType wire_dtype = v1::DTYPE_F32;
  uint64_t seed = 1;
  // Called about once a second from the calling thread: the variant running
  // and the steps done by all engines so far. May be empty.
  std::function<void(DecodeVariant variant, const char* phase, int64_t steps_done)> progress;
};

struct DecodeVariantReport {
  DecodeVariant variant = DecodeVariant::kUnary;
  int64_t steps = 0;  // decode steps completed, over all engines
  int64_t errors = 0;
  double rpcs_per_step = 0;  // calls (unary, fused) or stream messages
  double messages_per_step = 0;
  double step_p50_ms = 0;  // one decode step of one engine (all layers)
  double step_p99_ms = 0;
  double step_mean_ms = 0;
  // Server kernel time (store + attend) per step, and its share of the step;
  // -1 when the server reports no timings.
  double kernel_ms_per_step = -1;
  double kernel_share = -1;
  // Mean time per layer outside the kernels: (step - kernels) / layers, and
  // its two parts: in the server's handlers (validation, conversion, cache
  // bookkeeping, the executor's queue) and beyond them (gRPC on both sides,
  // the network, the client's own work).
  double outside_us_per_layer = -1;
  double server_us_per_layer = -1;
  double transport_us_per_layer = -1;
  double tokens_per_second_per_sequence = 0;
  double tokens_per_second = 0;  // over every sequence of every engine
  std::string first_error;       // "" when none
};

struct DecodeLoadReport {
  int layers = 0;
  int kv_heads = 0;
  int query_heads = 0;
  int head_dim = 0;
  std::vector<DecodeVariantReport> variants;  // in the order run
};

// Fails only when the run cannot start (bad options, GetServerInfo fails,
// unknown cache, a prefill that fails); decode errors are counted.
absl::StatusOr<DecodeLoadReport> RunDecodeLoad(const DecodeLoadOptions& options);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_DECODE_LOAD_H_
