// A plain driver for the request fuzz target, for builds without libFuzzer
// (the CTest entry; scripts/fuzz.sh builds the coverage-guided one):
//
//   request_fuzz_driver [--seconds S] [--seed N] CORPUS_DIR...   replay, then mutate for S s
//   request_fuzz_driver --write-seeds DIR                        write the seed corpus
//   request_fuzz_driver --write-config FILE                      the caches' server config
//
// The seeds are generated, not kept in git: valid requests of every method
// for the harness's caches.
// After replaying every corpus file it runs seeded random mutations of them
// (bit flips, random bytes, inserted, deleted and repeated runs, splices
// with another entry, another method byte) until S seconds have passed, and
// prints how many inputs ran. A finding is a crash or a sanitizer report.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/fuzz/request_fuzzer.h"
#include "tqkv/v1/kvcache.pb.h"

namespace {

using tqkv::fuzz::Method;

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

tqkv::v1::Tensor Tensor(std::vector<int64_t> shape, tqkv::v1::DType dtype, uint32_t seed) {
  tqkv::v1::Tensor t;
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::string data;
  for (int64_t i = 0; i < n; ++i) {
    const float x = normal(rng);
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (dtype == tqkv::v1::DTYPE_F32) {
      data.append(reinterpret_cast<const char*>(&bits), 4);
    } else {  // bf16: the top half (f16 seeds are not needed: the fuzzer flips dtypes)
      const uint16_t half = static_cast<uint16_t>(bits >> 16);
      data.append(reinterpret_cast<const char*>(&half), 2);
    }
  }
  t.set_data(data);
  return t;
}

// Valid requests against the harness's caches (request_fuzzer.cc), a file
// per method and variant: the fuzzer's starting points.
int WriteSeeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  int written = 0;
  // Each seed three times: as the admin, and as tenants t and u on their
  // own ids ("t:s", "u:s"; the selector byte picks the caller).
  int who = 0;
  const auto write = [&](Method method, const std::string& name, const google::protobuf::Message& m) {
    std::ofstream out(dir / (name + (who == 0 ? "" : who == 1 ? "_t" : "_u")), std::ios::binary);
    out.put(static_cast<char>(method + who * tqkv::fuzz::kMethods));
    out << m.SerializeAsString();
    ++written;
  };
  using namespace tqkv::v1;
  for (who = 0; who < 3; ++who) {
    const std::string p = who == 0 ? "" : who == 1 ? "t:" : "u:";  // the caller's namespace
    for (const char* cache : {"", "plain"}) {
      const bool plain = std::string(cache) == "plain";
      const int layers = plain ? 2 : 3, kv = plain ? 1 : 2, q = plain ? 2 : 4, d = plain ? 16 : 32;
      const std::string suffix = plain ? "_plain" : "";
      AppendRequest append;
      append.set_cache(cache);
      append.set_sequence_id(p + "s");
      *append.mutable_keys() = Tensor({layers, 6, kv, d}, DTYPE_F32, 1);
      *append.mutable_values() = Tensor({layers, 6, kv, d}, DTYPE_BF16, 2);
      write(tqkv::fuzz::kAppend, "append" + suffix, append);
      append.set_start_position(6);
      append.set_layer_begin(1);
      append.set_request_id("r1");
      *append.mutable_keys() = Tensor({layers - 1, 2, kv, d}, DTYPE_F32, 3);
      *append.mutable_values() = Tensor({layers - 1, 2, kv, d}, DTYPE_F32, 4);
      write(tqkv::fuzz::kAppend, "append_layers" + suffix, append);
      AttendRequest attend;
      attend.set_cache(cache);
      attend.set_return_lse(true);
      AttendItem* item = attend.add_items();
      item->set_sequence_id(p + "s");
      item->set_layer(layers - 1);
      *item->mutable_queries() = Tensor({2, q, d}, DTYPE_F32, 5);
      write(tqkv::fuzz::kAttend, "attend" + suffix, attend);
      *attend.mutable_sink_logits() = Tensor({q}, DTYPE_F32, 6);
      attend.set_output_dtype(DTYPE_BF16);
      write(tqkv::fuzz::kAttend, "attend_sinks" + suffix, attend);
      AppendAttendRequest step;
      step.set_cache(cache);
      step.set_layer(0);
      AppendAttendItem* s = step.add_items();
      s->set_sequence_id(p + "s");
      s->set_start_position(6);
      *s->mutable_keys() = Tensor({1, kv, d}, DTYPE_F32, 7);
      *s->mutable_values() = Tensor({1, kv, d}, DTYPE_F32, 8);
      *s->mutable_queries() = Tensor({1, q, d}, DTYPE_F32, 9);
      write(tqkv::fuzz::kAppendAttend, "append_attend" + suffix, step);
      ScoreQueryRequest score;
      score.set_cache(cache);
      score.set_sequence_id(p + "s");
      score.set_layer(0);
      score.set_token_begin(1);
      score.set_token_end(5);
      score.set_top_k(2);
      *score.mutable_queries() = Tensor({q, d}, DTYPE_F32, 10);
      write(tqkv::fuzz::kScoreQuery, "score" + suffix, score);
      CreateSequenceRequest create;
      create.set_cache(cache);
      create.set_sequence_id(p + "c");
      write(tqkv::fuzz::kCreateSequence, "create" + suffix, create);
      ForkSequenceRequest fork;
      fork.set_cache(cache);
      fork.set_parent_id(p + "s");
      fork.set_child_id(p + "s/f");
      write(tqkv::fuzz::kForkSequence, "fork" + suffix, fork);
      GetSequenceRequest get;
      get.set_cache(cache);
      get.set_sequence_id(p + "s");
      write(tqkv::fuzz::kGetSequence, "get" + suffix, get);
      DropSequenceRequest drop;
      drop.set_cache(cache);
      drop.set_sequence_id(p + "s/f");
      write(tqkv::fuzz::kDropSequence, "drop" + suffix, drop);
    }
  }
  printf("wrote %d seeds to %s\n", written, dir.c_str());
  return 0;
}

std::string Mutate(const std::vector<std::string>& corpus, std::mt19937_64& rng) {
  std::string x = corpus[rng() % corpus.size()];
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    const size_t n = x.size();
    switch (rng() % 7) {
      case 0:  // flip a bit
        if (n > 0) x[rng() % n] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:  // a random byte
        if (n > 0) x[rng() % n] = static_cast<char>(rng());
        break;
      case 2: {  // insert random bytes
        const size_t at = n > 0 ? rng() % (n + 1) : 0;
        std::string bytes(1 + rng() % 8, '\0');
        for (char& c : bytes) c = static_cast<char>(rng());
        x.insert(at, bytes);
        break;
      }
      case 3:  // delete a run
        if (n > 1) {
          const size_t at = rng() % n;
          x.erase(at, 1 + rng() % std::min<size_t>(n - at, 16));
        }
        break;
      case 4:  // repeat a run
        if (n > 1) {
          const size_t at = rng() % n, len = 1 + rng() % std::min<size_t>(n - at, 64);
          x.insert(rng() % (x.size() + 1), x.substr(at, len));
        }
        break;
      case 5: {  // splice with another entry
        const std::string& other = corpus[rng() % corpus.size()];
        if (!other.empty() && n > 0) x = x.substr(0, rng() % n) + other.substr(rng() % other.size());
        break;
      }
      case 6:  // another method
        if (n > 0) x[0] = static_cast<char>(rng() % tqkv::fuzz::kMethods);
        break;
    }
  }
  if (x.size() > 8192) x.resize(8192);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 10.0;
  uint64_t seed = 1;
  std::vector<std::string> corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--write-seeds" && i + 1 < argc) return WriteSeeds(argv[++i]);
    if (arg == "--write-config" && i + 1 < argc) {
      std::ofstream(argv[++i]) << tqkv::fuzz::HarnessConfig();
      return 0;
    }
    if (arg == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      for (const auto& entry : std::filesystem::directory_iterator(arg)) {
        if (entry.is_regular_file()) corpus.push_back(ReadFile(entry.path()));
      }
    }
  }
  if (corpus.empty()) {
    fprintf(stderr,
            "usage: request_fuzz_driver [--seconds S] [--seed N] CORPUS_DIR... | --write-seeds DIR | --write-config "
            "FILE\n");
    return 2;
  }
  int64_t runs = 0;
  for (const std::string& input : corpus) {
    tqkv::fuzz::RunOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    ++runs;
  }
  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    for (int k = 0; k < 256; ++k, ++runs) {
      const std::string input = Mutate(corpus, rng);
      tqkv::fuzz::RunOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    }
  }
  printf("request_fuzz_driver: %lld inputs (%zu corpus files, then seeded mutations for %.0f s), no crash\n",
         static_cast<long long>(runs), corpus.size(), seconds);
  return 0;
}
