// The one list of the tqkv CLI's subcommands (commands.h): adding a command
// is its RunX in commands.h, its file, and its row here.
#include <vector>

#include "client/cli/commands.h"

namespace tqkv {
namespace cli {

const std::vector<Command>& AllCommands() {
  static const std::vector<Command> commands = {
      {"presets", "list presets with bytes per (token, head) and compression", RunPresets},
      {"distortion", "codebook D_mse for bits 1..4 next to the theoretical bounds", RunDistortion},
      {"codebook", "centroids and midpoints of one Lloyd-Max codebook", RunCodebook},
      {"roundtrip", "encode then decode an .npy array with one part of a preset", RunRoundtrip},
      {"eval", "attention quality of presets on keys / queries / values .npy files", RunEval},
      {"synth", "write synthetic gaussian or outlier-channel vectors as .npy", RunSynth},
      {"calibrate", "per-layer attention error of presets on a Q/K/V capture; protection plan", RunCalibrate},
      {"bench", "attend / store speed per preset next to a bf16 cache (CPU backend); the transport floor", RunBench},
      {"capacity", "tokens that fit in a memory budget per preset, vs bf16", RunCapacity},
      {"config", "a tqkv-server cache config for a model, from its config.json or GGUF file", RunConfig},
      {"info", "server backend, caches (pages, tokens, bytes vs bf16) and presets", RunInfo},
      {"append", "append K/V .npy [layers, tokens, kv_heads, head_dim] to a sequence", RunAppend},
      {"attend", "fused decode attention of queries .npy over a sequence's layer", RunAttend},
      {"score", "attention logits (or top-k) of queries .npy over a sequence's layer", RunScore},
      {"sequence", "tokens per layer and pages of one sequence", RunSequence},
      {"fork", "new sequence sharing a parent's tokens (copy-on-write)", RunFork},
      {"drop", "drop a sequence and free its pages", RunDrop},
      {"move", "move sequences to another server at their compressed size", RunMove},
      {"rebalance", "after the router's shards changed, move every sequence to the server its key now goes to",
       RunRebalance},
      {"load", "load generator: layer-by-layer decode (unary, fused, stream side by side) or mixed traffic", RunLoad},
  };
  return commands;
}

}  // namespace cli
}  // namespace tqkv
