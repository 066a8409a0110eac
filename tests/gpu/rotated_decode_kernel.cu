// The nvcc build of rotated_decode_kernel.cuh (test only); the source is in
// rotated_decode_kernel_impl.cuh.
#include "tests/gpu/rotated_decode_kernel_impl.cuh"
