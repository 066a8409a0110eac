#include "kernels/cuda/device_tables.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/float_formats.h"
#include "kernels/cuda/attend_kernels.cuh"
#include "base/status_macros.h"

namespace tqkv {
namespace cuda {

void Relocate(DeviceField& field, const uint8_t* base) {
  for (int p = 0; p < field.num_parts; ++p) {
    DevicePart& part = field.parts[p];
    Relocate(part.centroids, base);
    Relocate(part.boundaries, base);
    Relocate(part.channels, base);
    Relocate(part.rotation.signs, base);
    Relocate(part.rotation.factor, base);
    Relocate(part.rotation.factor_t, base);
    Relocate(part.rotation.matrix, base);
  }
}

float PairTableScale(const std::vector<float>& centroids) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* found = new std::map<std::vector<float>, float>();
  absl::MutexLock lock(&mu);
  auto it = found->find(centroids);
  if (it != found->end()) return it->second;
  constexpr int kSteps = 1 << 14;
  const auto worst = [&](float s) {
    double most = 0.0;
    for (float c : centroids) {
      const float x = c * s;
      if (x != 0.0f)
        most = std::max(most, std::fabs(static_cast<double>(HalfToFloat(FloatToHalf(x))) - x) / std::fabs(x));
    }
    return most;
  };
  float best = 1.0f;
  double best_error = worst(1.0f);
  for (int k = 1; k < kSteps; ++k) {
    const float s = 1.0f + static_cast<float>(k) / kSteps;
    const double error = worst(s);
    if (error < best_error) {
      best = s;
      best_error = error;
    }
  }
  found->emplace(centroids, best);
  return best;
}

absl::StatusOr<DeviceRotation> DescribeRotation(const Rotation& rotation, TableBuilder& tables) {
  DeviceRotation r;
  r.dim = rotation.dim();
  switch (rotation.kind()) {
    case Rotation::Kind::kRandomizedHadamard: {
      r.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(r.dim)));
      r.signs = tables.AddVector(rotation.signs());
      const int m = rotation.hadamard_factor_order();
      if (m == 1) {
        r.kind = DeviceRotationKind::kHadamard;
        return r;
      }
      r.kind = DeviceRotationKind::kKron;
      r.factor_order = m;
      r.factor_rows = r.dim / m;
      const std::vector<float>& factor = rotation.hadamard_factor();
      r.factor = tables.AddVector(factor);
      std::vector<float> transpose(factor.size());
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < m; ++j) transpose[j * m + i] = factor[i * m + j];
      }
      // One transpose per m: name it by the factor's last element.
      r.factor_t = reinterpret_cast<const float*>(
          tables.Add(&factor.back(), transpose.data(), transpose.size() * sizeof(float)));
      return r;
    }
    case Rotation::Kind::kDense:
      r.kind = DeviceRotationKind::kDense;
      r.matrix = tables.AddVector(rotation.matrix());
      return r;
    default:
      return absl::UnimplementedError("the CUDA backend reads randomized Hadamard and dense rotations only");
  }
}

absl::StatusOr<DeviceField> DescribeField(const VectorCodec& codec, size_t codes_offset, size_t scalars_offset,
                                          TableBuilder& tables) {
  DeviceField f;
  f.code_bytes = codec.code_bytes();
  f.num_scalars = codec.num_scalars();
  f.codes_offset = codes_offset;
  f.scalars_offset = scalars_offset;
  const CodecSpec& spec = codec.spec();
  f.tiled = TiledCodes(spec.kind) ? 1 : 0;
  // The readers of raw fields (attend_kernels_impl.cuh) load runs of
  // coordinates contiguously: token-major planes only.
  const bool raw = spec.kind == CodecKind::kFp16 || spec.kind == CodecKind::kBf16 || spec.kind == CodecKind::kFp8;
  if (raw && f.tiled) {
    return absl::UnimplementedError(
        absl::StrFormat("the CUDA kernels read %s codes token-major, not tiled", spec.Name()));
  }
  switch (spec.kind) {
    case CodecKind::kFp16:
      f.format = DeviceFieldFormat::kFp16;
      f.bits = 16;
      return f;
    case CodecKind::kBf16:
      f.format = DeviceFieldFormat::kBf16;
      f.bits = 16;
      return f;
    case CodecKind::kFp8:
      f.format = DeviceFieldFormat::kFp8;
      f.bits = 8;
      return f;
    case CodecKind::kUniform:
      f.format = DeviceFieldFormat::kUniform;
      f.bits = spec.bits;
      return f;
    case CodecKind::kTurboQuant:
    case CodecKind::kOutlierSplit: {
      f.format = DeviceFieldFormat::kTurboQuant;
      const std::vector<TurboQuantPart>& parts = codec.turboquant_parts();
      f.num_parts = static_cast<int>(parts.size());
      int state_offset = 0;
      for (int p = 0; p < f.num_parts; ++p) {
        const TurboQuantPart& src = parts[p];
        DevicePart& part = f.parts[p];
        part.dim = static_cast<int>(src.channels.size());
        part.bits = src.codebook->bits;
        part.code_offset = src.code_offset;
        part.scalar_index = src.scalar_index;
        part.state_offset = state_offset;
        part.norm_correction = spec.norm_correction ? 1 : 0;
        part.centroids = tables.AddVector(src.codebook->centroids);
        f.pair_scale[p] = PairTableScale(src.codebook->centroids);
        part.boundaries = tables.AddVector(src.codebook->boundaries);
        bool identity = part.dim == codec.head_dim();
        for (int k = 0; identity && k < part.dim; ++k) identity = src.channels[k] == k;
        if (!identity) part.channels = tables.AddVector(src.channels);
        ASSIGN_OR_RETURN(part.rotation, DescribeRotation(*src.rotation, tables));
        if (part.dim % 4 != 0) {
          return absl::UnimplementedError(
              absl::StrFormat("the CUDA kernels need TurboQuant parts of a multiple of 4 channels, got %d", part.dim));
        }
        state_offset += part.dim;
      }
      f.bits = f.parts[0].bits;
      return f;
    }
    case CodecKind::kQjl:
      break;
  }
  return absl::UnimplementedError(
      absl::StrFormat("the CUDA backend has no kernels for %s (evaluation only); use --backend cpu", spec.Name()));
}

absl::Status DescribeLayout(const KvLayout& layout, bool tensor_cores, TableBuilder& tables,
                            std::vector<DeviceHead>* heads, LayoutTables* out) {
  const int d = layout.head_dim();
  heads->assign(static_cast<size_t>(layout.num_layers()) * layout.num_kv_heads(), DeviceHead());
  for (int layer = 0; layer < layout.num_layers(); ++layer) {
    for (int head = 0; head < layout.num_kv_heads(); ++head) {
      const KvLayout::HeadPlanes& planes = layout.planes(layer, head);
      DeviceHead& h = (*heads)[static_cast<size_t>(layer) * layout.num_kv_heads() + head];
      ASSIGN_OR_RETURN(h.key,
                       DescribeField(layout.key_codec(layer, head), planes.key_codes, planes.key_scalars, tables));
      ASSIGN_OR_RETURN(
          h.value, DescribeField(layout.value_codec(layer, head), planes.value_codes, planes.value_scalars, tables));
      if (h.value.format == DeviceFieldFormat::kTurboQuant && h.value.num_parts != 1) {
        return absl::UnimplementedError("the CUDA backend reads single-part TurboQuant values only");
      }
    }
    const DeviceHead& first = (*heads)[static_cast<size_t>(layer) * layout.num_kv_heads()];
    FormatPair pair;
    if (!FindFormatPair(first.key.format, first.value.format, &pair) || (PairInfo(pair).fused_on & kFusedCuda) == 0 ||
        !cuda::ScoreSupported(first.key.format)) {
      return absl::UnimplementedError(
          absl::StrFormat("the CUDA backend has no attention kernel for preset %s (layer %d)",
                          std::string(layout.layer_preset(layer).name), layer));
    }
    out->layer_pair.push_back(pair);
    // The fp16 tensor-core kernel where every head of the layer has its one shape.
    int shape = cuda::AttendHmmaShape(first.key, first.value, d, layout.page_tokens());
    for (int head = 1; head < layout.num_kv_heads() && shape >= 0; ++head) {
      const DeviceHead& h = (*heads)[static_cast<size_t>(layer) * layout.num_kv_heads() + head];
      if (cuda::AttendHmmaShape(h.key, h.value, d, layout.page_tokens()) != shape) shape = -1;
    }
    if (!tensor_cores || layout.page_bytes() > UINT32_MAX) shape = -1;  // HmmaAt: 32-bit page bytes
    out->layer_hmma.push_back(shape);
    out->layer_mma.push_back(shape >= 0 || (tensor_cores && cuda::AttendMmaSupported(first.key, first.value, d)));
    out->layer_key_format.push_back(first.key.format);
  }
  return absl::OkStatus();
}

int Segments(const KvLayout& layout, bool has_exact_table, int64_t length, Segment* out) {
  if (!layout.has_exact_tokens() || !has_exact_table) {
    out[0] = {false, 0, length};
    return 1;
  }
  const ExactRanges r = layout.exact_ranges(length);
  int n = 0;
  if (r.recent_begin > r.sink_end) out[n++] = {false, r.sink_end, r.recent_begin};
  if (r.sink_end > 0) out[n++] = {true, 0, r.sink_end};
  if (length > r.recent_begin) out[n++] = {true, r.recent_begin, length};
  return n;
}

void AppendExactTable(const KvLayout& layout, const int32_t* exact_table, int64_t length, int64_t view_end,
                      std::vector<int32_t>* tables) {
  const ExactRanges r = layout.exact_ranges(length);
  const int64_t ept = layout.exact_page_tokens();
  const int64_t pages = (view_end + ept - 1) / ept;
  for (int64_t i = 0; i < pages; ++i) {
    const bool needed = i * ept < r.sink_end || (i + 1) * ept > r.recent_begin;
    tables->push_back(needed ? exact_table[i] : -1);
  }
}

}  // namespace cuda
}  // namespace tqkv
