// The nvcc build of store_kernels.cuh; the source is in store_kernels_impl.cuh.
#include "kernels/cuda/store_kernels_impl.cuh"
