#include "service/device_watch.h"

#include <mutex>
#include <string>
#include <utility>

#include "kernels/forwarding_backend.h"

namespace tqkv {
namespace service {
namespace {

class DeviceWatch final : public ForwardingBackend {
 public:
  DeviceWatch(std::unique_ptr<Backend> inner, std::function<void(const absl::Status&)> on_lost)
      : ForwardingBackend(std::move(inner)), on_lost_(std::move(on_lost)) {}

  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    absl::StatusOr<PagePool> pool = inner().AllocatePool(layout, num_pages);
    if (!pool.ok()) Check();
    return pool;
  }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return Watched(inner().CopyPage(pool, from, to));
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    return Watched(inner().ReadPages(pool, pages, host));
  }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    return Watched(inner().WritePages(pool, pages, host));
  }
  absl::Status Store(const StoreParams& params) override { return Watched(inner().Store(params)); }
  absl::Status Score(const ScoreParams& params) override { return Watched(inner().Score(params)); }
  absl::Status Attend(const AttendParams& params) override { return Watched(inner().Attend(params)); }
  absl::Status StoreAndAttend(const StoreParams& store, const AttendParams& attend) override {
    return Watched(inner().StoreAndAttend(store, attend));
  }

 private:
  absl::Status Watched(absl::Status status) {
    if (!status.ok()) Check();
    return status;
  }
  // Only failed calls ask: a healthy call costs nothing extra.
  void Check() {
    const absl::Status device = inner().DeviceStatus();
    if (device.ok()) return;
    std::call_once(reported_, [&] { on_lost_(device); });
  }

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
