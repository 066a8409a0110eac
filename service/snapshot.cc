#include "service/snapshot.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "service/crc32c.h"
#include "service/sequence_transfer.h"

namespace tqkv {
namespace service {
namespace {

constexpr size_t kMagicBytes = 8;
constexpr char kSnapshotSuffix[] = ".tqkv-snapshot";
// A snapshot being written; renamed over the file when complete.
constexpr char kTemporarySuffix[] = ".tmp";
// No record is larger: a page message of kExportMessageBytes, or one page,
// plus its framing; a sequence's state is far smaller than a pool.
constexpr uint64_t kMaxRecordBytes = uint64_t{1} << 31;

void PutU32(uint32_t v, uint8_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetU32(const uint8_t* in) {
  return static_cast<uint32_t>(in[0]) | static_cast<uint32_t>(in[1]) << 8 | static_cast<uint32_t>(in[2]) << 16 |
         static_cast<uint32_t>(in[3]) << 24;
}

absl::Status IoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrFormat("%s '%s': %s", what, path, std::strerror(errno)));
}

// A snapshot being written: records to a temporary file, then renamed.
class SnapshotWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SnapshotWriter>> Open(const std::string& path) {
    std::unique_ptr<SnapshotWriter> w(new SnapshotWriter(path));
    w->file_ = std::fopen(w->tmp_.c_str(), "wb");
    if (w->file_ == nullptr) return IoError("cannot create", w->tmp_);
    RETURN_IF_ERROR(w->Write(kSnapshotMagic, kMagicBytes));
    return w;
  }
  ~SnapshotWriter() {
    if (file_ != nullptr) {
      std::fclose(file_);
      std::remove(tmp_.c_str());  // not committed
    }
  }

  // One record: the message's bytes in parts (written back to back).
  absl::Status Record(std::initializer_list<std::pair<const void*, size_t>> parts) {
    uint32_t crc = 0;
    uint64_t size = 0;
    for (const auto& [data, n] : parts) {
      crc = Crc32c(crc, data, n);
      size += n;
    }
    uint8_t head[8];
    PutU32(static_cast<uint32_t>(size), head);
    PutU32(crc, head + 4);
    RETURN_IF_ERROR(Write(head, sizeof(head)));
    for (const auto& [data, n] : parts) RETURN_IF_ERROR(Write(data, n));
    return absl::OkStatus();
  }
  absl::Status Record(const v1::ExportChunk& chunk) {
    const std::string bytes = chunk.SerializeAsString();
    return Record({{bytes.data(), bytes.size()}});
  }

  // Flushes to disk and renames over the old snapshot.
  absl::Status Commit() {
    if (std::fflush(file_) != 0 || fsync(fileno(file_)) != 0) return IoError("cannot write", tmp_);
    if (std::fclose(file_) != 0) {
      file_ = nullptr;
      return IoError("cannot close", tmp_);
    }
    file_ = nullptr;
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0) return IoError("cannot rename over", path_);
    // The rename itself is durable once the directory is.
    const std::string dir = path_.substr(0, path_.find_last_of('/') == std::string::npos ? 0 : path_.find_last_of('/'));
    if (int fd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY); fd >= 0) {
      fsync(fd);
      close(fd);
    }
    return absl::OkStatus();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  explicit SnapshotWriter(std::string path) : path_(std::move(path)), tmp_(path_ + kTemporarySuffix) {}
  absl::Status Write(const void* data, size_t n) {
    if (n > 0 && std::fwrite(data, 1, n, file_) != n) return IoError("cannot write", tmp_);
    bytes_ += n;
    return absl::OkStatus();
  }
  const std::string path_, tmp_;
  std::FILE* file_ = nullptr;
  uint64_t bytes_ = 0;
};

// Reads a snapshot's records in order.
class SnapshotReader {
 public:
  static absl::StatusOr<std::unique_ptr<SnapshotReader>> Open(const std::string& path) {
    std::unique_ptr<SnapshotReader> r(new SnapshotReader());
    r->file_ = std::fopen(path.c_str(), "rb");
    if (r->file_ == nullptr) return IoError("cannot open", path);
    char magic[kMagicBytes];
    if (std::fread(magic, 1, kMagicBytes, r->file_) != kMagicBytes ||
        std::memcmp(magic, kSnapshotMagic, kMagicBytes) != 0) {
      return absl::DataLossError("not a tqkv snapshot (no TQKVSNP1 magic)");
    }
    r->offset_ = kMagicBytes;
    return r;
  }
  ~SnapshotReader() {
    if (file_ != nullptr) std::fclose(file_);
  }

  // The next record's message; false at a clean end of file. DATA_LOSS for
  // a torn or corrupt record (naming its offset).
  absl::StatusOr<bool> Next(v1::ExportChunk* chunk) {
    uint8_t head[8];
    const size_t got = std::fread(head, 1, sizeof(head), file_);
    if (got == 0 && std::feof(file_)) return false;
    if (got != sizeof(head)) return absl::DataLossError(absl::StrFormat("a record cut short at byte %d", offset_));
    const uint32_t size = GetU32(head), crc = GetU32(head + 4);
    if (size > kMaxRecordBytes) {
      return absl::DataLossError(absl::StrFormat("a record of %d bytes at byte %d", size, offset_));
    }
    buffer_.resize(size);
    if (std::fread(buffer_.data(), 1, size, file_) != size) {
      return absl::DataLossError(absl::StrFormat("a record cut short at byte %d", offset_));
    }
    if (Crc32c(0, buffer_.data(), size) != crc) {
      return absl::DataLossError(absl::StrFormat("the record at byte %d does not match its CRC-32C", offset_));
    }
    if (!chunk->ParseFromString(buffer_)) {
      return absl::DataLossError(absl::StrFormat("the record at byte %d is not an ExportChunk", offset_));
    }
    offset_ += sizeof(head) + size;
    return true;
  }

 private:
  SnapshotReader() = default;
  std::FILE* file_ = nullptr;
  uint64_t offset_ = 0;
  std::string buffer_;
};

// What a verified snapshot holds.
struct FileSummary {
  int64_t sequences = 0;
  int64_t pages = 0;  // carried: what a load allocates
};

// Checks a whole snapshot of `cache` without changing anything: its records,
// its header against the cache's layout, its structure and trailer.
absl::Status Verify(const std::string& path, const KvCache& cache, FileSummary* summary) {
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotReader> reader, SnapshotReader::Open(path));
  v1::ExportChunk chunk;
  ASSIGN_OR_RETURN(bool more, reader->Next(&chunk));
  if (!more || !chunk.has_header()) return absl::DataLossError("no header");
  RETURN_IF_ERROR(CheckImportable(chunk.header(), cache));
  const int64_t page_bytes = static_cast<int64_t>(cache.layout().page_bytes());
  int64_t count = 0, pages = 0, bytes = 0, expected = 0, received = 0;
  for (;;) {
    ASSIGN_OR_RETURN(more, reader->Next(&chunk));
    if (!more) return absl::DataLossError("the file ends without its trailer (torn: an unfinished write)");
    if (chunk.has_sequence()) {
      const v1::ExportedSequence& sequence = chunk.sequence();
      if (received != expected) return absl::DataLossError("a sequence's pages are incomplete");
      expected = sequence.num_pages() - sequence.shared_pages_size();
      if (expected < 0) return absl::DataLossError("a sequence shares more pages than it holds");
      for (int64_t stream_index : sequence.shared_pages()) {
        if (stream_index < 0 || stream_index >= pages) {
          return absl::DataLossError("a sequence shares a page the file did not carry before it");
        }
      }
      received = 0;
      ++count;
    } else if (chunk.has_pages()) {
      const v1::ExportPages& p = chunk.pages();
      const int64_t size = static_cast<int64_t>(p.data().size());
      if (p.first_page() != received || size % page_bytes != 0 || size / page_bytes > expected - received ||
          Crc32c(0, p.data().data(), p.data().size()) != p.crc32c()) {
        return absl::DataLossError("a page record is out of order or corrupt");
      }
      received += size / page_bytes;
      pages += size / page_bytes;
      bytes += size;
    } else if (chunk.has_trailer()) {
      if (received != expected || chunk.trailer().sequences() != count || chunk.trailer().pages() != pages ||
          chunk.trailer().bytes() != bytes) {
        return absl::DataLossError("the trailer disagrees with the records before it");
      }
      ASSIGN_OR_RETURN(more, reader->Next(&chunk));
      if (more) return absl::DataLossError("records after the trailer");
      summary->sequences = count;
      summary->pages = pages;
      return absl::OkStatus();
    } else {
      return absl::DataLossError("a record of an unexpected kind");
    }
  }
}

// Imports a verified snapshot into `cache`, sequence by sequence, sharing
// what the file shares; the ids that landed go to `loaded`. An error names
// the sequence; what landed before it stays (the caller drops it).
absl::Status ImportFile(const std::string& path, KvCache& cache, const Authenticator* auth,
                        std::vector<std::string>* loaded) {
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotReader> reader, SnapshotReader::Open(path));
  ImportSharing sharing(&cache);
  std::unique_ptr<SequenceImport> import;  // destroyed before `sharing`
  std::string id;
  int64_t received = 0;
  const auto named = [&id](const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat("sequence '", id, "': ", status.message()));
  };
  v1::ExportChunk chunk;
  for (;;) {
    ASSIGN_OR_RETURN(bool more, reader->Next(&chunk));
    if (!more) return absl::OkStatus();
    if (chunk.has_sequence()) {
      id = chunk.sequence().sequence_id();
      absl::StatusOr<SequenceImage> state = FromProto(chunk.sequence(), cache);
      if (!state.ok()) return named(state.status());
      absl::StatusOr<std::unique_ptr<SequenceImport>> begun =
          cache.BeginImport(*state, auth == nullptr ? nullptr : auth->AccountOf(id), &sharing);
      if (!begun.ok()) return named(begun.status());
      import = *std::move(begun);
      received = 0;
    } else if (chunk.has_pages() && import != nullptr) {
      const std::string& data = chunk.pages().data();
      const int64_t count = static_cast<int64_t>(data.size() / cache.layout().page_bytes());
      absl::Status written = import->WritePages(received, count, reinterpret_cast<const uint8_t*>(data.data()));
      if (!written.ok()) return named(written);
      received += count;
    }
    if (import != nullptr && received == import->num_pages()) {
      if (absl::Status committed = import->Commit(); !committed.ok()) return named(committed);
      import.reset();
      loaded->push_back(id);
    }
  }
}

// File names: the cache name with anything outside [A-Za-z0-9._-] as '_'.
std::string FileSafe(const std::string& name) {
  std::string out = name;
  for (char& c : out) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  }
  return out.empty() ? "_" : out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Snapshotter>> Snapshotter::Open(std::string data_dir, std::vector<KvCache*> caches,
                                                               const Authenticator* auth) {
  std::unique_ptr<Snapshotter> snapshotter(new Snapshotter(std::move(data_dir), std::move(caches), auth));
  const std::string lock_path = absl::StrCat(snapshotter->data_dir_, "/LOCK");
  snapshotter->lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (snapshotter->lock_fd_ < 0) return IoError("cannot open the data directory's lock file", lock_path);
  if (flock(snapshotter->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the data directory '%s' is in use by another tqkv-server (it holds '%s'); give each server its own",
        snapshotter->data_dir_, lock_path));
  }
  return snapshotter;
}

Snapshotter::Snapshotter(std::string data_dir, std::vector<KvCache*> caches, const Authenticator* auth)
    : data_dir_(std::move(data_dir)), caches_(std::move(caches)), auth_(auth) {}

Snapshotter::~Snapshotter() {
  if (lock_fd_ >= 0) close(lock_fd_);  // lets go of the lock
}

std::string Snapshotter::PathOf(const std::string& name) const {
  return absl::StrCat(data_dir_, "/", FileSafe(name), kSnapshotSuffix);
}

absl::StatusOr<v1::SaveSnapshotResponse> Snapshotter::SaveAll() {
  absl::MutexLock lock(&mu_);
  v1::SaveSnapshotResponse response;
  // Every cache is tried: one that cannot be saved does not cost the others
  // theirs.
  absl::Status first_error;
  int failed = 0;
  for (KvCache* cache : caches_) {
    absl::StatusOr<v1::SnapshotFileInfo> file = Save(*cache);
    if (file.ok()) {
      *response.add_files() = *std::move(file);
    } else if (++failed == 1) {
      first_error = file.status();
    }
  }
  if (failed == 0) return response;
  if (failed == 1) return first_error;
  return absl::Status(first_error.code(),
                      absl::StrFormat("%s (and %d more caches failed)", first_error.message(), failed - 1));
}

absl::StatusOr<v1::SnapshotFileInfo> Snapshotter::Save(KvCache& cache) {
  const absl::Time start = absl::Now();
  const std::string path = PathOf(cache.options().name);
  if (not_loaded_.contains(path)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "'%s' holds sequences this server did not load and could not set aside; it is not overwritten: move it "
        "away (or load it into a cache that fits it), then save again",
        path));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotWriter> writer, SnapshotWriter::Open(path));
  v1::ExportChunk chunk;
  *chunk.mutable_header() = MakeExportHeader(cache);
  RETURN_IF_ERROR(writer->Record(chunk));
  const size_t page_bytes = cache.layout().page_bytes();
  const int64_t per_record = std::max<int64_t>(1, kExportMessageBytes / static_cast<int64_t>(page_bytes));
  std::vector<uint8_t> buffer;
  int64_t sequences = 0, bytes = 0;
  // Pages several sequences share (forks) are written once.
  ExportSharing sharing(&cache);
  for (const std::string& id : cache.ListSequences()) {
    absl::StatusOr<std::unique_ptr<SequenceExport>> e = cache.BeginExport(id, &sharing);
    if (absl::IsNotFound(e.status())) continue;  // dropped since the listing
    if (!e.ok()) return e.status();
    chunk.Clear();
    ToProto((*e)->state(), chunk.mutable_sequence());
    RETURN_IF_ERROR(writer->Record(chunk));
    const int64_t n = (*e)->state().carried_pages();
    for (int64_t first = 0; first < n; first += per_record) {
      const int64_t count = std::min(per_record, n - first);
      const size_t size = static_cast<size_t>(count) * page_bytes;
      buffer.resize(size);
      RETURN_IF_ERROR((*e)->ReadPages(first, count, buffer.data()));
      std::string prefix, suffix;
      FramePagesChunk(first, size, Crc32c(0, buffer.data(), size), &prefix, &suffix);
      RETURN_IF_ERROR(
          writer->Record({{prefix.data(), prefix.size()}, {buffer.data(), size}, {suffix.data(), suffix.size()}}));
      bytes += static_cast<int64_t>(size);
    }
    ++sequences;
  }
  chunk.Clear();
  chunk.mutable_trailer()->set_sequences(sequences);
  chunk.mutable_trailer()->set_pages(sharing.carried_pages());
  chunk.mutable_trailer()->set_bytes(bytes);
  RETURN_IF_ERROR(writer->Record(chunk));
  RETURN_IF_ERROR(writer->Commit());
  v1::SnapshotFileInfo info;
  info.set_cache(cache.options().name);
  info.set_path(path);
  info.set_sequences(sequences);
  info.set_pages(sharing.carried_pages());
  info.set_bytes(static_cast<int64_t>(writer->bytes()));
  info.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return info;
}

std::vector<std::string> Snapshotter::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> lines = RemoveStaleTemporaries();
  for (KvCache* cache : caches_) {
    std::string line = Load(*cache);
    if (!line.empty()) lines.push_back(std::move(line));
  }
  return lines;
}

std::vector<std::string> Snapshotter::RemoveStaleTemporaries() {
  std::vector<std::string> lines;
  DIR* dir = opendir(data_dir_.c_str());
  if (dir == nullptr) return lines;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (!absl::EndsWith(name, absl::StrCat(kSnapshotSuffix, kTemporarySuffix))) continue;
    const std::string path = absl::StrCat(data_dir_, "/", name);
    lines.push_back(std::remove(path.c_str()) == 0
                        ? absl::StrFormat("removed '%s', a snapshot write that never finished", path)
                        : absl::StrFormat("cannot remove '%s', a snapshot write that never finished: %s", path,
                                          std::strerror(errno)));
  }
  closedir(dir);
  return lines;
}

std::string Snapshotter::Load(KvCache& cache) {
  const std::string path = PathOf(cache.options().name);
  const std::string name = cache.options().name;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return "";  // nothing saved yet
  const absl::Time start = absl::Now();
  FileSummary summary;
  if (absl::Status ok = Verify(path, cache, &summary); !ok.ok()) return SetAside(path, name, std::string(ok.message()));
  const int32_t pool_pages = cache.Stats().pages_total;
  if (summary.pages > pool_pages) {
    return SetAside(path, name,
                    absl::StrFormat("its %d sequences need %d pages and the cache has %d; give the cache a "
                                    "memory budget of at least %d bytes",
                                    summary.sequences, summary.pages, pool_pages,
                                    summary.pages * static_cast<int64_t>(cache.layout().page_bytes())));
  }
  // All or nothing: a sequence that does not load (a tenant's quota, say)
  // takes the ones before it back out, and the file is set aside whole.
  std::vector<std::string> loaded;
  if (absl::Status ok = ImportFile(path, cache, auth_, &loaded); !ok.ok()) {
    for (const std::string& id : loaded) (void)cache.Drop(id);
    return SetAside(path, name, std::string(ok.message()));
  }
  return absl::StrFormat("snapshot '%s': loaded %d sequences (%d pages) into cache '%s' in %.2f s", path, loaded.size(),
                         summary.pages, name, absl::ToDoubleSeconds(absl::Now() - start));
}

std::string Snapshotter::SetAside(const std::string& path, const std::string& cache, const std::string& why) {
  // Set aside, not overwritten by the next snapshot: it may still be worth
  // a look, or a load into a cache that fits it.
  const std::string aside = absl::StrCat(path, ".skipped-", absl::ToUnixMicros(absl::Now()));
  if (std::rename(path.c_str(), aside.c_str()) != 0) {
    not_loaded_.insert(path);
    return absl::StrFormat(
        "snapshot '%s' of cache '%s' not loaded, nothing of it: %s; it cannot be set aside (%s), so this server "
        "will not write a snapshot of cache '%s' over it",
        path, cache, why, std::strerror(errno), cache);
  }
  return absl::StrFormat(
      "snapshot '%s' of cache '%s' not loaded, nothing of it: %s; the file is kept whole as '%s' (rename it back "
      "to '%s' before a start whose cache fits it, and it loads then)",
      path, cache, why, aside, path);
}

}  // namespace service
}  // namespace tqkv
