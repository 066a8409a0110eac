// The KV cache's bookkeeping, the same for every backend: sequences, block
// tables, the page pool with reference counts, capacity, eviction and idle TTL.
// Compute (store, score, attend) goes to a Backend; this class decides which
// page slots each call touches and guarantees readers a consistent prefix.
//
// Sequences. A client-chosen id names each sequence in a cache. Its length is
// kept per layer, so a prefill can stream layer by layer; it has one block
// table per chunk of layers (KvLayout::chunk_layers; one chunk of every layer
// without sliding-window layers), listing the pages holding the chunk's
// tokens [0, max length of its layers).
//
// Sliding-window layers (KvLayout::layer_window). A query at position p of
// such a layer sees tokens [p + 1 - window, p + 1) only: Attend masks older
// ones. An append of n tokens starting at s keeps what its own queries see:
// the layer holds tokens [held_begin, length) with held_begin = s + 1 -
// window (never lower than before), and older tokens leave stored_bytes.
// Pages of a windowed chunk all of whose tokens are below every layer's
// held_begin (compressed and exact ones) go back to the pool, their table
// entries -1; readers in flight keep theirs alive through their pins. A read
// that needs a token below held_begin is OUT_OF_RANGE: an Attend with more
// query tokens than the layer's last append had, a Score range starting
// below it.
//
// Appends carry the position they start at. An append of n tokens to layers
// [b, e) must start exactly at the current length of each of those layers
// (FAILED_PRECONDITION otherwise, naming the expected position), so a retried
// append is detected instead of stored twice. Appends are all-or-nothing: on
// any error the sequence, the pool and every counter are exactly as before.
//
// Fork shares every page of the parent with the child (reference counts).
// The first append into a shared, partially filled last page copies it first
// (copy-on-write); full pages are never written again, so they stay shared.
//
// Centering and exact tokens (kv_layout.h). With key centering, each
// (sequence, layer, KV head) gets a mean m from the layer's first append
// (tokens [S, S + centering_tokens) of it, S the sink count, or all of them
// when it is shorter), fixed from then on and shared by forks; every key is
// stored as k_t - R_t m and attention adds q . R_t m back. With exact tokens,
// an append also writes the tokens that end up among the layer's first
// exact_sink_tokens or last exact_recent_tokens to exact pages (a second
// block table, pages of the same pool); an exact page none of whose tokens
// is a sink or among the recent tokens of the shortest non-empty layer is
// released. Exact pages share copy-on-write like the others, count for
// eviction, and their bytes (fp16) and the means (fp32) are in stored_bytes.
//
// Chunks share one pool: a sequence of T tokens in every layer takes
// ceil(T / page_tokens) pages per full-attention chunk, about window /
// page_tokens + 1 per windowed one.
//
// Capacity. The pool has a fixed number of pages (from a byte budget). When an
// append needs more pages than are free it fails with RESOURCE_EXHAUSTED and
// changes nothing, unless LRU eviction is on: then idle sequences (no call in
// flight on them) are dropped, least recently used first, until the pages fit
// or none is left to evict. With an idle TTL, sequences not touched for longer
// are dropped by EvictExpired() (the service calls it periodically) and before
// any allocation.
//
// Accounts. A sequence may be charged to a UsageAccount (usage_account.h:
// the server's tenants): its pages, itself and its tokens count there from
// creation to drop or eviction, and an append, fork or create past the
// account's limits is RESOURCE_EXHAUSTED before anything is allocated or
// evicted (an account at its limit does not evict others' sequences).
//
// Details the tests pin down: copy-on-write copies every shared page an append
// writes into (with per-layer lengths a page can be full in one layer and open
// in another); Drop, Fork and CreateSequence on an id wait for an append in
// flight on it; a sequence created by its first append is invisible until that
// append succeeds and gone if it fails; LRU eviction is all-or-nothing and
// skips sequences with any call in flight; GetSequence / ListSequences do not
// count as a use for LRU and TTL, every other call does.
//
// Thread safety: every method is thread-safe. Appends to different sequences
// run their store kernels concurrently; appends to one sequence are serialized.
// Attend and Score snapshot a sequence's block table and lengths under the
// lock, pin its pages, and run the kernel outside the lock: they see a
// consistent prefix while the sequence grows, and a concurrent Drop frees the
// pages only when the last pin is released.
#ifndef TQKV_CACHE_KV_CACHE_H_
#define TQKV_CACHE_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/usage_account.h"
#include "kernels/backend.h"
#include "kernels/kv_layout.h"

namespace tqkv {

class RopeCheck;  // cache/rope_check.h

namespace cache_internal {
struct Sequence;      // kv_cache_internal.h
struct ReadSnapshot;  // kv_cache_internal.h
}  // namespace cache_internal

struct CacheOptions {
  std::string name = "default";
  KvLayoutOptions layout;
  // Bytes of backend memory for the page pool; the pool gets
  // floor(memory_budget_bytes / page_bytes) pages. Must fit at least one page.
  size_t memory_budget_bytes = size_t{1} << 30;
  // Drop idle sequences, least recently used first, when an append needs pages.
  bool evict_lru = false;
  // Drop sequences idle for longer than this. InfiniteDuration() disables.
  absl::Duration idle_ttl = absl::InfiniteDuration();
  // Clock for LRU order and TTL; absl::Now when empty. Tests inject their own.
  std::function<absl::Time()> clock;
};

struct SequenceInfo {
  std::string id;
  std::vector<int64_t> layer_tokens;  // per layer
  int64_t max_tokens = 0;             // max over layers
  // The oldest token each layer holds (0 but in sliding-window layers).
  std::vector<int64_t> layer_held_begin;
  int32_t pages = 0;               // pages held, over every chunk's table
  int32_t exact_pages = 0;         // exact pages held (sinks, recent tokens)
  uint64_t stored_bytes = 0;       // as CacheStats counts them
  uint64_t stored_bytes_bf16 = 0;  // the tokens held, in bf16
  absl::Time last_access;
};

struct CacheStats {
  int32_t pages_total = 0;
  int32_t pages_used = 0;
  int64_t sequences = 0;
  // Tokens summed over sequences, counted in the layer with most tokens.
  int64_t tokens = 0;
  // Bytes of what the sequences hold (KvLayout::layer_bytes: compressed
  // tokens, exact copies, key means), excluding page padding and unfilled
  // slots, and the bf16 bytes of the same (token, layer) entries. Logical: a forked prefix counts once
  // per sequence, like `tokens`.
  uint64_t stored_bytes = 0;
  uint64_t stored_bytes_bf16 = 0;
  uint64_t evictions = 0;       // sequences dropped by LRU or TTL, ever
  uint64_t copy_on_writes = 0;  // pages copied for copy-on-write, ever
  // Calls that named a sequence this cache had evicted (their NOT_FOUND says
  // so: "... it was evicted 12s ago (idle TTL)"), ever.
  uint64_t evicted_lookups = 0;
  // (sequence, layer) key means whose keys did not rotate like the cache's
  // RoPE says (cache/rope_check.h), ever; pre-RoPE centering only.
  uint64_t rope_mismatches = 0;
};

struct AppendRequest {
  std::string sequence_id;
  int64_t start_position = 0;
  int layer_begin = 0;  // [layer_begin, layer_end)
  int layer_end = 0;
  int64_t num_tokens = 0;
  // [layer_end - layer_begin, num_tokens, num_kv_heads, head_dim] row-major.
  const float* keys = nullptr;
  const float* values = nullptr;
  // Create the sequence if it does not exist (NOT_FOUND otherwise).
  bool create_if_missing = true;
  // The client's idempotency key for this append ("" for none). The cache
  // remembers the last kRememberedAppends keys of each sequence with what
  // they appended: the same key again with the same start, token count and
  // layers is answered OK without storing (AppendOutcome::already_stored);
  // with anything else INVALID_ARGUMENT. A key the sequence does not
  // remember is an ordinary append (a retry whose first try failed).
  std::string request_id;
  // The account (usage_account.h) a sequence this append creates is charged
  // to, from then until it is dropped; null: none. An existing sequence
  // keeps the account it was created with. An append past its sequence's
  // account limits is RESOURCE_EXHAUSTED and changes nothing.
  std::shared_ptr<UsageAccount> account;
  // Without a request_id: an append whose tokens every layer of the range
  // already holds, up to exactly start_position + num_tokens (a retry that
  // landed), is answered OK with already_stored instead of
  // FAILED_PRECONDITION (what AppendAttend promises).
  bool landed_is_stored = false;
  // The caller has checked that keys and values are finite (the service
  // does, decoding them): the cache does not scan them again.
  bool finite_checked = false;
};

inline constexpr int kRememberedAppends = 64;
// The largest AttendRequestItem::first_query_position (positions stay within
// int32 on every backend).
inline constexpr int64_t kMaxQueryPosition = (int64_t{1} << 31) - 1;

// What an OK Append did.
struct AppendOutcome {
  bool already_stored = false;  // request_id named an append that had landed: nothing stored
  // What the append changed in the sequence's bytes as the cache counts
  // them (SequenceInfo::stored_bytes, CacheStats): its tokens compressed,
  // their exact copies, a layer's first key mean; less what it released
  // (exact copies no longer recent, tokens that left a sliding
  // window), so it can be negative. The bf16 figure is the same change for
  // the tokens held, at 2 bytes per element. Both 0 when already_stored.
  int64_t stored_bytes = 0;
  int64_t stored_bytes_bf16 = 0;
};

struct AttendRequestItem {
  std::string sequence_id;
  int layer = 0;
  int num_query_tokens = 1;
  const float* queries = nullptr;  // [num_query_tokens, num_query_heads, head_dim]
  float* output = nullptr;         // same shape
  float* lse = nullptr;            // optional [num_query_tokens, num_query_heads]
  // -1: the query tokens are the layer's last num_query_tokens stored tokens
  // (appended first). >= 0: query token i sits at this position + i and sees
  // the stored tokens [0, min(length, position + 1)), in a sliding-window
  // layer from position + 1 - window on: a prefill reading a stored prefix,
  // whose own tokens it attends itself and merges by lse. A query token
  // that sees no stored token (past a sliding window) gets output 0 and lse
  // -inf. At most kMaxQueryPosition.
  int64_t first_query_position = -1;
};

// A sequence as it is stored, for moving it between caches of the same
// layout (export and import, snapshots): its state and the bytes of every
// page it holds, unchanged. Imported into a cache of the same layout, it
// reads exactly as it did (bit-identical Attend and Score) and can grow.
//
// Its pages are numbered 0 .. num_pages - 1: first the pages it carries (its
// own bytes, in table order, block tables first), then the pages it shares
// with a sequence before it in the same stream (ExportSharing), which carried
// them; those travel once, as stream indices.
struct SequenceImage {
  std::string id;
  std::vector<int64_t> layer_tokens;  // per layer
  std::vector<int64_t> held_begin;    // per layer (see SequenceInfo)
  // Per chunk (KvLayout::chunk_layers), the block table and the exact block
  // table, each entry the index of its page in `pages`, or -1 (given back,
  // released or never written).
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<int32_t>> exact_tables;
  // Per layer, the key mean (KvLayout::mean_floats() floats), or empty
  // where the layer has none yet (no centering, or no tokens).
  std::vector<std::vector<float>> key_means;
  // The idempotency keys the sequence remembers, oldest first.
  struct RememberedAppend {
    std::string request_id;
    int64_t start = 0;
    int64_t tokens = 0;
    int layer_begin = 0;
    int layer_end = 0;
  };
  std::vector<RememberedAppend> recent_appends;
  int64_t num_pages = 0;
  // Pages [carried_pages(), num_pages): entry i is page carried_pages() + i's
  // index among the pages the stream carried before this sequence (0: the
  // stream's first carried page). Empty outside a shared stream.
  std::vector<int64_t> shared_pages;
  // Of its carried pages, those later sequences of the stream may share
  // (ascending page indices): an importer keeps them at hand until the stream
  // ends (ImportSharing).
  std::vector<int64_t> offered_pages;
  // carried_pages() * page_bytes: carried page i at i * page_bytes.
  std::vector<uint8_t> pages;

  int64_t carried_pages() const { return num_pages - static_cast<int64_t>(shared_pages.size()); }
};

class KvCache;

// One export stream's shared pages, on the exporting side: made for a stream
// and passed to every BeginExport of it, so that a page several of its
// sequences hold (forks, shared prefixes) is carried by the first of them and
// named by its stream index in the others. It numbers the pages the stream
// carries, and keeps a reference on each carried page that was shared when
// exported: such a page stays allocated and unchanged until the sharing is
// destroyed (an append into it copies it first, as for any shared page).
// Thread safety: one stream (one thread at a time); the cache's calls on
// other sequences run concurrently. REQUIRES: destroyed before its cache.
class ExportSharing {
 public:
  explicit ExportSharing(KvCache* cache) : cache_(cache) {}
  ~ExportSharing();
  ExportSharing(const ExportSharing&) = delete;
  ExportSharing& operator=(const ExportSharing&) = delete;

  // Pages the stream carries, over the sequences begun so far.
  int64_t carried_pages() const { return carried_; }

 private:
  friend class KvCache;
  KvCache* const cache_;
  absl::flat_hash_map<int32_t, int64_t> kept_;  // pool page -> its stream index
  int64_t carried_ = 0;
};

// The importing side of a shared stream: the pool pages of the carried pages
// later sequences may share (SequenceImage::offered_pages), by stream index,
// each with a reference held until the sharing is destroyed. Pass the same
// ImportSharing to every BeginImport of one stream, in stream order.
// Thread safety and lifetime as ExportSharing.
class ImportSharing {
 public:
  explicit ImportSharing(KvCache* cache) : cache_(cache) {}
  ~ImportSharing();
  ImportSharing(const ImportSharing&) = delete;
  ImportSharing& operator=(const ImportSharing&) = delete;

  // Pages the stream carried, over the sequences begun so far.
  int64_t carried_pages() const { return static_cast<int64_t>(pool_page_.size()); }

 private:
  friend class KvCache;
  KvCache* const cache_;
  std::vector<int32_t> pool_page_;  // by stream index; -1: not offered (or its import failed)
};

// An export in progress (KvCache::BeginExport): the sequence's state as of
// that call, its pages pinned (kept allocated, their tokens unchanged) until
// this object is destroyed. The sequence stays live meanwhile: appends go
// on, writing only slots past the exported lengths (which an import never
// reads), and a drop frees the pages when the export lets go.
// REQUIRES: destroyed before its cache.
class SequenceExport {
 public:
  ~SequenceExport();
  SequenceExport(const SequenceExport&) = delete;
  SequenceExport& operator=(const SequenceExport&) = delete;

  // The image without its page bytes (`pages` empty, `num_pages` set).
  const SequenceImage& state() const { return state_; }
  // Copies carried pages [first, first + count) of the image to `out` (count
  // * page_bytes bytes). INVALID_ARGUMENT outside [0, carried_pages()).
  absl::Status ReadPages(int64_t first, int64_t count, uint8_t* out) const;

 private:
  friend class KvCache;
  SequenceExport() = default;
  KvCache* cache_ = nullptr;
  SequenceImage state_;
  std::vector<int32_t> physical_;  // the image's carried page i is pool page physical_[i]
  uint64_t serial_ = 0;
};

// An import in progress (KvCache::BeginImport): the pages are allocated and
// charged, the id reserved (calls naming it wait, as for an append in
// flight), nothing visible until Commit. Destroyed without a commit, it
// gives everything back. REQUIRES: destroyed before its cache.
class SequenceImport {
 public:
  ~SequenceImport();
  SequenceImport(const SequenceImport&) = delete;
  SequenceImport& operator=(const SequenceImport&) = delete;

  // The pages this import writes: the image's carried pages.
  int64_t num_pages() const { return static_cast<int64_t>(allocated_.size()); }
  // Writes carried pages [first, first + count) of the image from `data`.
  absl::Status WritePages(int64_t first, int64_t count, const uint8_t* data);
  // Publishes the sequence. FAILED_PRECONDITION when called twice.
  absl::Status Commit();

 private:
  friend class KvCache;
  SequenceImport() = default;
  KvCache* cache_ = nullptr;
  SequenceImage state_;
  std::vector<int32_t> allocated_;
  ImportSharing* sharing_ = nullptr;
  int64_t stream_base_ = 0;  // the stream index of its first carried page
  bool finished_ = false;
};

class KvCache {
 public:
  // Allocates the pool from `backend` (which must outlive the cache).
  // INVALID_ARGUMENT / NOT_FOUND from the layout; RESOURCE_EXHAUSTED when the
  // budget holds no page or the backend cannot allocate it.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const CacheOptions& options, Backend* backend);
  // REQUIRES: no call on this cache is in flight.
  ~KvCache();

  const KvLayout& layout() const { return *layout_; }
  const CacheOptions& options() const { return options_; }

  // ALREADY_EXISTS if the id is taken; INVALID_ARGUMENT for an empty id;
  // RESOURCE_EXHAUSTED past `account`'s max_sequences. The sequence is
  // charged to `account` (null: none).
  absl::Status CreateSequence(const std::string& id, std::shared_ptr<UsageAccount> account = nullptr);

  // Errors: NOT_FOUND (unknown sequence and !create_if_missing),
  // INVALID_ARGUMENT (empty layer range or one beyond the layout, no tokens,
  // null tensors, non-finite values), FAILED_PRECONDITION (start_position is
  // not the current length of every layer in the range; the message names the
  // expected position), RESOURCE_EXHAUSTED (pool full, nothing evictable).
  absl::Status Append(const AppendRequest& request, AppendOutcome* outcome = nullptr);

  // Appends to several sequences at once (a layer of a decode step, any
  // batch): request i is checked, planned and published on its own, with
  // Append's errors and all-or-nothing guarantee, into statuses[i] and
  // outcomes[i]; their kernels run together, one backend Store for every
  // request of one layer range (exact copies included). A request naming
  // the same sequence as an earlier one of the batch is INVALID_ARGUMENT.
  // REQUIRES: statuses.size() == requests.size(); outcomes empty or as long.
  void AppendBatch(absl::Span<const AppendRequest> requests, absl::Span<absl::Status> statuses,
                   absl::Span<AppendOutcome> outcomes = {});

  // A decode layer: AppendBatch(appends), then, for every item whose append
  // succeeded (already stored included), attends[i] over its layer with the
  // new tokens, as Attend does, in one backend call with the store
  // (Backend::StoreAndAttend). attends[i] names appends[i]'s sequence, its
  // one layer, and as many query tokens as it appends. statuses[i] is the
  // append's error, or the attention's; an item that fails leaves its
  // sequence as it was. INVALID_ARGUMENT for every item when `scale` or
  // `logit_softcap` (as in Attend) is bad or an item does not match its
  // append.
  void AppendAttend(absl::Span<const AppendRequest> appends, absl::Span<const AttendRequestItem> attends, float scale,
                    absl::Span<absl::Status> statuses, absl::Span<AppendOutcome> outcomes, float logit_softcap = 0.0f);

  // The child gets the parent's tokens, sharing its pages. NOT_FOUND for the
  // parent, ALREADY_EXISTS for the child. The child is charged to
  // `child_account` (null: none) for every page it shares: RESOURCE_EXHAUSTED
  // when they do not fit its limits.
  absl::Status Fork(const std::string& parent_id, const std::string& child_id,
                    std::shared_ptr<UsageAccount> child_account = nullptr);

  // NOT_FOUND if unknown.
  absl::Status Drop(const std::string& id);

  // Starts exporting a sequence: its state now (an append in flight is
  // waited for first) with its pages pinned; see SequenceExport. Does not
  // count as a use for LRU and TTL, and an exported sequence is not idle
  // (eviction skips it). With `sharing` (a stream of several sequences),
  // pages an earlier sequence of the stream carried are named, not carried
  // again. NOT_FOUND if unknown. REQUIRES: `sharing` belongs to this cache.
  absl::StatusOr<std::unique_ptr<SequenceExport>> BeginExport(const std::string& id, ExportSharing* sharing = nullptr);
  // The whole image at once: BeginExport, then every page.
  absl::StatusOr<SequenceImage> ExportSequence(const std::string& id);

  // Starts recreating an exported sequence under state.id (state.pages is
  // not read; its carried pages follow through SequenceImport), charged to
  // `account` (null: none) for every page it holds, shared ones included (as
  // a fork is). Pages it shares are taken from `sharing`, the stream's
  // (state.shared_pages without one is INVALID_ARGUMENT). The state is
  // checked against this cache's layout before anything is allocated:
  // INVALID_ARGUMENT naming what does not fit (table sizes, a page a read
  // would need and the image lacks, means, lengths, a shared page the stream
  // did not offer). ALREADY_EXISTS if the id is taken; RESOURCE_EXHAUSTED
  // when the carried pages do not fit the pool (after LRU eviction, when on)
  // or the account. REQUIRES: the image comes from a cache of the same
  // layout (the caller compares layouts: an image does not record one);
  // `sharing` belongs to this cache.
  absl::StatusOr<std::unique_ptr<SequenceImport>> BeginImport(const SequenceImage& state,
                                                              std::shared_ptr<UsageAccount> account = nullptr,
                                                              ImportSharing* sharing = nullptr);
  // The whole image at once: BeginImport, every page, Commit. All or nothing.
  absl::Status ImportSequence(const SequenceImage& image, std::shared_ptr<UsageAccount> account = nullptr);

  absl::StatusOr<SequenceInfo> GetSequence(const std::string& id);
  std::vector<std::string> ListSequences();

  // Fused attention for a batch of items over each sequence's tokens in the
  // item's layer (causal among an item's query tokens; see AttendItem;
  // masked to the window in a sliding-window layer).
  // NOT_FOUND for an unknown sequence, INVALID_ARGUMENT for a bad layer, null
  // pointers, or more query tokens than the layer holds; OUT_OF_RANGE when a
  // query's window reaches below the layer's held_begin. All items are
  // validated before any kernel runs. `scale` is the logit scale; 0 means
  // 1 / sqrt(head_dim). `logit_softcap` > 0 soft-caps every logit (Gemma 2:
  // x -> cap * tanh(x / cap) on the true logit, before the softmax; the lse
  // is that of the capped logits); 0 means none. INVALID_ARGUMENT when
  // either is negative or not finite.
  absl::Status Attend(absl::Span<const AttendRequestItem> items, float scale = 0.0f, float logit_softcap = 0.0f);

  // logits[h][t - token_begin] = scale * <q_h, k_t> for t in
  // [token_begin, token_end) of one layer, the true logits (never
  // soft-capped: a cap is an elementwise pass over them); token_end = -1 means the layer's
  // length. queries [num_query_heads, head_dim]; logits sized by the caller
  // as num_query_heads * (token_end - token_begin). `scale` as in Attend
  // (0 means 1 / sqrt(head_dim)). OUT_OF_RANGE for a range beyond the
  // layer's length or, in a sliding-window layer, starting below its
  // held_begin (the message names the oldest token held).
  absl::Status Score(const std::string& id, int layer, int64_t token_begin, int64_t token_end, const float* queries,
                     float* logits, float scale = 0.0f);

  // Drops sequences idle for longer than the TTL. Returns how many.
  int EvictExpired();

  CacheStats Stats();

 private:
  // Implementation-defined; see kv_cache_internal.h.
  struct State;
  // One append of a batch, from its plan to its publication; see
  // kv_cache_append.cc.
  struct AppendPlan;
  // The phases of a batch of appends: stateless checks; the plan under the
  // lock (positions, retries, pages, reservations); the kernels; the
  // publication (or rollback) under the lock.
  struct StoreRun;
  absl::Status CheckAppend(const AppendRequest& request) const;
  void PlanAppendsLocked(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans);
  absl::Status PlanAppendLocked(const AppendRequest& request, AppendPlan* plan);
  absl::Status PlanAppendPages(const AppendRequest& request, const cache_internal::Sequence* seq, AppendPlan* plan,
                               absl::Time now);
  void PlanAppendSlots(const AppendRequest& request, AppendPlan* plan) const;
  // Page copies and centering, per request.
  void PrepareAppendKernels(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans);
  // The stores, the last with `attend` (null: none) in the same backend
  // call; a failed store fails its requests. Returns the last call's status
  // (the attention's, with `attend`).
  absl::Status StoreAppends(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans,
                            const AttendParams* attend);
  absl::Status StoreRunOf(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans, const StoreRun& run,
                          const AttendParams* attend);
  void PublishAppendLocked(const AppendRequest& request, AppendPlan* plan);
  // AppendAttend's parts: an item's attention against its append, and what
  // its kernel reads (the planned tables, or the sequence now for a retry).
  absl::Status CheckAttendOfAppend(const AppendRequest& append, const AttendRequestItem& attend) const;
  absl::Status SnapshotForAttendLocked(const AppendRequest& append, const AttendRequestItem& attend,
                                       const AppendPlan& plan, cache_internal::ReadSnapshot* snap);
  // The keys of `request` as stored: k - R_t m per (layer, head), with the
  // means of layers that have none yet (null entries) estimated first.
  void CenterKeys(const AppendRequest& request, std::vector<std::shared_ptr<const std::vector<float>>>* means,
                  std::vector<float>* centered) const;
  friend class SequenceExport;
  friend class SequenceImport;
  friend class ExportSharing;
  friend class ImportSharing;
  // The sharing objects' ends: their references go back.
  void ReleaseKept(const std::vector<int32_t>& pages);
  // SequenceExport's and SequenceImport's ends.
  void EndExport(const SequenceExport& e);
  absl::Status EndImport(SequenceImport& import, bool commit);
  KvCache(const CacheOptions& options, std::shared_ptr<const KvLayout> layout, Backend* backend, PagePool pool);

  CacheOptions options_;
  std::shared_ptr<const KvLayout> layout_;
  Backend* backend_;
  PagePool pool_;
  std::unique_ptr<State> state_;
  std::unique_ptr<RopeCheck> rope_check_;  // pre-RoPE centering only; else null
};

}  // namespace tqkv

#endif  // TQKV_CACHE_KV_CACHE_H_
