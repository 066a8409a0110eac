// Snapshots: a server with a data directory (--data_dir) writes every
// sequence of every cache to disk on graceful shutdown, on demand
// (SaveSnapshot) and every --snapshot_interval_seconds, and loads them when
// it starts. Without a data directory nothing is written or read.
//
// A snapshot file, one per cache (`<data_dir>/<cache>.tqkv-snapshot`), is
// the cache's export stream (docs/export_format.md) as records: the magic
// "TQKVSNP1", then per ExportChunk message a little-endian u32 length, a u32
// CRC-32C of the message bytes, and the message. It is written to a
// temporary file, flushed to disk (fsync) and renamed over the old one, so a
// crash leaves the previous snapshot or the new one, never a mix.
//
// Loading verifies the whole file first (magic, every record's length and
// CRC, a header whose layout matches the cache, the trailer's counts); a
// torn, corrupt or foreign file is skipped whole with one log line, never
// half-loaded; it is renamed to `<file>.skipped-<unix time, us>` so that the
// next snapshot does not overwrite it. Then each sequence is imported as ImportSequences would; a
// sequence that does not fit (a smaller pool now, a tenant's quota) is
// skipped with a log line, the others load.
//
// What a crash (kill -9) loses: every append since the last snapshot that
// completed. Sequences are saved one by one while traffic goes on, so a
// snapshot holds each sequence as it was when the snapshot reached it.
//
// Thread safety: SaveAll and LoadAll are serialized by a mutex.
#ifndef TQKV_SERVICE_SNAPSHOT_H_
#define TQKV_SERVICE_SNAPSHOT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache/kv_cache.h"
#include "service/auth.h"
#include "tqkv/v1/kvcache.pb.h"

namespace tqkv {
namespace service {

inline constexpr char kSnapshotMagic[] = "TQKVSNP1";

class Snapshotter {
 public:
  // REQUIRES: the caches and `auth` outlive the snapshotter.
  Snapshotter(std::string data_dir, std::vector<KvCache*> caches, const Authenticator* auth);

  const std::string& data_dir() const { return data_dir_; }
  // The file of cache `name`.
  std::string PathOf(const std::string& name) const;

  // Writes every cache's file. Errors (I/O) name the file; the previous
  // snapshot of that cache is then left as it was.
  absl::StatusOr<v1::SaveSnapshotResponse> SaveAll();
  // Loads every cache's file that exists, into caches that hold no sequence
  // yet. Returns one line per file, saying what was loaded or skipped and why.
  std::vector<std::string> LoadAll();

 private:
  absl::StatusOr<v1::SnapshotFileInfo> Save(KvCache& cache);
  std::string Load(KvCache& cache);

  const std::string data_dir_;
  const std::vector<KvCache*> caches_;
  const Authenticator* const auth_;
  absl::Mutex mu_;  // one SaveAll or LoadAll at a time
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_SNAPSHOT_H_
