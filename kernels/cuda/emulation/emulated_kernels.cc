// The CUDA kernels' own source (the *_impl.cuh files), compiled for the host
// emulation of emulated_device.h instead of by nvcc.
#include "kernels/cuda/attend_kernels_impl.cuh"
#include "kernels/cuda/prologue_kernels_impl.cuh"
