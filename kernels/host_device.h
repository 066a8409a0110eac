// Lets format code (number conversions, bit unpacking) be shared verbatim by the
// CPU backend and CUDA kernels.
#ifndef TQKV_KERNELS_HOST_DEVICE_H_
#define TQKV_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define TQKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TQKV_HOST_DEVICE inline
#endif

#endif  // TQKV_KERNELS_HOST_DEVICE_H_
