#include "kernels/cuda/attend_launch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kernels/cuda/device.h"
#include "base/status_macros.h"

namespace tqkv {
namespace cuda {

PoolView View(const KvLayout& layout, const PagePool& pool, const LayoutTables& tables) {
  PoolView v;
  v.heads = tables.heads;
  v.pool = pool.base;
  v.page_bytes = pool.page_bytes;
  v.page_tokens = layout.page_tokens();
  const int pt = layout.page_tokens();
  v.page_shift = (pt & (pt - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(pt)) : -1;
  v.num_kv_heads = layout.num_kv_heads();
  v.num_query_heads = layout.num_query_heads();
  v.head_dim = layout.head_dim();
  return v;
}

double ElapsedSeconds(Workspace& w) {
  float ms = 0.0f;
  if (cudaEventElapsedTime(&ms, w.start, w.stop) != cudaSuccess) {
    cudaGetLastError();
    return 0.0;
  }
  return ms * 1e-3;
}

LaunchKey KeyOf(const PoolTables& tables, int layer, bool exact, int block_rows) {
  const LayoutTables& t = exact ? tables.exact : tables.main;
  LaunchKey key;
  key.exact = exact;
  key.mma = t.layer_mma[layer];
  key.hmma = t.layer_hmma[layer];
  key.pair = t.layer_pair[layer];
  key.block_rows = block_rows;
  return key;
}

void PlanItemAddBack(const KvLayout& layout, float scale, const AttendItem& item, const PlanPiece& piece,
                     const AttendItemDesc& desc, Workspace& w) {
  if (layout.key_centering() == KeyCentering::kNone) return;
  const int d = layout.head_dim();
  const int qh = layout.num_query_heads();
  const int group = layout.query_heads_per_kv_head();
  w.constants.resize(desc.query_row + static_cast<size_t>(piece.tokens) * qh, 0.0f);
  for (int kv = 0; kv < layout.num_kv_heads(); ++kv) {
    if (!Centered(layout, item.key_mean)) {
      w.addback.push_back(AddBackDesc());
      continue;
    }
    // Row r = i * group + g: query token token0 + i, query head kv * group + g.
    const auto row_of = [&](int r) { return static_cast<size_t>(r / group) * qh + kv * group + r % group; };
    const float* queries = item.queries + static_cast<size_t>(piece.token0) * qh * d;
    float* constants = w.constants.data() + desc.query_row;
    w.addback.push_back(PlanAddBack(
        layout, item.layer, item.key_mean + static_cast<size_t>(kv) * d, piece.tokens * group, scale,
        [&](int r) { return queries + row_of(r) * d; }, [&](int r, float c) { constants[row_of(r)] = c; }, w));
  }
}

void SortBlocksByLaunch(const PoolTables& tables, const BatchContents& b, Workspace& w) {
  w.block_keys.clear();
  for (size_t i = 0; i < b.blocks.size(); ++i) {
    const BlockLaunch& launch = b.launches[i];
    w.block_keys.push_back(KeyOf(tables, b.items[b.blocks[i].item].layer, launch.exact, launch.block_rows));
  }
  w.block_order.resize(b.blocks.size());
  std::iota(w.block_order.begin(), w.block_order.end(), 0);
  std::stable_sort(w.block_order.begin(), w.block_order.end(),
                   [&w](int32_t x, int32_t y) { return w.block_keys[x] < w.block_keys[y]; });
  w.sorted_blocks.resize(b.blocks.size());
  w.sorted_keys.resize(b.blocks.size());
  for (size_t i = 0; i < w.block_order.size(); ++i) {
    w.sorted_blocks[i] = b.blocks[w.block_order[i]];
    w.sorted_keys[i] = w.block_keys[w.block_order[i]];
  }
}

void UnstageBatch(const KvLayout& layout, const AttendParams& p, const AttendBatch& batch, const AttendWorkspace& at,
                  Workspace& w) {
  const int d = layout.head_dim();
  const int qh = layout.num_query_heads();
  const BatchContents& b = w.batch;
  const float* output = reinterpret_cast<const float*>(w.host + at.output);
  const float* lse = reinterpret_cast<const float*>(w.host + at.lse);
  for (size_t i = 0; i < b.items.size(); ++i) {
    const PlanPiece& piece = w.plan.pieces[batch.piece_begin + i];
    const AttendItem& item = p.items[piece.item];
    const int64_t row = b.items[i].query_row;
    const size_t rows = static_cast<size_t>(piece.tokens) * qh;
    std::memcpy(item.output + static_cast<size_t>(piece.token0) * qh * d, output + row * d, sizeof(float) * rows * d);
    if (item.lse != nullptr) {
      std::memcpy(item.lse + static_cast<size_t>(piece.token0) * qh, lse + row, sizeof(float) * rows);
    }
  }
}

void AddPreparation(const PoolView& view, int64_t rows, size_t head_of_row, size_t queries, size_t prepared,
                    float scale, const Workspace& w, PrologueParams* prologue) {
  PrepareParams& prep = prologue->preparations[prologue->num_preparations++];
  prep.view = view;
  prep.num_rows = rows;
  prep.head_of_row = reinterpret_cast<const int32_t*>(w.device + head_of_row);
  prep.queries = reinterpret_cast<const float*>(w.device + queries);
  prep.prepared = reinterpret_cast<float*>(w.device + prepared);
  prep.scale = scale;
}

absl::Status LaunchDecode(const PoolView& view, const PoolView& exact_view, const AttendWorkspace& at, float softcap,
                          Workspace& w) {
  AttendKernelParams k;
  k.softcap = softcap;
  k.softcap_shift = AddBackOf(at).Constants(w.device);
  k.block_tables = reinterpret_cast<const int32_t*>(w.device + at.tables);
  k.items = reinterpret_cast<const AttendItemDesc*>(w.device + at.items);
  k.partial_acc = reinterpret_cast<float*>(w.device + at.partial_acc);
  k.partial_stats = reinterpret_cast<float*>(w.device + at.partial_stats);
  k.addback = AddBackOf(at).Tables(w.device);
  // The last split of each unit merges it (attend_kernels.cuh): no merge launch.
  MergeParams& merge = k.merge;
  merge.view = view;
  merge.items = k.items;
  merge.units = reinterpret_cast<MergeUnit*>(w.device + at.units);
  merge.partial_acc = k.partial_acc;
  merge.partial_stats = k.partial_stats;
  merge.output = reinterpret_cast<float*>(w.device + at.output);
  merge.lse = reinterpret_cast<float*>(w.device + at.lse);
  merge.lse_constant = AddBackOf(at).Constants(w.device);
  if (k.addback.heads != nullptr) {
    for (const AddBackDesc& d : w.addback) k.addback.max_pairs = std::max(k.addback.max_pairs, d.pairs);
  }
  const AttendBlock* device_blocks = reinterpret_cast<const AttendBlock*>(w.device + at.blocks);
  for (size_t first = 0; first < w.sorted_blocks.size();) {
    size_t last = first;
    const LaunchKey& key = w.sorted_keys[first];
    while (last < w.sorted_keys.size() && w.sorted_keys[last] == key) ++last;
    k.blocks = device_blocks + first;
    k.num_blocks = static_cast<int32_t>(last - first);
    k.exact = key.exact ? 1 : 0;
    k.view = key.exact ? exact_view : view;
    k.prepared = reinterpret_cast<const float*>(w.device + (key.exact ? at.prepared_exact : at.prepared));
    if (key.mma) {
      RETURN_IF_ERROR(CudaStatus(LaunchAttendMma(key.pair, key.hmma, k, w.stream), "tensor-core attend kernel launch"));
    } else {
      RETURN_IF_ERROR(CudaStatus(LaunchAttend(key.pair, key.block_rows, k, w.stream), "attend kernel launch"));
    }
    first = last;
  }

  return absl::OkStatus();
}

absl::Status MeasureOccupancy(const KvLayout& layout, LayoutTables* t) {
  const int rows = BlockRowsFor(std::min(layout.query_heads_per_kv_head(), kMaxBlockRows));
  t->layer_blocks_per_sm.clear();
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    int blocks = 0;
    RETURN_IF_ERROR(CudaStatus(AttendBlocksPerSm(t->layer_pair[layer], t->layer_mma[layer], t->layer_hmma[layer], rows,
                                                 layout.head_dim(), &blocks),
                               "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
    t->layer_blocks_per_sm.push_back(std::max(1, blocks));
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace tqkv
