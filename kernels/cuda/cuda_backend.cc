#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/codec.h"
#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/attend_launch.h"
#include "kernels/cuda/call_workspace.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_format.h"
#include "kernels/cuda/device_tables.h"
#include "kernels/cuda/planner.h"
#include "kernels/cuda/prologue_kernels.cuh"
#include "kernels/cuda/store_launch.h"
#include "kernels/format_table.h"
#include "kernels/kv_layout.h"
#include "base/status_macros.h"

namespace tqkv {
namespace {

using cuda::AttendBlock;
using cuda::AttendItemDesc;
using cuda::CudaStatus;
using cuda::DeviceField;
using cuda::DeviceFieldFormat;
using cuda::DeviceHead;
using cuda::DevicePart;
using cuda::DeviceRotation;
using cuda::DeviceRotationKind;
using cuda::MergeUnit;
// Host-side tables and workspaces (device_tables.h, call_workspace.h).
using cuda::ActivePairs;
using cuda::AddBackAt;
using cuda::AddBackOf;
using cuda::AddPreparation;
using cuda::AlignUp;
using cuda::AppendExactTable;
using cuda::Centered;
using cuda::ClearAddBack;
using cuda::CopyAddBack;
using cuda::DescribeLayout;
using cuda::ElapsedSeconds;
using cuda::KeyOf;
using cuda::kMaxSegments;
using cuda::LaunchDecode;
using cuda::LaunchKey;
using cuda::LayoutTables;
using cuda::MeasureOccupancy;
using cuda::PlanAddBack;
using cuda::PlanItemAddBack;
using cuda::PlanScoreAddBack;
using cuda::PoolTables;
using cuda::Relocate;
using cuda::Segment;
using cuda::Segments;
using cuda::SortBlocksByLaunch;
using cuda::StageQueries;
using cuda::StageStore;
using cuda::StoreOf;
using cuda::TableBuilder;
using cuda::UnstageBatch;
using cuda::View;
using cuda::Workspace;

// LastCallTiming: one per thread, shared by the process's CUDA backends (a
// caller asks the backend it just called, on the same thread).
thread_local CallTiming last_timing;

// Bytes read past a pool's last page by vectorised loads of a tail group.
constexpr size_t kPoolTailPadding = 256;

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(const CudaBackendOptions& options) {
    if (options.workspaces < 1 || options.workspace_bytes < (size_t{1} << 20)) {
      return absl::InvalidArgumentError("the CUDA backend needs >= 1 workspace of >= 1 MiB");
    }
    ASSIGN_OR_RETURN(std::vector<cuda::DeviceInfo> devices, cuda::ListDevices());
    if (options.device < 0 || options.device >= static_cast<int>(devices.size())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("CUDA device %d does not exist (%d found)", options.device, devices.size()));
    }
    std::unique_ptr<CudaBackend> backend(new CudaBackend(options, devices[options.device]));
    RETURN_IF_ERROR(backend->Init());
    return std::unique_ptr<Backend>(std::move(backend));
  }

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    for (Workspace& w : workspaces_) {
      if (w.stream != nullptr) cudaStreamDestroy(w.stream);
      if (w.start != nullptr) cudaEventDestroy(w.start);
      if (w.stop != nullptr) cudaEventDestroy(w.stop);
      if (w.host != nullptr) cudaFreeHost(w.host);
      if (w.device != nullptr) cudaFree(w.device);
    }
  }

  std::string name() const override { return "cuda"; }

  std::string device() const override {
    return absl::StrFormat("%s, sm_%d%d, %.0f GiB", info_.name, info_.compute_capability_major,
                           info_.compute_capability_minor,
                           static_cast<double>(info_.total_memory_bytes) / (1ull << 30));
  }

  // Everything AllocatePool would refuse, found on the host alone: the head
  // dim, then the format description of every (layer, head) of the layout
  // and of its exact layout (DescribeLayout, the same code AllocatePool
  // runs), so that a refusal comes before any allocation.
  absl::Status SupportsLayout(const KvLayout& layout) const override {
    const int d = layout.head_dim();
    if (d > cuda::kMaxDeviceHeadDim || d % 8 != 0) {
      return absl::UnimplementedError(absl::StrFormat(
          "the CUDA backend takes head dims that are multiples of 8 up to %d, got %d", cuda::kMaxDeviceHeadDim, d));
    }
    TableBuilder tables;
    std::vector<DeviceHead> heads;
    LayoutTables described;
    RETURN_IF_ERROR(DescribeLayout(layout, options_.tensor_cores, tables, &heads, &described));
    if (layout.has_exact_tokens()) {
      LayoutTables exact;
      RETURN_IF_ERROR(DescribeLayout(*layout.exact_layout(), options_.tensor_cores, tables, &heads, &exact));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    return Guarded([&] { return DoAllocatePool(layout, num_pages); });
  }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return Guarded([&] { return DoCopyPage(pool, from, to); });
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    return Guarded([&] { return CopyPages(pool, pages, host, cudaMemcpyDeviceToHost); });
  }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    return Guarded([&] { return CopyPages(pool, pages, const_cast<uint8_t*>(host), cudaMemcpyHostToDevice); });
  }
  absl::Status StoreAndAttend(const StoreParams& store, const AttendParams& attend) override {
    return Guarded([&]() -> absl::Status {
      ASSIGN_OR_RETURN(bool fused, DoStoreAndAttend(store, attend));
      if (fused) return absl::OkStatus();
      // Too large for one workspace: the two calls, each planned its way.
      const absl::Status stored = StoreWithExact(store);
      if (!stored.ok()) return stored;
      const double store_seconds = last_timing.device_seconds;
      RETURN_IF_ERROR(DoAttend(attend));
      last_timing.device_seconds += store_seconds;
      return absl::OkStatus();
    });
  }

  absl::Status Store(const StoreParams& p) override {
    return Guarded([&]() -> absl::Status { return StoreWithExact(p); });
  }

  // A decode layer on one stream (Backend::StoreAndAttend): the store, its
  // exact copies and the attention staged in one workspace, one copy in,
  // the launches (one prologue storing both parts and preparing the queries
  // of both layouts, the decode launches, which merge), one copy out, one
  // synchronization. The attend plan's
  // workspace is rearranged so that each copy is one range:
  //   [attend inputs][store inputs][error words][attend outputs][attend scratch]
  //   '---------------- copy in ---------------'
  //                                '------- copy out -------'
  // false, having run nothing, when the call does not fit one workspace and
  // one attend batch.
  absl::StatusOr<bool> DoStoreAndAttend(const StoreParams& store, const AttendParams& attend) {
    if (store.layer_end <= store.layer_begin || store.num_tokens <= 0 || attend.items.empty()) return false;
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(store.pool));
    std::vector<float> exact_keys, exact_values;
    std::vector<int32_t> exact_slots;
    const StoreParams exact = ExactStorePart(store, &exact_keys, &exact_values, &exact_slots);
    ASSIGN_OR_RETURN(bool one_piece, StoreFitsOnePiece(store));
    if (!one_piece) return false;
    const size_t store_bytes = LayOutStoreRegion(store, exact, 0).end;
    if (store_bytes + cuda::kWorkspaceAlignment >= options_.workspace_bytes) return false;

    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    const KvLayout& layout = *attend.layout;
    cuda::AttendPlanInput in = DescribeAttend(layout, attend, *tables, w);
    in.workspace_bytes -= Align(store_bytes) + cuda::kWorkspaceAlignment;
    RETURN_IF_ERROR(cuda::PlanAttend(in, &w.plan));
    if (w.plan.batches.size() != 1) return false;
    const cuda::AttendBatch& batch = w.plan.batches[0];
    cuda::AttendWorkspace at;
    if (!Rearrange(batch.at, store_bytes, &at)) return false;
    const StoreRegion region = LayOutStoreRegion(store, exact, Align(batch.at.copy_in));

    StageStoreRegion(store, exact, region, w);
    RETURN_IF_ERROR(StageBatch(layout, attend, *tables, in, batch, at, w));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.device, w.host, at.copy_in, cudaMemcpyHostToDevice, w.stream),
                               "store and attend: copy in"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(
        LaunchBatch(layout, attend, *tables, batch.counts.rows, at, StoresOf(*tables, store, exact, region, w), w));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
    const size_t out_end = at.output + (batch.at.end - batch.at.output);
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + region.errors, w.device + region.errors,
                                               out_end - region.errors, cudaMemcpyDeviceToHost, w.stream),
                               "store and attend: copy out"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "store and attend kernels"));
    last_timing.device_seconds = ElapsedSeconds(w);
    RETURN_IF_ERROR(CheckStoreRegion(store, exact, region, w));
    UnstageBatch(layout, attend, batch, at, w);
    return true;
  }

  // A store and its exact part (ExactStorePart; no tokens: none) as one
  // region of a workspace from `base`: the store's tokens, the exact part's,
  // then their two error words, [errors, end) what a copy out brings back.
  struct StoreRegion {
    cuda::StoreWorkspace main, exact;
    size_t errors = 0;
    size_t end = 0;
  };

  // REQUIRES: the store fits one piece (StoreFitsOnePiece), so that no
  // offset overflows; `base` aligned.
  StoreRegion LayOutStoreRegion(const StoreParams& store, const StoreParams& exact, size_t base) const {
    StoreRegion r;
    r.main = Moved(cuda::LayOutStore(StoreInputOf(store, store.num_tokens), store.num_tokens), base);
    r.errors = Align(r.main.end);
    if (exact.num_tokens > 0) {
      r.exact = Moved(cuda::LayOutStore(StoreInputOf(exact, exact.num_tokens), exact.num_tokens), r.errors);
      r.errors = Align(r.exact.end);
    }
    r.main.error = r.errors;
    r.exact.error = r.errors + sizeof(unsigned long long);
    r.end = r.errors + 2 * sizeof(unsigned long long);
    return r;
  }

  // Whether the store's tokens fit one workspace piece (cuda::PlanStore).
  absl::StatusOr<bool> StoreFitsOnePiece(const StoreParams& store) const {
    cuda::StorePlan plan;
    RETURN_IF_ERROR(cuda::PlanStore(StoreInputOf(store, store.num_tokens), &plan));
    return plan.piece_tokens >= store.num_tokens;
  }

  static void StageStoreRegion(const StoreParams& store, const StoreParams& exact, const StoreRegion& region,
                               Workspace& w) {
    StageStore(store, 0, store.num_tokens, region.main, w);
    if (exact.num_tokens > 0) StageStore(exact, 0, exact.num_tokens, region.exact, w);
  }

  // The prologue's stores of a region (its preparations left to add).
  static cuda::PrologueParams StoresOf(const PoolTables& tables, const StoreParams& store, const StoreParams& exact,
                                       const StoreRegion& region, const Workspace& w) {
    cuda::PrologueParams prologue;
    prologue.stores[prologue.num_stores++] = StoreOf(tables, store, store.num_tokens, region.main, w);
    if (exact.num_tokens > 0) {
      prologue.stores[prologue.num_stores++] = StoreOf(tables, exact, exact.num_tokens, region.exact, w);
    }
    return prologue;
  }

  absl::Status CheckStoreRegion(const StoreParams& store, const StoreParams& exact, const StoreRegion& region,
                                Workspace& w) {
    RETURN_IF_ERROR(CheckStoreError(store, 0, store.num_tokens, region.main, w));
    if (exact.num_tokens > 0) RETURN_IF_ERROR(CheckStoreError(exact, 0, exact.num_tokens, region.exact, w));
    return absl::OkStatus();
  }

  static size_t Align(size_t offset) {
    const size_t a = cuda::kWorkspaceAlignment;
    return (offset + a - 1) / a * a;
  }
  static cuda::StoreWorkspace Moved(cuda::StoreWorkspace at, size_t by) {
    for (size_t* offset : {&at.keys, &at.values, &at.slots, &at.error, &at.end}) *offset += by;
    return at;
  }

  // The attend workspace `planned` rearranged around a store region of
  // `store_bytes` (see DoStoreAndAttend): its inputs stay, the store region
  // follows them, then its outputs, then its scratch. false when `planned`
  // is not [inputs][scratch][outputs] or the result exceeds the workspace.
  bool Rearrange(const cuda::AttendWorkspace& planned, size_t store_bytes, cuda::AttendWorkspace* at) const {
    const size_t inputs_end = planned.copy_in;
    const size_t scratch[] = {planned.prepared, planned.prepared_exact, planned.partial_acc, planned.partial_stats};
    for (size_t offset : scratch) {
      if (offset < inputs_end || offset > planned.output) return false;
    }
    if (planned.lse < planned.output || planned.end < planned.lse) return false;
    *at = planned;
    const size_t store_base = Align(inputs_end);
    at->copy_in = store_base + store_bytes;
    const size_t outputs = Align(at->copy_in);
    at->output = outputs;
    at->lse = outputs + (planned.lse - planned.output);
    const size_t scratch_base = Align(outputs + (planned.end - planned.output));
    at->prepared = scratch_base + (planned.prepared - inputs_end);
    at->prepared_exact = scratch_base + (planned.prepared_exact - inputs_end);
    at->partial_acc = scratch_base + (planned.partial_acc - inputs_end);
    at->partial_stats = scratch_base + (planned.partial_stats - inputs_end);
    at->end = scratch_base + (planned.output - inputs_end);
    return at->end <= options_.workspace_bytes;
  }

  // A store and its exact copies (StoreParams::exact_slots): in one piece
  // when they fit one (DoStoreRegion), else as two stores, each in pieces.
  absl::Status StoreWithExact(const StoreParams& p) {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    if (p.layer_end <= p.layer_begin || p.num_tokens <= 0) return absl::OkStatus();
    std::vector<float> keys, values;
    std::vector<int32_t> slots;
    const StoreParams exact = ExactStorePart(p, &keys, &values, &slots);
    ASSIGN_OR_RETURN(bool stored, DoStoreRegion(*tables, p, exact));
    if (stored) return absl::OkStatus();
    RETURN_IF_ERROR(DoStore(p));
    if (exact.num_tokens == 0) return absl::OkStatus();
    const double main_seconds = last_timing.device_seconds;
    RETURN_IF_ERROR(DoStore(exact));
    last_timing.device_seconds += main_seconds;
    return absl::OkStatus();
  }

  // A store and its exact part staged as one region: one copy in, one
  // prologue launch, the error words back, one synchronization. false,
  // having run nothing, when they do not fit one workspace.
  absl::StatusOr<bool> DoStoreRegion(const PoolTables& tables, const StoreParams& store, const StoreParams& exact) {
    ASSIGN_OR_RETURN(bool one_piece, StoreFitsOnePiece(store));
    if (!one_piece) return false;
    const StoreRegion region = LayOutStoreRegion(store, exact, 0);
    if (region.end > options_.workspace_bytes) return false;
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    StageStoreRegion(store, exact, region, w);
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(w.device, w.host, region.end, cudaMemcpyHostToDevice, w.stream), "store: copy in"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(LaunchPrologue(StoresOf(tables, store, exact, region, w), w));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + region.errors, w.device + region.errors,
                                               region.end - region.errors, cudaMemcpyDeviceToHost, w.stream),
                               "store: copy error words"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "store kernel"));
    last_timing.device_seconds = ElapsedSeconds(w);
    RETURN_IF_ERROR(CheckStoreRegion(store, exact, region, w));
    return true;
  }

  absl::Status Score(const ScoreParams& p) override {
    return Guarded([&] { return DoScore(p); });
  }
  absl::Status Attend(const AttendParams& p) override {
    return Guarded([&] { return DoAttend(p); });
  }

  void FreePool(PagePool pool) override {
    cudaSetDevice(options_.device);
    void* tables = nullptr;
    {
      absl::MutexLock lock(&pools_mu_);
      auto it = pools_.find(pool.base);
      if (it != pools_.end()) {
        tables = it->second.memory;
        pools_.erase(it);
      }
    }
    cudaFree(tables);
    cudaFree(pool.base);
  }

  CallTiming LastCallTiming() const override { return last_timing; }

  absl::Status DeviceStatus() const override {
    if (!lost_flag_.load(std::memory_order_acquire)) return absl::OkStatus();
    absl::MutexLock lock(&lost_mu_);
    return lost_;
  }

 private:
  absl::StatusOr<PagePool> DoAllocatePool(const KvLayout& layout, int32_t num_pages) {
    if (num_pages < 1) return absl::InvalidArgumentError("a pool needs at least one page");
    RETURN_IF_ERROR(SupportsLayout(layout));
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    TableBuilder tables;
    std::vector<DeviceHead> heads, exact_heads;
    PoolTables pool_tables;
    RETURN_IF_ERROR(DescribeLayout(layout, options_.tensor_cores, tables, &heads, &pool_tables.main));
    if (layout.has_exact_tokens()) {
      pool_tables.exact_layout = layout.exact_layout();
      RETURN_IF_ERROR(
          DescribeLayout(*layout.exact_layout(), options_.tensor_cores, tables, &exact_heads, &pool_tables.exact));
    }
    RETURN_IF_ERROR(MeasureOccupancy(layout, &pool_tables.main));
    heads.insert(heads.end(), exact_heads.begin(), exact_heads.end());
    const std::vector<uint8_t>& blob = tables.blob();
    const size_t heads_offset = AlignUp(blob.size(), 64);
    const size_t table_bytes = heads_offset + heads.size() * sizeof(DeviceHead);
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&pool_tables.memory, table_bytes), "cudaMalloc (format tables)"));
    const uint8_t* base = static_cast<const uint8_t*>(pool_tables.memory);
    for (DeviceHead& h : heads) {
      Relocate(h.key, base);
      Relocate(h.value, base);
    }
    absl::Status status = CudaStatus(cudaMemcpy(pool_tables.memory, blob.data(), blob.size(), cudaMemcpyHostToDevice),
                                     "copy format tables");
    if (status.ok()) {
      status = CudaStatus(cudaMemcpy(static_cast<uint8_t*>(pool_tables.memory) + heads_offset, heads.data(),
                                     heads.size() * sizeof(DeviceHead), cudaMemcpyHostToDevice),
                          "copy format heads");
    }
    void* pages = nullptr;
    const size_t pool_bytes = layout.page_bytes() * static_cast<size_t>(num_pages);
    if (status.ok()) {
      const cudaError_t error = cudaMalloc(&pages, pool_bytes + kPoolTailPadding);
      if (error == cudaErrorMemoryAllocation) {
        cudaGetLastError();  // not sticky; clear it
        status = absl::ResourceExhaustedError(
            absl::StrFormat("cannot allocate a %d-page pool (%d bytes) on %s", num_pages, pool_bytes, info_.name));
      } else {
        status = CudaStatus(error, "cudaMalloc (page pool)");
      }
    }
    // Pages start zeroed, like nothing in particular; the tail padding must
    // hold finite bytes for reads that are masked off.
    if (status.ok()) status = CudaStatus(cudaMemset(pages, 0, pool_bytes + kPoolTailPadding), "cudaMemset pool");
    if (!status.ok()) {
      cudaFree(pool_tables.memory);
      if (pages != nullptr) cudaFree(pages);
      return status;
    }
    pool_tables.main.heads = reinterpret_cast<const DeviceHead*>(base + heads_offset);
    if (!exact_heads.empty()) {
      pool_tables.exact.heads = pool_tables.main.heads + (heads.size() - exact_heads.size());
    }
    PagePool pool{static_cast<uint8_t*>(pages), layout.page_bytes(), num_pages};
    absl::MutexLock lock(&pools_mu_);
    pools_[pool.base] = std::move(pool_tables);
    return pool;
  }

  absl::Status DoCopyPage(const PagePool& pool, int32_t from, int32_t to) {
    if (from < 0 || from >= pool.num_pages || to < 0 || to >= pool.num_pages) {
      return absl::InvalidArgumentError(
          absl::StrFormat("page copy %d -> %d outside a %d-page pool", from, to, pool.num_pages));
    }
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(pool.base + static_cast<size_t>(to) * pool.page_bytes,
                                               pool.base + static_cast<size_t>(from) * pool.page_bytes, pool.page_bytes,
                                               cudaMemcpyDeviceToDevice, w.stream),
                               "copy page"));
    return CudaStatus(cudaStreamSynchronize(w.stream), "copy page (sync)");
  }

  // Pages between the pool and host memory, one copy per page on a
  // workspace's stream (pages of a sequence are rarely adjacent).
  absl::Status CopyPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host, cudaMemcpyKind kind) {
    for (int32_t page : pages) {
      if (page < 0 || page >= pool.num_pages) {
        return absl::InvalidArgumentError(absl::StrFormat("page %d is outside a %d-page pool", page, pool.num_pages));
      }
    }
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    for (size_t i = 0; i < pages.size(); ++i) {
      uint8_t* device = pool.base + static_cast<size_t>(pages[i]) * pool.page_bytes;
      uint8_t* near = host + i * pool.page_bytes;
      RETURN_IF_ERROR(CudaStatus(kind == cudaMemcpyDeviceToHost
                                     ? cudaMemcpyAsync(near, device, pool.page_bytes, kind, w.stream)
                                     : cudaMemcpyAsync(device, near, pool.page_bytes, kind, w.stream),
                                 "copy pages"));
    }
    return CudaStatus(cudaStreamSynchronize(w.stream), "copy pages (sync)");
  }

  absl::Status DoStore(const StoreParams& p) {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    const int layers = p.layer_end - p.layer_begin;
    if (layers <= 0 || p.num_tokens <= 0) return absl::OkStatus();
    const cuda::StoreInput in = StoreInputOf(p, p.num_tokens);
    cuda::StorePlan plan;
    RETURN_IF_ERROR(cuda::PlanStore(in, &plan));
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    double kernel_seconds = 0.0;
    for (int64_t t0 = 0; t0 < p.num_tokens; t0 += plan.piece_tokens) {
      const int64_t tokens = std::min<int64_t>(plan.piece_tokens, p.num_tokens - t0);
      const cuda::StoreWorkspace at = cuda::LayOutStore(in, tokens);
      StageStore(p, t0, tokens, at, w);
      RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(w.device, w.host, at.end, cudaMemcpyHostToDevice, w.stream), "store: copy in"));
      cuda::PrologueParams prologue;
      prologue.stores[prologue.num_stores++] = StoreOf(*tables, p, tokens, at, w);
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
      RETURN_IF_ERROR(LaunchPrologue(prologue, w));
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + at.error, w.device + at.error, sizeof(unsigned long long),
                                                 cudaMemcpyDeviceToHost, w.stream),
                                 "store: copy error word"));
      RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "store kernel"));
      kernel_seconds += ElapsedSeconds(w);
      RETURN_IF_ERROR(CheckStoreError(p, t0, tokens, at, w));
    }
    last_timing.device_seconds = kernel_seconds;
    return absl::OkStatus();
  }

  cuda::StoreInput StoreInputOf(const StoreParams& p, int64_t tokens) const {
    const KvLayout& layout = *p.layout;
    return cuda::StoreInput{p.layer_end - p.layer_begin, layout.num_kv_heads(), layout.head_dim(), tokens,
                            options_.workspace_bytes};
  }

  static absl::Status LaunchPrologue(const cuda::PrologueParams& prologue, Workspace& w) {
    return CudaStatus(cuda::LaunchPrologue(prologue, w.stream), "prologue kernel launch");
  }

  // The error word of a piece, copied back to the pinned buffer.
  absl::Status CheckStoreError(const StoreParams& p, int64_t t0, int64_t tokens, const cuda::StoreWorkspace& at,
                               Workspace& w) {
    unsigned long long failure;
    std::memcpy(&failure, w.host + at.error, sizeof(failure));
    return failure == ~0ull ? absl::OkStatus() : StoreFailure(failure, *p.layout, p, t0, tokens);
  }

  absl::Status DoScore(const ScoreParams& p) {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int64_t count = p.token_end - p.token_begin;
    if (count <= 0) return absl::OkStatus();
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    // Without exact tokens `length` may be left 0: the range decides then.
    const int64_t length = std::max(p.length, p.token_end);
    const bool exact = layout.has_exact_tokens() && p.exact_block_table != nullptr;
    const int64_t pages = (p.token_end + layout.page_tokens() - 1) / layout.page_tokens();
    w.tables.assign(p.block_table, p.block_table + pages);
    if (exact) AppendExactTable(layout, p.exact_block_table, length, p.token_end, &w.tables);
    PlanScoreAddBack(layout, p, w);
    cuda::ScoreInput in;
    in.num_query_heads = qh;
    in.head_dim = d;
    in.exact = exact;
    in.table_entries = static_cast<int64_t>(w.tables.size());
    in.addback_heads = static_cast<int64_t>(w.addback.size());
    in.theta = static_cast<int64_t>(w.theta.size());
    in.coef = static_cast<int64_t>(w.coef.size());
    in.constants = static_cast<int64_t>(w.constants.size());
    in.tokens = count;
    in.workspace_bytes = options_.workspace_bytes;
    cuda::ScorePlan plan;
    RETURN_IF_ERROR(cuda::PlanScore(in, &plan));
    const int64_t piece = plan.piece_tokens;
    const size_t table = plan.at.table, heads = plan.at.heads, queries = plan.at.queries;
    const AddBackAt addback = AddBackOf(plan.at);
    const size_t copy_in = plan.at.copy_in;
    const size_t prepared = plan.at.prepared, prepared_exact = plan.at.prepared_exact, logits = plan.at.logits;
    std::memcpy(w.host + table, w.tables.data(), sizeof(int32_t) * w.tables.size());
    const int group = layout.query_heads_per_kv_head();
    for (int h = 0; h < qh; ++h) {
      const int32_t head = p.layer * layout.num_kv_heads() + h / group;
      std::memcpy(w.host + heads + sizeof(int32_t) * h, &head, sizeof(head));
    }
    StageQueries(layout, p.layer, p.key_mean, p.queries, 1, w.host + queries);
    CopyAddBack(addback, w);
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(w.device, w.host, copy_in, cudaMemcpyHostToDevice, w.stream), "score: copy in"));
    const cuda::PoolView view = View(layout, p.pool, tables->main);
    const cuda::PoolView exact_view = exact ? View(*layout.exact_layout(), p.pool, tables->exact) : view;
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
    cuda::PrologueParams prologue;
    AddPreparation(view, qh, heads, queries, prepared, p.scale, w, &prologue);
    if (exact) AddPreparation(exact_view, qh, heads, queries, prepared_exact, p.scale, w, &prologue);
    RETURN_IF_ERROR(LaunchPrologue(prologue, w));
    Segment segments[kMaxSegments];
    const int num_segments = Segments(layout, exact, length, segments);
    double kernel_seconds = 0.0;
    bool first_launch = true;
    for (int k = 0; k < num_segments; ++k) {
      const Segment& seg = segments[k];
      cuda::ScoreKernelParams launch;
      launch.view = seg.exact ? exact_view : view;
      launch.block_table = reinterpret_cast<const int32_t*>(w.device + table) + (seg.exact ? pages : 0);
      launch.layer = p.layer;
      launch.prepared = reinterpret_cast<const float*>(w.device + (seg.exact ? prepared_exact : prepared));
      launch.logits = reinterpret_cast<float*>(w.device + logits);
      launch.addback = addback.Tables(w.device);
      launch.constant = addback.Constants(w.device);
      const DeviceFieldFormat key = (seg.exact ? tables->exact : tables->main).layer_key_format[p.layer];
      for (int64_t t0 = std::max(seg.begin, p.token_begin); t0 < std::min(seg.end, p.token_end); t0 += piece) {
        const int64_t n = std::min(piece, std::min(seg.end, p.token_end) - t0);
        if (!first_launch) RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
        first_launch = false;
        launch.token_begin = static_cast<int32_t>(t0);
        launch.token_end = static_cast<int32_t>(t0 + n);
        RETURN_IF_ERROR(CudaStatus(cuda::LaunchScore(key, launch, w.stream), "score kernel launch"));
        RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
        RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + logits, w.device + logits, sizeof(float) * qh * n,
                                                   cudaMemcpyDeviceToHost, w.stream),
                                   "score: copy out"));
        RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "score kernel"));
        kernel_seconds += ElapsedSeconds(w);
        const float* piece_logits = reinterpret_cast<const float*>(w.host + logits);
        for (int h = 0; h < qh; ++h) {
          std::memcpy(p.logits + h * count + (t0 - p.token_begin), piece_logits + h * n, sizeof(float) * n);
        }
      }
    }
    last_timing.device_seconds = kernel_seconds;
    return absl::OkStatus();
  }

  absl::Status DoAttend(const AttendParams& p) {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    const KvLayout& layout = *p.layout;
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    const cuda::AttendPlanInput in = DescribeAttend(layout, p, *tables, w);
    RETURN_IF_ERROR(cuda::PlanAttend(in, &w.plan));
    double kernel_seconds = 0.0;
    for (const cuda::AttendBatch& batch : w.plan.batches) {
      RETURN_IF_ERROR(RunBatch(layout, p, *tables, in, batch, w, &kernel_seconds));
    }
    last_timing.device_seconds = kernel_seconds;
    return absl::OkStatus();
  }

  // The planner's view of an Attend call (its items in w.plan_items).
  cuda::AttendPlanInput DescribeAttend(const KvLayout& layout, const AttendParams& p, const PoolTables& tables,
                                       Workspace& w) const {
    cuda::AttendPlanInput in;
    in.dims.num_kv_heads = layout.num_kv_heads();
    in.dims.num_query_heads = layout.num_query_heads();
    in.dims.head_dim = layout.head_dim();
    in.dims.page_tokens = layout.page_tokens();
    in.dims.exact_page_tokens = layout.has_exact_tokens() ? layout.exact_page_tokens() : 0;
    in.dims.centered = layout.key_centering() != KeyCentering::kNone;
    w.plan_items.clear();
    // The call's kernels share the device: plan for the most resident.
    int blocks_per_sm = 1;
    for (const AttendItem& item : p.items) {
      cuda::PlanItem planned;
      planned.context_tokens = item.context_tokens;
      planned.query_tokens = item.num_query_tokens;
      planned.first_query_position = item.first_query_position;
      planned.layer = item.layer;
      planned.exact = layout.has_exact_tokens() && item.exact_block_table != nullptr;
      if (planned.exact) {
        const ExactRanges r = layout.exact_ranges(item.context_tokens);
        planned.sink_end = r.sink_end;
        planned.recent_begin = r.recent_begin;
      }
      planned.window = layout.layer_window(item.layer);
      planned.mma = tables.main.layer_mma[item.layer];
      planned.addback_pairs = Centered(layout, item.key_mean) ? ActivePairs(layout, item.layer, item.key_mean) : 0;
      w.plan_items.push_back(planned);
      blocks_per_sm = std::max(blocks_per_sm, tables.main.layer_blocks_per_sm[item.layer]);
    }
    in.items = w.plan_items;
    in.device.sm_count = sm_count_;
    in.device.blocks_per_sm = blocks_per_sm;
    in.workspace_bytes = options_.workspace_bytes;
    return in;
  }

  // Runs one public call: fails fast once the device is lost, and marks it
  // lost when the call met a sticky error (cuda::IsDeviceLost).
  template <typename F>
  auto Guarded(F call) -> decltype(call()) {
    if (absl::Status lost = DeviceStatus(); !lost.ok()) return lost;
    last_timing = CallTiming();
    auto result = call();
    if (!result.ok()) NoteFailure(StatusOf(result));
    return result;
  }
  static const absl::Status& StatusOf(const absl::Status& status) { return status; }
  template <typename T>
  static const absl::Status& StatusOf(const absl::StatusOr<T>& result) {
    return result.status();
  }
  void NoteFailure(const absl::Status& status) {
    if (!cuda::IsDeviceLost(status)) return;
    absl::MutexLock lock(&lost_mu_);
    if (lost_.ok()) lost_ = status;  // the first report names the cause
    lost_flag_.store(true, std::memory_order_release);
  }

  // Exclusive use of one workspace for a scope.
  class WorkspaceLease {
   public:
    // The time to get one counts as the call's wait (LastCallTiming).
    explicit WorkspaceLease(CudaBackend* backend) : backend_(backend) {
      const auto start = std::chrono::steady_clock::now();
      {
        absl::MutexLock lock(&backend_->workspaces_mu_);
        backend_->workspaces_mu_.Await(absl::Condition(
            +[](std::vector<Workspace*>* free) { return !free->empty(); }, &backend_->free_workspaces_));
        workspace_ = backend_->free_workspaces_.back();
        backend_->free_workspaces_.pop_back();
      }
      last_timing.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    ~WorkspaceLease() {
      absl::MutexLock lock(&backend_->workspaces_mu_);
      backend_->free_workspaces_.push_back(workspace_);
    }
    Workspace& get() { return *workspace_; }

   private:
    CudaBackend* backend_;
    Workspace* workspace_;
  };

  CudaBackend(const CudaBackendOptions& options, cuda::DeviceInfo info)
      : options_(options), info_(std::move(info)), workspaces_(options.workspaces) {}

  absl::Status Init() {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, options_.device),
                               "cudaDeviceGetAttribute"));
    for (Workspace& w : workspaces_) {
      RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
      RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&w.start), "cudaEventCreate"));
      RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&w.stop), "cudaEventCreate"));
      RETURN_IF_ERROR(
          CudaStatus(cudaHostAlloc(reinterpret_cast<void**>(&w.host), options_.workspace_bytes, cudaHostAllocDefault),
                     "cudaHostAlloc (workspace)"));
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(reinterpret_cast<void**>(&w.device), options_.workspace_bytes),
                                 "cudaMalloc (workspace)"));
      free_workspaces_.push_back(&w);
    }
    return absl::OkStatus();
  }

  // The start of every compute call: this thread on the backend's device
  // (the current device is per thread), and the pool's format tables.
  absl::StatusOr<const PoolTables*> Enter(const PagePool& pool) {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    absl::MutexLock lock(&pools_mu_);
    auto it = pools_.find(pool.base);
    if (it == pools_.end()) return absl::InvalidArgumentError("page pool was not allocated by this CUDA backend");
    // Entries are only erased by FreePool, which callers never race with a
    // call on the same pool.
    return &it->second;
  }

  absl::Status StoreFailure(unsigned long long failure, const KvLayout& layout, const StoreParams& p, int64_t t0,
                            int64_t tokens) {
    const unsigned long long vector = failure / 4;
    const auto code = static_cast<cuda::StoreError>(failure % 4);
    const int heads = layout.num_kv_heads();
    const int head = static_cast<int>(vector % heads);
    const int64_t token = t0 + static_cast<int64_t>((vector / heads) % tokens);
    const int layer = p.layer_begin + static_cast<int>(vector / (heads * tokens));
    const char* what = code == cuda::StoreError::kNotFinite ? "a coordinate is NaN or infinite; vectors must be finite"
                       : code == cuda::StoreError::kOutOfRange
                           ? "a coordinate is beyond the fp16 range of the stored format"
                           : "the vector norm is beyond the fp16 range of the stored norm";
    return absl::InvalidArgumentError(absl::StrFormat("layer %d, token %d, KV head %d: %s", layer, token, head, what));
  }

  // Runs one batch of the plan: its arrays (FillAttendBatch), block tables,
  // queries and add-back staged at the plan's offsets, the kernels, the
  // outputs back to the items.
  absl::Status RunBatch(const KvLayout& layout, const AttendParams& p, const PoolTables& tables,
                        const cuda::AttendPlanInput& in, const cuda::AttendBatch& batch, Workspace& w,
                        double* kernel_seconds) {
    const cuda::AttendWorkspace& at = batch.at;
    RETURN_IF_ERROR(StageBatch(layout, p, tables, in, batch, at, w));
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(w.device, w.host, at.copy_in, cudaMemcpyHostToDevice, w.stream), "attend: copy in"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(LaunchBatch(layout, p, tables, batch.counts.rows, at, cuda::PrologueParams(), w));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(w.host + at.output, w.device + at.output, at.end - at.output, cudaMemcpyDeviceToHost, w.stream),
        "attend: copy out"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "attend kernels"));
    *kernel_seconds += ElapsedSeconds(w);
    UnstageBatch(layout, p, batch, at, w);
    return absl::OkStatus();
  }

  // A batch's inputs into the pinned buffer at `at` (its plan's layout, or
  // that layout moved: DoStoreAndAttend), its blocks sorted by launch key.
  absl::Status StageBatch(const KvLayout& layout, const AttendParams& p, const PoolTables& tables,
                          const cuda::AttendPlanInput& in, const cuda::AttendBatch& batch,
                          const cuda::AttendWorkspace& at, Workspace& w) {
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    cuda::FillAttendBatch(in, w.plan, batch, &w.batch);
    const cuda::BatchContents& b = w.batch;
    w.tables.clear();
    ClearAddBack(w);
    for (size_t i = 0; i < b.items.size(); ++i) {
      const cuda::PlanPiece& piece = w.plan.pieces[batch.piece_begin + i];
      const AttendItem& item = p.items[piece.item];
      w.tables.insert(w.tables.end(), item.block_table, item.block_table + b.tables[i].pages);
      if (b.tables[i].exact_pages > 0) {
        AppendExactTable(layout, item.exact_block_table, item.context_tokens, b.items[i].context_tokens, &w.tables);
      }
      PlanItemAddBack(layout, p.scale, item, piece, b.items[i], w);
    }
    // The workspace was laid out from the plan's counts: what is staged must
    // be exactly that.
    const cuda::AttendCounts& c = batch.counts;
    if (static_cast<int64_t>(w.tables.size()) != c.table_entries ||
        static_cast<int64_t>(w.addback.size()) != c.addback_heads || static_cast<int64_t>(w.theta.size()) != c.theta ||
        static_cast<int64_t>(w.coef.size()) != c.coef || static_cast<int64_t>(w.constants.size()) != c.constants ||
        static_cast<int64_t>(b.blocks.size()) != c.blocks || static_cast<int64_t>(b.units.size()) != c.units ||
        static_cast<int64_t>(b.head_of_row.size()) != c.rows) {
      return absl::InternalError("the attend plan's counts disagree with the arrays staged for it");
    }
    SortBlocksByLaunch(tables, b, w);
    std::memcpy(w.host + at.items, b.items.data(), sizeof(AttendItemDesc) * b.items.size());
    std::memcpy(w.host + at.blocks, w.sorted_blocks.data(), sizeof(AttendBlock) * w.sorted_blocks.size());
    std::memcpy(w.host + at.units, b.units.data(), sizeof(MergeUnit) * b.units.size());
    std::memcpy(w.host + at.head_of_row, b.head_of_row.data(), sizeof(int32_t) * b.head_of_row.size());
    std::memcpy(w.host + at.tables, w.tables.data(), sizeof(int32_t) * w.tables.size());
    for (size_t i = 0; i < b.items.size(); ++i) {
      const cuda::PlanPiece& piece = w.plan.pieces[batch.piece_begin + i];
      const AttendItem& item = p.items[piece.item];
      StageQueries(layout, item.layer, item.key_mean, item.queries + static_cast<size_t>(piece.token0) * qh * d,
                   piece.tokens, w.host + at.queries + sizeof(float) * b.items[i].query_row * d);
    }
    CopyAddBack(AddBackOf(at), w);
    return absl::OkStatus();
  }

  // The batch's kernels on w's stream: the prologue (`prologue`'s stores, if
  // any, and the query preparation for each layout read), one decode launch
  // per launch key (the last split of a unit merges it).
  absl::Status LaunchBatch(const KvLayout& layout, const AttendParams& p, const PoolTables& tables, int64_t rows_total,
                           const cuda::AttendWorkspace& at, cuda::PrologueParams prologue, Workspace& w) {
    const bool exact = layout.has_exact_tokens();
    const cuda::PoolView view = View(layout, p.pool, tables.main);
    const cuda::PoolView exact_view = exact ? View(*layout.exact_layout(), p.pool, tables.exact) : view;
    AddPreparation(view, rows_total, at.head_of_row, at.queries, at.prepared, p.scale, w, &prologue);
    if (exact) {
      AddPreparation(exact_view, rows_total, at.head_of_row, at.queries, at.prepared_exact, p.scale, w, &prologue);
    }
    RETURN_IF_ERROR(LaunchPrologue(prologue, w));
    return LaunchDecode(view, exact_view, at, p.logit_softcap, w);
  }

  const CudaBackendOptions options_;
  const cuda::DeviceInfo info_;
  int sm_count_ = 0;

  std::vector<Workspace> workspaces_;
  absl::Mutex workspaces_mu_;
  std::vector<Workspace*> free_workspaces_ ABSL_GUARDED_BY(workspaces_mu_);

  absl::Mutex pools_mu_;
  std::map<uint8_t*, PoolTables> pools_ ABSL_GUARDED_BY(pools_mu_);

  // Set once, by the first call that met a sticky error; never cleared.
  std::atomic<bool> lost_flag_{false};
  mutable absl::Mutex lost_mu_;
  absl::Status lost_ ABSL_GUARDED_BY(lost_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options) {
  return CudaBackend::Create(options);
}

}  // namespace tqkv
