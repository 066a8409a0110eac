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
// CRC, a header whose layout matches the cache, the trailer's counts), then
// imports it whole or not at all: a torn, corrupt or foreign file, one whose
// pages exceed the pool, or one with a sequence that does not load (a
// tenant's quota now smaller, say) leaves the cache empty, with one log line
// naming the problem, and the file is renamed to `<file>.skipped-<unix time,
// us>`, whole, so that the next snapshot does not overwrite it (when even the
// rename fails, the server refuses to snapshot that cache rather than write
// over the file). Pages that several sequences share travel once in the file
// (docs/export_format.md) and are shared again when loaded, so a cache whose
// sequences fit before a restart fits them after it. Temporary files of
// snapshot writes that never finished (a crash mid-write) are removed at
// start-up. A data directory serves one server at a time: its LOCK file is
// held (flock) while the Snapshotter lives.
//
// What a crash (kill -9) loses: every append since the last snapshot that
// completed. Sequences are saved one by one while traffic goes on, so a
// snapshot holds each sequence as it was when the snapshot reached it.
//
// Thread safety: SaveAll and LoadAll are serialized by a mutex.
#ifndef TQKV_SERVICE_SNAPSHOT_H_
#define TQKV_SERVICE_SNAPSHOT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
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
  // Takes `data_dir`'s LOCK file: FAILED_PRECONDITION when another process
  // holds it, INTERNAL when it cannot be opened. REQUIRES: the caches and
  // `auth` outlive the snapshotter; the directory exists.
  static absl::StatusOr<std::unique_ptr<Snapshotter>> Open(std::string data_dir, std::vector<KvCache*> caches,
                                                           const Authenticator* auth);
  ~Snapshotter();
  Snapshotter(const Snapshotter&) = delete;
  Snapshotter& operator=(const Snapshotter&) = delete;

  const std::string& data_dir() const { return data_dir_; }
  // The file of cache `name`.
  std::string PathOf(const std::string& name) const;

  // Writes every cache's file. Errors (I/O) name the file; the previous
  // snapshot of that cache is then left as it was.
  absl::StatusOr<v1::SaveSnapshotResponse> SaveAll();
  // Removes temporary files of unfinished writes, then loads every cache's
  // file that exists, whole or not at all, into caches that hold no
  // sequence yet. Returns one line per file (and per temporary file
  // removed), saying what was loaded or set aside and why.
  std::vector<std::string> LoadAll();

 private:
  Snapshotter(std::string data_dir, std::vector<KvCache*> caches, const Authenticator* auth);
  absl::StatusOr<v1::SnapshotFileInfo> Save(KvCache& cache) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Load(KvCache& cache) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> RemoveStaleTemporaries();
  // Renames a file that did not load out of the way; its log line.
  std::string SetAside(const std::string& path, const std::string& cache, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string data_dir_;
  const std::vector<KvCache*> caches_;
  const Authenticator* const auth_;
  int lock_fd_ = -1;
  absl::Mutex mu_;  // one SaveAll or LoadAll at a time
  // Files that did not load and could not be set aside: never written over.
  absl::flat_hash_set<std::string> not_loaded_ ABSL_GUARDED_BY(mu_);
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_SNAPSHOT_H_
