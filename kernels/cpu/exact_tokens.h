// Internal to the CPU backend: the exact tokens of a fused kernel's walk
// (HeadAttendParams::exact): the sink and recent tokens read from their fp16
// copies in exact pages, block by block, inside the kernel's own online
// softmax. The kernel asks which of a block's tokens are exact (BlockMask),
// takes their logits from Scores in place of the compressed ones, and after
// its softmax gives their weights to Values, which adds weight x value to
// the exact accumulator (ExactTokens::out, in the original basis); Rescale
// and Finish follow the kernel's own accumulator.
//
// The work is fp32 multiply-adds on the fp16 keys and values: per token and
// row head_dim of each, as a bf16 kernel spends, with no per-call setup
// beyond a pointer per token.
//
// Not prefetched: the exact lines asked for ahead (the next block's, a group
// at each BlockPrefetch step into L2, or a block's values into L1 while its
// keys are scored) measured slower in the integer kernel at 1k context
// (Xeon, 2 threads, batch 8, medians of 4: vs_plain 1.283 and 1.292 against
// 1.260 and 1.268 without; why was not isolated: the kernel's time at 1k
// already sits mostly on BlockPrefetch's prefetch instructions).
//
// Include only from the kernels' translation units (unnamed namespace,
// templated on simd_mappings.h's vectors, which says why).
#ifndef TQKV_KERNELS_CPU_EXACT_TOKENS_H_
#define TQKV_KERNELS_CPU_EXACT_TOKENS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {
namespace {  // NOLINT(build/namespaces): see the file comment

template <typename V>
class ExactReader {
 public:
  static constexpr int kLanes = V::kLanes;
  // Rows per pass: 4 x 4 accumulators with 32 registers, 2 x 4 with 16.
  static constexpr int kTileRows = V::kRegisters >= 32 ? 4 : 2;

  explicit ExactReader(const HeadAttendParams& p) : p_(p), e_(p.exact), d_(p.head_dim) {}

  bool any() const { return e_.any(); }

  // Bit i: token t0 + i is read exact (i < count, t0 + i >= token_begin).
  uint64_t BlockMask(int64_t t0, int count) const {
    if (!e_.any()) return 0;
    const auto bits = [&](int64_t begin, int64_t end) -> uint64_t {
      const int from = static_cast<int>(std::clamp<int64_t>(begin - t0, 0, count));
      const int to = static_cast<int>(std::clamp<int64_t>(end - t0, 0, count));
      if (from >= to) return 0;
      const uint64_t upto = to == 64 ? ~uint64_t{0} : (uint64_t{1} << to) - 1;
      return upto & ~((uint64_t{1} << from) - 1);
    };
    return bits(std::max<int64_t>(p_.token_begin, 0), e_.sink_end) |
           bits(std::max(p_.token_begin, e_.recent_begin), t0 + count);
  }

  // scores[r * kAttendBlock + i] = the query of row r . the key of token t0 +
  // i, every row, for each bit i of mask (other entries untouched). Also
  // finds the tokens' values for Values.
  void Scores(int64_t t0, uint64_t mask, float* scores) {
    Locate(t0, mask);
    int r0 = 0;
    for (; r0 + kTileRows <= p_.rows; r0 += kTileRows) ScoreRows<kTileRows>(r0, scores);
    for (; r0 < p_.rows; ++r0) ScoreRows<1>(r0, scores);
  }

  // out[r] += w[r * kAttendBlock + i] x the value of token t0 + i, for each
  // token Scores found, every row that sees any of the block (the others'
  // weights may be anything: the kernels skip such rows).
  void Values(int64_t t0, const float* w) {
    int r0 = 0;
    for (; r0 + kTileRows <= p_.rows; r0 += kTileRows) ValueRows<kTileRows>(r0, t0, w);
    for (; r0 < p_.rows; ++r0) ValueRows<1>(r0, t0, w);
  }

  // out[r] *= factor (the kernel's correction when a block raises the maximum).
  void Rescale(int r, float factor) {
    if (!e_.any() || factor == 1.0f) return;
    float* out = e_.out + static_cast<size_t>(r) * d_;
    const typename V::F32 f = V::Set1(factor);
    for (int c = 0; c < d_; c += kLanes) V::Store(out + c, V::Mul(V::Load(out + c), f));
  }

  // out[r] *= inv_sum (1 / the row's softmax denominator; 0 for a row that saw nothing).
  void Finish(int r, float inv_sum) {
    if (!e_.any()) return;
    Rescale(r, inv_sum);
  }

  // Zeroes the accumulator (at the start of a call).
  void Clear() {
    if (e_.any()) memset(e_.out, 0, sizeof(float) * p_.rows * d_);
  }

 private:
  // keys_[k], values_[k], index_[k]: the k-th exact token of the block's mask.
  void Locate(int64_t t0, uint64_t mask) {
    count_ = 0;
    while (mask != 0) {
      // One run of consecutive tokens: a page look-up at its start, then slots.
      const int i = __builtin_ctzll(mask);
      const uint64_t from_i = mask >> i;
      const int run = from_i == ~uint64_t{0} ? 64 - i : __builtin_ctzll(~from_i);
      int64_t page_index = (t0 + i) / e_.page_tokens;
      int slot = static_cast<int>((t0 + i) % e_.page_tokens);
      for (int k = 0; k < run; ++k) {
        const uint8_t* page = p_.pool_base + static_cast<size_t>(e_.block_table[page_index]) * p_.page_bytes;
        keys_[count_] = reinterpret_cast<const uint16_t*>(page + e_.key_offset) + static_cast<size_t>(slot) * d_;
        values_[count_] = reinterpret_cast<const uint16_t*>(page + e_.value_offset) + static_cast<size_t>(slot) * d_;
        index_[count_++] = i + k;
        if (++slot == e_.page_tokens) {
          slot = 0;
          ++page_index;
        }
      }
      mask = i + run == 64 ? 0 : mask & ~((uint64_t{2} << (i + run - 1)) - 1);
    }
  }

  // The logits of rows [r0, r0 + kRows) for the block's exact tokens, four
  // tokens at a time: 4 x kRows independent chains of multiply-adds, each
  // row's four sums reduced together.
  template <int kRows>
  void ScoreRows(int r0, float* scores) const {
    for (int k0 = 0; k0 < count_; k0 += 4) {
      const uint16_t* key[4];
      for (int k = 0; k < 4; ++k) key[k] = keys_[std::min(k0 + k, count_ - 1)];
      typename V::F32 acc[kRows][4];
      for (int r = 0; r < kRows; ++r) {
        for (int k = 0; k < 4; ++k) acc[r][k] = V::Zero();
      }
      for (int c = 0; c < d_; c += kLanes) {
        typename V::F32 x[4];
        for (int k = 0; k < 4; ++k) x[k] = V::LoadHalves(key[k] + c);
        for (int r = 0; r < kRows; ++r) {
          const typename V::F32 q = V::Load(e_.query_rows[r0 + r] + c);
          for (int k = 0; k < 4; ++k) acc[r][k] = V::Fmadd(q, x[k], acc[r][k]);
        }
      }
      // Four tokens in a row (the usual case) take one store: a reload of
      // scalars from a wider store would wait for it.
      const bool whole = k0 + 4 <= count_ && index_[k0 + 3] == index_[k0] + 3;
      for (int r = 0; r < kRows; ++r) {
        const __m128 sums =
            _mm_mul_ps(V::Sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(e_.query_scale));
        float* row = scores + (r0 + r) * kAttendBlock;
        if (whole) {
          _mm_storeu_ps(row + index_[k0], sums);
          continue;
        }
        alignas(16) float lanes[4];
        _mm_store_ps(lanes, sums);
        for (int k = 0; k < 4 && k0 + k < count_; ++k) row[index_[k0 + k]] = lanes[k];
      }
    }
  }

  // Rows [r0, r0 + kRows) take the block's exact tokens' weighted values,
  // kChunks vectors of coordinates at a time (kRows x kChunks chains).
  template <int kRows>
  void ValueRows(int r0, int64_t t0, const float* w) {
    constexpr int kChunks = 4;
    bool any = false;
    for (int r = 0; r < kRows; ++r) any = any || p_.visible[r0 + r] > t0;
    if (!any) return;
    for (int c0 = 0; c0 < d_; c0 += kChunks * kLanes) {
      const int chunks = std::min(kChunks, (d_ - c0) / kLanes);
      typename V::F32 acc[kRows][kChunks];
      for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kChunks; ++c) acc[r][c] = c < chunks ? Out(r0 + r, c0 + c * kLanes) : V::Zero();
      }
      for (int k = 0; k < count_; ++k) {
        typename V::F32 v[kChunks];
        for (int c = 0; c < kChunks; ++c) v[c] = c < chunks ? V::LoadHalves(values_[k] + c0 + c * kLanes) : V::Zero();
        for (int r = 0; r < kRows; ++r) {
          const typename V::F32 weight = V::Set1(w[static_cast<size_t>(r0 + r) * kAttendBlock + index_[k]]);
          for (int c = 0; c < kChunks; ++c) acc[r][c] = V::Fmadd(weight, v[c], acc[r][c]);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        if (p_.visible[r0 + r] <= t0) continue;
        for (int c = 0; c < chunks; ++c)
          V::Store(e_.out + static_cast<size_t>(r0 + r) * d_ + c0 + c * kLanes, acc[r][c]);
      }
    }
  }

  typename V::F32 Out(int r, int c) const { return V::Load(e_.out + static_cast<size_t>(r) * d_ + c); }

  const HeadAttendParams& p_;
  const ExactTokens& e_;
  const int d_;
  int count_ = 0;
  const uint16_t* keys_[kAttendBlock];
  const uint16_t* values_[kAttendBlock];
  int index_[kAttendBlock];
};

}  // namespace
}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_EXACT_TOKENS_H_
