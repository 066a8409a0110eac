// The plain structs a decode plan consists of (AttendItemDesc, AttendBlock,
// MergeUnit, AddBackDesc) and the kernel constants a plan depends on, shared
// by the kernels (nvcc and the host emulation), the kernels' launchers and
// the host planner (planner.h). No CUDA types: the planner and its tests
// compile without nvcc.
#ifndef TQKV_KERNELS_CUDA_ATTEND_DESC_H_
#define TQKV_KERNELS_CUDA_ATTEND_DESC_H_

#include <cstdint>

namespace tqkv {
namespace cuda {

inline constexpr int kAttendThreads = 128;
// Tokens per tile of a block's loop.
inline constexpr int kAttendTile = 128;
// The most rows one block handles (template instances: 1, 2, 4, 8).
inline constexpr int kMaxBlockRows = 8;

// One (item, query token chunk) of a decode batch, as planned.
struct AttendItemDesc {
  int64_t block_table = 0;        // offset into AttendKernelParams::block_tables
  int64_t exact_block_table = 0;  // the same, of the item's exact pages
  int32_t context_tokens = 0;
  int32_t num_query_tokens = 0;
  int32_t layer = 0;
  int32_t pad = 0;
  int64_t query_row = 0;  // first row in queries / output: row = query_row + i * query_heads + h
};

// One thread block: rows [row0, row0 + rows) of (item, kv_head), where row
// r = i * group + g is query token i, query head kv_head * group + g; tokens
// [token_begin, token_end).
struct AttendBlock {
  int32_t item = 0;
  int32_t kv_head = 0;
  int32_t row0 = 0;
  int32_t rows = 0;
  int32_t token_begin = 0;
  int32_t token_end = 0;
  int32_t partial = 0;  // index of this block's partial result
  int32_t unit = 0;     // the MergeUnit of its split
};

// The splits of one (item, kv_head, row chunk): partials [first_partial,
// first_partial + num_splits), of which the first basis_splits read
// compressed pages (accumulated in the value codec's basis) and the others
// exact pages (plain coordinates). The decode kernels count the splits they
// finish in `arrived` (0 as staged); the one that finishes the last merges
// them (attend_kernels.cuh). Every unit has at least one split.
struct MergeUnit {
  int32_t item = 0;
  int32_t kv_head = 0;
  int32_t row0 = 0;
  int32_t rows = 0;
  int32_t first_partial = 0;
  int32_t num_splits = 0;
  int32_t basis_splits = 0;
  int32_t arrived = 0;
};

// The pre-RoPE add-back of one (item, KV head) (kernels/key_centering.h),
// the logit scale folded in: the logit of block row r (AttendBlock's row
// numbering; ScoreQuery: the query head's index in its group) at token t
// gains
//   sum_i A[r][i] cos(t theta_i) + B[r][i] sin(t theta_i),  i < pairs,
// theta_i = AddBackTables::theta[theta + i], A[r] = coef + r * 2 * pairs in
// AddBackTables::coef, B[r] = A[r] + pairs. pairs 0: nothing to add.
struct AddBackDesc {
  int32_t pairs = 0;
  int32_t pad = 0;
  int64_t theta = 0;
  int64_t coef = 0;
};

// Block rows an instance uses for `rows` rows: 1, 2, 4 or 8 (the fp32
// kernel's template instances; the tensor-core kernel always holds 8).
constexpr int BlockRowsFor(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kMaxBlockRows; }

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_DESC_H_
