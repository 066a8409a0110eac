// The CPU add-back's per-call plan (kernels/cpu/addback.h runs it): which
// RoPE pairs of a key mean are added back, their tabulated frequencies, and
// each query row's coefficients. Host-side helpers of cpu_backend.cc.
//
// Thread safety: TabulatedFrequencies keeps its tables per thread; the
// returned reference stays valid until this thread's next few calls with
// other RoPEs (it keeps the last kKeptTables).
#ifndef TQKV_KERNELS_CPU_ADDBACK_PLAN_H_
#define TQKV_KERNELS_CPU_ADDBACK_PLAN_H_

#include <vector>

#include "kernels/cpu/attend_kernels.h"
#include "kernels/key_centering.h"

namespace tqkv {
namespace cpu_internal {

// Every rotary frequency of `rope` tabulated (AddBackFrequency), kept per
// thread for the last kKeptTables RoPEs seen: one per layout, or one per
// layer RoPE (KvLayout::rope(layer); Gemma 3 has two), so calls that
// alternate between layers of different RoPEs do not tabulate again.
inline constexpr int kKeptTables = 4;
const std::vector<AddBackFrequency>& TabulatedFrequencies(const RopeTable& rope);

// The add-back's pairs (ActivePairs) of one KV head's mean and their
// tabulated frequencies (this thread's table), into `pairs` and `freq`;
// their count.
int AddBackPairs(const RopeTable& rope, const float* mean, std::vector<int>* pairs,
                 std::vector<const AddBackFrequency*>* freq);

// Row r's add-back coefficients (HeadAttendParams::addback_coef: A of each
// listed pair, then B) and constant part, logit scale folded in
// (MakeAddBackTerms without its allocations). coef: 2 * pairs.size() floats.
double AddBackCoefficients(const RopeTable& rope, const float* mean, const float* query, int d, float scale,
                           const std::vector<int>& pairs, float* coef);

}  // namespace cpu_internal
}  // namespace tqkv

#endif  // TQKV_KERNELS_CPU_ADDBACK_PLAN_H_
