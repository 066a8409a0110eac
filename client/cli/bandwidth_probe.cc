#include "client/cli/bandwidth_probe.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace tqkv {
namespace cli {
namespace {

double Seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Four independent accumulators keep the loads, not the adds, the bound.
__attribute__((target("avx2"))) uint64_t SumAvx2(const uint8_t* p, size_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a = _mm256_add_epi64(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_add_epi64(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_add_epi64(c, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_add_epi64(d, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

uint64_t SumSse2(const uint8_t* p, size_t n) {
  __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    a = _mm_add_epi64(a, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i)));
    b = _mm_add_epi64(b, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 16)));
    c = _mm_add_epi64(c, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 32)));
    d = _mm_add_epi64(d, _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 48)));
  }
  alignas(16) uint64_t lanes[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), _mm_add_epi64(_mm_add_epi64(a, b), _mm_add_epi64(c, d)));
  return lanes[0] + lanes[1];
}

}  // namespace

double MeasureReadBandwidth(size_t bytes, int threads, double min_seconds) {
  threads = std::max(1, threads);
  const size_t slice = std::max<size_t>(bytes / threads / 4096, 1) * 4096;
  const size_t total = slice * threads;
  uint8_t* buffer = static_cast<uint8_t*>(std::aligned_alloc(4096, total));
  if (buffer == nullptr) return 0.0;
  // Non-zero bytes: a zero page could be served by one shared physical page.
  memset(buffer, 1, total);
  const bool avx2 = __builtin_cpu_supports("avx2");
  std::vector<uint64_t> sums(threads);
  const auto pass = [&] {
    std::vector<std::thread> workers;
    for (int t = 1; t < threads; ++t) {
      workers.emplace_back(
          [&, t] { sums[t] = avx2 ? SumAvx2(buffer + t * slice, slice) : SumSse2(buffer + t * slice, slice); });
    }
    sums[0] = avx2 ? SumAvx2(buffer, slice) : SumSse2(buffer, slice);
    for (std::thread& w : workers) w.join();
  };
  pass();
  std::vector<double> rates;
  const double start = Seconds();
  while (rates.size() < 5 || (Seconds() - start < min_seconds && rates.size() < 1000)) {
    const double t0 = Seconds();
    pass();
    rates.push_back(static_cast<double>(total) / (Seconds() - t0));
  }
  std::free(buffer);
  // The sums are data, not results: reading them keeps the loops alive.
  volatile uint64_t sink = 0;
  for (uint64_t s : sums) sink = sink + s;
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

}  // namespace cli
}  // namespace tqkv
