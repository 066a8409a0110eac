#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/codec.h"
#include "kernels/cuda/attend_kernels.cuh"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_format.h"
#include "kernels/cuda/store_kernels.cuh"
#include "kernels/status_macros.h"

namespace tqkv {
namespace {

using cuda::AttendBlock;
using cuda::AttendItemDesc;
using cuda::CudaStatus;
using cuda::DeviceField;
using cuda::DeviceFieldFormat;
using cuda::DeviceHead;
using cuda::DevicePart;
using cuda::DeviceRotation;
using cuda::DeviceRotationKind;
using cuda::MergeUnit;

thread_local double last_kernel_seconds = 0.0;

// Query tokens of one item handled together; longer items are split (each
// piece sees its own causal prefix).
constexpr int kMaxQueryTokensPerPiece = 32;
// The launch key of the tensor-core kernel's blocks (above any fp32 one).
constexpr int kMmaLaunch = 1 << 10;
// Arena alignment slack of one Attend batch, beyond its pieces' bytes.
constexpr size_t kBatchOverhead = 8 * 256;
// Bytes read past a pool's last page by vectorised loads of a tail group.
constexpr size_t kPoolTailPadding = 256;

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

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

absl::StatusOr<DeviceField> DescribeField(const VectorCodec& codec, size_t codes_offset,
                                          size_t scalars_offset, TableBuilder& tables) {
  DeviceField f;
  f.code_bytes = codec.code_bytes();
  f.num_scalars = codec.num_scalars();
  f.codes_offset = codes_offset;
  f.scalars_offset = scalars_offset;
  const CodecSpec& spec = codec.spec();
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
        part.boundaries = tables.AddVector(src.codebook->boundaries);
        bool identity = part.dim == codec.head_dim();
        for (int k = 0; identity && k < part.dim; ++k) identity = src.channels[k] == k;
        if (!identity) part.channels = tables.AddVector(src.channels);
        ASSIGN_OR_RETURN(part.rotation, DescribeRotation(*src.rotation, tables));
        if (part.dim % 4 != 0) {
          return absl::UnimplementedError(absl::StrFormat(
              "the CUDA kernels need TurboQuant parts of a multiple of 4 channels, got %d", part.dim));
        }
        state_offset += part.dim;
      }
      f.bits = f.parts[0].bits;
      return f;
    }
    case CodecKind::kQjl:
      break;
  }
  return absl::UnimplementedError(absl::StrFormat(
      "the CUDA backend has no kernels for %s (evaluation only); use --backend cpu", spec.Name()));
}

// A pool's device-side description.
struct PoolTables {
  void* memory = nullptr;  // the blob followed by the DeviceHead array
  const DeviceHead* heads = nullptr;
  std::vector<int> layer_variant;  // AttendVariant of each layer
  std::vector<bool> layer_mma;     // whether the tensor-core kernel reads it
  std::vector<DeviceFieldFormat> layer_key_format;
  std::vector<bool> layer_value_rotated;
};

// ---------------------------------------------------------------------------

// Bump allocation inside a workspace buffer.
class Arena {
 public:
  explicit Arena(size_t capacity) : capacity_(capacity) {}
  // Offset of `bytes` new bytes (256-aligned); `fits` turns false on overflow.
  size_t Take(size_t bytes) {
    const size_t offset = AlignUp(used_, 256);
    used_ = offset + bytes;
    return offset;
  }
  bool fits() const { return used_ <= capacity_; }
  size_t used() const { return used_; }

 private:
  size_t capacity_;
  size_t used_ = 0;
};

struct Workspace {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  uint8_t* host = nullptr;    // pinned
  uint8_t* device = nullptr;
  // Host-side plans, reused from call to call.
  std::vector<AttendItemDesc> items;
  std::vector<AttendBlock> blocks;
  std::vector<AttendBlock> sorted_blocks;
  std::vector<MergeUnit> units;
  std::vector<int32_t> head_of_row;
  std::vector<int32_t> tables;
  struct Piece {
    const AttendItem* item;
    int token0;
    int tokens;
  };
  std::vector<Piece> pieces;
};

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(const CudaBackendOptions& options) {
    if (options.workspaces < 1 || options.workspace_bytes < (size_t{1} << 20)) {
      return absl::InvalidArgumentError("the CUDA backend needs >= 1 workspace of >= 1 MiB");
    }
    ASSIGN_OR_RETURN(std::vector<cuda::DeviceInfo> devices, cuda::ListDevices());
    if (options.device < 0 || options.device >= static_cast<int>(devices.size())) {
      return absl::InvalidArgumentError(absl::StrFormat("CUDA device %d does not exist (%d found)",
                                                        options.device, devices.size()));
    }
    std::unique_ptr<CudaBackend> backend(new CudaBackend(options, devices[options.device]));
    RETURN_IF_ERROR(backend->Init());
    return std::unique_ptr<Backend>(std::move(backend));
  }

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    for (Workspace& w : workspaces_) {
      if (w.stream != nullptr) cudaStreamDestroy(w.stream);
      if (w.start != nullptr) cudaEventDestroy(w.start);
      if (w.stop != nullptr) cudaEventDestroy(w.stop);
      if (w.host != nullptr) cudaFreeHost(w.host);
      if (w.device != nullptr) cudaFree(w.device);
    }
  }

  std::string name() const override { return "cuda"; }

  std::string device() const override {
    return absl::StrFormat("%s, sm_%d%d, %.0f GiB", info_.name, info_.compute_capability_major,
                           info_.compute_capability_minor,
                           static_cast<double>(info_.total_memory_bytes) / (1ull << 30));
  }

  absl::StatusOr<PagePool> AllocatePool(const KvLayout& layout, int32_t num_pages) override {
    if (num_pages < 1) return absl::InvalidArgumentError("a pool needs at least one page");
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    const int d = layout.head_dim();
    if (d > cuda::kMaxDeviceHeadDim || d % 8 != 0) {
      return absl::UnimplementedError(absl::StrFormat(
          "the CUDA backend takes head dims that are multiples of 8 up to %d, got %d",
          cuda::kMaxDeviceHeadDim, d));
    }
    TableBuilder tables;
    std::vector<DeviceHead> heads(static_cast<size_t>(layout.num_layers()) * layout.num_kv_heads());
    PoolTables pool_tables;
    for (int layer = 0; layer < layout.num_layers(); ++layer) {
      for (int head = 0; head < layout.num_kv_heads(); ++head) {
        const KvLayout::HeadPlanes& planes = layout.planes(layer, head);
        DeviceHead& h = heads[static_cast<size_t>(layer) * layout.num_kv_heads() + head];
        ASSIGN_OR_RETURN(h.key, DescribeField(layout.key_codec(layer, head), planes.key_codes,
                                              planes.key_scalars, tables));
        ASSIGN_OR_RETURN(h.value, DescribeField(layout.value_codec(layer, head), planes.value_codes,
                                                planes.value_scalars, tables));
        if (h.value.format == DeviceFieldFormat::kTurboQuant && h.value.num_parts != 1) {
          return absl::UnimplementedError("the CUDA backend reads single-part TurboQuant values only");
        }
      }
      const DeviceHead& first = heads[static_cast<size_t>(layer) * layout.num_kv_heads()];
      const int variant = cuda::AttendVariant(first.key.format, first.value.format);
      if (variant < 0 || !cuda::ScoreSupported(first.key.format)) {
        return absl::UnimplementedError(absl::StrFormat(
            "the CUDA backend has no attention kernel for preset %s (layer %d)",
            std::string(layout.layer_preset(layer).name), layer));
      }
      pool_tables.layer_variant.push_back(variant);
      pool_tables.layer_mma.push_back(options_.tensor_cores && cuda::AttendMmaSupported(first.key, first.value, d));
      pool_tables.layer_key_format.push_back(first.key.format);
      pool_tables.layer_value_rotated.push_back(first.value.format == DeviceFieldFormat::kTurboQuant);
    }
    const std::vector<uint8_t>& blob = tables.blob();
    const size_t heads_offset = AlignUp(blob.size(), 64);
    const size_t table_bytes = heads_offset + heads.size() * sizeof(DeviceHead);
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&pool_tables.memory, table_bytes), "cudaMalloc (format tables)"));
    const uint8_t* base = static_cast<const uint8_t*>(pool_tables.memory);
    for (DeviceHead& h : heads) {
      Relocate(h.key, base);
      Relocate(h.value, base);
    }
    absl::Status status = CudaStatus(cudaMemcpy(pool_tables.memory, blob.data(), blob.size(),
                                                cudaMemcpyHostToDevice), "copy format tables");
    if (status.ok()) {
      status = CudaStatus(cudaMemcpy(static_cast<uint8_t*>(pool_tables.memory) + heads_offset, heads.data(),
                                     heads.size() * sizeof(DeviceHead), cudaMemcpyHostToDevice),
                          "copy format heads");
    }
    void* pages = nullptr;
    const size_t pool_bytes = layout.page_bytes() * static_cast<size_t>(num_pages);
    if (status.ok()) {
      const cudaError_t error = cudaMalloc(&pages, pool_bytes + kPoolTailPadding);
      if (error == cudaErrorMemoryAllocation) {
        cudaGetLastError();  // not sticky; clear it
        status = absl::ResourceExhaustedError(absl::StrFormat(
            "cannot allocate a %d-page pool (%d bytes) on %s", num_pages, pool_bytes, info_.name));
      } else {
        status = CudaStatus(error, "cudaMalloc (page pool)");
      }
    }
    // Pages start zeroed, like nothing in particular; the tail padding must
    // hold finite bytes for reads that are masked off.
    if (status.ok()) status = CudaStatus(cudaMemset(pages, 0, pool_bytes + kPoolTailPadding), "cudaMemset pool");
    if (!status.ok()) {
      cudaFree(pool_tables.memory);
      if (pages != nullptr) cudaFree(pages);
      return status;
    }
    pool_tables.heads = reinterpret_cast<const DeviceHead*>(base + heads_offset);
    PagePool pool{static_cast<uint8_t*>(pages), layout.page_bytes(), num_pages};
    absl::MutexLock lock(&pools_mu_);
    pools_[pool.base] = std::move(pool_tables);
    return pool;
  }

  void FreePool(PagePool pool) override {
    cudaSetDevice(options_.device);
    void* tables = nullptr;
    {
      absl::MutexLock lock(&pools_mu_);
      auto it = pools_.find(pool.base);
      if (it != pools_.end()) {
        tables = it->second.memory;
        pools_.erase(it);
      }
    }
    cudaFree(tables);
    cudaFree(pool.base);
  }

  absl::Status CopyPage(const PagePool& pool, int32_t from, int32_t to) override {
    if (from < 0 || from >= pool.num_pages || to < 0 || to >= pool.num_pages) {
      return absl::InvalidArgumentError(absl::StrFormat("page copy %d -> %d outside a %d-page pool",
                                                        from, to, pool.num_pages));
    }
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(pool.base + static_cast<size_t>(to) * pool.page_bytes,
                                               pool.base + static_cast<size_t>(from) * pool.page_bytes,
                                               pool.page_bytes, cudaMemcpyDeviceToDevice, w.stream),
                               "copy page"));
    return CudaStatus(cudaStreamSynchronize(w.stream), "copy page (sync)");
  }

  absl::Status Store(const StoreParams& p) override {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    const KvLayout& layout = *p.layout;
    const int layers = p.layer_end - p.layer_begin;
    const size_t vector_floats = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
    const size_t bytes_per_token = 2 * sizeof(float) * layers * vector_floats + sizeof(int32_t);
    const size_t fixed = 4096;
    if (layers <= 0 || p.num_tokens <= 0) return absl::OkStatus();
    const int64_t max_tokens = static_cast<int64_t>((options_.workspace_bytes - fixed) / bytes_per_token);
    if (max_tokens < 1) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "one token of %d layers (%d bytes) does not fit a %d-byte CUDA workspace", layers,
          bytes_per_token, options_.workspace_bytes));
    }
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    double kernel_seconds = 0.0;
    for (int64_t t0 = 0; t0 < p.num_tokens; t0 += max_tokens) {
      const int64_t tokens = std::min<int64_t>(max_tokens, p.num_tokens - t0);
      Arena arena(options_.workspace_bytes);
      const size_t layer_bytes = static_cast<size_t>(tokens) * vector_floats * sizeof(float);
      const size_t keys = arena.Take(layer_bytes * layers);
      const size_t values = arena.Take(layer_bytes * layers);
      const size_t slots = arena.Take(sizeof(int32_t) * tokens);
      const size_t error = arena.Take(sizeof(unsigned long long));
      for (int l = 0; l < layers; ++l) {
        const size_t src = (static_cast<size_t>(l) * p.num_tokens + t0) * vector_floats;
        std::memcpy(w.host + keys + l * layer_bytes, p.keys + src, layer_bytes);
        std::memcpy(w.host + values + l * layer_bytes, p.values + src, layer_bytes);
      }
      std::memcpy(w.host + slots, p.slots + t0, sizeof(int32_t) * tokens);
      const unsigned long long no_error = ~0ull;
      std::memcpy(w.host + error, &no_error, sizeof(no_error));
      cuda::StoreKernelParams k;
      k.heads = tables->heads;
      k.pool = p.pool.base;
      k.page_bytes = p.pool.page_bytes;
      k.page_tokens = layout.page_tokens();
      k.num_kv_heads = layout.num_kv_heads();
      k.head_dim = layout.head_dim();
      k.layer_begin = p.layer_begin;
      k.num_layers = layers;
      k.num_tokens = static_cast<int32_t>(tokens);
      k.slots = reinterpret_cast<const int32_t*>(w.device + slots);
      k.keys = reinterpret_cast<const float*>(w.device + keys);
      k.values = reinterpret_cast<const float*>(w.device + values);
      k.error = reinterpret_cast<unsigned long long*>(w.device + error);
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.device, w.host, arena.used(), cudaMemcpyHostToDevice, w.stream),
                                 "store: copy in"));
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cuda::LaunchStore(k, w.stream), "store kernel launch"));
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + error, w.device + error, sizeof(unsigned long long),
                                                 cudaMemcpyDeviceToHost, w.stream),
                                 "store: copy error word"));
      RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "store kernel"));
      kernel_seconds += ElapsedSeconds(w);
      unsigned long long failure;
      std::memcpy(&failure, w.host + error, sizeof(failure));
      if (failure != ~0ull) return StoreFailure(failure, layout, p, t0, tokens);
    }
    last_kernel_seconds = kernel_seconds;
    return absl::OkStatus();
  }

  absl::Status Score(const ScoreParams& p) override {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    const KvLayout& layout = *p.layout;
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int64_t count = p.token_end - p.token_begin;
    if (count <= 0) return absl::OkStatus();
    const int64_t pages = (p.token_end + layout.page_tokens() - 1) / layout.page_tokens();
    const size_t fixed = 8192 + sizeof(int32_t) * (pages + qh) + 2 * sizeof(float) * qh * d;
    if (fixed + sizeof(float) * qh * cuda::kAttendTile > options_.workspace_bytes) {
      return absl::ResourceExhaustedError("ScoreQuery's block table does not fit a CUDA workspace");
    }
    // Token pieces: whole tiles that fit beside the queries.
    int64_t piece = static_cast<int64_t>((options_.workspace_bytes - fixed) / (sizeof(float) * qh));
    piece = std::max<int64_t>(cuda::kAttendTile, piece / cuda::kAttendTile * cuda::kAttendTile);
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    Arena arena(options_.workspace_bytes);
    const size_t table = arena.Take(sizeof(int32_t) * pages);
    const size_t heads = arena.Take(sizeof(int32_t) * qh);
    const size_t queries = arena.Take(sizeof(float) * qh * d);
    const size_t prepared = arena.Take(sizeof(float) * qh * d);
    const size_t logits = arena.Take(sizeof(float) * qh * std::min(count, piece));
    std::memcpy(w.host + table, p.block_table, sizeof(int32_t) * pages);
    const int group = layout.query_heads_per_kv_head();
    for (int h = 0; h < qh; ++h) {
      const int32_t head = p.layer * layout.num_kv_heads() + h / group;
      std::memcpy(w.host + heads + sizeof(int32_t) * h, &head, sizeof(head));
    }
    std::memcpy(w.host + queries, p.queries, sizeof(float) * qh * d);
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.device, w.host, prepared, cudaMemcpyHostToDevice, w.stream),
                               "score: copy in"));
    const cuda::PoolView view = View(layout, p.pool, *tables);
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
    cuda::PrepareParams prep;
    prep.view = view;
    prep.num_rows = qh;
    prep.head_of_row = reinterpret_cast<const int32_t*>(w.device + heads);
    prep.queries = reinterpret_cast<const float*>(w.device + queries);
    prep.prepared = reinterpret_cast<float*>(w.device + prepared);
    prep.scale = p.scale;
    RETURN_IF_ERROR(CudaStatus(cuda::LaunchPrepare(prep, w.stream), "prepare kernel launch"));
    double kernel_seconds = 0.0;
    for (int64_t t0 = 0; t0 < count; t0 += piece) {
      const int64_t n = std::min(piece, count - t0);
      if (t0 > 0) RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));
      cuda::ScoreKernelParams k;
      k.view = view;
      k.block_table = reinterpret_cast<const int32_t*>(w.device + table);
      k.layer = p.layer;
      k.token_begin = static_cast<int32_t>(p.token_begin + t0);
      k.token_end = static_cast<int32_t>(p.token_begin + t0 + n);
      k.prepared = prep.prepared;
      k.logits = reinterpret_cast<float*>(w.device + logits);
      RETURN_IF_ERROR(CudaStatus(cuda::LaunchScore(tables->layer_key_format[p.layer], k, w.stream),
                                 "score kernel launch"));
      RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + logits, w.device + logits, sizeof(float) * qh * n,
                                                 cudaMemcpyDeviceToHost, w.stream),
                                 "score: copy out"));
      RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "score kernel"));
      kernel_seconds += ElapsedSeconds(w);
      const float* piece_logits = reinterpret_cast<const float*>(w.host + logits);
      for (int h = 0; h < qh; ++h) {
        std::memcpy(p.logits + h * count + t0, piece_logits + h * n, sizeof(float) * n);
      }
    }
    last_kernel_seconds = kernel_seconds;
    return absl::OkStatus();
  }

  absl::Status Attend(const AttendParams& p) override {
    ASSIGN_OR_RETURN(const PoolTables* tables, Enter(p.pool));
    const KvLayout& layout = *p.layout;
    WorkspaceLease lease(this);
    Workspace& w = lease.get();
    // Pieces of at most kMaxQueryTokensPerPiece query tokens.
    w.pieces.clear();
    int64_t total_work = 0;
    bool any_mma = false;
    for (const AttendItem& item : p.items) {
      total_work += item.context_tokens * layout.num_kv_heads();
      any_mma = any_mma || tables->layer_mma[item.layer];
    }
    // Splits: about four thread blocks per SM over the whole request (sixteen
    // one-warp blocks for the tensor-core kernel), whole tiles.
    const int64_t target_blocks = (any_mma ? 16 : 4) * static_cast<int64_t>(sm_count_);
    int64_t split = (total_work + target_blocks - 1) / std::max<int64_t>(1, target_blocks);
    split = std::max<int64_t>(2 * cuda::kAttendTile, (split + cuda::kAttendTile - 1) / cuda::kAttendTile *
                                                         cuda::kAttendTile);
    for (const AttendItem& item : p.items) {
      // As many query tokens per piece as fit a workspace, up to the maximum.
      int per_piece = std::min(kMaxQueryTokensPerPiece, item.num_query_tokens);
      while (per_piece > 1 &&
             PieceBytes(layout, {&item, 0, per_piece}, split) + kBatchOverhead > options_.workspace_bytes) {
        per_piece = (per_piece + 1) / 2;
      }
      for (int t0 = 0; t0 < item.num_query_tokens; t0 += per_piece) {
        w.pieces.push_back({&item, t0, std::min(per_piece, item.num_query_tokens - t0)});
      }
    }
    double kernel_seconds = 0.0;
    size_t next = 0;
    while (next < w.pieces.size()) {
      size_t end = next;
      RETURN_IF_ERROR(PlanBatch(layout, *tables, split, w, next, &end));
      RETURN_IF_ERROR(RunBatch(layout, p, *tables, split, w, next, end, &kernel_seconds));
      next = end;
    }
    last_kernel_seconds = kernel_seconds;
    return absl::OkStatus();
  }

 private:
  // Exclusive use of one workspace for a scope.
  class WorkspaceLease {
   public:
    explicit WorkspaceLease(CudaBackend* backend) : backend_(backend) {
      absl::MutexLock lock(&backend_->workspaces_mu_);
      backend_->workspaces_mu_.Await(absl::Condition(
          +[](std::vector<Workspace*>* free) { return !free->empty(); }, &backend_->free_workspaces_));
      workspace_ = backend_->free_workspaces_.back();
      backend_->free_workspaces_.pop_back();
    }
    ~WorkspaceLease() {
      absl::MutexLock lock(&backend_->workspaces_mu_);
      backend_->free_workspaces_.push_back(workspace_);
    }
    Workspace& get() { return *workspace_; }

   private:
    CudaBackend* backend_;
    Workspace* workspace_;
  };

  CudaBackend(const CudaBackendOptions& options, cuda::DeviceInfo info)
      : options_(options), info_(std::move(info)), workspaces_(options.workspaces) {}

  absl::Status Init() {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, options_.device),
                               "cudaDeviceGetAttribute"));
    for (Workspace& w : workspaces_) {
      RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
      RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&w.start), "cudaEventCreate"));
      RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&w.stop), "cudaEventCreate"));
      RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(reinterpret_cast<void**>(&w.host), options_.workspace_bytes,
                                               cudaHostAllocDefault),
                                 "cudaHostAlloc (workspace)"));
      RETURN_IF_ERROR(CudaStatus(cudaMalloc(reinterpret_cast<void**>(&w.device), options_.workspace_bytes),
                                 "cudaMalloc (workspace)"));
      free_workspaces_.push_back(&w);
    }
    return absl::OkStatus();
  }

  // The start of every compute call: this thread on the backend's device
  // (the current device is per thread), and the pool's format tables.
  absl::StatusOr<const PoolTables*> Enter(const PagePool& pool) {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    absl::MutexLock lock(&pools_mu_);
    auto it = pools_.find(pool.base);
    if (it == pools_.end()) return absl::InvalidArgumentError("page pool was not allocated by this CUDA backend");
    // Entries are only erased by FreePool, which callers never race with a
    // call on the same pool.
    return &it->second;
  }

  static cuda::PoolView View(const KvLayout& layout, const PagePool& pool, const PoolTables& tables) {
    cuda::PoolView v;
    v.heads = tables.heads;
    v.pool = pool.base;
    v.page_bytes = pool.page_bytes;
    v.page_tokens = layout.page_tokens();
    const int pt = layout.page_tokens();
    v.page_shift = (pt & (pt - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(pt)) : -1;
    v.num_kv_heads = layout.num_kv_heads();
    v.num_query_heads = layout.num_query_heads();
    v.head_dim = layout.head_dim();
    return v;
  }

  static double ElapsedSeconds(Workspace& w) {
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, w.start, w.stop) != cudaSuccess) {
      cudaGetLastError();
      return 0.0;
    }
    return ms * 1e-3;
  }

  absl::Status StoreFailure(unsigned long long failure, const KvLayout& layout, const StoreParams& p,
                            int64_t t0, int64_t tokens) {
    const unsigned long long vector = failure / 4;
    const auto code = static_cast<cuda::StoreError>(failure % 4);
    const int heads = layout.num_kv_heads();
    const int head = static_cast<int>(vector % heads);
    const int64_t token = t0 + static_cast<int64_t>((vector / heads) % tokens);
    const int layer = p.layer_begin + static_cast<int>(vector / (heads * tokens));
    const char* what = code == cuda::StoreError::kNotFinite     ? "a coordinate is NaN or infinite; vectors must be finite"
                       : code == cuda::StoreError::kOutOfRange  ? "a coordinate is beyond the fp16 range of the stored format"
                                                                : "the vector norm is beyond the fp16 range of the stored norm";
    return absl::InvalidArgumentError(
        absl::StrFormat("layer %d, token %d, KV head %d: %s", layer, token, head, what));
  }

  // Bytes of one piece in a batch.
  static size_t PieceBytes(const KvLayout& layout, const Workspace::Piece& piece, int64_t split) {
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int group = layout.query_heads_per_kv_head();
    const int64_t pages = (piece.item->context_tokens + layout.page_tokens() - 1) / layout.page_tokens();
    const int rows = piece.tokens * group;
    const int block_rows = cuda::BlockRowsFor(rows);
    const int64_t chunks = (rows + block_rows - 1) / block_rows;
    const int64_t visible = piece.item->context_tokens - piece.item->num_query_tokens + piece.token0 + piece.tokens;
    const int64_t splits = std::max<int64_t>(1, (visible + split - 1) / split);
    const int64_t partials = layout.num_kv_heads() * chunks * splits;
    const int64_t query_floats = static_cast<int64_t>(piece.tokens) * qh * d;
    return sizeof(AttendItemDesc) + sizeof(int32_t) * pages +
           sizeof(float) * (3 * query_floats + piece.tokens * qh) + sizeof(int32_t) * piece.tokens * qh +
           partials * (sizeof(AttendBlock) + sizeof(MergeUnit) +
                       sizeof(float) * cuda::kMaxBlockRows * (d + 2)) +
           6 * 256;
  }

  absl::Status PlanBatch(const KvLayout& layout, const PoolTables& tables, int64_t split, Workspace& w,
                         size_t begin, size_t* end) {
    size_t bytes = kBatchOverhead;
    size_t i = begin;
    for (; i < w.pieces.size(); ++i) {
      const size_t piece = PieceBytes(layout, w.pieces[i], split);
      if (bytes + piece > options_.workspace_bytes) break;
      bytes += piece;
    }
    if (i == begin) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "one Attend item (context %d tokens) needs more than a %d-byte CUDA workspace",
          w.pieces[begin].item->context_tokens, options_.workspace_bytes));
    }
    *end = i;
    return absl::OkStatus();
  }

  absl::Status RunBatch(const KvLayout& layout, const AttendParams& p, const PoolTables& tables,
                        int64_t split, Workspace& w, size_t begin, size_t end, double* kernel_seconds) {
    const int d = layout.head_dim();
    const int qh = layout.num_query_heads();
    const int heads = layout.num_kv_heads();
    const int group = layout.query_heads_per_kv_head();
    w.items.clear();
    w.blocks.clear();
    w.units.clear();
    w.head_of_row.clear();
    w.tables.clear();
    int64_t rows_total = 0;
    int32_t partials = 0;
    for (size_t i = begin; i < end; ++i) {
      const Workspace::Piece& piece = w.pieces[i];
      const AttendItem& item = *piece.item;
      AttendItemDesc desc;
      desc.block_table = static_cast<int64_t>(w.tables.size());
      // The piece's own causal view: its last query token is the item's
      // token0 + tokens - 1.
      desc.context_tokens = static_cast<int32_t>(item.context_tokens - item.num_query_tokens + piece.token0 +
                                                 piece.tokens);
      desc.num_query_tokens = piece.tokens;
      desc.layer = item.layer;
      desc.query_row = rows_total;
      const int64_t pages = (desc.context_tokens + layout.page_tokens() - 1) / layout.page_tokens();
      w.tables.insert(w.tables.end(), item.block_table, item.block_table + pages);
      for (int t = 0; t < piece.tokens; ++t) {
        for (int h = 0; h < qh; ++h) w.head_of_row.push_back(item.layer * heads + h / group);
      }
      const int item_index = static_cast<int>(w.items.size());
      w.items.push_back(desc);
      const int rows = piece.tokens * group;
      const bool mma = tables.layer_mma[item.layer];
      // The tensor-core kernel always holds 8 rows (its N).
      const int block_rows = mma ? cuda::kMaxBlockRows : cuda::BlockRowsFor(rows);
      for (int kv = 0; kv < heads; ++kv) {
        for (int row0 = 0; row0 < rows; row0 += block_rows) {
          const int chunk_rows = std::min(block_rows, rows - row0);
          // The chunk's last row sees the most tokens.
          const int last_token = (row0 + chunk_rows - 1) / group;
          const int64_t visible = desc.context_tokens - desc.num_query_tokens + 1 + last_token;
          const int splits = static_cast<int>(std::max<int64_t>(1, (visible + split - 1) / split));
          MergeUnit unit;
          unit.item = item_index;
          unit.kv_head = kv;
          unit.row0 = row0;
          unit.rows = chunk_rows;
          unit.first_partial = partials;
          unit.num_splits = splits;
          w.units.push_back(unit);
          for (int s = 0; s < splits; ++s) {
            AttendBlock b;
            b.item = item_index;
            b.kv_head = kv;
            b.row0 = row0;
            b.rows = chunk_rows;
            b.token_begin = static_cast<int32_t>(s * split);
            b.token_end = static_cast<int32_t>(std::min<int64_t>(visible, (s + 1) * split));
            b.partial = partials + s;
            // Kernel, variant and row count decide the launch; kept in pad.
            b.pad = (mma ? kMmaLaunch : 0) + tables.layer_variant[item.layer] * 16 + block_rows;
            w.blocks.push_back(b);
          }
          partials += splits;
        }
      }
      rows_total += static_cast<int64_t>(piece.tokens) * qh;
    }
    // One launch per (variant, block rows): sort the blocks by that key.
    w.sorted_blocks = w.blocks;
    std::stable_sort(w.sorted_blocks.begin(), w.sorted_blocks.end(),
                     [](const AttendBlock& a, const AttendBlock& b) { return a.pad < b.pad; });

    Arena arena(options_.workspace_bytes);
    const size_t items_at = arena.Take(sizeof(AttendItemDesc) * w.items.size());
    const size_t blocks_at = arena.Take(sizeof(AttendBlock) * w.sorted_blocks.size());
    const size_t units_at = arena.Take(sizeof(MergeUnit) * w.units.size());
    const size_t heads_at = arena.Take(sizeof(int32_t) * w.head_of_row.size());
    const size_t tables_at = arena.Take(sizeof(int32_t) * w.tables.size());
    const size_t queries_at = arena.Take(sizeof(float) * rows_total * d);
    const size_t copy_in = arena.used();
    const size_t prepared_at = arena.Take(sizeof(float) * rows_total * d);
    const size_t partial_acc_at = arena.Take(sizeof(float) * static_cast<size_t>(partials) * cuda::kMaxBlockRows * d);
    const size_t partial_stats_at = arena.Take(sizeof(float) * static_cast<size_t>(partials) * cuda::kMaxBlockRows * 2);
    const size_t output_at = arena.Take(sizeof(float) * rows_total * d);
    const size_t lse_at = arena.Take(sizeof(float) * rows_total);
    const size_t copy_out_end = arena.used();
    if (!arena.fits()) {
      return absl::InternalError(absl::StrFormat("attend plan of %d bytes overflows the %d-byte workspace",
                                                 arena.used(), options_.workspace_bytes));
    }
    std::memcpy(w.host + items_at, w.items.data(), sizeof(AttendItemDesc) * w.items.size());
    std::memcpy(w.host + blocks_at, w.sorted_blocks.data(), sizeof(AttendBlock) * w.sorted_blocks.size());
    std::memcpy(w.host + units_at, w.units.data(), sizeof(MergeUnit) * w.units.size());
    std::memcpy(w.host + heads_at, w.head_of_row.data(), sizeof(int32_t) * w.head_of_row.size());
    std::memcpy(w.host + tables_at, w.tables.data(), sizeof(int32_t) * w.tables.size());
    for (size_t i = begin; i < end; ++i) {
      const Workspace::Piece& piece = w.pieces[i];
      const size_t floats = static_cast<size_t>(piece.tokens) * qh * d;
      std::memcpy(w.host + queries_at + sizeof(float) * w.items[i - begin].query_row * d,
                  piece.item->queries + static_cast<size_t>(piece.token0) * qh * d, sizeof(float) * floats);
    }
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.device, w.host, copy_in, cudaMemcpyHostToDevice, w.stream),
                               "attend: copy in"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.start, w.stream), "cudaEventRecord"));

    const cuda::PoolView view = View(layout, p.pool, tables);
    cuda::PrepareParams prep;
    prep.view = view;
    prep.num_rows = rows_total;
    prep.head_of_row = reinterpret_cast<const int32_t*>(w.device + heads_at);
    prep.queries = reinterpret_cast<const float*>(w.device + queries_at);
    prep.prepared = reinterpret_cast<float*>(w.device + prepared_at);
    prep.scale = p.scale;
    RETURN_IF_ERROR(CudaStatus(cuda::LaunchPrepare(prep, w.stream), "prepare kernel launch"));

    cuda::AttendKernelParams k;
    k.view = view;
    k.block_tables = reinterpret_cast<const int32_t*>(w.device + tables_at);
    k.items = reinterpret_cast<const AttendItemDesc*>(w.device + items_at);
    k.prepared = prep.prepared;
    k.partial_acc = reinterpret_cast<float*>(w.device + partial_acc_at);
    k.partial_stats = reinterpret_cast<float*>(w.device + partial_stats_at);
    const AttendBlock* device_blocks = reinterpret_cast<const AttendBlock*>(w.device + blocks_at);
    for (size_t first = 0; first < w.sorted_blocks.size();) {
      size_t last = first;
      while (last < w.sorted_blocks.size() && w.sorted_blocks[last].pad == w.sorted_blocks[first].pad) ++last;
      k.blocks = device_blocks + first;
      k.num_blocks = static_cast<int32_t>(last - first);
      const int key = w.sorted_blocks[first].pad;
      if (key >= kMmaLaunch) {
        RETURN_IF_ERROR(CudaStatus(cuda::LaunchAttendMma((key - kMmaLaunch) / 16, k, w.stream),
                                   "tensor-core attend kernel launch"));
      } else {
        RETURN_IF_ERROR(CudaStatus(cuda::LaunchAttend(key / 16, key % 16, k, w.stream), "attend kernel launch"));
      }
      first = last;
    }

    cuda::MergeParams merge;
    merge.view = view;
    merge.items = k.items;
    merge.units = reinterpret_cast<const MergeUnit*>(w.device + units_at);
    merge.num_units = static_cast<int32_t>(w.units.size());
    merge.partial_acc = k.partial_acc;
    merge.partial_stats = k.partial_stats;
    merge.output = reinterpret_cast<float*>(w.device + output_at);
    merge.lse = reinterpret_cast<float*>(w.device + lse_at);
    RETURN_IF_ERROR(CudaStatus(cuda::LaunchMerge(merge, w.stream), "merge kernel launch"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(w.stop, w.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(w.host + output_at, w.device + output_at, copy_out_end - output_at,
                                               cudaMemcpyDeviceToHost, w.stream),
                               "attend: copy out"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(w.stream), "attend kernels"));
    *kernel_seconds += ElapsedSeconds(w);

    const float* output = reinterpret_cast<const float*>(w.host + output_at);
    const float* lse = reinterpret_cast<const float*>(w.host + lse_at);
    for (size_t i = begin; i < end; ++i) {
      const Workspace::Piece& piece = w.pieces[i];
      const int64_t row = w.items[i - begin].query_row;
      const size_t rows = static_cast<size_t>(piece.tokens) * qh;
      std::memcpy(piece.item->output + static_cast<size_t>(piece.token0) * qh * d, output + row * d,
                  sizeof(float) * rows * d);
      if (piece.item->lse != nullptr) {
        std::memcpy(piece.item->lse + static_cast<size_t>(piece.token0) * qh, lse + row, sizeof(float) * rows);
      }
    }
    return absl::OkStatus();
  }

  const CudaBackendOptions options_;
  const cuda::DeviceInfo info_;
  int sm_count_ = 0;

  std::vector<Workspace> workspaces_;
  absl::Mutex workspaces_mu_;
  std::vector<Workspace*> free_workspaces_ ABSL_GUARDED_BY(workspaces_mu_);

  absl::Mutex pools_mu_;
  std::map<uint8_t*, PoolTables> pools_ ABSL_GUARDED_BY(pools_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const CudaBackendOptions& options) {
  return CudaBackend::Create(options);
}

double LastCudaKernelSeconds() { return last_kernel_seconds; }

}  // namespace tqkv
