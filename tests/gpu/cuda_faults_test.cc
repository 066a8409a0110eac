// What only the emulated device can show (gpu_emulation_test; nothing in
// gpu_test): a sticky error injected through the emulated runtime, and the
// runtime calls a decode layer costs, counted by the emulator.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "cache/kv_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#if TQKV_CUDA_EMULATION
#include "kernels/cuda/emulation/call_counts.h"
#include "kernels/cuda/emulation/fault_injection.h"
#endif
#include "tests/gpu/cuda_backend_test_util.h"

namespace tqkv {
namespace cuda_test {
namespace {

#if TQKV_CUDA_EMULATION
// A sticky error, injected through the emulated runtime where an illegal
// address would surface on a device (the next call, its synchronisation),
// marks the backend lost: that call and every later one are UNAVAILABLE
// with the first cause, even once the runtime answers again. A failure that
// is not sticky (out of memory) leaves it usable. Only the emulator can
// inject; on a device a lost context would end the test process's use of
// CUDA.
TEST(CudaBackendFaults, AStickyErrorMarksTheDeviceLostForGood) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  CudaBackendOptions options;
  options.workspaces = 1;
  options.workspace_bytes = size_t{1} << 20;
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(options);
  ASSERT_TRUE(made.ok()) << made.status();
  Backend& gpu = **made;
  Fixture f({"turboquant_k3v4_nc", 64, 16, 2, 4}, 20, cpu.get(), &gpu);
  f.Build();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu.Store(f.Store(f.gpu_pool())).ok());
  EXPECT_TRUE(gpu.DeviceStatus().ok());
  // Not sticky: a pool far beyond the device's memory.
  EXPECT_EQ(gpu.AllocatePool(f.layout(), 1 << 30).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(gpu.DeviceStatus().ok());

  cuda::emulation::InjectStickyError(cudaErrorIllegalAddress);
  const absl::Status failed = gpu.Store(f.Store(f.gpu_pool()));
  cuda::emulation::InjectStickyError(cudaSuccess);  // the emulator recovers; a device would not
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_TRUE(cuda::IsDeviceLost(failed)) << failed;
  EXPECT_NE(failed.message().find("cudaErrorIllegalAddress"), std::string::npos) << failed;
  EXPECT_EQ(gpu.DeviceStatus(), failed);
  // Every later call fails fast with the same status, touching nothing.
  const int32_t page = f.block_table()[0];
  std::vector<uint8_t> host(f.gpu_pool().page_bytes);
  EXPECT_EQ(gpu.Store(f.Store(f.gpu_pool())), failed);
  EXPECT_EQ(gpu.CopyPage(f.gpu_pool(), page, f.block_table()[1]), failed);
  EXPECT_EQ(gpu.ReadPages(f.gpu_pool(), {&page, 1}, host.data()), failed);
  EXPECT_EQ(gpu.WritePages(f.gpu_pool(), {&page, 1}, host.data()), failed);
  EXPECT_EQ(gpu.AllocatePool(f.layout(), 2).status(), failed);
  std::vector<float> query(4 * 64, 0.5f), output(query.size());
  AttendItem item{f.block_table().data(), 20, 0, 1, query.data(), output.data(), nullptr};
  EXPECT_EQ(gpu.Attend(AttendParams{&f.layout(), f.gpu_pool(), {&item, 1}, 0.125f}), failed);
  std::vector<float> logits(4 * 20);
  ScoreParams score;
  score.layout = &f.layout();
  score.pool = f.gpu_pool();
  score.block_table = f.block_table().data();
  score.token_end = 20;
  score.queries = query.data();
  score.scale = 0.125f;
  score.logits = logits.data();
  EXPECT_EQ(gpu.Score(score), failed);

  // Each sticky error is recognised; ordinary failures are not.
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorECCUncorrectable,
                        cudaErrorMisalignedAddress, cudaErrorAssert}) {
    EXPECT_TRUE(cuda::IsStickyError(e)) << e;
    EXPECT_TRUE(cuda::IsDeviceLost(cuda::CudaStatus(e, "call"))) << e;
  }
  for (cudaError_t e : {cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNoDevice}) {
    EXPECT_FALSE(cuda::IsStickyError(e)) << e;
    EXPECT_FALSE(cuda::IsDeviceLost(cuda::CudaStatus(e, "call"))) << e;
  }
}

// What a decode layer costs the device, from the runtime calls the emulator
// sees (not times: a budget a machine without a GPU can hold the backend
// to): one AppendAttend layer of the default recipe (pre-RoPE centering,
// exact sinks and recent tokens) at batch 8 and 64 is one copy in, one copy out and
// one synchronization, whatever the batch (Backend::StoreAndAttend), and
// answers as the CPU backend does, in 3 launches: the prologue (both
// stores, compressed and exact, and the query preparation of both layouts),
// the decode of compressed and of exact tokens (the block that finishes a
// unit's last split merges it: no merge launch). A prefill's
// Append (Backend::Store with exact copies) is one launch and one copy each
// way.
TEST(CudaBackendBudget, ADecodeLayerIsOneCopyEachWayAndOneSynchronization) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeCudaBackend(CudaBackendOptions());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  CacheOptions o;
  o.layout.num_layers = 2;
  o.layout.num_kv_heads = 2;
  o.layout.num_query_heads = 8;
  o.layout.head_dim = 64;
  o.layout.preset = "tqkv_k3v4u_csw";
  o.layout.boundary_layers = 0;
  o.layout.rope.base = 500000.0;
  o.layout.exact_recent_tokens = 8;  // the recipe's 4 sinks, fewer recent tokens: a short context passes them
  o.memory_budget_bytes = size_t{64} << 20;
  std::unique_ptr<KvCache> on_gpu = *KvCache::Create(o, gpu->get());
  std::unique_ptr<KvCache> on_cpu = *KvCache::Create(o, cpu.get());
  const KvLayout& layout = on_gpu->layout();
  const size_t row = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
  const size_t qrow = static_cast<size_t>(layout.num_query_heads()) * layout.head_dim();
  for (int batch : {8, 64}) {
    SCOPED_TRACE(batch);
    constexpr int64_t kContext = 20;  // past the exact recent tokens
    const auto id = [batch](int s) { return "b" + std::to_string(batch) + "-" + std::to_string(s); };
    for (int s = 0; s < batch; ++s) {
      const std::vector<float> prefill = Gaussian(layout.num_layers() * kContext * row, 100 * batch + s);
      AppendRequest r;
      r.sequence_id = id(s);
      r.layer_end = layout.num_layers();
      r.num_tokens = kContext;
      r.keys = prefill.data();
      r.values = prefill.data();
      cuda::emulation::ResetCallCounts();
      ASSERT_TRUE(on_gpu->Append(r).ok());
      const cuda::emulation::CallCounts n = cuda::emulation::GetCallCounts();
      ASSERT_TRUE(on_cpu->Append(r).ok());
      // The prefill's store, its exact copies included: one prologue.
      EXPECT_EQ(n.launches, 1);
      EXPECT_EQ(n.copies_to_device, 1);
      EXPECT_EQ(n.copies_to_host, 1);
      EXPECT_EQ(n.synchronizations, 1);
    }
    for (int layer = 0; layer < layout.num_layers(); ++layer) {
      const std::vector<float> tokens = Gaussian(batch * row, 7 + layer), queries = Gaussian(batch * qrow, 8 + layer);
      std::vector<float> gpu_out(batch * qrow), cpu_out(batch * qrow);
      std::vector<AppendRequest> appends(batch);
      std::vector<AttendRequestItem> gpu_items(batch), cpu_items(batch);
      for (int s = 0; s < batch; ++s) {
        AppendRequest& r = appends[s];
        r.sequence_id = id(s);
        r.start_position = kContext;
        r.layer_begin = layer;
        r.layer_end = layer + 1;
        r.num_tokens = 1;
        r.keys = tokens.data() + s * row;
        r.values = tokens.data() + s * row;
        gpu_items[s] = {r.sequence_id, layer, 1, queries.data() + s * qrow, gpu_out.data() + s * qrow, nullptr};
        cpu_items[s] = {r.sequence_id, layer, 1, queries.data() + s * qrow, cpu_out.data() + s * qrow, nullptr};
      }
      std::vector<absl::Status> statuses(batch);
      std::vector<AppendOutcome> outcomes(batch);
      cuda::emulation::ResetCallCounts();
      on_gpu->AppendAttend(appends, gpu_items, 0.0f, absl::MakeSpan(statuses), absl::MakeSpan(outcomes));
      const cuda::emulation::CallCounts n = cuda::emulation::GetCallCounts();
      for (const absl::Status& status : statuses) ASSERT_TRUE(status.ok()) << status;
      on_cpu->AppendAttend(appends, cpu_items, 0.0f, absl::MakeSpan(statuses), absl::MakeSpan(outcomes));
      for (const absl::Status& status : statuses) ASSERT_TRUE(status.ok()) << status;
      ExpectClose(gpu_out, cpu_out, kTensorCoreTolerance, "decode layer output");
      std::printf("batch %d layer %d: %lld launches, %lld copies in, %lld out, %lld on the device, %lld syncs\n", batch,
                  layer, static_cast<long long>(n.launches), static_cast<long long>(n.copies_to_device),
                  static_cast<long long>(n.copies_to_host), static_cast<long long>(n.copies_on_device),
                  static_cast<long long>(n.synchronizations));
      EXPECT_EQ(n.launches, 3);
      EXPECT_EQ(n.copies_to_device, 1);
      EXPECT_EQ(n.copies_to_host, 1);
      EXPECT_EQ(n.copies_on_device, 0);
      EXPECT_EQ(n.synchronizations, 1);
    }
  }
}
#endif  // TQKV_CUDA_EMULATION

}  // namespace
}  // namespace cuda_test
}  // namespace tqkv
