// Lost-device handling for the server: a Backend that forwards every call to
// another and, when a call fails and the inner backend's DeviceStatus() says
// the device is lost (a sticky CUDA error, backend.h), runs `on_lost` once.
// The server's `on_lost` turns health NOT_SERVING and logs; the calls
// themselves already fail UNAVAILABLE (the backend refuses every call once
// lost), which clients and routers take as "try another server".
//
// Thread safety: thread-safe; `on_lost` runs on the thread of the failed call
// that first saw the loss, exactly once, and must not call back into the
// backend.
#ifndef TQKV_SERVICE_DEVICE_WATCH_H_
#define TQKV_SERVICE_DEVICE_WATCH_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace tqkv {
namespace service {

// REQUIRES: inner non-null. `on_lost` receives inner's DeviceStatus().
std::unique_ptr<Backend> WithDeviceWatch(std::unique_ptr<Backend> inner,
                                         std::function<void(const absl::Status&)> on_lost);

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_DEVICE_WATCH_H_
