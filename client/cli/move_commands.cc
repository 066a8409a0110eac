// `tqkv move`, `tqkv rebalance` and `tqkv bench move`: sequences moved
// between servers at their compressed size (pulled by the destination or
// relayed here), the shard set rebalanced, and the move timed.
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

// bf16 bytes of what a sequence holds: K and V of its held tokens per layer.
int64_t Bf16BytesOf(const SequenceState& s, const v1::CacheConfig& layout) {
  int64_t tokens = 0;
  for (size_t l = 0; l < s.layer_tokens.size(); ++l) {
    tokens += s.layer_tokens[l] - (l < s.layer_oldest_token.size() ? s.layer_oldest_token[l] : 0);
  }
  return tokens * layout.num_kv_heads() * layout.head_dim() * 2 * 2;
}

// What a destination needs to pull `request` from the source at `target`.
v1::PullSequencesRequest PullRequest(const std::string& target, const ClientOptions& source,
                                     const v1::ExportRequest& request, const std::string& target_cache) {
  v1::PullSequencesRequest pull;
  pull.set_source(WithDefaultPort(target));
  pull.set_source_auth_token(source.auth_token);
  pull.set_source_tls_root_certs(source.tls_root_certs_pem);
  *pull.mutable_export_request() = request;
  pull.set_target_cache(target_cache);
  return pull;
}

struct MoveFlags {
  Connection to;
  std::string to_cache;
};

void AddDestinationFlags(FlagSet& flags, MoveFlags* m) {
  flags.AddRequiredString("to", &m->to.target, "host:port of the destination tqkv-server");
  flags.AddString("to-cache", &m->to_cache, "destination cache (empty: the source cache's name)");
  flags.AddString("to-auth-token-file", &m->to.auth_token_file, "bearer token file for the destination");
  flags.AddString("to-tls-ca-file", &m->to.tls_ca_file, "PEM CA certificate of the destination: TLS");
}

absl::StatusOr<v1::CacheConfig> CacheLayout(Client& client, const std::string& cache) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  for (const v1::CacheInfo& c : info->caches()) {
    if (c.config().name() == cache || (cache.empty() && &c == &info->caches(0))) return c.config();
  }
  return absl::NotFoundError(absl::StrCat("cache '", cache, "' not found on the server"));
}

}  // namespace

int RunMove(int argc, const char* const* argv) {
  FlagSet flags("move",
                "Moves sequences to another server at their compressed size (ExportSequences into\n"
                "ImportSequences, relayed message by message), then drops them from the source\n"
                "unless --keep-source. A moved sequence reads bit for bit as before.");
  Connection c;
  MoveFlags m;
  std::string sequences, prefix;
  bool all = false, keep_source = false, json = false;
  AddConnectionFlags(flags, &c);
  AddDestinationFlags(flags, &m);
  flags.AddString("sequences", &sequences, "comma-separated sequence ids");
  flags.AddString("prefix", &prefix, "also every sequence whose id starts with this");
  flags.AddBool("all", &all, "every sequence of the cache");
  flags.AddBool("keep-source", &keep_source, "copy: leave the sequences on the source");
  bool pull = false;
  flags.AddBool("pull", &pull, "the destination pulls from the source itself (PullSequences, admin): no relay here");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (sequences.empty() && prefix.empty() && !all) return UsageError("name --sequences, --prefix or --all");
  absl::StatusOr<ClientOptions> from_options = MakeClientOptions(c);
  if (!from_options.ok()) return Fail(from_options.status());
  absl::StatusOr<ClientOptions> to_options = MakeClientOptions(m.to);
  if (!to_options.ok()) return Fail(to_options.status());
  Client from(*from_options), to(*to_options);
  v1::ExportRequest request;
  request.set_cache(c.cache);
  for (absl::string_view id : absl::StrSplit(sequences, ',', absl::SkipEmpty()))
    request.add_sequence_ids(std::string(id));
  request.set_id_prefix(prefix);
  request.set_all(all);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::ImportResponse> moved =
      pull ? to.PullSequences(PullRequest(c.target, *from_options, request, m.to_cache))
           : CopySequences(from, to, request, m.to_cache);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!moved.ok()) return Fail(moved.status());
  int dropped = 0;
  if (!keep_source) {
    for (const std::string& id : moved->sequence_ids()) {
      if (absl::Status s = from.DropSequence(c.cache, id); !s.ok()) return Fail(s);
      ++dropped;
    }
  }
  const double gbps = seconds > 0 ? moved->bytes() / seconds / 1e9 : 0;
  if (json) {
    Json ids = Json::array();
    for (const std::string& id : moved->sequence_ids()) ids.push_back(id);
    PrintJson(Json{{"sequences", ids},
                   {"pages", moved->pages()},
                   {"bytes", moved->bytes()},
                   {"seconds", seconds},
                   {"gb_per_s", gbps},
                   {"dropped_from_source", dropped}});
  } else {
    printf("moved %d sequences (%lld pages, %lld bytes) in %.3f s (%.2f GB/s)%s\n", moved->sequence_ids_size(),
           static_cast<long long>(moved->pages()), static_cast<long long>(moved->bytes()), seconds, gbps,
           keep_source ? "; kept on the source" : "; dropped from the source");
  }
  return 0;
}

int RunRebalance(int argc, const char* const* argv) {
  FlagSet flags("rebalance",
                "After the router's shard set changed: moves every sequence to the server the router\n"
                "now sends its routing key to. The router itself says where a key goes (a\n"
                "GetServerInfo routed by the key names its server's instance_id), so any router\n"
                "with any hash works; --servers lists every server that may hold sequences (the\n"
                "old set and the new). To drain a server before removing it: take it out of the\n"
                "router, then rebalance with it still in --servers (--from limits the moves to it).\n"
                "The ids of one routing key (forks 'chat-7/...' of 'chat-7') move in one stream, so the\n"
                "pages they share travel once and stay shared.");
  Connection c;
  std::string router, servers, only_from;
  bool dry_run = false, json = false;
  AddConnectionFlags(flags, &c);
  flags.AddRequiredString("router", &router, "host:port of the router (haproxy)");
  flags.AddRequiredString("servers", &servers, "comma-separated host:port of every tqkv-server behind it");
  flags.AddString("from", &only_from, "only move sequences off this server (host:port, one of --servers)");
  flags.AddBool("dry-run", &dry_run, "say what would move, move nothing");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  const auto options_for = [&c](const std::string& target) {
    Connection to = c;
    to.target = target;
    return MakeClientOptions(to);
  };
  struct Shard {
    std::string target;
    std::unique_ptr<Client> client;
    std::string instance;
  };
  std::vector<Shard> shards;
  std::map<std::string, size_t> by_instance;
  for (absl::string_view t : absl::StrSplit(servers, ',', absl::SkipEmpty())) {
    absl::StatusOr<ClientOptions> o = options_for(std::string(t));
    if (!o.ok()) return Fail(o.status());
    Shard shard{std::string(t), std::make_unique<Client>(*o), ""};
    absl::StatusOr<v1::ServerInfo> info = shard.client->GetServerInfo();
    if (!info.ok()) return Fail(absl::Status(info.status().code(), absl::StrCat(t, ": ", info.status().message())));
    shard.instance = info->instance_id();
    by_instance[shard.instance] = shards.size();
    shards.push_back(std::move(shard));
  }
  if (!only_from.empty() &&
      std::none_of(shards.begin(), shards.end(), [&](const Shard& s) { return s.target == only_from; })) {
    return UsageError("--from must be one of --servers");
  }
  absl::StatusOr<ClientOptions> router_options = options_for(router);
  if (!router_options.ok()) return Fail(router_options.status());
  Client via(*router_options);
  std::map<std::string, size_t> owner_of_key;  // routing key -> shard
  int64_t moved = 0, kept = 0, bytes = 0;
  Json moves = Json::array();
  const absl::Time start = absl::Now();
  for (size_t from = 0; from < shards.size(); ++from) {
    if (!only_from.empty() && shards[from].target != only_from) continue;
    absl::StatusOr<std::vector<std::string>> ids = shards[from].client->ListSequences(c.cache);
    if (!ids.ok()) return Fail(ids.status());
    // The ids of each routing key move together, to one server.
    std::map<std::string, std::vector<std::string>> groups;
    for (const std::string& id : *ids) groups[RouteKey(id)].push_back(id);
    for (const auto& [key, group] : groups) {
      auto it = owner_of_key.find(key);
      if (it == owner_of_key.end()) {
        absl::StatusOr<std::string> instance = via.InstanceFor(group.front());
        if (!instance.ok()) return Fail(instance.status());
        auto shard = by_instance.find(*instance);
        if (shard == by_instance.end()) {
          return Fail(absl::FailedPreconditionError(
              absl::StrFormat("the router sends key '%s' to a server not in --servers (instance %s)", key, *instance)));
        }
        it = owner_of_key.emplace(key, shard->second).first;
      }
      const size_t to = it->second;
      if (to == from) {
        kept += static_cast<int64_t>(group.size());
        continue;
      }
      for (const std::string& id : group) {
        moves.push_back(Json{{"sequence", id}, {"from", shards[from].target}, {"to", shards[to].target}});
        if (!json)
          printf("%s %s: %s -> %s\n", dry_run ? "would move" : "moving", id.c_str(), shards[from].target.c_str(),
                 shards[to].target.c_str());
      }
      if (dry_run) {
        moved += static_cast<int64_t>(group.size());
        continue;
      }
      v1::ExportRequest request;
      request.set_cache(c.cache);
      for (const std::string& id : group) request.add_sequence_ids(id);
      absl::StatusOr<v1::ImportResponse> copied = CopySequences(*shards[from].client, *shards[to].client, request);
      if (!copied.ok()) {
        return Fail(absl::Status(copied.status().code(),
                                 absl::StrCat("moving key '", key, "' from ", shards[from].target, " to ",
                                              shards[to].target, ": ", copied.status().message())));
      }
      // Dropped from the old home only once the new one holds them all.
      for (const std::string& id : group) {
        if (absl::Status s = shards[from].client->DropSequence(c.cache, id); !s.ok()) return Fail(s);
      }
      moved += static_cast<int64_t>(group.size());
      bytes += copied->bytes();
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (json) {
    PrintJson(Json{{"moved", moved},
                   {"kept", kept},
                   {"bytes", bytes},
                   {"seconds", seconds},
                   {"dry_run", dry_run},
                   {"moves", moves}});
  } else {
    printf("%s %lld sequences (%lld bytes), %lld already home, in %.2f s\n", dry_run ? "would move" : "moved",
           static_cast<long long>(moved), static_cast<long long>(bytes), static_cast<long long>(kept), seconds);
  }
  return 0;
}

namespace {

// Prefills `id` with `context` tokens of random K/V in chunks of at most
// ~32 MiB on the wire, the same random chunk each time (what the bytes are
// does not change what moving them costs).
absl::Status PrefillRandom(Client& from, const std::string& cache, const std::string& id, const v1::CacheConfig& layout,
                           int64_t context, std::mt19937& rng) {
  const int64_t layers = layout.num_layers(), heads = layout.num_kv_heads(), dim = layout.head_dim();
  const int64_t chunk_tokens = std::max<int64_t>(1, (int64_t{32} << 20) / (layers * heads * dim * 2 * 2));
  std::normal_distribution<float> normal;
  std::vector<float> kv(static_cast<size_t>(layers * std::min(chunk_tokens, context) * heads * dim));
  for (float& x : kv) x = normal(rng);
  std::vector<AppendArgs> chunks;
  for (int64_t t = 0; t < context; t += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, context - t);
    AppendArgs a;
    a.cache = cache;
    a.sequence_id = id;
    a.start_position = t;
    a.shape = {layers, n, heads, dim};
    a.keys = absl::MakeConstSpan(kv.data(), static_cast<size_t>(layers * n * heads * dim));
    a.values = a.keys;
    a.wire_dtype = v1::DTYPE_BF16;
    chunks.push_back(a);
  }
  return from.AppendStream(chunks).status();
}

// Whether the copy answers exactly as the source: one random query at the
// first and the last layer.
absl::StatusOr<bool> SameAttend(Client& from, Client& to, const std::string& cache, const std::string& dest_cache,
                                const std::string& id, const v1::CacheConfig& layout, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const int64_t dim = layout.head_dim();
  std::vector<float> q(static_cast<size_t>(layout.num_query_heads() * dim));
  for (float& x : q) x = normal(rng);
  bool identical = true;
  for (int64_t layer : {int64_t{0}, int64_t{layout.num_layers()} - 1}) {
    AttendItemArgs item;
    item.sequence_id = id;
    item.layer = static_cast<int>(layer);
    item.shape = {1, layout.num_query_heads(), dim};
    item.queries = q;
    AttendArgs args;
    args.items = {item};
    args.cache = cache;
    absl::StatusOr<std::vector<AttendOutput>> a = from.Attend(args);
    args.cache = dest_cache;
    absl::StatusOr<std::vector<AttendOutput>> b = to.Attend(args);
    if (!a.ok()) return a.status();
    if (!b.ok()) return b.status();
    identical = identical && (*a)[0].output == (*b)[0].output;
  }
  return identical;
}

}  // namespace

int RunBenchMove(int argc, const char* const* argv) {
  FlagSet flags("bench move",
                "Prefills one sequence of --context tokens on the source server (random K/V, bf16 on\n"
                "the wire), then times moving it to the destination (export + import, relayed by this\n"
                "process) --rounds times, dropping the copy between rounds. Checks that the copy's\n"
                "Attend equals the source's bit for bit; prints the bytes moved next to the same\n"
                "tokens in bf16, and GB/s of compressed bytes (median round).");
  Connection c;
  MoveFlags m;
  int64_t context = 32768, rounds = 3;
  bool json = false;
  AddConnectionFlags(flags, &c);
  AddDestinationFlags(flags, &m);
  flags.AddInt("context", &context, "tokens of the sequence moved");
  flags.AddInt("rounds", &rounds, "timed moves");
  bool pull = false;
  flags.AddBool("pull", &pull, "the destination pulls from the source (PullSequences): no relay process");
  flags.AddBool("json", &json, "print JSON");
  if (int code = ParseOrExit(flags, argc, argv); code >= 0) return code;
  if (!InIntRange(context, 1, int64_t{1} << 22) || !InIntRange(rounds, 1, 100)) {
    return UsageError("--context wants 1..2^22 and --rounds 1..100");
  }
  absl::StatusOr<ClientOptions> from_options = MakeClientOptions(c);
  if (!from_options.ok()) return Fail(from_options.status());
  absl::StatusOr<ClientOptions> to_options = MakeClientOptions(m.to);
  if (!to_options.ok()) return Fail(to_options.status());
  Client from(*from_options), to(*to_options);
  absl::StatusOr<v1::CacheConfig> layout = CacheLayout(from, c.cache);
  if (!layout.ok()) return Fail(layout.status());
  const int64_t layers = layout->num_layers();
  const std::string id = absl::StrCat("bench-move-", absl::ToUnixMicros(absl::Now()));

  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  fprintf(stderr, "prefilling %lld tokens of '%s'...\n", static_cast<long long>(context), id.c_str());
  if (absl::Status s = PrefillRandom(from, c.cache, id, *layout, context, rng); !s.ok()) return Fail(s);
  absl::StatusOr<SequenceState> state = from.GetSequence(c.cache, id);
  if (!state.ok()) return Fail(state.status());
  const int64_t bf16_bytes = Bf16BytesOf(*state, *layout);

  v1::ExportRequest request;
  request.set_cache(c.cache);
  request.add_sequence_ids(id);
  std::vector<double> seconds;
  int64_t bytes = 0;
  bool identical = true;
  const std::string dest_cache = m.to_cache.empty() ? c.cache : m.to_cache;
  for (int64_t r = 0; r < rounds; ++r) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::ImportResponse> moved =
        pull ? to.PullSequences(PullRequest(c.target, *from_options, request, m.to_cache))
             : CopySequences(from, to, request, m.to_cache);
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    if (!moved.ok()) return Fail(moved.status());
    bytes = moved->bytes();
    if (r == 0) {
      absl::StatusOr<bool> same = SameAttend(from, to, c.cache, dest_cache, id, *layout, rng);
      if (!same.ok()) return Fail(same.status());
      identical = *same;
    }
    if (absl::Status s = to.DropSequence(dest_cache, id); !s.ok()) return Fail(s);
  }
  (void)from.DropSequence(c.cache, id);
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double gbps = bytes / median / 1e9;
  const double ratio = static_cast<double>(bytes) / bf16_bytes;
  if (json) {
    PrintJson(Json{{"context", context},
                   {"preset", layout->preset()},
                   {"bytes_moved", bytes},
                   {"bf16_bytes", bf16_bytes},
                   {"ratio_to_bf16", ratio},
                   {"seconds", seconds},
                   {"median_seconds", median},
                   {"gb_per_s", gbps},
                   {"identical_attend", identical}});
  } else {
    printf("moved %lld tokens (%lld layers, preset %s): %lld bytes = %.3fx their %lld bf16 bytes\n",
           static_cast<long long>(context), static_cast<long long>(layers), layout->preset().c_str(),
           static_cast<long long>(bytes), ratio, static_cast<long long>(bf16_bytes));
    printf(
        "median of %zu rounds %.3f s (%s): %.2f GB/s of compressed bytes (bf16 at that rate: %.3f s); attend "
        "on the copy %s\n",
        seconds.size(), median, pull ? "pulled by the destination" : "relayed by this process", gbps,
        bf16_bytes / (gbps * 1e9), identical ? "identical" : "DIFFERS");
  }
  return identical ? 0 : kExitFailure;
}

}  // namespace cli
}  // namespace tqkv
