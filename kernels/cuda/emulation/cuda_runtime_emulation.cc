// The CUDA runtime calls tqkv makes, for the emulated device: device memory is
// host memory, copies are memcpy, streams run in order at once, events read
// the host clock, and kernels run through emulated_device.h. One device,
// "tqkv CUDA emulator", with 4 multiprocessors (so that the decode planner
// splits even short contexts) and 16 GiB. The occupancy API answers from
// sm_90's per-SM limits on threads, blocks and shared memory (registers and
// static shared memory are not modelled: the emulation cannot know them).
// Sticky errors on demand: fault_injection.h.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "kernels/cuda/emulation/call_counts.h"
#include "kernels/cuda/emulation/fault_injection.h"

struct CUstream_st {};
struct CUevent_st {
  double seconds = 0.0;
};

namespace {

constexpr int kMultiprocessors = 4;
// sm_90's per-SM limits, for the occupancy API.
constexpr int kThreadsPerSm = 2048;
constexpr int kBlocksPerSm = 32;
constexpr size_t kSharedPerSm = 228 * 1024;
constexpr size_t kSharedPerBlock = 227 * 1024;
constexpr size_t kSharedReservedPerBlock = 1024;
constexpr size_t kDeviceBytes = size_t{16} << 30;
thread_local cudaError_t last_error = cudaSuccess;
std::atomic<int64_t> launches{0}, copies_to_device{0}, copies_to_host{0}, copies_on_device{0}, synchronizations{0};

void CountCopy(cudaMemcpyKind kind) {
  if (kind == cudaMemcpyHostToDevice) ++copies_to_device;
  if (kind == cudaMemcpyDeviceToHost) ++copies_to_host;
  if (kind == cudaMemcpyDeviceToDevice) ++copies_on_device;
}
std::atomic<cudaError_t> sticky_error{cudaSuccess};
constexpr size_t kSharedDefaultPerBlock = 48 * 1024;  // without the opt-in attribute

// cudaFuncAttributeMaxDynamicSharedMemorySize by kernel.
std::mutex& AttributeMutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<const void*, int>& MaxDynamicShared() {
  static std::map<const void*, int> by_function;
  return by_function;
}

cudaError_t Fail(cudaError_t error) {
  last_error = error;
  return error;
}

// 256-byte aligned like cudaMalloc, and exactly `bytes` long, so that a
// sanitizer run sees any read past an allocation.
void* Allocate(size_t bytes) {
  void* ptr = nullptr;
  return posix_memalign(&ptr, 256, bytes == 0 ? 1 : bytes) == 0 ? ptr : nullptr;
}

}  // namespace

namespace tqkv {
namespace cuda {
namespace emulation {

void InjectStickyError(cudaError_t error) { sticky_error.store(error); }

CallCounts GetCallCounts() {
  return CallCounts{launches.load(), copies_to_device.load(), copies_to_host.load(), copies_on_device.load(),
                    synchronizations.load()};
}
void ResetCallCounts() {
  for (std::atomic<int64_t>* c :
       {&launches, &copies_to_device, &copies_to_host, &copies_on_device, &synchronizations}) {
    c->store(0);
  }
}
void CountLaunch() { ++launches; }
bool DynamicSharedAllowed(const void* func, size_t bytes) {
  if (bytes <= kSharedDefaultPerBlock) return true;
  std::lock_guard<std::mutex> lock(AttributeMutex());
  const auto it = MaxDynamicShared().find(func);
  return it != MaxDynamicShared().end() && bytes <= static_cast<size_t>(it->second);
}
cudaError_t StickyError() { return sticky_error.load(); }

}  // namespace emulation
}  // namespace cuda
}  // namespace tqkv

// What a dead context answers to most calls: the sticky error, if any.
#define TQKV_RETURN_IF_STICKY()                     \
  do {                                              \
    const cudaError_t sticky = sticky_error.load(); \
    if (sticky != cudaSuccess) return sticky;       \
  } while (0)

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  TQKV_RETURN_IF_STICKY();
  return device == 0 ? cudaSuccess : Fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int* device) {
  TQKV_RETURN_IF_STICKY();
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::strncpy(prop->name, "tqkv CUDA emulator", sizeof(prop->name) - 1);
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = kDeviceBytes;
  prop->multiProcessorCount = kMultiprocessors;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  TQKV_RETURN_IF_STICKY();
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  *value = attr == cudaDevAttrMultiProcessorCount ? kMultiprocessors : 0;
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void* func, int block_size,
                                                          size_t dynamic_shared_bytes) {
  TQKV_RETURN_IF_STICKY();
  if (num_blocks == nullptr || func == nullptr || block_size < 1 || block_size > 1024) {
    return Fail(cudaErrorInvalidValue);
  }
  if (dynamic_shared_bytes > kSharedPerBlock) {
    *num_blocks = 0;
    return cudaSuccess;
  }
  const int warps = (block_size + 31) / 32;
  int blocks = std::min(kBlocksPerSm, kThreadsPerSm / (warps * 32));
  const size_t shared = dynamic_shared_bytes + kSharedReservedPerBlock;
  blocks = std::min<int>(blocks, static_cast<int>(kSharedPerSm / shared));
  *num_blocks = blocks;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  TQKV_RETURN_IF_STICKY();
  if (func == nullptr) return Fail(cudaErrorInvalidDeviceFunction);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > kSharedPerBlock) return Fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(AttributeMutex());
    MaxDynamicShared()[func] = value;
  }
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  TQKV_RETURN_IF_STICKY();
  if (size > kDeviceBytes) return Fail(cudaErrorMemoryAllocation);
  *ptr = Allocate(size);
  return *ptr != nullptr ? cudaSuccess : Fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
  TQKV_RETURN_IF_STICKY();
  *ptr = Allocate(size);
  return *ptr != nullptr ? cudaSuccess : Fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  TQKV_RETURN_IF_STICKY();
  CountCopy(kind);
  ++synchronizations;  // a blocking copy waits for the device
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t) {
  TQKV_RETURN_IF_STICKY();
  CountCopy(kind);
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  TQKV_RETURN_IF_STICKY();
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  TQKV_RETURN_IF_STICKY();
  *stream = new CUstream_st();
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
  TQKV_RETURN_IF_STICKY();
  ++synchronizations;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  TQKV_RETURN_IF_STICKY();
  ++synchronizations;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  TQKV_RETURN_IF_STICKY();
  *event = new CUevent_st();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  TQKV_RETURN_IF_STICKY();
  event->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  TQKV_RETURN_IF_STICKY();
  *ms = static_cast<float>((end->seconds - start->seconds) * 1e3);
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  TQKV_RETURN_IF_STICKY();  // not cleared, as on a device
  const cudaError_t error = last_error;
  last_error = cudaSuccess;
  return error;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorECCUncorrectable:
      return "cudaErrorECCUncorrectable";
    default:
      return "cudaError (emulated)";
  }
}

const char* cudaGetErrorString(cudaError_t error) { return cudaGetErrorName(error); }

}  // extern "C"
