// The host side of a decode batch on the CUDA backend, below the backend
// class: pool views, launch keys and the blocks sorted by them, the
// add-back of a piece, the outputs copied back, the query preparations
// added to the prologue, and the decode launches (which merge). Free functions
// over a call's Workspace (call_workspace.h) and a pool's tables
// (device_tables.h).
#ifndef TQKV_KERNELS_CUDA_ATTEND_LAUNCH_H_
#define TQKV_KERNELS_CUDA_ATTEND_LAUNCH_H_

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/call_workspace.h"
#include "kernels/cuda/device_tables.h"
#include "kernels/cuda/planner.h"
#include "kernels/cuda/prologue_kernels.cuh"
#include "kernels/kv_layout.h"

namespace tqkv {
namespace cuda {

// `layout` and `tables` of the same layout: the cache's or its exact one.
PoolView View(const KvLayout& layout, const PagePool& pool, const LayoutTables& tables);

// The device time between the workspace's start and stop events, in
// seconds (0 when it cannot be read).
double ElapsedSeconds(Workspace& w);

// The launch of a block of `layer` with `block_rows` rows that reads exact
// pages or not.
LaunchKey KeyOf(const PoolTables& tables, int layer, bool exact, int block_rows);

// The add-back of one piece (nothing without centering): a desc per KV
// head (pairs 0 for an item without a mean) and each row's constant.
void PlanItemAddBack(const KvLayout& layout, float scale, const AttendItem& item, const PlanPiece& piece,
                     const AttendItemDesc& desc, Workspace& w);

// One launch per launch key: the blocks sorted by it.
void SortBlocksByLaunch(const PoolTables& tables, const BatchContents& b, Workspace& w);

// The outputs the batch's copy out brought back, to the items.
void UnstageBatch(const KvLayout& layout, const AttendParams& p, const AttendBatch& batch, const AttendWorkspace& at,
                  Workspace& w);

// The preparation of `rows` queries staged at `queries` (rows' KV heads at
// `head_of_row`) for `view`, into `prepared` (workspace offsets), added to
// the prologue.
void AddPreparation(const PoolView& view, int64_t rows, size_t head_of_row, size_t queries, size_t prepared,
                    float scale, const Workspace& w, PrologueParams* prologue);

// One decode launch per launch key (the blocks sorted by it: StageBatch),
// over queries the prologue prepared; the block that finishes a unit's last
// split merges it, so no launch follows. softcap: the call's
// logit soft cap (AttendParams::logit_softcap), 0 for none.
absl::Status LaunchDecode(const PoolView& view, const PoolView& exact_view, const AttendWorkspace& at, float softcap,
                          Workspace& w);

// Every layer's resident AttendBlocks per SM (the split planner's
// figure), for the kernel instance a one-token decode of the layout uses.
absl::Status MeasureOccupancy(const KvLayout& layout, LayoutTables* t);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_ATTEND_LAUNCH_H_
