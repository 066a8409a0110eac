#include "cache/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cache/page_allocator.h"
#include "kernels/key_centering.h"
#include "kernels/status_macros.h"

namespace tqkv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls f(page) for every page a table holds (-1 entries: given back).
template <typename F>
void ForEachHeld(const std::vector<int32_t>& table, F f) {
  for (int32_t page : table) {
    if (page >= 0) f(page);
  }
}

// Bytes a sequence's tokens take (KvLayout::layer_bytes), summed over layers:
// tokens [held_begin, layer_tokens) of each.
void CountBytes(const KvLayout& layout, const std::vector<int64_t>& layer_tokens,
                const std::vector<int64_t>& held_begin, uint64_t* bytes, uint64_t* bytes_bf16) {
  *bytes = 0;
  *bytes_bf16 = 0;
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    *bytes += layout.layer_bytes(layer, layer_tokens[layer], held_begin[layer]);
    *bytes_bf16 += static_cast<uint64_t>(layer_tokens[layer] - held_begin[layer]) * layout.token_bytes_bf16();
  }
}

// The positions of an append of [start, start + n) that get an exact copy:
// sinks and the window the layers have after it, as at most two runs.
std::vector<std::pair<int64_t, int64_t>> ExactRuns(const KvLayout& layout, int64_t start, int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (!layout.has_exact_tokens()) return runs;
  const ExactRanges r = layout.exact_ranges(start + n);
  if (start < r.sink_end) runs.push_back({start, r.sink_end});
  const int64_t window_begin = std::max(start, r.window_begin);
  if (window_begin < start + n) {
    if (!runs.empty() && runs.back().second >= window_begin) {
      runs.back().second = start + n;
    } else {
      runs.push_back({window_begin, start + n});
    }
  }
  return runs;
}

// What an append must do to one table before it writes: pages to copy
// (shared ones it writes into) and entries to fill with fresh pages.
struct TablePlan {
  std::vector<int32_t> table;       // the new table; fresh entries still -1
  std::vector<int64_t> copy;        // indices whose shared page is copied
  std::vector<int64_t> fresh;       // indices that get a fresh page
  int32_t pages_needed() const { return static_cast<int32_t>(copy.size() + fresh.size()); }
};

// Plans writes to the pages holding positions in `runs`, `page_tokens` per
// page, growing the table to `size` entries (new ones -1).
TablePlan PlanTableWrites(const PageAllocator& pages, const std::vector<int32_t>& table, int64_t size,
                          const std::vector<std::pair<int64_t, int64_t>>& runs, int page_tokens) {
  TablePlan plan;
  plan.table = table;
  if (static_cast<int64_t>(plan.table.size()) < size) plan.table.resize(size, -1);
  int64_t last = -1;
  for (const auto& [begin, end] : runs) {
    for (int64_t block = std::max(begin / page_tokens, last + 1); block < CeilDiv(end, page_tokens); ++block) {
      const int32_t page = plan.table[block];
      if (page < 0) {
        plan.fresh.push_back(block);
      } else if (pages.refs(page) > 1) {
        plan.copy.push_back(block);
      }
      last = block;
    }
  }
  return plan;
}

// Every field is guarded by the cache's State::mu.
struct Sequence {
  std::string id;
  // Tells a re-created id apart from a dropped one when an in-flight read
  // comes back to release its hold.
  uint64_t serial = 0;
  std::vector<int64_t> layer_tokens;
  // Per layer, the oldest token held: 0, except in a sliding-window layer
  // whose appends gave older tokens back (KvLayout::WindowBegin of the last
  // append's start). Reads never reach below it.
  std::vector<int64_t> held_begin;
  int64_t max_tokens = 0;
  // Per chunk (KvLayout::chunk_layers), the pages by page index; -1 where a
  // windowed chunk gave the page back (every token older than its layers'
  // held_begin).
  std::vector<std::vector<int32_t>> tables;
  // Per chunk, exact pages (KvLayout::exact_layout()), by exact page index;
  // -1 where no token of the page is read exact any more (released) or none
  // was written.
  std::vector<std::vector<int32_t>> exact_tables;
  // Key means per layer (KvLayout::mean_floats() floats), set by the layer's
  // first append and immutable after: readers and forks share them.
  std::vector<std::shared_ptr<const std::vector<float>>> key_means;
  absl::Time last_access;
  // Breaks last_access ties (a coarse or frozen clock) in touch order.
  uint64_t access_order = 0;
  uint64_t stored_bytes = 0;
  uint64_t stored_bytes_bf16 = 0;
  // The last kRememberedAppends appends that carried a request_id, oldest
  // first (AppendRequest::request_id).
  struct RememberedAppend {
    std::string request_id;
    int64_t start;
    int64_t tokens;
    int layer_begin;
    int layer_end;
  };
  std::deque<RememberedAppend> recent_appends;
  // An append is between its two critical sections. Only that append changes
  // the block table then; Drop and Fork wait, eviction skips the sequence.
  bool writer_active = false;
  // Made by an append that has not published yet: invisible to everything
  // but other appends to the id, and removed again if that append fails.
  bool pending = false;
  // Attend / Score calls in flight; a sequence with readers is not idle.
  int readers = 0;
  // The account it is charged to (null: none), and what is charged there
  // now: pool pages in bytes (including pages an append in flight has
  // reserved) and tokens.
  std::shared_ptr<UsageAccount> account;
  uint64_t charged_bytes = 0;
  int64_t charged_tokens = 0;
};

// Calls f(page) for every page a sequence holds, in all its tables.
template <typename F>
void ForEachPage(const Sequence& seq, F f) {
  for (const std::vector<int32_t>& table : seq.tables) ForEachHeld(table, f);
  for (const std::vector<int32_t>& table : seq.exact_tables) ForEachHeld(table, f);
}

// A sequence's pages as an export numbers them (SequenceImage): carried
// pages first, in table order (block tables, then exact ones), then those
// `kept` (an ExportSharing's pages, by stream index; null: none) already has.
struct PageNumbering {
  std::vector<int32_t> carried;  // pool pages, by image index
  std::vector<int64_t> shared;   // stream indices of the pages after them
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
// kernels read these outside it.
struct ReadSnapshot {
  uint64_t serial = 0;
  int64_t length = 0;
  std::vector<int32_t> table;        // the layer's chunk's; pinned where >= 0
  std::vector<int32_t> exact_table;  // pinned where >= 0
  bool has_exact = false;
  std::shared_ptr<const std::vector<float>> key_mean;

  const int32_t* exact_table_or_null() const { return has_exact ? exact_table.data() : nullptr; }
  const float* key_mean_or_null() const { return key_mean ? key_mean->data() : nullptr; }
};

// Scans a [layers, tokens, kv_heads, head_dim] tensor for NaN and infinity so
// that the common bad input fails before any page is touched.
absl::Status CheckFinite(const char* name, const float* data, int layer_begin, int layers,
                         int64_t tokens, int heads, int dim) {
  const int64_t count = static_cast<int64_t>(layers) * tokens * heads * dim;
  // A branch-free pass the compiler vectorizes (an exponent of all ones is
  // NaN or Inf); the element is looked for only when there is one.
  uint32_t all_ones = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, data + i, 4);
    all_ones |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  if (all_ones == 0) return absl::OkStatus();
  for (int64_t i = 0; i < count; ++i) {
    if (std::isfinite(data[i])) continue;
    const int64_t row = i / dim;
    return absl::InvalidArgumentError(
        absl::StrFormat("%s[layer %d, token %d, kv head %d, dim %d] is %f; want finite values",
                        name, layer_begin + row / (tokens * heads), (row / heads) % tokens,
                        row % heads, i % dim, data[i]));
  }
  return absl::OkStatus();
}

// Logit scale: 0 selects the usual 1 / sqrt(head_dim).
absl::Status CheckScale(float scale) {
  if (!std::isfinite(scale) || scale < 0.0f) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "scale is %g; want a finite value >= 0 (0 means 1 / sqrt(head_dim))", scale));
  }
  return absl::OkStatus();
}

float EffectiveScale(float scale, const KvLayout& layout) {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(layout.head_dim()));
}

}  // namespace

struct KvCache::State {
  State(const CacheOptions& options, const KvLayout* layout, int32_t num_pages)
      : name(options.name),
        layout(layout),
        clock(options.clock ? options.clock : std::function<absl::Time()>(&absl::Now)),
        idle_ttl(options.idle_ttl),
        evict_lru(options.evict_lru),
        pages(num_pages) {}

  // Everything below `mu` is bookkeeping; kernels never run under it.
  const std::string name;
  const KvLayout* const layout;
  const std::function<absl::Time()> clock;
  const absl::Duration idle_ttl;
  const bool evict_lru;

  absl::Mutex mu;
  PageAllocator pages ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::unique_ptr<Sequence>> sequences ABSL_GUARDED_BY(mu);
  uint64_t next_serial ABSL_GUARDED_BY(mu) = 1;
  uint64_t next_access ABSL_GUARDED_BY(mu) = 1;
  // Running totals over published sequences (pending ones excluded).
  int64_t num_sequences ABSL_GUARDED_BY(mu) = 0;
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;
  uint64_t stored_bytes ABSL_GUARDED_BY(mu) = 0;
  uint64_t stored_bytes_bf16 ABSL_GUARDED_BY(mu) = 0;
  uint64_t evictions ABSL_GUARDED_BY(mu) = 0;
  uint64_t copy_on_writes ABSL_GUARDED_BY(mu) = 0;
  uint64_t evicted_lookups ABSL_GUARDED_BY(mu) = 0;

  // The last kEvictedMemory sequences evicted, so that NOT_FOUND can tell an
  // evicted sequence from one that never existed. Forgotten when the id is
  // used again.
  static constexpr size_t kEvictedMemory = 4096;
  struct Evicted {
    absl::Time at;
    const char* reason;
    uint64_t serial;  // matches evicted_order's entry while it is the latest
  };
  absl::flat_hash_map<std::string, Evicted> evicted ABSL_GUARDED_BY(mu);
  std::deque<std::pair<std::string, uint64_t>> evicted_order ABSL_GUARDED_BY(mu);
  uint64_t next_evicted_serial ABSL_GUARDED_BY(mu) = 1;

  void RecordEvicted(const std::string& id, absl::Time now, const char* reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const uint64_t serial = next_evicted_serial++;
    evicted[id] = Evicted{now, reason, serial};
    evicted_order.emplace_back(id, serial);
    while (evicted_order.size() > kEvictedMemory) {
      auto it = evicted.find(evicted_order.front().first);
      if (it != evicted.end() && it->second.serial == evicted_order.front().second) evicted.erase(it);
      evicted_order.pop_front();
    }
  }

  // NOT_FOUND for sequence `id`: `message`, and when this cache evicted it,
  // when and why.
  absl::Status SequenceNotFound(const std::string& id, std::string message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = evicted.find(id);
    if (it != evicted.end()) {
      ++evicted_lookups;
      const absl::Duration age = absl::Trunc(clock() - it->second.at, absl::Milliseconds(1));
      absl::StrAppend(&message, "; it was evicted ", age == absl::ZeroDuration() ? "0s" : absl::FormatDuration(age),
                      " ago (", it->second.reason, ")");
    }
    return absl::NotFoundError(message);
  }

  void Touch(Sequence* seq, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    seq->last_access = now;
    seq->access_order = next_access++;
  }

  // A published sequence, or null.
  Sequence* FindVisible(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = sequences.find(id);
    if (it == sequences.end() || it->second->pending) return nullptr;
    return it->second.get();
  }

  Sequence* AddSequence(const std::string& id, bool pending, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto seq = std::make_unique<Sequence>();
    seq->id = id;
    seq->serial = next_serial++;
    seq->layer_tokens.assign(layout->num_layers(), 0);
    seq->held_begin.assign(layout->num_layers(), 0);
    seq->tables.resize(layout->num_chunks());
    seq->exact_tables.resize(layout->num_chunks());
    seq->key_means.resize(layout->num_layers());
    seq->pending = pending;
    Touch(seq.get(), now);
    if (!pending) ++num_sequences;
    Sequence* raw = seq.get();
    sequences[id] = std::move(seq);
    evicted.erase(id);
    return raw;
  }

  // Removes a published sequence and releases its pages (pinned ones go back
  // to the free list when their last reader unpins them).
  // REQUIRES: !seq->writer_active.
  void DropLocked(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ForEachPage(*seq, [&](int32_t page) { pages.Release(page); });
    if (seq->account != nullptr) {
      seq->account->AdjustBytes(-static_cast<int64_t>(seq->charged_bytes));
      seq->account->AddTokens(-seq->charged_tokens);
      seq->account->RemoveSequence();
    }
    --num_sequences;
    tokens -= seq->max_tokens;
    stored_bytes -= seq->stored_bytes;
    stored_bytes_bf16 -= seq->stored_bytes_bf16;
    sequences.erase(sequences.find(seq->id));
  }

  struct NoWriterArgs {
    State* state;
    const std::string* a;
    const std::string* b;
  };
  // Evaluated by absl::Mutex with `mu` held, possibly on another thread.
  static bool NoWriterOn(NoWriterArgs* args) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (const std::string* id : {args->a, args->b}) {
      if (id == nullptr) continue;
      auto it = args->state->sequences.find(*id);
      if (it != args->state->sequences.end() && it->second->writer_active) return false;
    }
    return true;
  }
  // Waits until no append is in flight on `a` (nor on `b`, when given).
  void AwaitNoWriter(const std::string& a, const std::string* b = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    NoWriterArgs args{this, &a, b};
    mu.Await(absl::Condition(&NoWriterOn, &args));
  }

  // Drops published sequences idle for longer than the TTL, except `keep`.
  int EvictExpiredLocked(absl::Time now, const std::string* keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (idle_ttl == absl::InfiniteDuration()) return 0;
    std::vector<Sequence*> expired;
    for (const auto& [id, seq] : sequences) {
      if (seq->pending || seq->writer_active) continue;
      if (keep != nullptr && id == *keep) continue;
      if (now - seq->last_access > idle_ttl) expired.push_back(seq.get());
    }
    for (Sequence* seq : expired) {
      RecordEvicted(seq->id, now, "idle longer than the cache's idle TTL");
      DropLocked(seq);
    }
    evictions += expired.size();
    return static_cast<int>(expired.size());
  }

  // Ensures `need` free pages for a call on `keep`: at once, or by LRU
  // eviction when the cache evicts (all or nothing); RESOURCE_EXHAUSTED,
  // evicting nobody, otherwise.
  absl::Status MakeRoom(int32_t need, const std::string& keep, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (need <= pages.num_free()) return absl::OkStatus();
    const int32_t free_before = pages.num_free();
    std::vector<Sequence*> victims;
    int32_t reachable = free_before;
    if (!evict_lru || !PlanLruEviction(need, keep, &victims, &reachable)) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "cache '%s' is full: need %d pages, %d free of %d%s", name, need, free_before, pages.num_pages(),
          evict_lru ? absl::StrFormat("; evicting every idle sequence would free only %d", reachable - free_before)
                    : std::string()));
    }
    for (Sequence* victim : victims) {
      RecordEvicted(victim->id, now, "least recently used, to make room in a full pool");
      DropLocked(victim);
    }
    evictions += victims.size();
    return absl::OkStatus();
  }

  // Picks idle sequences, least recently used first, whose dropping brings
  // the free pages to `need`. Simulates the releases first so that eviction
  // is all-or-nothing: returns false, choosing none, when even dropping every
  // idle sequence is not enough (shared or pinned pages free nothing).
  bool PlanLruEviction(int32_t need, const std::string& keep, std::vector<Sequence*>* victims,
                       int32_t* reachable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<Sequence*> idle;
    for (const auto& [id, seq] : sequences) {
      if (seq->pending || seq->writer_active || seq->readers > 0 || id == keep) continue;
      idle.push_back(seq.get());
    }
    std::sort(idle.begin(), idle.end(), [](const Sequence* x, const Sequence* y) {
      if (x->last_access != y->last_access) return x->last_access < y->last_access;
      return x->access_order < y->access_order;
    });
    absl::flat_hash_map<int32_t, int32_t> refs_left;
    int32_t free_pages = pages.num_free();
    for (Sequence* seq : idle) {
      if (free_pages >= need) break;
      victims->push_back(seq);
      ForEachPage(*seq, [&](int32_t page) {
        int32_t& left = refs_left.try_emplace(page, pages.refs(page)).first->second;
        if (--left == 0 && pages.pins(page) == 0) ++free_pages;
      });
    }
    *reachable = free_pages;
    if (free_pages >= need) return true;
    victims->clear();
    return false;
  }

  // Brings what `seq` is charged to its account to what it holds now.
  void Recharge(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (seq->account == nullptr) return;
    int64_t held = 0;
    ForEachPage(*seq, [&](int32_t) { ++held; });
    const uint64_t bytes = static_cast<uint64_t>(held) * layout->page_bytes();
    seq->account->AdjustBytes(static_cast<int64_t>(bytes) - static_cast<int64_t>(seq->charged_bytes));
    seq->account->AddTokens(seq->max_tokens - seq->charged_tokens);
    seq->charged_bytes = bytes;
    seq->charged_tokens = seq->max_tokens;
  }

  // The oldest token any layer of `chunk` still holds or will write.
  int64_t ChunkHeldBegin(const Sequence& seq, int chunk) const {
    int64_t held = std::numeric_limits<int64_t>::max();
    for (int layer : layout->chunk_layers(chunk)) held = std::min(held, seq.held_begin[layer]);
    return held;
  }

  // Releases the pages of `table` (`page_tokens` per page) all of whose
  // tokens are below `held`.
  void ReleaseBelow(std::vector<int32_t>* table, int64_t page_tokens, int64_t held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (size_t k = 0; k < table->size() && static_cast<int64_t>(k + 1) * page_tokens <= held; ++k) {
      if ((*table)[k] < 0) continue;
      pages.Release((*table)[k]);
      (*table)[k] = -1;
    }
  }

  // Releases what a windowed chunk's layers gave back: the pages, compressed
  // and exact, all of whose tokens are below every layer's held_begin.
  void ReleaseGivenBack(Sequence* seq, int chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (layout->chunk_window(chunk) == 0) return;
    const int64_t held = ChunkHeldBegin(*seq, chunk);
    ReleaseBelow(&seq->tables[chunk], layout->page_tokens(), held);
    if (layout->has_exact_tokens()) ReleaseBelow(&seq->exact_tables[chunk], layout->exact_page_tokens(), held);
  }

  // Releases the exact pages of a chunk that no layer of it reads exact any
  // more: those without a sink token that end before the window of the
  // shortest non-empty layer.
  void ReleaseLeftExactPages(Sequence* seq, int chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!layout->has_exact_tokens()) return;
    int64_t shortest = -1;
    for (int layer : layout->chunk_layers(chunk)) {
      const int64_t length = seq->layer_tokens[layer];
      if (length > 0 && (shortest < 0 || length < shortest)) shortest = length;
    }
    if (shortest < 0) return;
    const int64_t page_tokens = layout->exact_page_tokens();
    const int64_t sinks = layout->options().exact_sink_tokens;
    const int64_t window_begin = shortest - layout->options().exact_window_tokens;
    std::vector<int32_t>& exact_table = seq->exact_tables[chunk];
    for (size_t k = 0; k < exact_table.size(); ++k) {
      const int64_t begin = static_cast<int64_t>(k) * page_tokens;
      if (exact_table[k] < 0 || begin < sinks || begin + page_tokens > window_begin) continue;
      pages.Release(exact_table[k]);
      exact_table[k] = -1;
    }
  }

  // Copies what a read of `layer` (holding `length` tokens) needs, pins its
  // pages and counts the reader.
  void TakeSnapshot(Sequence* seq, int layer, int64_t length, ReadSnapshot* snap)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int chunk = layout->layer_chunk(layer);
    const std::vector<int32_t>& table = seq->tables[chunk];
    snap->serial = seq->serial;
    snap->length = length;
    snap->table.assign(table.begin(), table.begin() + CeilDiv(length, layout->page_tokens()));
    if (layout->has_exact_tokens()) {
      const std::vector<int32_t>& exact_table = seq->exact_tables[chunk];
      const size_t used = std::min<size_t>(exact_table.size(), CeilDiv(length, layout->exact_page_tokens()));
      snap->exact_table.assign(exact_table.begin(), exact_table.begin() + used);
      snap->has_exact = true;
    }
    snap->key_mean = seq->key_means[layer];
    ForEachHeld(snap->table, [&](int32_t page) { pages.Pin(page); });
    ForEachHeld(snap->exact_table, [&](int32_t page) { pages.Pin(page); });
    ++seq->readers;
  }

  // Releases what an in-flight read took: its pins and its reader count.
  void EndRead(const std::string& id, const ReadSnapshot& snap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ForEachHeld(snap.table, [&](int32_t page) { pages.Unpin(page); });
    ForEachHeld(snap.exact_table, [&](int32_t page) { pages.Unpin(page); });
    auto it = sequences.find(id);
    if (it != sequences.end() && it->second->serial == snap.serial) --it->second->readers;
  }
};

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const CacheOptions& options,
                                                         Backend* backend) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cache '%s': backend is null; want a backend", options.name));
  }
  if (options.idle_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache '%s': idle_ttl is %s; want a positive duration or InfiniteDuration() to disable",
        options.name, absl::FormatDuration(options.idle_ttl)));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const KvLayout> layout, KvLayout::Create(options.layout));
  if (absl::Status supported = backend->SupportsLayout(*layout); !supported.ok()) {
    return absl::Status(supported.code(), absl::StrFormat("cache '%s' on the %s backend: %s", options.name,
                                                          backend->name(), supported.message()));
  }
  const size_t page_bytes = layout->page_bytes();
  // Slots (page * page_tokens + slot) are int32 in the kernels' params.
  const int64_t max_pages = std::numeric_limits<int32_t>::max() / layout->page_tokens();
  const int64_t num_pages =
      static_cast<int64_t>(std::min<uint64_t>(options.memory_budget_bytes / page_bytes, max_pages));
  if (num_pages == 0) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cache '%s': a memory budget of %d bytes holds no page of %d bytes; want at least %d",
        options.name, options.memory_budget_bytes, page_bytes, page_bytes));
  }
  ASSIGN_OR_RETURN(PagePool pool, backend->AllocatePool(*layout, static_cast<int32_t>(num_pages)));
  return std::unique_ptr<KvCache>(new KvCache(options, std::move(layout), backend, pool));
}

KvCache::KvCache(const CacheOptions& options, std::shared_ptr<const KvLayout> layout,
                 Backend* backend, PagePool pool)
    : options_(options),
      layout_(std::move(layout)),
      backend_(backend),
      pool_(pool),
      state_(std::make_unique<State>(options, layout_.get(), pool.num_pages)) {}

KvCache::~KvCache() { backend_->FreePool(pool_); }

absl::Status KvCache::CreateSequence(const std::string& id, std::shared_ptr<UsageAccount> account) {
  if (id.empty()) return absl::InvalidArgumentError("sequence id is empty; want a non-empty id");
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  // A first append in flight on the id decides whether it exists.
  s.AwaitNoWriter(id);
  if (s.sequences.contains(id)) {
    return absl::AlreadyExistsError(
        absl::StrFormat("sequence '%s' already exists in cache '%s'", id, s.name));
  }
  if (account != nullptr) RETURN_IF_ERROR(account->TryAddSequence());
  s.AddSequence(id, /*pending=*/false, s.clock())->account = std::move(account);
  return absl::OkStatus();
}

absl::Status KvCache::Append(const AppendRequest& request, AppendOutcome* outcome) {
  if (outcome != nullptr) *outcome = AppendOutcome();
  const KvLayout& layout = *layout_;
  const std::string& id = request.sequence_id;
  const int64_t start = request.start_position;
  const int64_t n = request.num_tokens;
  const int page_tokens = layout.page_tokens();

  // Checks that need no state come first, outside the lock.
  if (id.empty()) return absl::InvalidArgumentError("sequence_id is empty; want a non-empty id");
  if (request.layer_begin < 0 || request.layer_end > layout.num_layers() ||
      request.layer_begin >= request.layer_end) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "layer range [%d, %d) is empty or outside the cache's %d layers; want "
        "0 <= layer_begin < layer_end <= %d",
        request.layer_begin, request.layer_end, layout.num_layers(), layout.num_layers()));
  }
  if (n < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("num_tokens is %d; want at least 1", n));
  }
  if (request.keys == nullptr || request.values == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is null; want [layers, tokens, kv_heads, head_dim] floats",
                        request.keys == nullptr ? "keys" : "values"));
  }
  if (start < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("start_position is %d; want a non-negative position", start));
  }
  const int64_t capacity_tokens = static_cast<int64_t>(pool_.num_pages) * page_tokens;
  // Layers that keep every token bound a sequence by the pool; windowed ones
  // give old pages back, so only the page check below bounds them. A start
  // beyond the pool is a gap, reported below with the expected position.
  bool keeps_every_token = false;
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    keeps_every_token = keeps_every_token || layout.layer_window(layer) == 0;
  }
  if (keeps_every_token && start <= capacity_tokens && n > capacity_tokens - start) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cache '%s' cannot hold tokens [%d, %d): its %d pages hold %d tokens per sequence",
        options_.name, start, start + n, pool_.num_pages, capacity_tokens));
  }
  const int layers = request.layer_end - request.layer_begin;
  RETURN_IF_ERROR(CheckFinite("keys", request.keys, request.layer_begin, layers, n,
                              layout.num_kv_heads(), layout.head_dim()));
  RETURN_IF_ERROR(CheckFinite("values", request.values, request.layer_begin, layers, n,
                              layout.num_kv_heads(), layout.head_dim()));

  State& s = *state_;
  Sequence* seq = nullptr;
  std::vector<int32_t> allocated;  // owned by this call until publish
  // The chunks the append writes (KvLayout::chunk_layers), and per chunk the
  // plans of its tables.
  std::vector<int> chunks;
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    const int chunk = layout.layer_chunk(layer);
    if (std::find(chunks.begin(), chunks.end(), chunk) == chunks.end()) chunks.push_back(chunk);
  }
  std::vector<TablePlan> main_plans(layout.num_chunks()), exact_plans(layout.num_chunks());
  struct PageCopy {
    int32_t from;  // the shared page
    int32_t to;    // its fresh copy
  };
  std::vector<PageCopy> copies;
  // Per chunk: slots of the tokens, and of their exact copies.
  std::vector<std::vector<int32_t>> slots(layout.num_chunks()), exact_slots(layout.num_chunks());
  const std::vector<std::pair<int64_t, int64_t>> exact_runs = ExactRuns(layout, start, n);
  // Key means of the layers in range: taken from the sequence, or (first
  // append, start 0) estimated from this append's keys below.
  std::vector<std::shared_ptr<const std::vector<float>>> means(layers);
  uint64_t reserved = 0;  // bytes charged to the account for fresh pages
  {
    absl::MutexLock lock(&s.mu);
    // Appends to one sequence are serialized; the winner's result decides
    // what this one must start at, so every check below runs after the wait.
    s.AwaitNoWriter(id);
    auto it = s.sequences.find(id);
    seq = it == s.sequences.end() ? nullptr : it->second.get();
    if (seq == nullptr && !request.create_if_missing) {
      return s.SequenceNotFound(id, absl::StrFormat(
          "sequence '%s' not found in cache '%s'; create it first (CreateSequence), or append "
          "without do_not_create",
          id, s.name));
    }
    if (seq != nullptr && !request.request_id.empty()) {
      for (const Sequence::RememberedAppend& r : seq->recent_appends) {
        if (r.request_id != request.request_id) continue;
        if (r.start == start && r.tokens == n && r.layer_begin == request.layer_begin &&
            r.layer_end == request.layer_end) {
          if (outcome != nullptr) outcome->already_stored = true;
          s.Touch(seq, s.clock());
          return absl::OkStatus();
        }
        return absl::InvalidArgumentError(absl::StrFormat(
            "request_id '%s' already named an append to sequence '%s' (tokens [%d, %d) of layers [%d, "
            "%d)); this one is tokens [%d, %d) of layers [%d, %d): give every append its own request_id",
            request.request_id, id, r.start, r.start + r.tokens, r.layer_begin, r.layer_end, start, start + n,
            request.layer_begin, request.layer_end));
      }
    }
    for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
      const int64_t have = seq == nullptr ? 0 : seq->layer_tokens[layer];
      if (have != start) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "sequence '%s' layer %d holds %d tokens; an append must start at %d, got %d", id, layer,
            have, have, start));
      }
    }

    const absl::Time now = s.clock();
    s.EvictExpiredLocked(now, &id);

    static const std::vector<int32_t> kNoPages;
    int32_t need = 0;
    for (int chunk : chunks) {
      // With per-layer lengths any existing page from the first written
      // position on may be written (for these layers), not just the last
      // one. Pages a windowed chunk gave back lie below every layer's
      // held_begin <= start, so the append never writes one.
      int64_t chunk_max = 0;
      if (seq != nullptr) {
        for (int layer : layout.chunk_layers(chunk)) chunk_max = std::max(chunk_max, seq->layer_tokens[layer]);
      }
      const int64_t end = std::max(chunk_max, start + n);
      main_plans[chunk] = PlanTableWrites(s.pages, seq == nullptr ? kNoPages : seq->tables[chunk],
                                          CeilDiv(end, page_tokens), {{start, start + n}}, page_tokens);
      if (layout.has_exact_tokens()) {
        const int exact_tokens = layout.exact_page_tokens();
        exact_plans[chunk] = PlanTableWrites(s.pages, seq == nullptr ? kNoPages : seq->exact_tables[chunk],
                                             CeilDiv(end, exact_tokens), exact_runs, exact_tokens);
      }
      need += main_plans[chunk].pages_needed() + exact_plans[chunk].pages_needed();
    }

    // The account's limits before the pool's: a sequence at its quota
    // evicts nobody. Copies replace pages the sequence holds already.
    UsageAccount* const account = seq != nullptr ? seq->account.get() : request.account.get();
    int64_t fresh = 0;
    for (int chunk : chunks) fresh += main_plans[chunk].fresh.size() + exact_plans[chunk].fresh.size();
    reserved = static_cast<uint64_t>(fresh) * layout.page_bytes();
    if (account != nullptr) RETURN_IF_ERROR(account->TryReserve(seq == nullptr, reserved, "this append"));
    if (absl::Status room = s.MakeRoom(need, id, now); !room.ok()) {
      if (account != nullptr) account->Unreserve(seq == nullptr, reserved);
      return room;
    }
    const bool allocated_ok = s.pages.Allocate(need, &allocated);
    (void)allocated_ok;  // `need` free pages were ensured above.
    size_t next = 0;
    for (int chunk : chunks) {
      for (TablePlan* plan : {&main_plans[chunk], &exact_plans[chunk]}) {
        for (int64_t block : plan->copy) {
          copies.push_back({plan->table[block], allocated[next]});
          plan->table[block] = allocated[next++];
        }
        for (int64_t block : plan->fresh) plan->table[block] = allocated[next++];
      }
    }

    if (seq == nullptr) {
      seq = s.AddSequence(id, /*pending=*/true, now);
      seq->account = request.account;
    }
    seq->charged_bytes += reserved;
    seq->writer_active = true;
    const int exact_tokens = layout.exact_page_tokens();
    for (int chunk : chunks) {
      const std::vector<int32_t>& table = main_plans[chunk].table;
      slots[chunk].resize(n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t position = start + i;
        slots[chunk][i] = table[position / page_tokens] * page_tokens + static_cast<int32_t>(position % page_tokens);
      }
      for (const auto& [begin, end] : exact_runs) {
        for (int64_t position = begin; position < end; ++position) {
          exact_slots[chunk].push_back(exact_plans[chunk].table[position / exact_tokens] * exact_tokens +
                                       static_cast<int32_t>(position % exact_tokens));
        }
      }
    }
    for (int l = 0; l < layers; ++l) means[l] = seq->key_means[request.layer_begin + l];
  }

  // Kernels run outside the lock. The pages written are either fresh ones
  // owned by this call or unshared ones whose published slots lie below
  // `start` for these layers, so concurrent readers are unaffected.
  absl::Status status;
  for (const PageCopy& copy : copies) {
    status = backend_->CopyPage(pool_, copy.from, copy.to);
    if (!status.ok()) break;
  }
  std::vector<float> centered;  // the keys as stored, when centering
  const float* keys = request.keys;
  if (status.ok() && layout.key_centering() != KeyCentering::kNone) {
    CenterKeys(request, &means, &centered);
    keys = centered.data();
  }
  // One Store per run of consecutive layers in one chunk.
  const size_t layer_floats = static_cast<size_t>(n) * layout.num_kv_heads() * layout.head_dim();
  for (int run_begin = request.layer_begin; status.ok() && run_begin < request.layer_end;) {
    const int chunk = layout.layer_chunk(run_begin);
    int run_end = run_begin + 1;
    while (run_end < request.layer_end && layout.layer_chunk(run_end) == chunk) ++run_end;
    const size_t offset = (run_begin - request.layer_begin) * layer_floats;
    StoreParams params;
    params.layout = layout_.get();
    params.pool = pool_;
    params.layer_begin = run_begin;
    params.layer_end = run_end;
    params.num_tokens = n;
    params.slots = slots[chunk].data();
    params.keys = keys + offset;
    params.values = request.values + offset;
    status = backend_->Store(params);
    if (status.ok() && !exact_slots[chunk].empty()) {
      status = StoreExact(params, start, exact_runs, exact_slots[chunk]);
    }
    run_begin = run_end;
  }

  absl::MutexLock lock(&s.mu);
  if (!status.ok()) {
    for (int32_t page : allocated) s.pages.Release(page);
    if (seq->account != nullptr) seq->account->Unreserve(seq->pending, reserved);
    seq->charged_bytes -= reserved;
    if (seq->pending) {
      s.sequences.erase(id);
    } else {
      seq->writer_active = false;
    }
    return absl::Status(status.code(), absl::StrFormat("append to sequence '%s' in cache '%s': %s",
                                                       id, s.name, status.message()));
  }
  // Publish: the tables, then the lengths readers go by.
  for (const PageCopy& copy : copies) s.pages.Release(copy.from);
  s.copy_on_writes += copies.size();
  for (int chunk : chunks) {
    seq->tables[chunk] = std::move(main_plans[chunk].table);
    if (layout.has_exact_tokens()) seq->exact_tables[chunk] = std::move(exact_plans[chunk].table);
  }
  const int64_t old_max = seq->max_tokens;
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    seq->layer_tokens[layer] = start + n;
    // The append's own queries see from start + 1 - window on.
    seq->held_begin[layer] = std::max(seq->held_begin[layer], layout.WindowBegin(layer, start));
    seq->key_means[layer] = means[layer - request.layer_begin];
  }
  for (int chunk : chunks) {
    s.ReleaseGivenBack(seq, chunk);
    s.ReleaseLeftExactPages(seq, chunk);
  }
  uint64_t bytes = 0, bytes_bf16 = 0;
  CountBytes(layout, seq->layer_tokens, seq->held_begin, &bytes, &bytes_bf16);
  s.stored_bytes += bytes - seq->stored_bytes;
  s.stored_bytes_bf16 += bytes_bf16 - seq->stored_bytes_bf16;
  seq->stored_bytes = bytes;
  seq->stored_bytes_bf16 = bytes_bf16;
  seq->max_tokens = std::max(old_max, start + n);
  s.tokens += seq->max_tokens - old_max;
  s.Recharge(seq);
  if (seq->pending) {
    seq->pending = false;
    ++s.num_sequences;
  }
  if (!request.request_id.empty()) {
    seq->recent_appends.push_back({request.request_id, start, n, request.layer_begin, request.layer_end});
    if (seq->recent_appends.size() > kRememberedAppends) seq->recent_appends.pop_front();
  }
  s.Touch(seq, s.clock());
  seq->writer_active = false;
  return absl::OkStatus();
}

void KvCache::CenterKeys(const AppendRequest& request,
                         std::vector<std::shared_ptr<const std::vector<float>>>* means,
                         std::vector<float>* centered) const {
  const KvLayout& layout = *layout_;
  const KvLayoutOptions& o = layout.options();
  const int64_t n = request.num_tokens;
  const int heads = layout.num_kv_heads();
  const int d = layout.head_dim();
  const int64_t stride = static_cast<int64_t>(heads) * d;
  const RopeAngles angles = ComputeRopeAngles(layout.rope(), request.start_position, n);
  // The mean's tokens: centering_tokens of them after the sinks (or from 0),
  // or every token when the append has too few.
  int64_t mean_begin = o.centering_includes_sinks ? 0 : std::min<int64_t>(o.exact_sink_tokens, n);
  if (mean_begin >= n) mean_begin = 0;
  const int64_t mean_end = std::min<int64_t>(n, mean_begin + o.centering_tokens);
  centered->resize(static_cast<size_t>(means->size()) * n * stride);
  for (size_t l = 0; l < means->size(); ++l) {
    const float* keys = request.keys + l * n * stride;
    if ((*means)[l] == nullptr) {  // the layer's first append
      auto mean = std::make_shared<std::vector<float>>(stride);
      for (int h = 0; h < heads; ++h) {
        EstimateKeyMean(layout.rope(), angles, keys + h * d, mean_begin, mean_end, stride,
                        o.centering_pairs, d, mean->data() + h * d);
      }
      (*means)[l] = std::move(mean);
    }
    for (int h = 0; h < heads; ++h) {
      SubtractKeyMean(layout.rope(), angles, (*means)[l]->data() + h * d, keys + h * d, stride, d,
                      centered->data() + l * n * stride + h * d);
    }
  }
}

absl::Status KvCache::StoreExact(const StoreParams& stored, int64_t start,
                                 const std::vector<std::pair<int64_t, int64_t>>& runs,
                                 const std::vector<int32_t>& exact_slots) {
  const KvLayout& layout = *layout_;
  const int layers = stored.layer_end - stored.layer_begin;
  const int64_t n = stored.num_tokens;
  const size_t stride = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
  const int64_t m = static_cast<int64_t>(exact_slots.size());
  // The exact tokens' rows, [layers, m, kv_heads, head_dim] like a request.
  std::vector<float> exact_keys(layers * m * stride), exact_values(exact_keys.size());
  for (int l = 0; l < layers; ++l) {
    int64_t row = 0;
    for (const auto& [begin, end] : runs) {
      const size_t from = (l * n + (begin - start)) * stride;
      const size_t count = static_cast<size_t>(end - begin) * stride;
      std::copy(stored.keys + from, stored.keys + from + count, exact_keys.begin() + (l * m + row) * stride);
      std::copy(stored.values + from, stored.values + from + count,
                exact_values.begin() + (l * m + row) * stride);
      row += end - begin;
    }
  }
  StoreParams params = stored;
  params.layout = layout.exact_layout();
  params.num_tokens = m;
  params.slots = exact_slots.data();
  params.keys = exact_keys.data();
  params.values = exact_values.data();
  return backend_->Store(params);
}

absl::Status KvCache::Fork(const std::string& parent_id, const std::string& child_id,
                           std::shared_ptr<UsageAccount> child_account) {
  if (child_id.empty()) {
    return absl::InvalidArgumentError("child sequence id is empty; want a non-empty id");
  }
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  // An append in flight on the parent may be writing its unshared last page;
  // sharing it now would let the child copy half-written bytes.
  s.AwaitNoWriter(parent_id, &child_id);
  Sequence* parent = s.FindVisible(parent_id);
  if (parent == nullptr) {
    return s.SequenceNotFound(parent_id,
                              absl::StrFormat("parent sequence '%s' not found in cache '%s'", parent_id, s.name));
  }
  if (s.sequences.contains(child_id)) {
    return absl::AlreadyExistsError(
        absl::StrFormat("child sequence '%s' already exists in cache '%s'", child_id, s.name));
  }
  int64_t shared_pages = 0;
  ForEachPage(*parent, [&](int32_t) { ++shared_pages; });
  const uint64_t charged = static_cast<uint64_t>(shared_pages) * layout_->page_bytes();
  if (child_account != nullptr) {
    RETURN_IF_ERROR(child_account->TryReserve(/*new_sequence=*/true, charged, "this fork"));
    child_account->AddTokens(parent->max_tokens);
  }
  const absl::Time now = s.clock();
  Sequence* child = s.AddSequence(child_id, /*pending=*/false, now);
  child->account = std::move(child_account);
  child->charged_bytes = child->account != nullptr ? charged : 0;
  child->charged_tokens = child->account != nullptr ? parent->max_tokens : 0;
  child->layer_tokens = parent->layer_tokens;
  child->held_begin = parent->held_begin;
  child->max_tokens = parent->max_tokens;
  child->tables = parent->tables;
  child->exact_tables = parent->exact_tables;
  child->key_means = parent->key_means;
  child->stored_bytes = parent->stored_bytes;
  child->stored_bytes_bf16 = parent->stored_bytes_bf16;
  ForEachPage(*child, [&](int32_t page) { s.pages.AddRef(page); });
  s.tokens += child->max_tokens;
  s.stored_bytes += child->stored_bytes;
  s.stored_bytes_bf16 += child->stored_bytes_bf16;
  s.Touch(parent, now);
  return absl::OkStatus();
}

absl::Status KvCache::Drop(const std::string& id) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  // The pages an append in flight writes are not pinned; let it finish.
  s.AwaitNoWriter(id);
  Sequence* seq = s.FindVisible(id);
  if (seq == nullptr) {
    return s.SequenceNotFound(id, absl::StrFormat("sequence '%s' not found in cache '%s'", id, s.name));
  }
  s.DropLocked(seq);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SequenceExport>> KvCache::BeginExport(const std::string& id,
                                                                     ExportSharing* sharing) {
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
    return DoesNotFit(image.id, absl::StrFormat("it has %d layers (%d oldest-token entries, %d means); the cache has %d",
                                                image.layer_tokens.size(), image.held_begin.size(),
                                                image.key_means.size(), layers));
  }
  for (int l = 0; l < layers; ++l) {
    const int64_t length = image.layer_tokens[l], held = image.held_begin[l];
    if (length < 0 || length > (int64_t{1} << 40) || held < 0 || held > length ||
        (layout.layer_window(l) == 0 && held != 0)) {
      return DoesNotFit(image.id, absl::StrFormat("layer %d holds tokens [%d, %d)", l, held, length));
    }
    const bool wants_mean = layout.key_centering() != KeyCentering::kNone && length > 0;
    const size_t mean_size = image.key_means[l].size();
    if (wants_mean ? mean_size != static_cast<size_t>(layout.mean_floats()) : mean_size != 0) {
      return DoesNotFit(image.id, absl::StrFormat("layer %d has a key mean of %d floats; want %d", l, mean_size,
                                                  wants_mean ? layout.mean_floats() : 0));
    }
    for (float x : image.key_means[l]) {
      if (!std::isfinite(x)) return DoesNotFit(image.id, absl::StrFormat("layer %d's key mean is not finite", l));
    }
  }
  return absl::OkStatus();
}

// Pages [begin, end) of `table` (`page_tokens` per page) are present. An
// empty range needs none.
absl::Status NeedPages(const std::string& id, const std::vector<int32_t>& table, int64_t page_tokens,
                       int64_t begin, int64_t end, const char* what, int layer) {
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
        return DoesNotFit(id, absl::StrFormat("chunk %d's %s names page %d twice or outside its %d pages", chunk,
                                              what, page, image.num_pages));
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
      // window it still holds.
      const ExactRanges r = layout.exact_ranges(length);
      const int64_t ept = layout.exact_page_tokens();
      RETURN_IF_ERROR(NeedPages(id, image.exact_tables[chunk], ept, held, r.sink_end, "exact block table", l));
      RETURN_IF_ERROR(NeedPages(id, image.exact_tables[chunk], ept, std::max(r.window_begin, held), length,
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
      return DoesNotFit(id, absl::StrFormat("it shares stream page %d, which no earlier sequence offered (or twice)",
                                            stream_index));
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
    if (r.request_id.empty() || r.request_id.size() > 64) return DoesNotFit(id, "a remembered request id is not 1..64 bytes");
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
    return absl::ResourceExhaustedError(absl::StrFormat("cache '%s' cannot hold sequence '%s': %d pages, the pool has %d",
                                                        options_.name, id, image.carried_pages(), pool_.num_pages));
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
    if (!image.key_means[l].empty()) seq->key_means[l] = std::make_shared<const std::vector<float>>(image.key_means[l]);
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
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence '%s' does not fit this cache: %d carried pages in %d bytes; want pages of %d bytes", image.id,
        image.carried_pages(), image.pages.size(), layout_->page_bytes()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SequenceImport> import, BeginImport(image, std::move(account)));
  RETURN_IF_ERROR(import->WritePages(0, import->num_pages(), image.pages.data()));
  return import->Commit();
}

absl::StatusOr<SequenceInfo> KvCache::GetSequence(const std::string& id) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const Sequence* seq = s.FindVisible(id);
  if (seq == nullptr) {
    return s.SequenceNotFound(id, absl::StrFormat("sequence '%s' not found in cache '%s'", id, s.name));
  }
  SequenceInfo info;
  info.id = seq->id;
  info.layer_tokens = seq->layer_tokens;
  info.layer_held_begin = seq->held_begin;
  info.max_tokens = seq->max_tokens;
  for (const std::vector<int32_t>& table : seq->tables) ForEachHeld(table, [&](int32_t) { ++info.pages; });
  for (const std::vector<int32_t>& table : seq->exact_tables) {
    ForEachHeld(table, [&](int32_t) { ++info.exact_pages; });
  }
  info.stored_bytes = seq->stored_bytes;
  info.last_access = seq->last_access;
  return info;
}

std::vector<std::string> KvCache::ListSequences() {
  State& s = *state_;
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&s.mu);
    ids.reserve(s.sequences.size());
    for (const auto& [id, seq] : s.sequences) {
      if (!seq->pending) ids.push_back(id);
    }
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::Status KvCache::Attend(absl::Span<const AttendRequestItem> items, float scale) {
  const KvLayout& layout = *layout_;
  RETURN_IF_ERROR(CheckScale(scale));
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendRequestItem& item = items[i];
    if (item.layer < 0 || item.layer >= layout.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: layer %d is outside the cache's %d layers; want [0, %d)", i,
                          item.layer, layout.num_layers(), layout.num_layers()));
    }
    if (item.queries == nullptr || item.output == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "item %d: %s is null; want [num_query_tokens, num_query_heads, head_dim] floats", i,
          item.queries == nullptr ? "queries" : "output"));
    }
    if (item.num_query_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "item %d: num_query_tokens is %d; want at least 1", i, item.num_query_tokens));
    }
  }
  if (items.empty()) return absl::OkStatus();

  State& s = *state_;
  // Snapshots owned by this call: the kernel reads them outside the lock.
  std::vector<ReadSnapshot> snapshots(items.size());
  std::vector<AttendItem> kernel_items(items.size());
  {
    absl::MutexLock lock(&s.mu);
    // Validate every item before taking anything.
    for (size_t i = 0; i < items.size(); ++i) {
      const AttendRequestItem& item = items[i];
      const Sequence* seq = s.FindVisible(item.sequence_id);
      if (seq == nullptr) {
        return s.SequenceNotFound(item.sequence_id, absl::StrFormat("item %d: sequence '%s' not found in cache '%s'",
                                                                    i, item.sequence_id, s.name));
      }
      const int64_t length = seq->layer_tokens[item.layer];
      if (item.num_query_tokens > length) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "item %d: %d query tokens but sequence '%s' layer %d holds %d tokens; the query "
            "tokens must be appended first (want 1 <= num_query_tokens <= %d)",
            i, item.num_query_tokens, item.sequence_id, item.layer, length, length));
      }
      const int64_t first_seen = layout.WindowBegin(item.layer, length - item.num_query_tokens);
      const int64_t held = seq->held_begin[item.layer];
      if (first_seen < held) {
        return absl::OutOfRangeError(absl::StrFormat(
            "item %d: sequence '%s' layer %d (sliding window %d) holds tokens [%d, %d) and has given "
            "older ones back; %d query tokens need token %d on (the oldest token held is %d: attend "
            "with at most as many query tokens as the layer's last append had)",
            i, item.sequence_id, item.layer, layout.layer_window(item.layer), held, length,
            item.num_query_tokens, first_seen, held));
      }
    }
    const absl::Time now = s.clock();
    for (size_t i = 0; i < items.size(); ++i) {
      const AttendRequestItem& item = items[i];
      Sequence* seq = s.FindVisible(item.sequence_id);
      const int64_t length = seq->layer_tokens[item.layer];
      s.TakeSnapshot(seq, item.layer, length, &snapshots[i]);
      s.Touch(seq, now);

      AttendItem& k = kernel_items[i];
      k.block_table = snapshots[i].table.data();
      k.exact_block_table = snapshots[i].exact_table_or_null();
      k.key_mean = snapshots[i].key_mean_or_null();
      k.context_tokens = length;
      k.layer = item.layer;
      k.num_query_tokens = item.num_query_tokens;
      k.queries = item.queries;
      k.output = item.output;
      k.lse = item.lse;
    }
  }

  AttendParams params;
  params.layout = layout_.get();
  params.pool = pool_;
  params.items = kernel_items;
  params.scale = EffectiveScale(scale, layout);
  const absl::Status status = backend_->Attend(params);

  absl::MutexLock lock(&s.mu);
  for (size_t i = 0; i < items.size(); ++i) s.EndRead(items[i].sequence_id, snapshots[i]);
  return status;
}

absl::Status KvCache::Score(const std::string& id, int layer, int64_t token_begin,
                            int64_t token_end, const float* queries, float* logits,
                            float scale) {
  const KvLayout& layout = *layout_;
  RETURN_IF_ERROR(CheckScale(scale));
  if (layer < 0 || layer >= layout.num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d is outside the cache's %d layers; want [0, %d)", layer,
                        layout.num_layers(), layout.num_layers()));
  }
  if (queries == nullptr || logits == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is null; want %s", queries == nullptr ? "queries" : "logits",
                        queries == nullptr ? "[num_query_heads, head_dim] floats"
                                           : "[num_query_heads, token_end - token_begin] floats"));
  }
  if (token_begin < 0 || token_end < -1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "token range [%d, %d) is negative; want 0 <= token_begin <= token_end, or token_end = -1 "
        "for the layer's length",
        token_begin, token_end));
  }

  State& s = *state_;
  ReadSnapshot snapshot;
  int64_t end = 0;
  {
    absl::MutexLock lock(&s.mu);
    Sequence* seq = s.FindVisible(id);
    if (seq == nullptr) {
      return s.SequenceNotFound(id, absl::StrFormat("sequence '%s' not found in cache '%s'", id, s.name));
    }
    const int64_t length = seq->layer_tokens[layer];
    end = token_end == -1 ? length : token_end;
    if (token_begin > length || end > length) {
      return absl::OutOfRangeError(absl::StrFormat(
          "token range [%d, %d) is beyond sequence '%s' layer %d, which holds %d tokens",
          token_begin, end, id, layer, length));
    }
    if (token_begin > end) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token range [%d, %d) ends before it begins; want token_begin <= token_end", token_begin,
          end));
    }
    if (token_begin < seq->held_begin[layer] && token_begin < end) {
      return absl::OutOfRangeError(absl::StrFormat(
          "token range [%d, %d) of sequence '%s' layer %d (sliding window %d) reaches tokens given "
          "back; the oldest token held is %d",
          token_begin, end, id, layer, layout.layer_window(layer), seq->held_begin[layer]));
    }
    s.Touch(seq, s.clock());
    if (token_begin == end) return absl::OkStatus();
    s.TakeSnapshot(seq, layer, length, &snapshot);
  }

  ScoreParams params;
  params.layout = layout_.get();
  params.pool = pool_;
  params.layer = layer;
  params.block_table = snapshot.table.data();
  params.exact_block_table = snapshot.exact_table_or_null();
  params.key_mean = snapshot.key_mean_or_null();
  params.length = snapshot.length;
  params.token_begin = token_begin;
  params.token_end = end;
  params.queries = queries;
  params.scale = EffectiveScale(scale, layout);
  params.logits = logits;
  const absl::Status status = backend_->Score(params);

  absl::MutexLock lock(&s.mu);
  s.EndRead(id, snapshot);
  return status;
}

int KvCache::EvictExpired() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  return s.EvictExpiredLocked(s.clock(), /*keep=*/nullptr);
}

CacheStats KvCache::Stats() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  CacheStats stats;
  stats.pages_total = s.pages.num_pages();
  stats.pages_used = s.pages.num_used();
  stats.sequences = s.num_sequences;
  stats.tokens = s.tokens;
  stats.stored_bytes = s.stored_bytes;
  stats.stored_bytes_bf16 = s.stored_bytes_bf16;
  stats.evictions = s.evictions;
  stats.copy_on_writes = s.copy_on_writes;
  stats.evicted_lookups = s.evicted_lookups;
  return stats;
}

}  // namespace tqkv
