// The round-trip property: every state a sequence can reach survives being
// moved (export and import) and a snapshot with a restart, bit for bit, with
// the same sharing and the same byte accounting, and grows afterwards
// exactly as it would have without the move.
//
// A run draws a random layout the cache accepts (RandomLayout: presets,
// boundary and per-layer presets, centering, per-layer RoPEs, key scales
// (the cache's or each sequence's own),
// exact sinks and recent tokens, sliding-window layers, page sizes) and drives two Targets of it in
// lockstep with random operations (appends of 1..n tokens to every layer or
// to a prefix of the layers, decode steps layer by layer, retried appends,
// appends at a wrong position, creates, forks, drops, reads; evictions when
// the pool is small and evicts). At random points the second target is moved
// or restarted (its whole contents through an export stream or a snapshot);
// then both must hold the same sequences with the same lengths, the same
// pages, the same bytes, and answer Attend and Score with the same bits; and
// every later operation must answer the same on both.
//
// Evictions are the one allowed difference: a moved cache's LRU order is not
// the source's (an import touches its sequences in stream order), so with
// eviction on, a sequence one target evicted is dropped from the other too,
// and an operation the two answer differently drops its sequence from both.
//
// Targets: CacheTarget here (a KvCache in process, moved through
// ExportSharing / ImportSharing); the service suite adds a real server moved
// through ExportSequences / ImportSequences / PullSequences and restarted
// from its snapshot.
#ifndef TQKV_TESTS_CACHE_ROUND_TRIP_PROPERTY_H_
#define TQKV_TESTS_CACHE_ROUND_TRIP_PROPERTY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/kv_layout.h"
#include "base/status_macros.h"

namespace tqkv {
namespace round_trip {

// A random layout a cache accepts, small enough for a test: 2..5 layers,
// 1..2 KV heads, head dim 32 or 64, 1..16 tokens per page.
inline KvLayoutOptions RandomLayout(std::mt19937_64& rng) {
  const auto pick = [&rng](int lo, int hi) { return lo + static_cast<int>(rng() % (hi - lo + 1)); };
  const std::vector<std::string> presets = {"tqkv_k3v4u_csw",
                                            "turboquant_3bit_nc",
                                            "turboquant_4bit_nc",
                                            "turboquant_k3v4_nc",
                                            "turboquant_k8v4",
                                            "tqkv_k3v3",
                                            "tqkv_k4v4",
                                            "fp8",
                                            "fp16",
                                            "tqkv_k3v3u_csw"};
  KvLayoutOptions o;
  o.num_layers = pick(2, 5);
  o.num_kv_heads = pick(1, 2);
  o.num_query_heads = o.num_kv_heads * pick(1, 3);
  o.head_dim = rng() % 2 ? 32 : 64;
  o.page_tokens = std::vector<int>{1, 2, 3, 4, 8, 16}[rng() % 6];
  o.preset = presets[rng() % presets.size()];
  o.boundary_layers = pick(0, o.num_layers / 2);
  o.boundary_preset = rng() % 2 ? "fp16" : "turboquant_4bit_nc";
  if (rng() % 4 == 0) {  // protected layers by name
    o.layer_presets.assign(o.num_layers, "");
    o.layer_presets[rng() % o.num_layers] = presets[rng() % presets.size()];
  }
  o.rope.base = 10000.0;
  if (rng() % 2 == 0) {  // centering and exact tokens of one's own choosing
    o.key_centering = static_cast<KeyCentering>(rng() % 3);
    o.exact_sink_tokens = pick(0, 6);
    o.exact_recent_tokens = rng() % 3 == 0 ? 0 : pick(1, 24);
    o.centering_tokens = pick(1, 16);
  }
  if (rng() % 3 == 0) {  // some layers rotated with a RoPE of their own (layer_ropes)
    o.layer_ropes.assign(o.num_layers, RopeOptions());
    for (RopeOptions& r : o.layer_ropes) {
      if (rng() % 2 == 0) continue;
      r.base = std::vector<double>{500.0, 1e4, 1e6}[rng() % 3];
      r.pair_layout = rng() % 2 ? RopePairLayout::kHalfSplit : RopePairLayout::kInterleaved;
    }
  }
  if (rng() % 4 == 0) {  // per-channel key scales (refused without centering: drawn again)
    o.key_scales.resize(static_cast<size_t>(o.num_layers) * o.num_kv_heads * o.head_dim);
    for (float& s : o.key_scales) s = std::exp2(static_cast<float>(pick(-8, 8)) / 8.0f);
  } else if (rng() % 3 == 0) {  // scales each sequence measures (refused without centering: drawn again)
    o.sequence_key_scales = true;
  }
  if (rng() % 2 == 0) {  // sliding-window layers, some shorter than the exact recent tokens
    o.layer_windows.assign(o.num_layers, 0);
    for (int& w : o.layer_windows) w = rng() % 2 ? 0 : pick(1, 40);
  }
  return o;
}

// A cache of a random layout (RandomLayout, drawn again until KvLayout
// accepts it) with a pool of 24..323 pages, evicting (LRU) one time in three.
inline CacheOptions RandomCacheOptions(std::mt19937_64& rng, std::shared_ptr<const KvLayout>* layout) {
  CacheOptions options;
  *layout = nullptr;
  while (*layout == nullptr) {
    options.layout = RandomLayout(rng);
    absl::StatusOr<std::shared_ptr<const KvLayout>> created = KvLayout::Create(options.layout);
    if (created.ok()) *layout = *std::move(created);
  }
  options.evict_lru = rng() % 3 == 0;
  options.memory_budget_bytes = (*layout)->page_bytes() * (24 + rng() % 300);
  return options;
}

// What one read answered: its status code and its output bytes.
struct ReadResult {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string bytes;
  bool operator==(const ReadResult& o) const { return code == o.code && bytes == o.bytes; }
};

// A cache's totals as a target reports them.
struct Usage {
  int64_t pages_used = 0, sequences = 0, tokens = 0;
  uint64_t stored_bytes = 0, stored_bytes_bf16 = 0;
  bool operator==(const Usage& o) const {
    return pages_used == o.pages_used && sequences == o.sequences && tokens == o.tokens &&
           stored_bytes == o.stored_bytes && stored_bytes_bf16 == o.stored_bytes_bf16;
  }
  std::string ToString() const {
    return absl::StrCat("pages ", pages_used, ", sequences ", sequences, ", tokens ", tokens, ", bytes ", stored_bytes,
                        ", bf16 bytes ", stored_bytes_bf16);
  }
};

// One append: tokens [start, start + n) of layers [layer_begin, layer_end).
struct AppendCall {
  std::string id;
  int64_t start = 0;
  int layer_begin = 0, layer_end = 0;
  int64_t n = 0;
  std::vector<float> keys, values;  // [layers, n, kv_heads, head_dim]
  std::string request_id;
};

// One item of a decode layer: append one token to `layer` and attend.
struct DecodeItem {
  std::string id;
  int64_t start = 0;
  std::vector<float> key, value, query;  // [1, kv_heads, head_dim], [1, query_heads, head_dim]
};

// A cache, in process or behind a server. Every call answers what the cache
// answered (status and results); Move and Restart replace what the target
// serves with its own contents moved.
class Target {
 public:
  virtual ~Target() = default;
  virtual absl::StatusOr<bool> Append(const AppendCall& call) = 0;  // already_stored
  // Per item in order: the append's status, or the attention's bytes.
  virtual std::vector<ReadResult> DecodeLayer(int layer, const std::vector<DecodeItem>& items) = 0;
  virtual absl::Status Create(const std::string& id) = 0;
  virtual absl::Status Fork(const std::string& parent, const std::string& child) = 0;
  virtual absl::Status Drop(const std::string& id) = 0;
  virtual absl::StatusOr<SequenceInfo> Get(const std::string& id) = 0;
  virtual std::vector<std::string> List() = 0;
  virtual ReadResult Attend(const std::string& id, int layer, int query_tokens, const std::vector<float>& q) = 0;
  virtual ReadResult Score(const std::string& id, int layer, int64_t begin, int64_t end,
                           const std::vector<float>& q) = 0;
  virtual Usage GetUsage() = 0;
  // Every sequence moved into a fresh cache of the same layout, which
  // serves from then on.
  virtual absl::Status Move() = 0;
  // What a restart keeps (a snapshot), brought back.
  virtual absl::Status Restart() = 0;
};

inline std::string FloatBytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// A KvCache in process on `backend`. Move and Restart both export every
// sequence with one ExportSharing and import it with one ImportSharing.
class CacheTarget : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<CacheTarget>> Create(const CacheOptions& options, Backend* backend) {
    std::unique_ptr<CacheTarget> t(new CacheTarget(options, backend));
    ASSIGN_OR_RETURN(t->cache_, KvCache::Create(options, backend));
    return t;
  }
  KvCache& cache() { return *cache_; }

  absl::StatusOr<bool> Append(const AppendCall& c) override {
    AppendRequest r;
    r.sequence_id = c.id;
    r.start_position = c.start;
    r.layer_begin = c.layer_begin;
    r.layer_end = c.layer_end;
    r.num_tokens = c.n;
    r.keys = c.keys.data();
    r.values = c.values.data();
    r.request_id = c.request_id;
    AppendOutcome outcome;
    RETURN_IF_ERROR(cache_->Append(r, &outcome));
    return outcome.already_stored;
  }
  // One KvCache::AppendAttend for the layer, as the server runs it.
  std::vector<ReadResult> DecodeLayer(int layer, const std::vector<DecodeItem>& items) override {
    const KvLayout& layout = cache_->layout();
    std::vector<AppendRequest> appends(items.size());
    std::vector<AttendRequestItem> attends(items.size());
    std::vector<std::vector<float>> outputs(items.size()), lses(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      AppendRequest& r = appends[i];
      r.sequence_id = items[i].id;
      r.start_position = items[i].start;
      r.layer_begin = layer;
      r.layer_end = layer + 1;
      r.num_tokens = 1;
      r.keys = items[i].key.data();
      r.values = items[i].value.data();
      r.landed_is_stored = true;
      outputs[i].resize(items[i].query.size());
      lses[i].resize(layout.num_query_heads());
      attends[i] = {items[i].id, layer, 1, items[i].query.data(), outputs[i].data(), lses[i].data()};
    }
    std::vector<absl::Status> statuses(items.size());
    std::vector<AppendOutcome> outcomes(items.size());
    cache_->AppendAttend(appends, attends, 0.0f, absl::MakeSpan(statuses), absl::MakeSpan(outcomes));
    std::vector<ReadResult> out;
    for (size_t i = 0; i < items.size(); ++i) {
      out.push_back(statuses[i].ok() ? ReadResult{statuses[i].code(), FloatBytes(outputs[i]) + FloatBytes(lses[i])}
                                     : ReadResult{statuses[i].code(), ""});
    }
    return out;
  }
  absl::Status Create(const std::string& id) override { return cache_->CreateSequence(id); }
  absl::Status Fork(const std::string& parent, const std::string& child) override {
    return cache_->Fork(parent, child);
  }
  absl::Status Drop(const std::string& id) override { return cache_->Drop(id); }
  absl::StatusOr<SequenceInfo> Get(const std::string& id) override {
    ASSIGN_OR_RETURN(SequenceInfo info, cache_->GetSequence(id));
    info.last_access = absl::InfinitePast();  // differs after a move, by design
    return info;
  }
  std::vector<std::string> List() override { return cache_->ListSequences(); }
  ReadResult Attend(const std::string& id, int layer, int query_tokens, const std::vector<float>& q) override {
    const KvLayout& layout = cache_->layout();
    std::vector<float> out(q.size()), lse(static_cast<size_t>(query_tokens) * layout.num_query_heads());
    AttendRequestItem item{id, layer, query_tokens, q.data(), out.data(), lse.data()};
    const absl::Status s = cache_->Attend({item});
    return s.ok() ? ReadResult{s.code(), FloatBytes(out) + FloatBytes(lse)} : ReadResult{s.code(), ""};
  }
  ReadResult Score(const std::string& id, int layer, int64_t begin, int64_t end, const std::vector<float>& q) override {
    std::vector<float> logits(static_cast<size_t>(std::max<int64_t>(0, end - begin)) *
                              cache_->layout().num_query_heads());
    const absl::Status s = cache_->Score(id, layer, begin, end, q.data(), logits.data());
    return s.ok() ? ReadResult{s.code(), FloatBytes(logits)} : ReadResult{s.code(), ""};
  }
  Usage GetUsage() override {
    const CacheStats s = cache_->Stats();
    return Usage{s.pages_used, s.sequences, s.tokens, s.stored_bytes, s.stored_bytes_bf16};
  }
  absl::Status Move() override {
    ASSIGN_OR_RETURN(std::unique_ptr<KvCache> fresh, KvCache::Create(options_, backend_));
    {
      ExportSharing out(cache_.get());
      ImportSharing in(fresh.get());
      for (const std::string& id : cache_->ListSequences()) RETURN_IF_ERROR(MoveOne(id, &out, *fresh, &in));
    }
    cache_ = std::move(fresh);
    return absl::OkStatus();
  }
  absl::Status Restart() override { return Move(); }

 private:
  CacheTarget(const CacheOptions& options, Backend* backend) : options_(options), backend_(backend) {}

  absl::Status MoveOne(const std::string& id, ExportSharing* out, KvCache& to, ImportSharing* in) {
    ASSIGN_OR_RETURN(std::unique_ptr<SequenceExport> e, cache_->BeginExport(id, out));
    std::vector<uint8_t> pages(static_cast<size_t>(e->state().carried_pages()) * cache_->layout().page_bytes());
    RETURN_IF_ERROR(e->ReadPages(0, e->state().carried_pages(), pages.data()));
    ASSIGN_OR_RETURN(std::unique_ptr<SequenceImport> import, to.BeginImport(e->state(), nullptr, in));
    RETURN_IF_ERROR(import->WritePages(0, import->num_pages(), pages.data()));
    return import->Commit();
  }

  const CacheOptions options_;
  Backend* const backend_;
  std::unique_ptr<KvCache> cache_;
};

// Drives two targets of one layout in lockstep; see the file comment.
class Lockstep {
 public:
  // `evicts`: the targets' caches evict (LRU), so evictions may differ.
  Lockstep(const KvLayout& layout, Target* a, Target* b, uint64_t seed, bool evicts)
      : layout_(layout), a_(a), b_(b), rng_(seed), evicts_(evicts) {}

  // Runs `steps` random operations; false (with a test failure that lists
  // the last operations) at the first difference.
  bool Run(int steps) {
    for (int step = 0; step < steps && ok_; ++step) Step();
    if (ok_) Compare("the end");
    return ok_;
  }
  int round_trips() const { return round_trips_; }
  // Appends both targets stored, and appends tried.
  int appends_stored() const { return appends_stored_; }
  int appends() const { return appends_; }

 private:
  void Log(const std::string& line) {
    log_.push_back(line);
    if (log_.size() > 40) log_.pop_front();
  }
  void Fail(const std::string& what) {
    if (!ok_) return;
    ok_ = false;
    ADD_FAILURE() << what << "\nlast operations:\n  " << absl::StrJoin(log_, "\n  ");
  }
  int Pick(int lo, int hi) { return lo + static_cast<int>(rng_() % (hi - lo + 1)); }
  std::vector<float> Floats(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng_) + 0.25f * scale;  // an offset for centering to remove
    return v;
  }
  size_t RowFloats() const { return static_cast<size_t>(layout_.num_kv_heads()) * layout_.head_dim(); }
  std::vector<float> Queries(int tokens) {
    return Floats(static_cast<size_t>(tokens) * layout_.num_query_heads() * layout_.head_dim());
  }

  // A live sequence id (of target a), or "" when none.
  std::string AnyId() {
    const std::vector<std::string> ids = a_->List();
    return ids.empty() ? "" : ids[rng_() % ids.size()];
  }
  std::string NewId() { return absl::StrCat("s", next_id_++); }

  void Step() {
    const int kind = Pick(0, 99);
    if (kind < 22) {
      AppendTokens();
    } else if (kind < 50) {
      DecodeStep();
    } else if (kind < 57) {
      RetriedAppend();
    } else if (kind < 60) {
      MisplacedAppend();
    } else if (kind < 70) {
      ForkOne();
    } else if (kind < 79) {
      DropOne();
    } else if (kind < 81) {
      CreateOne();
    } else if (kind < 89) {
      ReadOne();
    } else {
      RoundTrip();
    }
    if (ok_ && evicts_) Reconcile();
  }

  // Compares two answers to one operation on `id`: with eviction, a
  // difference drops the sequence from both.
  template <typename T>
  void Same(const T& x, const T& y, const std::string& id, const std::string& what) {
    if (x == y) return;
    if (evicts_) {
      Log(absl::StrCat("  answers differ (evictions): dropping ", id));
      (void)a_->Drop(id);
      (void)b_->Drop(id);
      return;
    }
    Fail(absl::StrCat(what, " answered differently"));
  }
  void SameStatus(const absl::Status& x, const absl::Status& y, const std::string& id, const std::string& what) {
    Same(x.code(), y.code(), id, absl::StrCat(what, " (", x.ToString(), " vs ", y.ToString(), ")"));
  }

  // The layer lengths of `id` on target a (empty when it has none).
  std::vector<int64_t> Lengths(const std::string& id) {
    absl::StatusOr<SequenceInfo> info = a_->Get(id);
    return info.ok() ? info->layer_tokens : std::vector<int64_t>();
  }

  AppendCall MakeAppend(const std::string& id, int64_t start, int begin, int end, int64_t n) {
    const size_t floats = static_cast<size_t>(end - begin) * n * RowFloats();
    return AppendCall{id, start, begin, end, n, Floats(floats, 2.0f), Floats(floats), ""};
  }
  void Apply(const AppendCall& c) {
    Log(absl::StrCat("append ", c.id, " [", c.start, ", ", c.start + c.n, ") layers [", c.layer_begin, ", ",
                     c.layer_end, ")", c.request_id.empty() ? "" : " id " + c.request_id));
    absl::StatusOr<bool> x = a_->Append(c), y = b_->Append(c);
    ++appends_;
    appends_stored_ += x.ok() && y.ok();
    SameStatus(x.status(), y.status(), c.id, "append");
    if (x.ok() && y.ok()) Same(*x, *y, c.id, "append's already_stored");
  }

  // Tokens for every layer (or a prefix of the layers, as a prefill that
  // streams layer by layer), to a new or an existing sequence.
  void AppendTokens() {
    std::string id = rng_() % 3 == 0 ? NewId() : AnyId();
    if (id.empty()) id = NewId();
    std::vector<int64_t> lengths = Lengths(id);
    if (lengths.empty()) lengths.assign(layout_.num_layers(), 0);
    // The layers at the shortest length, from the first of them on.
    const int64_t start = *std::min_element(lengths.begin(), lengths.end());
    int begin = 0;
    while (lengths[begin] != start) ++begin;
    int end = begin + 1;
    while (end < layout_.num_layers() && lengths[end] == start) ++end;
    if (end - begin > 1 && rng_() % 4 == 0) end = Pick(begin + 1, end - 1);
    const int64_t n = rng_() % 5 == 0 ? Pick(20, 90) : Pick(1, 3 * layout_.page_tokens() + 2);
    Apply(MakeAppend(id, start, begin, end, n));
  }

  // One decode step of 1..3 sequences: each layer in order, one token each,
  // attending as it goes.
  void DecodeStep() {
    std::vector<std::string> ids;
    for (int i = Pick(1, 3); i > 0; --i) {
      const std::string id = AnyId();
      if (!id.empty() && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    }
    if (ids.empty()) return;
    Log(absl::StrCat("decode step of ", absl::StrJoin(ids, ", ")));
    std::vector<std::vector<int64_t>> lengths;
    for (const std::string& id : ids) lengths.push_back(Lengths(id));
    for (int layer = 0; layer < layout_.num_layers() && ok_; ++layer) {
      std::vector<DecodeItem> items;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (lengths[i].empty()) continue;
        items.push_back({ids[i], lengths[i][layer], Floats(RowFloats(), 2.0f), Floats(RowFloats()), Queries(1)});
      }
      if (items.empty()) return;
      const std::vector<ReadResult> x = a_->DecodeLayer(layer, items), y = b_->DecodeLayer(layer, items);
      for (size_t i = 0; i < items.size() && ok_; ++i) {
        Same(x[i], y[i], items[i].id, absl::StrCat("decode of ", items[i].id, " in layer ", layer));
      }
    }
  }

  // An append with a request id, then the same again (already stored).
  void RetriedAppend() {
    const std::string id = AnyId();
    const std::vector<int64_t> lengths = Lengths(id);
    if (lengths.empty() ||
        *std::min_element(lengths.begin(), lengths.end()) != *std::max_element(lengths.begin(), lengths.end())) {
      return;
    }
    AppendCall c = MakeAppend(id, lengths[0], 0, layout_.num_layers(), Pick(1, 4));
    c.request_id = absl::StrCat("r", next_request_++);
    Apply(c);
    Apply(c);
  }

  void MisplacedAppend() {
    const std::string id = AnyId();
    const std::vector<int64_t> lengths = Lengths(id);
    if (lengths.empty()) return;
    Apply(MakeAppend(id, lengths[0] + Pick(1, 3), 0, 1, 1));
  }

  void ForkOne() {
    const std::string parent = AnyId();
    if (parent.empty()) return;
    const std::string child = absl::StrCat(parent, "/", next_id_++);
    Log(absl::StrCat("fork ", parent, " -> ", child));
    SameStatus(a_->Fork(parent, child), b_->Fork(parent, child), child, "fork");
  }

  void DropOne() {
    const std::string id = AnyId();
    if (id.empty()) return;
    Log(absl::StrCat("drop ", id));
    SameStatus(a_->Drop(id), b_->Drop(id), id, "drop");
  }

  void CreateOne() {
    const std::string id = NewId();
    Log(absl::StrCat("create ", id));
    SameStatus(a_->Create(id), b_->Create(id), id, "create");
  }

  void ReadOne() {
    const std::string id = AnyId();
    if (id.empty()) return;
    Log(absl::StrCat("read ", id));
    CompareSequence(id);
  }

  void RoundTrip() {
    const bool restart = rng_() % 2 == 0;
    Log(restart ? "restart b" : "move b");
    const absl::Status s = restart ? b_->Restart() : b_->Move();
    if (!s.ok()) return Fail(absl::StrCat(restart ? "restart" : "move", " failed: ", s.ToString()));
    ++round_trips_;
    Compare(restart ? "a restart" : "a move");
  }

  // With eviction: a sequence only one target holds goes from both.
  void Reconcile() {
    const std::vector<std::string> x = a_->List(), y = b_->List();
    for (const std::string& id : x) {
      if (!std::binary_search(y.begin(), y.end(), id)) (void)a_->Drop(id);
    }
    for (const std::string& id : y) {
      if (!std::binary_search(x.begin(), x.end(), id)) (void)b_->Drop(id);
    }
  }

  // Everything both targets hold, after `when`.
  void Compare(const std::string& when) {
    if (evicts_) Reconcile();
    const std::vector<std::string> ids = a_->List();
    if (ids != b_->List()) {
      return Fail(absl::StrCat("after ", when, " the sequences differ: [", absl::StrJoin(ids, ", "), "] vs [",
                               absl::StrJoin(b_->List(), ", "), "]"));
    }
    const Usage x = a_->GetUsage(), y = b_->GetUsage();
    if (!(x == y))
      return Fail(absl::StrCat("after ", when, " the usage differs: ", x.ToString(), " vs ", y.ToString()));
    for (const std::string& id : ids) {
      if (ok_) CompareSequence(id);
    }
  }

  // One sequence's state and every read of it.
  void CompareSequence(const std::string& id) {
    absl::StatusOr<SequenceInfo> x = a_->Get(id), y = b_->Get(id);
    if (!x.ok() || !y.ok())
      return Fail(absl::StrCat("sequence ", id, ": ", x.status().ToString(), " vs ", y.status().ToString()));
    if (x->layer_tokens != y->layer_tokens || x->layer_held_begin != y->layer_held_begin || x->pages != y->pages ||
        x->exact_pages != y->exact_pages || x->stored_bytes != y->stored_bytes) {
      return Fail(absl::StrCat("sequence ", id, "'s state differs: tokens [", absl::StrJoin(x->layer_tokens, " "),
                               "] vs [", absl::StrJoin(y->layer_tokens, " "), "], pages ", x->pages, "+",
                               x->exact_pages, " vs ", y->pages, "+", y->exact_pages, ", bytes ", x->stored_bytes,
                               " vs ", y->stored_bytes));
    }
    for (int layer = 0; layer < layout_.num_layers() && ok_; ++layer) {
      const int64_t length = x->layer_tokens[layer], held = x->layer_held_begin[layer];
      if (length == 0) continue;
      const int tokens = static_cast<int>(std::min<int64_t>(length, Pick(1, 3)));
      const std::vector<float> q = Queries(tokens);
      Same(a_->Attend(id, layer, tokens, q), b_->Attend(id, layer, tokens, q), id,
           absl::StrCat("Attend of ", id, " layer ", layer, " (", tokens, " query tokens)"));
      const std::vector<float> q1(q.begin(), q.begin() + layout_.num_query_heads() * layout_.head_dim());
      const int64_t begin = held + static_cast<int64_t>(rng_() % (length - held + 1));
      Same(a_->Score(id, layer, held, length, q1), b_->Score(id, layer, held, length, q1), id,
           absl::StrCat("Score of ", id, " layer ", layer));
      Same(a_->Score(id, layer, begin, length, q1), b_->Score(id, layer, begin, length, q1), id,
           absl::StrCat("Score of ", id, " layer ", layer, " from ", begin));
    }
  }

  const KvLayout& layout_;
  Target* const a_;
  Target* const b_;
  std::mt19937_64 rng_;
  const bool evicts_;
  bool ok_ = true;
  int next_id_ = 0;
  int next_request_ = 0;
  int round_trips_ = 0;
  int appends_ = 0, appends_stored_ = 0;
  std::deque<std::string> log_;
};

}  // namespace round_trip
}  // namespace tqkv

#endif  // TQKV_TESTS_CACHE_ROUND_TRIP_PROPERTY_H_
