// The fp32 (SIMT) decode kernel, the merge of split partials and the score
// kernel. Part of attend_kernels_impl.cuh's translation unit.
#ifndef TQKV_KERNELS_CUDA_ATTEND_SIMT_IMPL_CUH_
#define TQKV_KERNELS_CUDA_ATTEND_SIMT_IMPL_CUH_

#include "kernels/cuda/attend_common_impl.cuh"

namespace tqkv {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// The fused decode kernel.

// Dynamic shared memory: queries [kRows][head_dim] (+32 floats of zeros past
// the end), logits / probabilities [kRows][kAttendTile], output [kRows][head_dim].
__host__ __device__ constexpr size_t AttendSharedBytes(int rows, int head_dim) {
  return sizeof(float) * (static_cast<size_t>(rows) * head_dim * 2 + 32 + static_cast<size_t>(rows) * kAttendTile);
}

// One tile's step of the online softmax, one warp per row: the tile's max,
// its probabilities relative to the new running max (written over the
// logits), and the factor for what came before (row_alpha). Shared arrays.
template <int kRows>
__device__ __forceinline__ void TileSoftmax(float* s_logit, float* row_max, float* row_sum, float* row_alpha) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int r = warp; r < kRows; r += kWarps) {
    float* logit = s_logit + r * kAttendTile;
    float tile_max = -INFINITY;
    for (int k = lane; k < kAttendTile; k += 32) tile_max = fmaxf(tile_max, logit[k]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullWarp, tile_max, offset));
    }
    const float old_max = row_max[r];
    const float new_max = fmaxf(old_max, tile_max);
    float sum = 0.0f;
    for (int k = lane; k < kAttendTile; k += 32) {
      const float x = logit[k];
      const float e = x == -INFINITY ? 0.0f : expf(x - new_max);
      logit[k] = e;
      sum += e;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullWarp, sum, offset);
    __syncwarp();
    if (lane == 0) {
      const float alpha = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
      row_alpha[r] = alpha;
      row_sum[r] = row_sum[r] * alpha + sum;
      row_max[r] = new_max;
    }
  }
}

template <DeviceFieldFormat kKey, DeviceFieldFormat kValue, int kRows>
__global__ void __launch_bounds__(kAttendThreads) AttendKernel(__grid_constant__ const AttendKernelParams p) {
  static_assert(FamilyInfo(kKey).reads_keys, "a key family the table says holds no keys");
  float* shared = DynamicSharedFloats();
  __shared__ BlockTables tables;
  __shared__ int visible[kRows];
  __shared__ float row_max[kRows], row_sum[kRows], row_alpha[kRows], row_shift[kRows];

  const PoolView& view = p.view;
  const int d = view.head_dim;
  const AttendBlock b = p.blocks[blockIdx.x];
  const AttendItemDesc item = p.items[b.item];
  const DeviceHead& head = view.heads[item.layer * view.num_kv_heads + b.kv_head];
  const int group = view.num_query_heads / view.num_kv_heads;
  const int32_t* block_table = p.block_tables + (p.exact ? item.exact_block_table : item.block_table);
  const AddBackDesc addback =
      p.addback.heads != nullptr ? p.addback.heads[b.item * view.num_kv_heads + b.kv_head] : AddBackDesc();

  float* s_q = shared;
  float* s_logit = s_q + kRows * d + 32;
  float* s_out = s_logit + kRows * kAttendTile;

  LoadTables(head, tables);
  for (int i = threadIdx.x; i < kRows * d + 32; i += kAttendThreads) {
    const int r = i / d;
    float q = 0.0f;
    if (r < b.rows) {
      const int row = b.row0 + r;
      const int token = row / group;
      const int h = b.kv_head * group + row % group;
      q = p.prepared[(item.query_row + static_cast<int64_t>(token) * view.num_query_heads + h) * d + i % d];
    }
    s_q[i] = q;
  }
  for (int i = threadIdx.x; i < kRows * d; i += kAttendThreads) s_out[i] = 0.0f;
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    const int token = (b.row0 + r) / group;
    // Rows past b.rows see nothing; they only pad the instance's row count.
    visible[r] = r < b.rows ? item.context_tokens - item.num_query_tokens + 1 + token : 0;
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
    row_shift[r] = SoftCapShift(p, item, b, group, r);
  }
  __syncthreads();

  const int chunks = d / 8;
  const int value_slots = kAttendThreads / chunks;
  const int value_slot = threadIdx.x / chunks;
  const int chunk = threadIdx.x % chunks;
  float acc[kRows][8];
  float zero_acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    zero_acc[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
  }

  for (int tile = b.token_begin; tile < b.token_end; tile += kAttendTile) {
    const int count = min(kAttendTile, b.token_end - tile);
    ScoreTile<kKey, kRows>(view, head.key, tables, block_table, tile, count, visible, s_q, d, s_logit);
    __syncthreads();
    if (addback.pairs > 0) {  // the same for the whole block
      AddBackTile<kRows>(p.addback, addback, b.row0, b.rows, tile, count, s_logit);
      __syncthreads();
    }
    if (p.softcap > 0.0f) {  // the same for the whole launch
      for (int i = threadIdx.x; i < kRows * kAttendTile; i += kAttendThreads) {
        float& logit = s_logit[i];
        if (logit != -INFINITY) logit = SoftCap(logit, p.softcap, row_shift[i / kAttendTile]);
      }
      __syncthreads();
    }
    TileSoftmax<kRows>(s_logit, row_max, row_sum, row_alpha);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float alpha = row_alpha[r];
      zero_acc[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
    }
    if (value_slot < value_slots) {
      for (int k = value_slot; k < count; k += value_slots) {
        const TokenAddress at = Locate(view, block_table, tile + k);
        AccumulateToken<kValue, kRows>(head.value, view.page_tokens, tables, at.page, at.slot, chunk, s_logit, k, acc,
                                       zero_acc);
      }
    }
    __syncthreads();
  }

  // Sum the token slots' accumulators in a fixed order.
  for (int s = 0; s < value_slots; ++s) {
    if (value_slot == s) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s_out[r * d + chunk * 8 + e] += acc[r][e] + zero_acc[r];
      }
    }
    __syncthreads();
  }
  float* stats = p.partial_stats + static_cast<int64_t>(b.partial) * kMaxBlockRows * 2;
  float* out = p.partial_acc + static_cast<int64_t>(b.partial) * kMaxBlockRows * d;
  for (int i = threadIdx.x; i < b.rows * d; i += kAttendThreads) out[i] = s_out[i];
  const int r = static_cast<int>(threadIdx.x);
  if (r < b.rows) {
    stats[2 * r] = row_max[r];
    stats[2 * r + 1] = row_sum[r];
  }
  MergeIfLastBlock(p.merge, b.unit);
}

// ---------------------------------------------------------------------------
// ScoreQuery: logits of one layer's query heads over a token range.
// grid.x: tiles of kAttendTile tokens; grid.y: KV head * row chunks.

template <DeviceFieldFormat kKey, int kRows>
__global__ void __launch_bounds__(kAttendThreads) ScoreKernel(ScoreKernelParams p) {
  static_assert(FamilyInfo(kKey).reads_keys, "a key family the table says holds no keys");
  float* shared = DynamicSharedFloats();
  __shared__ BlockTables tables;
  __shared__ int visible[kRows];
  const PoolView& view = p.view;
  const int d = view.head_dim;
  const int group = view.num_query_heads / view.num_kv_heads;
  const int chunks_per_head = (group + kRows - 1) / kRows;
  const int kv = blockIdx.y / chunks_per_head;
  const int row0 = (blockIdx.y % chunks_per_head) * kRows;
  const int rows = min(kRows, group - row0);
  const DeviceHead& head = view.heads[p.layer * view.num_kv_heads + kv];
  float* s_q = shared;
  float* s_logit = s_q + kRows * d + 32;
  LoadTables(head, tables);
  for (int i = threadIdx.x; i < kRows * d + 32; i += kAttendThreads) {
    const int r = i / d;
    s_q[i] = r < rows ? p.prepared[static_cast<int64_t>(kv * group + row0 + r) * d + i % d] : 0.0f;
  }
  if (threadIdx.x < kRows) visible[threadIdx.x] = p.token_end;
  __syncthreads();
  const int tile = p.token_begin + blockIdx.x * kAttendTile;
  const int count = min(kAttendTile, p.token_end - tile);
  ScoreTile<kKey, kRows>(view, head.key, tables, p.block_table, tile, count, visible, s_q, d, s_logit);
  __syncthreads();
  if (p.addback.heads != nullptr && p.addback.heads[kv].pairs > 0) {
    AddBackTile<kRows>(p.addback, p.addback.heads[kv], row0, rows, tile, count, s_logit);
    __syncthreads();
  }
  const int64_t columns = p.token_end - p.token_begin;
  for (int r = 0; r < rows; ++r) {
    const float constant = p.constant != nullptr ? p.constant[kv * group + row0 + r] : 0.0f;
    for (int k = threadIdx.x; k < count; k += kAttendThreads) {
      p.logits[static_cast<int64_t>(kv * group + row0 + r) * columns + (tile - p.token_begin) + k] =
          s_logit[r * kAttendTile + k] + constant;
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_SIMT_IMPL_CUH_
