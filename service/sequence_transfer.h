// ExportSequences and ImportSequences: moving sequences between servers at
// their compressed size (docs/export_format.md), over KvCache::BeginExport /
// BeginImport. Also the conversions between a SequenceImage's state and its
// proto, and the layout comparison an import makes, which snapshots share.
//
// Export runs as a bidirectional reactor of one request (the token is
// checked when the headers arrive), then writes: a header, per sequence its
// state and its pages in messages of about kExportMessageBytes, a trailer.
// Each message is produced on the executor after the one before it has been
// written, so a slow reader holds one message of memory, pins of the
// sequence being sent, and no thread.
//
// Import reads messages one at a time on the executor; pages go straight to
// the pool (SequenceImport), so a sequence's bytes are never held whole.
#ifndef TQKV_SERVICE_SEQUENCE_TRANSFER_H_
#define TQKV_SERVICE_SEQUENCE_TRANSFER_H_

#include <cstdint>
#include <string>

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/kv_cache.h"
#include "service/auth.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {

class KvCacheService;

// The format version an export writes: 3 since pages several sequences of
// a stream share travel once (ExportedSequence.shared_pages). An import also
// reads version 2 (the same without shared pages); version 1 pages held the
// codes planes token-major (before docs/format.md's tiles), and are refused.
inline constexpr uint32_t kExportFormatVersion = 3;
inline constexpr uint32_t kOldestImportableFormatVersion = 2;
// Page bytes per ExportPages message (at least one page per message).
inline constexpr int64_t kExportMessageBytes = int64_t{2} << 20;

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewExportReactor(KvCacheService* service,
                                                                              grpc::CallbackServerContext* context);
grpc::ServerReadReactor<grpc::ByteBuffer>* NewImportReactor(KvCacheService* service,
                                                            grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response);

// The protobuf bytes before and after `size` page bytes that make them an
// ExportChunk holding ExportPages {first_page, data, crc32c}: how page
// messages are written without copying the pages into a message first.
void FramePagesChunk(int64_t first_page, size_t size, uint32_t crc, std::string* prefix, std::string* suffix);

// PullSequences: runs ExportSequences against request.source and imports
// the stream here (on the calling thread, an executor thread, for the whole
// transfer). Admins only.
absl::Status PullSequences(KvCacheService* service, const Caller& caller, const v1::PullSequencesRequest& request,
                           v1::ImportResponse* response);

// A cache's header: its resolved config, page bytes, the format version.
v1::ExportHeader MakeExportHeader(const KvCache& cache);
// OK when an export with `header` can be imported into `cache` (format
// versions kOldestImportableFormatVersion .. kExportFormatVersion);
// FAILED_PRECONDITION naming the format version or the layout fields that
// differ otherwise.
absl::Status CheckImportable(const v1::ExportHeader& header, const KvCache& cache);

// A sequence's state (SequenceImage without pages) and back. FromProto
// checks only sizes against `cache`'s layout (BeginImport checks the rest).
void ToProto(const SequenceImage& state, v1::ExportedSequence* out);
absl::StatusOr<SequenceImage> FromProto(const v1::ExportedSequence& in, const KvCache& cache);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_SEQUENCE_TRANSFER_H_
