#include "cache/kv_cache.h"

#include "cache/kv_cache_internal.h"

namespace tqkv {

using cache_internal::CeilDiv;
using cache_internal::CheckFinite;
using cache_internal::CheckScale;
using cache_internal::CountBytes;
using cache_internal::EffectiveScale;
using cache_internal::ExactRuns;
using cache_internal::ForEachHeld;
using cache_internal::ForEachPage;
using cache_internal::PlanTableWrites;
using cache_internal::ReadSnapshot;
using cache_internal::Sequence;
using cache_internal::TablePlan;
namespace {

// A sequence's pages as an export numbers them (SequenceImage): carried
// pages first, in table order (block tables, then exact ones), then those
// `kept` (an ExportSharing's pages, by stream index; null: none) already has.
struct PageNumbering {
  std::vector<int32_t> carried;                            // pool pages, by image index
  std::vector<int64_t> shared;                             // stream indices of the pages after them
  std::vector<std::vector<int32_t>> tables, exact_tables;  // by image index
};

PageNumbering NumberPages(const Sequence& seq, const absl::flat_hash_map<int32_t, int64_t>* kept) {
  PageNumbering out;
  std::vector<int32_t> shared_pool;
  absl::flat_hash_map<int32_t, int32_t> number;
  const auto classify = [&](const std::vector<int32_t>& table) {
    ForEachHeld(table, [&](int32_t page) {
      if (kept != nullptr && kept->contains(page)) {
        shared_pool.push_back(page);
      } else {
        number[page] = static_cast<int32_t>(out.carried.size());
        out.carried.push_back(page);
      }
    });
  };
  for (const std::vector<int32_t>& table : seq.tables) classify(table);
  for (const std::vector<int32_t>& table : seq.exact_tables) classify(table);
  for (int32_t page : shared_pool) {
    number[page] = static_cast<int32_t>(out.carried.size() + out.shared.size());
    out.shared.push_back(kept->at(page));
  }
  const auto renumber = [&number](const std::vector<int32_t>& table) {
    std::vector<int32_t> image(table.size(), -1);
    for (size_t k = 0; k < table.size(); ++k) image[k] = table[k] < 0 ? -1 : number.at(table[k]);
    return image;
  };
  for (const std::vector<int32_t>& table : seq.tables) out.tables.push_back(renumber(table));
  for (const std::vector<int32_t>& table : seq.exact_tables) out.exact_tables.push_back(renumber(table));
  return out;
}

// What a read (Attend item, Score) took from a sequence under the lock: the
}  // namespace

absl::StatusOr<std::unique_ptr<SequenceExport>> KvCache::BeginExport(const std::string& id, ExportSharing* sharing) {
  State& s = *state_;
  std::unique_ptr<SequenceExport> e(new SequenceExport());
  e->cache_ = this;
  SequenceImage& image = e->state_;
  absl::MutexLock lock(&s.mu);
  s.AwaitNoWriter(id);
  Sequence* seq = s.FindVisible(id);
  if (seq == nullptr) {
    return s.SequenceNotFound(id, absl::StrFormat("sequence '%s' not found in cache '%s'", id, s.name));
  }
  image.id = seq->id;
  image.layer_tokens = seq->layer_tokens;
  image.held_begin = seq->held_begin;
  PageNumbering numbering = NumberPages(*seq, sharing == nullptr ? nullptr : &sharing->kept_);
  e->physical_ = std::move(numbering.carried);
  image.tables = std::move(numbering.tables);
  image.exact_tables = std::move(numbering.exact_tables);
  image.shared_pages = std::move(numbering.shared);
  image.num_pages = static_cast<int64_t>(e->physical_.size() + image.shared_pages.size());
  for (const auto& mean : seq->key_means) image.key_means.push_back(mean ? *mean : std::vector<float>());
  for (const Sequence::RememberedAppend& r : seq->recent_appends) {
    image.recent_appends.push_back({r.request_id, r.start, r.tokens, r.layer_begin, r.layer_end});
  }
  if (sharing != nullptr) {
    // Carried pages shared now may be named by a later sequence of the
    // stream: the sharing keeps them, unchanged, until the stream ends.
    const int64_t base = sharing->carried_;
    for (size_t i = 0; i < e->physical_.size(); ++i) {
      const int32_t page = e->physical_[i];
      if (s.pages.refs(page) < 2) continue;
      image.offered_pages.push_back(static_cast<int64_t>(i));
      sharing->kept_.emplace(page, base + static_cast<int64_t>(i));
      s.pages.AddRef(page);
    }
    sharing->carried_ += static_cast<int64_t>(e->physical_.size());
  }
  // Pinned as a reader pins: the pages stay allocated and their tokens
  // unchanged (appends write only later slots), and eviction skips it.
  for (int32_t page : e->physical_) s.pages.Pin(page);
  ++seq->readers;
  e->serial_ = seq->serial;
  return e;
}

void KvCache::EndExport(const SequenceExport& e) {
  State& s = *state_;
  ReadSnapshot held;
  held.serial = e.serial_;
  held.table = e.physical_;
  absl::MutexLock lock(&s.mu);
  s.EndRead(e.state_.id, held);
}

SequenceExport::~SequenceExport() {
  if (cache_ != nullptr) cache_->EndExport(*this);
}

absl::Status SequenceExport::ReadPages(int64_t first, int64_t count, uint8_t* out) const {
  const int64_t carried = static_cast<int64_t>(physical_.size());
  if (first < 0 || count < 0 || first > carried || count > carried - first) {
    return absl::InvalidArgumentError(absl::StrFormat("pages [%d, %d) are outside sequence '%s''s %d carried pages",
                                                      first, first + count, state_.id, carried));
  }
  return cache_->backend_->ReadPages(cache_->pool_, absl::MakeConstSpan(physical_.data() + first, count), out);
}

absl::StatusOr<SequenceImage> KvCache::ExportSequence(const std::string& id) {
  ASSIGN_OR_RETURN(std::unique_ptr<SequenceExport> e, BeginExport(id));
  SequenceImage image = e->state();
  const int64_t carried = image.carried_pages();
  try {
    image.pages.resize(static_cast<size_t>(carried) * layout_->page_bytes());
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot allocate %d bytes to export sequence '%s'", carried * layout_->page_bytes(), id));
  }
  RETURN_IF_ERROR(e->ReadPages(0, carried, image.pages.data()));
  return image;
}

ExportSharing::~ExportSharing() {
  std::vector<int32_t> pages;
  pages.reserve(kept_.size());
  for (const auto& [page, stream_index] : kept_) pages.push_back(page);
  cache_->ReleaseKept(pages);
}

ImportSharing::~ImportSharing() {
  std::vector<int32_t> pages;
  for (int32_t page : pool_page_) {
    if (page >= 0) pages.push_back(page);
  }
  cache_->ReleaseKept(pages);
}

void KvCache::ReleaseKept(const std::vector<int32_t>& pages) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  for (int32_t page : pages) s.pages.Release(page);
}

namespace {

// INVALID_ARGUMENT: image `id` does not fit this cache, because `why`.
absl::Status DoesNotFit(const std::string& id, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrFormat("sequence '%s' does not fit this cache: %s", id, why));
}

// An image's lengths, oldest tokens and key means against `layout`.
absl::Status CheckImageLayers(const KvLayout& layout, const SequenceImage& image) {
  const int layers = layout.num_layers();
  if (static_cast<int>(image.layer_tokens.size()) != layers || static_cast<int>(image.held_begin.size()) != layers ||
      static_cast<int>(image.key_means.size()) != layers) {
    return DoesNotFit(
        image.id, absl::StrFormat("it has %d layers (%d oldest-token entries, %d means); the cache has %d",
                                  image.layer_tokens.size(), image.held_begin.size(), image.key_means.size(), layers));
  }
  for (int l = 0; l < layers; ++l) {
    const int64_t length = image.layer_tokens[l], held = image.held_begin[l];
    if (length < 0 || length > (int64_t{1} << 40) || held < 0 || held > length ||
        (layout.layer_window(l) == 0 && held != 0)) {
      return DoesNotFit(image.id, absl::StrFormat("layer %d holds tokens [%d, %d)", l, held, length));
    }
    const bool wants_mean = layout.key_centering() != KeyCentering::kNone && length > 0;
    const size_t mean_size = image.key_means[l].size();
    // A mean without sequence key scales fits a cache that keeps them: the
    // import gives it scales 1, which is how its keys were stored.
    const size_t means = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
    const bool unscaled = wants_mean && layout.sequence_key_scales() && mean_size == means;
    if (wants_mean ? mean_size != static_cast<size_t>(layout.mean_floats()) && !unscaled : mean_size != 0) {
      return DoesNotFit(image.id, absl::StrFormat("layer %d has a key mean of %d floats; want %d", l, mean_size,
                                                  wants_mean ? layout.mean_floats() : 0));
    }
    for (float x : image.key_means[l]) {
      if (!std::isfinite(x)) return DoesNotFit(image.id, absl::StrFormat("layer %d's key mean is not finite", l));
    }
    // Sequence key scales follow the means: finite and > 0.
    for (size_t i = means; i < mean_size; ++i) {
      if (!(image.key_means[l][i] > 0.0f)) {
        return DoesNotFit(image.id, absl::StrFormat("layer %d's sequence key scales are not all > 0", l));
      }
    }
  }
  return absl::OkStatus();
}

// Pages [begin, end) of `table` (`page_tokens` per page) are present. An
// empty range needs none.
absl::Status NeedPages(const std::string& id, const std::vector<int32_t>& table, int64_t page_tokens, int64_t begin,
                       int64_t end, const char* what, int layer) {
  for (int64_t k = begin / page_tokens; begin < end && k < CeilDiv(end, page_tokens); ++k) {
    if (table[k] < 0) {
      return DoesNotFit(id, absl::StrFormat("layer %d reads tokens [%d, %d) from its %s, whose entry %d holds no page",
                                            layer, begin, end, what, k));
    }
  }
  return absl::OkStatus();
}

// An image's tables against `layout`: every table exactly as long as its
// chunk's tokens need, every page index once and in a table, every page a
// read needs present. REQUIRES: CheckImageLayers passed.
absl::Status CheckImageTables(const KvLayout& layout, const SequenceImage& image) {
  const std::string& id = image.id;
  if (static_cast<int>(image.tables.size()) != layout.num_chunks() ||
      static_cast<int>(image.exact_tables.size()) != layout.num_chunks()) {
    return DoesNotFit(id, absl::StrFormat("it has %d block tables and %d exact ones; the cache has %d layer chunks",
                                          image.tables.size(), image.exact_tables.size(), layout.num_chunks()));
  }
  std::vector<bool> seen(static_cast<size_t>(image.num_pages), false);
  const auto check_table = [&](const std::vector<int32_t>& table, int64_t want_size, const char* what,
                               int chunk) -> absl::Status {
    if (static_cast<int64_t>(table.size()) != want_size) {
      return DoesNotFit(id, absl::StrFormat("chunk %d's %s has %d entries; its tokens need %d", chunk, what,
                                            table.size(), want_size));
    }
    for (int32_t page : table) {
      if (page < -1 || page >= image.num_pages || (page >= 0 && seen[page])) {
        return DoesNotFit(id, absl::StrFormat("chunk %d's %s names page %d twice or outside its %d pages", chunk, what,
                                              page, image.num_pages));
      }
      if (page >= 0) seen[page] = true;
    }
    return absl::OkStatus();
  };
  for (int chunk = 0; chunk < layout.num_chunks(); ++chunk) {
    int64_t chunk_max = 0;
    for (int l : layout.chunk_layers(chunk)) chunk_max = std::max(chunk_max, image.layer_tokens[l]);
    RETURN_IF_ERROR(check_table(image.tables[chunk], CeilDiv(chunk_max, layout.page_tokens()), "block table", chunk));
    const int64_t exact_size =
        layout.has_exact_tokens() && chunk_max > 0 ? CeilDiv(chunk_max, layout.exact_page_tokens()) : 0;
    RETURN_IF_ERROR(check_table(image.exact_tables[chunk], exact_size, "exact block table", chunk));
    for (int l : layout.chunk_layers(chunk)) {
      const int64_t length = image.layer_tokens[l], held = image.held_begin[l];
      RETURN_IF_ERROR(NeedPages(id, image.tables[chunk], layout.page_tokens(), held, length, "block table", l));
      if (!layout.has_exact_tokens() || length == 0) continue;
      // The exact tokens a read of the layer takes: the sinks and the
      // recent tokens it still holds.
      const ExactRanges r = layout.exact_ranges(length);
      const int64_t ept = layout.exact_page_tokens();
      RETURN_IF_ERROR(NeedPages(id, image.exact_tables[chunk], ept, held, r.sink_end, "exact block table", l));
      RETURN_IF_ERROR(NeedPages(id, image.exact_tables[chunk], ept, std::max(r.recent_begin, held), length,
                                "exact block table", l));
    }
  }
  for (int64_t i = 0; i < image.num_pages; ++i) {
    if (!seen[i]) return DoesNotFit(id, absl::StrFormat("page %d is in no table", i));
  }
  return absl::OkStatus();
}

// An image's shared and offered pages against the stream's `sharing` (null:
// none), and its remembered request ids.
absl::Status CheckImageSharing(const SequenceImage& image, const std::vector<int32_t>* stream_pages) {
  const std::string& id = image.id;
  const int64_t shared = static_cast<int64_t>(image.shared_pages.size());
  if (shared > image.num_pages) {
    return DoesNotFit(id, absl::StrFormat("it shares %d of its %d pages", shared, image.num_pages));
  }
  if (shared > 0 && stream_pages == nullptr) {
    return DoesNotFit(id, absl::StrFormat("it shares %d pages with earlier sequences, outside a stream", shared));
  }
  absl::flat_hash_map<int64_t, bool> named;
  for (int64_t stream_index : image.shared_pages) {
    if (stream_index < 0 || stream_index >= static_cast<int64_t>(stream_pages->size()) ||
        (*stream_pages)[stream_index] < 0 || !named.emplace(stream_index, true).second) {
      return DoesNotFit(
          id, absl::StrFormat("it shares stream page %d, which no earlier sequence offered (or twice)", stream_index));
    }
  }
  for (size_t i = 0; i < image.offered_pages.size(); ++i) {
    const int64_t page = image.offered_pages[i];
    if (page < 0 || page >= image.carried_pages() || (i > 0 && page <= image.offered_pages[i - 1])) {
      return DoesNotFit(id, absl::StrFormat("it offers page %d; want ascending pages below its %d carried ones", page,
                                            image.carried_pages()));
    }
  }
  if (image.recent_appends.size() > static_cast<size_t>(kRememberedAppends)) {
    return DoesNotFit(id, absl::StrFormat("it remembers %d request ids; want at most %d", image.recent_appends.size(),
                                          kRememberedAppends));
  }
  for (const SequenceImage::RememberedAppend& r : image.recent_appends) {
    if (r.request_id.empty() || r.request_id.size() > 64)
      return DoesNotFit(id, "a remembered request id is not 1..64 bytes");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SequenceImport>> KvCache::BeginImport(const SequenceImage& image,
                                                                     std::shared_ptr<UsageAccount> account,
                                                                     ImportSharing* sharing) {
  const KvLayout& layout = *layout_;
  const std::string& id = image.id;
  // Everything a read or a later append relies on is checked first: a
  // malformed image must not make a kernel read outside the pool.
  if (id.empty()) return absl::InvalidArgumentError("sequence id is empty; want a non-empty id");
  RETURN_IF_ERROR(CheckImageLayers(layout, image));
  if (image.num_pages < 0) return DoesNotFit(id, absl::StrFormat("it has %d pages", image.num_pages));
  RETURN_IF_ERROR(CheckImageSharing(image, sharing == nullptr ? nullptr : &sharing->pool_page_));
  if (image.carried_pages() > pool_.num_pages) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cache '%s' cannot hold sequence '%s': %d pages, the pool has %d", options_.name, id,
                        image.carried_pages(), pool_.num_pages));
  }
  RETURN_IF_ERROR(CheckImageTables(layout, image));

  State& s = *state_;
  // The pool gives the carried pages; the account is charged for every
  // page, shared ones included, as a fork is.
  const int32_t need = static_cast<int32_t>(image.carried_pages());
  const uint64_t charged = static_cast<uint64_t>(image.num_pages) * layout.page_bytes();
  std::vector<int32_t> allocated;
  absl::MutexLock lock(&s.mu);
  s.AwaitNoWriter(id);
  if (s.sequences.contains(id)) {
    return absl::AlreadyExistsError(absl::StrFormat("sequence '%s' already exists in cache '%s'", id, s.name));
  }
  const absl::Time now = s.clock();
  s.EvictExpiredLocked(now, &id);
  if (account != nullptr) RETURN_IF_ERROR(account->TryReserve(/*new_sequence=*/true, charged, "this import"));
  if (absl::Status room = s.MakeRoom(need, id, now); !room.ok()) {
    if (account != nullptr) account->Unreserve(/*new_sequence=*/true, charged);
    return room;
  }
  (void)s.pages.Allocate(need, &allocated);
  // Reserved, invisible, held: calls naming the id wait for the commit or
  // the abort, as for a first append in flight.
  Sequence* seq = s.AddSequence(id, /*pending=*/true, now);
  seq->account = std::move(account);
  seq->charged_bytes = seq->account != nullptr ? charged : 0;
  seq->writer_active = true;
  // Made only now: its destructor gives back what is reserved above, so no
  // refused import may own one.
  std::unique_ptr<SequenceImport> import(new SequenceImport());
  import->cache_ = this;
  import->state_ = image;
  import->state_.pages.clear();
  import->allocated_ = std::move(allocated);
  if (sharing != nullptr) {
    // Its carried pages take the next stream indices, offered or not.
    import->sharing_ = sharing;
    import->stream_base_ = sharing->carried_pages();
    sharing->pool_page_.resize(sharing->pool_page_.size() + need, -1);
  }
  return import;
}

absl::Status SequenceImport::WritePages(int64_t first, int64_t count, const uint8_t* data) {
  if (finished_) return absl::FailedPreconditionError("the import has ended");
  if (first < 0 || count < 0 || first > num_pages() || count > num_pages() - first) {
    return absl::InvalidArgumentError(absl::StrFormat("pages [%d, %d) are outside sequence '%s''s %d carried pages",
                                                      first, first + count, state_.id, num_pages()));
  }
  return cache_->backend_->WritePages(cache_->pool_, absl::MakeConstSpan(allocated_.data() + first, count), data);
}

absl::Status SequenceImport::Commit() {
  if (finished_) return absl::FailedPreconditionError("the import has ended");
  return cache_->EndImport(*this, /*commit=*/true);
}

SequenceImport::~SequenceImport() {
  if (!finished_ && cache_ != nullptr) (void)cache_->EndImport(*this, /*commit=*/false);
}

absl::Status KvCache::EndImport(SequenceImport& import, bool commit) {
  import.finished_ = true;
  const KvLayout& layout = *layout_;
  const SequenceImage& image = import.state_;
  const std::vector<int32_t>& allocated = import.allocated_;
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  Sequence* seq = s.sequences.at(image.id).get();  // reserved by BeginImport: only this import removes it
  if (!commit) {
    for (int32_t page : allocated) s.pages.Release(page);
    if (seq->account != nullptr) seq->account->Unreserve(/*new_sequence=*/true, seq->charged_bytes);
    s.sequences.erase(image.id);
    return absl::OkStatus();
  }
  // The image's page i: a carried page, or one the stream's sharing keeps
  // (BeginImport checked that it does), which gains this holder.
  std::vector<int32_t> pool_page = allocated;
  for (int64_t stream_index : image.shared_pages) {
    const int32_t page = import.sharing_->pool_page_[stream_index];
    s.pages.AddRef(page);
    pool_page.push_back(page);
  }
  if (import.sharing_ != nullptr) {
    for (int64_t i : image.offered_pages) {
      import.sharing_->pool_page_[import.stream_base_ + i] = allocated[i];
      s.pages.AddRef(allocated[i]);
    }
  }
  const auto map = [&pool_page](const std::vector<int32_t>& table) {
    std::vector<int32_t> out(table.size(), -1);
    for (size_t k = 0; k < table.size(); ++k) out[k] = table[k] < 0 ? -1 : pool_page[table[k]];
    return out;
  };
  for (int chunk = 0; chunk < layout.num_chunks(); ++chunk) {
    seq->tables[chunk] = map(image.tables[chunk]);
    seq->exact_tables[chunk] = map(image.exact_tables[chunk]);
  }
  seq->layer_tokens = image.layer_tokens;
  seq->held_begin = image.held_begin;
  for (int l = 0; l < layout.num_layers(); ++l) {
    if (image.key_means[l].empty()) continue;
    auto mean = std::make_shared<std::vector<float>>(image.key_means[l]);
    mean->resize(layout.mean_floats(), 1.0f);  // an unscaled sequence: scales 1 (CheckImage)
    seq->key_means[l] = std::move(mean);
  }
  seq->max_tokens = *std::max_element(image.layer_tokens.begin(), image.layer_tokens.end());
  for (const SequenceImage::RememberedAppend& r : image.recent_appends) {
    seq->recent_appends.push_back({r.request_id, r.start, r.tokens, r.layer_begin, r.layer_end});
  }
  CountBytes(layout, seq->layer_tokens, seq->held_begin, &seq->stored_bytes, &seq->stored_bytes_bf16);
  s.stored_bytes += seq->stored_bytes;
  s.stored_bytes_bf16 += seq->stored_bytes_bf16;
  s.tokens += seq->max_tokens;
  ++s.num_sequences;
  seq->pending = false;
  seq->writer_active = false;
  s.Recharge(seq);
  s.Touch(seq, s.clock());
  return absl::OkStatus();
}

absl::Status KvCache::ImportSequence(const SequenceImage& image, std::shared_ptr<UsageAccount> account) {
  if (image.num_pages < 0 || image.shared_pages.size() > static_cast<size_t>(image.num_pages) ||
      image.pages.size() != static_cast<size_t>(image.carried_pages()) * layout_->page_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence '%s' does not fit this cache: %d carried pages in %d bytes; want pages of %d bytes",
                        image.id, image.carried_pages(), image.pages.size(), layout_->page_bytes()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SequenceImport> import, BeginImport(image, std::move(account)));
  RETURN_IF_ERROR(import->WritePages(0, import->num_pages(), image.pages.data()));
  return import->Commit();
}

}  // namespace tqkv
