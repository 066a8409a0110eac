// `tqkv load`: the load generator's command line (the generators:
// decode_load.h for a decode node's loop, load_generator.h for mixed
// traffic), its checks and its tables.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cli/command_util.h"
#include "client/cli/commands.h"
#include "client/cli/connection.h"
#include "client/cli/decode_load.h"
#include "client/cli/flags.h"
#include "client/cli/load_generator.h"
#include "client/cpp/tqkv_client.h"

namespace tqkv {
namespace cli {
namespace {

int RunDecodeLoadTable(const DecodeLoadOptions& options, bool json, bool quiet, const std::string& target) {
  absl::StatusOr<DecodeLoadReport> report = RunDecodeLoad(options);
  if (!quiet) fprintf(stderr, "\n");
  if (!report.ok()) return FailRpc(report.status(), target);
  const DecodeLoadReport& r = *report;
  int64_t errors = 0;
  if (json) {
    Json variants = Json::array();
    for (const DecodeVariantReport& v : r.variants) {
      errors += v.errors;
      Json row = Json{{"variant", DecodeVariantName(v.variant)},
                      {"steps", v.steps},
                      {"errors", v.errors},
                      {"rpcs_per_step", v.rpcs_per_step},
                      {"messages_per_step", v.messages_per_step},
                      {"step_p50_ms", v.step_p50_ms},
                      {"step_p99_ms", v.step_p99_ms},
                      {"step_mean_ms", v.step_mean_ms},
                      {"tokens_per_second_per_sequence", v.tokens_per_second_per_sequence},
                      {"tokens_per_second", v.tokens_per_second}};
      row["kernel_ms_per_step"] = v.kernel_ms_per_step >= 0 ? Json(v.kernel_ms_per_step) : Json();
      row["kernel_share"] = v.kernel_share >= 0 ? Json(v.kernel_share) : Json();
      row["outside_us_per_layer"] = v.outside_us_per_layer >= 0 ? Json(v.outside_us_per_layer) : Json();
      row["server_us_per_layer"] = v.server_us_per_layer >= 0 ? Json(v.server_us_per_layer) : Json();
      row["transport_us_per_layer"] = v.transport_us_per_layer >= 0 ? Json(v.transport_us_per_layer) : Json();
      if (!v.first_error.empty()) row["first_error"] = v.first_error;
      variants.push_back(row);
    }
    PrintJson(Json{{"mode", "decode"},
                   {"layers", r.layers},
                   {"kv_heads", r.kv_heads},
                   {"query_heads", r.query_heads},
                   {"head_dim", r.head_dim},
                   {"engines", options.clients},
                   {"batch", options.batch},
                   {"context", options.context},
                   {"variants", variants}});
    return errors > 0 ? kExitFailure : 0;
  }
  printf(
      "layer-by-layer decode: %d layers, %d KV heads, %d query heads, head_dim %d; %d "
      "engine(s) x batch %d, context %lld\n",
      r.layers, r.kv_heads, r.query_heads, r.head_dim, options.clients, options.batch,
      static_cast<long long>(options.context));
  printf("%-7s %6s %6s %9s %9s %9s %10s %8s %12s %10s %10s %10s %10s\n", "variant", "steps", "errors", "rpcs/step",
         "p50_ms", "p99_ms", "kernel_ms", "kernel%", "outside_us/l", "server_us", "grpc_us", "tok/s/seq", "tok/s");
  const DecodeVariantReport* unary = nullptr;
  for (const DecodeVariantReport& v : r.variants) {
    errors += v.errors;
    if (v.variant == DecodeVariant::kUnary) unary = &v;
    const double calls = v.variant == DecodeVariant::kStream ? v.messages_per_step : v.rpcs_per_step;
    printf("%-7s %6lld %6lld %8.0f%s %9.2f %9.2f %10.2f %7.1f%% %12.0f %10.0f %10.0f %10.1f %10.1f\n",
           DecodeVariantName(v.variant), static_cast<long long>(v.steps), static_cast<long long>(v.errors), calls,
           v.variant == DecodeVariant::kStream ? "m" : " ", v.step_p50_ms, v.step_p99_ms, v.kernel_ms_per_step,
           100 * v.kernel_share, v.outside_us_per_layer, v.server_us_per_layer, v.transport_us_per_layer,
           v.tokens_per_second_per_sequence, v.tokens_per_second);
  }
  printf(
      "(m: stream messages per step, on one stream; outside_us/l: mean step time minus the "
      "server's kernel time, per layer = server_us (handlers minus kernels) + grpc_us (beyond "
      "the handlers: gRPC, loopback, the client))\n");
  if (unary != nullptr && unary->outside_us_per_layer > 0) {
    for (const DecodeVariantReport& v : r.variants) {
      if (&v == unary || v.outside_us_per_layer < 0) continue;
      printf("%s: time outside the kernels per layer is %.2fx unary's (%.0f vs %.0f us)\n",
             DecodeVariantName(v.variant), v.outside_us_per_layer / unary->outside_us_per_layer, v.outside_us_per_layer,
             unary->outside_us_per_layer);
    }
  }
  for (const DecodeVariantReport& v : r.variants) {
    if (!v.first_error.empty()) {
      printf("%s first error: %s\n", DecodeVariantName(v.variant), v.first_error.c_str());
    }
  }
  return errors > 0 ? kExitFailure : 0;
}

// The flags of `tqkv load`, both modes.
struct LoadFlags {
  Connection c;
  std::string mode = "decode", variants = "unary,fused,stream", wire = "f32";
  int64_t clients = 0, requests = 0, prefill = 512, chunk = 0, steps = 0, per_client = 0, layers = 0, score_every = 16,
          top_k = 8, seed = 1, batch = 8, context = 1024;
  double duration = 10, max_seconds = 0, give_up = 10;
  bool json = false, quiet = false;
};

void AddLoadFlags(FlagSet& flags, LoadFlags* f) {
  AddConnectionFlags(flags, &f->c);
  flags.AddString("mode", &f->mode, "decode (layer by layer) or mixed");
  flags.AddInt("clients", &f->clients, "concurrent clients (decode: engines); 0: 1 (decode), 8 (mixed)");
  flags.AddString("variants", &f->variants, "decode: unary,fused,stream (any subset, run in order)");
  flags.AddInt("batch", &f->batch, "decode: sequences per engine, attended together per layer");
  flags.AddInt("context", &f->context, "decode: tokens prefilled per sequence before the steps");
  flags.AddDouble("max-seconds", &f->max_seconds, "decode: end a variant's steps after this long (0: off)");
  flags.AddString("wire-dtype", &f->wire, "decode: f32, f16 or bf16 for K, V, queries and outputs on the wire");
  flags.AddDouble("duration-seconds", &f->duration, "mixed: stop after this long (0: no time bound)");
  flags.AddInt("requests", &f->requests, "mixed: stop after this many calls (0: no count bound)");
  flags.AddInt("prefill-tokens", &f->prefill, "mixed: prefill tokens per sequence");
  flags.AddInt("prefill-chunk-tokens", &f->chunk,
               "prefills longer than this go as AppendStream chunks (0: 256 decode, 64 mixed)");
  flags.AddInt("decode-steps", &f->steps, "decode steps per sequence (0: 16 decode, 64 mixed)");
  flags.AddInt("sequences-per-client", &f->per_client, "mixed: sequences per client (0: until a bound)");
  flags.AddInt("layers", &f->layers, "layers appended and attended (0: the cache's)");
  flags.AddInt("score-every", &f->score_every, "mixed: a ScoreQuery every this many steps (0: never)");
  flags.AddInt("top-k", &f->top_k, "mixed: top_k of the ScoreQuery calls");
  flags.AddInt("seed", &f->seed, "data seed");
  flags.AddDouble("give-up-seconds", &f->give_up,
                  "mixed: stop when the server has answered nothing (every call UNAVAILABLE) this long; "
                  "meanwhile each client backs off, 50 ms doubling to 1 s");
  flags.AddBool("json", &f->json, "print JSON instead of a table");
  flags.AddBool("quiet", &f->quiet, "no live progress line");
}

int RunDecodeMode(const LoadFlags& f, const ClientOptions& client) {
  DecodeLoadOptions options;
  options.client = client;
  options.cache = f.c.cache;
  absl::StatusOr<std::vector<DecodeVariant>> parsed = ParseDecodeVariants(f.variants);
  if (!parsed.ok()) return UsageError(std::string("--variants: ") + std::string(parsed.status().message()));
  options.variants = *parsed;
  options.clients = static_cast<int>(f.clients);
  options.batch = static_cast<int>(f.batch);
  options.context = f.context;
  options.steps = f.steps;
  if (!(f.max_seconds >= 0) || f.max_seconds > 86400) return UsageError("--max-seconds must be in [0, 86400]");
  options.max_seconds_per_variant = f.max_seconds;
  options.layers = static_cast<int>(f.layers);
  options.prefill_chunk_tokens = f.chunk;
  if (f.wire == "f32") {
    options.wire_dtype = v1::DTYPE_F32;
  } else if (f.wire == "f16") {
    options.wire_dtype = v1::DTYPE_F16;
  } else if (f.wire == "bf16") {
    options.wire_dtype = v1::DTYPE_BF16;
  } else {
    return UsageError("--wire-dtype must be f32, f16 or bf16");
  }
  options.seed = static_cast<uint64_t>(f.seed);
  if (!f.quiet) {
    options.progress = [](DecodeVariant v, const char* phase, int64_t done) {
      fprintf(stderr, "\r%-6s %-8s %6lld steps ", DecodeVariantName(v), phase, static_cast<long long>(done));
      fflush(stderr);
    };
  }
  return RunDecodeLoadTable(options, f.json, f.quiet, f.c.target);
}

void PrintMixedReport(const LoadReport& r, const LoadFlags& f) {
  if (f.json) {
    Json methods = Json::array();
    for (const MethodStats& m : r.methods) {
      methods.push_back(Json{{"method", m.method},
                             {"calls", m.calls},
                             {"errors", m.errors},
                             {"calls_per_second", m.calls_per_second},
                             {"p50_ms", m.p50_ms},
                             {"p99_ms", m.p99_ms}});
    }
    Json out = Json{{"clients", f.clients}, {"elapsed_seconds", r.elapsed_seconds}, {"calls", r.calls},
                    {"errors", r.errors},   {"tokens_appended", r.tokens_appended}, {"methods", methods}};
    out["server_attend_seconds"] = r.server_attend_seconds >= 0 ? Json(r.server_attend_seconds) : Json();
    out["attend_kernel_share"] = r.attend_kernel_share >= 0 ? Json(r.attend_kernel_share) : Json();
    if (!r.first_error.empty()) out["first_error"] = r.first_error;
    if (!r.server_lost.ok()) out["server_lost"] = r.server_lost.ToString();
    PrintJson(out);
    return;
  }
  printf("%lld clients, %.2f s, %lld calls, %lld errors, %lld tokens appended\n", static_cast<long long>(f.clients),
         r.elapsed_seconds, static_cast<long long>(r.calls), static_cast<long long>(r.errors),
         static_cast<long long>(r.tokens_appended));
  printf("%-14s %9s %7s %10s %9s %9s\n", "method", "calls", "errors", "calls/s", "p50_ms", "p99_ms");
  for (const MethodStats& m : r.methods) {
    printf("%-14s %9lld %7lld %10.1f %9.3f %9.3f\n", m.method.c_str(), static_cast<long long>(m.calls),
           static_cast<long long>(m.errors), m.calls_per_second, m.p50_ms, m.p99_ms);
  }
  if (r.attend_kernel_share >= 0) {
    printf("attend kernel share: %.1f%% of server-side Attend time (%.3f s); %.1f%% outside the kernel\n",
           100 * r.attend_kernel_share, r.server_attend_seconds, 100 * (1 - r.attend_kernel_share));
  }
  if (!r.first_error.empty()) printf("first error: %s\n", r.first_error.c_str());
}

int RunMixedMode(const LoadFlags& f, const ClientOptions& client) {
  if (!(f.duration >= 0) || f.duration > 86400) return UsageError("--duration-seconds must be in [0, 86400]");
  if (f.requests < 0) return UsageError("--requests must be >= 0");
  if (!(f.give_up > 0) || f.give_up > 86400) return UsageError("--give-up-seconds must be in (0, 86400]");
  if (f.duration == 0 && f.requests == 0) {
    return UsageError("give --duration-seconds or --requests: the run must end");
  }
  LoadOptions options;
  options.client = client;
  options.cache = f.c.cache;
  options.clients = static_cast<int>(f.clients);
  options.duration_seconds = f.duration;
  options.requests = f.requests;
  options.prefill_tokens = f.prefill;
  options.prefill_chunk_tokens = f.chunk;
  options.decode_steps = f.steps;
  options.sequences_per_client = f.per_client;
  options.layers = static_cast<int>(f.layers);
  options.score_every = static_cast<int>(f.score_every);
  options.top_k = static_cast<int>(f.top_k);
  options.seed = static_cast<uint64_t>(f.seed);
  options.give_up_seconds = f.give_up;
  if (!f.quiet) {
    options.progress = [](double elapsed, int64_t calls, int64_t errors) {
      fprintf(stderr, "\r%6.1f s  %9lld calls  %9.1f calls/s  %lld errors ", elapsed, static_cast<long long>(calls),
              elapsed > 0 ? calls / elapsed : 0.0, static_cast<long long>(errors));
      fflush(stderr);
    };
  }
  absl::StatusOr<LoadReport> report = RunLoad(options);
  if (!f.quiet) fprintf(stderr, "\n");
  if (!report.ok()) return FailRpc(report.status(), f.c.target);
  PrintMixedReport(*report, f);
  if (!report->server_lost.ok()) {
    std::string why = UnreachableMessage(report->server_lost, WithDefaultPort(f.c.target));
    if (why.empty()) why = report->server_lost.ToString();
    fprintf(stderr, "tqkv load: stopped after %.1f s of failed calls: %s\n", f.give_up, why.c_str());
  }
  return report->errors > 0 ? kExitFailure : 0;
}

}  // namespace

int RunLoad(int argc, const char* const* argv) {
  FlagSet flags("load",
                "Load generator. --mode decode (default): a decode node's loop, layer by layer:\n"
                "engines (--clients) of --batch sequences prefilled with --context tokens, then\n"
                "--decode-steps steps, each layer one round trip, as unary Append+Attend, a fused\n"
                "AppendAttend, or a DecodeStream message (--variants, run side by side); prints\n"
                "step p50/p99, rpcs per step, the kernels' share and the time outside them per\n"
                "layer, tokens/s. --mode mixed: N clients loop prefill, decode steps (Append 1\n"
                "token to all layers + one Attend over them, ScoreQuery now and then), Drop;\n"
                "calls/s and p50/p99 per method.");
  LoadFlags f;
  AddLoadFlags(flags, &f);
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (f.mode != "decode" && f.mode != "mixed") return UsageError("--mode must be decode or mixed");
  const bool decode = f.mode == "decode";
  if (f.clients == 0) f.clients = decode ? 1 : 8;
  if (f.chunk == 0) f.chunk = decode ? 256 : 64;
  if (f.steps == 0) f.steps = decode ? 16 : 64;
  if (!InIntRange(f.clients, 1, 1024)) return UsageError("--clients must be in [1, 1024]");
  if (!InIntRange(f.prefill, 0, 1 << 20) || !InIntRange(f.chunk, 1, 1 << 20) || !InIntRange(f.steps, 1, 1 << 20) ||
      f.per_client < 0 || !InIntRange(f.layers, 0, 1 << 20) || !InIntRange(f.score_every, 0, 1 << 20) ||
      !InIntRange(f.top_k, 1, 1 << 20) || !InIntRange(f.batch, 1, 4096) || !InIntRange(f.context, 0, 1 << 24)) {
    return UsageError("token, step, batch, layer and top-k counts must be in range (see --help)");
  }
  absl::StatusOr<ClientOptions> client = MakeClientOptions(f.c);
  if (!client.ok()) return Fail(client.status());
  return decode ? RunDecodeMode(f, *client) : RunMixedMode(f, *client);
}

}  // namespace cli
}  // namespace tqkv
