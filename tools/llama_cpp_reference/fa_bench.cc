// Times ggml's CPU flash attention (GGML_OP_FLASH_ATTN_EXT) for one decode
// step of a Llama-3.1-8B-shaped layer: head dim 128, 32 query heads over 8 KV
// heads, 1 query token, a mask, K/V stored as f16 / q8_0 / q4_0, as llama.cpp
// runs it with flash attention on. Built and run by
// scripts/llama_cpp_reference.sh against the ggml it builds; uses only ggml's
// public API. Two K/V layouts:
//   cache  llama.cpp's KV cache: one row per token holding all KV heads, seen
//          by flash attention as a strided [head_dim, kv, kv_heads] view (what
//          llama.cpp decode runs);
//   heads  each KV head's rows contiguous (test-backend-ops' layout).
// Prints one row per (layout, kv type, context): median, p10, p90 ms per call,
// the largest error of the output against a double-precision reference from
// the same (dequantized) K/V, and the CPU other processes used while it ran
// (in cores; above ~0.1 the row is not a clean figure).
//
//   fa_bench [--threads 2] [--contexts 1024,8192,32768] [--types f16,q8_0,q4_0]
//            [--layouts cache,heads] [--seconds 2] [--json]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

constexpr int kHeadDim = 128, kQHeads = 32, kKvHeads = 8;

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

ggml_type TypeByName(const std::string& name) {
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const char* n = ggml_type_name(static_cast<ggml_type>(t));
    if (n != nullptr && name == n) return static_cast<ggml_type>(t);
  }
  std::fprintf(stderr, "unknown ggml type %s\n", name.c_str());
  std::exit(2);
}

// Writes n floats into t (f32, f16 or a quantized type), row by row.
void Fill(ggml_tensor* t, const std::vector<float>& src) {
  if (t->type == GGML_TYPE_F32) {
    std::memcpy(t->data, src.data(), src.size() * sizeof(float));
  } else if (t->type == GGML_TYPE_F16) {
    ggml_fp32_to_fp16_row(src.data(), static_cast<ggml_fp16_t*>(t->data), src.size());
  } else {
    const int64_t rows = src.size() / t->ne[0];
    ggml_quantize_chunk(t->type, src.data(), t->data, 0, rows, t->ne[0], nullptr);
  }
}

// The tensor's values as floats (dequantized), for the reference.
std::vector<float> ToFloat(const ggml_tensor* t) {
  std::vector<float> out(ggml_nelements(t));
  if (t->type == GGML_TYPE_F32) {
    std::memcpy(out.data(), t->data, out.size() * sizeof(float));
  } else {
    ggml_get_type_traits(t->type)->to_float(t->data, out.data(), out.size());
  }
  return out;
}

// Busy CPU seconds of the whole machine so far (/proc/stat) and of this process.
double MachineBusySeconds() {
  unsigned long long user, nice, sys, idle, iowait, irq, softirq, steal;
  FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return 0.0;
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &sys, &idle, &iowait, &irq,
                            &softirq, &steal);
  std::fclose(f);
  if (n != 8) return 0.0;
  return double(user + nice + sys + irq + softirq + steal) / sysconf(_SC_CLK_TCK);
}

double OwnCpuSeconds() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

struct Row {
  double median, p10, p90, max_err, other_load;
  int runs;
};

Row RunCase(bool cache_layout, ggml_type type, int kv, int threads, double seconds) {
  const size_t kv_bytes = 2 * ggml_row_size(type, kHeadDim) * kv * kKvHeads;
  ggml_init_params params = {kv_bytes + (size_t{64} << 20), nullptr, false};
  ggml_context* ctx = ggml_init(params);
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, kHeadDim, 1, kQHeads, 1);
  ggml_tensor *k, *v, *k_view, *v_view;
  if (cache_layout) {
    // As llama_kv_cache::get_k/get_v view the cache, permuted as llama.cpp's
    // attention graph does: element (token j, head g, d) at (j*kv_heads+g)*D+d.
    k = ggml_new_tensor_2d(ctx, type, kHeadDim * kKvHeads, kv);
    v = ggml_new_tensor_2d(ctx, type, kHeadDim * kKvHeads, kv);
    auto view = [&](ggml_tensor* cache) {
      ggml_tensor* t = ggml_view_3d(ctx, cache, kHeadDim, kKvHeads, kv, ggml_row_size(type, kHeadDim), cache->nb[1], 0);
      return ggml_permute(ctx, t, 0, 2, 1, 3);
    };
    k_view = view(k);
    v_view = view(v);
  } else {
    // Element (token j, head g, d) at (g*kv+j)*D+d.
    k = k_view = ggml_new_tensor_3d(ctx, type, kHeadDim, kv, kKvHeads);
    v = v_view = ggml_new_tensor_3d(ctx, type, kHeadDim, kv, kKvHeads);
  }
  auto offset = [&](int j, int g) {
    return cache_layout ? (size_t(j) * kKvHeads + g) * kHeadDim : (size_t(g) * kv + j) * kHeadDim;
  };
  ggml_tensor* mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, kv, 1, 1, 1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k_view, v_view, mask, scale, 0.0f, 0.0f);
  ggml_prec_set_acc(out, GGML_PREC_F32);
  ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);

  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  auto random = [&](size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = uni(rng);
    return x;
  };
  Fill(q, random(ggml_nelements(q)));
  Fill(k, random(ggml_nelements(k)));
  Fill(v, random(ggml_nelements(v)));
  std::memset(mask->data, 0, ggml_nbytes(mask));  // every position visible

  ggml_cplan plan = ggml_graph_plan(graph, threads, nullptr);
  std::vector<uint8_t> work(plan.work_size);
  plan.work_data = work.data();
  auto compute = [&] {
    if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "ggml_graph_compute failed\n");
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) compute();  // warm-up

  using Clock = std::chrono::steady_clock;
  std::vector<double> ms;
  const double busy0 = MachineBusySeconds(), own0 = OwnCpuSeconds();
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration<double>(seconds);
  while (ms.size() < 10 || (Clock::now() < deadline && ms.size() < 2000)) {
    const auto t0 = Clock::now();
    compute();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const double other_load = std::max(0.0, (MachineBusySeconds() - busy0) - (OwnCpuSeconds() - own0)) / wall;
  std::sort(ms.begin(), ms.end());
  auto pct = [&](double p) { return ms[static_cast<size_t>(p * (ms.size() - 1))]; };

  // Reference: softmax(q.k * scale) v per query head, in double, from the
  // values ggml actually stored. out is [head_dim, q_heads, 1, 1].
  const std::vector<float> qf = ToFloat(q), kf = ToFloat(k), vf = ToFloat(v);
  const float* of = static_cast<const float*>(out->data);
  double max_err = 0.0;
  std::vector<double> s(kv), acc(kHeadDim);
  for (int h = 0; h < kQHeads; ++h) {
    const int g = h / (kQHeads / kKvHeads);
    const float* qh = &qf[h * kHeadDim];
    double mx = -INFINITY;
    for (int j = 0; j < kv; ++j) {
      const float* kj = &kf[offset(j, g)];
      double dot = 0.0;
      for (int d = 0; d < kHeadDim; ++d) dot += double(qh[d]) * kj[d];
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double sum = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < kv; ++j) {
      const double p = std::exp(s[j] - mx);
      sum += p;
      const float* vj = &vf[offset(j, g)];
      for (int d = 0; d < kHeadDim; ++d) acc[d] += p * vj[d];
    }
    for (int d = 0; d < kHeadDim; ++d) {
      max_err = std::max(max_err, std::fabs(acc[d] / sum - of[h * kHeadDim + d]));
    }
  }
  ggml_free(ctx);
  return {pct(0.5), pct(0.1), pct(0.9), max_err, other_load, static_cast<int>(ms.size())};
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  double seconds = 2.0;
  bool json = false;
  std::string contexts = "1024,8192,32768", types = "f16,q8_0,q4_0", layouts = "cache,heads";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--json") {
      json = true;
    } else if (a == "--threads" && has_value) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--seconds" && has_value) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--contexts" && has_value) {
      contexts = argv[++i];
    } else if (a == "--types" && has_value) {
      types = argv[++i];
    } else if (a == "--layouts" && has_value) {
      layouts = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--threads N] [--contexts A,B] [--types f16,q8_0] [--layouts cache,heads] "
                   "[--seconds S] [--json]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!json) {
    std::printf("%-6s %-5s %8s %10s %10s %10s %6s %8s %10s\n", "layout", "kv", "context", "median_ms", "p10_ms",
                "p90_ms", "runs", "max_err", "other_cpu");
  }
  for (const std::string& layout : Split(layouts)) {
    if (layout != "cache" && layout != "heads") {
      std::fprintf(stderr, "unknown layout %s (cache or heads)\n", layout.c_str());
      return 2;
    }
    for (const std::string& type_name : Split(types)) {
      const ggml_type type = TypeByName(type_name);
      for (const std::string& c : Split(contexts)) {
        const int kv = std::atoi(c.c_str());
        const Row r = RunCase(layout == "cache", type, kv, threads, seconds);
        if (json) {
          std::printf(
              "{\"impl\":\"llama.cpp-ggml-cpu\",\"op\":\"FLASH_ATTN_EXT\",\"layout\":\"%s\",\"kv_type\":\"%s\","
              "\"context\":%d,\"head_dim\":%d,\"q_heads\":%d,\"kv_heads\":%d,\"tokens\":1,\"threads\":%d,"
              "\"median_ms\":%.4f,\"p10_ms\":%.4f,\"p90_ms\":%.4f,\"runs\":%d,\"max_err\":%.2e,"
              "\"other_cpu\":%.2f}\n",
              layout.c_str(), type_name.c_str(), kv, kHeadDim, kQHeads, kKvHeads, threads, r.median, r.p10, r.p90,
              r.runs, r.max_err, r.other_load);
        } else {
          std::printf("%-6s %-5s %8d %10.3f %10.3f %10.3f %6d %8.1e %10.2f\n", layout.c_str(), type_name.c_str(), kv,
                      r.median, r.p10, r.p90, r.runs, r.max_err, r.other_load);
        }
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
