#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sys/mman.h>
#if defined(__SSE2__)
#include <xmmintrin.h>
#include <emmintrin.h>
#endif
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cpu/addback_plan.h"
#include "kernels/cpu/attend_kernels.h"
#include "base/thread_pool.h"
#include "kernels/simd/cpu_features.h"
#include "kernels/key_centering.h"
#include "base/status_macros.h"

namespace tqkv {
namespace {

// Pool memory. A decode step reads every page of a sequence through its block
// table, so with 4 KiB pages a long context misses the TLB on nearly every
// cache page (one 32k-token Llama-3.1-8B layer spans about 6,500 of them).
// Pools of 2 MiB or more are therefore mapped 2 MiB-aligned and advised as
// transparent huge pages; where THP is off the advice is ignored. Smaller
// pools come from the heap.
constexpr size_t kHugePage = size_t{2} << 20;

size_t PoolMappingBytes(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

void* MapPoolMemory(size_t bytes) {
  if (bytes < kHugePage) return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  const size_t mapped = PoolMappingBytes(bytes);
  // Map one huge page more than needed, then trim both ends to alignment.
  void* raw = mmap(nullptr, mapped + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t tail = start + mapped + kHugePage - (aligned + mapped);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + mapped), tail);
  madvise(reinterpret_cast<void*>(aligned), mapped, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

void UnmapPoolMemory(void* memory, size_t bytes) {
  if (memory == nullptr) return;
  if (bytes < kHugePage) {
    std::free(memory);
  } else {
    munmap(memory, PoolMappingBytes(bytes));
  }
}

// Where token t of a sequence lives, given its block table.
struct SlotAddress {
  const uint8_t* page;
  int slot;
};

inline SlotAddress Locate(const PagePool& pool, const int32_t* block_table, int page_tokens, int64_t token) {
  const int32_t page = block_table[token / page_tokens];
  return {pool.base + static_cast<size_t>(page) * pool.page_bytes, static_cast<int>(token % page_tokens)};
}

// Views of one (layer, head)'s planes in one page.
struct HeadView {
  const VectorCodec* key;
  const VectorCodec* value;
  const KvLayout::HeadPlanes* planes;
  CodePlane key_plane;  // how the codes planes are laid out (kernels/code_tiles.h)
  CodePlane value_plane;

  // A token's codes: in the page (token-major planes), or copied out of its
  // tile into scratch[code_bytes] (tiled ones).
  const uint8_t* key_codes(const uint8_t* page, int slot, uint8_t* scratch) const {
    return Codes(page + planes->key_codes, key_plane, slot, scratch);
  }
  const uint16_t* key_scalars(const uint8_t* page, int slot) const {
    return reinterpret_cast<const uint16_t*>(page + planes->key_scalars) +
           static_cast<size_t>(slot) * key->num_scalars();
  }
  const uint8_t* value_codes(const uint8_t* page, int slot, uint8_t* scratch) const {
    return Codes(page + planes->value_codes, value_plane, slot, scratch);
  }
  const uint16_t* value_scalars(const uint8_t* page, int slot) const {
    return reinterpret_cast<const uint16_t*>(page + planes->value_scalars) +
           static_cast<size_t>(slot) * value->num_scalars();
  }

  static const uint8_t* Codes(const uint8_t* plane, const CodePlane& layout, int slot, uint8_t* scratch) {
    if (!layout.tiled) return plane + static_cast<size_t>(slot) * layout.code_bytes;
    GatherCodes(plane, layout, slot, scratch);
    return scratch;
  }
};

HeadView View(const KvLayout& layout, int layer, int head) {
  return {&layout.key_codec(layer, head), &layout.value_codec(layer, head), &layout.planes(layer, head),
          layout.key_code_plane(layer, head), layout.value_code_plane(layer, head)};
}

// Room for one token's codes copied out of a tile (the widest codes plane:
// 8-bit uniform at kMaxHeadDim, or fp16 there).
constexpr int kMaxCodeBytes = 2 * kMaxHeadDim;

absl::Status CheckPages(const PagePool& pool, absl::Span<const int32_t> pages) {
  for (int32_t page : pages) {
    if (page < 0 || page >= pool.num_pages) {
      return absl::InvalidArgumentError(absl::StrFormat("page %d is outside a %d-page pool", page, pool.num_pages));
    }
  }
  return absl::OkStatus();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options)
      : num_threads_(options.num_threads > 0 ? options.num_threads
                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
        integer_attention_(options.integer_attention), pool_(num_threads_ - 1) {}

  std::string name() const override { return "cpu"; }

  std::string device() const override {
    const SimdLevel level = ActiveSimdLevel();
    return absl::StrFormat("x86-64, %d threads, %s%s", num_threads_, std::string(SimdLevelName(level)),
                           level < SimdLevel::kAvx512Vnni ? ""
                           : integer_attention_           ? ", integer attention"
                                                          : ", fp32 attention");
  }

  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    if (num_pages < 1) return absl::InvalidArgumentError("a pool needs at least one page");
    const size_t bytes = layout.page_bytes() * static_cast<size_t>(num_pages);
    void* memory = MapPoolMemory(bytes);
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cannot allocate a %d-page pool (%d bytes)", num_pages, bytes));
    }
    return PagePool{static_cast<uint8_t*>(memory), layout.page_bytes(), num_pages};
  }

  void FreePool(PagePool pool) override {
    UnmapPoolMemory(pool.base, pool.page_bytes * static_cast<size_t>(pool.num_pages));
  }

  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    if (from < 0 || from >= pool.num_pages || to < 0 || to >= pool.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrFormat("page copy %d -> %d outside a %d-page pool", from, to, pool.num_pages));
    }
    memcpy(pool.base + static_cast<size_t>(to) * pool.page_bytes,
           pool.base + static_cast<size_t>(from) * pool.page_bytes, pool.page_bytes);
    return absl::OkStatus();
  }

  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    RETURN_IF_ERROR(CheckPages(pool, pages));
    for (size_t i = 0; i < pages.size(); ++i) {
      memcpy(host + i * pool.page_bytes, pool.base + static_cast<size_t>(pages[i]) * pool.page_bytes, pool.page_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    RETURN_IF_ERROR(CheckPages(pool, pages));
    for (size_t i = 0; i < pages.size(); ++i) {
      memcpy(pool.base + static_cast<size_t>(pages[i]) * pool.page_bytes, host + i * pool.page_bytes, pool.page_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status Store(const StoreParams& p) override {
    RETURN_IF_ERROR(StoreTokens(p));
    if (p.exact_slots == nullptr) return absl::OkStatus();
    // The exact copies: a second, small pass over the rows that have one.
    std::vector<float> keys, values;
    std::vector<int32_t> slots;
    const StoreParams exact = ExactStorePart(p, &keys, &values, &slots);
    return exact.num_tokens > 0 ? StoreTokens(exact) : absl::OkStatus();
  }

  // The page and slot of tokens [i0, i0 + n) of a store.
  static void LocateSlots(const StoreParams& p, int64_t i0, int n, uint8_t** pages, int* slots) {
    const int page_tokens = p.layout->page_tokens();
    for (int k = 0; k < n; ++k) {
      const int32_t slot_index = p.slots[i0 + k];
      pages[k] = p.pool.base + static_cast<size_t>(slot_index / page_tokens) * p.pool.page_bytes;
      slots[k] = slot_index % page_tokens;
    }
  }

  // Where a run of n tokens of one head goes: each token's codes (in its
  // page, or for a tiled plane its row of the staged buffer, token-major)
  // and scalars, at pages[k] / slots[k].
  static void PointAtSlots(const HeadView& view, int n, uint8_t* const* pages, const int* slots, uint8_t* staged_keys,
                           uint8_t* staged_values, uint8_t** key_codes, uint8_t** value_codes, uint16_t** key_scalars,
                           uint16_t** value_scalars) {
    for (int k = 0; k < n; ++k) {
      uint8_t* page = pages[k];
      const int slot = slots[k];
      key_codes[k] = view.key_plane.tiled
                         ? staged_keys + k * view.key_plane.code_bytes
                         : page + view.planes->key_codes + static_cast<size_t>(slot) * view.key_plane.code_bytes;
      value_codes[k] = view.value_plane.tiled
                           ? staged_values + k * view.value_plane.code_bytes
                           : page + view.planes->value_codes + static_cast<size_t>(slot) * view.value_plane.code_bytes;
      key_scalars[k] = const_cast<uint16_t*>(view.key_scalars(page, slot));
      value_scalars[k] = const_cast<uint16_t*>(view.value_scalars(page, slot));
    }
  }

  // Tiled planes: asks for a run's tiles to write while the codecs work, so
  // that StoreTiled's stores do not wait on them.
  static void PrefetchTilesToWrite(const HeadView& view, int n, uint8_t* const* pages, const int* slots) {
    for (int k = 0; k < n; k += kTileTokens) {
      for (const auto& [plane, offset] :
           {std::pair{view.key_plane, view.planes->key_codes}, std::pair{view.value_plane, view.planes->value_codes}}) {
        if (!plane.tiled) continue;
        const uint8_t* tile =
            pages[k] + offset + static_cast<size_t>(slots[k] - slots[k] % kTileTokens) * plane.code_bytes;
        for (int b = 0; b < kTileTokens * plane.code_bytes; b += 64) __builtin_prefetch(tile + b, 1, 3);
      }
    }
  }

  // Store without the exact copies.
  absl::Status StoreTokens(const StoreParams& p) {
    const KvLayout& layout = *p.layout;
    const int heads = layout.num_kv_heads();
    const int d = layout.head_dim();
    // One task per (layer, run of kRun tokens), each storing every KV head
    // of its run: tasks write disjoint slots. Heads go inside a run, not
    // across the whole call, so that the run's input rows (one per token,
    // every head side by side) stay in L2 and its TLB entries stay warm
    // while each head reads its slice: a task per head swept the whole
    // input once per head, a 4 KiB page per token each time.
    // Within a run the codecs take the tokens together (EncodeMany), keys
    // then values. A head's input rows of a run are 4 KiB apart (one row
    // per token holds every head), which the hardware prefetchers do not
    // follow: each head asks for the next head's rows (the last for the
    // next run's first) while it encodes. Without it the first read of
    // every row waited on DRAM, most of a bf16 store's time.
    constexpr int kRun = 32;
    const size_t row_floats = static_cast<size_t>(heads) * d;
    const auto prefetch_rows = [&](const float* in, int layer, int64_t i0, int n, int head) {
      const size_t first =
          (static_cast<size_t>(layer - p.layer_begin) * p.num_tokens + i0) * row_floats + static_cast<size_t>(head) * d;
      for (int k = 0; k < n; ++k) {
        const float* row = in + first + k * row_floats;
        for (int j = 0; j < d; j += 16) cpu_internal::PrefetchLine(row + j);
      }
    };
    absl::Mutex error_mu;
    absl::Status first_error;
    const int64_t work = static_cast<int64_t>(p.layer_end - p.layer_begin) * heads * p.num_tokens * d;
    const int runs = static_cast<int>((p.num_tokens + kRun - 1) / kRun);
    RunTasks((p.layer_end - p.layer_begin) * runs, work, [&](int task) {
      const int layer = p.layer_begin + task / runs;
      const int64_t i0 = static_cast<int64_t>(task % runs) * kRun;
      const int n = static_cast<int>(std::min<int64_t>(kRun, p.num_tokens - i0));
      const int64_t layer_offset = static_cast<int64_t>(layer - p.layer_begin) * p.num_tokens;
      const float* key_in[kRun];
      const float* value_in[kRun];
      uint8_t* key_codes[kRun];
      uint8_t* value_codes[kRun];
      // Tiled planes: the codecs write each token's codes here, token-major,
      // and StoreTiled puts them in their tiles, one field later (keys
      // while the values encode, values while the next head's keys do):
      // read back at once, the codecs' fresh stores made the copy wait.
      // Two heads' rows of each field.
      // Rows code_bytes apart (the field's), so that all four stay in L1.
      thread_local std::vector<uint8_t> staged(4 * (kRun * kMaxCodeBytes + 64));
      const auto staged_rows = [&](int head, int field) {
        return staged.data() + (2 * (head % 2) + field) * (kRun * kMaxCodeBytes + 64);
      };
      const HeadView* pending_values = nullptr;  // the previous head's, not yet in their tiles
      HeadView previous;
      uint16_t* key_scalars[kRun];
      uint16_t* value_scalars[kRun];
      // Each token's page and slot, once for every head.
      uint8_t* pages[kRun];
      int slots[kRun];
      LocateSlots(p, i0, n, pages, slots);
      if (i0 == 0) {
        prefetch_rows(p.keys, layer, i0, n, 0);
        prefetch_rows(p.values, layer, i0, n, 0);
      }
      for (int head = 0; head < heads; ++head) {
        // What the next head reads (the next run's first for the last head):
        // its keys while these keys encode, its values while these values do.
        int64_t next_i0 = i0;
        int next_n = n, next_head = head + 1;
        if (next_head == heads) {
          next_i0 = i0 + n;
          next_n = static_cast<int>(std::min<int64_t>(kRun, p.num_tokens - next_i0));
          next_head = 0;
        }
        const HeadView view = View(layout, layer, head);
        uint8_t* const staged_keys = staged_rows(head, 0);
        uint8_t* const staged_values = staged_rows(head, 1);
        for (int k = 0; k < n; ++k) {
          const size_t row = static_cast<size_t>((layer_offset + i0 + k) * heads + head) * d;
          key_in[k] = p.keys + row;
          value_in[k] = p.values + row;
        }
        PointAtSlots(view, n, pages, slots, staged_keys, staged_values, key_codes, value_codes, key_scalars,
                     value_scalars);
        int key_failed = n, value_failed = n;
        PrefetchTilesToWrite(view, n, pages, slots);
        if (next_n > 0) prefetch_rows(p.keys, layer, next_i0, next_n, next_head);
        absl::Status key_status = view.key->EncodeMany(n, key_in, key_codes, key_scalars, &key_failed);
        if (pending_values != nullptr) {
          StoreTiled(pending_values->value_plane, pending_values->planes->value_codes, pages, slots, n,
                     staged_rows(head - 1, 1));
          pending_values = nullptr;
        }
        if (next_n > 0) prefetch_rows(p.values, layer, next_i0, next_n, next_head);
        absl::Status value_status = view.value->EncodeMany(n, value_in, value_codes, value_scalars, &value_failed);
        if (key_status.ok() && value_status.ok()) {
          if (view.key_plane.tiled) StoreTiled(view.key_plane, view.planes->key_codes, pages, slots, n, staged_keys);
          if (view.value_plane.tiled) {
            previous = view;
            pending_values = &previous;
          }
          if (head + 1 == heads && pending_values != nullptr) {
            StoreTiled(view.value_plane, view.planes->value_codes, pages, slots, n, staged_values);
          }
          continue;
        }
        // The first failing token, its key's error before its value's.
        const bool key_first = !key_status.ok() && (value_status.ok() || key_failed <= value_failed);
        const absl::Status& status = key_first ? key_status : value_status;
        const int64_t token = i0 + (key_first ? key_failed : value_failed);
        absl::MutexLock lock(&error_mu);
        if (first_error.ok()) {
          first_error = absl::InvalidArgumentError(
              absl::StrFormat("layer %d, token %d, KV head %d: %s", layer, token, head, status.message()));
        }
        return;
      }
    });
    return first_error;
  }

  absl::Status Score(const ScoreParams& p) override {
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int group = layout.query_heads_per_kv_head();
    const int64_t count = p.token_end - p.token_begin;
    Segment segments[kMaxSegments];
    // Without exact tokens `length` may be left 0: the range decides then.
    const int num_segments =
        Segments(layout, p.block_table, p.exact_block_table, std::max(p.length, p.token_end), segments);
    // Per KV head, the group's queries score each token in turn: a token's
    // bytes come from memory once per group, not once per query head.
    std::vector<float> states, scaled;
    std::vector<AddBackTerms> terms(group);
    uint8_t scratch[kMaxCodeBytes];
    for (int kv = 0; kv < layout.num_kv_heads(); ++kv) {
      for (int g = 0; g < group; ++g) {
        terms[g] = Terms(layout, p.layer, p.key_mean, kv, p.queries + static_cast<size_t>(kv * group + g) * d, p.scale);
      }
      for (int k = 0; k < num_segments; ++k) {
        const Segment& seg = segments[k];
        const int64_t begin = std::max(seg.begin, p.token_begin), end = std::min(seg.end, p.token_end);
        if (begin >= end) continue;
        const HeadView view = View(*seg.layout, p.layer, kv);
        const size_t state_floats = view.key->query_state_floats();
        states.resize(state_floats * group);
        for (int g = 0; g < group; ++g) {
          const float* query = ScaledQuery(layout, p.layer, kv, p.key_mean,
                                           p.queries + static_cast<size_t>(kv * group + g) * d, &scaled);
          view.key->PrepareQuery(query, states.data() + g * state_floats);
        }
        for (int64_t t = begin; t < end; ++t) {
          const SlotAddress at = Locate(p.pool, seg.table, seg.layout->page_tokens(), t);
          const uint8_t* codes = view.key_codes(at.page, at.slot, scratch);
          const uint16_t* scalars = view.key_scalars(at.page, at.slot);
          for (int g = 0; g < group; ++g) {
            const float score = p.scale * view.key->Score(states.data() + g * state_floats, codes, scalars);
            p.logits[(kv * group + g) * count + t - p.token_begin] =
                static_cast<float>(score + (terms[g].pairs.empty() ? terms[g].constant : terms[g].At(t)));
          }
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Attend(const AttendParams& p) override {
    const KvLayout& layout = *p.layout;
    const int heads = layout.num_kv_heads();
    // One task per (item, KV head); each writes its own rows of the output.
    int64_t work = 0;
    for (const AttendItem& item : p.items) {
      work += item.context_tokens * item.num_query_tokens * layout.query_heads_per_kv_head();
    }
    work *= static_cast<int64_t>(heads) * layout.head_dim();
    RunTasks(static_cast<int>(p.items.size()) * heads, work,
             [&](int task) { AttendHead(p, p.items[task / heads], task % heads); });
    return absl::OkStatus();
  }

 private:
  // Below this much work (multiply-adds, roughly) a call runs on its caller:
  // waking a worker costs more than it saves (tens of microseconds on a VM),
  // and a decode step makes many small calls (one token, one layer).
  static constexpr int64_t kInlineWork = int64_t{1} << 17;

  void RunTasks(int tasks, int64_t work, const std::function<void(int)>& body) {
    if (work < kInlineWork) {
      for (int i = 0; i < tasks; ++i) body(i);
      return;
    }
    pool_.ParallelFor(tasks, body);
  }

  // Puts n tokens' codes, staged token-major (code_bytes apart), into
  // their tiles: 16 tokens that fill a whole tile word by word (a store
  // after a store, 64 bytes a word), the others one by one (ScatterCodes).
  static void StoreTiled(const CodePlane& plane, size_t plane_offset, uint8_t* const* pages, const int* slots, int n,
                         const uint8_t* staged) {
    const int words = plane.code_bytes / kTileWordBytes;
    for (int k = 0; k < n;) {
      const bool whole_tile = slots[k] % kTileTokens == 0 && k + kTileTokens <= n &&
                              plane.TileSize(slots[k]) == kTileTokens && pages[k + kTileTokens - 1] == pages[k] &&
                              slots[k + kTileTokens - 1] == slots[k] + kTileTokens - 1;
      if (!whole_tile) {
        ScatterCodes(staged + static_cast<size_t>(k) * plane.code_bytes, plane, slots[k], pages[k] + plane_offset);
        ++k;
        continue;
      }
      // Consecutive slots of one page (the last equal to the first + 15)
      // from a tile's start: the 16 staged rows in order.
      uint8_t* tile = pages[k] + plane_offset + static_cast<size_t>(slots[k]) * plane.code_bytes;
      const uint8_t* rows = staged + static_cast<size_t>(k) * plane.code_bytes;
      int w = 0;
#if defined(__SSE2__)
      // 4 x 4 word transposes: 16-byte stores, a quarter of the stores
      // word by word took (a tile's first stores wait on its lines coming
      // in from memory, and 4-byte stores filled the store buffer).
      for (; w + 4 <= words; w += 4) {
        for (int i = 0; i < kTileTokens; i += 4) {
          const auto row = [&](int t) {
            return _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                rows + static_cast<size_t>(i + t) * plane.code_bytes + kTileWordBytes * w)));
          };
          __m128 r0 = row(0), r1 = row(1), r2 = row(2), r3 = row(3);
          _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
          uint8_t* to = tile + kTileWordBytes * (kTileTokens * w + i);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(to), _mm_castps_si128(r0));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(to + kTileWordBytes * kTileTokens), _mm_castps_si128(r1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 2 * kTileWordBytes * kTileTokens), _mm_castps_si128(r2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(to + 3 * kTileWordBytes * kTileTokens), _mm_castps_si128(r3));
        }
      }
#endif
      for (; w < words; ++w) {
        for (int i = 0; i < kTileTokens; ++i) {
          memcpy(tile + kTileWordBytes * (kTileTokens * w + i),
                 rows + static_cast<size_t>(i) * plane.code_bytes + kTileWordBytes * w, kTileWordBytes);
        }
      }
      const int tail = plane.code_bytes - kTileWordBytes * words;
      for (int i = 0; i < kTileTokens; ++i) {
        for (int b = 0; b < tail; ++b) {
          tile[kTileWordBytes * kTileTokens * words + tail * i + b] =
              staged[static_cast<size_t>(k + i) * plane.code_bytes + kTileWordBytes * words + b];
        }
      }
      k += kTileTokens;
    }
  }

  // The most runs one read splits into: sinks, compressed, recent.
  static constexpr int kMaxSegments = 3;

  // A run of tokens [begin, end) read from the pages of one layout.
  struct Segment {
    const KvLayout* layout;
    const int32_t* table;
    int64_t begin;
    int64_t end;
  };

  // The runs a read of a layer holding `length` tokens covers, in token order.
  static int Segments(const KvLayout& layout, const int32_t* table, const int32_t* exact_table, int64_t length,
                      Segment* out) {
    if (!layout.has_exact_tokens() || exact_table == nullptr) {
      out[0] = {&layout, table, 0, length};
      return 1;
    }
    const ExactRanges r = layout.exact_ranges(length);
    const KvLayout* exact = layout.exact_layout();
    int n = 0;
    if (r.sink_end > 0) out[n++] = {exact, exact_table, 0, r.sink_end};
    if (r.recent_begin > r.sink_end) out[n++] = {&layout, table, r.sink_end, r.recent_begin};
    if (length > r.recent_begin) out[n++] = {exact, exact_table, r.recent_begin, length};
    return n;
  }

  // The query the stored keys of (layer, KV head) are read with: q * s with
  // key scales, the cache's or the sequence's after its mean (kv_layout.h;
  // the add-back takes q as given), else q itself.
  static const float* ScaledQuery(const KvLayout& layout, int layer, int kv, const float* key_mean, const float* query,
                                  std::vector<float>* scaled) {
    const float* s = layout.key_scales(layer, kv, key_mean);
    if (s == nullptr) return query;
    const int d = layout.head_dim();
    scaled->resize(d);
    for (int j = 0; j < d; ++j) (*scaled)[j] = query[j] * s[j];
    return scaled->data();
  }

  // The add-back of one (KV head, query), scale folded in (none without a mean).
  static AddBackTerms Terms(const KvLayout& layout, int layer, const float* key_mean, int kv, const float* query,
                            float scale) {
    if (key_mean == nullptr || layout.key_centering() == KeyCentering::kNone) return {};
    const int d = layout.head_dim();
    return MakeAddBackTerms(layout.rope(layer), key_mean + static_cast<size_t>(kv) * d, query, d, scale);
  }

  // The fused kernel for one layout's (layer, KV head), or null.
  cpu_internal::AttendKernel PickKernel(const KvLayout& layout, int layer, int kv, cpu_internal::FieldReader* key,
                                        cpu_internal::FieldReader* value) {
    const SimdLevel level = ActiveSimdLevel();
    const bool avx512 = level >= SimdLevel::kAvx512 && __builtin_cpu_supports("avx512dq");
    const bool avx2 = level >= SimdLevel::kAvx2;
    const bool vnni = integer_attention_ && level >= SimdLevel::kAvx512Vnni;
    const HeadView view = View(layout, layer, kv);
    *key = cpu_internal::DescribeField(*view.key);
    *value = cpu_internal::DescribeField(*view.value);
    key->codes_offset = view.planes->key_codes;
    key->scalars_offset = view.planes->key_scalars;
    value->codes_offset = view.planes->value_codes;
    value->scalars_offset = view.planes->value_scalars;
    if (vnni && cpu_internal::AttendHeadAvx512VnniSupported(*key, *value, layout.head_dim())) {
      return cpu_internal::AttendHeadAvx512Vnni;
    }
    if (avx512 && cpu_internal::AttendHeadAvx512Supported(*key, *value, layout.head_dim())) {
      return cpu_internal::AttendHeadAvx512;
    }
    if (avx2 && cpu_internal::AttendHeadAvx2Supported(*key, *value, layout.head_dim())) {
      return cpu_internal::AttendHeadAvx2;
    }
    return nullptr;
  }

  void AttendHead(const AttendParams& p, const AttendItem& item, int kv) {
    const KvLayout& layout = *p.layout;
    cpu_internal::FieldReader key, value;
    const cpu_internal::AttendKernel kernel = PickKernel(layout, item.layer, kv, &key, &value);
    if (kernel != nullptr) {
      AttendHeadFast(p, item, kv, key, value, kernel);
      return;
    }
    Segment segments[kMaxSegments];
    const int n = Segments(layout, item.block_table, item.exact_block_table, item.context_tokens, segments);
    AttendHeadReference(p, item, kv, segments, n);
  }

  // Rows of one (item, KV head): query token i, query head g of the group.
  static int RowCount(const KvLayout& layout, const AttendItem& item) {
    return item.num_query_tokens * layout.query_heads_per_kv_head();
  }

  // Where the fused kernels read an item's exact tokens of one KV head
  // (queries and out are the caller's): nothing without exact tokens.
  static cpu_internal::ExactTokens ExactFor(const KvLayout& layout, const AttendItem& item, int kv) {
    cpu_internal::ExactTokens exact;
    if (!layout.has_exact_tokens() || item.exact_block_table == nullptr) return exact;
    const ExactRanges r = layout.exact_ranges(item.context_tokens);
    exact.sink_end = r.sink_end;
    if (r.recent_begin < item.context_tokens) exact.recent_begin = r.recent_begin;
    if (!exact.any()) return exact;
    const KvLayout& pages = *layout.exact_layout();
    exact.page_tokens = pages.page_tokens();
    exact.block_table = item.exact_block_table;
    exact.key_offset = pages.planes(item.layer, kv).key_codes;
    exact.value_offset = pages.planes(item.layer, kv).value_codes;
    return exact;
  }

  // The fused kernel over one (item, KV head), its rows in chunks of at most
  // kMaxRows: compressed and exact tokens in one walk and one online softmax
  // (exact_tokens.h), the add-back inside (addback.h).
  void AttendHeadFast(const AttendParams& p, const AttendItem& item, int kv, const cpu_internal::FieldReader& key,
                      const cpu_internal::FieldReader& value, cpu_internal::AttendKernel kernel) {
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int group = layout.query_heads_per_kv_head();
    const int total_rows = RowCount(layout, item);
    const HeadView view = View(layout, item.layer, kv);
    const bool centered = item.key_mean != nullptr && layout.key_centering() != KeyCentering::kNone;
    const float* mean = centered ? item.key_mean + static_cast<size_t>(kv) * d : nullptr;
    thread_local std::vector<float> queries, out, exact_out, state, coef, line, lse, scaled_rows, shifts;
    thread_local std::vector<const float*> query_rows;
    thread_local std::vector<int64_t> visible;
    thread_local std::vector<double> constants;
    thread_local std::vector<int> pairs;
    thread_local std::vector<const cpu_internal::AddBackFrequency*> freq;
    const RopeTable& rope = layout.rope(item.layer);
    const int num_pairs = centered ? cpu_internal::AddBackPairs(rope, mean, &pairs, &freq) : 0;
    cpu_internal::ExactTokens exact = ExactFor(layout, item, kv);
    state.resize(view.key->query_state_floats());
    line.resize(d);
    // The kernel takes one token_begin for all its rows: in a sliding-window
    // layer each query token's rows (its window begins at p + 1 - window)
    // form their own chunks.
    const bool windowed = layout.layer_window(item.layer) > 0;
    for (int row0 = 0, rows = 0; row0 < total_rows; row0 += rows) {
      rows = std::min(cpu_internal::kMaxRows, total_rows - row0);
      if (windowed) rows = std::min(rows, (row0 / group + 1) * group - row0);
      const size_t floats = static_cast<size_t>(rows) * d;
      queries.resize(floats);
      out.resize(floats);
      exact_out.resize(exact.any() ? floats : 0);
      query_rows.resize(rows);
      visible.resize(rows);
      lse.resize(rows);
      constants.assign(rows, 0.0);
      coef.resize(static_cast<size_t>(rows) * 2 * num_pairs);
      const float* key_scales = layout.key_scales(item.layer, kv, item.key_mean);
      if (key_scales != nullptr) scaled_rows.resize(floats);
      for (int r = 0; r < rows; ++r) {
        const int i = (row0 + r) / group, h = kv * group + (row0 + r) % group;
        const float* query = item.queries + (static_cast<size_t>(i) * qh + h) * d;
        visible[r] = VisibleEnd(item, i);
        // Stored keys (compressed and exact) are read with q * s; the
        // add-back below takes q.
        const float* stored_query = query;
        if (key_scales != nullptr) {
          float* row = scaled_rows.data() + static_cast<size_t>(r) * d;
          for (int j = 0; j < d; ++j) row[j] = query[j] * key_scales[j];
          stored_query = row;
        }
        view.key->PrepareQuery(stored_query, state.data());
        for (int j = 0; j < d; ++j) queries[static_cast<size_t>(r) * d + j] = state[j] * p.scale;
        query_rows[r] = stored_query;
        if (centered) {
          constants[r] = cpu_internal::AddBackCoefficients(rope, mean, query, d, p.scale, pairs,
                                                           coef.data() + static_cast<size_t>(r) * 2 * num_pairs);
        }
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
      // The first token the chunk's rows see (all of them, when windowed).
      params.token_begin = layout.WindowBegin(item.layer, QueryPosition(item, row0 / group));
      params.addback_pairs = num_pairs;
      params.addback_freq = freq.data();
      params.addback_coef = coef.data();
      params.exact = exact;
      params.exact.query_rows = query_rows.data();
      params.exact.query_scale = p.scale;
      params.exact.out = exact_out.data();
      params.out = out.data();
      params.lse = lse.data();
      params.softcap = p.logit_softcap;
      if (p.logit_softcap > 0.0f && centered) {
        shifts.assign(constants.begin(), constants.begin() + rows);
        params.softcap_shift = shifts.data();
      }
      kernel(params);
      for (int r = 0; r < rows; ++r) {
        const int i = (row0 + r) / group, h = kv * group + (row0 + r) % group;
        const size_t row = static_cast<size_t>(i) * qh + h;
        float* to = item.output + row * d;
        if (lse[r] == -std::numeric_limits<float>::infinity()) {
          std::fill(to, to + d, 0.0f);
        } else {
          view.value->FinishAccumulation(out.data() + static_cast<size_t>(r) * d, to);
          if (exact.any()) {
            const float* share = exact_out.data() + static_cast<size_t>(r) * d;
            for (int j = 0; j < d; ++j) to[j] += share[j];
          }
        }
        if (item.lse != nullptr) item.lse[row] = static_cast<float>(lse[r] + constants[r]);
      }
    }
  }

  // A logit x without its constant part c, soft-capped on the whole logit
  // and c taken off again (so that the lse plus c stays right), in double.
  static float SoftCapped(float x, double c, float cap) {
    return static_cast<float>(cap * std::tanh((x + c) / cap) - c);
  }

  // The reference: the codec's own Score / Accumulate, two passes in float,
  // the add-back in double, the soft cap after it.
  void AttendHeadReference(const AttendParams& p, const AttendItem& item, int kv, const Segment* segments,
                           int num_segments) {
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int group = layout.query_heads_per_kv_head();
    thread_local std::vector<float> state, logits, acc, part, scaled;
    uint8_t scratch[kMaxCodeBytes];
    for (int h = kv * group; h < (kv + 1) * group; ++h) {
      for (int i = 0; i < item.num_query_tokens; ++i) {
        const int64_t visible = VisibleEnd(item, i);
        const int64_t first_seen = layout.WindowBegin(item.layer, QueryPosition(item, i));
        const size_t row = (static_cast<size_t>(i) * qh + h) * d;
        const AddBackTerms terms = Terms(layout, item.layer, item.key_mean, kv, item.queries + row, p.scale);
        logits.resize(std::max<int64_t>(visible, 1));
        float max_logit = -std::numeric_limits<float>::infinity();
        for (int k = 0; k < num_segments; ++k) {
          const Segment& seg = segments[k];
          const HeadView view = View(*seg.layout, item.layer, kv);
          state.resize(view.key->query_state_floats());
          view.key->PrepareQuery(ScaledQuery(layout, item.layer, kv, item.key_mean, item.queries + row, &scaled),
                                 state.data());
          for (int64_t t = std::max(seg.begin, first_seen); t < std::min(seg.end, visible); ++t) {
            const SlotAddress at = Locate(p.pool, seg.table, seg.layout->page_tokens(), t);
            const float score = p.scale * view.key->Score(state.data(), view.key_codes(at.page, at.slot, scratch),
                                                          view.key_scalars(at.page, at.slot));
            logits[t] = static_cast<float>(score + (terms.pairs.empty() ? 0.0 : terms.At(t) - terms.constant));
            if (p.logit_softcap > 0.0f) logits[t] = SoftCapped(logits[t], terms.constant, p.logit_softcap);
            max_logit = std::max(max_logit, logits[t]);
          }
        }
        double denominator = 0.0;
        for (int64_t t = first_seen; t < visible; ++t) {
          logits[t] = std::exp(logits[t] - max_logit);
          denominator += logits[t];
        }
        const float inv = static_cast<float>(1.0 / denominator);
        std::fill(item.output + row, item.output + row + d, 0.0f);
        for (int k = 0; k < num_segments; ++k) {
          const Segment& seg = segments[k];
          const HeadView view = View(*seg.layout, item.layer, kv);
          acc.assign(view.value->accumulator_floats(), 0.0f);
          part.resize(d);
          bool any = false;
          for (int64_t t = std::max(seg.begin, first_seen); t < std::min(seg.end, visible); ++t) {
            const SlotAddress at = Locate(p.pool, seg.table, seg.layout->page_tokens(), t);
            view.value->Accumulate(logits[t] * inv, view.value_codes(at.page, at.slot, scratch),
                                   view.value_scalars(at.page, at.slot), acc.data());
            any = true;
          }
          if (!any) continue;
          view.value->FinishAccumulation(acc.data(), part.data());
          for (int j = 0; j < d; ++j) item.output[row + j] += part[j];
        }
        if (item.lse != nullptr) {
          item.lse[static_cast<size_t>(i) * qh + h] =
              static_cast<float>(max_logit + std::log(denominator) + terms.constant);
        }
      }
    }
  }

  int num_threads_;
  bool integer_attention_;
  ThreadPool pool_;
};

}  // namespace

namespace cpu_internal {

uint8_t* BlockWalkStage(size_t bytes) {
  thread_local std::vector<uint8_t> stage;
  if (stage.size() < bytes) stage.resize(bytes);
  return stage.data();
}

FieldReader DescribeField(const VectorCodec& codec) {
  FieldReader field;
  field.code_bytes = codec.code_bytes();
  field.num_scalars = codec.num_scalars();
  field.tiled = TiledCodes(codec.spec().kind);
  field.readable = true;
  const CodecSpec& spec = codec.spec();
  switch (spec.kind) {
    case CodecKind::kTurboQuant:
      field.format = FormatFamily::kTurboQuant;
      field.bits = spec.bits;
      field.centroids = codec.turboquant_parts()[0].codebook->centroids.data();
      break;
    case CodecKind::kUniform:
      field.format = FormatFamily::kUniform;
      field.bits = spec.bits;
      break;
    case CodecKind::kFp16:
      field.format = FormatFamily::kFp16;
      field.bits = 16;
      break;
    case CodecKind::kBf16:
      field.format = FormatFamily::kBf16;
      field.bits = 16;
      break;
    case CodecKind::kFp8:
      field.format = FormatFamily::kFp8;
      field.bits = 8;
      break;
    case CodecKind::kOutlierSplit: {
      const std::vector<TurboQuantPart>& parts = codec.turboquant_parts();
      field.format = FormatFamily::kTurboQuant;
      field.parts = 2;
      field.bits = spec.hot_bits;
      field.centroids = parts[0].codebook->centroids.data();
      field.hot_dims = static_cast<int>(parts[0].channels.size());
      field.cold_bits = spec.bits;
      field.cold_centroids = parts[1].codebook->centroids.data();
      field.cold_code_offset = parts[1].code_offset;
      break;
    }
    case CodecKind::kQjl:
      field.readable = false;
      break;
  }
  return field;
}

}  // namespace cpu_internal

std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

std::unique_ptr<Backend> MakeCpuBackend(int num_threads) {
  CpuBackendOptions options;
  options.num_threads = num_threads;
  options.integer_attention = false;
  return MakeCpuBackend(options);
}

}  // namespace tqkv
