// The two wrappers the server puts around its backend, over a backend that
// can lose its device: the lost-device watch (service/device_watch.h)
// reports a loss once, and only a lost device, not ordinary failures; the
// metrics wrapper (WithKernelTimings) records the device and wait times the
// backend measured; both forward the capability and device queries.
#include "service/device_watch.h"

#include <atomic>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kv_layout.h"
#include "service/metrics.h"

namespace tqkv {
namespace service {
namespace {

// The CPU backend with a device that can be lost (as the CUDA backend's
// after a sticky error) and a layout it refuses (head dim 96).
class LosableBackend final : public Backend {
 public:
  LosableBackend() : cpu_(MakeCpuBackend(1)) {}
  void Lose() { lost_ = true; }

  std::string name() const override { return "losable"; }
  std::string device() const override { return "test device"; }
  absl::Status SupportsLayout(const KvLayout& layout) const override {
    if (layout.head_dim() == 96) return absl::UnimplementedError("no head dim 96 here");
    return absl::OkStatus();
  }
  absl::Status DeviceStatus() const override {
    return lost_ ? absl::UnavailableError("the test device is lost") : absl::OkStatus();
  }
  // As if every call spent 0.25 s on the device after 0.5 s of waiting.
  CallTiming LastCallTiming() const override { return CallTiming{0.25, 0.5}; }
  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    if (lost_) return DeviceStatus();
    return cpu_->AllocatePool(layout, num_pages);
  }
  void FreePool(PagePool pool) override { cpu_->FreePool(pool); }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return lost_ ? DeviceStatus() : cpu_->CopyPage(pool, from, to);
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    return lost_ ? DeviceStatus() : cpu_->ReadPages(pool, pages, host);
  }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    return lost_ ? DeviceStatus() : cpu_->WritePages(pool, pages, host);
  }
  absl::Status Store(const StoreParams& params) override { return lost_ ? DeviceStatus() : cpu_->Store(params); }
  absl::Status Score(const ScoreParams& params) override { return lost_ ? DeviceStatus() : cpu_->Score(params); }
  absl::Status Attend(const AttendParams& params) override { return lost_ ? DeviceStatus() : cpu_->Attend(params); }

 private:
  std::unique_ptr<Backend> cpu_;
  std::atomic<bool> lost_{false};
};

std::shared_ptr<const KvLayout> Layout(int head_dim) {
  KvLayoutOptions options;
  options.num_layers = 1;
  options.num_kv_heads = 1;
  options.num_query_heads = 1;
  options.head_dim = head_dim;
  options.page_tokens = 4;
  options.preset = "fp16";
  options.boundary_layers = 0;
  return *KvLayout::Create(options);
}

TEST(DeviceWatch, ReportsALostDeviceOnceAndOrdinaryFailuresNever) {
  auto inner = std::make_unique<LosableBackend>();
  LosableBackend* losable = inner.get();
  std::vector<std::string> reports;
  std::unique_ptr<Backend> backend =
      WithDeviceWatch(std::move(inner), [&](const absl::Status& lost) { reports.push_back(lost.ToString()); });
  const std::shared_ptr<const KvLayout> layout = Layout(64);
  absl::StatusOr<PagePool> pool = backend->AllocatePool(*layout, 4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<float> keys(4 * 64, 0.5f), values(keys.size(), 0.25f);
  std::vector<int32_t> slots(4);
  std::iota(slots.begin(), slots.end(), 0);
  StoreParams store{layout.get(), *pool, 0, 1, 4, slots.data(), keys.data(), values.data()};
  ASSERT_TRUE(backend->Store(store).ok());
  // An ordinary failure: bad input, the device is fine.
  keys[3] = NAN;
  EXPECT_EQ(backend->Store(store).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend->CopyPage(*pool, 0, 99).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(reports.empty());
  keys[3] = 0.5f;

  losable->Lose();
  EXPECT_EQ(backend->DeviceStatus().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(reports.empty()) << "asking is not failing";
  EXPECT_EQ(backend->Store(store).code(), absl::StatusCode::kUnavailable);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_NE(reports[0].find("the test device is lost"), std::string::npos) << reports[0];
  EXPECT_EQ(backend->CopyPage(*pool, 0, 1).code(), absl::StatusCode::kUnavailable);
  int32_t page = 0;
  std::vector<uint8_t> host(pool->page_bytes);
  EXPECT_EQ(backend->ReadPages(*pool, {&page, 1}, host.data()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(backend->AllocatePool(*layout, 4).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(reports.size(), 1u) << "reported once";
  backend->FreePool(*pool);
}

// The value of the first sample of `name` whose labels include `label`;
// -1 when there is none.
double Sample(const std::string& text, const std::string& name, const std::string& label) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name + "{") || line.find(label) == absl::string_view::npos) continue;
    double value = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) return value;
  }
  return -1;
}

// Both wrappers the server puts around its backend forward SupportsLayout
// (the cache asks it before allocating), DeviceStatus and LastCallTiming.
TEST(BackendWrappers, ForwardTheCapabilityDeviceAndTimingQueries) {
  auto inner = std::make_unique<LosableBackend>();
  LosableBackend* losable = inner.get();
  Metrics metrics("losable");
  std::unique_ptr<Backend> backend =
      WithKernelTimings(WithDeviceWatch(std::move(inner), [](const absl::Status&) {}), &metrics);
  EXPECT_TRUE(backend->SupportsLayout(*Layout(64)).ok());
  EXPECT_EQ(backend->SupportsLayout(*Layout(96)).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(backend->LastCallTiming().device_seconds, 0.25);
  EXPECT_TRUE(backend->DeviceStatus().ok());
  losable->Lose();
  EXPECT_EQ(backend->DeviceStatus().code(), absl::StatusCode::kUnavailable);
}

// Wall time for every call; device and wait time, as the backend measured
// them, for the calls that succeeded.
TEST(BackendWrappers, KernelTimingsRecordDeviceAndWaitTimeApart) {
  auto inner = std::make_unique<LosableBackend>();
  LosableBackend* losable = inner.get();
  Metrics metrics("losable");
  std::unique_ptr<Backend> backend = WithKernelTimings(std::move(inner), &metrics);
  const std::shared_ptr<const KvLayout> layout = Layout(64);
  absl::StatusOr<PagePool> pool = backend->AllocatePool(*layout, 4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<float> keys(2 * 64, 0.5f), values(keys.size(), 0.25f);
  std::vector<int32_t> slots = {0, 1};
  StoreParams store{layout.get(), *pool, 0, 1, 2, slots.data(), keys.data(), values.data()};
  ASSERT_TRUE(backend->Store(store).ok());
  ASSERT_TRUE(backend->Store(store).ok());
  losable->Lose();
  EXPECT_FALSE(backend->Store(store).ok());
  backend->FreePool(*pool);

  const std::string text = SerializeMetrics({metrics.registry()});
  const std::string store_label = "kernel=\"store\"";
  EXPECT_EQ(Sample(text, "tqkv_kernel_duration_seconds_count", store_label), 3);
  EXPECT_EQ(Sample(text, "tqkv_kernel_device_seconds_count", store_label), 2);
  EXPECT_DOUBLE_EQ(Sample(text, "tqkv_kernel_device_seconds_sum", store_label), 0.5);
  EXPECT_EQ(Sample(text, "tqkv_kernel_wait_seconds_count", store_label), 2);
  EXPECT_DOUBLE_EQ(Sample(text, "tqkv_kernel_wait_seconds_sum", store_label), 1.0);
  EXPECT_EQ(Sample(text, "tqkv_kernel_device_seconds_count", "kernel=\"attend\""), 0);
}

// A backend that measures nothing (the CPU backend) adds no device or wait
// samples.
TEST(BackendWrappers, KernelTimingsRecordNoDeviceTimeWhereNoneIsMeasured) {
  Metrics metrics("cpu");
  std::unique_ptr<Backend> backend = WithKernelTimings(MakeCpuBackend(1), &metrics);
  EXPECT_LT(backend->LastCallTiming().device_seconds, 0);
  const std::shared_ptr<const KvLayout> layout = Layout(64);
  absl::StatusOr<PagePool> pool = backend->AllocatePool(*layout, 4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<float> keys(2 * 64, 0.5f), values(keys.size(), 0.25f);
  std::vector<int32_t> slots = {0, 1};
  ASSERT_TRUE(backend->Store({layout.get(), *pool, 0, 1, 2, slots.data(), keys.data(), values.data()}).ok());
  backend->FreePool(*pool);
  const std::string text = SerializeMetrics({metrics.registry()});
  EXPECT_EQ(Sample(text, "tqkv_kernel_duration_seconds_count", "kernel=\"store\""), 1);
  EXPECT_EQ(Sample(text, "tqkv_kernel_device_seconds_count", "kernel=\"store\""), 0);
}

}  // namespace
}  // namespace service
}  // namespace tqkv
