// A Backend that forwards every call to another it owns: the base of
// decorators (service/device_watch.cc, the kernel timers in
// service/metrics.cc), which override only the calls they watch.
#ifndef TQKV_KERNELS_FORWARDING_BACKEND_H_
#define TQKV_KERNELS_FORWARDING_BACKEND_H_

#include <memory>
#include <string>
#include <utility>

#include "kernels/backend.h"

namespace tqkv {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  std::string device() const override { return inner_->device(); }
  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    return inner_->AllocatePool(layout, num_pages);
  }
  absl::Status SupportsLayout(const KvLayout& layout) const override { return inner_->SupportsLayout(layout); }
  void FreePool(PagePool pool) override { inner_->FreePool(pool); }
  absl::Status DeviceStatus() const override { return inner_->DeviceStatus(); }
  CallTiming LastCallTiming() const override { return inner_->LastCallTiming(); }
  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    return inner_->CopyPage(pool, from, to);
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> pages, uint8_t* host) override {
    return inner_->ReadPages(pool, pages, host);
  }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> pages, const uint8_t* host) override {
    return inner_->WritePages(pool, pages, host);
  }
  absl::Status Store(const StoreParams& params) override { return inner_->Store(params); }
  absl::Status Score(const ScoreParams& params) override { return inner_->Score(params); }
  absl::Status Attend(const AttendParams& params) override { return inner_->Attend(params); }
  absl::Status StoreAndAttend(const StoreParams& store, const AttendParams& attend) override {
    return inner_->StoreAndAttend(store, attend);
  }

 protected:
  Backend& inner() const { return *inner_; }

 private:
  const std::unique_ptr<Backend> inner_;
};

}  // namespace tqkv

#endif  // TQKV_KERNELS_FORWARDING_BACKEND_H_
