// Sliding-window layers through the real cache and CPU backend: attention
// masked to each query's window against float64 attention over the decoded
// vectors, the pages and bytes given back, and the features that must keep
// working on windowed layers (fork, eviction, all-or-nothing appends, pins).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cache/kv_cache.h"
#include "cache_test_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace {

using testing_util::CountMismatches;
using testing_util::GatedBackend;
using testing_util::RandomQueries;
using testing_util::RandomTensor;
using testing_util::ReferenceSequence;

constexpr int kWindow = 10;

// 4 layers, 0, 2 and 3 with a window of kWindow, 1 full; 4 tokens per page.
KvLayoutOptions WindowedLayout(const std::string& preset) {
  KvLayoutOptions o;
  o.num_layers = 4;
  o.num_kv_heads = 2;
  o.num_query_heads = 4;
  o.head_dim = 64;
  o.page_tokens = 4;
  o.preset = preset;
  o.boundary_layers = 0;
  o.layer_windows = {kWindow, 0, kWindow, kWindow};
  return o;
}

// Float64 attention over the decoded vectors of `layer`, query token i of n
// (position p = context - n + i, or first + i when first >= 0) seeing the
// stored tokens [max(0, p + 1 - window), min(context, p + 1)); one that sees
// none gets output 0 and lse -inf.
void WindowedReference(const ReferenceSequence& ref, const KvLayout& layout, int layer, int n, const float* queries,
                       int window, std::vector<double>* output, std::vector<double>* lse, int64_t first = -1) {
  const int qh = layout.num_query_heads(), d = layout.head_dim();
  const int group = layout.query_heads_per_kv_head();
  const int64_t context = ref.tokens(layer);
  output->assign(static_cast<size_t>(n) * qh * d, 0.0);
  lse->assign(static_cast<size_t>(n) * qh, -INFINITY);
  for (int i = 0; i < n; ++i) {
    const int64_t position = (first >= 0 ? first : context - n) + i;
    const int64_t end = std::min(context, position + 1);
    const int64_t begin = window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
    if (begin >= end) continue;
    for (int h = 0; h < qh; ++h) {
      const float* q = queries + (static_cast<size_t>(i) * qh + h) * d;
      std::vector<double> logits(end - begin);
      double top = -INFINITY;
      for (int64_t t = begin; t < end; ++t) {
        double dot = 0;
        const float* k = ref.key(layer, t, h / group);
        for (int j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * k[j];
        logits[t - begin] = dot * ref.Scale();
        top = std::max(top, logits[t - begin]);
      }
      double sum = 0;
      for (double l : logits) sum += std::exp(l - top);
      double* out = &(*output)[(static_cast<size_t>(i) * qh + h) * d];
      for (int64_t t = begin; t < end; ++t) {
        const double p = std::exp(logits[t - begin] - top) / sum;
        const float* v = ref.value(layer, t, h / group);
        for (int j = 0; j < d; ++j) out[j] += p * v[j];
      }
      (*lse)[static_cast<size_t>(i) * qh + h] = top + std::log(sum);
    }
  }
}

struct Fixture {
  std::unique_ptr<Backend> backend = MakeCpuBackend(2);
  std::unique_ptr<KvCache> cache;

  explicit Fixture(const KvLayoutOptions& layout, size_t budget = size_t{8} << 20, bool evict_lru = false,
                   Backend* use = nullptr) {
    CacheOptions o;
    o.layout = layout;
    o.memory_budget_bytes = budget;
    o.evict_lru = evict_lru;
    auto made = KvCache::Create(o, use != nullptr ? use : backend.get());
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) cache = std::move(*made);
  }
  const KvLayout& layout() const { return cache->layout(); }

  // Appends n tokens of keys k and values v ([layers, n, ...]) to every layer.
  absl::Status AppendTokens(const std::string& id, int64_t start, int64_t n, const float* k, const float* v) {
    AppendRequest r;
    r.sequence_id = id;
    r.start_position = start;
    r.layer_begin = 0;
    r.layer_end = layout().num_layers();
    r.num_tokens = n;
    r.keys = k;
    r.values = v;
    return cache->Append(r);
  }

  // Appends n random tokens to every layer, and to `ref` when given.
  absl::Status Append(const std::string& id, int64_t start, int64_t n, uint32_t seed,
                      ReferenceSequence* ref = nullptr) {
    const int layers = layout().num_layers();
    const std::vector<float> k = RandomTensor(layers, n, layout(), seed);
    const std::vector<float> v = RandomTensor(layers, n, layout(), seed + 7777);
    absl::Status status = AppendTokens(id, start, n, k.data(), v.data());
    if (status.ok() && ref != nullptr) ref->Append(0, layers, n, k.data(), v.data());
    return status;
  }

  // Attends every layer with n query tokens (at `first` on when >= 0);
  // mismatches against the windowed reference.
  int CheckAttend(const std::string& id, const ReferenceSequence& ref, int n, uint32_t seed, int64_t first = -1) {
    int bad = 0;
    for (int layer = 0; layer < layout().num_layers(); ++layer) {
      const std::vector<float> q = RandomQueries(n, layout(), seed + layer);
      std::vector<float> out(q.size()), lse(static_cast<size_t>(n) * layout().num_query_heads());
      AttendRequestItem item;
      item.sequence_id = id;
      item.layer = layer;
      item.num_query_tokens = n;
      item.queries = q.data();
      item.output = out.data();
      item.lse = lse.data();
      item.first_query_position = first;
      const absl::Status status = cache->Attend({&item, 1});
      EXPECT_TRUE(status.ok()) << status;
      if (!status.ok()) return 1;
      std::vector<double> want, want_lse;
      WindowedReference(ref, layout(), layer, n, q.data(), layout().layer_window(layer), &want, &want_lse, first);
      const std::string what = id + " layer " + std::to_string(layer);
      // A query token that sees nothing: lse -inf exactly (compared here).
      for (size_t r = 0; r < want_lse.size(); ++r) {
        if (std::isinf(want_lse[r]) || std::isinf(lse[r])) {
          bad += want_lse[r] == lse[r] ? 0 : 1;
          EXPECT_EQ(lse[r], want_lse[r]) << what << " lse[" << r << "]";
          want_lse[r] = 0.0;
          lse[r] = 0.0f;
        }
      }
      bad += CountMismatches(out.data(), want, 1e-4, what + " output");
      bad += CountMismatches(lse.data(), want_lse, 1e-4, what + " lse");
    }
    return bad;
  }

  // One-token appends at [from, to), each followed by CheckAttend; stops at
  // the first failure.
  void DecodeAndCheck(const std::string& id, ReferenceSequence* ref, int64_t from, int64_t to) {
    for (int64_t t = from; t < to; ++t) {
      ASSERT_TRUE(Append(id, t, 1, 10 + t, ref).ok()) << "at " << t;
      ASSERT_EQ(CheckAttend(id, *ref, 1, 200 + t), 0) << "at " << t;
    }
  }
};

TEST(SlidingWindowLayoutTest, GemmaShapeSplitsIntoChunksOfThreeLayersWithNoStrideWaste) {
  KvLayoutOptions o;
  o.num_layers = 18;
  o.num_kv_heads = 1;
  o.num_query_heads = 4;
  o.head_dim = 256;
  o.preset = "turboquant_k3v4_nc";
  o.boundary_layers = 0;
  o.layer_windows.assign(18, 512);
  for (int layer : {5, 11, 17}) o.layer_windows[layer] = 0;
  auto layout = KvLayout::Create(o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const KvLayout& l = **layout;
  ASSERT_EQ(l.num_chunks(), 6);
  EXPECT_EQ(l.chunk_layers(0), (std::vector<int>{5, 11, 17}));
  EXPECT_EQ(l.chunk_window(0), 0);
  std::vector<size_t> bytes;
  for (int c = 0; c < l.num_chunks(); ++c) {
    EXPECT_EQ(l.chunk_layers(c).size(), 3u) << c;
    if (c > 0) {
      EXPECT_EQ(l.chunk_window(c), 512);
    }
    bytes.push_back(l.chunk_bytes(c));
  }
  EXPECT_EQ(ChunkWaste(bytes), 0.0);
  // With fp16 boundary layers (0, 1, 16, 17) the chunks differ in bytes: the
  // waste the chooser settles for, measured.
  KvLayoutOptions mixed = o;
  mixed.boundary_layers = 2;
  auto with_boundary = KvLayout::Create(mixed);
  ASSERT_TRUE(with_boundary.ok()) << with_boundary.status();
  std::vector<size_t> mixed_bytes;
  for (int c = 0; c < (*with_boundary)->num_chunks(); ++c) mixed_bytes.push_back((*with_boundary)->chunk_bytes(c));
  std::printf("gemma-3 shape with 2 fp16 boundary layers: %d chunks, stride waste %.1f%%\n",
              (*with_boundary)->num_chunks(), 100.0 * ChunkWaste(mixed_bytes));
  EXPECT_LT(ChunkWaste(mixed_bytes), 0.5);
  // A page is 16 tokens of 3 layers.
  o.num_layers = 3;
  o.layer_windows.clear();
  EXPECT_EQ(l.page_bytes(), (*KvLayout::Create(o))->page_bytes());
}

TEST(SlidingWindowLayoutTest, WithoutWindowsOneChunkHoldsEveryLayerInOrder) {
  auto layout = KvLayout::Create(testing_util::SmallLayout());
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ((*layout)->num_chunks(), 1);
  EXPECT_EQ((*layout)->chunk_layers(0), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ((*layout)->chunk_bytes(0), (*layout)->page_bytes());
  EXPECT_FALSE((*layout)->has_windows());
  // Planes follow each other layer by layer from offset 0, as docs/format.md says.
  EXPECT_EQ((*layout)->planes(0, 0).key_codes, 0u);
  EXPECT_LE((*layout)->planes(0, 1).value_scalars, (*layout)->planes(1, 0).key_codes);
}

TEST(SlidingWindowLayoutTest, RejectsBadWindows) {
  KvLayoutOptions o = WindowedLayout("fp16");
  o.layer_windows = {kWindow, 0, -1, kWindow};
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.layer_windows = {kWindow, 0};
  EXPECT_EQ(KvLayout::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

class WindowedAttendTest : public ::testing::TestWithParam<std::string> {};

TEST_P(WindowedAttendTest, AttendEqualsFloat64AttentionOverOnlyTheWindow) {
  Fixture f(WindowedLayout(GetParam()));
  ReferenceSequence ref(&f.layout());
  // A prefill, then decode steps (append one token, attend with it).
  ASSERT_TRUE(f.Append("s", 0, 7, 1, &ref).ok());
  EXPECT_EQ(f.CheckAttend("s", ref, 1, 100), 0);
  for (int64_t t = 7; t < 30; ++t) {
    ASSERT_TRUE(f.Append("s", t, 1, 10 + t, &ref).ok());
    ASSERT_EQ(f.CheckAttend("s", ref, 1, 200 + t), 0) << "at " << t;
  }
  // The masked result is not the full-attention one (the test tells them apart).
  const std::vector<float> q = RandomQueries(1, f.layout(), 5);
  std::vector<float> out(q.size());
  AttendRequestItem item{"s", 0, 1, q.data(), out.data(), nullptr};
  ASSERT_TRUE(f.cache->Attend({&item, 1}).ok());
  std::vector<double> full, full_lse;
  WindowedReference(ref, f.layout(), 0, 1, q.data(), 0, &full, &full_lse);
  double diff = 0;
  for (size_t i = 0; i < full.size(); ++i) diff = std::max(diff, std::fabs(full[i] - out[i]));
  EXPECT_GT(diff, 1e-2);
}

TEST_P(WindowedAttendTest, MultiTokenCausalQueriesEachSeeTheirOwnWindow) {
  Fixture f(WindowedLayout(GetParam()));
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 25, 1, &ref).ok());
  // 25 query tokens over 25 tokens: each its own causal window.
  EXPECT_EQ(f.CheckAttend("s", ref, 25, 300), 0);
  // A speculative step of 5 tokens after 25.
  ASSERT_TRUE(f.Append("s", 25, 5, 2, &ref).ok());
  EXPECT_EQ(f.CheckAttend("s", ref, 5, 400), 0);
  EXPECT_EQ(f.CheckAttend("s", ref, 3, 500), 0);
}

TEST_P(WindowedAttendTest, PlacedQueriesSeeTheStoredTokensUpToTheirPosition) {
  Fixture f(WindowedLayout(GetParam()));
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 23, 1, &ref).ok());
  // Positions 20..26: causal inside the stored tokens, then all of them.
  EXPECT_EQ(f.CheckAttend("s", ref, 7, 600, 20), 0);
  // A prefill of 9 new tokens after the 23 stored (none appended): each
  // sees the stored ones in its window; in the windowed layers (10) those
  // at 32 and on see none (output 0, lse -inf).
  EXPECT_EQ(f.CheckAttend("s", ref, 9, 700, 23), 0);
  // Wholly past every window: only the full-attention layer sees tokens.
  EXPECT_EQ(f.CheckAttend("s", ref, 3, 800, 40), 0);
  // Placed where the default puts them: the same result.
  EXPECT_EQ(f.CheckAttend("s", ref, 4, 900, 19), 0);
}

TEST(SlidingWindowTest, PlacedQueriesCheckTheirPositions) {
  Fixture f(WindowedLayout("turboquant_k3v4_nc"));
  ASSERT_TRUE(f.Append("s", 0, 30, 1).ok());
  for (int64_t t = 30; t < 40; ++t) ASSERT_TRUE(f.Append("s", t, 1, 2 + t).ok());
  const std::vector<float> q = RandomQueries(2, f.layout(), 3);
  std::vector<float> out(q.size());
  AttendRequestItem item{"s", 0, 2, q.data(), out.data(), nullptr};
  item.first_query_position = -2;
  EXPECT_EQ(f.cache->Attend({&item, 1}).code(), absl::StatusCode::kInvalidArgument);
  item.first_query_position = kMaxQueryPosition - 1;
  EXPECT_EQ(f.cache->Attend({&item, 1}).code(), absl::StatusCode::kInvalidArgument);
  // Layer 0 (window 10) holds only its last tokens: position 5 reads below.
  item.first_query_position = 5;
  EXPECT_EQ(f.cache->Attend({&item, 1}).code(), absl::StatusCode::kOutOfRange);
  item.layer = 1;  // full attention: every token is held
  EXPECT_TRUE(f.cache->Attend({&item, 1}).ok());
  item.sequence_id = "empty";
  ASSERT_TRUE(f.cache->CreateSequence("empty").ok());
  EXPECT_EQ(f.cache->Attend({&item, 1}).code(), absl::StatusCode::kInvalidArgument);
}

// fp16 (exact-ish), two compressed presets on the fast kernels, and fp8 on
// the reference path.
INSTANTIATE_TEST_SUITE_P(Presets, WindowedAttendTest,
                         ::testing::Values("fp16", "turboquant_k3v4_nc", "tqkv_k3v3", "fp8"));

TEST(SlidingWindowTest, ExactSinkAndRecentTokensStillMatchInsideTheWindow) {
  KvLayoutOptions o = WindowedLayout("fp16");
  o.page_tokens = 8;
  o.exact_sink_tokens = 2;
  o.exact_recent_tokens = 4;
  Fixture f(o);
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 6, 1, &ref).ok());
  f.DecodeAndCheck("s", &ref, 6, 40);
  // The windowed chunks gave their sink pages back; the full layer kept them.
  auto info = f.cache->GetSequence("s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_held_begin, (std::vector<int64_t>{30, 0, 30, 30}));
  ASSERT_TRUE(f.cache->Drop("s").ok());
  EXPECT_EQ(f.cache->Stats().pages_used, 0);
}

// Sliding windows (10 tokens) inside the exact recent tokens (6 sinks, 23
// recent tokens, pages of 16): a windowed layer's rows see no compressed token,
// yet the kernels' blocks start below the window, beside the sinks' codes.
TEST(SlidingWindowTest, WindowsInsideTheExactRecentTokensReadOnlyExactTokens) {
  KvLayoutOptions o = WindowedLayout("fp16");
  o.page_tokens = 16;
  o.exact_sink_tokens = 6;
  o.exact_recent_tokens = 23;
  Fixture f(o);
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 8, 1, &ref).ok());
  f.DecodeAndCheck("s", &ref, 8, 72);
}

TEST(SlidingWindowTest, ReadsBelowTheOldestTokenHeldAreOutOfRange) {
  Fixture f(WindowedLayout("fp16"));
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 20, 1, &ref).ok());
  ASSERT_TRUE(f.Append("s", 20, 3, 2, &ref).ok());
  // The last append started at 20: its queries see from 11 on.
  const std::vector<float> q = RandomQueries(1, f.layout(), 3);
  std::vector<float> logits(static_cast<size_t>(f.layout().num_query_heads()) * 23);
  absl::Status status = f.cache->Score("s", 0, 0, -1, q.data(), logits.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
  EXPECT_NE(status.message().find("oldest token held is 11"), std::string::npos) << status;
  EXPECT_EQ(f.cache->Score("s", 0, 10, 23, q.data(), logits.data()).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(f.cache->Score("s", 0, 11, 23, q.data(), logits.data()).ok());
  EXPECT_EQ(CountMismatches(logits.data(), ref.Score(0, 11, 23, q.data()), 1e-4, "logits"), 0);
  // The full-attention layer keeps everything.
  ASSERT_TRUE(f.cache->Score("s", 1, 0, -1, q.data(), logits.data()).ok());
  EXPECT_EQ(CountMismatches(logits.data(), ref.Score(1, 0, 23, q.data()), 1e-4, "full logits"), 0);

  // Attend with as many query tokens as the last append had is fine, more is not.
  EXPECT_EQ(f.CheckAttend("s", ref, 3, 10), 0);
  const std::vector<float> q4 = RandomQueries(4, f.layout(), 4);
  std::vector<float> out(q4.size());
  AttendRequestItem item{"s", 2, 4, q4.data(), out.data(), nullptr};
  status = f.cache->Attend({&item, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << status;
  EXPECT_NE(status.message().find("oldest token held is 11"), std::string::npos) << status;
  item.layer = 1;  // full attention: fine
  EXPECT_TRUE(f.cache->Attend({&item, 1}).ok());
}

TEST(SlidingWindowTest, AppendsGiveBackPagesOlderThanTheirQueriesSee) {
  Fixture f(WindowedLayout("tqkv_k3v3"));
  const KvLayout& l = f.layout();
  ASSERT_EQ(l.num_chunks(), 4);  // equal layers: one per chunk, no waste
  ASSERT_TRUE(f.Append("s", 0, 30, 1).ok());
  // A prefill keeps everything its queries see: all 30 tokens.
  auto info = f.cache->GetSequence("s");
  EXPECT_EQ(info->pages, 4 * 8);
  for (int64_t t = 30; t < 60; ++t) ASSERT_TRUE(f.Append("s", t, 1, 100 + t).ok());
  info = f.cache->GetSequence("s");
  // Windowed layers hold [50, 60): pages 12..14; the full layer 15 pages.
  EXPECT_EQ(info->layer_held_begin, (std::vector<int64_t>{50, 0, 50, 50}));
  EXPECT_EQ(info->pages, 3 * 3 + 15);
  EXPECT_EQ(f.cache->Stats().pages_used, 3 * 3 + 15);
  uint64_t want = 0;
  for (int layer = 0; layer < 4; ++layer) want += l.layer_bytes(layer, 60, layer == 1 ? 0 : 50);
  EXPECT_EQ(info->stored_bytes, want);
  EXPECT_EQ(f.cache->Stats().stored_bytes, want);
  EXPECT_EQ(f.cache->Stats().stored_bytes_bf16, (3 * 10 + 60) * l.token_bytes_bf16());
}

// A cache of windowed layers only holds about the window whatever the
// length: a sequence may run far past what the pool could hold in full.
TEST(SlidingWindowTest, AllWindowedLayersRunPastThePoolsFullCapacity) {
  KvLayoutOptions o = WindowedLayout("tqkv_k3v3");
  o.layer_windows = {kWindow, kWindow, kWindow, kWindow};
  Fixture probe(o);
  const size_t page = probe.layout().page_bytes();
  // 8 pages in each of the 4 chunks' pools at most: 32 pages, 128 positions.
  Fixture f(o, 32 * page);
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("long", 0, 8, 1, &ref).ok());
  for (int64_t t = 8; t < 400; ++t) {
    const absl::Status s = f.Append("long", t, 1, 10 + static_cast<uint32_t>(t), &ref);
    ASSERT_TRUE(s.ok()) << "token " << t << ": " << s;
  }
  EXPECT_EQ(f.CheckAttend("long", ref, 1, 77), 0);
  EXPECT_LE(f.cache->Stats().pages_used, 4 * 4);  // each layer about its window
  // A layer that keeps every token is still bounded by the pool.
  KvLayoutOptions mixed = WindowedLayout("tqkv_k3v3");  // layer 1 keeps everything
  Fixture g(mixed, 32 * page);
  EXPECT_EQ(g.Append("long", 0, 400, 2).code(), absl::StatusCode::kResourceExhausted);
}

// Gemma 3 270M's shape: 18 layers, 1 KV head, 4 query heads, head_dim 256,
// window 512, global layers 5, 11, 17; 8k tokens prefilled in chunks of 512
// then 64 decode steps.
TEST(SlidingWindowTest, GemmaShapeHoldsAboutTheWindowInWindowedLayers) {
  KvLayoutOptions o;
  o.num_layers = 18;
  o.num_kv_heads = 1;
  o.num_query_heads = 4;
  o.head_dim = 256;
  o.page_tokens = 16;
  o.preset = "turboquant_k3v4_nc";
  o.boundary_layers = 0;
  o.layer_windows.assign(18, 512);
  for (int layer : {5, 11, 17}) o.layer_windows[layer] = 0;
  Fixture f(o, size_t{64} << 20);
  const KvLayout& l = f.layout();
  int64_t length = 0;
  for (; length < 8192; length += 512) ASSERT_TRUE(f.Append("g", length, 512, 1 + length).ok());
  for (int i = 0; i < 64; ++i, ++length) ASSERT_TRUE(f.Append("g", length, 1, 9000 + i).ok());
  ASSERT_EQ(length, 8256);
  auto info = f.cache->GetSequence("g");
  ASSERT_TRUE(info.ok());
  // Windowed layers hold [length - 512, length): 7744 = page 484, 32 pages
  // each of 5 chunks; the global chunk 516 pages.
  EXPECT_EQ(info->layer_held_begin[0], length - 512);
  EXPECT_EQ(info->pages, 5 * 32 + 516);
  EXPECT_EQ(f.cache->Stats().pages_used, 5 * 32 + 516);
  const uint64_t bytes = info->stored_bytes;
  uint64_t want = 0;
  for (int layer = 0; layer < 18; ++layer) {
    want += l.layer_bytes(layer, length, l.layer_window(layer) > 0 ? length - 512 : 0);
  }
  EXPECT_EQ(bytes, want);
  EXPECT_EQ(bytes, 15 * 512 * l.token_bytes(0) + 3 * length * l.token_bytes(5) + 18 * sizeof(float) * l.mean_floats());
  const uint64_t full = 18 * length * l.token_bytes(0);
  const uint64_t bf16 = 18 * length * l.token_bytes_bf16();
  const uint64_t pool = static_cast<uint64_t>(info->pages) * l.page_bytes();
  std::printf(
      "gemma-3 shape at %lld tokens: %llu bytes stored (%llu in pages) vs %llu all-full-attention "
      "(%.2fx) vs %llu bf16 (%.2fx)\n",
      static_cast<long long>(length), static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(pool),
      static_cast<unsigned long long>(full), static_cast<double>(full) / bytes, static_cast<unsigned long long>(bf16),
      static_cast<double>(bf16) / bytes);
  // Attention still reads the window (the decode step's query).
  const std::vector<float> q = RandomQueries(1, l, 3);
  std::vector<float> out(q.size());
  for (int layer : {0, 5}) {
    AttendRequestItem item{"g", layer, 1, q.data(), out.data(), nullptr};
    ASSERT_TRUE(f.cache->Attend({&item, 1}).ok());
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(SlidingWindowTest, ForksShareWindowedPagesAndAppendCopyOnWrite) {
  Fixture f(WindowedLayout("turboquant_k3v4_nc"));
  ReferenceSequence parent(&f.layout());
  ASSERT_TRUE(f.Append("p", 0, 14, 1, &parent).ok());  // page 3 half full
  for (int64_t t = 14; t < 22; ++t) ASSERT_TRUE(f.Append("p", t, 1, 10 + t, &parent).ok());
  const int32_t used = f.cache->Stats().pages_used;
  ASSERT_TRUE(f.cache->Fork("p", "c").ok());
  EXPECT_EQ(f.cache->Stats().pages_used, used);  // shared
  ReferenceSequence child = parent;
  for (int64_t t = 22; t < 40; ++t) {
    ASSERT_TRUE(f.Append("c", t, 1, 500 + t, &child).ok());
    if (t < 30) {
      ASSERT_TRUE(f.Append("p", t, 1, 900 + t, &parent).ok());
    }
  }
  EXPECT_GT(f.cache->Stats().copy_on_writes, 0u);
  EXPECT_EQ(f.CheckAttend("p", parent, 1, 1), 0);
  EXPECT_EQ(f.CheckAttend("c", child, 1, 2), 0);
  ASSERT_TRUE(f.cache->Drop("p").ok());
  EXPECT_EQ(f.CheckAttend("c", child, 1, 3), 0);
  // The child alone: windowed chunks hold [30, 40) (3 pages each), the full one 10.
  EXPECT_EQ(f.cache->Stats().pages_used, 3 * 3 + 10);
  ASSERT_TRUE(f.cache->Drop("c").ok());
  EXPECT_EQ(f.cache->Stats().pages_used, 0);
}

TEST(SlidingWindowTest, LruEvictionDropsWindowedSequencesAndFreesEveryPage) {
  const KvLayoutOptions o = WindowedLayout("tqkv_k3v3");
  const size_t page = testing_util::PageBytes(o);
  Fixture f(o, page * 40, /*evict_lru=*/true);
  // Each sequence: 20 tokens, then 10 decode steps: 3 x 3 + 8 = 17 pages.
  for (int s = 0; s < 5; ++s) {
    const std::string id = "s" + std::to_string(s);
    ASSERT_TRUE(f.Append(id, 0, 20, s).ok()) << id;
    for (int64_t t = 20; t < 30; ++t) ASSERT_TRUE(f.Append(id, t, 1, 100 * s + t).ok()) << id << " " << t;
  }
  const CacheStats stats = f.cache->Stats();
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_LE(stats.pages_used, 40);
  int32_t held = 0;
  for (const std::string& id : f.cache->ListSequences()) held += f.cache->GetSequence(id)->pages;
  EXPECT_EQ(held, stats.pages_used);
  for (const std::string& id : f.cache->ListSequences()) ASSERT_TRUE(f.cache->Drop(id).ok());
  EXPECT_EQ(f.cache->Stats().pages_used, 0);
  EXPECT_EQ(f.cache->Stats().stored_bytes, 0u);
}

TEST(SlidingWindowTest, AFailedAppendChangesNothing) {
  const KvLayoutOptions o = WindowedLayout("tqkv_k3v3");
  Fixture f(o, testing_util::PageBytes(o) * 30);
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 20, 1, &ref).ok());  // 4 x 5 pages
  for (int64_t t = 20; t < 26; ++t) ASSERT_TRUE(f.Append("s", t, 1, 10 + t, &ref).ok());
  const CacheStats before = f.cache->Stats();
  const SequenceInfo info = *f.cache->GetSequence("s");
  // 24 tokens at once need 4 x 6 fresh pages (and would give back none).
  absl::Status status = f.Append("s", 26, 24, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  const CacheStats after = f.cache->Stats();
  EXPECT_EQ(after.pages_used, before.pages_used);
  EXPECT_EQ(after.stored_bytes, before.stored_bytes);
  EXPECT_EQ(after.tokens, before.tokens);
  const SequenceInfo now = *f.cache->GetSequence("s");
  EXPECT_EQ(now.layer_tokens, info.layer_tokens);
  EXPECT_EQ(now.layer_held_begin, info.layer_held_begin);
  EXPECT_EQ(now.pages, info.pages);
  EXPECT_EQ(now.stored_bytes, info.stored_bytes);
  EXPECT_EQ(f.CheckAttend("s", ref, 1, 7), 0);
  // A non-finite value fails too, and changes nothing either.
  std::vector<float> k = RandomTensor(4, 1, f.layout(), 3), v = k;
  v.back() = NAN;
  EXPECT_EQ(f.AppendTokens("s", 26, 1, k.data(), v.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.cache->Stats().pages_used, before.pages_used);
  EXPECT_EQ(f.CheckAttend("s", ref, 1, 8), 0);
}

TEST(SlidingWindowTest, PinsKeepGivenBackPagesAliveForReadsInFlight) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(2);
  GatedBackend gated(cpu.get());
  const KvLayoutOptions o = WindowedLayout("fp16");
  const size_t page = testing_util::PageBytes(o);
  Fixture f(o, page * 64, false, &gated);
  ReferenceSequence ref(&f.layout());
  ASSERT_TRUE(f.Append("s", 0, 16, 1, &ref).ok());
  for (int64_t t = 16; t < 20; ++t) ASSERT_TRUE(f.Append("s", t, 1, 10 + t, &ref).ok());
  // The read's expected result, from what is stored now.
  const std::vector<float> q = RandomQueries(1, f.layout(), 42);
  std::vector<double> want, want_lse;
  WindowedReference(ref, f.layout(), 0, 1, q.data(), kWindow, &want, &want_lse);
  std::vector<float> out(q.size());
  gated.ArmAttendGate();
  absl::Status read;
  std::thread reader([&] {
    AttendRequestItem item{"s", 0, 1, q.data(), out.data(), nullptr};
    read = f.cache->Attend({&item, 1});
  });
  ASSERT_TRUE(gated.WaitUntilAttendEntered());
  const int32_t before = f.cache->Stats().pages_used;
  // Slide the window well past what the read holds: its pages are given back
  // (but pinned), then fill the pool with another sequence's tokens.
  for (int64_t t = 20; t < 44; ++t) ASSERT_TRUE(f.Append("s", t, 1, 100 + t).ok());
  for (int64_t t = 0;; t += 4) {
    if (!f.Append("filler", t, 4, 1000 + t).ok()) break;
  }
  gated.ReleaseAttend();
  reader.join();
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(CountMismatches(out.data(), want, 1e-4, "in-flight output"), 0);
  // Unpinned now: the given-back pages are free again.
  const int32_t free_after = f.cache->Stats().pages_total - f.cache->Stats().pages_used;
  EXPECT_GT(free_after, 0);
  (void)before;
  ASSERT_TRUE(f.cache->Drop("s").ok());
  ASSERT_TRUE(f.cache->Drop("filler").ok());
  EXPECT_EQ(f.cache->Stats().pages_used, 0);
}

}  // namespace
}  // namespace tqkv
