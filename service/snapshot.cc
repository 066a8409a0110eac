#include "service/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "service/crc32c.h"
#include "service/sequence_transfer.h"

namespace tqkv {
namespace service {
namespace {

constexpr size_t kMagicBytes = 8;
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
  explicit SnapshotWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {}
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
    if (std::fread(magic, 1, kMagicBytes, r->file_) != kMagicBytes || std::memcmp(magic, kSnapshotMagic, kMagicBytes) != 0) {
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

// Checks a whole snapshot of `cache` without changing anything: its records,
// its header against the cache's layout, its structure and trailer.
absl::Status Verify(const std::string& path, const KvCache& cache, int64_t* sequences) {
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
      if (received != expected) return absl::DataLossError("a sequence's pages are incomplete");
      expected = chunk.sequence().num_pages();
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
      *sequences = count;
      return absl::OkStatus();
    } else {
      return absl::DataLossError("a record of an unexpected kind");
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

Snapshotter::Snapshotter(std::string data_dir, std::vector<KvCache*> caches, const Authenticator* auth)
    : data_dir_(std::move(data_dir)), caches_(std::move(caches)), auth_(auth) {}

std::string Snapshotter::PathOf(const std::string& name) const {
  return absl::StrCat(data_dir_, "/", FileSafe(name), ".tqkv-snapshot");
}

absl::StatusOr<v1::SaveSnapshotResponse> Snapshotter::SaveAll() {
  absl::MutexLock lock(&mu_);
  v1::SaveSnapshotResponse response;
  for (KvCache* cache : caches_) {
    ASSIGN_OR_RETURN(v1::SnapshotFileInfo file, Save(*cache));
    *response.add_files() = std::move(file);
  }
  return response;
}

absl::StatusOr<v1::SnapshotFileInfo> Snapshotter::Save(KvCache& cache) {
  const absl::Time start = absl::Now();
  const std::string path = PathOf(cache.options().name);
  ASSIGN_OR_RETURN(std::unique_ptr<SnapshotWriter> writer, SnapshotWriter::Open(path));
  v1::ExportChunk chunk;
  *chunk.mutable_header() = MakeExportHeader(cache);
  RETURN_IF_ERROR(writer->Record(chunk));
  const size_t page_bytes = cache.layout().page_bytes();
  const int64_t per_record = std::max<int64_t>(1, kExportMessageBytes / static_cast<int64_t>(page_bytes));
  std::vector<uint8_t> buffer;
  int64_t sequences = 0, pages = 0, bytes = 0;
  for (const std::string& id : cache.ListSequences()) {
    absl::StatusOr<std::unique_ptr<SequenceExport>> e = cache.BeginExport(id);
    if (absl::IsNotFound(e.status())) continue;  // dropped since the listing
    if (!e.ok()) return e.status();
    chunk.Clear();
    ToProto((*e)->state(), chunk.mutable_sequence());
    RETURN_IF_ERROR(writer->Record(chunk));
    const int64_t n = (*e)->state().num_pages;
    for (int64_t first = 0; first < n; first += per_record) {
      const int64_t count = std::min(per_record, n - first);
      const size_t size = static_cast<size_t>(count) * page_bytes;
      buffer.resize(size);
      RETURN_IF_ERROR((*e)->ReadPages(first, count, buffer.data()));
      std::string prefix, suffix;
      FramePagesChunk(first, size, Crc32c(0, buffer.data(), size), &prefix, &suffix);
      RETURN_IF_ERROR(writer->Record({{prefix.data(), prefix.size()}, {buffer.data(), size}, {suffix.data(), suffix.size()}}));
      bytes += static_cast<int64_t>(size);
    }
    pages += n;
    ++sequences;
  }
  chunk.Clear();
  chunk.mutable_trailer()->set_sequences(sequences);
  chunk.mutable_trailer()->set_pages(pages);
  chunk.mutable_trailer()->set_bytes(bytes);
  RETURN_IF_ERROR(writer->Record(chunk));
  RETURN_IF_ERROR(writer->Commit());
  v1::SnapshotFileInfo info;
  info.set_cache(cache.options().name);
  info.set_path(path);
  info.set_sequences(sequences);
  info.set_pages(pages);
  info.set_bytes(static_cast<int64_t>(writer->bytes()));
  info.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return info;
}

std::vector<std::string> Snapshotter::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> lines;
  for (KvCache* cache : caches_) {
    std::string line = Load(*cache);
    if (!line.empty()) lines.push_back(std::move(line));
  }
  return lines;
}

std::string Snapshotter::Load(KvCache& cache) {
  const std::string path = PathOf(cache.options().name);
  const std::string name = cache.options().name;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return "";  // nothing saved yet
  const absl::Time start = absl::Now();
  int64_t sequences = 0;
  if (absl::Status ok = Verify(path, cache, &sequences); !ok.ok()) {
    // Set aside, not overwritten by the next snapshot: it may still be worth
    // a look (or a load into a cache of its own layout).
    const std::string aside = absl::StrCat(path, ".skipped-", absl::ToUnixMicros(absl::Now()));
    const bool moved = std::rename(path.c_str(), aside.c_str()) == 0;
    return absl::StrFormat("snapshot '%s' of cache '%s' skipped, nothing loaded: %s; %s", path, name, ok.message(),
                           moved ? absl::StrCat("kept as '", aside, "'") : "could not set it aside");
  }
  // Verified whole: import it, sequence by sequence.
  absl::StatusOr<std::unique_ptr<SnapshotReader>> reader = SnapshotReader::Open(path);
  if (!reader.ok()) return absl::StrFormat("snapshot '%s' skipped: %s", path, reader.status().message());
  v1::ExportChunk chunk;
  std::unique_ptr<SequenceImport> import;
  int64_t loaded = 0, received = 0;
  std::vector<std::string> skipped;
  for (;;) {
    absl::StatusOr<bool> more = (*reader)->Next(&chunk);
    if (!more.ok() || !*more) break;  // verified: a clean end after the trailer
    if (chunk.has_sequence()) {
      import.reset();
      const std::string& id = chunk.sequence().sequence_id();
      absl::StatusOr<SequenceImage> state = FromProto(chunk.sequence(), cache);
      absl::StatusOr<std::unique_ptr<SequenceImport>> begun =
          state.ok() ? cache.BeginImport(*state, auth_ == nullptr ? nullptr : auth_->AccountOf(id))
                     : absl::StatusOr<std::unique_ptr<SequenceImport>>(state.status());
      if (!begun.ok()) {
        skipped.push_back(absl::StrCat("'", id, "' (", begun.status().message(), ")"));
        continue;
      }
      import = *std::move(begun);
      received = 0;
    } else if (chunk.has_pages() && import != nullptr) {
      const std::string& data = chunk.pages().data();
      const int64_t count = static_cast<int64_t>(data.size() / cache.layout().page_bytes());
      if (absl::Status w = import->WritePages(received, count, reinterpret_cast<const uint8_t*>(data.data())); !w.ok()) {
        skipped.push_back(absl::StrCat("a sequence (", w.message(), ")"));
        import.reset();
        continue;
      }
      received += count;
    } else {
      continue;
    }
    if (import != nullptr && received == import->num_pages()) {
      if (import->Commit().ok()) ++loaded;
      import.reset();
    }
  }
  std::string line = absl::StrFormat("snapshot '%s': loaded %d of %d sequences into cache '%s' in %.2f s", path,
                                     loaded, sequences, name, absl::ToDoubleSeconds(absl::Now() - start));
  if (!skipped.empty()) {
    absl::StrAppend(&line, "; skipped ", skipped.size(), ": ", skipped.front(), skipped.size() > 1 ? ", ..." : "");
  }
  return line;
}

}  // namespace service
}  // namespace tqkv
