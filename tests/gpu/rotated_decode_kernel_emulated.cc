// The emulated-device build of rotated_decode_kernel.cuh (test only): the
// same source as rotated_decode_kernel.cu, for the host emulation.
#include "tests/gpu/rotated_decode_kernel_impl.cuh"
