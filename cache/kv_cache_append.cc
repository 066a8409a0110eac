#include "cache/kv_cache.h"

#include <algorithm>
#include <memory>

#include "cache/kv_cache_internal.h"

namespace tqkv {

using cache_internal::AddRangeBytes;
using cache_internal::CeilDiv;
using cache_internal::CheckFinite;
using cache_internal::CheckLogitSoftcap;
using cache_internal::CheckScale;
using cache_internal::EffectiveScale;
using cache_internal::ExactRuns;
using cache_internal::ForEachHeld;
using cache_internal::ForEachPage;
using cache_internal::PlanTableWrites;
using cache_internal::ReadSnapshot;
using cache_internal::Sequence;
using cache_internal::TablePlan;

// What an append does, in four phases so that a batch shares its lock and
// its kernels: CheckAppend (no state), PlanAppendLocked (positions, retries,
// pages, reservations: the sequence is claimed, writer_active), the kernels
// (page copies, centering, one Store per layer range with the exact copies,
// and for AppendAttend the attention in the same backend call), and
// PublishAppendLocked (the new tables and lengths, or everything given back).
struct KvCache::AppendPlan {
  struct PageCopy {
    int32_t from;  // the shared page
    int32_t to;    // its fresh copy
  };
  absl::Status status;                             // the request's outcome so far
  bool already_stored = false;                     // answered without storing (a retry)
  Sequence* seq = nullptr;                         // claimed by this batch (writer_active)
  std::vector<int> chunks;                         // the chunks the append writes
  std::vector<TablePlan> main_plans, exact_plans;  // by chunk: the new tables
  std::vector<PageCopy> copies;
  // By chunk, per token: its slot, and its exact slot (-1: none).
  std::vector<std::vector<int32_t>> slots, exact_slots;
  // Per layer of the range: the key mean (a layer's first append estimates
  // it with the kernels).
  std::vector<std::shared_ptr<const std::vector<float>>> means;
  uint64_t reserved = 0;                            // bytes charged to the account for fresh pages
  int64_t stored_bytes = 0, stored_bytes_bf16 = 0;  // the change published (AppendOutcome)
  std::vector<int32_t> allocated;                   // owned until published
  std::vector<float> centered;                      // the keys as stored, when centering
  const float* keys = nullptr;                      // the keys as stored

  // Planned and not answered yet: its kernels run.
  bool stores() const { return status.ok() && !already_stored && seq != nullptr; }
};

absl::Status KvCache::Append(const AppendRequest& request, AppendOutcome* outcome) {
  absl::Status status;
  AppendOutcome out;
  AppendBatch(absl::MakeConstSpan(&request, 1), absl::MakeSpan(&status, 1), absl::MakeSpan(&out, 1));
  if (outcome != nullptr) *outcome = out;
  return status;
}

namespace {

// What a published (or refused) plan tells its caller.
template <typename Plan>
AppendOutcome OutcomeOf(const Plan& plan) {
  AppendOutcome out;
  if (!plan.status.ok()) return out;
  out.already_stored = plan.already_stored;
  out.stored_bytes = plan.stored_bytes;
  out.stored_bytes_bf16 = plan.stored_bytes_bf16;
  return out;
}

// INVALID_ARGUMENT for every request naming a sequence an earlier one named.
template <typename Plan>
void RefuseRepeatedIds(absl::Span<const AppendRequest> requests, absl::Span<Plan> plans) {
  absl::flat_hash_map<std::string_view, size_t> first;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto [it, inserted] = first.emplace(requests[i].sequence_id, i);
    if (inserted || !plans[i].status.ok()) continue;
    plans[i].status = absl::InvalidArgumentError(
        absl::StrFormat("sequence '%s' is also appended to by request %d of this batch; want at most one per sequence",
                        requests[i].sequence_id, it->second));
  }
}

}  // namespace

void KvCache::AppendBatch(absl::Span<const AppendRequest> requests, absl::Span<absl::Status> statuses,
                          absl::Span<AppendOutcome> outcomes) {
  std::vector<AppendPlan> plans(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) plans[i].status = CheckAppend(requests[i]);
  RefuseRepeatedIds(requests, absl::MakeSpan(plans));
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    PlanAppendsLocked(requests, absl::MakeSpan(plans));
  }
  PrepareAppendKernels(requests, absl::MakeSpan(plans));
  (void)StoreAppends(requests, absl::MakeSpan(plans), nullptr);
  absl::MutexLock lock(&s.mu);
  for (size_t i = 0; i < requests.size(); ++i) {
    PublishAppendLocked(requests[i], &plans[i]);
    statuses[i] = plans[i].status;
    if (!outcomes.empty()) outcomes[i] = OutcomeOf(plans[i]);
  }
}

void KvCache::AppendAttend(absl::Span<const AppendRequest> appends, absl::Span<const AttendRequestItem> attends,
                           float scale, absl::Span<absl::Status> statuses, absl::Span<AppendOutcome> outcomes,
                           float logit_softcap) {
  const size_t n = appends.size();
  std::vector<AppendPlan> plans(n);
  absl::Status scale_ok = CheckScale(scale);
  if (scale_ok.ok()) scale_ok = CheckLogitSoftcap(logit_softcap);
  for (size_t i = 0; i < n; ++i) {
    plans[i].status = scale_ok.ok() ? CheckAppend(appends[i]) : scale_ok;
    if (plans[i].status.ok()) plans[i].status = CheckAttendOfAppend(appends[i], attends[i]);
  }
  RefuseRepeatedIds(appends, absl::MakeSpan(plans));
  State& s = *state_;
  std::vector<ReadSnapshot> snapshots(n);
  {
    absl::MutexLock lock(&s.mu);
    PlanAppendsLocked(appends, absl::MakeSpan(plans));
    for (size_t i = 0; i < n; ++i) {
      if (plans[i].status.ok())
        plans[i].status = SnapshotForAttendLocked(appends[i], attends[i], plans[i], &snapshots[i]);
    }
  }
  PrepareAppendKernels(appends, absl::MakeSpan(plans));
  // One attention batch over the items planned, their new tokens included.
  std::vector<AttendItem> items;
  std::vector<size_t> attended;
  for (size_t i = 0; i < n; ++i) {
    if (!plans[i].status.ok()) continue;
    const ReadSnapshot& snap = snapshots[i];
    AttendItem k;
    k.block_table = snap.table.data();
    k.exact_block_table = snap.exact_table_or_null();
    k.key_mean =
        plans[i].already_stored ? snap.key_mean_or_null() : (plans[i].means[0] ? plans[i].means[0]->data() : nullptr);
    k.context_tokens = snap.length;
    k.layer = attends[i].layer;
    k.num_query_tokens = attends[i].num_query_tokens;
    k.queries = attends[i].queries;
    k.output = attends[i].output;
    k.lse = attends[i].lse;
    items.push_back(k);
    attended.push_back(i);
  }
  AttendParams params;
  params.layout = layout_.get();
  params.pool = pool_;
  params.items = items;
  params.scale = EffectiveScale(scale, *layout_);
  params.logit_softcap = logit_softcap;
  const absl::Status status = StoreAppends(appends, absl::MakeSpan(plans), &params);
  if (!status.ok()) {
    // The store's or the attention's: nothing of the batch is kept.
    for (size_t i : attended) {
      if (plans[i].status.ok()) plans[i].status = status;
    }
  }
  absl::MutexLock lock(&s.mu);
  for (size_t i = 0; i < n; ++i) {
    PublishAppendLocked(appends[i], &plans[i]);
    if (snapshots[i].serial != 0) s.EndRead(appends[i].sequence_id, snapshots[i]);
    statuses[i] = plans[i].status;
    if (!outcomes.empty()) outcomes[i] = OutcomeOf(plans[i]);
  }
}

absl::Status KvCache::CheckAttendOfAppend(const AppendRequest& append, const AttendRequestItem& attend) const {
  if (attend.sequence_id != append.sequence_id || append.layer_end != append.layer_begin + 1 ||
      attend.layer != append.layer_begin || attend.num_query_tokens != append.num_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the attention of sequence '%s' (layer %d, %d query tokens) does not match its append (layers [%d, %d), "
        "%d tokens); want one layer and a query per appended token",
        attend.sequence_id, attend.layer, attend.num_query_tokens, append.layer_begin, append.layer_end,
        append.num_tokens));
  }
  if (attend.queries == nullptr || attend.output == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s is null; want [num_query_tokens, num_query_heads, head_dim] floats",
                        attend.queries == nullptr ? "queries" : "output"));
  }
  return absl::OkStatus();
}

absl::Status KvCache::SnapshotForAttendLocked(const AppendRequest& append, const AttendRequestItem& attend,
                                              const AppendPlan& plan, ReadSnapshot* snap) {
  State& s = *state_;
  const KvLayout& layout = *layout_;
  Sequence* seq = plan.seq;
  const int layer = attend.layer;
  if (plan.already_stored) {
    // A retry: attention over what the layer holds now, as Attend gives it.
    const int64_t length = seq->layer_tokens[layer];
    const int64_t first_seen = layout.WindowBegin(layer, length - attend.num_query_tokens);
    if (first_seen < seq->held_begin[layer]) {
      return absl::OutOfRangeError(absl::StrFormat(
          "sequence '%s' layer %d holds tokens [%d, %d); %d query tokens need token %d on", append.sequence_id, layer,
          seq->held_begin[layer], length, attend.num_query_tokens, first_seen));
    }
    s.TakeSnapshot(seq, layer, length, snap);
    return absl::OkStatus();
  }
  // The tables as the append will publish them, its tokens included.
  const int chunk = layout.layer_chunk(layer);
  const int64_t length = append.start_position + append.num_tokens;
  const std::vector<int32_t>& table = plan.main_plans[chunk].table;
  snap->serial = seq->serial;
  snap->length = length;
  snap->table.assign(table.begin(), table.begin() + CeilDiv(length, layout.page_tokens()));
  if (layout.has_exact_tokens()) {
    const std::vector<int32_t>& exact = plan.exact_plans[chunk].table;
    snap->exact_table.assign(
        exact.begin(), exact.begin() + std::min<size_t>(exact.size(), CeilDiv(length, layout.exact_page_tokens())));
    snap->has_exact = true;
  }
  ForEachHeld(snap->table, [&](int32_t page) { s.pages.Pin(page); });
  ForEachHeld(snap->exact_table, [&](int32_t page) { s.pages.Pin(page); });
  ++seq->readers;
  return absl::OkStatus();
}

absl::Status KvCache::CheckAppend(const AppendRequest& request) const {
  const KvLayout& layout = *layout_;
  const int64_t start = request.start_position;
  const int64_t n = request.num_tokens;
  if (request.sequence_id.empty()) return absl::InvalidArgumentError("sequence_id is empty; want a non-empty id");
  if (request.layer_begin < 0 || request.layer_end > layout.num_layers() || request.layer_begin >= request.layer_end) {
    return absl::InvalidArgumentError(
        absl::StrFormat("layer range [%d, %d) is empty or outside the cache's %d layers; want "
                        "0 <= layer_begin < layer_end <= %d",
                        request.layer_begin, request.layer_end, layout.num_layers(), layout.num_layers()));
  }
  if (n < 1) return absl::InvalidArgumentError(absl::StrFormat("num_tokens is %d; want at least 1", n));
  if (request.keys == nullptr || request.values == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s is null; want [layers, tokens, kv_heads, head_dim] floats",
                                                      request.keys == nullptr ? "keys" : "values"));
  }
  if (start < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("start_position is %d; want a non-negative position", start));
  }
  const int64_t capacity_tokens = static_cast<int64_t>(pool_.num_pages) * layout.page_tokens();
  // Layers that keep every token bound a sequence by the pool; windowed ones
  // give old pages back, so only the page check bounds them. A start beyond
  // the pool is a gap, reported with the expected position.
  bool keeps_every_token = false;
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    keeps_every_token = keeps_every_token || layout.layer_window(layer) == 0;
  }
  if (keeps_every_token && start <= capacity_tokens && n > capacity_tokens - start) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cache '%s' cannot hold tokens [%d, %d): its %d pages hold %d tokens per sequence",
                        options_.name, start, start + n, pool_.num_pages, capacity_tokens));
  }
  if (request.finite_checked) return absl::OkStatus();
  const int layers = request.layer_end - request.layer_begin;
  RETURN_IF_ERROR(
      CheckFinite("keys", request.keys, request.layer_begin, layers, n, layout.num_kv_heads(), layout.head_dim()));
  return CheckFinite("values", request.values, request.layer_begin, layers, n, layout.num_kv_heads(),
                     layout.head_dim());
}

void KvCache::PlanAppendsLocked(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans) {
  State& s = *state_;
  // Appends to one sequence are serialized; the winner's result decides
  // what the next one must start at, so every check runs after the wait.
  std::vector<const std::string*> ids;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (plans[i].status.ok()) ids.push_back(&requests[i].sequence_id);
  }
  s.AwaitNoWriters(ids);
  // The batch's sequences are claimed first: room made for one request's
  // pages never evicts another's sequence.
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!plans[i].status.ok()) continue;
    auto it = s.sequences.find(requests[i].sequence_id);
    if (it == s.sequences.end()) continue;
    plans[i].seq = it->second.get();
    plans[i].seq->writer_active = true;
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    AppendPlan& plan = plans[i];
    if (!plan.status.ok()) continue;
    plan.status = PlanAppendLocked(requests[i], &plan);
    if (plan.status.ok() || plan.seq == nullptr) continue;
    plan.seq->writer_active = false;  // claimed, nothing planned
    plan.seq = nullptr;
  }
}

namespace {

// The outcome of request `r` for a sequence that remembers `seq`'s appends:
// OK with *stored when it is a retry of one that landed; INVALID_ARGUMENT
// when its request_id named another append; OK and !*stored otherwise.
absl::Status RetryOf(const Sequence& seq, const AppendRequest& r, bool* stored) {
  *stored = false;
  const int64_t start = r.start_position, n = r.num_tokens;
  if (!r.request_id.empty()) {
    for (const Sequence::RememberedAppend& m : seq.recent_appends) {
      if (m.request_id != r.request_id) continue;
      if (m.start == start && m.tokens == n && m.layer_begin == r.layer_begin && m.layer_end == r.layer_end) {
        *stored = true;
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrFormat("request_id '%s' already named an append to sequence '%s' (tokens [%d, %d) of layers [%d, "
                          "%d)); this one is tokens [%d, %d) of layers [%d, %d): give every append its own request_id",
                          r.request_id, r.sequence_id, m.start, m.start + m.tokens, m.layer_begin, m.layer_end, start,
                          start + n, r.layer_begin, r.layer_end));
    }
    return absl::OkStatus();
  }
  if (!r.landed_is_stored) return absl::OkStatus();
  for (int layer = r.layer_begin; layer < r.layer_end; ++layer) {
    if (seq.layer_tokens[layer] != start + n) return absl::OkStatus();
  }
  *stored = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status KvCache::PlanAppendLocked(const AppendRequest& request, AppendPlan* plan) {
  State& s = *state_;
  const std::string& id = request.sequence_id;
  const int64_t start = request.start_position;
  Sequence* seq = plan->seq;
  if (seq == nullptr && !request.create_if_missing) {
    return s.SequenceNotFound(id, absl::StrFormat("sequence '%s' not found in cache '%s'; create it first "
                                                  "(CreateSequence), or append without do_not_create",
                                                  id, s.name));
  }
  if (seq != nullptr) {
    RETURN_IF_ERROR(RetryOf(*seq, request, &plan->already_stored));
    if (plan->already_stored) return absl::OkStatus();
  }
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    const int64_t have = seq == nullptr ? 0 : seq->layer_tokens[layer];
    if (have != start) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "sequence '%s' layer %d holds %d tokens; an append must start at %d, got %d", id, layer, have, have, start));
    }
  }
  const absl::Time now = s.clock();
  s.EvictExpiredLocked(now, &id);
  RETURN_IF_ERROR(PlanAppendPages(request, seq, plan, now));
  if (seq == nullptr) {
    seq = s.AddSequence(id, /*pending=*/true, now);
    seq->account = request.account;
    seq->writer_active = true;
    plan->seq = seq;
  }
  seq->charged_bytes += plan->reserved;
  PlanAppendSlots(request, plan);
  plan->means.resize(request.layer_end - request.layer_begin);
  for (size_t l = 0; l < plan->means.size(); ++l) plan->means[l] = seq->key_means[request.layer_begin + l];
  return absl::OkStatus();
}

absl::Status KvCache::PlanAppendPages(const AppendRequest& request, const Sequence* seq, AppendPlan* plan,
                                      absl::Time now) {
  const KvLayout& layout = *layout_;
  State& s = *state_;
  const int64_t start = request.start_position, n = request.num_tokens;
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    const int chunk = layout.layer_chunk(layer);
    if (std::find(plan->chunks.begin(), plan->chunks.end(), chunk) == plan->chunks.end()) plan->chunks.push_back(chunk);
  }
  plan->main_plans.resize(layout.num_chunks());
  plan->exact_plans.resize(layout.num_chunks());
  const std::vector<std::pair<int64_t, int64_t>> exact_runs = ExactRuns(layout, start, n);
  static const std::vector<int32_t> kNoPages;
  int32_t need = 0;
  int64_t fresh = 0;
  for (int chunk : plan->chunks) {
    // With per-layer lengths any existing page from the first written
    // position on may be written (for these layers), not just the last
    // one. Pages a windowed chunk gave back lie below every layer's
    // held_begin <= start, so the append never writes one.
    int64_t chunk_max = 0;
    if (seq != nullptr) {
      for (int layer : layout.chunk_layers(chunk)) chunk_max = std::max(chunk_max, seq->layer_tokens[layer]);
    }
    const int64_t end = std::max(chunk_max, start + n);
    TablePlan& main = plan->main_plans[chunk];
    TablePlan& exact = plan->exact_plans[chunk];
    main = PlanTableWrites(s.pages, seq == nullptr ? kNoPages : seq->tables[chunk], CeilDiv(end, layout.page_tokens()),
                           {{start, start + n}}, layout.page_tokens());
    if (layout.has_exact_tokens()) {
      exact = PlanTableWrites(s.pages, seq == nullptr ? kNoPages : seq->exact_tables[chunk],
                              CeilDiv(end, layout.exact_page_tokens()), exact_runs, layout.exact_page_tokens());
    }
    need += main.pages_needed() + exact.pages_needed();
    fresh += static_cast<int64_t>(main.fresh.size() + exact.fresh.size());
  }
  // The account's limits before the pool's: a sequence at its quota evicts
  // nobody. Copies replace pages the sequence holds already.
  UsageAccount* const account = seq != nullptr ? seq->account.get() : request.account.get();
  plan->reserved = static_cast<uint64_t>(fresh) * layout.page_bytes();
  if (account != nullptr) RETURN_IF_ERROR(account->TryReserve(seq == nullptr, plan->reserved, "this append"));
  if (absl::Status room = s.MakeRoom(need, request.sequence_id, now); !room.ok()) {
    if (account != nullptr) account->Unreserve(seq == nullptr, plan->reserved);
    plan->reserved = 0;
    return room;
  }
  (void)s.pages.Allocate(need, &plan->allocated);  // `need` free pages were ensured above
  size_t next = 0;
  for (int chunk : plan->chunks) {
    for (TablePlan* table : {&plan->main_plans[chunk], &plan->exact_plans[chunk]}) {
      for (int64_t block : table->copy) {
        plan->copies.push_back({table->table[block], plan->allocated[next]});
        table->table[block] = plan->allocated[next++];
      }
      for (int64_t block : table->fresh) table->table[block] = plan->allocated[next++];
    }
  }
  return absl::OkStatus();
}

void KvCache::PlanAppendSlots(const AppendRequest& request, AppendPlan* plan) const {
  const KvLayout& layout = *layout_;
  const int64_t start = request.start_position, n = request.num_tokens;
  const int page_tokens = layout.page_tokens(), exact_tokens = layout.exact_page_tokens();
  const std::vector<std::pair<int64_t, int64_t>> exact_runs = ExactRuns(layout, start, n);
  plan->slots.resize(layout.num_chunks());
  plan->exact_slots.resize(layout.num_chunks());
  for (int chunk : plan->chunks) {
    const std::vector<int32_t>& table = plan->main_plans[chunk].table;
    std::vector<int32_t>& slots = plan->slots[chunk];
    slots.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t position = start + i;
      slots[i] = table[position / page_tokens] * page_tokens + static_cast<int32_t>(position % page_tokens);
    }
    if (exact_runs.empty()) continue;
    std::vector<int32_t>& exact = plan->exact_slots[chunk];
    exact.assign(n, -1);
    for (const auto& [begin, end] : exact_runs) {
      for (int64_t position = begin; position < end; ++position) {
        exact[position - start] = plan->exact_plans[chunk].table[position / exact_tokens] * exact_tokens +
                                  static_cast<int32_t>(position % exact_tokens);
      }
    }
  }
}

void KvCache::PrepareAppendKernels(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans) {
  // Kernels run outside the lock. The pages written are either fresh ones
  // owned by this batch or unshared ones whose published slots lie below
  // each append's start for its layers, so concurrent readers are
  // unaffected.
  for (size_t i = 0; i < requests.size(); ++i) {
    AppendPlan& plan = plans[i];
    if (!plan.stores()) continue;
    for (const AppendPlan::PageCopy& copy : plan.copies) {
      plan.status = backend_->CopyPage(pool_, copy.from, copy.to);
      if (!plan.status.ok()) break;
    }
    plan.keys = requests[i].keys;
    if (plan.status.ok() && layout_->key_centering() != KeyCentering::kNone) {
      CenterKeys(requests[i], &plan.means, &plan.centered);
      plan.keys = plan.centered.data();
    }
  }
}

// Stores that run together: the requests of one layer range, one Store per
// run of consecutive layers in one chunk, their tokens side by side.
struct KvCache::StoreRun {
  int layer_begin = 0, layer_end = 0, chunk = 0;
  std::vector<size_t> members;  // request indices, in order
};

absl::Status KvCache::StoreAppends(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans,
                                   const AttendParams* attend) {
  const KvLayout& layout = *layout_;
  std::vector<StoreRun> runs;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!plans[i].stores()) continue;
    const AppendRequest& r = requests[i];
    for (int b = r.layer_begin; b < r.layer_end;) {
      const int chunk = layout.layer_chunk(b);
      int e = b + 1;
      while (e < r.layer_end && layout.layer_chunk(e) == chunk) ++e;
      auto it = std::find_if(runs.begin(), runs.end(), [&](const StoreRun& run) {
        return run.layer_begin == b && run.layer_end == e && requests[run.members[0]].layer_begin == r.layer_begin &&
               requests[run.members[0]].layer_end == r.layer_end;
      });
      if (it == runs.end()) it = runs.insert(runs.end(), StoreRun{b, e, chunk, {}});
      it->members.push_back(i);
      b = e;
    }
  }
  absl::Status last;
  for (size_t k = 0; k < runs.size(); ++k) {
    const AttendParams* with = k + 1 == runs.size() ? attend : nullptr;
    last = StoreRunOf(requests, plans, runs[k], with);
    if (last.ok()) continue;
    for (size_t i : runs[k].members) {
      if (!plans[i].status.ok()) continue;
      plans[i].status =
          absl::Status(last.code(), absl::StrFormat("append to sequence '%s' in cache '%s': %s",
                                                    requests[i].sequence_id, options_.name, last.message()));
    }
  }
  if (runs.empty() && attend != nullptr && !attend->items.empty()) return backend_->Attend(*attend);
  return last;
}

namespace {

// Room for `floats` floats of a store's tokens gathered side by side,
// never zeroed (the gather writes it whole before the store reads it).
// Slot 0 or 1 (keys, values) keeps up to 4 MiB with the thread for its next
// call, a decode layer's batch; a larger gather (a batched prefill) is
// allocated into *own for this call alone.
float* GatherRoom(int slot, size_t floats, std::unique_ptr<float[]>* own) {
  constexpr size_t kKept = size_t{1} << 20;
  if (floats > kKept) {
    own->reset(new float[floats]);
    return own->get();
  }
  thread_local std::unique_ptr<float[]> kept[2];
  thread_local size_t kept_size[2] = {0, 0};
  if (kept_size[slot] < floats) {
    kept_size[slot] = std::min(kKept, std::max(floats, 2 * kept_size[slot]));
    kept[slot].reset(new float[kept_size[slot]]);
  }
  return kept[slot].get();
}

}  // namespace

absl::Status KvCache::StoreRunOf(absl::Span<const AppendRequest> requests, absl::Span<AppendPlan> plans,
                                 const StoreRun& run, const AttendParams* attend) {
  const KvLayout& layout = *layout_;
  const size_t row = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
  const int layers = run.layer_end - run.layer_begin;
  StoreParams params;
  params.layout = layout_.get();
  params.pool = pool_;
  params.layer_begin = run.layer_begin;
  params.layer_end = run.layer_end;
  const bool exact = layout.has_exact_tokens() && std::any_of(run.members.begin(), run.members.end(), [&](size_t i) {
                       return !plans[i].exact_slots[run.chunk].empty();
                     });
  std::unique_ptr<float[]> own_keys, own_values;
  std::vector<int32_t> slots, exact_slots;
  if (run.members.size() == 1) {
    // One request: its own arrays, no copy.
    const size_t i = run.members[0];
    const AppendRequest& r = requests[i];
    const size_t offset = static_cast<size_t>(run.layer_begin - r.layer_begin) * r.num_tokens * row;
    params.num_tokens = r.num_tokens;
    params.slots = plans[i].slots[run.chunk].data();
    params.keys = plans[i].keys + offset;
    params.values = r.values + offset;
    if (exact) params.exact_slots = plans[i].exact_slots[run.chunk].data();
  } else {
    // Several: their tokens side by side, layer by layer.
    int64_t total = 0;
    for (size_t i : run.members) total += requests[i].num_tokens;
    const size_t floats = static_cast<size_t>(layers) * total * row;
    float* k_out = GatherRoom(0, floats, &own_keys);
    float* v_out = GatherRoom(1, floats, &own_values);
    params.keys = k_out;
    params.values = v_out;
    for (int l = run.layer_begin; l < run.layer_end; ++l) {
      for (size_t i : run.members) {
        const AppendRequest& r = requests[i];
        const size_t from = static_cast<size_t>(l - r.layer_begin) * r.num_tokens * row;
        const size_t count = static_cast<size_t>(r.num_tokens) * row;
        std::copy(plans[i].keys + from, plans[i].keys + from + count, k_out);
        std::copy(r.values + from, r.values + from + count, v_out);
        k_out += count;
        v_out += count;
      }
    }
    for (size_t i : run.members) {
      const std::vector<int32_t>& own = plans[i].slots[run.chunk];
      slots.insert(slots.end(), own.begin(), own.end());
      if (!exact) continue;
      const std::vector<int32_t>& own_exact = plans[i].exact_slots[run.chunk];
      if (own_exact.empty()) {
        exact_slots.insert(exact_slots.end(), own.size(), -1);
      } else {
        exact_slots.insert(exact_slots.end(), own_exact.begin(), own_exact.end());
      }
    }
    params.num_tokens = total;
    params.slots = slots.data();
    if (exact) params.exact_slots = exact_slots.data();
  }
  if (exact) params.exact_layout = layout.exact_layout();
  return attend != nullptr ? backend_->StoreAndAttend(params, *attend) : backend_->Store(params);
}

void KvCache::PublishAppendLocked(const AppendRequest& request, AppendPlan* plan) {
  State& s = *state_;
  Sequence* seq = plan->seq;
  if (seq == nullptr) return;  // nothing was planned
  if (!plan->status.ok()) {
    for (int32_t page : plan->allocated) s.pages.Release(page);
    if (seq->account != nullptr) seq->account->Unreserve(seq->pending, plan->reserved);
    seq->charged_bytes -= plan->reserved;
    if (seq->pending) {
      s.sequences.erase(request.sequence_id);
    } else {
      seq->writer_active = false;
    }
    return;
  }
  if (plan->already_stored) {
    s.Touch(seq, s.clock());
    seq->writer_active = false;
    return;
  }
  const KvLayout& layout = *layout_;
  const int64_t start = request.start_position, n = request.num_tokens;
  // The tables, then the lengths readers go by.
  for (const AppendPlan::PageCopy& copy : plan->copies) s.pages.Release(copy.from);
  s.copy_on_writes += plan->copies.size();
  for (int chunk : plan->chunks) {
    seq->tables[chunk] = std::move(plan->main_plans[chunk].table);
    if (layout.has_exact_tokens()) seq->exact_tables[chunk] = std::move(plan->exact_plans[chunk].table);
  }
  const int64_t old_max = seq->max_tokens;
  // Only the range's layers change their bytes.
  uint64_t before = 0, before_bf16 = 0, after = 0, after_bf16 = 0;
  AddRangeBytes(layout, seq->layer_tokens, seq->held_begin, request.layer_begin, request.layer_end, &before,
                &before_bf16);
  for (int layer = request.layer_begin; layer < request.layer_end; ++layer) {
    seq->layer_tokens[layer] = start + n;
    // The append's own queries see from start + 1 - window on.
    seq->held_begin[layer] = std::max(seq->held_begin[layer], layout.WindowBegin(layer, start));
    seq->key_means[layer] = plan->means[layer - request.layer_begin];
  }
  for (int chunk : plan->chunks) {
    s.ReleaseGivenBack(seq, chunk);
    s.ReleaseLeftExactPages(seq, chunk);
  }
  AddRangeBytes(layout, seq->layer_tokens, seq->held_begin, request.layer_begin, request.layer_end, &after,
                &after_bf16);
  plan->stored_bytes = static_cast<int64_t>(after) - static_cast<int64_t>(before);
  plan->stored_bytes_bf16 = static_cast<int64_t>(after_bf16) - static_cast<int64_t>(before_bf16);
  seq->stored_bytes += after - before;
  seq->stored_bytes_bf16 += after_bf16 - before_bf16;
  s.stored_bytes += after - before;
  s.stored_bytes_bf16 += after_bf16 - before_bf16;
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
}

void KvCache::CenterKeys(const AppendRequest& request, std::vector<std::shared_ptr<const std::vector<float>>>* means,
                         std::vector<float>* centered) const {
  const KvLayout& layout = *layout_;
  const KvLayoutOptions& o = layout.options();
  const int64_t n = request.num_tokens;
  const int heads = layout.num_kv_heads();
  const int d = layout.head_dim();
  const int64_t stride = static_cast<int64_t>(heads) * d;
  // Angles per RoPE: layers of the cache's RoPE share one set; a layer with
  // its own (layer_ropes) computes its RoPE's, kept while the next layers
  // share it.
  const RopeAngles cache_angles = ComputeRopeAngles(layout.rope(), request.start_position, n);
  RopeAngles layer_angles;
  std::vector<double> layer_angles_freqs;
  // The mean's tokens: centering_tokens of them after the sinks (or from 0),
  // or every token when the append has too few.
  int64_t mean_begin = o.centering_includes_sinks ? 0 : std::min<int64_t>(o.exact_sink_tokens, n);
  if (mean_begin >= n) mean_begin = 0;
  const int64_t mean_end = std::min<int64_t>(n, mean_begin + o.centering_tokens);
  centered->resize(static_cast<size_t>(means->size()) * n * stride);
  for (size_t l = 0; l < means->size(); ++l) {
    const float* keys = request.keys + l * n * stride;
    const RopeTable& rope = layout.rope(request.layer_begin + static_cast<int>(l));
    const RopeAngles* angles = &cache_angles;
    if (&rope != &layout.rope()) {
      if (layer_angles_freqs != rope.inv_freqs() || layer_angles.n != n) {
        layer_angles = ComputeRopeAngles(rope, request.start_position, n);
        layer_angles_freqs = rope.inv_freqs();
      }
      angles = &layer_angles;
    }
    // The layer's first append estimates its mean (and, with sequence key
    // scales, measures them on the residual of the mean's tokens).
    std::shared_ptr<std::vector<float>> first;
    if ((*means)[l] == nullptr) {
      first = std::make_shared<std::vector<float>>(layout.mean_floats());
      for (int h = 0; h < heads; ++h) {
        EstimateKeyMean(rope, *angles, keys + h * d, mean_begin, mean_end, stride, o.centering_pairs, d,
                        first->data() + h * d);
      }
      if (rope_check_) {
        rope_check_->Observe(request.layer_begin + l, rope, *angles, keys, mean_begin, n, stride, heads, d);
      }
    }
    const float* mean = first ? first->data() : (*means)[l]->data();
    float* residual = centered->data() + l * n * stride;
    for (int h = 0; h < heads; ++h) {
      SubtractKeyMean(rope, *angles, mean + h * d, keys + h * d, stride, d, residual + h * d);
    }
    if (first && layout.sequence_key_scales()) {
      // Every token of the first append after the mean's first: more tokens
      // than the mean's estimate the spread better.
      for (int h = 0; h < heads; ++h) {
        EstimateKeyScales(rope, residual + h * d, mean_begin, n, stride, d, first->data() + stride + h * d);
      }
    }
    if (first) (*means)[l] = std::move(first);
    // Key scales: the residual / s (reads take the query * s).
    for (int h = 0; h < heads; ++h) {
      if (const float* s = layout.key_scales(request.layer_begin + static_cast<int>(l), h, mean)) {
        float* out = residual + h * d;
        for (int64_t t = 0; t < n; ++t) {
          for (int j = 0; j < d; ++j) out[t * stride + j] /= s[j];
        }
      }
    }
  }
}

}  // namespace tqkv
