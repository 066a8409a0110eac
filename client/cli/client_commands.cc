// The CLI subcommands that talk to a tqkv-server through tqkv::Client: info,
// sequence, append, attend, score, fork, drop (move, rebalance and bench
// move: move_commands.cc; load: load_command.cc). Every one takes
// --target (default localhost:50051; a host without a port means port 50051),
// --cache, --auth-token-file and --tls-ca-file, and --json; a failed rpc
// prints "tqkv: CODE: message" (or "cannot reach ...: is tqkv-server running
// at ...?" when nothing answered) and exits 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/cli/command_util.h"
#include "client/cli/connection.h"
#include "client/cli/commands.h"
#include "client/cli/decode_load.h"
#include "client/cli/flags.h"
#include "client/cli/load_generator.h"
#include "client/cli/npy.h"
#include "client/cpp/tqkv_client.h"

namespace tqkv {
namespace cli {

int RunInfo(int argc, const char* const* argv) {
  FlagSet flags("info", "Backend, device, caches (layout, pages, tokens, bytes) and presets.");
  Connection c;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddBool("json", &json, "print JSON instead of text");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<v1::ServerInfo> info = Client(*options).GetServerInfo();
  if (!info.ok()) return FailRpc(info.status(), c.target);
  if (!c.cache.empty()) {  // only that cache; an unknown name is an error
    std::vector<std::string> names;
    v1::CacheInfo only;
    for (const v1::CacheInfo& ci : info->caches()) {
      names.push_back(absl::StrCat("'", ci.config().name(), "'"));
      if (ci.config().name() == c.cache) only = ci;
    }
    if (only.config().name() != c.cache) {
      return Fail(absl::NotFoundError(absl::StrCat("the server at ", c.target, " has no cache '", c.cache,
                                                   "'; its caches: ", absl::StrJoin(names, ", "))));
    }
    info->clear_caches();
    *info->add_caches() = std::move(only);
  }
  if (json) {
    Json caches = Json::array();
    for (const v1::CacheInfo& ci : info->caches()) {
      const v1::CacheConfig& k = ci.config();
      caches.push_back(Json{{"name", k.name()},
                            {"num_layers", k.num_layers()},
                            {"num_kv_heads", k.num_kv_heads()},
                            {"num_query_heads", k.num_query_heads()},
                            {"head_dim", k.head_dim()},
                            {"page_tokens", k.page_tokens()},
                            {"preset", k.preset()},
                            {"boundary_layers", k.boundary_layers()},
                            {"boundary_preset", k.boundary_preset()},
                            {"page_bytes", ci.page_bytes()},
                            {"pages_used", ci.pages_used()},
                            {"pages_total", ci.pages_total()},
                            {"sequences", ci.sequences()},
                            {"tokens", ci.tokens()},
                            {"stored_bytes", ci.stored_bytes()},
                            {"stored_bytes_bf16", ci.stored_bytes_bf16()},
                            {"pool_bytes_used", static_cast<int64_t>(ci.pages_used()) * ci.page_bytes()},
                            {"evictions", ci.evictions()},
                            {"bytes_per_token_head", ci.bytes_per_token_head()},
                            {"bytes_per_token", ci.bytes_per_token()}});
    }
    Json tenants = Json::array();
    std::vector<const v1::TenantInfo*> shown;
    if (info->has_tenant()) shown.push_back(&info->tenant());
    for (const v1::TenantInfo& t : info->tenants()) shown.push_back(&t);
    for (const v1::TenantInfo* t : shown) {
      tenants.push_back(Json{{"name", t->name()},
                             {"sequence_prefix", t->sequence_prefix()},
                             {"bytes", t->bytes()},
                             {"max_bytes", t->max_bytes()},
                             {"sequences", t->sequences()},
                             {"max_sequences", t->max_sequences()},
                             {"tokens", t->tokens()},
                             {"quota_refusals", t->quota_refusals()}});
    }
    Json presets = Json::array();
    for (const v1::PresetInfo& p : info->presets()) {
      presets.push_back(Json{{"name", p.name()},
                             {"keys", p.keys()},
                             {"values", p.values()},
                             {"bytes_per_token_head", p.bytes_per_token_head()}});
    }
    PrintJson(Json{{"version", info->version()},
                   {"backend", info->backend()},
                   {"device", info->device()},
                   {"caches", caches},
                   {"tenants", tenants},
                   {"presets", presets}});
    return 0;
  }
  printf("tqkv-server %s at %s\nbackend: %s (%s)\n", info->version().c_str(), WithDefaultPort(c.target).c_str(),
         info->backend().c_str(), info->device().c_str());
  for (const v1::CacheInfo& ci : info->caches()) {
    const v1::CacheConfig& k = ci.config();
    const double ratio = ci.stored_bytes() > 0 ? static_cast<double>(ci.stored_bytes_bf16()) / ci.stored_bytes() : 0.0;
    const double pool = static_cast<double>(ci.pages_used()) * static_cast<double>(ci.page_bytes());
    const double pool_ratio = pool > 0 ? static_cast<double>(ci.stored_bytes_bf16()) / pool : 0.0;
    printf(
        "cache '%s': %d layers, %d kv heads, %d query heads, head_dim %d, %d-token pages, "
        "preset %s (%d boundary layers %s)\n",
        k.name().c_str(), k.num_layers(), k.num_kv_heads(), k.num_query_heads(), k.head_dim(), k.page_tokens(),
        k.preset().c_str(), k.boundary_layers(), k.boundary_preset().c_str());
    printf("  %lld bytes per token (%d per token and KV head in a compressed layer)\n",
           static_cast<long long>(ci.bytes_per_token()), ci.bytes_per_token_head());
    printf("  pages %d / %d used (%lld bytes each), %lld sequences, %lld tokens\n", ci.pages_used(), ci.pages_total(),
           static_cast<long long>(ci.page_bytes()), static_cast<long long>(ci.sequences()),
           static_cast<long long>(ci.tokens()));
    printf(
        "  stored %lld bytes (exact copies and key means included) vs %lld as bf16 (x%.2f; from the "
        "pool, whole pages: x%.2f), %lld evictions\n",
        static_cast<long long>(ci.stored_bytes()), static_cast<long long>(ci.stored_bytes_bf16()), ratio, pool_ratio,
        static_cast<long long>(ci.evictions()));
  }
  // A tenant's token sees itself; an admin's every tenant.
  const auto limit = [](int64_t max) { return max == 0 ? std::string("no limit") : absl::StrCat(max); };
  const auto print_tenant = [&limit](const char* what, const v1::TenantInfo& t) {
    printf(
        "%s '%s' (ids '%s...'): %lld bytes of pages (max %s), %lld sequences (max %s), %lld tokens, "
        "%lld quota refusals\n",
        what, t.name().c_str(), t.sequence_prefix().c_str(), static_cast<long long>(t.bytes()),
        limit(t.max_bytes()).c_str(), static_cast<long long>(t.sequences()), limit(t.max_sequences()).c_str(),
        static_cast<long long>(t.tokens()), static_cast<long long>(t.quota_refusals()));
  };
  if (info->has_tenant()) print_tenant("you are tenant", info->tenant());
  for (const v1::TenantInfo& t : info->tenants()) print_tenant("tenant", t);
  std::vector<std::string> names;
  for (const v1::PresetInfo& p : info->presets()) names.push_back(p.name());
  printf("presets: %s\n", absl::StrJoin(names, ", ").c_str());
  return 0;
}

namespace {

void PrintSequence(const SequenceState& s) {
  printf("sequence '%s' (cache '%s'): %d pages, layer tokens [%s]\n", s.sequence_id.c_str(), s.cache.c_str(), s.pages,
         absl::StrJoin(s.layer_tokens, ", ").c_str());
}

Json SequenceJson(const SequenceState& s) {
  return Json{{"sequence", s.sequence_id}, {"cache", s.cache}, {"pages", s.pages}, {"layer_tokens", s.layer_tokens}};
}

// The sequence as text, or as one JSON object.
void PrintSequence(const SequenceState& s, bool json) {
  if (json) {
    PrintJson(SequenceJson(s));
  } else {
    PrintSequence(s);
  }
}

}  // namespace

int RunSequence(int argc, const char* const* argv) {
  FlagSet flags("sequence", "Shows one sequence: tokens per layer and pages (GetSequence).");
  Connection c;
  std::string id;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<SequenceState> s = Client(*options).GetSequence(c.cache, id);
  if (!s.ok()) return FailRpc(s.status(), c.target);
  PrintSequence(*s, json);
  return 0;
}

int RunAppend(int argc, const char* const* argv) {
  FlagSet flags("append",
                "Appends K/V .npy arrays [layers, tokens, kv_heads, head_dim] to a sequence\n"
                "(created if new) at --start (default: its current length, 0 when new).");
  Connection c;
  std::string id, keys_path, values_path;
  int64_t start = -1, layer_begin = 0, layer_end = 0;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddRequiredString("keys", &keys_path, "keys .npy [layers, tokens, kv_heads, head_dim]");
  flags.AddRequiredString("values", &values_path, "values .npy, same shape as keys");
  flags.AddInt("start", &start, "position of the first token (-1: the current length)");
  flags.AddInt("layer-begin", &layer_begin, "first layer of the range");
  flags.AddInt("layer-end", &layer_end, "end of the layer range (0: all layers)");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(layer_begin, 0, 1 << 20) || !InIntRange(layer_end, 0, 1 << 20)) {
    return UsageError("--layer-begin and --layer-end must be in [0, 2^20]");
  }
  if (start < -1) return UsageError("--start must be >= 0 (or -1: the current length)");
  absl::StatusOr<NpyArray> keys = ReadNpy(keys_path);
  if (!keys.ok()) return Fail(keys.status());
  absl::StatusOr<NpyArray> values = ReadNpy(values_path);
  if (!values.ok()) return Fail(values.status());
  if (keys->shape.size() != 4) {
    return Fail(absl::InvalidArgumentError(
        absl::StrFormat("%s has %d dims; want [layers, tokens, kv_heads, head_dim]", keys_path, keys->shape.size())));
  }
  if (values->shape != keys->shape) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(values_path, " has shape [", absl::StrJoin(values->shape, ", "),
                                                        "]; want the keys' [", absl::StrJoin(keys->shape, ", "), "]")));
  }
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  Client client(*options);
  if (start < 0) {
    // The current length. A new sequence starts at 0: ask whether the id
    // exists (ListSequences by prefix, which never fails for a missing id)
    // rather than calling GetSequence and counting a NOT_FOUND on the server
    // for every new sequence.
    absl::StatusOr<std::vector<std::string>> ids = client.ListSequences(c.cache, id);
    if (!ids.ok()) return FailRpc(ids.status(), c.target);
    start = 0;
    if (std::find(ids->begin(), ids->end(), id) != ids->end()) {
      absl::StatusOr<SequenceState> s = client.GetSequence(c.cache, id);
      if (!s.ok()) return FailRpc(s.status(), c.target);
      if (!s->layer_tokens.empty()) {
        start = s->layer_tokens[layer_begin < static_cast<int64_t>(s->layer_tokens.size()) ? layer_begin : 0];
      }
    }
  }
  AppendArgs args;
  args.cache = c.cache;
  args.sequence_id = id;
  args.start_position = start;
  args.layer_begin = static_cast<int>(layer_begin);
  args.layer_end = static_cast<int>(layer_end);
  args.shape = {keys->shape[0], keys->shape[1], keys->shape[2], keys->shape[3]};
  args.keys = keys->data;
  args.values = values->data;
  absl::StatusOr<AppendResult> r = client.Append(args);
  if (!r.ok()) return FailRpc(r.status(), c.target);
  if (json) {
    PrintJson(Json{{"tokens", keys->shape[1]},
                   {"start", start},
                   {"stored_bytes", r->stored_bytes},
                   {"stored_bytes_bf16", r->stored_bytes_bf16},
                   {"sequence", SequenceJson(r->sequence)}});
    return 0;
  }
  printf("appended %lld tokens at %lld: stored %lld bytes (%lld as bf16)\n", static_cast<long long>(keys->shape[1]),
         static_cast<long long>(start), static_cast<long long>(r->stored_bytes),
         static_cast<long long>(r->stored_bytes_bf16));
  PrintSequence(r->sequence);
  return 0;
}

int RunAttend(int argc, const char* const* argv) {
  FlagSet flags("attend",
                "Fused decode attention of queries .npy [query_tokens, query_heads, head_dim]\n"
                "or [query_heads, head_dim] over one layer of a sequence; writes the output.");
  Connection c;
  std::string id, queries_path, out_path, lse_path;
  int64_t layer = 0;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddRequiredInt("layer", &layer, "layer");
  flags.AddRequiredString("queries", &queries_path, "queries .npy");
  flags.AddRequiredString("out", &out_path, "output .npy, [query_tokens, query_heads, head_dim]");
  flags.AddString("lse-out", &lse_path, "also write log-sum-exp .npy [query_tokens, query_heads]");
  flags.AddBool("json", &json, "print JSON (the files written and the output's shape)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(layer, 0, 1 << 20)) return UsageError("--layer must be in [0, 2^20]");
  absl::StatusOr<NpyArray> q = ReadNpy(queries_path);
  if (!q.ok()) return Fail(q.status());
  if (q->shape.size() == 2) q->shape.insert(q->shape.begin(), 1);
  if (q->shape.size() != 3) {
    return Fail(absl::InvalidArgumentError(
        absl::StrFormat("%s has %d dims; want [query_tokens, query_heads, head_dim] or [query_heads, head_dim]",
                        queries_path, q->shape.size())));
  }
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  AttendArgs args;
  args.cache = c.cache;
  args.return_lse = !lse_path.empty();
  AttendItemArgs item;
  item.sequence_id = id;
  item.layer = static_cast<int>(layer);
  item.shape = {q->shape[0], q->shape[1], q->shape[2]};
  item.queries = q->data;
  args.items.push_back(item);
  absl::StatusOr<std::vector<AttendOutput>> out = Client(*options).Attend(args);
  if (!out.ok()) return FailRpc(out.status(), c.target);
  const AttendOutput& o = out->front();
  const std::vector<int64_t> shape(o.shape.begin(), o.shape.end());
  if (absl::Status s = WriteNpy(out_path, shape, o.output.data()); !s.ok()) return Fail(s);
  if (!lse_path.empty()) {
    if (absl::Status s = WriteNpy(lse_path, {shape[0], shape[1]}, o.lse.data()); !s.ok()) {
      return Fail(s);
    }
  }
  if (json) {
    PrintJson(Json{{"out", out_path}, {"shape", shape}, {"lse_out", lse_path.empty() ? Json() : Json(lse_path)}});
    return 0;
  }
  printf("wrote %s [%s]\n", out_path.c_str(), absl::StrJoin(shape, ", ").c_str());
  return 0;
}

int RunScore(int argc, const char* const* argv) {
  FlagSet flags("score",
                "Attention logits of queries .npy [query_heads, head_dim] against one layer's\n"
                "keys; all logits, or the top-k per head with their token positions.");
  Connection c;
  std::string id, queries_path, out_path;
  int64_t layer = 0, top_k = 0, token_begin = 0, token_end = 0;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddRequiredInt("layer", &layer, "layer");
  flags.AddRequiredString("queries", &queries_path, "queries .npy [query_heads, head_dim]");
  flags.AddInt("top-k", &top_k, "only the k largest logits per head (0: all)");
  flags.AddInt("token-begin", &token_begin, "first token of the range");
  flags.AddInt("token-end", &token_end, "end of the token range (0: the layer's length)");
  flags.AddString("out", &out_path, "write the logits .npy [query_heads, columns]");
  flags.AddBool("json", &json, "print JSON (logits and positions)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(layer, 0, 1 << 20)) return UsageError("--layer must be in [0, 2^20]");
  if (!InIntRange(top_k, 0, 1 << 30)) return UsageError("--top-k must be in [0, 2^30]");
  absl::StatusOr<NpyArray> q = ReadNpy(queries_path);
  if (!q.ok()) return Fail(q.status());
  if (q->shape.size() != 2) {
    return Fail(absl::InvalidArgumentError(
        absl::StrFormat("%s has %d dims; want [query_heads, head_dim]", queries_path, q->shape.size())));
  }
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  ScoreArgs args;
  args.cache = c.cache;
  args.sequence_id = id;
  args.layer = static_cast<int>(layer);
  args.shape = {q->shape[0], q->shape[1]};
  args.queries = q->data;
  args.top_k = static_cast<int>(top_k);
  args.token_begin = token_begin;
  args.token_end = token_end;
  absl::StatusOr<ScoreResult> r = Client(*options).Score(args);
  if (!r.ok()) return FailRpc(r.status(), c.target);
  if (!out_path.empty()) {
    if (absl::Status s = WriteNpy(out_path, {r->query_heads, r->columns}, r->logits.data()); !s.ok()) {
      return Fail(s);
    }
  }
  if (json) {
    Json heads = Json::array();
    for (int64_t h = 0; h < r->query_heads; ++h) {
      Json row = {{"head", h}, {"logits", FloatArray(r->logits.data() + h * r->columns, r->columns)}};
      if (!r->positions.empty()) {
        const auto first = r->positions.begin() + h * r->columns;
        row["positions"] = std::vector<int64_t>(first, first + r->columns);
      }
      heads.push_back(row);
    }
    PrintJson(Json{{"query_heads", r->query_heads}, {"columns", r->columns}, {"heads", heads}});
    return 0;
  }
  printf("logits [%lld, %lld]\n", static_cast<long long>(r->query_heads), static_cast<long long>(r->columns));
  for (int64_t h = 0; h < r->query_heads; ++h) {
    printf("head %lld:", static_cast<long long>(h));
    const int64_t shown = std::min<int64_t>(r->columns, 8);
    for (int64_t i = 0; i < shown; ++i) {
      if (!r->positions.empty()) {
        printf(" %lld:%.4f", static_cast<long long>(r->positions[h * r->columns + i]), r->logits[h * r->columns + i]);
      } else {
        printf(" %.4f", r->logits[h * r->columns + i]);
      }
    }
    printf("%s\n", r->columns > shown ? " ..." : "");
  }
  return 0;
}

int RunFork(int argc, const char* const* argv) {
  FlagSet flags("fork", "Creates --child sharing --parent's tokens (copy-on-write pages).");
  Connection c;
  std::string parent, child;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("parent", &parent, "parent sequence id");
  flags.AddRequiredString("child", &child, "new sequence id");
  flags.AddBool("json", &json, "print JSON (the child)");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<SequenceState> s = Client(*options).ForkSequence(c.cache, parent, child);
  if (!s.ok()) return FailRpc(s.status(), c.target);
  PrintSequence(*s, json);
  return 0;
}

int RunDrop(int argc, const char* const* argv) {
  FlagSet flags("drop", "Drops a sequence and frees its pages.");
  Connection c;
  std::string id;
  bool json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("sequence", &id, "sequence id");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  absl::StatusOr<ClientOptions> options = MakeClientOptions(c);
  if (!options.ok()) return Fail(options.status());
  if (absl::Status s = Client(*options).DropSequence(c.cache, id); !s.ok()) return FailRpc(s, c.target);
  if (json) {
    PrintJson(Json{{"dropped", id}});
    return 0;
  }
  printf("dropped '%s'\n", id.c_str());
  return 0;
}

}  // namespace cli
}  // namespace tqkv
