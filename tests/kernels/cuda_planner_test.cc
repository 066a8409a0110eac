// The CUDA backend's host planner (kernels/cuda/planner.h), without nvcc or a
// device: workspace sizing at its limits and every split rule.
#include "kernels/cuda/planner.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace tqkv {
namespace cuda {
namespace {

constexpr size_t kHuge = size_t{1} << 40;  // a workspace nothing fills

PlanDims Dims(int kv_heads = 8, int query_heads = 32, int head_dim = 128, int page_tokens = 16) {
  PlanDims d;
  d.num_kv_heads = kv_heads;
  d.num_query_heads = query_heads;
  d.head_dim = head_dim;
  d.page_tokens = page_tokens;
  return d;
}

PlanItem Item(int64_t context, int query_tokens = 1) {
  PlanItem item;
  item.context_tokens = context;
  item.query_tokens = query_tokens;
  return item;
}

// A call's planner input with the items it spans.
struct Call {
  Call(const PlanDims& dims, std::vector<PlanItem> plan_items, int sm_count, int blocks_per_sm, size_t workspace_bytes)
      : items(std::move(plan_items)) {
    in.dims = dims;
    in.items = items;
    in.device = {sm_count, blocks_per_sm};
    in.workspace_bytes = workspace_bytes;
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  operator const AttendPlanInput&() const { return in; }

  std::vector<PlanItem> items;
  AttendPlanInput in;
};

AttendPlan Plan(const AttendPlanInput& in) {
  AttendPlan plan;
  const absl::Status status = PlanAttend(in, &plan);
  EXPECT_TRUE(status.ok()) << status;
  return plan;
}

// Blocks of the whole call, over its batches.
int64_t TotalBlocks(const AttendPlan& plan) {
  int64_t blocks = 0;
  for (const AttendBatch& batch : plan.batches) blocks += batch.counts.blocks;
  return blocks;
}

// Bytes of one batch holding every piece of `items` (a workspace nothing fills).
size_t BatchBytes(const PlanDims& dims, const std::vector<PlanItem>& items) {
  const AttendPlan plan = Plan(Call(dims, items, 4, 4, kHuge));
  EXPECT_EQ(plan.batches.size(), 1u);
  return plan.batches.empty() ? 0 : plan.batches[0].at.end;
}

// Every batch of `plan` fits the workspace, is laid out from its counts, and
// FillAttendBatch writes exactly those counts: one computation of the bytes.
void ExpectConsistent(const AttendPlanInput& in, const AttendPlan& plan) {
  size_t next_piece = 0;
  for (const AttendBatch& batch : plan.batches) {
    EXPECT_EQ(batch.piece_begin, next_piece);
    EXPECT_LT(batch.piece_begin, batch.piece_end);
    next_piece = batch.piece_end;
    EXPECT_LE(batch.at.end, in.workspace_bytes);
    EXPECT_EQ(batch.at.end, LayOutAttend(in.dims, batch.counts).end);
    BatchContents contents;
    FillAttendBatch(in, plan, batch, &contents);
    EXPECT_EQ(static_cast<int64_t>(contents.items.size()), batch.counts.items);
    EXPECT_EQ(static_cast<int64_t>(contents.blocks.size()), batch.counts.blocks);
    EXPECT_EQ(static_cast<int64_t>(contents.launches.size()), batch.counts.blocks);
    EXPECT_EQ(static_cast<int64_t>(contents.units.size()), batch.counts.units);
    EXPECT_EQ(static_cast<int64_t>(contents.head_of_row.size()), batch.counts.rows);
    int64_t entries = 0;
    for (const PieceTables& t : contents.tables) entries += t.pages + t.exact_pages;
    EXPECT_EQ(entries, batch.counts.table_entries);
    // Every unit's partials are its blocks, in order, at least one (the
    // last to finish merges the unit), none empty.
    for (size_t u = 0; u < contents.units.size(); ++u) {
      const MergeUnit& unit = contents.units[u];
      EXPECT_GE(unit.num_splits, 1);
      EXPECT_EQ(unit.arrived, 0);
      for (int k = 0; k < unit.num_splits; ++k) {
        const AttendBlock& b = contents.blocks[unit.first_partial + k];
        EXPECT_EQ(b.partial, unit.first_partial + k);
        EXPECT_EQ(b.unit, static_cast<int32_t>(u));
        EXPECT_EQ(b.item, unit.item);
        EXPECT_EQ(b.kv_head, unit.kv_head);
        EXPECT_EQ(b.row0, unit.row0);
        EXPECT_LE(b.token_end - b.token_begin, plan.split);
        EXPECT_LT(b.token_begin, b.token_end);
      }
    }
  }
  EXPECT_EQ(next_piece, plan.pieces.size());
}

// --- Workspace sizing -------------------------------------------------------

TEST(PlannerWorkspace, APieceThatExactlyFitsRunsAndOneByteLessDoesNot) {
  const PlanDims dims = Dims();
  const std::vector<PlanItem> items = {Item(5000)};
  const size_t bytes = BatchBytes(dims, items);
  const AttendPlan exact = Plan(Call(dims, items, 4, 4, bytes));
  ASSERT_EQ(exact.batches.size(), 1u);
  EXPECT_EQ(exact.batches[0].at.end, bytes);

  AttendPlan plan;
  const absl::Status short_one = PlanAttend(Call(dims, items, 4, 4, bytes - 1), &plan);
  EXPECT_EQ(short_one.code(), absl::StatusCode::kResourceExhausted) << short_one;
  EXPECT_NE(short_one.message().find("context 5000 tokens"), std::string::npos) << short_one;
  EXPECT_TRUE(plan.batches.empty());
}

TEST(PlannerWorkspace, OneByteShortOfTwoPiecesMakesTwoBatches) {
  const PlanDims dims = Dims();
  const std::vector<PlanItem> items = {Item(3000), Item(700)};
  const size_t both = BatchBytes(dims, items);
  const Call fits(dims, items, 4, 4, both);
  const AttendPlan one = Plan(fits);
  EXPECT_EQ(one.batches.size(), 1u);
  ExpectConsistent(fits, one);

  const Call short_one(dims, items, 4, 4, both - 1);
  const AttendPlan two = Plan(short_one);
  ASSERT_EQ(two.batches.size(), 2u);
  EXPECT_EQ(two.batches[0].piece_end, 1u);
  ExpectConsistent(short_one, two);
}

TEST(PlannerWorkspace, ASingleTokenThatCannotFitIsResourceExhausted) {
  // A million-token context at one token per page: 4 MB of block table alone.
  PlanDims dims = Dims(8, 32, 128, 1);
  AttendPlan plan;
  const absl::Status status = PlanAttend(Call(dims, {Item(300), Item(1 << 20)}, 4, 4, size_t{1} << 20), &plan);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("context 1048576 tokens"), std::string::npos) << status;
}

// The overflow the emulator found once: 32 query tokens of a long item did
// not fit one workspace. Pieces halve until one fits.
TEST(PlannerWorkspace, PiecesHalveTheirQueryTokensUntilOneFits) {
  const PlanDims dims = Dims();
  const int64_t context = 20000;
  // The widest piece of 16 tokens ends at the item's last token.
  const size_t sixteen = BatchBytes(dims, {Item(context, 16)});
  const Call in(dims, {Item(context, 40)}, 4, 4, sixteen);
  const AttendPlan plan = Plan(in);
  std::vector<int> tokens;
  for (const PlanPiece& piece : plan.pieces) tokens.push_back(piece.tokens);
  EXPECT_EQ(tokens, (std::vector<int>{16, 16, 8}));
  ExpectConsistent(in, plan);

  const AttendPlan smaller = Plan(Call(dims, {Item(context, 40)}, 4, 4, sixteen - 1));
  for (const PlanPiece& piece : smaller.pieces) EXPECT_EQ(piece.tokens, 8);
  EXPECT_EQ(smaller.pieces.size(), 5u);
}

TEST(PlannerWorkspace, HugeSizesSaturateInsteadOfWrapping) {
  const PlanDims dims = Dims();
  AttendCounts counts;
  counts.rows = std::numeric_limits<int64_t>::max() / 64;  // rows x head dim x 4 overflows
  EXPECT_EQ(LayOutAttend(dims, counts).end, std::numeric_limits<size_t>::max());
  AttendCounts blocks;
  blocks.blocks = std::numeric_limits<int64_t>::max() / 4;
  EXPECT_EQ(LayOutAttend(dims, blocks).end, std::numeric_limits<size_t>::max());
  // Sums of counts saturate too.
  AttendCounts sum;
  sum.rows = std::numeric_limits<int64_t>::max() - 1;
  sum += sum;
  EXPECT_EQ(sum.rows, std::numeric_limits<int64_t>::max());

  // The longest context a plan takes, on one-token pages: it needs more
  // than any real workspace, and says so instead of wrapping around.
  const PlanDims pages = Dims(8, 32, 128, 1);
  const int64_t longest = std::numeric_limits<int32_t>::max();
  AttendPlan plan;
  EXPECT_EQ(PlanAttend(Call(pages, {Item(longest, 32)}, 132, 16, size_t{64} << 20), &plan).code(),
            absl::StatusCode::kResourceExhausted);
  // With room for it, its blocks stay within int32 token positions.
  const Call roomy(pages, {Item(longest)}, 132, 16, kHuge);
  const AttendPlan big = Plan(roomy);
  ASSERT_EQ(big.batches.size(), 1u);
  EXPECT_GE(big.batches[0].counts.table_entries, longest);
  BatchContents contents;
  FillAttendBatch(roomy, big, big.batches[0], &contents);
  int64_t covered = 0;
  for (const AttendBlock& b : contents.blocks) {
    if (b.kv_head == 0) covered += b.token_end - b.token_begin;
  }
  EXPECT_EQ(covered, longest);
  // Beyond int32 positions: refused as input.
  EXPECT_EQ(PlanAttend(Call(pages, {Item(longest + 1)}, 132, 16, kHuge), &plan).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlannerWorkspace, BadInputIsInvalidArgument) {
  AttendPlan plan;
  EXPECT_EQ(PlanAttend(Call(Dims(), {Item(100)}, 0, 4, kHuge), &plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAttend(Call(Dims(), {Item(100)}, 4, 0, kHuge), &plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAttend(Call(Dims(), {Item(3, 5)}, 4, 4, kHuge), &plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAttend(Call(Dims(), {Item(3, 0)}, 4, 4, kHuge), &plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAttend(Call(Dims(8, 12), {Item(100)}, 4, 4, kHuge), &plan).code(), absl::StatusCode::kInvalidArgument);
  PlanItem exact = Item(100);
  exact.exact = true;  // but the dims keep no exact tokens
  EXPECT_EQ(PlanAttend(Call(Dims(), {exact}, 4, 4, kHuge), &plan).code(), absl::StatusCode::kInvalidArgument);
  // No items: nothing to run.
  EXPECT_TRUE(PlanAttend(Call(Dims(), {}, 4, 4, kHuge), &plan).ok());
  EXPECT_TRUE(plan.batches.empty());
}

TEST(PlannerWorkspace, BuffersAreAlignedAndInOrder) {
  PlanDims dims = Dims();
  dims.exact_page_tokens = 16;
  dims.centered = true;
  PlanItem item = Item(1000, 3);
  item.exact = true;
  item.sink_end = 4;
  item.recent_begin = 900;
  item.addback_pairs = 40;
  const AttendPlan plan = Plan(Call(dims, {item}, 4, 4, kHuge));
  ASSERT_EQ(plan.batches.size(), 1u);
  const AttendWorkspace& at = plan.batches[0].at;
  const std::vector<size_t> order = {at.items,       at.blocks,        at.units,         at.head_of_row,
                                     at.tables,      at.queries,       at.addback_heads, at.theta,
                                     at.coef,        at.constants,     at.prepared,      at.prepared_exact,
                                     at.partial_acc, at.partial_stats, at.output,        at.lse};
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(order[i] % kWorkspaceAlignment, 0u) << i;
    if (i > 0) {
      EXPECT_LT(order[i - 1], order[i]) << i;
    }
  }
  EXPECT_TRUE(at.addback);
  EXPECT_LE(at.constants, at.copy_in);
  EXPECT_LE(at.copy_in, at.prepared);
  EXPECT_LT(at.lse, at.end);
  // The add-back arrays: a desc per KV head, the item's pairs' thetas, two
  // coefficients per pair and row, a constant per row.
  const AttendCounts& c = plan.batches[0].counts;
  EXPECT_EQ(c.addback_heads, 8);
  EXPECT_EQ(c.theta, 40);
  EXPECT_EQ(c.coef, 3 * 4 * 2 * 40);
  EXPECT_EQ(c.constants, 3 * 32);
}

// --- Split rules ------------------------------------------------------------

TEST(PlannerSplits, TheSplitIsAtLeastTwoTiles) {
  const AttendPlan plan = Plan(Call(Dims(), {Item(100)}, 132, 16, kHuge));
  EXPECT_EQ(plan.split, kMinSplitTokens);
  EXPECT_EQ(kMinSplitTokens, 2 * kAttendTile);
}

TEST(PlannerSplits, SplitsAreWholeMultiplesOfSixteenTokens) {
  // One SM, one block: the split is the whole (single KV head) context,
  // rounded up to 16 tokens (not to a 128-token tile).
  for (auto [context, split] : {std::pair<int64_t, int64_t>{1000, 1008}, {1024, 1024}, {1025, 1040}}) {
    const AttendPlan plan = Plan(Call(Dims(1, 1), {Item(context)}, 1, 1, kHuge));
    EXPECT_EQ(kSplitGranularity, 16);
    EXPECT_EQ(plan.split, split) << context;
    EXPECT_EQ(TotalBlocks(plan), 1) << context;
  }
}

TEST(PlannerSplits, ManySmsGiveShorterSplitsThanFew) {
  // 32k tokens x 8 KV heads over 132 SMs x 4 blocks: 496.5 -> 512;
  // over 4 SMs x 4 blocks: 16384.
  const AttendPlan many = Plan(Call(Dims(), {Item(32768)}, 132, 4, kHuge));
  EXPECT_EQ(many.target_blocks, 528);
  EXPECT_EQ(many.split, 512);
  const AttendPlan few = Plan(Call(Dims(), {Item(32768)}, 4, 4, kHuge));
  EXPECT_EQ(few.target_blocks, 16);
  EXPECT_EQ(few.split, 16384);
  EXPECT_EQ(few.batches[0].counts.blocks, 16);
}

TEST(PlannerSplits, TheOccupancyFigureScalesTheTarget) {
  const AttendPlan two = Plan(Call(Dims(), {Item(65536)}, 64, 2, kHuge));
  const AttendPlan eight = Plan(Call(Dims(), {Item(65536)}, 64, 8, kHuge));
  EXPECT_EQ(two.target_blocks, 128);
  EXPECT_EQ(eight.target_blocks, 512);
  EXPECT_EQ(two.split, 4 * eight.split);
}

TEST(PlannerSplits, OneLongItemAndManyShortItemsBothFillTheTarget) {
  // The same work (512k token-heads) over 512 resident blocks: splits of 1024.
  const AttendPlan one = Plan(Call(Dims(), {Item(65536)}, 128, 4, kHuge));
  EXPECT_EQ(one.split, 1024);
  EXPECT_EQ(one.batches[0].counts.blocks, 512);
  const std::vector<PlanItem> short_items(64, Item(1024));
  const AttendPlan many = Plan(Call(Dims(), short_items, 128, 4, kHuge));
  EXPECT_EQ(many.split, 1024);
  EXPECT_EQ(many.batches[0].counts.blocks, 512);
  // Shorter items than a split are one block per (item, KV head).
  const std::vector<PlanItem> tiny(64, Item(10));
  const AttendPlan tiny_plan = Plan(Call(Dims(), tiny, 128, 4, kHuge));
  EXPECT_EQ(tiny_plan.split, kMinSplitTokens);
  EXPECT_EQ(tiny_plan.batches[0].counts.blocks, 64 * 8);
}

TEST(PlannerSplits, MultiTokenQueriesAreCutIntoPiecesOfTheirOwnCausalView) {
  const Call in(Dims(), {Item(1000, 70), Item(500, 1)}, 4, 4, kHuge);
  const AttendPlan plan = Plan(in);
  ASSERT_EQ(plan.pieces.size(), 4u);
  const int expected_tokens[] = {32, 32, 6, 1};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(plan.pieces[i].tokens, expected_tokens[i]) << i;
  EXPECT_EQ(plan.pieces[2].token0, 64);
  ASSERT_EQ(plan.batches.size(), 1u);
  BatchContents contents;
  FillAttendBatch(in, plan, plan.batches[0], &contents);
  // Piece i sees up to its last query token; rows follow one another.
  EXPECT_EQ(contents.items[0].context_tokens, 1000 - 70 + 32);
  EXPECT_EQ(contents.items[1].context_tokens, 1000 - 70 + 64);
  EXPECT_EQ(contents.items[2].context_tokens, 1000);
  EXPECT_EQ(contents.items[3].context_tokens, 500);
  EXPECT_EQ(contents.items[1].query_row, 32 * 32);
  EXPECT_EQ(contents.items[3].query_row, 70 * 32);
  EXPECT_EQ(contents.tables[0].pages, (1000 - 70 + 32 + 15) / 16);
  // A row chunk's blocks end where its last row's view ends: group 4, 8-row
  // chunks hold two query tokens, the second of which sees one more token.
  for (const AttendBlock& b : contents.blocks) {
    if (b.item != 0) continue;
    const int last_token = (b.row0 + b.rows - 1) / 4;
    EXPECT_LE(b.token_end, 1000 - 70 + 1 + last_token);
  }
  ExpectConsistent(in, plan);
}

TEST(PlannerSplits, SlidingWindowQueriesArePiecesOfOneToken) {
  PlanItem item = Item(5000, 5);
  item.window = 300;
  const Call in(Dims(), {item}, 4, 4, kHuge);
  const AttendPlan plan = Plan(in);
  ASSERT_EQ(plan.pieces.size(), 5u);
  BatchContents contents;
  FillAttendBatch(in, plan, plan.batches[0], &contents);
  for (const AttendBlock& b : contents.blocks) {
    const int64_t view_end = contents.items[b.item].context_tokens;
    EXPECT_GE(b.token_begin, view_end - 300);
    EXPECT_LE(b.token_end, view_end);
  }
  ExpectConsistent(in, plan);
}

TEST(PlannerSplits, BlocksNeverCrossASegment) {
  PlanDims dims = Dims();
  dims.exact_page_tokens = 8;
  PlanItem item = Item(3000);
  item.exact = true;
  item.sink_end = 4;
  item.recent_begin = 2900;
  const Call in(dims, {item}, 1, 1, kHuge);  // one long split
  const AttendPlan plan = Plan(in);
  BatchContents contents;
  FillAttendBatch(in, plan, plan.batches[0], &contents);
  EXPECT_EQ(contents.tables[0].exact_pages, 3000 / 8);
  EXPECT_EQ(contents.items[0].exact_block_table, contents.tables[0].pages);
  for (const MergeUnit& unit : contents.units) {
    ASSERT_EQ(unit.num_splits, 3);  // compressed, sinks, recent
    EXPECT_EQ(unit.basis_splits, 1);
    const AttendBlock* b = &contents.blocks[unit.first_partial];
    EXPECT_EQ(b[0].token_begin, 4);
    EXPECT_EQ(b[0].token_end, 2900);
    EXPECT_EQ(b[1].token_begin, 0);
    EXPECT_EQ(b[1].token_end, 4);
    EXPECT_EQ(b[2].token_begin, 2900);
    EXPECT_EQ(b[2].token_end, 3000);
    EXPECT_FALSE(contents.launches[unit.first_partial].exact);
    EXPECT_TRUE(contents.launches[unit.first_partial + 1].exact);
    EXPECT_TRUE(contents.launches[unit.first_partial + 2].exact);
  }
  ExpectConsistent(in, plan);
}

TEST(PlannerSplits, RowChunksFollowTheGroupAndTheKernel) {
  auto rows_of = [](int query_heads, bool mma) {
    PlanItem item = Item(600);
    item.mma = mma;
    const Call in(Dims(2, query_heads), {item}, 4, 4, kHuge);
    const AttendPlan plan = Plan(in);
    BatchContents contents;
    FillAttendBatch(in, plan, plan.batches[0], &contents);
    std::vector<int> out;
    for (const MergeUnit& u : contents.units) {
      if (u.kv_head == 0) out.push_back(u.rows);
    }
    out.push_back(contents.launches[0].block_rows);
    return out;
  };
  EXPECT_EQ(rows_of(2, false), (std::vector<int>{1, 1}));      // group 1: 1-row blocks
  EXPECT_EQ(rows_of(6, false), (std::vector<int>{3, 4}));      // group 3: 4-row instance
  EXPECT_EQ(rows_of(32, false), (std::vector<int>{8, 8, 8}));  // group 16: two chunks of 8
  EXPECT_EQ(rows_of(2, true), (std::vector<int>{1, 8}));       // the tensor-core kernel holds 8
}

// --- Waves ------------------------------------------------------------------

// The blocks `plan`'s pieces make at `split` instead of plan.split, all in
// one batch, as FillAttendBatch (the walk the backend launches) writes them.
int64_t BlocksAt(const AttendPlanInput& in, AttendPlan plan, int64_t split) {
  plan.split = split;
  AttendBatch all;
  all.piece_end = plan.pieces.size();
  BatchContents contents;
  FillAttendBatch(in, plan, all, &contents);
  return static_cast<int64_t>(contents.blocks.size());
}

// The split rules (planner.h) as properties of a plan whose pieces were not
// halved: whole multiples of kSplitGranularity, at least kMinSplitTokens;
// the fewest waves (one whenever one block per run fits the target); and no
// shorter split that keeps them.
void ExpectFewestWaves(const AttendPlanInput& in, const AttendPlan& plan) {
  EXPECT_EQ(plan.split % kSplitGranularity, 0) << plan.split;
  EXPECT_GE(plan.split, kMinSplitTokens);
  int64_t longest = 0;
  for (const PlanItem& item : in.items) longest = std::max(longest, item.context_tokens);
  // At a split as long as every item, each run is one block: the fewest.
  const int64_t fewest = BlocksAt(in, plan, std::max(plan.split, longest));
  const int64_t target = plan.target_blocks;
  const int64_t waves = std::max<int64_t>(1, (fewest + target - 1) / target);
  const int64_t blocks = TotalBlocks(plan);
  EXPECT_EQ(blocks, BlocksAt(in, plan, plan.split));
  EXPECT_LE(blocks, waves * target) << "split " << plan.split << ", fewest blocks " << fewest;
  EXPECT_EQ(plan.blocks, blocks);
  EXPECT_EQ(plan.waves, (blocks + target - 1) / target);
  if (plan.split > kMinSplitTokens) {
    EXPECT_GT(BlocksAt(in, plan, plan.split - kSplitGranularity), waves * target)
        << "split " << plan.split << " is not the shortest that fits " << waves << " wave(s)";
  }
}

// Every unit's blocks are non-empty, no longer than the split, each inside
// one segment (exact ones in the sinks or recent tokens), and together cover the
// tokens its last row sees exactly once.
void ExpectBlocksCoverTheirRows(const AttendPlanInput& in, const AttendPlan& plan) {
  const int group = in.dims.num_query_heads / in.dims.num_kv_heads;
  for (const AttendBatch& batch : plan.batches) {
    BatchContents contents;
    FillAttendBatch(in, plan, batch, &contents);
    for (const MergeUnit& unit : contents.units) {
      const PlanPiece& piece = plan.pieces[batch.piece_begin + unit.item];
      const PlanItem& item = in.items[piece.item];
      const int64_t view_end = contents.items[unit.item].context_tokens;
      const int64_t visible = view_end - piece.tokens + 1 + (unit.row0 + unit.rows - 1) / group;
      const int64_t first_seen = item.window > 0 ? std::max<int64_t>(0, view_end - item.window) : 0;
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (int k = 0; k < unit.num_splits; ++k) {
        const AttendBlock& b = contents.blocks[unit.first_partial + k];
        EXPECT_LT(b.token_begin, b.token_end);
        EXPECT_LE(b.token_end - b.token_begin, plan.split);
        if (contents.launches[unit.first_partial + k].exact) {
          EXPECT_TRUE(b.token_end <= item.sink_end || b.token_begin >= item.recent_begin);
        } else if (item.exact) {
          EXPECT_TRUE(b.token_begin >= item.sink_end && b.token_end <= item.recent_begin);
        }
        ranges.push_back({b.token_begin, b.token_end});
      }
      std::sort(ranges.begin(), ranges.end());
      int64_t next = first_seen;
      for (const auto& [begin, end] : ranges) {
        EXPECT_EQ(begin, next) << "a gap or an overlap";
        next = end;
      }
      EXPECT_EQ(next, visible);
    }
  }
}

// The sizes the H200 ran at (docs/measurements/h200-2026-12-04): 132 SMs,
// one Llama-3.1-8B layer, one query token per item, the backend's default
// 64 MiB workspace. Blocks per SM are the backend's figure for the kernel
// instance each format decodes with (MeasureOccupancy: the occupancy API's
// thread blocks per SM times the AttendBlocks each runs), here from the
// registers per thread ptxas gives the sm_90 build, 65536 registers per SM
// allocated per warp in units of 256; bf16's 12 x 132 is the 1584 resident
// blocks the H200 showed.
struct H200Format {
  const char* what;
  int blocks_per_sm;
  bool mma;
  bool recipe;  // tqkv_k3v4u_csw: exact segments, add-back pairs
};
const H200Format kH200Formats[] = {
    {"bf16 or fp16 (tensor cores, 165 registers: 3 thread blocks of 4 warps)", 12, true, false},
    {"TurboQuant keys, uniform values (tensor cores, 128 registers: 4 x 4 warps)", 16, true, false},
    {"TurboQuant keys and values (tensor cores, 166 registers: 3 x 4 warps)", 12, true, false},
    {"fp8, fp8 + uniform or split keys (fp32 kernel, 4-row blocks, 96 registers: 5 x 1)", 5, false, false},
    {"tqkv_k3v4u_csw (the TurboQuant + uniform kernel; 4 sinks, 64 recent, 8 pairs)", 16, true, true},
};
constexpr int kH200Sms = 132;
constexpr size_t kDefaultWorkspace = size_t{64} << 20;

PlanDims H200Dims(const H200Format& format) {
  PlanDims dims = Dims();
  if (format.recipe) {
    dims.exact_page_tokens = 4;  // sizes the tables only
    dims.centered = true;
  }
  return dims;
}

std::vector<PlanItem> H200Items(const H200Format& format, int batch, int64_t context) {
  PlanItem item = Item(context);
  item.mma = format.mma;
  if (format.recipe) {
    item.exact = true;
    item.sink_end = 4;
    item.recent_begin = context - 64;
    item.addback_pairs = 8 * 8;
  }
  return std::vector<PlanItem>(batch, item);
}

TEST(PlannerWaves, EveryCallAtTheH200SizesRunsInOneWave) {
  for (const H200Format& format : kH200Formats) {
    for (int batch : {1, 8, 16, 32, 64}) {
      for (int64_t context : {1024, 8192, 32768, 131072}) {
        SCOPED_TRACE(testing::Message() << format.what << ", batch " << batch << ", context " << context);
        const Call in(H200Dims(format), H200Items(format, batch, context), kH200Sms, format.blocks_per_sm,
                      kDefaultWorkspace);
        const AttendPlan plan = Plan(in);
        EXPECT_EQ(plan.target_blocks, kH200Sms * format.blocks_per_sm);
        EXPECT_LE(TotalBlocks(plan), plan.target_blocks) << "split " << plan.split;
        ExpectFewestWaves(in, plan);
        ExpectBlocksCoverTheirRows(in, plan);
        ExpectConsistent(in, plan);
      }
    }
  }
}

TEST(PlannerWaves, Bf16AtBatch16And32kFitsTheResidentBlocks) {
  // The partial wave the H200 measured: 128-token splits (2688) made 13
  // blocks per (item, KV head), 1664 for 1584 resident, 1212 us against
  // 402 us at batch 8. 2736 makes 12.
  const Call in(H200Dims(kH200Formats[0]), H200Items(kH200Formats[0], 16, 32768), kH200Sms, 12, kDefaultWorkspace);
  const AttendPlan plan = Plan(in);
  EXPECT_EQ(plan.target_blocks, 1584);
  EXPECT_EQ(plan.split, 2736);
  EXPECT_EQ(TotalBlocks(plan), 16 * 8 * 12);
  EXPECT_EQ(BlocksAt(in, plan, 2720), 16 * 8 * 13);
  EXPECT_EQ(BlocksAt(in, plan, 2688), 1664);
}

TEST(PlannerWaves, RunsBeyondOneWaveFillTheFewestWaves) {
  // 200 recipe items: 200 x 8 KV heads x 3 segments = 4800 runs over 1584
  // resident blocks, so 4 waves at the least; the split fills them.
  const H200Format& recipe = kH200Formats[4];
  const Call in(H200Dims(recipe), H200Items(recipe, 200, 32768), kH200Sms, 12, kHuge);
  const AttendPlan plan = Plan(in);
  EXPECT_EQ(plan.waves, 4);
  EXPECT_GT(TotalBlocks(plan), 3 * 1584);
  EXPECT_LE(TotalBlocks(plan), 4 * 1584);
  ExpectFewestWaves(in, plan);
  ExpectBlocksCoverTheirRows(in, plan);
}

// Random calls: items long and short, multi-token pieces, exact segments,
// sliding windows, small and large devices.
TEST(PlannerWaves, RandomCallsKeepEveryRule) {
  std::mt19937_64 rng(35);
  auto uniform = [&rng](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int round = 0; round < 300; ++round) {
    const int kv_heads = 1 << uniform(0, 3);
    PlanDims dims = Dims(kv_heads, kv_heads * static_cast<int>(uniform(1, 8)));
    dims.exact_page_tokens = uniform(0, 1) ? 8 : 0;
    std::vector<PlanItem> items(uniform(1, 24));
    for (PlanItem& item : items) {
      item.context_tokens = uniform(1, int64_t{1} << uniform(1, 16));
      const int64_t most = uniform(0, 3) ? 1 : 8;  // mostly decode, sometimes several query tokens
      item.query_tokens = static_cast<int32_t>(uniform(1, std::min(item.context_tokens, most)));
      item.mma = uniform(0, 1);
      if (uniform(0, 4) == 0) item.window = uniform(1, item.context_tokens);
      if (dims.exact_page_tokens > 0 && uniform(0, 1)) {
        item.exact = true;
        item.sink_end = std::min<int64_t>(item.context_tokens, uniform(0, 8));
        item.recent_begin = std::max(item.sink_end, item.context_tokens - uniform(0, 100));
      }
    }
    SCOPED_TRACE(testing::Message() << "round " << round);
    const Call in(dims, items, static_cast<int>(uniform(1, 140)), static_cast<int>(uniform(1, 16)), kHuge);
    const AttendPlan plan = Plan(in);
    ExpectConsistent(in, plan);
    ExpectFewestWaves(in, plan);
    ExpectBlocksCoverTheirRows(in, plan);
  }
}

// --- ScoreQuery and Store -----------------------------------------------------

ScoreInput Score(int64_t tokens, size_t bytes) {
  ScoreInput in;
  in.num_query_heads = 32;
  in.head_dim = 128;
  in.table_entries = (tokens + 15) / 16;
  in.tokens = tokens;
  in.workspace_bytes = bytes;
  return in;
}

TEST(PlannerScore, LaunchesHoldWholeTilesThatFit) {
  ScorePlan plan;
  ASSERT_TRUE(PlanScore(Score(100000, kHuge), &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 100000);  // everything at once

  const size_t ten_tiles = LayOutScore(Score(100000, 0), 10 * kAttendTile).end;
  ASSERT_TRUE(PlanScore(Score(100000, ten_tiles), &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 10 * kAttendTile);
  EXPECT_EQ(plan.at.end, ten_tiles);
  ASSERT_TRUE(PlanScore(Score(100000, ten_tiles - 1), &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 9 * kAttendTile);

  const size_t one_tile = LayOutScore(Score(100000, 0), kAttendTile).end;
  EXPECT_EQ(PlanScore(Score(100000, one_tile - 1), &plan).code(), absl::StatusCode::kResourceExhausted);
  // A range shorter than a tile needs only its own logits.
  const size_t short_range = LayOutScore(Score(50, 0), 50).end;
  ASSERT_TRUE(PlanScore(Score(50, short_range), &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 50);
}

TEST(PlannerScore, HugeTablesSaturate) {
  ScoreInput in = Score(1000, size_t{64} << 20);
  in.table_entries = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_EQ(LayOutScore(in, kAttendTile).end, std::numeric_limits<size_t>::max());
  ScorePlan plan;
  EXPECT_EQ(PlanScore(in, &plan).code(), absl::StatusCode::kResourceExhausted);
}

TEST(PlannerStore, PiecesHoldTheMostTokensThatFit) {
  const StoreInput unbounded{2, 8, 128, 10000, kHuge};
  StorePlan plan;
  ASSERT_TRUE(PlanStore(unbounded, &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 10000);

  const size_t hundred = LayOutStore(unbounded, 100).end;
  ASSERT_TRUE(PlanStore({2, 8, 128, 10000, hundred}, &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 100);
  ASSERT_TRUE(PlanStore({2, 8, 128, 10000, hundred - 1}, &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 99);
  EXPECT_LE(LayOutStore(unbounded, 99).end, hundred - 1);

  const size_t one = LayOutStore(unbounded, 1).end;
  ASSERT_TRUE(PlanStore({2, 8, 128, 10000, one}, &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 1);
  const absl::Status status = PlanStore({2, 8, 128, 10000, one - 1}, &plan);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("one token of 2 layers"), std::string::npos) << status;
}

TEST(PlannerStore, HugeRequestsSaturateAndStayWithinInt32Tokens) {
  const StoreInput huge{1 << 20, 1 << 10, 512, std::numeric_limits<int64_t>::max() / 2, size_t{64} << 20};
  EXPECT_EQ(LayOutStore(huge, huge.tokens).end, std::numeric_limits<size_t>::max());
  StorePlan plan;
  EXPECT_EQ(PlanStore(huge, &plan).code(), absl::StatusCode::kResourceExhausted);
  const StoreInput many{1, 1, 4, int64_t{1} << 40, std::numeric_limits<size_t>::max()};
  ASSERT_TRUE(PlanStore(many, &plan).ok());
  EXPECT_EQ(plan.piece_tokens, std::numeric_limits<int32_t>::max());
  EXPECT_TRUE(PlanStore({0, 8, 128, 100, kHuge}, &plan).ok());
  EXPECT_EQ(plan.piece_tokens, 0);
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv
