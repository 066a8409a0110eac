#include "kernels/cuda/planner.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"

namespace tqkv {
namespace cuda {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr size_t kSizeMax = std::numeric_limits<size_t>::max();

// Saturating arithmetic: plans of absurd sizes must fail to fit, not wrap
// around into something small.
int64_t AddSat(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_add_overflow(a, b, &r) ? kInt64Max : r;
}
int64_t MulSat(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kInt64Max : r;
}
int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Bump allocation of kWorkspaceAlignment-aligned buffers; saturates at
// kSizeMax.
class Layout {
 public:
  size_t Take(int64_t count, size_t element) {
    size_t bytes;
    if (count < 0 || __builtin_mul_overflow(static_cast<uint64_t>(count), element, &bytes)) bytes = kSizeMax;
    size_t offset;
    if (__builtin_add_overflow(used_, kWorkspaceAlignment - 1, &offset)) {
      used_ = kSizeMax;
      return kSizeMax;
    }
    offset = offset / kWorkspaceAlignment * kWorkspaceAlignment;
    if (__builtin_add_overflow(offset, bytes, &used_)) used_ = kSizeMax;
    return offset;
  }
  size_t used() const { return used_; }

 private:
  size_t used_ = 0;
};

struct Segment {
  bool exact;
  int64_t begin;
  int64_t end;
};
constexpr int kMaxSegments = 3;

// The runs of tokens an item reads: the compressed run first, then the exact
// sinks and recent tokens; empty runs left out (as the CPU backend reads them).
int Segments(const PlanItem& item, Segment* out) {
  const int64_t length = item.context_tokens;
  if (!item.exact) {
    out[0] = {false, 0, length};
    return 1;
  }
  int n = 0;
  if (item.recent_begin > item.sink_end) out[n++] = {false, item.sink_end, item.recent_begin};
  if (item.sink_end > 0) out[n++] = {true, 0, item.sink_end};
  if (length > item.recent_begin) out[n++] = {true, item.recent_begin, length};
  return n;
}

// What one piece reads: its causal view, its row chunks and its segments.
struct PieceView {
  int64_t view_end = 0;    // after the piece's last query token
  int64_t first_seen = 0;  // sliding window: the first token its (single) query token sees
  int32_t tokens = 0;
  int group = 1;
  int64_t rows = 0;  // query tokens x group
  int block_rows = 1;
  Segment segments[kMaxSegments];
  int num_segments = 0;

  int64_t ChunkRows(int64_t row0) const { return std::min<int64_t>(block_rows, rows - row0); }
  // The tokens [lo, hi) the row chunk at row0 reads of segment k (none when
  // hi <= lo): up to what its last row sees.
  std::pair<int64_t, int64_t> Run(int64_t row0, int k) const {
    const int64_t visible = view_end - tokens + 1 + (row0 + ChunkRows(row0) - 1) / group;
    return {std::max(segments[k].begin, first_seen), std::min(segments[k].end, visible)};
  }
};

PieceView ViewOf(const PlanDims& dims, const PlanItem& item, const PlanPiece& piece) {
  PieceView v;
  if (item.first_query_position >= 0) {  // one-token pieces (CutPieces)
    const int64_t position = item.first_query_position + piece.token0 + piece.tokens - 1;
    v.view_end = std::min<int64_t>(item.context_tokens, position + 1);
    v.first_seen = item.window > 0 ? std::max<int64_t>(0, position + 1 - item.window) : 0;
  } else {
    v.view_end = item.context_tokens - item.query_tokens + piece.token0 + piece.tokens;
    v.first_seen = item.window > 0 ? std::max<int64_t>(0, v.view_end - item.window) : 0;
  }
  v.tokens = piece.tokens;
  v.group = dims.num_query_heads / dims.num_kv_heads;
  v.rows = static_cast<int64_t>(piece.tokens) * v.group;
  v.block_rows = item.mma ? kMaxBlockRows : BlockRowsFor(static_cast<int>(std::min<int64_t>(v.rows, kMaxBlockRows)));
  v.num_segments = Segments(item, v.segments);
  return v;
}

// Appends the length of every non-empty run (row chunk x segment) `piece`
// reads in one KV head: ceil(length / split) blocks each, per KV head.
void AppendRuns(const PlanDims& dims, const PlanItem& item, const PlanPiece& piece, std::vector<int64_t>* runs) {
  const PieceView v = ViewOf(dims, item, piece);
  for (int64_t row0 = 0; row0 < v.rows; row0 += v.block_rows) {
    for (int k = 0; k < v.num_segments; ++k) {
      const auto [lo, hi] = v.Run(row0, k);
      if (hi > lo) runs->push_back(hi - lo);
    }
  }
}

// Where FillAttendBatch has got to in the batch's arrays.
struct Cursor {
  int64_t rows = 0;
  int64_t tables = 0;
};

// The element counts of one piece; with `out`, also its arrays appended
// there (cursor then required). Both modes run the same walk, so the counts
// that size a workspace are the counts that fill it.
AttendCounts WalkPiece(const PlanDims& dims, const PlanItem& item, const PlanPiece& piece, int64_t split,
                       BatchContents* out, Cursor* cursor) {
  const int heads = dims.num_kv_heads;
  const int qh = dims.num_query_heads;
  const PieceView v = ViewOf(dims, item, piece);
  PieceTables tables;
  tables.pages = CeilDiv(v.view_end, dims.page_tokens);
  tables.exact_pages = item.exact ? CeilDiv(v.view_end, dims.exact_page_tokens) : 0;

  AttendCounts c;
  c.items = 1;
  c.rows = static_cast<int64_t>(piece.tokens) * qh;
  c.table_entries = tables.pages + tables.exact_pages;
  if (dims.centered) {
    c.addback_heads = heads;
    c.theta = item.addback_pairs;
    c.coef = MulSat(MulSat(v.rows, 2), item.addback_pairs);
    c.constants = c.rows;
  }
  // Blocks of one KV head (every head has the same). Every row chunk sees
  // a token (CheckInput), so every MergeUnit has a block: the one that
  // finishes last merges the unit.
  int64_t head_blocks = 0;
  for (int64_t row0 = 0; row0 < v.rows; row0 += v.block_rows) {
    for (int k = 0; k < v.num_segments; ++k) {
      const auto [lo, hi] = v.Run(row0, k);
      if (hi > lo) head_blocks += CeilDiv(hi - lo, split);
    }
  }
  c.units = MulSat(heads, CeilDiv(v.rows, v.block_rows));
  c.blocks = MulSat(heads, head_blocks);
  if (out == nullptr) return c;

  AttendItemDesc desc;
  desc.context_tokens = static_cast<int32_t>(v.view_end);
  desc.num_query_tokens = piece.tokens;
  desc.layer = item.layer;
  desc.query_row = cursor->rows;
  desc.block_table = cursor->tables;
  desc.exact_block_table = cursor->tables + tables.pages;
  const int32_t desc_index = static_cast<int32_t>(out->items.size());
  out->items.push_back(desc);
  out->tables.push_back(tables);
  for (int t = 0; t < piece.tokens; ++t) {
    for (int h = 0; h < qh; ++h) out->head_of_row.push_back(item.layer * heads + h / v.group);
  }
  for (int kv = 0; kv < heads; ++kv) {
    for (int64_t row0 = 0; row0 < v.rows; row0 += v.block_rows) {
      MergeUnit unit;
      unit.item = desc_index;
      unit.kv_head = kv;
      unit.row0 = static_cast<int32_t>(row0);
      unit.rows = static_cast<int32_t>(v.ChunkRows(row0));
      unit.first_partial = static_cast<int32_t>(out->blocks.size());
      const int32_t unit_index = static_cast<int32_t>(out->units.size());
      for (int k = 0; k < v.num_segments; ++k) {  // the compressed segment first
        const auto [lo, hi] = v.Run(row0, k);
        for (int64_t t = lo; t < hi; t += split) {
          AttendBlock b;
          b.item = desc_index;
          b.kv_head = kv;
          b.row0 = unit.row0;
          b.rows = unit.rows;
          b.token_begin = static_cast<int32_t>(t);
          b.token_end = static_cast<int32_t>(std::min(hi, t + split));
          b.partial = unit.first_partial + unit.num_splits;
          b.unit = unit_index;
          out->blocks.push_back(b);
          out->launches.push_back({v.segments[k].exact, v.block_rows});
          ++unit.num_splits;
          if (!v.segments[k].exact) ++unit.basis_splits;
        }
      }
      out->units.push_back(unit);
    }
  }
  cursor->rows += c.rows;
  cursor->tables += c.table_entries;
  return c;
}

absl::Status CheckInput(const AttendPlanInput& in) {
  const PlanDims& d = in.dims;
  if (d.num_kv_heads < 1 || d.num_query_heads < 1 || d.num_query_heads % d.num_kv_heads != 0 || d.head_dim < 1 ||
      d.page_tokens < 1 || d.exact_page_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "attend plan: bad dims (%d KV heads, %d query heads, head dim %d, %d-token pages, %d-token exact pages)",
        d.num_kv_heads, d.num_query_heads, d.head_dim, d.page_tokens, d.exact_page_tokens));
  }
  if (in.device.sm_count < 1 || in.device.blocks_per_sm < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("attend plan: bad device figures (%d SMs, %d blocks per SM)",
                                                      in.device.sm_count, in.device.blocks_per_sm));
  }
  for (size_t i = 0; i < in.items.size(); ++i) {
    const PlanItem& item = in.items[i];
    const bool placed = item.first_query_position >= 0;  // queries anywhere: any count
    if (item.query_tokens < 1 || item.context_tokens < (placed ? 1 : item.query_tokens) ||
        item.context_tokens > kInt32Max) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "attend item %d: %d query tokens in a context of %d tokens; want 1 <= query tokens <= context <= %d", i,
          item.query_tokens, item.context_tokens, kInt32Max));
    }
    if (placed && item.window > 0 &&
        item.first_query_position + item.query_tokens - item.window >= item.context_tokens) {
      return absl::InvalidArgumentError(
          absl::StrFormat("attend item %d: its last query token sees no stored token (sliding window)", i));
    }
    if (item.exact && d.exact_page_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("attend item %d reads exact pages of a layout without exact tokens", i));
    }
    if (item.window < 0 || item.addback_pairs < 0) {
      return absl::InvalidArgumentError(absl::StrFormat("attend item %d: negative window or add-back pairs", i));
    }
  }
  return absl::OkStatus();
}

// Whether a batch of `counts` fits: its layout within the workspace, and its
// indices within the int32 fields of the kernels' structs.
bool Fits(const PlanDims& dims, const AttendCounts& counts, size_t workspace_bytes) {
  return counts.blocks <= kInt32Max && counts.items <= kInt32Max && counts.units <= kInt32Max &&
         LayOutAttend(dims, counts).end <= workspace_bytes;
}

}  // namespace

AttendCounts& AttendCounts::operator+=(const AttendCounts& o) {
  items = AddSat(items, o.items);
  blocks = AddSat(blocks, o.blocks);
  units = AddSat(units, o.units);
  rows = AddSat(rows, o.rows);
  table_entries = AddSat(table_entries, o.table_entries);
  addback_heads = AddSat(addback_heads, o.addback_heads);
  theta = AddSat(theta, o.theta);
  coef = AddSat(coef, o.coef);
  constants = AddSat(constants, o.constants);
  return *this;
}

// The pre-RoPE add-back arrays of an Attend or ScoreQuery workspace, laid
// out the same way in both (none without add-back heads).
template <typename Counts, typename Workspace>
void TakeAddBack(const Counts& c, Layout& layout, Workspace& at) {
  at.addback = c.addback_heads > 0;
  if (!at.addback) return;
  at.addback_heads = layout.Take(c.addback_heads, sizeof(AddBackDesc));
  at.theta = layout.Take(c.theta, sizeof(double));
  at.coef = layout.Take(c.coef, sizeof(float));
  at.constants = layout.Take(c.constants, sizeof(float));
}

AttendWorkspace LayOutAttend(const PlanDims& dims, const AttendCounts& c) {
  const int64_t d = dims.head_dim;
  const int64_t query_floats = MulSat(c.rows, d);
  Layout layout;
  AttendWorkspace at;
  at.items = layout.Take(c.items, sizeof(AttendItemDesc));
  at.blocks = layout.Take(c.blocks, sizeof(AttendBlock));
  at.units = layout.Take(c.units, sizeof(MergeUnit));
  at.head_of_row = layout.Take(c.rows, sizeof(int32_t));
  at.tables = layout.Take(c.table_entries, sizeof(int32_t));
  at.queries = layout.Take(query_floats, sizeof(float));
  TakeAddBack(c, layout, at);
  at.copy_in = layout.used();
  at.prepared = layout.Take(query_floats, sizeof(float));
  at.prepared_exact = layout.Take(dims.exact_page_tokens > 0 ? query_floats : 0, sizeof(float));
  at.partial_acc = layout.Take(MulSat(c.blocks, MulSat(kMaxBlockRows, d)), sizeof(float));
  at.partial_stats = layout.Take(MulSat(c.blocks, kMaxBlockRows * 2), sizeof(float));
  at.output = layout.Take(query_floats, sizeof(float));
  at.lse = layout.Take(c.rows, sizeof(float));
  at.end = layout.used();
  return at;
}

namespace {

// Cuts every item into pieces of query tokens (at most
// kMaxQueryTokensPerPiece; one each in a sliding-window layer). With a
// split, an item's pieces halve while its widest one (the last: it sees the
// most) does not fit a workspace at that split; without one (0), they stay
// at their widest. Returns whether any item was halved.
bool CutPieces(const AttendPlanInput& in, int64_t split, std::vector<PlanPiece>* pieces) {
  pieces->clear();
  bool halved = false;
  for (size_t i = 0; i < in.items.size(); ++i) {
    const PlanItem& item = in.items[i];
    const bool one_each = item.window > 0 || item.first_query_position >= 0;
    const int widest = one_each ? 1 : std::min(kMaxQueryTokensPerPiece, item.query_tokens);
    int per_piece = widest;
    while (split > 0 && per_piece > 1) {
      const PlanPiece last{static_cast<int32_t>(i), item.query_tokens - per_piece, per_piece};
      if (Fits(in.dims, WalkPiece(in.dims, item, last, split, nullptr, nullptr), in.workspace_bytes)) break;
      per_piece = (per_piece + 1) / 2;
    }
    halved = halved || per_piece < widest;
    for (int t0 = 0; t0 < item.query_tokens; t0 += per_piece) {
      pieces->push_back({static_cast<int32_t>(i), t0, std::min(per_piece, item.query_tokens - t0)});
    }
  }
  return halved;
}

// Blocks one KV head makes at `split` from the sorted lengths of its runs:
// the sum of ceil(length / split), or, where it takes fewer steps (the
// split near the longest run: a decode batch at its final split), the sum
// over k >= 0 of the runs longer than k x split, a binary search each.
int64_t HeadBlocks(const std::vector<int64_t>& sorted, int64_t split) {
  if (sorted.empty()) return 0;
  const int64_t n = static_cast<int64_t>(sorted.size());
  const int64_t steps = CeilDiv(sorted.back(), split);  // blocks of the longest run
  int64_t blocks = 0;
  if (steps * (64 - __builtin_clzll(static_cast<uint64_t>(n))) < n) {
    for (int64_t k = 0; k < steps; ++k) {
      blocks += sorted.end() - std::upper_bound(sorted.begin(), sorted.end(), k * split);
    }
    return blocks;
  }
  for (int64_t length : sorted) blocks += CeilDiv(length, split);
  return blocks;
}

// The shortest split (see planner.h) whose blocks fit the fewest waves of
// `target`, from the lengths of the runs one KV head reads (AppendRuns:
// each makes ceil(length / split) blocks per KV head, as WalkPiece counts;
// sorted here). Blocks only decrease as the split grows, and at a split as
// long as the longest run each run is one block: the fewest there are.
// Bisects over multiples of kSplitGranularity, from below by the split no
// fewer blocks than the total length over the budget allow.
int64_t ChooseSplit(std::vector<int64_t>& runs, int heads, int64_t target) {
  std::sort(runs.begin(), runs.end());
  int64_t total = 0;
  for (int64_t length : runs) total = AddSat(total, length);
  const auto fits = [&](int64_t units, int64_t budget) {
    return MulSat(HeadBlocks(runs, units * kSplitGranularity), heads) <= budget;
  };
  const int64_t fewest = MulSat(static_cast<int64_t>(runs.size()), heads);
  const int64_t budget = MulSat(CeilDiv(std::max<int64_t>(fewest, 1), target), target);
  int64_t lo = CeilDiv(kMinSplitTokens, kSplitGranularity);
  int64_t hi = std::max(lo, runs.empty() ? 0 : CeilDiv(runs.back(), kSplitGranularity));
  if (fits(lo, budget)) return lo * kSplitGranularity;
  // Below total x heads / budget tokens even exact division makes too many.
  lo = std::max(lo, (CeilDiv(MulSat(total, heads), budget) - 1) / kSplitGranularity);
  while (hi - lo > 1) {  // lo does not fit, hi does
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid, budget) ? hi : lo) = mid;
  }
  return hi * kSplitGranularity;
}

// The split for the call's pieces as cut (plan->pieces), with plan->runs as
// scratch.
int64_t SplitFor(const AttendPlanInput& in, AttendPlan* plan) {
  plan->runs.clear();
  for (const PlanPiece& piece : plan->pieces) AppendRuns(in.dims, in.items[piece.item], piece, &plan->runs);
  return ChooseSplit(plan->runs, in.dims.num_kv_heads, plan->target_blocks);
}

}  // namespace

absl::Status PlanAttend(const AttendPlanInput& in, AttendPlan* plan) {
  plan->pieces.clear();
  plan->batches.clear();
  plan->blocks = 0;
  plan->waves = 0;
  if (absl::Status s = CheckInput(in); !s.ok()) return s;
  const PlanDims& dims = in.dims;
  plan->target_blocks = MulSat(in.device.sm_count, in.device.blocks_per_sm);

  // The split from the pieces at their widest; pieces that must halve to
  // fit a workspace make other blocks, so the split is chosen again from
  // them. The longer of the two keeps both promises: a longer split makes
  // no more blocks (the waves hold) and no larger a workspace (the pieces
  // still fit).
  CutPieces(in, 0, &plan->pieces);
  plan->split = SplitFor(in, plan);
  if (CutPieces(in, plan->split, &plan->pieces)) plan->split = std::max(plan->split, SplitFor(in, plan));

  // Batches: as many pieces as fit, in order.
  AttendBatch batch;
  for (size_t p = 0; p < plan->pieces.size(); ++p) {
    const PlanPiece& piece = plan->pieces[p];
    const PlanItem& item = in.items[piece.item];
    const AttendCounts c = WalkPiece(dims, item, piece, plan->split, nullptr, nullptr);
    plan->blocks = AddSat(plan->blocks, c.blocks);
    AttendCounts next = batch.counts;
    next += c;
    if (Fits(dims, next, in.workspace_bytes)) {
      batch.counts = next;
      continue;
    }
    if (!Fits(dims, c, in.workspace_bytes)) {
      plan->batches.clear();
      return absl::ResourceExhaustedError(absl::StrFormat(
          "one query token of an Attend item (context %d tokens) needs %d bytes, more than a %d-byte CUDA "
          "workspace",
          item.context_tokens, LayOutAttend(dims, c).end, in.workspace_bytes));
    }
    batch.piece_end = p;
    batch.at = LayOutAttend(dims, batch.counts);
    plan->batches.push_back(batch);
    batch = AttendBatch();
    batch.piece_begin = p;
    batch.counts = c;
  }
  if (!plan->pieces.empty()) {
    batch.piece_end = plan->pieces.size();
    batch.at = LayOutAttend(dims, batch.counts);
    plan->batches.push_back(batch);
  }
  plan->waves = CeilDiv(plan->blocks, plan->target_blocks);
  return absl::OkStatus();
}

void FillAttendBatch(const AttendPlanInput& in, const AttendPlan& plan, const AttendBatch& batch, BatchContents* out) {
  out->items.clear();
  out->tables.clear();
  out->blocks.clear();
  out->launches.clear();
  out->units.clear();
  out->head_of_row.clear();
  Cursor cursor;
  for (size_t p = batch.piece_begin; p < batch.piece_end; ++p) {
    const PlanPiece& piece = plan.pieces[p];
    WalkPiece(in.dims, in.items[piece.item], piece, plan.split, out, &cursor);
  }
}

ScoreWorkspace LayOutScore(const ScoreInput& in, int64_t piece_tokens) {
  const int64_t query_floats = MulSat(in.num_query_heads, in.head_dim);
  Layout layout;
  ScoreWorkspace at;
  at.table = layout.Take(in.table_entries, sizeof(int32_t));
  at.heads = layout.Take(in.num_query_heads, sizeof(int32_t));
  at.queries = layout.Take(query_floats, sizeof(float));
  TakeAddBack(in, layout, at);
  at.copy_in = layout.used();
  at.prepared = layout.Take(query_floats, sizeof(float));
  at.prepared_exact = layout.Take(in.exact ? query_floats : 0, sizeof(float));
  at.logits = layout.Take(MulSat(in.num_query_heads, std::min(in.tokens, piece_tokens)), sizeof(float));
  at.end = layout.used();
  return at;
}

absl::Status PlanScore(const ScoreInput& in, ScorePlan* plan) {
  if (in.num_query_heads < 1 || in.head_dim < 1 || in.tokens < 0 || in.tokens > kInt32Max || in.table_entries < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("score plan: bad input (%d query heads, head dim %d, %d tokens, %d table entries)",
                        in.num_query_heads, in.head_dim, in.tokens, in.table_entries));
  }
  const auto fits = [&](int64_t piece) { return LayOutScore(in, piece).end <= in.workspace_bytes; };
  // Whole tiles per launch, at least one (or the whole range if shorter).
  const int64_t smallest = std::min<int64_t>(in.tokens, kAttendTile);
  if (!fits(smallest)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "ScoreQuery of %d query heads over %d block table entries needs %d bytes, more than a %d-byte CUDA "
        "workspace",
        in.num_query_heads, in.table_entries, LayOutScore(in, smallest).end, in.workspace_bytes));
  }
  if (fits(in.tokens)) {
    plan->piece_tokens = in.tokens;
  } else {
    // The most whole tiles that fit: [lo fits, hi does not].
    int64_t lo = 1, hi = CeilDiv(in.tokens, kAttendTile);
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (fits(mid * kAttendTile) ? lo : hi) = mid;
    }
    plan->piece_tokens = lo * kAttendTile;
  }
  plan->at = LayOutScore(in, plan->piece_tokens);
  return absl::OkStatus();
}

StoreWorkspace LayOutStore(const StoreInput& in, int64_t piece_tokens) {
  const int64_t floats = MulSat(MulSat(in.layers, piece_tokens), MulSat(in.num_kv_heads, in.head_dim));
  Layout layout;
  StoreWorkspace at;
  at.keys = layout.Take(floats, sizeof(float));
  at.values = layout.Take(floats, sizeof(float));
  at.slots = layout.Take(piece_tokens, sizeof(int32_t));
  at.error = layout.Take(1, sizeof(unsigned long long));
  at.end = layout.used();
  return at;
}

absl::Status PlanStore(const StoreInput& in, StorePlan* plan) {
  if (in.layers < 0 || in.num_kv_heads < 1 || in.head_dim < 1 || in.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("store plan: bad input (%d layers, %d KV heads, head dim %d, %d tokens)", in.layers,
                        in.num_kv_heads, in.head_dim, in.tokens));
  }
  plan->piece_tokens = 0;
  if (in.layers == 0 || in.tokens == 0) return absl::OkStatus();
  const auto fits = [&](int64_t tokens) { return LayOutStore(in, tokens).end <= in.workspace_bytes; };
  if (!fits(1)) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("one token of %d layers (%d bytes) does not fit a %d-byte CUDA workspace", in.layers,
                        LayOutStore(in, 1).end, in.workspace_bytes));
  }
  // The most tokens that fit, within the kernel's int32 count: [lo fits, hi
  // does not].
  const int64_t most = std::min<int64_t>(in.tokens, kInt32Max);
  if (fits(most)) {
    plan->piece_tokens = most;
    return absl::OkStatus();
  }
  int64_t lo = 1, hi = most;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  plan->piece_tokens = lo;
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace tqkv
