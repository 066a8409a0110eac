// The nvcc build of format_kernels.cuh; the source is in format_kernels_impl.cuh.
#include "kernels/cuda/format_kernels_impl.cuh"
