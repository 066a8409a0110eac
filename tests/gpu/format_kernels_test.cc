#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/codec.h"
#include "kernels/cuda/device.h"
#include "tests/gpu/rotated_decode.h"
#include "base/random.h"

namespace tqkv {
namespace {

bool HaveDevice() { return cuda::ListDevices().ok(); }

TEST(CudaFormat, RotatedDecodeMatchesTheCpuCodec) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device: " << cuda::ListDevices().status();
  for (int bits : {2, 3, 4}) {
    for (int dim : {64, 80, 96, 128, 256}) {
      CodecOptions options;
      options.head_dim = dim;
      options.seed = 3;
      auto codec = *MakeCodec(CodecSpec::TurboQuant(bits, true), options);
      const int n = 257;
      Random rng(dim * 10 + bits);
      std::vector<uint8_t> codes(static_cast<size_t>(n) * codec->code_bytes());
      std::vector<uint16_t> scales(n);
      std::vector<float> x(dim);
      for (int v = 0; v < n; ++v) {
        for (float& value : x) value = static_cast<float>(rng.NextGaussian());
        ASSERT_TRUE(codec->Encode(x.data(), &codes[v * codec->code_bytes()], &scales[v]).ok());
      }
      const auto& part = codec->turboquant_parts()[0];
      std::vector<float> gpu(static_cast<size_t>(n) * dim);
      ASSERT_TRUE(cuda::RotatedDecodeOnDevice(codes.data(), codec->code_bytes(), scales.data(),
                                              part.codebook->centroids, bits, dim, n, gpu.data())
                      .ok());
      for (int v = 0; v < n; ++v) {
        std::vector<float> cpu(dim, 0.0f);
        codec->Accumulate(1.0f, &codes[v * codec->code_bytes()], &scales[v], cpu.data());
        for (int j = 0; j < dim; ++j) {
          ASSERT_FALSE(std::isnan(gpu[v * dim + j]));
          ASSERT_EQ(gpu[v * dim + j], cpu[j]) << "bits " << bits << " dim " << dim;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tqkv
