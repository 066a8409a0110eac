#include "service/device_watch.h"

#include <mutex>
#include <string>
#include <utility>

namespace tqkv {
namespace service {
namespace {

class DeviceWatch final : public Backend {
 public:
  DeviceWatch(std::unique_ptr<Backend> inner, std::function<void(const absl::Status&)> on_lost)
      : inner_(std::move(inner)), on_lost_(std::move(on_lost)) {}

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  absl::Status SupportsLayout(const KvLayout& layout) const override { return inner_->SupportsLayout(layout); }
  absl::Status DeviceStatus() const override { return inner_->DeviceStatus(); }
  CallTiming LastCallTiming() const override { return inner_->LastCallTiming(); }
  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    absl::StatusOr<PagePool> pool = inner_->AllocatePool(layout, num_pages);
    if (!pool.ok()) Check();
    return pool;
  }
  void FreePool(PagePool pool) override { inner_->FreePool(pool); }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return Watched(inner_->CopyPage(pool, from, to));
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    return Watched(inner_->ReadPages(pool, pages, host));
  }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    return Watched(inner_->WritePages(pool, pages, host));
  }
  absl::Status Store(const StoreParams& params) override { return Watched(inner_->Store(params)); }
  absl::Status Score(const ScoreParams& params) override { return Watched(inner_->Score(params)); }
  absl::Status Attend(const AttendParams& params) override { return Watched(inner_->Attend(params)); }

 private:
  absl::Status Watched(absl::Status status) {
    if (!status.ok()) Check();
    return status;
  }
  // Only failed calls ask: a healthy call costs nothing extra.
  void Check() {
    const absl::Status device = inner_->DeviceStatus();
    if (device.ok()) return;
    std::call_once(reported_, [&] { on_lost_(device); });
  }

  const std::unique_ptr<Backend> inner_;
  const std::function<void(const absl::Status&)> on_lost_;
  std::once_flag reported_;
};

}  // namespace

std::unique_ptr<Backend> WithDeviceWatch(std::unique_ptr<Backend> inner,
                                         std::function<void(const absl::Status&)> on_lost) {
  return std::make_unique<DeviceWatch>(std::move(inner), std::move(on_lost));
}

}  // namespace service
}  // namespace tqkv
