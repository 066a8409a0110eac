#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cpu/attend_kernels.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu_features.h"
#include "kernels/status_macros.h"

namespace tqkv {
namespace {

// Where token t of a sequence lives, given its block table.
struct SlotAddress {
  const uint8_t* page;
  int slot;
};

inline SlotAddress Locate(const PagePool& pool, const int32_t* block_table, int page_tokens,
                          int64_t token) {
  const int32_t page = block_table[token / page_tokens];
  return {pool.base + static_cast<size_t>(page) * pool.page_bytes,
          static_cast<int>(token % page_tokens)};
}

// Views of one (layer, head)'s planes in one page.
struct HeadView {
  const VectorCodec* key;
  const VectorCodec* value;
  const KvLayout::HeadPlanes* planes;

  const uint8_t* key_codes(const uint8_t* page, int slot) const {
    return page + planes->key_codes + static_cast<size_t>(slot) * key->code_bytes();
  }
  const uint16_t* key_scalars(const uint8_t* page, int slot) const {
    return reinterpret_cast<const uint16_t*>(page + planes->key_scalars) +
           static_cast<size_t>(slot) * key->num_scalars();
  }
  const uint8_t* value_codes(const uint8_t* page, int slot) const {
    return page + planes->value_codes + static_cast<size_t>(slot) * value->code_bytes();
  }
  const uint16_t* value_scalars(const uint8_t* page, int slot) const {
    return reinterpret_cast<const uint16_t*>(page + planes->value_scalars) +
           static_cast<size_t>(slot) * value->num_scalars();
  }
};

HeadView View(const KvLayout& layout, int layer, int head) {
  return {&layout.key_codec(layer, head), &layout.value_codec(layer, head),
          &layout.planes(layer, head)};
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads)
      : num_threads_(num_threads > 0 ? num_threads
                                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
        pool_(num_threads_ - 1) {}

  std::string name() const override { return "cpu"; }

  std::string device() const override {
    return absl::StrFormat("x86-64, %d threads, %s", num_threads_,
                           std::string(SimdLevelName(ActiveSimdLevel())));
  }

  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    if (num_pages < 1) return absl::InvalidArgumentError("a pool needs at least one page");
    const size_t bytes = layout.page_bytes() * static_cast<size_t>(num_pages);
    void* memory = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cannot allocate a %d-page pool (%d bytes)", num_pages, bytes));
    }
    return PagePool{static_cast<uint8_t*>(memory), layout.page_bytes(), num_pages};
  }

  void FreePool(PagePool pool) override { std::free(pool.base); }

  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    if (from < 0 || from >= pool.num_pages || to < 0 || to >= pool.num_pages) {
      return absl::InvalidArgumentError(absl::StrFormat("page copy %d -> %d outside a %d-page pool",
                                                        from, to, pool.num_pages));
    }
    memcpy(pool.base + static_cast<size_t>(to) * pool.page_bytes,
           pool.base + static_cast<size_t>(from) * pool.page_bytes, pool.page_bytes);
    return absl::OkStatus();
  }

  absl::Status Store(const StoreParams& p) override {
    const KvLayout& layout = *p.layout;
    const int heads = layout.num_kv_heads();
    const int d = layout.head_dim();
    const int page_tokens = layout.page_tokens();
    // One task per (layer, head): they write disjoint planes.
    absl::Mutex error_mu;
    absl::Status first_error;
    pool_.ParallelFor((p.layer_end - p.layer_begin) * heads, [&](int task) {
      const int layer = p.layer_begin + task / heads;
      const int head = task % heads;
      const int64_t layer_offset = static_cast<int64_t>(layer - p.layer_begin) * p.num_tokens;
      const HeadView view = View(layout, layer, head);
      for (int64_t i = 0; i < p.num_tokens; ++i) {
        const int32_t slot_index = p.slots[i];
        uint8_t* page = p.pool.base + static_cast<size_t>(slot_index / page_tokens) * p.pool.page_bytes;
        const int slot = slot_index % page_tokens;
        const size_t row = static_cast<size_t>((layer_offset + i) * heads + head) * d;
        absl::Status status = view.key->Encode(p.keys + row, const_cast<uint8_t*>(view.key_codes(page, slot)),
                                               const_cast<uint16_t*>(view.key_scalars(page, slot)));
        if (status.ok()) {
          status = view.value->Encode(p.values + row, const_cast<uint8_t*>(view.value_codes(page, slot)),
                                      const_cast<uint16_t*>(view.value_scalars(page, slot)));
        }
        if (!status.ok()) {
          absl::MutexLock lock(&error_mu);
          if (first_error.ok()) {
            first_error = absl::InvalidArgumentError(absl::StrFormat(
                "layer %d, token %d, KV head %d: %s", layer, i, head, status.message()));
          }
          return;
        }
      }
    });
    return first_error;
  }

  absl::Status Score(const ScoreParams& p) override {
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int group = layout.query_heads_per_kv_head();
    const int64_t count = p.token_end - p.token_begin;
    std::vector<float> state;
    for (int h = 0; h < layout.num_query_heads(); ++h) {
      const HeadView view = View(layout, p.layer, h / group);
      state.resize(view.key->query_state_floats());
      view.key->PrepareQuery(p.queries + static_cast<size_t>(h) * d, state.data());
      for (int64_t t = 0; t < count; ++t) {
        const SlotAddress at = Locate(p.pool, p.block_table, layout.page_tokens(), p.token_begin + t);
        p.logits[h * count + t] = p.scale * view.key->Score(state.data(), view.key_codes(at.page, at.slot),
                                                           view.key_scalars(at.page, at.slot));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Attend(const AttendParams& p) override {
    const KvLayout& layout = *p.layout;
    // The widest fused kernel the CPU and the active SIMD level allow.
    const SimdLevel level = ActiveSimdLevel();
    const bool avx512 = level >= SimdLevel::kAvx512 && __builtin_cpu_supports("avx512dq");
    const bool avx2 = level >= SimdLevel::kAvx2;
    const int heads = layout.num_kv_heads();
    // One task per (item, KV head); each writes its own rows of the output.
    pool_.ParallelFor(static_cast<int>(p.items.size()) * heads, [&](int task) {
      const AttendItem& item = p.items[task / heads];
      const int kv = task % heads;
      {
        const HeadView view = View(layout, item.layer, kv);
        cpu_internal::FieldReader key = cpu_internal::DescribeField(*view.key);
        cpu_internal::FieldReader value = cpu_internal::DescribeField(*view.value);
        key.codes_offset = view.planes->key_codes;
        key.scalars_offset = view.planes->key_scalars;
        value.codes_offset = view.planes->value_codes;
        value.scalars_offset = view.planes->value_scalars;
        cpu_internal::AttendKernel kernel = nullptr;
        if (avx512 && cpu_internal::AttendHeadAvx512Supported(key, value, layout.head_dim())) {
          kernel = cpu_internal::AttendHeadAvx512;
        } else if (avx2 && cpu_internal::AttendHeadAvx2Supported(key, value, layout.head_dim())) {
          kernel = cpu_internal::AttendHeadAvx2;
        }
        if (kernel != nullptr) {
          AttendHeadFast(p, item, kv, view, key, value, kernel);
        } else {
          AttendHeadReference(p, item, kv, view);
        }
      }
    });
    return absl::OkStatus();
  }

 private:
  // Rows of one (item, KV head): query token i, query head g of the group.
  static int RowCount(const KvLayout& layout, const AttendItem& item) {
    return item.num_query_tokens * layout.query_heads_per_kv_head();
  }

  void AttendHeadFast(const AttendParams& p, const AttendItem& item, int kv, const HeadView& view,
                      const cpu_internal::FieldReader& key, const cpu_internal::FieldReader& value,
                      cpu_internal::AttendKernel kernel) {
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int group = layout.query_heads_per_kv_head();
    const int total_rows = RowCount(layout, item);
    thread_local std::vector<float> queries, out, state;
    thread_local std::vector<int64_t> visible;
    thread_local std::vector<float> lse;
    for (int row0 = 0; row0 < total_rows; row0 += cpu_internal::kMaxRows) {
      const int rows = std::min(cpu_internal::kMaxRows, total_rows - row0);
      queries.resize(static_cast<size_t>(rows) * d);
      out.resize(static_cast<size_t>(rows) * d);
      visible.resize(rows);
      lse.resize(rows);
      state.resize(view.key->query_state_floats());
      for (int r = 0; r < rows; ++r) {
        const int i = (row0 + r) / group, h = kv * group + (row0 + r) % group;
        view.key->PrepareQuery(item.queries + (static_cast<size_t>(i) * qh + h) * d, state.data());
        for (int j = 0; j < d; ++j) queries[static_cast<size_t>(r) * d + j] = state[j] * p.scale;
        visible[r] = item.context_tokens - item.num_query_tokens + 1 + i;
      }
      cpu_internal::HeadAttendParams params;
      params.head_dim = d;
      params.page_tokens = layout.page_tokens();
      params.pool_base = p.pool.base;
      params.page_bytes = p.pool.page_bytes;
      params.block_table = item.block_table;
      params.key = key;
      params.value = value;
      params.rows = rows;
      params.queries = queries.data();
      params.visible = visible.data();
      params.out = out.data();
      params.lse = lse.data();
      kernel(params);
      for (int r = 0; r < rows; ++r) {
        const int i = (row0 + r) / group, h = kv * group + (row0 + r) % group;
        const size_t row = static_cast<size_t>(i) * qh + h;
        view.value->FinishAccumulation(out.data() + static_cast<size_t>(r) * d, item.output + row * d);
        if (item.lse != nullptr) item.lse[row] = lse[r];
      }
    }
  }

  // The reference: the codec's own Score / Accumulate, two passes in float.
  void AttendHeadReference(const AttendParams& p, const AttendItem& item, int kv, const HeadView& view) {
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int group = layout.query_heads_per_kv_head();
    thread_local std::vector<float> state, logits, acc;
    state.resize(view.key->query_state_floats());
    acc.resize(view.value->accumulator_floats());
    for (int h = kv * group; h < (kv + 1) * group; ++h) {
      for (int i = 0; i < item.num_query_tokens; ++i) {
        const int64_t visible = item.context_tokens - item.num_query_tokens + 1 + i;
        const size_t row = (static_cast<size_t>(i) * qh + h) * d;
        view.key->PrepareQuery(item.queries + row, state.data());
        logits.resize(std::max<int64_t>(visible, 1));
        float max_logit = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < visible; ++t) {
          const SlotAddress at = Locate(p.pool, item.block_table, layout.page_tokens(), t);
          logits[t] = p.scale * view.key->Score(state.data(), view.key_codes(at.page, at.slot),
                                                view.key_scalars(at.page, at.slot));
          max_logit = std::max(max_logit, logits[t]);
        }
        double denominator = 0.0;
        for (int64_t t = 0; t < visible; ++t) {
          logits[t] = std::exp(logits[t] - max_logit);
          denominator += logits[t];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        const float inv = static_cast<float>(1.0 / denominator);
        for (int64_t t = 0; t < visible; ++t) {
          const SlotAddress at = Locate(p.pool, item.block_table, layout.page_tokens(), t);
          view.value->Accumulate(logits[t] * inv, view.value_codes(at.page, at.slot),
                                 view.value_scalars(at.page, at.slot), acc.data());
        }
        view.value->FinishAccumulation(acc.data(), item.output + row);
        if (item.lse != nullptr) {
          item.lse[static_cast<size_t>(i) * qh + h] = max_logit + static_cast<float>(std::log(denominator));
        }
      }
    }
  }

  int num_threads_;
  ThreadPool pool_;
};

}  // namespace

namespace cpu_internal {

FieldReader DescribeField(const VectorCodec& codec) {
  FieldReader field;
  field.code_bytes = codec.code_bytes();
  field.num_scalars = codec.num_scalars();
  const CodecSpec& spec = codec.spec();
  switch (spec.kind) {
    case CodecKind::kTurboQuant:
      field.format = FieldFormat::kCentroids;
      field.bits = spec.bits;
      field.centroids = codec.turboquant_parts()[0].codebook->centroids.data();
      break;
    case CodecKind::kUniform:
      field.format = FieldFormat::kUniform;
      field.bits = spec.bits;
      break;
    case CodecKind::kFp16:
      field.format = FieldFormat::kFp16;
      field.bits = 16;
      break;
    case CodecKind::kBf16:
      field.format = FieldFormat::kBf16;
      field.bits = 16;
      break;
    default:
      field.format = FieldFormat::kUnsupported;
  }
  return field;
}

}  // namespace cpu_internal

std::unique_ptr<Backend> MakeCpuBackend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace tqkv
