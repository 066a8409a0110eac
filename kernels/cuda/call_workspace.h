// A CUDA backend call's host-side workspace (stream, events, pinned and
// device buffers, and the plans reused from call to call), the launch key
// that groups decode blocks into launches, and the pre-RoPE add-back's
// plans (key_centering.h's terms, per item and KV head, in the workspace).
#ifndef TQKV_KERNELS_CUDA_CALL_WORKSPACE_H_
#define TQKV_KERNELS_CUDA_CALL_WORKSPACE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/planner.h"
#include "kernels/format_table.h"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace cuda {

// Which decode launch runs a block: blocks with equal keys go in one launch.
// Ordered as the launches are made: fp32 before tensor-core kernels, reads
// of compressed pages before reads of exact pages, then by format pair and rows.
struct LaunchKey {
  bool exact = false;                       // reads exact pages (the exact layout's view)
  bool mma = false;                         // a tensor-core kernel
  FormatPair pair = FormatPair::kFp16Fp16;  // the layer's formats (kernels/format_table.h)
  int block_rows = 0;                       // the fp32 kernel's rows per block (template argument)
  int hmma = -1;                            // the fp16 tensor-core kernel's shape (LayoutTables::layer_hmma)

  auto Tied() const { return std::tie(exact, mma, pair, block_rows, hmma); }
  bool operator<(const LaunchKey& o) const { return Tied() < o.Tied(); }
  bool operator==(const LaunchKey& o) const { return Tied() == o.Tied(); }
};

struct Workspace {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  uint8_t* host = nullptr;  // pinned
  uint8_t* device = nullptr;
  // Host-side plans, reused from call to call.
  std::vector<cuda::PlanItem> plan_items;
  cuda::AttendPlan plan;
  cuda::BatchContents batch;
  std::vector<LaunchKey> block_keys;  // batch.blocks[i]'s launch
  std::vector<int32_t> block_order;   // blocks by launch key
  std::vector<AttendBlock> sorted_blocks;
  std::vector<LaunchKey> sorted_keys;
  std::vector<int32_t> tables;
  // The add-back (AddBackDesc): per (item, KV head), thetas, coefficients,
  // and each row's constant.
  std::vector<cuda::AddBackDesc> addback;
  std::vector<double> theta;
  std::vector<float> coef;
  std::vector<float> constants;
  std::vector<int> pairs;
};

// The add-back of `rows` query rows against one KV head's key mean `mean` in
// `layer` (rotated with that layer's RoPE, KvLayout::rope(layer); the thetas
// travel with the call, so layers of different RoPEs need no device table)
// (key_centering.h, MakeAddBackTerms, in the same double arithmetic): appends
// the mean's active pairs' thetas and each row's coefficients (A then B,
// `scale` folded in) to w and returns their desc; constant(r, c) receives
// each row's constant part. query_of(r) is row r's query.
template <typename QueryOf, typename Constant>
cuda::AddBackDesc PlanAddBack(const KvLayout& layout, int layer, const float* mean, int rows, float scale,
                              const QueryOf& query_of, const Constant& constant, Workspace& w) {
  const RopeTable& rope = layout.rope(layer);
  const int d = layout.head_dim();
  w.pairs.clear();
  for (int i = 0; i < rope.num_pairs(); ++i) {
    if (mean[rope.first(i)] != 0.0f || mean[rope.second(i)] != 0.0f) w.pairs.push_back(i);
  }
  cuda::AddBackDesc desc;
  desc.pairs = static_cast<int32_t>(w.pairs.size());
  desc.theta = static_cast<int64_t>(w.theta.size());
  desc.coef = static_cast<int64_t>(w.coef.size());
  for (int i : w.pairs) w.theta.push_back(rope.inv_freq(i));
  for (int r = 0; r < rows; ++r) {
    const float* q = query_of(r);
    double c = 0.0;
    for (int j = 0; j < d; ++j) {
      if (rope.num_pairs() == 0 || rope.pair_of(j) < 0) c += static_cast<double>(q[j]) * mean[j];
    }
    constant(r, static_cast<float>(c * scale));
    for (int i : w.pairs) {
      const double qa = q[rope.first(i)], qb = q[rope.second(i)];
      w.coef.push_back(static_cast<float>(scale * (qa * mean[rope.first(i)] + qb * mean[rope.second(i)])));
    }
    for (int i : w.pairs) {
      const double qa = q[rope.first(i)], qb = q[rope.second(i)];
      w.coef.push_back(static_cast<float>(scale * (qb * mean[rope.first(i)] - qa * mean[rope.second(i)])));
    }
  }
  return desc;
}

// Whether a read with `key_mean` adds the centering back.
bool Centered(const KvLayout& layout, const float* key_mean);

// The active RoPE pairs of a key mean (those PlanAddBack adds back), summed
// over KV heads of `layer`: what the planner sizes the add-back arrays by.
int64_t ActivePairs(const KvLayout& layout, int layer, const float* key_mean);

// Where a call's add-back arrays sit in its workspace (the plan's offsets);
// none without centering.
struct AddBackAt {
  bool any = false;
  size_t heads = 0, theta = 0, coef = 0, constants = 0;

  cuda::AddBackTables Tables(const uint8_t* device) const {
    cuda::AddBackTables t;
    if (!any) return t;
    t.heads = reinterpret_cast<const cuda::AddBackDesc*>(device + heads);
    t.theta = reinterpret_cast<const double*>(device + theta);
    t.coef = reinterpret_cast<const float*>(device + coef);
    return t;
  }
  const float* Constants(const uint8_t* device) const {
    return any ? reinterpret_cast<const float*>(device + constants) : nullptr;
  }
};

// The add-back offsets of an AttendWorkspace or a ScoreWorkspace.
template <typename PlannedWorkspace>
AddBackAt AddBackOf(const PlannedWorkspace& at) {
  return AddBackAt{at.addback, at.addback_heads, at.theta, at.coef, at.constants};
}

// The add-back arrays into the workspace's pinned buffer, at `at`.
void CopyAddBack(const AddBackAt& at, Workspace& w);

// Empties the workspace's add-back arrays.
void ClearAddBack(Workspace& w);

// Copies `tokens` query tokens of `layer` ([tokens, query heads, head_dim]
// floats) to `to`, each row multiplied by its KV head's key scales where the
// layout or the sequence (after its `key_mean`) has them
// (KvLayout::key_scales): the queries the stored keys are read with. The
// add-back (PlanAddBack) takes the queries as given.
void StageQueries(const KvLayout& layout, int layer, const float* key_mean, const float* queries, int64_t tokens,
                  uint8_t* to);

// ScoreQuery's add-back: one desc per KV head, its rows the group's query
// heads; constants per query head (added to every logit).
void PlanScoreAddBack(const KvLayout& layout, const ScoreParams& p, Workspace& w);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_CALL_WORKSPACE_H_
