// Internal to the CPU backend: the pre-RoPE add-back (kernels/key_centering.h)
// of a fused kernel's rows, one block of kAttendBlock tokens at a time, for
// every row of the call at once.
//
// Row r gains at token t
//   sum_i A_ri cos(t theta_i) + B_ri sin(t theta_i) = Re sum_i z_ri e^{i t theta_i},
//   z_ri = A_ri - i B_ri
// (HeadAttendParams::addback_coef holds A and B). For the block from t0 write
// w_ri = z_ri e^{i t0 theta_i}; then token t0 + j gains
//   sum_i Re(w_ri) cos(j theta_i) - Im(w_ri) sin(j theta_i):
// two multiply-adds per (row, pair) and token, against the tables of cos(j
// theta) and sin(j theta), j < kAttendBlock, that every block and call share
// (AddBackFrequency, tabulated once per RopeTable). No sine or cosine is
// evaluated per token or per block: e^{i t0 theta} moves from block to block
// by a complex multiply with e^{i 64 theta} in double (about 1e-16 of drift a
// block, nothing at any context length), and w is formed from it in float
// once per block (a relative error of about 1e-7, as the tables').
//
// Per 16 tokens and four rows with 8 pairs that is 64 multiply-adds and 16
// table loads, shared by the rows: about 5 instructions a token.
//
// Include only from the kernels' translation units: the class is in an
// unnamed namespace (and templated on simd_mappings.h's vectors) so that each
// ISA's file compiles its own copy (simd_mappings.h says why).
#ifndef TQKV_KERNELS_CPU_ADDBACK_H_
#define TQKV_KERNELS_CPU_ADDBACK_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/attend_kernels.h"
#include "kernels/simd/simd_mappings.h"

namespace tqkv {
namespace cpu_internal {
namespace {  // NOLINT(build/namespaces): see the file comment

template <typename V>
class AddBackRows {
 public:
  static constexpr int kLanes = V::kLanes;
  // Groups of kLanes tokens per pass over the pairs, and rows per pass:
  // kPass x kTileRows accumulators and 2 x kPass table vectors in registers.
  static constexpr int kPass = 4;
  static constexpr int kTileRows = V::kRegisters >= 32 ? 4 : 1;
  static_assert(kAttendBlock % (kPass * kLanes) == 0, "passes cover a block");

  // The rows of p; the first block starts at `first`.
  AddBackRows(const HeadAttendParams& p, int64_t first) : p_(p), pairs_(p.addback_pairs), rows_(p.rows) {
    if (pairs_ == 0) return;
    thread_local std::vector<float> floats;
    thread_local std::vector<double> doubles;
    floats.resize(4 * static_cast<size_t>(rows_) * pairs_ + 2 * static_cast<size_t>(pairs_));
    doubles.resize(2 * static_cast<size_t>(pairs_));
    w_re_ = floats.data();
    w_im_ = w_re_ + static_cast<size_t>(rows_) * pairs_;
    z_re_ = w_im_ + static_cast<size_t>(rows_) * pairs_;
    z_im_ = z_re_ + static_cast<size_t>(rows_) * pairs_;
    c_ = z_im_ + static_cast<size_t>(rows_) * pairs_;
    s_ = c_ + pairs_;
    base_c_ = doubles.data();
    base_s_ = base_c_ + pairs_;
    for (int i = 0; i < pairs_; ++i) {
      // Once per call, and only where a run starts past token 0 (sliding
      // windows): the block starts are then chained in double.
      const double theta = p_.addback_freq[i]->theta;
      base_c_[i] = first == 0 ? 1.0 : std::cos(static_cast<double>(first) * theta);
      base_s_[i] = first == 0 ? 0.0 : std::sin(static_cast<double>(first) * theta);
    }
    // z_im_ and w_im_ hold -Im: the tables' sine terms are then added.
    for (int r = 0; r < rows_; ++r) {
      for (int i = 0; i < pairs_; ++i) {
        z_re_[static_cast<size_t>(r) * pairs_ + i] = p_.addback_coef[static_cast<size_t>(r) * 2 * pairs_ + i];
        z_im_[static_cast<size_t>(r) * pairs_ + i] = p_.addback_coef[static_cast<size_t>(r) * 2 * pairs_ + pairs_ + i];
      }
    }
  }

  bool active() const { return pairs_ > 0; }

  // ab[r * kAttendBlock + j]: the add-back of row r at token t0 + j of the
  // current block, every row; then moves to the next block.
  void Next(float* ab) {
    Reseed();
    int r = 0;
    for (; r + kTileRows <= rows_; r += kTileRows) Tile<kTileRows>(r, ab);
    for (; r < rows_; ++r) Tile<1>(r, ab);
    Advance();
  }

 protected:
  // e^{i t0 theta} to the next block's.
  void Advance() {
    for (int i = 0; i < pairs_; ++i) {
      const double* step = p_.addback_freq[i]->step;
      const double c = base_c_[i] * step[0] - base_s_[i] * step[1];
      base_s_[i] = base_s_[i] * step[0] + base_c_[i] * step[1];
      base_c_[i] = c;
    }
  }

  // w = z e^{i t0 theta} for every (row, pair): with z = x - i y and
  // e^{i t0 theta} = c + i s, Re(w) = x c + y s and -Im(w) = y c - x s.
  void Reseed() {
    for (int i = 0; i < pairs_; ++i) {
      c_[i] = static_cast<float>(base_c_[i]);
      s_[i] = static_cast<float>(base_s_[i]);
    }
    for (int r = 0; r < rows_; ++r) {
      const size_t row = static_cast<size_t>(r) * pairs_;
      for (int i = 0; i < pairs_; ++i) {
        const float x = z_re_[row + i], y = z_im_[row + i];
        w_re_[row + i] = x * c_[i] + y * s_[i];
        w_im_[row + i] = y * c_[i] - x * s_[i];
      }
    }
  }

  // The coefficients z of row r (A_ri and B_ri), and their size.
  float RowNorm(int r, float* largest) const {
    float sum = 0.0f;
    *largest = 0.0f;
    for (int i = 0; i < pairs_; ++i) {
      const size_t n = static_cast<size_t>(r) * pairs_ + i;
      const float size = std::sqrt(z_re_[n] * z_re_[n] + z_im_[n] * z_im_[n]);
      sum += size;
      *largest = std::max(*largest, size);
    }
    return sum;
  }

 private:
  // Rows [r0, r0 + kRows) of ab, kPass groups at a time.
  template <int kRows>
  void Tile(int r0, float* ab) const {
    for (int j0 = 0; j0 < kAttendBlock; j0 += kPass * kLanes) {
      typename V::F32 acc[kRows][kPass];
      for (int k = 0; k < kRows; ++k) {
        for (int g = 0; g < kPass; ++g) acc[k][g] = V::Zero();
      }
      for (int i = 0; i < pairs_; ++i) {
        const AddBackFrequency& f = *p_.addback_freq[i];
        typename V::F32 c[kPass], s[kPass];
        for (int g = 0; g < kPass; ++g) {
          c[g] = V::Load(f.cos + j0 + g * kLanes);
          s[g] = V::Load(f.sin + j0 + g * kLanes);
        }
        for (int k = 0; k < kRows; ++k) {
          const size_t n = static_cast<size_t>(r0 + k) * pairs_ + i;
          const typename V::F32 re = V::Set1(w_re_[n]), im = V::Set1(w_im_[n]);
          for (int g = 0; g < kPass; ++g) acc[k][g] = V::Fmadd(im, s[g], V::Fmadd(re, c[g], acc[k][g]));
        }
      }
      for (int k = 0; k < kRows; ++k) {
        for (int g = 0; g < kPass; ++g) V::Store(ab + (r0 + k) * kAttendBlock + j0 + g * kLanes, acc[k][g]);
      }
    }
  }

 protected:
  const HeadAttendParams& p_;
  const int pairs_;
  const int rows_;
  float* w_re_ = nullptr;  // [rows][pairs]
  float* w_im_ = nullptr;
  float* z_re_ = nullptr;
  float* z_im_ = nullptr;
  float* c_ = nullptr;  // [pairs]: e^{i t0 theta} of the block, in float
  float* s_ = nullptr;
  double* base_c_ = nullptr;  // [pairs]: e^{i t0 theta}, in double
  double* base_s_ = nullptr;
};

}  // namespace
}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ADDBACK_H_
