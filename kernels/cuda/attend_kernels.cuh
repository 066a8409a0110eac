// The CUDA read-side kernels: ScoreQuery logits, and fused split-KV
// (flash-decoding) decode attention with a log-sum-exp merge.
//
// They never dequantize the cache. A query is rotated once into the key
// codec's basis before they run (the prologue kernel's query preparation,
// prologue_kernels.cuh: PrepareParams, logit scale folded in); a key's logit is then
// the norm times a sum of rotated-query coordinates times codebook centroids
// read straight from the packed codes. Values with a rotated codec are summed
// in the rotated basis and mapped back once per output row (Merge). Codes are
// read where the page's layout puts them (kernels/code_tiles.h: packed codes
// tiled, raw numbers token-major), through token_codes.cuh.
//
// Decode work is planned on the host (planner.h) into AttendBlocks, one
// per (item, KV head, row chunk, token split), each run by a block of
// kAttendThreads threads (the fp32 kernel, LaunchAttend) or by one warp (the
// tensor-core kernel, LaunchAttendMma).
// A block's rows are the (query token, query head) pairs of one KV head, up to
// the kernel's kRows: every page is read once for all query heads of its KV
// head (GQA), and causal masking gives each row its own visible length. Each
// block writes an unnormalised partial (max logit, sum of exponentials,
// accumulator per row) and counts itself in its MergeUnit; the block that
// finishes a unit's last split, in whichever launch, merges the unit (no
// launch of its own): it combines the splits, normalises, applies the value
// rotation's inverse and writes the output and the log-sum-exp.
//
// The bf16 preset runs through the same kernel (raw bf16 keys and values): it
// is the baseline that the GPU benchmark compares against.
//
// Centering and exact tokens (kernels/backend.h, key_centering.h). An item's
// tokens fall into up to three segments: sinks and recent tokens on the exact fp16
// pages (the exact layout's PoolView and the item's exact block table,
// AttendKernelParams::exact), the rest on the compressed pages. The planner
// gives each segment its own blocks (splits), so a block never crosses a
// segment boundary; Merge sums each unit's compressed splits in the value
// codec's basis, maps them back, then adds the exact splits (plain basis).
// The pre-RoPE add-back (AddBackTables) is added to every logit inside the
// kernels; its constant part only shifts the log-sum-exp (Merge) or, for
// ScoreQuery, every logit. A logit soft cap is applied in both decode
// kernels, on the whole logit (AttendKernelParams::softcap); ScoreQuery's
// logits are never capped (the caller's post-pass).
//
// All pointers are device pointers.
#ifndef TQKV_KERNELS_CUDA_ATTEND_KERNELS_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_KERNELS_CUH_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/cuda/attend_desc.h"
#include "kernels/cuda/device_format.h"

namespace tqkv {
namespace cuda {

struct AddBackTables {
  const AddBackDesc* heads = nullptr;  // [item * num_kv_heads + kv_head]; null: no add-back
  const double* theta = nullptr;       // radians per position
  const float* coef = nullptr;
  // The most RoPE pairs of any of the launch's heads (host-set; 0: none):
  // it picks the fp16 kernel's loop (HmmaLoopFor).
  int32_t max_pairs = 0;
};

struct PoolView {
  const DeviceHead* heads = nullptr;  // [num_layers * num_kv_heads]
  const uint8_t* pool = nullptr;
  uint64_t page_bytes = 0;
  int32_t page_tokens = 0;
  int32_t page_shift = -1;  // log2(page_tokens) when a power of two, else -1
  int32_t num_kv_heads = 0;
  int32_t num_query_heads = 0;
  int32_t head_dim = 0;
};

// What the merge of a unit reads and writes (the compressed layout's view:
// its value codec).
struct MergeParams {
  PoolView view;
  const AttendItemDesc* items = nullptr;
  MergeUnit* units = nullptr;    // MergeUnit::arrived counts the finished splits
  float* partial_acc = nullptr;  // a unit's first split's rows: the merge's scratch
  const float* partial_stats = nullptr;
  float* output = nullptr;  // rows as queries
  float* lse = nullptr;     // [rows]; natural log
  // [rows], added to the lse: the add-back's constant part. Null: none.
  const float* lse_constant = nullptr;
};

struct AttendKernelParams {
  PoolView view;
  const int32_t* block_tables = nullptr;
  const AttendItemDesc* items = nullptr;
  const AttendBlock* blocks = nullptr;  // this launch's blocks
  int32_t num_blocks = 0;
  const float* prepared = nullptr;  // rows as in AttendItemDesc::query_row
  // Per partial: kMaxBlockRows rows of head_dim floats, and (max, sum) pairs.
  float* partial_acc = nullptr;
  float* partial_stats = nullptr;
  // Non-zero: the blocks read the items' exact pages (view is the exact
  // layout's, prepared its queries).
  int32_t exact = 0;
  AddBackTables addback;
  // Logit soft-capping (AttendParams::logit_softcap), 0: none. The kernels'
  // logits lack the add-back's constant part (MergeParams::lse_constant,
  // which Merge adds to the lse), so with a cap a logit x of output row o
  // becomes softcap * tanh((x + c) / softcap) - c, c = softcap_shift[o]
  // (null: 0); the lse plus c is then that of the capped true logits.
  float softcap = 0.0f;
  const float* softcap_shift = nullptr;  // rows as lse_constant
  MergeParams merge;
};

// logits[h][t - token_begin] for query heads h of one layer.
struct ScoreKernelParams {
  PoolView view;
  const int32_t* block_table = nullptr;
  int32_t layer = 0;
  int32_t token_begin = 0;
  int32_t token_end = 0;
  const float* prepared = nullptr;  // [num_query_heads][head_dim]
  float* logits = nullptr;          // [num_query_heads][token_end - token_begin]
  // The add-back: heads[kv_head] (one item), and constant[query head] added
  // to every logit (null: none).
  AddBackTables addback;
  const float* constant = nullptr;
};

// The decode kernels have an instance for every pair of the shared format
// table (kernels/format_table.h, FindFormatPair), dispatched in one place
// (format_dispatch.cuh). Whether ScoreQuery can read keys of this format
// (the table's reads_keys).
bool ScoreSupported(DeviceFieldFormat key);

// Whether the tensor-core kernel (TF32 mma, one warp per AttendBlock of up to
// kMaxBlockRows rows) reads this (key, value) pair at this head dim: head dims
// 64, 128, 256; fp16 or bf16 pairs, or single-part TurboQuant keys of 2-4 bits
// with uniform or TurboQuant values of 2-4 bits. Its outputs agree with the
// fp32 kernel to about 2e-3 (TF32 operands).
bool AttendMmaSupported(const DeviceField& key, const DeviceField& value, int head_dim);

// The fp16 tensor-core kernel (attend_hmma_impl.cuh: m16n8k16 on fp16 / bf16
// fragments built from the codes) for this (key, value) pair, head dim and
// page size: -1 where it has no instance, else its shape code, key bits * 32
// + value bits (16 for fp16 / bf16, 8 for fp8; split keys: format_table.h's
// SplitKeyBits(part 0's, part 1's)). Pairs: fp16, bf16, fp8 keys with fp8 or uniform values,
// single-part TurboQuant keys of 2-4 bits with uniform values of 2-4 bits,
// and of 3-4 bits with single-part TurboQuant values of 3-4 bits, split
// TurboQuant keys of 4 | 3 and 3 | 2 bits (halves of the state) with 3-bit
// TurboQuant values; head dims 64, 128, 256; page_tokens a multiple of 16
// (the layout's page_bytes below 2^32: device_tables.cc). Preferred over
// the TF32 and fp32 kernels wherever it applies.
int AttendHmmaShape(const DeviceField& key, const DeviceField& value, int head_dim, int page_tokens);

// One launch of the fp32 kernel for `pair` with block_rows rows per block.
cudaError_t LaunchAttend(FormatPair pair, int block_rows, const AttendKernelParams& params, cudaStream_t stream);
// A tensor-core kernel for `pair`, one warp per block of params.blocks: the
// fp16 one for shape >= 0 (an AttendHmmaShape code), else the TF32 one (its
// fields must pass AttendMmaSupported).
cudaError_t LaunchAttendMma(FormatPair pair, int shape, const AttendKernelParams& params, cudaStream_t stream);
// AttendBlocks of `pair`'s kernel (the fp16 kernel: its general loop) that one SM runs at once, from
// cudaOccupancyMaxActiveBlocksPerMultiprocessor: the fp32 kernel's thread
// blocks with `block_rows` rows at `head_dim` (one AttendBlock each), or with
// `mma` the tensor-core kernel's (shape as for LaunchAttendMma) thread blocks
// times their warps (one AttendBlock per warp). The planner's
// DeviceFigures::blocks_per_sm.
cudaError_t AttendBlocksPerSm(FormatPair pair, bool mma, int shape, int block_rows, int head_dim, int* blocks);
cudaError_t LaunchScore(DeviceFieldFormat key, const ScoreKernelParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_KERNELS_CUH_
