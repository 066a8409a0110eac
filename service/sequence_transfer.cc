#include "service/sequence_transfer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/slice.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "google/protobuf/util/message_differencer.h"
#include "base/status_macros.h"
#include "proto/grpc_raw.h"
#include "service/auth.h"
#include "service/config.h"
#include "service/crc32c.h"
#include "service/kv_cache_service.h"
#include "service/raw_message.h"
#include "service/status_util.h"
#include "version/version.h"

namespace tqkv {
namespace service {
namespace {

using Clock = CallClock;

// Ends a call's accounting (AccountCall) and gives its status.
grpc::Status Account(KvCacheService* service, const Caller& caller, Rpc rpc, Clock::time_point start,
                     const absl::Status& status) {
  grpc::Status done = ToGrpcStatus(status);
  AccountCall(service->metrics(), caller, rpc, start, done.error_code());
  return done;
}

// Protobuf wire encoding, for the one message framed by hand.
void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void AppendTag(std::string* out, int field, int wire_type) {
  AppendVarint(out, static_cast<uint64_t>(field) << 3 | wire_type);
}

// Reads a message's bytes across its slices, in order.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& slice : slices) remaining_ += slice.size();
    Skip();
  }
  uint64_t remaining() const { return remaining_; }
  // Bytes left in the current slice.
  size_t contiguous() const { return index_ < slices_.size() ? slices_[index_].size() - offset_ : 0; }

  bool Varint(uint64_t* out) {
    *out = 0;
    for (int shift = 0; shift < 64 && remaining_ > 0; shift += 7) {
      const uint8_t byte = slices_[index_].begin()[offset_];
      Advance(1);
      *out |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }
  // The next n bytes when one slice holds them all (then consumed), or null.
  const uint8_t* Contiguous(size_t n) {
    if (n > remaining_ || index_ == slices_.size() || slices_[index_].size() - offset_ < n) return nullptr;
    const uint8_t* p = slices_[index_].begin() + offset_;
    Advance(n);
    return p;
  }
  // REQUIRES: n <= remaining().
  void Copy(uint8_t* out, size_t n) {
    while (n > 0) {
      const size_t take = std::min(n, slices_[index_].size() - offset_);
      std::memcpy(out, slices_[index_].begin() + offset_, take);
      out += take;
      n -= take;
      Advance(take);
    }
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    remaining_ -= n;
    Skip();
  }
  void Skip() {  // past finished (and empty) slices
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }
  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  uint64_t remaining_ = 0;
};

// Runs `step` on the service's executor (inline without one); a full
// executor ends the call through `fail`.
template <typename Step, typename Fail>
void Schedule(KvCacheService* service, Step step, Fail fail) {
  CallExecutor* executor = service->executor();
  if (executor == nullptr) {
    step();
    return;
  }
  const absl::Status queued = executor->Submit(0, std::move(step));
  if (!queued.ok()) fail(queued);
}

class ExportReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ExportReactor(KvCacheService* service, const absl::StatusOr<Caller>& caller)
      : service_(service), start_(Clock::now()) {
    if (!caller.ok()) {
      End(caller.status());
      return;
    }
    caller_ = *caller;
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End(absl::InvalidArgumentError("the call carried no ExportRequest"));
      return;
    }
    Schedule(
        service_, [this] { Step(RunGuarded([this] { return Plan(); })); }, [this](const absl::Status& s) { End(s); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::CancelledError("the client went away"));
      return;
    }
    Schedule(
        service_, [this] { Step(RunGuarded([this] { return Next(); })); }, [this](const absl::Status& s) { End(s); });
  }

  void OnDone() override { delete this; }

 private:
  // After Plan or Next: write what they produced, or end the call.
  void Step(const absl::Status& status) {
    if (!status.ok()) {
      End(status);
    } else if (finished_) {
      End(absl::OkStatus());
    } else {
      StartWrite(&out_);
    }
  }

  // Parses and checks the request, lists the sequences, writes the header.
  absl::Status Plan() {
    v1::ExportRequest request;
    RETURN_IF_ERROR(ParseMessage(in_, &request, "the request"));
    in_.Clear();
    if (request.sequence_ids_size() == 0 && request.id_prefix().empty() && !request.all()) {
      return absl::InvalidArgumentError("name the sequences to export: sequence_ids, id_prefix or all");
    }
    std::set<std::string> named;
    for (const std::string& id : request.sequence_ids()) {
      if (id.empty() || id.size() > kMaxSequenceIdBytes) {
        return absl::InvalidArgumentError(
            absl::StrFormat("sequence_ids holds an id of %d bytes; want 1..%d", id.size(), kMaxSequenceIdBytes));
      }
      RETURN_IF_ERROR(Authenticator::Authorize(caller_, id, "sequence_id"));
      if (!named.insert(id).second) {
        return absl::InvalidArgumentError(absl::StrFormat("sequence_ids names '%s' twice", id));
      }
      ids_.push_back({id, /*named=*/true});
    }
    std::string prefix = request.id_prefix();
    const bool listing = request.all() || !prefix.empty();
    if (listing && !caller_.admin()) {
      // A tenant lists only its own namespace.
      if (prefix.empty()) prefix = caller_.tenant->prefix();
      RETURN_IF_ERROR(Authenticator::Authorize(caller_, prefix, "id_prefix"));
    }
    ASSIGN_OR_RETURN(cache_, service_->Find(request.cache()));
    if (static_cast<int64_t>(cache_->layout().page_bytes()) + 4096 > service_->max_response_bytes() &&
        service_->max_response_bytes() > 0) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("a page of cache '%s' is %d bytes, above the server's message limit of %d",
                          cache_->options().name, cache_->layout().page_bytes(), service_->max_response_bytes()));
    }
    if (listing) {
      for (const std::string& id : cache_->ListSequences()) {
        if (absl::StartsWith(id, prefix) && named.count(id) == 0) ids_.push_back({id, /*named=*/false});
      }
    }
    pages_per_message_ =
        std::max<int64_t>(1, kExportMessageBytes / static_cast<int64_t>(cache_->layout().page_bytes()));
    sharing_ = std::make_unique<ExportSharing>(cache_);
    v1::ExportChunk chunk;
    *chunk.mutable_header() = MakeExportHeader(*cache_);
    return SerializeMessage(chunk, &out_);
  }

  // The next message: pages of the sequence being sent, the next sequence's
  // state, the trailer, or the end.
  absl::Status Next() {
    out_.Clear();
    v1::ExportChunk chunk;
    if (current_ != nullptr && pages_sent_ < current_->state().carried_pages()) {
      const int64_t count = std::min(pages_per_message_, current_->state().carried_pages() - pages_sent_);
      const size_t size = static_cast<size_t>(count) * cache_->layout().page_bytes();
      // The pages go from the pool straight into the message's own slice,
      // framed by hand: an ExportChunk holding ExportPages {first_page,
      // data, crc32c} (the same bytes protobuf would write), so they are
      // copied once and never zero-filled first.
      grpc::Slice data(size);
      uint8_t* bytes = const_cast<uint8_t*>(data.begin());
      RETURN_IF_ERROR(current_->ReadPages(pages_sent_, count, bytes));
      std::string prefix, suffix;
      FramePagesChunk(pages_sent_, size, Crc32c(0, bytes, size), &prefix, &suffix);
      grpc::Slice slices[] = {grpc::Slice(prefix), std::move(data), grpc::Slice(suffix)};
      out_ = grpc::ByteBuffer(slices, 3);
      pages_sent_ += count;
      total_pages_ += count;
      total_bytes_ += static_cast<int64_t>(size);
      return absl::OkStatus();
    }
    current_.reset();  // lets go of the pins
    while (next_ < ids_.size()) {
      const auto& [id, named] = ids_[next_++];
      absl::StatusOr<std::unique_ptr<SequenceExport>> e = cache_->BeginExport(id, sharing_.get());
      if (!e.ok()) {
        // A listed sequence dropped since the listing is skipped; a named
        // one is an error.
        if (absl::IsNotFound(e.status()) && !named) continue;
        return e.status();
      }
      current_ = *std::move(e);
      pages_sent_ = 0;
      ++sequences_;
      ToProto(current_->state(), chunk.mutable_sequence());
      return SerializeMessage(chunk, &out_);
    }
    if (!trailer_sent_) {
      trailer_sent_ = true;
      v1::ExportTrailer* trailer = chunk.mutable_trailer();
      trailer->set_sequences(sequences_);
      trailer->set_pages(total_pages_);
      trailer->set_bytes(total_bytes_);
      return SerializeMessage(chunk, &out_);
    }
    finished_ = true;
    return absl::OkStatus();
  }

  void End(const absl::Status& status) {
    current_.reset();
    sharing_.reset();  // the stream's kept pages go back
    Finish(Account(service_, caller_, Rpc::kExportSequences, start_, status));
  }

  KvCacheService* const service_;
  const Clock::time_point start_;
  Caller caller_;
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
  KvCache* cache_ = nullptr;
  std::vector<std::pair<std::string, bool>> ids_;  // (id, named in the request)
  size_t next_ = 0;
  std::unique_ptr<ExportSharing> sharing_;  // made with cache_
  std::unique_ptr<SequenceExport> current_;
  int64_t pages_sent_ = 0;
  int64_t pages_per_message_ = 1;
  int64_t sequences_ = 0;
  int64_t total_pages_ = 0;
  int64_t total_bytes_ = 0;
  bool trailer_sent_ = false;
  bool finished_ = false;
  Metrics::InFlight in_flight_{service_->metrics(), Rpc::kExportSequences};
};

// The import of one stream of ExportChunk messages, message by message:
// what ImportSequences' reactor and PullSequences run.
class ImportSession {
 public:
  ImportSession(KvCacheService* service, const Caller& caller) : service_(service), caller_(caller) {}

  // One message of the stream.
  // One message of the stream (consumed).
  absl::Status Take(grpc::ByteBuffer& in) {
    in_ = &in;
    // Pages, the bulk of a stream, go from the message's slices to the pool
    // without being copied into a parsed message first.
    if (import_ != nullptr) {
      bool taken = false;
      RETURN_IF_ERROR(TakePagesInPlace(&taken));
      if (taken) {
        in_->Clear();
        ++messages_;
        return absl::OkStatus();
      }
    }
    v1::ExportChunk chunk;
    RETURN_IF_ERROR(ParseMessage(*in_, &chunk, absl::StrCat("message ", messages_)));
    in_->Clear();
    ++messages_;
    if (trailer_) return absl::InvalidArgumentError("a message after the trailer");
    switch (chunk.part_case()) {
      case v1::ExportChunk::kHeader:
        return TakeHeader(chunk.header());
      case v1::ExportChunk::kSequence:
        return TakeSequence(chunk.sequence());
      case v1::ExportChunk::kPages:
        return TakePages(chunk.pages());
      case v1::ExportChunk::kTrailer:
        return TakeTrailer(chunk.trailer());
      case v1::ExportChunk::PART_NOT_SET:
        break;
    }
    return absl::InvalidArgumentError(absl::StrFormat("message %d carries no part", messages_ - 1));
  }

  absl::Status TakeHeader(const v1::ExportHeader& header) {
    if (cache_ != nullptr) return absl::InvalidArgumentError("a second header");
    ASSIGN_OR_RETURN(KvCache * cache, service_->Find(header.cache()));
    RETURN_IF_ERROR(CheckImportable(header, *cache));
    cache_ = cache;
    sharing_ = std::make_unique<ImportSharing>(cache_);
    return absl::OkStatus();
  }

  absl::Status TakeSequence(const v1::ExportedSequence& sequence) {
    if (cache_ == nullptr) return absl::InvalidArgumentError("a sequence before the header");
    if (import_ != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequence '%s' starts before the %d pages of sequence '%s' are complete (%d came)",
                          sequence.sequence_id(), import_->num_pages(), id_, pages_received_));
    }
    id_ = sequence.sequence_id();
    if (id_.empty() || id_.size() > kMaxSequenceIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequence_id is %d bytes; want 1..%d bytes", id_.size(), kMaxSequenceIdBytes));
    }
    RETURN_IF_ERROR(Authenticator::Authorize(caller_, id_, "sequence_id"));
    ASSIGN_OR_RETURN(SequenceImage state, FromProto(sequence, *cache_));
    ASSIGN_OR_RETURN(import_, cache_->BeginImport(state, service_->auth().AccountOf(id_), sharing_.get()));
    pages_received_ = 0;
    return MaybeCommit();
  }

  // The number of pages `size` bytes from `first` hold when they are the
  // sequence's next whole pages, at least one and no more than it lacks;
  // 0 otherwise.
  int64_t PagesIfNext(int64_t first, int64_t size) const {
    const int64_t page_bytes = static_cast<int64_t>(cache_->layout().page_bytes());
    const int64_t count = size / page_bytes;
    if (first != pages_received_ || size % page_bytes != 0 || count == 0 ||
        count > import_->num_pages() - pages_received_) {
      return 0;
    }
    return count;
  }

  absl::Status TakePages(const v1::ExportPages& pages) {
    if (import_ == nullptr) return absl::InvalidArgumentError("pages outside a sequence");
    const int64_t page_bytes = static_cast<int64_t>(cache_->layout().page_bytes());
    const int64_t size = static_cast<int64_t>(pages.data().size());
    const int64_t count = PagesIfNext(pages.first_page(), size);
    if (count == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "pages from %d in %d bytes; want whole %d-byte pages from page %d, at most %d of them", pages.first_page(),
          size, page_bytes, pages_received_, import_->num_pages() - pages_received_));
    }
    if (Crc32c(0, pages.data().data(), pages.data().size()) != pages.crc32c()) {
      return absl::DataLossError(absl::StrFormat("pages [%d, %d): the bytes do not match their CRC-32C",
                                                 pages_received_, pages_received_ + count));
    }
    RETURN_IF_ERROR(import_->WritePages(pages_received_, count, reinterpret_cast<const uint8_t*>(pages.data().data())));
    pages_received_ += count;
    total_bytes_ += size;
    return MaybeCommit();
  }

  // The fast path of TakePages: when in_ is an ExportChunk holding only
  // ExportPages {first_page, data, crc32c} in field order (what an export
  // writes), checks and writes it straight from the slices and sets *taken;
  // anything else is left to the parser (*taken false).
  absl::Status TakePagesInPlace(bool* taken) {
    *taken = false;
    std::vector<grpc::Slice> slices;
    if (!in_->Dump(&slices).ok() || slices.empty()) return absl::OkStatus();
    SliceReader reader(slices);
    uint64_t tag = 0, outer = 0, first_page = 0, size = 0;
    if (!reader.Varint(&tag) || tag != (v1::ExportChunk::kPagesFieldNumber << 3 | 2) || !reader.Varint(&outer) ||
        outer != reader.remaining() || !reader.Varint(&tag)) {
      return absl::OkStatus();
    }
    if (tag == (v1::ExportPages::kFirstPageFieldNumber << 3 | 0)) {
      if (!reader.Varint(&first_page) || !reader.Varint(&tag)) return absl::OkStatus();
    }
    if (tag != (v1::ExportPages::kDataFieldNumber << 3 | 2) || !reader.Varint(&size) ||
        size + 5 != reader.remaining()) {
      return absl::OkStatus();
    }
    const uint64_t page_bytes = cache_->layout().page_bytes();
    const int64_t count = PagesIfNext(static_cast<int64_t>(first_page), static_cast<int64_t>(size));
    if (count == 0) return absl::OkStatus();  // the parser's path reports it
    *taken = true;
    uint32_t crc = 0;
    std::vector<uint8_t> bounce;
    for (int64_t i = 0; i < count;) {
      // As many whole pages as the current slice holds, in one write; a
      // page that straddles two slices goes through a bounce buffer.
      const int64_t run = std::min<int64_t>(count - i, static_cast<int64_t>(reader.contiguous() / page_bytes));
      const uint8_t* pages = run > 0 ? reader.Contiguous(run * page_bytes) : nullptr;
      if (pages == nullptr) {
        bounce.resize(page_bytes);
        reader.Copy(bounce.data(), page_bytes);
        pages = bounce.data();
      }
      const int64_t n = std::max<int64_t>(run, 1);
      crc = Crc32c(crc, pages, n * page_bytes);
      RETURN_IF_ERROR(import_->WritePages(pages_received_ + i, n, pages));
      i += n;
    }
    uint8_t tail[5];
    reader.Copy(tail, 5);
    const uint32_t want = static_cast<uint32_t>(tail[1]) | static_cast<uint32_t>(tail[2]) << 8 |
                          static_cast<uint32_t>(tail[3]) << 16 | static_cast<uint32_t>(tail[4]) << 24;
    if (tail[0] != (v1::ExportPages::kCrc32CFieldNumber << 3 | 5) || crc != want) {
      return absl::DataLossError(absl::StrFormat("pages [%d, %d): the bytes do not match their CRC-32C",
                                                 pages_received_, pages_received_ + count));
    }
    pages_received_ += count;
    total_bytes_ += static_cast<int64_t>(size);
    return MaybeCommit();
  }

  absl::Status MaybeCommit() {
    if (pages_received_ < import_->num_pages()) return absl::OkStatus();
    RETURN_IF_ERROR(import_->Commit());
    total_pages_ += import_->num_pages();
    import_.reset();
    response_.add_sequence_ids(id_);
    return absl::OkStatus();
  }

  absl::Status TakeTrailer(const v1::ExportTrailer& trailer) {
    if (cache_ == nullptr) return absl::InvalidArgumentError("a trailer before the header");
    if (import_ != nullptr) {
      return absl::DataLossError(absl::StrFormat("the trailer came with %d of sequence '%s''s %d pages",
                                                 pages_received_, id_, import_->num_pages()));
    }
    if (trailer.sequences() != response_.sequence_ids_size() || trailer.pages() != total_pages_ ||
        trailer.bytes() != total_bytes_) {
      return absl::DataLossError(absl::StrFormat(
          "the trailer counts %d sequences, %d pages, %d bytes; the stream carried %d, %d, %d", trailer.sequences(),
          trailer.pages(), trailer.bytes(), response_.sequence_ids_size(), total_pages_, total_bytes_));
    }
    trailer_ = true;
    return absl::OkStatus();
  }

  // The end of the stream: the response, or why the stream was incomplete.
  const v1::ImportResponse& response() const { return response_; }

  absl::Status EndOfStream(grpc::ByteBuffer* response_bytes) {
    if (import_ != nullptr) {
      return absl::DataLossError(absl::StrFormat("the stream ended with %d of sequence '%s''s %d pages",
                                                 pages_received_, id_, import_->num_pages()));
    }
    if (!trailer_) {
      return absl::DataLossError(
          absl::StrFormat("the stream ended without its trailer (%d sequences were imported: %s)",
                          response_.sequence_ids_size(), absl::StrJoin(response_.sequence_ids(), ", ")));
    }
    response_.set_pages(total_pages_);
    response_.set_bytes(total_bytes_);
    return response_bytes == nullptr ? absl::OkStatus() : SerializeMessage(response_, response_bytes);
  }

  // Names the sequence in progress in an error and gives back what it had
  // reserved; the sequences completed stay.
  absl::Status Abandon(const absl::Status& status) {
    absl::Status named = status;
    if (!status.ok() && import_ != nullptr) {
      named = absl::Status(status.code(), absl::StrCat("sequence '", id_, "': ", status.message()));
    }
    import_.reset();
    return named;
  }

 private:
  KvCacheService* const service_;
  const Caller caller_;
  grpc::ByteBuffer* in_ = nullptr;  // the message Take is taking
  int64_t messages_ = 0;
  KvCache* cache_ = nullptr;
  // The stream's shared pages (made with cache_); outlives import_.
  std::unique_ptr<ImportSharing> sharing_;
  std::unique_ptr<SequenceImport> import_;
  std::string id_;
  int64_t pages_received_ = 0;
  int64_t total_pages_ = 0;
  int64_t total_bytes_ = 0;
  bool trailer_ = false;
  v1::ImportResponse response_;
};

class ImportReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  ImportReactor(KvCacheService* service, const absl::StatusOr<Caller>& caller, grpc::ByteBuffer* response)
      : service_(service), response_bytes_(response), start_(Clock::now()) {
    if (!caller.ok()) {
      End(caller.status());
      return;
    }
    caller_ = *caller;
    session_ = std::make_unique<ImportSession>(service, caller_);
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    Schedule(
        service_,
        [this, ok] {
          const absl::Status status =
              RunGuarded([this, ok] { return ok ? session_->Take(in_) : session_->EndOfStream(response_bytes_); });
          if (!status.ok() || !ok) {
            End(status);
          } else {
            StartRead(&in_);
          }
        },
        [this](const absl::Status& s) { End(s); });
  }

  void OnDone() override { delete this; }

 private:
  void End(const absl::Status& status) {
    const absl::Status named = session_ != nullptr ? session_->Abandon(status) : status;
    session_.reset();  // an incomplete sequence gives everything back
    Finish(Account(service_, caller_, Rpc::kImportSequences, start_, named));
  }

  KvCacheService* const service_;
  grpc::ByteBuffer* const response_bytes_;
  const Clock::time_point start_;
  Caller caller_;
  grpc::ByteBuffer in_;
  std::unique_ptr<ImportSession> session_;
  Metrics::InFlight in_flight_{service_->metrics(), Rpc::kImportSequences};
};

// The config fields that fix how pages are laid out and read: everything
// but the name and the pool's sizing and eviction.
v1::CacheConfig LayoutOnly(v1::CacheConfig config) {
  config.clear_name();
  config.clear_memory_budget_bytes();
  config.clear_evict_lru();
  config.clear_idle_ttl_seconds();
  // Sequence key scales are per-sequence state, not page format: each
  // sequence's mean says whether it carries them (KvCache::ImportSequence).
  config.clear_sequence_key_scales();
  return config;
}

}  // namespace

absl::Status PullSequences(KvCacheService* service, const Caller& caller, const v1::PullSequencesRequest& request,
                           v1::ImportResponse* response) {
  if (!caller.admin()) {
    return absl::PermissionDeniedError(
        absl::StrFormat("PullSequences opens a connection from the server: it takes an admin token, not tenant '%s''s",
                        caller.tenant->name()));
  }
  if (request.source().empty())
    return absl::InvalidArgumentError("source is empty; want the exporting server's host:port");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // page messages are sized by the exporter
  const std::shared_ptr<grpc::ChannelCredentials> credentials =
      request.source_tls_root_certs().empty()
          ? grpc::InsecureChannelCredentials()
          : grpc::SslCredentials(grpc::SslCredentialsOptions{request.source_tls_root_certs(), "", ""});
  const std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(request.source(), credentials, args);
  grpc::ClientContext context;
  if (!request.source_auth_token().empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", request.source_auth_token()));
  }
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader =
      OpenRawServerStream(channel.get(), "/tqkv.v1.KvCache/ExportSequences", &context, request.export_request());
  ImportSession session(service, caller);
  grpc::ByteBuffer message;
  bool first = true;
  absl::Status status;
  while (status.ok() && reader->Read(&message)) {
    if (first && !request.target_cache().empty()) {
      v1::ExportChunk header;
      status = ParseMessage(message, &header, "the source's first message");
      if (status.ok() && !header.has_header())
        status = absl::DataLossError("the source's first message is not a header");
      if (!status.ok()) break;
      header.mutable_header()->set_cache(request.target_cache());
      message.Clear();  // serializing needs an empty buffer
      status = SerializeMessage(header, &message);
      if (!status.ok()) break;
    }
    first = false;
    status = session.Take(message);
  }
  if (!status.ok()) {
    context.TryCancel();
    (void)reader->Finish();
    return session.Abandon(status);
  }
  const grpc::Status source = reader->Finish();
  if (!source.ok()) {
    return session.Abandon(
        absl::Status(static_cast<absl::StatusCode>(source.error_code()),
                     absl::StrCat("the export from ", request.source(), " failed: ", source.error_message())));
  }
  RETURN_IF_ERROR(session.Abandon(session.EndOfStream(nullptr)));
  *response = session.response();
  return absl::OkStatus();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewExportReactor(KvCacheService* service,
                                                                              grpc::CallbackServerContext* context) {
  return new ExportReactor(service, service->auth().Authenticate(*context));
}

grpc::ServerReadReactor<grpc::ByteBuffer>* NewImportReactor(KvCacheService* service,
                                                            grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response) {
  return new ImportReactor(service, service->auth().Authenticate(*context), response);
}

void FramePagesChunk(int64_t first_page, size_t size, uint32_t crc, std::string* prefix, std::string* suffix) {
  std::string inner;
  AppendTag(&inner, v1::ExportPages::kFirstPageFieldNumber, 0);
  AppendVarint(&inner, static_cast<uint64_t>(first_page));
  AppendTag(&inner, v1::ExportPages::kDataFieldNumber, 2);
  AppendVarint(&inner, size);
  suffix->clear();
  AppendTag(suffix, v1::ExportPages::kCrc32CFieldNumber, 5);
  for (int i = 0; i < 4; ++i) suffix->push_back(static_cast<char>(crc >> (8 * i)));
  prefix->clear();
  AppendTag(prefix, v1::ExportChunk::kPagesFieldNumber, 2);
  AppendVarint(prefix, inner.size() + size + suffix->size());
  *prefix += inner;
}

v1::ExportHeader MakeExportHeader(const KvCache& cache) {
  v1::ExportHeader header;
  header.set_format_version(kExportFormatVersion);
  header.set_cache(cache.options().name);
  CacheOptions options = cache.options();
  options.layout = cache.layout().options();  // resolved
  *header.mutable_layout() = ToCacheConfig(options);
  header.set_page_bytes(static_cast<int64_t>(cache.layout().page_bytes()));
  header.set_server_version(VersionLine());
  return header;
}

absl::Status CheckImportable(const v1::ExportHeader& header, const KvCache& cache) {
  if (header.format_version() < kOldestImportableFormatVersion || header.format_version() > kExportFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the export is format version %d; this server reads versions %d to %d", header.format_version(),
                        kOldestImportableFormatVersion, kExportFormatVersion));
  }
  const v1::ExportHeader mine = MakeExportHeader(cache);
  std::string differences;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&differences);
  const bool same = differencer.Compare(LayoutOnly(header.layout()), LayoutOnly(mine.layout()));
  if (!same || header.page_bytes() != mine.page_bytes()) {
    if (header.page_bytes() != mine.page_bytes()) {
      absl::StrAppend(&differences, "page_bytes: ", header.page_bytes(), " -> ", mine.page_bytes(), "\n");
    }
    absl::StripTrailingAsciiWhitespace(&differences);
    absl::StrReplaceAll({{"\n", "; "}}, &differences);
    return absl::FailedPreconditionError(absl::StrFormat(
        "the export's layout differs from cache '%s' (export -> this cache): %s", cache.options().name, differences));
  }
  return absl::OkStatus();
}

void ToProto(const SequenceImage& state, v1::ExportedSequence* out) {
  out->set_sequence_id(state.id);
  for (int64_t t : state.layer_tokens) out->add_layer_tokens(t);
  for (int64_t t : state.held_begin) out->add_layer_oldest_token(t);
  for (const std::vector<int32_t>& table : state.tables) {
    out->add_tables()->mutable_pages()->Add(table.begin(), table.end());
  }
  for (const std::vector<int32_t>& table : state.exact_tables) {
    out->add_exact_tables()->mutable_pages()->Add(table.begin(), table.end());
  }
  for (const std::vector<float>& mean : state.key_means) {
    out->add_key_means()->mutable_values()->Add(mean.begin(), mean.end());
  }
  for (const SequenceImage::RememberedAppend& r : state.recent_appends) {
    v1::RememberedAppend* a = out->add_recent_appends();
    a->set_request_id(r.request_id);
    a->set_start(r.start);
    a->set_tokens(r.tokens);
    a->set_layer_begin(r.layer_begin);
    a->set_layer_end(r.layer_end);
  }
  out->set_num_pages(state.num_pages);
  out->mutable_shared_pages()->Add(state.shared_pages.begin(), state.shared_pages.end());
  out->mutable_offered_pages()->Add(state.offered_pages.begin(), state.offered_pages.end());
}

absl::StatusOr<SequenceImage> FromProto(const v1::ExportedSequence& in, const KvCache& cache) {
  const KvLayout& layout = cache.layout();
  if (in.layer_tokens_size() != layout.num_layers() || in.layer_oldest_token_size() != layout.num_layers() ||
      in.key_means_size() != layout.num_layers() || in.tables_size() != layout.num_chunks() ||
      in.exact_tables_size() != layout.num_chunks()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence '%s' has %d layers (%d oldest tokens, %d means) and %d + %d block tables; cache '%s' has %d "
        "layers in %d chunks",
        in.sequence_id(), in.layer_tokens_size(), in.layer_oldest_token_size(), in.key_means_size(), in.tables_size(),
        in.exact_tables_size(), cache.options().name, layout.num_layers(), layout.num_chunks()));
  }
  SequenceImage image;
  image.id = in.sequence_id();
  image.layer_tokens.assign(in.layer_tokens().begin(), in.layer_tokens().end());
  image.held_begin.assign(in.layer_oldest_token().begin(), in.layer_oldest_token().end());
  for (const v1::BlockTable& t : in.tables()) image.tables.emplace_back(t.pages().begin(), t.pages().end());
  for (const v1::BlockTable& t : in.exact_tables()) image.exact_tables.emplace_back(t.pages().begin(), t.pages().end());
  for (const v1::KeyMean& m : in.key_means()) image.key_means.emplace_back(m.values().begin(), m.values().end());
  for (const v1::RememberedAppend& r : in.recent_appends()) {
    image.recent_appends.push_back({r.request_id(), r.start(), r.tokens(), r.layer_begin(), r.layer_end()});
  }
  image.num_pages = in.num_pages();
  image.shared_pages.assign(in.shared_pages().begin(), in.shared_pages().end());
  image.offered_pages.assign(in.offered_pages().begin(), in.offered_pages().end());
  return image;
}

}  // namespace service
}  // namespace tqkv
