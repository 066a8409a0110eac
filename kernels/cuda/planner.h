// The CUDA backend's host planner: plan, then run (as FlashInfer splits its
// decode into a plan on the host and a run on the device). Pure host code, no
// CUDA types (tqkv_cuda_planner builds without nvcc); the real and the
// emulated device run the same plans.
//
// A call is described by plain numbers: the layout's dims (PlanDims), its
// items (PlanItem: context, query tokens, which segments it reads, which
// kernel), what the device runs at once (DeviceFigures, from the occupancy
// API), and the workspace capacity. The planner returns
//   - Attend: the split size (tokens per AttendBlock), the items cut into
//     pieces of query tokens, the pieces grouped into batches that each fit
//     one workspace, and for each batch the byte offset of every buffer in the
//     workspace (AttendWorkspace). FillAttendBatch then writes a batch's
//     AttendItemDescs, AttendBlocks and MergeUnits;
//   - ScoreQuery: the tokens per launch and the buffers' offsets;
//   - Store: the tokens per piece and the buffers' offsets.
// The offsets are the one computation of workspace bytes: whether a piece
// fits is decided by laying the workspace out (LayOut*) with the piece's
// exact element counts, and the backend stages at those same offsets. All
// byte arithmetic saturates: a size that would overflow size_t lays out to
// SIZE_MAX bytes and so never fits.
//
// The split rules (PlanAttend):
//   - the device's resident AttendBlocks, sm_count x blocks_per_sm, are the
//     target: a grid of at most that many blocks runs in one wave, and a few
//     blocks more start a second wave that is nearly empty yet takes as long
//     as a full one (on an H200, bf16 at 32k context: batch 16, 1664 blocks
//     for 1584 resident slots, took 3.0x the time of batch 8);
//   - the split is the shortest multiple of kSplitGranularity tokens, at
//     least kMinSplitTokens, whose blocks fit the fewest waves the call
//     allows: one wave whenever one block per (piece, KV head, row chunk,
//     segment) fits the target, else the fewest whole waves. The shortest
//     such split makes the longest block, which sets a wave's time, as
//     short as it can be. Blocks are counted by the walk that fills the
//     batches, so segments, row chunks and items shorter than a split count
//     as the blocks they make;
//   - a block never crosses a segment (compressed run, sinks, recent tokens) nor a
//     row chunk (BlockRowsFor of the piece's rows; 8 rows for the
//     tensor-core kernel), so segments and chunks add blocks;
//   - an item's query tokens are cut into pieces of at most
//     kMaxQueryTokensPerPiece, halved while one piece does not fit a
//     workspace; in a sliding-window layer every query token is a piece (a
//     block's rows share one first visible token).
//
// Errors: INVALID_ARGUMENT for impossible input (no query token, a context
// shorter than its query tokens or beyond int32 positions, zero dims or
// device figures); RESOURCE_EXHAUSTED when a single query token of one item
// (Attend), one tile of logits (Score) or one token (Store) cannot fit a
// workspace.
//
// Thread safety: plain functions; outputs belong to the caller.
#ifndef TQKV_KERNELS_CUDA_PLANNER_H_
#define TQKV_KERNELS_CUDA_PLANNER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/attend_desc.h"

namespace tqkv {
namespace cuda {

// Query tokens of one item handled together; longer items are cut into
// pieces (each sees its own causal prefix).
inline constexpr int kMaxQueryTokensPerPiece = 32;
// The shortest split: below two tiles a block's setup (query load, tables)
// outweighs its reads.
inline constexpr int64_t kMinSplitTokens = 2 * kAttendTile;
// Splits are whole multiples of this many tokens: the tensor-core kernel's
// token tile. Coarser steps (a whole kAttendTile) leave the block count
// far from the target: just over it is a second wave.
inline constexpr int64_t kSplitGranularity = 16;
// Every buffer in a workspace starts at a multiple of this.
inline constexpr size_t kWorkspaceAlignment = 256;

// What the device runs at once, read by the backend through the CUDA runtime
// (cudaDevAttrMultiProcessorCount, cudaOccupancyMaxActiveBlocksPerMultiprocessor;
// the emulated device answers both).
struct DeviceFigures {
  int sm_count = 0;
  // AttendBlocks resident on one SM: the occupancy API's thread blocks per
  // SM times the AttendBlocks one thread block runs (1 for the fp32 kernel,
  // one per warp for the tensor-core kernel).
  int blocks_per_sm = 0;
};

// The layout, as far as the plan depends on it.
struct PlanDims {
  int num_kv_heads = 0;
  int num_query_heads = 0;  // a multiple of num_kv_heads
  int head_dim = 0;
  int page_tokens = 0;
  int exact_page_tokens = 0;  // 0: the layout keeps no exact tokens
  bool centered = false;      // key centering: the add-back arrays are staged
};

// One Attend item.
struct PlanItem {
  int64_t context_tokens = 0;  // as AttendItem::context_tokens
  int32_t query_tokens = 1;
  // As AttendItem::first_query_position (-1: the last query_tokens stored
  // tokens); such items are cut into one-token pieces.
  int64_t first_query_position = -1;
  int32_t layer = 0;
  // Reads exact pages (the layout keeps exact tokens and the item has an
  // exact block table): segments from the exact ranges of context_tokens.
  bool exact = false;
  int64_t sink_end = 0;      // exact: tokens [0, sink_end) are sinks
  int64_t recent_begin = 0;  // exact: tokens [recent_begin, context) are recent
  int64_t window = 0;        // the layer's sliding window (0: full attention)
  bool mma = false;          // the tensor-core kernel reads the layer (8-row blocks)
  // The sum over KV heads of the key mean's active RoPE pairs (add-back
  // thetas per piece); 0 without a mean.
  int64_t addback_pairs = 0;
};

struct AttendPlanInput {
  PlanDims dims;
  absl::Span<const PlanItem> items;
  DeviceFigures device;
  size_t workspace_bytes = 0;
};

// Query tokens [token0, token0 + tokens) of items[item].
struct PlanPiece {
  int32_t item = 0;
  int32_t token0 = 0;
  int32_t tokens = 0;
};

// Element counts of the arrays one batch stages.
struct AttendCounts {
  int64_t items = 0;          // AttendItemDesc, one per piece
  int64_t blocks = 0;         // AttendBlock; also the partial results
  int64_t units = 0;          // MergeUnit
  int64_t rows = 0;           // query rows (query tokens x query heads)
  int64_t table_entries = 0;  // int32 block table entries, compressed and exact
  int64_t addback_heads = 0;  // AddBackDesc
  int64_t theta = 0;          // double
  int64_t coef = 0;           // float
  int64_t constants = 0;      // float, one per row

  AttendCounts& operator+=(const AttendCounts& o);
};

// Byte offsets of one Attend batch's buffers in a workspace, in this order;
// [0, copy_in) is copied in, [output, end) copied out.
struct AttendWorkspace {
  size_t items = 0, blocks = 0, units = 0, head_of_row = 0, tables = 0, queries = 0;
  bool addback = false;  // the add-back arrays are staged
  size_t addback_heads = 0, theta = 0, coef = 0, constants = 0;
  size_t copy_in = 0;
  size_t prepared = 0, prepared_exact = 0;  // prepared_exact: empty without exact tokens
  size_t partial_acc = 0, partial_stats = 0;
  size_t output = 0, lse = 0;
  size_t end = 0;  // bytes used; SIZE_MAX when they overflow size_t
};

// The one layout of a batch with `counts` elements.
AttendWorkspace LayOutAttend(const PlanDims& dims, const AttendCounts& counts);

struct AttendBatch {
  size_t piece_begin = 0;  // pieces [piece_begin, piece_end) of the plan
  size_t piece_end = 0;
  AttendCounts counts;
  AttendWorkspace at;  // at.end <= workspace_bytes
};

struct AttendPlan {
  int64_t target_blocks = 0;  // sm_count x blocks_per_sm
  // Tokens per block: a multiple of kSplitGranularity, >= kMinSplitTokens.
  int64_t split = 0;
  // Blocks of the whole call (over its batches) and the waves of
  // target_blocks they take: 1 whenever one wave is possible.
  int64_t blocks = 0;
  int64_t waves = 0;
  std::vector<PlanPiece> pieces;
  std::vector<AttendBatch> batches;
  // PlanAttend's scratch (the lengths of the runs it splits), kept so that
  // a reused plan allocates nothing.
  std::vector<int64_t> runs;
};

// Plans one Attend call into *plan (its vectors are reused).
absl::Status PlanAttend(const AttendPlanInput& input, AttendPlan* plan);

// The entries of one piece's block tables: the compressed table's first
// `pages` entries, then (exact) the first `exact_pages` of the exact table.
struct PieceTables {
  int64_t pages = 0;
  int64_t exact_pages = 0;
};

// Which launch runs a block: it reads exact pages or not, with `block_rows`
// rows (a template argument of the fp32 kernel).
struct BlockLaunch {
  bool exact = false;
  int32_t block_rows = 0;
};

// The plan's arrays of one batch, indexed as the kernels index them: item
// descs (block tables at offsets of the batch's table array, query rows),
// blocks with their launches, merge units, the KV head (layer * num_kv_heads
// + kv_head) of every query row. The add-back descs and the table and query
// contents are the backend's to write (from the counts and offsets here).
struct BatchContents {
  std::vector<AttendItemDesc> items;  // one per piece of the batch
  std::vector<PieceTables> tables;    // one per piece
  std::vector<AttendBlock> blocks;
  std::vector<BlockLaunch> launches;  // one per block
  std::vector<MergeUnit> units;
  std::vector<int32_t> head_of_row;
};

// Writes `batch` of `plan` (made by PlanAttend from `input`) into *out; its
// arrays hold exactly batch.counts elements.
void FillAttendBatch(const AttendPlanInput& input, const AttendPlan& plan, const AttendBatch& batch,
                     BatchContents* out);

// ScoreQuery of `tokens` tokens of one layer: the staged arrays' sizes.
struct ScoreInput {
  int num_query_heads = 0;
  int head_dim = 0;
  bool exact = false;         // reads exact pages too (a second prepared query)
  int64_t table_entries = 0;  // int32 block table entries, compressed and exact
  int64_t addback_heads = 0;  // AddBackDesc
  int64_t theta = 0;          // double
  int64_t coef = 0;           // float
  int64_t constants = 0;      // float
  int64_t tokens = 0;         // the range's tokens
  size_t workspace_bytes = 0;
};

// Byte offsets of ScoreQuery's buffers; [0, copy_in) is copied in; logits
// hold num_query_heads x `piece_tokens` floats.
struct ScoreWorkspace {
  size_t table = 0, heads = 0, queries = 0;
  bool addback = false;
  size_t addback_heads = 0, theta = 0, coef = 0, constants = 0;
  size_t copy_in = 0;
  size_t prepared = 0, prepared_exact = 0, logits = 0;
  size_t end = 0;  // SIZE_MAX on overflow
};

struct ScorePlan {
  // Tokens per launch: whole tiles, or every token of a shorter range.
  int64_t piece_tokens = 0;
  ScoreWorkspace at;
};

ScoreWorkspace LayOutScore(const ScoreInput& input, int64_t piece_tokens);
absl::Status PlanScore(const ScoreInput& input, ScorePlan* plan);

// Store of `tokens` tokens of `layers` layers: keys and values as fp32.
struct StoreInput {
  int layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t tokens = 0;
  size_t workspace_bytes = 0;
};

// Byte offsets of one store piece's buffers, all copied in; keys and values
// [layer][token][kv_head][head_dim] of the piece's tokens, then slots, then
// the error word.
struct StoreWorkspace {
  size_t keys = 0, values = 0, slots = 0, error = 0;
  size_t end = 0;  // SIZE_MAX on overflow
};

struct StorePlan {
  int64_t piece_tokens = 0;  // tokens per piece (the last may have fewer)
};

StoreWorkspace LayOutStore(const StoreInput& input, int64_t piece_tokens);
absl::Status PlanStore(const StoreInput& input, StorePlan* plan);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_PLANNER_H_
