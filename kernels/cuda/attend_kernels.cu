// The nvcc build of attend_kernels.cuh; the source is in attend_kernels_impl.cuh.
#include "kernels/cuda/attend_kernels_impl.cuh"
