#include "cache/kv_cache.h"

#include "cache/kv_cache_internal.h"

namespace tqkv {

using cache_internal::CeilDiv;
using cache_internal::ForEachHeld;
using cache_internal::CountBytes;
using cache_internal::ExactRuns;
using cache_internal::TablePlan;
using cache_internal::PlanTableWrites;
using cache_internal::Sequence;
using cache_internal::ForEachPage;
using cache_internal::ReadSnapshot;
using cache_internal::CheckFinite;
using cache_internal::CheckScale;
using cache_internal::EffectiveScale;

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

}  // namespace tqkv
