// AVX-512 fused attention for one (item, KV head): scores straight from the
// packed codes (a codebook lookup with vpermps, then FMAs against the rotated
// query), online softmax per page, values accumulated in their own basis.
// No dequantized copy of the cache is made: each token's vector is expanded
// into a d-float scratch line in L1 and consumed at once by every row.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/attend_kernels.h"
#include "kernels/float_formats.h"

namespace tqkv {
namespace cpu_internal {
namespace {

constexpr int kLanes = 16;

// exp(x) for x <= 0 (softmax arguments), relative error < 2e-7: Cody-Waite
// range reduction to |r| <= ln2/2 and a degree-6 Taylor polynomial.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Sixteen b-bit codes (coordinates 16c .. 16c+15) as int32 lanes.
template <int kBits>
inline __m512i Codes16(const uint8_t* codes, int chunk) {
  if constexpr (kBits == 8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * chunk)));
  } else {
    // 16 codes are 2*kBits <= 8 bytes; pdep spreads each group of 8 codes
    // (kBits bytes) into 8 bytes, one code per byte.
    constexpr uint64_t kByteMask = 0x0101010101010101ull * ((1u << kBits) - 1u);
    // One 8-byte load even when 2*kBits < 8: a narrower copy into a zeroed
    // word stalls on store forwarding. The over-read stays inside the page
    // (every codes plane is followed by its scalars plane).
    uint64_t word;
    memcpy(&word, codes + 2 * kBits * chunk, sizeof(word));
    const __m128i bytes = _mm_set_epi64x(static_cast<long long>(_pdep_u64(word >> (8 * kBits), kByteMask)),
                                         static_cast<long long>(_pdep_u64(word, kByteMask)));
    return _mm512_cvtepu8_epi32(bytes);
  }
}

// Expands one token's field into `line` (head_dim floats) and returns the
// scalars the kernel folds in elsewhere: scale, and zero (uniform only).
template <FieldFormat kFormat, int kBits>
inline void ExpandField(const FieldReader& field, const uint8_t* page, int slot, int head_dim,
                        __m512 table, float* line, float* scale, float* zero) {
  const uint8_t* codes = page + field.codes_offset + static_cast<size_t>(slot) * field.code_bytes;
  const uint16_t* scalars = reinterpret_cast<const uint16_t*>(page + field.scalars_offset) +
                            static_cast<size_t>(slot) * field.num_scalars;
  const int chunks = head_dim / kLanes;
  if constexpr (kFormat == FieldFormat::kCentroids) {
    *scale = HalfToFloat(scalars[0]);
    *zero = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      _mm512_store_ps(line + kLanes * c, _mm512_permutexvar_ps(Codes16<kBits>(codes, c), table));
    }
  } else if constexpr (kFormat == FieldFormat::kUniform) {
    *scale = HalfToFloat(scalars[0]);
    *zero = HalfToFloat(scalars[1]);
    for (int c = 0; c < chunks; ++c) {
      _mm512_store_ps(line + kLanes * c, _mm512_cvtepi32_ps(Codes16<kBits>(codes, c)));
    }
  } else if constexpr (kFormat == FieldFormat::kFp16) {
    *scale = 1.0f;
    *zero = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c));
      _mm512_store_ps(line + kLanes * c, _mm512_cvtph_ps(halves));
    }
  } else {  // kBf16
    *scale = 1.0f;
    *zero = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * c));
      const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
      _mm512_store_ps(line + kLanes * c, _mm512_castsi512_ps(widened));
    }
  }
}

template <FieldFormat kKey, int kKeyBits, FieldFormat kValue, int kValueBits>
void AttendHead(const HeadAttendParams& p) {
  const int d = p.head_dim;
  const int chunks = d / kLanes;
  const int rows = p.rows;
  const int page_tokens = p.page_tokens;
  alignas(64) float key_line[kMaxHeadDim];
  alignas(64) float value_line[kMaxHeadDim];
  // Per page: scores then weights, [rows][page_tokens rounded up to 16].
  const int stride = (page_tokens + kLanes - 1) / kLanes * kLanes;
  alignas(64) float weights[kMaxRows * 64];
  float row_max[kMaxRows], row_sum[kMaxRows], row_zero[kMaxRows];
  const int64_t max_visible = [&] {
    int64_t m = 0;
    for (int r = 0; r < rows; ++r) m = std::max(m, p.visible[r]);
    return m;
  }();
  for (int r = 0; r < rows; ++r) {
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
    row_zero[r] = 0.0f;
    memset(p.out + static_cast<size_t>(r) * d, 0, sizeof(float) * d);
  }
  __m512 key_table = _mm512_setzero_ps(), value_table = _mm512_setzero_ps();
  if constexpr (kKey == FieldFormat::kCentroids) {
    key_table = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (1 << kKeyBits)) - 1), p.key.centroids);
  }
  if constexpr (kValue == FieldFormat::kCentroids) {
    value_table = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (1 << kValueBits)) - 1), p.value.centroids);
  }
  const float kNegInf = -std::numeric_limits<float>::infinity();

  // Tokens go in blocks of at most 64 (a page, or part of a large page).
  const int block = std::min(page_tokens, 64);
  const int block_stride = std::min(stride, 64);
  int count = 0;
  for (int64_t t0 = 0; t0 < max_visible; t0 += count) {
    const int64_t page_index = t0 / page_tokens;
    const int first_slot = static_cast<int>(t0 % page_tokens);
    count = static_cast<int>(std::min<int64_t>({block, max_visible - t0, page_tokens - first_slot}));
    const uint8_t* page = p.pool_base + static_cast<size_t>(p.block_table[page_index]) * p.page_bytes;

    // Scores.
    for (int i = 0; i < count; ++i) {
      float key_scale, unused_zero;
      ExpandField<kKey, kKeyBits>(p.key, page, first_slot + i, d, key_table, key_line, &key_scale,
                                  &unused_zero);
      for (int r = 0; r < rows; ++r) {
        const float* q = p.queries + static_cast<size_t>(r) * d;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_load_ps(key_line));
        for (int c = 1; c < chunks; ++c) {
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + kLanes * c), _mm512_load_ps(key_line + kLanes * c), acc);
        }
        const bool seen = t0 + i < p.visible[r];
        weights[r * block_stride + i] = seen ? key_scale * _mm512_reduce_add_ps(acc) : kNegInf;
      }
    }
    // Online softmax: rescale what came before, turn scores into weights.
    for (int r = 0; r < rows; ++r) {
      float* w = weights + r * block_stride;
      float block_max = kNegInf;
      for (int i = 0; i < count; ++i) block_max = std::max(block_max, w[i]);
      if (block_max == kNegInf) {
        for (int i = 0; i < count; ++i) w[i] = 0.0f;
        continue;
      }
      const float new_max = std::max(row_max[r], block_max);
      const float correction = row_max[r] == kNegInf ? 0.0f : std::exp(row_max[r] - new_max);
      row_max[r] = new_max;
      float block_sum = 0.0f;
      for (int i = 0; i < count; i += kLanes) {
        const __mmask16 lanes = static_cast<__mmask16>(count - i >= kLanes ? 0xffff : (1u << (count - i)) - 1);
        const __m512 s = _mm512_maskz_loadu_ps(lanes, w + i);
        const __mmask16 live = _mm512_mask_cmp_ps_mask(lanes, s, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, Exp(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
        _mm512_mask_storeu_ps(w + i, lanes, e);
        block_sum += _mm512_reduce_add_ps(e);
      }
      row_sum[r] = row_sum[r] * correction + block_sum;
      row_zero[r] *= correction;
      if (correction != 1.0f) {
        float* out = p.out + static_cast<size_t>(r) * d;
        const __m512 factor = _mm512_set1_ps(correction);
        for (int c = 0; c < chunks; ++c) {
          _mm512_storeu_ps(out + kLanes * c, _mm512_mul_ps(_mm512_loadu_ps(out + kLanes * c), factor));
        }
      }
    }
    // Values.
    for (int i = 0; i < count; ++i) {
      float value_scale, value_zero;
      ExpandField<kValue, kValueBits>(p.value, page, first_slot + i, d, value_table, value_line,
                                      &value_scale, &value_zero);
      for (int r = 0; r < rows; ++r) {
        const float w = weights[r * block_stride + i];
        if (w == 0.0f) continue;
        row_zero[r] += w * value_zero;
        const __m512 factor = _mm512_set1_ps(w * value_scale);
        float* out = p.out + static_cast<size_t>(r) * d;
        for (int c = 0; c < chunks; ++c) {
          _mm512_storeu_ps(out + kLanes * c, _mm512_fmadd_ps(factor, _mm512_load_ps(value_line + kLanes * c),
                                                             _mm512_loadu_ps(out + kLanes * c)));
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* out = p.out + static_cast<size_t>(r) * d;
    const float inv = 1.0f / row_sum[r];
    const __m512 factor = _mm512_set1_ps(inv);
    const __m512 shift = _mm512_set1_ps(row_zero[r] * inv);
    for (int c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(out + kLanes * c, _mm512_fmadd_ps(_mm512_loadu_ps(out + kLanes * c), factor, shift));
    }
    p.lse[r] = row_max[r] + std::log(row_sum[r]);
  }
}

using Kernel = void (*)(const HeadAttendParams&);

template <FieldFormat kKey, int kKeyBits>
Kernel PickValue(const FieldReader& value) {
  switch (value.format) {
    case FieldFormat::kCentroids:
      switch (value.bits) {
        case 2: return AttendHead<kKey, kKeyBits, FieldFormat::kCentroids, 2>;
        case 3: return AttendHead<kKey, kKeyBits, FieldFormat::kCentroids, 3>;
        case 4: return AttendHead<kKey, kKeyBits, FieldFormat::kCentroids, 4>;
      }
      return nullptr;
    case FieldFormat::kUniform:
      switch (value.bits) {
        case 2: return AttendHead<kKey, kKeyBits, FieldFormat::kUniform, 2>;
        case 3: return AttendHead<kKey, kKeyBits, FieldFormat::kUniform, 3>;
        case 4: return AttendHead<kKey, kKeyBits, FieldFormat::kUniform, 4>;
        case 8: return AttendHead<kKey, kKeyBits, FieldFormat::kUniform, 8>;
      }
      return nullptr;
    case FieldFormat::kFp16:
      return AttendHead<kKey, kKeyBits, FieldFormat::kFp16, 16>;
    case FieldFormat::kBf16:
      return AttendHead<kKey, kKeyBits, FieldFormat::kBf16, 16>;
    default:
      return nullptr;
  }
}

// The one place runtime formats become compile-time constants.
Kernel PickKernel(const FieldReader& key, const FieldReader& value) {
  switch (key.format) {
    case FieldFormat::kCentroids:
      switch (key.bits) {
        case 2: return PickValue<FieldFormat::kCentroids, 2>(value);
        case 3: return PickValue<FieldFormat::kCentroids, 3>(value);
        case 4: return PickValue<FieldFormat::kCentroids, 4>(value);
      }
      return nullptr;
    case FieldFormat::kFp16:
      return PickValue<FieldFormat::kFp16, 16>(value);
    case FieldFormat::kBf16:
      return PickValue<FieldFormat::kBf16, 16>(value);
    default:
      return nullptr;
  }
}

}  // namespace

bool AttendHeadAvx512Supported(const FieldReader& key, const FieldReader& value, int head_dim) {
  return head_dim % kLanes == 0 && PickKernel(key, value) != nullptr;
}

void AttendHeadAvx512(const HeadAttendParams& params) {
  PickKernel(params.key, params.value)(params);
}

}  // namespace cpu_internal
}  // namespace tqkv
