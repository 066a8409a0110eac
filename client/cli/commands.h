// The tqkv CLI's subcommands. Each takes the arguments after its name and
// returns the process exit code: 0 on success, 1 when the work failed (bad
// input data, I/O), 2 for a usage error (unknown or malformed flags).
#ifndef TQKV_CLIENT_CLI_COMMANDS_H_
#define TQKV_CLIENT_CLI_COMMANDS_H_

#include <string_view>
#include <vector>

namespace tqkv {
namespace cli {

struct Command {
  std::string_view name;
  std::string_view summary;
  int (*run)(int argc, const char* const* argv);
};

// Offline subcommands (no server): codebooks, codecs and presets on .npy data.
int RunDistortion(int argc, const char* const* argv);
int RunCodebook(int argc, const char* const* argv);
int RunRoundtrip(int argc, const char* const* argv);
int RunEval(int argc, const char* const* argv);
int RunSynth(int argc, const char* const* argv);
int RunPresets(int argc, const char* const* argv);
// Per-layer attention error of presets on a Q/K/V capture, and a protection
// plan for a byte budget (calibrate_command.cc).
int RunCalibrate(int argc, const char* const* argv);

// A server config for a model, from its config.json or GGUF file
// (config_command.cc).
int RunConfig(int argc, const char* const* argv);

// Benchmarks (CPU backend): `bench attend`, `bench store`; and `capacity`.
int RunBench(int argc, const char* const* argv);
int RunCapacity(int argc, const char* const* argv);

// Subcommands over a tqkv-server (client_commands.cc): --target, --cache,
// --auth-token-file, --tls-ca-file; a failed rpc prints its code and message.
int RunInfo(int argc, const char* const* argv);
int RunSequence(int argc, const char* const* argv);
int RunAppend(int argc, const char* const* argv);
int RunAttend(int argc, const char* const* argv);
int RunScore(int argc, const char* const* argv);
int RunFork(int argc, const char* const* argv);
int RunDrop(int argc, const char* const* argv);
// Moves sequences between servers; `bench move` times it (client_commands.cc).
int RunMove(int argc, const char* const* argv);
int RunRebalance(int argc, const char* const* argv);
int RunBenchMove(int argc, const char* const* argv);
int RunLoad(int argc, const char* const* argv);

// Every subcommand, in the order `tqkv --help` lists them.
const std::vector<Command>& AllCommands();

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_COMMANDS_H_
