// The nvcc build of prologue_kernels.cuh; the source is in prologue_kernels_impl.cuh.
#include "kernels/cuda/prologue_kernels_impl.cuh"
