// The served methods of tqkv.v1.KvCache, one row each. The Rpc enum, its
// count, the metric labels and the proto method each serves all come from
// this table; CheckRpcTable compares it with the proto's service descriptor
// (the server refuses to start on a mismatch, and rpc_table_test checks it).
//
// Adding an rpc: a row here (its place fixes its Rpc value: append), the
// handler (service/kv_cache_service.h: a Do* method registered in the
// constructor, or a reactor), its raw method in RawKvCacheService, and the
// row in docs/service.md. CheckRpcTable names what is missing.
#ifndef TQKV_SERVICE_RPC_TABLE_H_
#define TQKV_SERVICE_RPC_TABLE_H_

#include "absl/status/status.h"

namespace tqkv {
namespace service {

// How a method's messages flow, as the proto declares it.
enum class RpcShape { kUnary, kClientStream, kServerStream, kBidiStream };

// X(enumerator, proto method, metric label, shape). The label is the
// `method` label of the tqkv_rpc_* metrics and of ServerInfo.rpc_timings;
// it differs from the method where a row counts something else than a call
// (kDecodeStreamStep: one DecodeStream message, read to answer queued).
#define TQKV_RPC_TABLE(X)                                                  \
  X(kAppend, "Append", "Append", kUnary)                                   \
  X(kAppendStream, "AppendStream", "AppendStream", kClientStream)          \
  X(kScoreQuery, "ScoreQuery", "ScoreQuery", kUnary)                       \
  X(kAttend, "Attend", "Attend", kUnary)                                   \
  X(kCreateSequence, "CreateSequence", "CreateSequence", kUnary)           \
  X(kForkSequence, "ForkSequence", "ForkSequence", kUnary)                 \
  X(kDropSequence, "DropSequence", "DropSequence", kUnary)                 \
  X(kGetSequence, "GetSequence", "GetSequence", kUnary)                    \
  X(kGetServerInfo, "GetServerInfo", "GetServerInfo", kUnary)              \
  X(kAppendAttend, "AppendAttend", "AppendAttend", kUnary)                 \
  X(kDecodeStreamStep, "DecodeStream", "DecodeStreamStep", kBidiStream)    \
  X(kExportSequences, "ExportSequences", "ExportSequences", kServerStream) \
  X(kImportSequences, "ImportSequences", "ImportSequences", kClientStream) \
  X(kSaveSnapshot, "SaveSnapshot", "SaveSnapshot", kUnary)                 \
  X(kListSequences, "ListSequences", "ListSequences", kUnary)              \
  X(kPullSequences, "PullSequences", "PullSequences", kUnary)

enum class Rpc {
#define TQKV_RPC_ENUMERATOR(name, method, label, shape) name,
  TQKV_RPC_TABLE(TQKV_RPC_ENUMERATOR)
#undef TQKV_RPC_ENUMERATOR
};

#define TQKV_RPC_COUNT(name, method, label, shape) +1
inline constexpr int kNumRpcs = 0 TQKV_RPC_TABLE(TQKV_RPC_COUNT);
#undef TQKV_RPC_COUNT

struct RpcRow {
  Rpc rpc;
  const char* method;  // in tqkv.v1.KvCache
  const char* label;   // in metrics
  RpcShape shape;
};

inline constexpr RpcRow kRpcTable[kNumRpcs] = {
#define TQKV_RPC_ROW(name, method, label, shape) {Rpc::name, method, label, RpcShape::shape},
    TQKV_RPC_TABLE(TQKV_RPC_ROW)
#undef TQKV_RPC_ROW
};

inline const RpcRow& RowOf(Rpc rpc) { return kRpcTable[static_cast<int>(rpc)]; }

// OK when every method of tqkv.v1.KvCache has exactly one row, with the
// proto's streaming shape, and every row names a method of it; INTERNAL
// naming the first difference otherwise.
absl::Status CheckRpcTable();

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_RPC_TABLE_H_
