// Inside KvCache (cache/kv_cache.h): its sequences, the shared state behind
// its lock, and the helpers its files share. Only cache/kv_cache*.cc include
// this header; kv_cache.h is the contract.
//
//   kv_cache.cc           creation, lifecycle (create, fork, drop), reads
//                         (Attend, Score), eviction, stats
//   kv_cache_append.cc    appends: plan, kernels, publish
//   kv_cache_transfer.cc  export and import (SequenceImage, sharing)
#ifndef TQKV_CACHE_KV_CACHE_INTERNAL_H_
#define TQKV_CACHE_KV_CACHE_INTERNAL_H_

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
#include "cache/rope_check.h"
#include "kernels/float_formats.h"
#include "kernels/key_centering.h"
#include "base/status_macros.h"

namespace tqkv {
namespace cache_internal {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls f(page) for every page a table holds (-1 entries: given back).
template <typename F>
void ForEachHeld(const std::vector<int32_t>& table, F f) {
  for (int32_t page : table) {
    if (page >= 0) f(page);
  }
}

// Bytes a sequence's tokens take (KvLayout::layer_bytes), summed over layers:
// tokens [held_begin, layer_tokens) of each.
inline void CountBytes(const KvLayout& layout, const std::vector<int64_t>& layer_tokens,
                       const std::vector<int64_t>& held_begin, uint64_t* bytes, uint64_t* bytes_bf16) {
  *bytes = 0;
  *bytes_bf16 = 0;
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    *bytes += layout.layer_bytes(layer, layer_tokens[layer], held_begin[layer]);
    *bytes_bf16 += static_cast<uint64_t>(layer_tokens[layer] - held_begin[layer]) * layout.token_bytes_bf16();
  }
}

// CountBytes over layers [begin, end) only, added to *bytes and *bytes_bf16.
inline void AddRangeBytes(const KvLayout& layout, const std::vector<int64_t>& layer_tokens,
                          const std::vector<int64_t>& held_begin, int begin, int end, uint64_t* bytes,
                          uint64_t* bytes_bf16) {
  for (int layer = begin; layer < end; ++layer) {
    *bytes += layout.layer_bytes(layer, layer_tokens[layer], held_begin[layer]);
    *bytes_bf16 += static_cast<uint64_t>(layer_tokens[layer] - held_begin[layer]) * layout.token_bytes_bf16();
  }
}

// The positions of an append of [start, start + n) that get an exact copy:
// sinks and the recent tokens the layers have after it, as at most two runs.
inline std::vector<std::pair<int64_t, int64_t>> ExactRuns(const KvLayout& layout, int64_t start, int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (!layout.has_exact_tokens()) return runs;
  const ExactRanges r = layout.exact_ranges(start + n);
  if (start < r.sink_end) runs.push_back({start, r.sink_end});
  const int64_t recent_begin = std::max(start, r.recent_begin);
  if (recent_begin < start + n) {
    if (!runs.empty() && runs.back().second >= recent_begin) {
      runs.back().second = start + n;
    } else {
      runs.push_back({recent_begin, start + n});
    }
  }
  return runs;
}

// What an append must do to one table before it writes: pages to copy
// (shared ones it writes into) and entries to fill with fresh pages.
struct TablePlan {
  std::vector<int32_t> table;  // the new table; fresh entries still -1
  std::vector<int64_t> copy;   // indices whose shared page is copied
  std::vector<int64_t> fresh;  // indices that get a fresh page
  int32_t pages_needed() const { return static_cast<int32_t>(copy.size() + fresh.size()); }
};

// Plans writes to the pages holding positions in `runs`, `page_tokens` per
// page, growing the table to `size` entries (new ones -1).
inline TablePlan PlanTableWrites(const PageAllocator& pages, const std::vector<int32_t>& table, int64_t size,
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
inline absl::Status CheckFinite(const char* name, const float* data, int layer_begin, int layers, int64_t tokens,
                                int heads, int dim) {
  const int64_t count = static_cast<int64_t>(layers) * tokens * heads * dim;
  // One branch-free pass; the element is looked for only when there is one.
  if (AllFinite(data, static_cast<size_t>(count))) return absl::OkStatus();
  for (int64_t i = 0; i < count; ++i) {
    if (std::isfinite(data[i])) continue;
    const int64_t row = i / dim;
    return absl::InvalidArgumentError(
        absl::StrFormat("%s[layer %d, token %d, kv head %d, dim %d] is %f; want finite values", name,
                        layer_begin + row / (tokens * heads), (row / heads) % tokens, row % heads, i % dim, data[i]));
  }
  return absl::OkStatus();
}

// Logit scale: 0 selects the usual 1 / sqrt(head_dim).
inline absl::Status CheckScale(float scale) {
  if (!std::isfinite(scale) || scale < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("scale is %g; want a finite value >= 0 (0 means 1 / sqrt(head_dim))", scale));
  }
  return absl::OkStatus();
}

// A logit soft cap (AttendParams::logit_softcap): 0 (none) or a finite cap.
inline absl::Status CheckLogitSoftcap(float cap) {
  if (!std::isfinite(cap) || cap < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("logit_softcap is %g; want a finite value >= 0 (0 means no soft-capping)", cap));
  }
  return absl::OkStatus();
}

inline float EffectiveScale(float scale, const KvLayout& layout) {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(layout.head_dim()));
}

}  // namespace cache_internal

struct KvCache::State {
  using Sequence = cache_internal::Sequence;
  using ReadSnapshot = cache_internal::ReadSnapshot;

  State(const CacheOptions& options, const KvLayout* layout, int32_t num_pages)
      : name(options.name), layout(layout),
        clock(options.clock ? options.clock : std::function<absl::Time()>(&absl::Now)), idle_ttl(options.idle_ttl),
        evict_lru(options.evict_lru), pages(num_pages) {}

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

  Sequence* AddSequence(const std::string& id, bool pending, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
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
    cache_internal::ForEachPage(*seq, [&](int32_t page) { pages.Release(page); });
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
    const std::string* const* ids;
    size_t count;
  };
  // Evaluated by absl::Mutex with `mu` held, possibly on another thread.
  static bool NoWriterOn(NoWriterArgs* args) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (size_t i = 0; i < args->count; ++i) {
      if (args->ids[i] == nullptr) continue;
      auto it = args->state->sequences.find(*args->ids[i]);
      if (it != args->state->sequences.end() && it->second->writer_active) return false;
    }
    return true;
  }
  // Waits until no append is in flight on `a` (nor on `b`, when given).
  void AwaitNoWriter(const std::string& a, const std::string* b = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const std::string* ids[] = {&a, b};
    NoWriterArgs args{this, ids, 2};
    mu.Await(absl::Condition(&NoWriterOn, &args));
  }
  // Waits until no append is in flight on any of `ids` (null entries are
  // skipped): a batch claims its sequences together, so two batches never
  // wait on each other.
  void AwaitNoWriters(const std::vector<const std::string*>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    NoWriterArgs args{this, ids.data(), ids.size()};
    mu.Await(absl::Condition(&NoWriterOn, &args));
  }

  // Drops published sequences idle for longer than the TTL, except `keep`.
  int EvictExpiredLocked(absl::Time now, const std::string* keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
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
  bool PlanLruEviction(int32_t need, const std::string& keep, std::vector<Sequence*>* victims, int32_t* reachable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
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
      cache_internal::ForEachPage(*seq, [&](int32_t page) {
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
    cache_internal::ForEachPage(*seq, [&](int32_t) { ++held; });
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
  void ReleaseBelow(std::vector<int32_t>* table, int64_t page_tokens, int64_t held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
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
  // more: those without a sink token that end before the recent tokens of the
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
    const int64_t recent_begin = shortest - layout->options().exact_recent_tokens;
    std::vector<int32_t>& exact_table = seq->exact_tables[chunk];
    for (size_t k = 0; k < exact_table.size(); ++k) {
      const int64_t begin = static_cast<int64_t>(k) * page_tokens;
      if (exact_table[k] < 0 || begin < sinks || begin + page_tokens > recent_begin) continue;
      pages.Release(exact_table[k]);
      exact_table[k] = -1;
    }
  }

  // Copies what a read of `layer` (holding `length` tokens) needs, pins its
  // pages and counts the reader.
  void TakeSnapshot(Sequence* seq, int layer, int64_t length, ReadSnapshot* snap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int chunk = layout->layer_chunk(layer);
    const std::vector<int32_t>& table = seq->tables[chunk];
    snap->serial = seq->serial;
    snap->length = length;
    snap->table.assign(table.begin(), table.begin() + cache_internal::CeilDiv(length, layout->page_tokens()));
    if (layout->has_exact_tokens()) {
      const std::vector<int32_t>& exact_table = seq->exact_tables[chunk];
      const size_t used =
          std::min<size_t>(exact_table.size(), cache_internal::CeilDiv(length, layout->exact_page_tokens()));
      snap->exact_table.assign(exact_table.begin(), exact_table.begin() + used);
      snap->has_exact = true;
    }
    snap->key_mean = seq->key_means[layer];
    cache_internal::ForEachHeld(snap->table, [&](int32_t page) { pages.Pin(page); });
    cache_internal::ForEachHeld(snap->exact_table, [&](int32_t page) { pages.Pin(page); });
    ++seq->readers;
  }

  // Releases what an in-flight read took: its pins and its reader count.
  void EndRead(const std::string& id, const ReadSnapshot& snap) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cache_internal::ForEachHeld(snap.table, [&](int32_t page) { pages.Unpin(page); });
    cache_internal::ForEachHeld(snap.exact_table, [&](int32_t page) { pages.Unpin(page); });
    auto it = sequences.find(id);
    if (it != sequences.end() && it->second->serial == snap.serial) --it->second->readers;
  }
};

}  // namespace tqkv

#endif  // TQKV_CACHE_KV_CACHE_INTERNAL_H_
