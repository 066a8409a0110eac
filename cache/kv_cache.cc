#include "cache/kv_cache.h"

#include "cache/kv_cache_internal.h"

namespace tqkv {

using cache_internal::CeilDiv;
using cache_internal::CheckFinite;
using cache_internal::CheckLogitSoftcap;
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

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const CacheOptions& options, Backend* backend) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("cache '%s': backend is null; want a backend", options.name));
  }
  if (options.idle_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cache '%s': idle_ttl is %s; want a positive duration or InfiniteDuration() to disable",
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
    return absl::ResourceExhaustedError(
        absl::StrFormat("cache '%s': a memory budget of %d bytes holds no page of %d bytes; want at least %d",
                        options.name, options.memory_budget_bytes, page_bytes, page_bytes));
  }
  ASSIGN_OR_RETURN(PagePool pool, backend->AllocatePool(*layout, static_cast<int32_t>(num_pages)));
  return std::unique_ptr<KvCache>(new KvCache(options, std::move(layout), backend, pool));
}

KvCache::KvCache(const CacheOptions& options, std::shared_ptr<const KvLayout> layout, Backend* backend, PagePool pool)
    : options_(options), layout_(std::move(layout)), backend_(backend), pool_(pool),
      state_(std::make_unique<State>(options, layout_.get(), pool.num_pages)) {
  if (layout_->key_centering() == KeyCentering::kPreRope && layout_->rope().num_pairs() > 0) {
    rope_check_ = std::make_unique<RopeCheck>(options.name, layout_->num_layers());
  }
}

KvCache::~KvCache() { backend_->FreePool(pool_); }

absl::Status KvCache::CreateSequence(const std::string& id, std::shared_ptr<UsageAccount> account) {
  if (id.empty()) return absl::InvalidArgumentError("sequence id is empty; want a non-empty id");
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  // A first append in flight on the id decides whether it exists.
  s.AwaitNoWriter(id);
  if (s.sequences.contains(id)) {
    return absl::AlreadyExistsError(absl::StrFormat("sequence '%s' already exists in cache '%s'", id, s.name));
  }
  if (account != nullptr) RETURN_IF_ERROR(account->TryAddSequence());
  s.AddSequence(id, /*pending=*/false, s.clock())->account = std::move(account);
  return absl::OkStatus();
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
  info.stored_bytes_bf16 = seq->stored_bytes_bf16;
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

namespace {

// Cuts each placed item (first_query_position >= 0) to its query tokens
// that see a stored token, the rest of its output set to 0 and its lse to
// -inf here, and leaves out the items that see nothing: the backends take
// only query tokens that see something. A sliding window moves forward with
// the position, so those tokens are a prefix of the item's. Items of the
// last n stored tokens are untouched.
void TrimPlacedQueries(const KvLayout& layout, std::vector<AttendItem>* items) {
  const size_t row = static_cast<size_t>(layout.num_query_heads());
  const size_t d = static_cast<size_t>(layout.head_dim());
  for (AttendItem& item : *items) {
    const int window = layout.layer_window(item.layer);
    if (item.first_query_position < 0 || window == 0) continue;
    // Query token i sees a stored token when position + 1 - window < length.
    const int64_t seeing = item.context_tokens + window - 1 - item.first_query_position;
    const int n = static_cast<int>(std::clamp<int64_t>(seeing, 0, item.num_query_tokens));
    std::fill(item.output + n * row * d, item.output + item.num_query_tokens * row * d, 0.0f);
    if (item.lse != nullptr) {
      std::fill(item.lse + n * row, item.lse + item.num_query_tokens * row, -std::numeric_limits<float>::infinity());
    }
    item.num_query_tokens = n;
  }
  items->erase(
      std::remove_if(items->begin(), items->end(), [](const AttendItem& i) { return i.num_query_tokens == 0; }),
      items->end());
}

}  // namespace

absl::Status KvCache::Attend(absl::Span<const AttendRequestItem> items, float scale, float logit_softcap) {
  const KvLayout& layout = *layout_;
  RETURN_IF_ERROR(CheckScale(scale));
  RETURN_IF_ERROR(CheckLogitSoftcap(logit_softcap));
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendRequestItem& item = items[i];
    if (item.layer < 0 || item.layer >= layout.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: layer %d is outside the cache's %d layers; want [0, %d)", i, item.layer,
                          layout.num_layers(), layout.num_layers()));
    }
    if (item.queries == nullptr || item.output == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: %s is null; want [num_query_tokens, num_query_heads, head_dim] floats", i,
                          item.queries == nullptr ? "queries" : "output"));
    }
    if (item.num_query_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("item %d: num_query_tokens is %d; want at least 1", i, item.num_query_tokens));
    }
    if (item.first_query_position < -1 || item.first_query_position > kMaxQueryPosition - item.num_query_tokens) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "item %d: first_query_position %d with %d query tokens; want the last query token's position in [0, %d]", i,
          item.first_query_position, item.num_query_tokens, kMaxQueryPosition - 1));
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
        return s.SequenceNotFound(item.sequence_id, absl::StrFormat("item %d: sequence '%s' not found in cache '%s'", i,
                                                                    item.sequence_id, s.name));
      }
      const int64_t length = seq->layer_tokens[item.layer];
      const bool placed = item.first_query_position >= 0;
      if (placed && length < 1) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "item %d: sequence '%s' layer %d holds no tokens to attend over", i, item.sequence_id, item.layer));
      }
      if (!placed && item.num_query_tokens > length) {
        return absl::InvalidArgumentError(
            absl::StrFormat("item %d: %d query tokens but sequence '%s' layer %d holds %d tokens; the query "
                            "tokens must be appended first (want 1 <= num_query_tokens <= %d)",
                            i, item.num_query_tokens, item.sequence_id, item.layer, length, length));
      }
      const int64_t first_seen =
          layout.WindowBegin(item.layer, placed ? item.first_query_position : length - item.num_query_tokens);
      const int64_t held = seq->held_begin[item.layer];
      if (first_seen < held) {
        return absl::OutOfRangeError(
            absl::StrFormat("item %d: sequence '%s' layer %d (sliding window %d) holds tokens [%d, %d) and has given "
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
      k.first_query_position = item.first_query_position;
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

  TrimPlacedQueries(layout, &kernel_items);
  AttendParams params;
  params.layout = layout_.get();
  params.pool = pool_;
  params.items = kernel_items;
  params.scale = EffectiveScale(scale, layout);
  params.logit_softcap = logit_softcap;
  const absl::Status status = backend_->Attend(params);

  absl::MutexLock lock(&s.mu);
  for (size_t i = 0; i < items.size(); ++i) s.EndRead(items[i].sequence_id, snapshots[i]);
  return status;
}

absl::Status KvCache::Score(const std::string& id, int layer, int64_t token_begin, int64_t token_end,
                            const float* queries, float* logits, float scale) {
  const KvLayout& layout = *layout_;
  RETURN_IF_ERROR(CheckScale(scale));
  if (layer < 0 || layer >= layout.num_layers()) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d is outside the cache's %d layers; want [0, %d)", layer,
                                                      layout.num_layers(), layout.num_layers()));
  }
  if (queries == nullptr || logits == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s is null; want %s", queries == nullptr ? "queries" : "logits",
                                                      queries == nullptr
                                                          ? "[num_query_heads, head_dim] floats"
                                                          : "[num_query_heads, token_end - token_begin] floats"));
  }
  if (token_begin < 0 || token_end < -1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("token range [%d, %d) is negative; want 0 <= token_begin <= token_end, or token_end = -1 "
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
      return absl::OutOfRangeError(
          absl::StrFormat("token range [%d, %d) is beyond sequence '%s' layer %d, which holds %d tokens", token_begin,
                          end, id, layer, length));
    }
    if (token_begin > end) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token range [%d, %d) ends before it begins; want token_begin <= token_end", token_begin, end));
    }
    if (token_begin < seq->held_begin[layer] && token_begin < end) {
      return absl::OutOfRangeError(
          absl::StrFormat("token range [%d, %d) of sequence '%s' layer %d (sliding window %d) reaches tokens given "
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
  stats.rope_mismatches = rope_check_ == nullptr ? 0 : rope_check_->mismatches();
  return stats;
}

}  // namespace tqkv
