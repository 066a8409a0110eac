// Host-side descriptions of what the CUDA kernels read: the format tables
// (DeviceHead per layer and KV head, their codebooks, rotations and channel
// lists in one blob, relocated to the blob's device address), each layout's
// per-layer kernel choices, and the token runs and exact block tables of a
// read. Built once per pool (AllocatePool) and per call (the runs).
#ifndef TQKV_KERNELS_CUDA_DEVICE_TABLES_H_
#define TQKV_KERNELS_CUDA_DEVICE_TABLES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/codec.h"
#include "kernels/cuda/device_format.h"
#include "kernels/format_table.h"
#include "kernels/kv_layout.h"
#include "kernels/rotation.h"

namespace tqkv {
namespace cuda {

inline size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---------------------------------------------------------------------------
// Format tables: DeviceHead structs whose pointers are offsets into one blob
// until the blob has a device address.

class TableBuilder {
 public:
  TableBuilder() : blob_(16, 0) {}  // offset 0 stands for null

  // Appends `bytes` of `data`, once per distinct `key`; returns the offset.
  size_t Add(const void* key, const void* data, size_t bytes) {
    auto it = offsets_.find(key);
    if (it != offsets_.end()) return it->second;
    const size_t offset = AlignUp(blob_.size(), 16);
    blob_.resize(offset + bytes);
    std::memcpy(blob_.data() + offset, data, bytes);
    offsets_[key] = offset;
    return offset;
  }
  template <typename T>
  const T* AddVector(const std::vector<T>& v) {
    return reinterpret_cast<const T*>(Add(v.data(), v.data(), v.size() * sizeof(T)));
  }
  const std::vector<uint8_t>& blob() const { return blob_; }

 private:
  std::vector<uint8_t> blob_;
  std::map<const void*, size_t> offsets_;
};

template <typename T>
void Relocate(const T*& pointer, const uint8_t* base) {
  if (pointer != nullptr) pointer = reinterpret_cast<const T*>(base + reinterpret_cast<uintptr_t>(pointer));
}

// Relocates every table pointer of `field` by `base` (the blob's address).
void Relocate(DeviceField& field, const uint8_t* base);

// The device form of `rotation`, its tables added to `tables`.
absl::StatusOr<DeviceRotation> DescribeRotation(const Rotation& rotation, TableBuilder& tables);

// A factor s in [1, 2) for which every centroid times s rounds to fp16 with
// the least largest relative error (a search over 2^14 steps; memoized per
// codebook). Why: the fp16 kernel's key tables hold the centroids in fp16,
// and a codebook's rounding errors are the same for every token, so that in
// a logit they add up coherently instead of averaging out: an error of up
// to 2^-12 of a large logit, which the softmax then amplifies. 2- and 3-bit
// codebooks (2 or 4 magnitudes) find an s with errors 10-50x smaller.
float PairTableScale(const std::vector<float>& centroids);

// The device form of `codec`'s field whose codes and scalars start at the
// given page offsets; UNIMPLEMENTED for codecs the kernels cannot read.
absl::StatusOr<DeviceField> DescribeField(const VectorCodec& codec, size_t codes_offset, size_t scalars_offset,
                                          TableBuilder& tables);

// One layout's pages as the kernels see them: the cache's layout, or its
// exact layout (same pool, same page stride).
struct LayoutTables {
  const DeviceHead* heads = nullptr;   // [num_layers * num_kv_heads], in PoolTables::memory
  std::vector<FormatPair> layer_pair;  // each layer's (key, value) formats
  std::vector<bool> layer_mma;         // whether a tensor-core kernel reads it
  // The fp16 tensor-core kernel's shape code (cuda::AttendHmmaShape), -1:
  // the TF32 one reads it (or none, without layer_mma).
  std::vector<int> layer_hmma;
  // AttendBlocks of the layer's kernel one SM runs at once (occupancy API);
  // filled by AllocatePool.
  std::vector<int> layer_blocks_per_sm;
  std::vector<DeviceFieldFormat> layer_key_format;
};

// A pool's device-side description: one allocation holding the blob and the
// DeviceHead arrays of both layouts.
struct PoolTables {
  void* memory = nullptr;
  LayoutTables main;
  LayoutTables exact;                      // heads null without exact tokens
  const KvLayout* exact_layout = nullptr;  // identifies Store calls for exact pages
};

// The DeviceHeads of `layout` (offsets into the blob) and its per-layer
// kernel choices; UNIMPLEMENTED for what the kernels cannot read.
absl::Status DescribeLayout(const KvLayout& layout, bool tensor_cores, TableBuilder& tables,
                            std::vector<DeviceHead>* heads, LayoutTables* out);

// The runs of tokens a read of a layer holding `length` tokens covers
// (backend.h): the compressed run first, then the exact runs (sinks,
// recent tokens); empty runs left out.
struct Segment {
  bool exact;
  int64_t begin;
  int64_t end;
};
constexpr int kMaxSegments = 3;

// Fills `out` (kMaxSegments) with the runs; returns how many.
int Segments(const KvLayout& layout, bool has_exact_table, int64_t length, Segment* out);

// Appends the exact block table of a read of `length` tokens whose view ends
// at `view_end` to `tables`: the entries of pages holding exact-range tokens,
// -1 for the others (which may be released).
void AppendExactTable(const KvLayout& layout, const int32_t* exact_table, int64_t length, int64_t view_end,
                      std::vector<int32_t>* tables);

}  // namespace cuda
}  // namespace tqkv

#endif  // TQKV_KERNELS_CUDA_DEVICE_TABLES_H_
