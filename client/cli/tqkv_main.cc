// tqkv: the command-line client. `tqkv <subcommand> --help` documents each;
// `tqkv --version` prints the build's version.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "base/malloc_tuning.h"
#include "version/version.h"

namespace {

void PrintUsage(FILE* out) {
  fprintf(out,
          "usage: tqkv <subcommand> [flags]\n\n"
          "TurboQuant KV-cache compression: codecs, presets and quality on the command line.\n\n"
          "subcommands:\n");
  for (const tqkv::cli::Command& command : tqkv::cli::AllCommands()) {
    fprintf(out, "  %-12.*s %.*s\n", static_cast<int>(command.name.size()), command.name.data(),
            static_cast<int>(command.summary.size()), command.summary.data());
  }
  fprintf(out,
          "\n`tqkv <subcommand> --help` lists a subcommand's flags (kebab-case, e.g. --head-dim;\n"
          "the snake_case spelling --head_dim is the same flag). `tqkv --version` prints the version.\n");
}

}  // namespace

int main(int argc, char** argv) {
  tqkv::TuneMallocForLargeMessages();  // large messages: see the header
  if (argc < 2) {
    PrintUsage(stderr);
    return 2;
  }
  const std::string_view name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    PrintUsage(stdout);
    return 0;
  }
  if (name == "--version" || name == "version") {
    printf("tqkv %s\n", tqkv::VersionLine());
    return 0;
  }
  for (const tqkv::cli::Command& command : tqkv::cli::AllCommands()) {
    if (command.name == name) return command.run(argc - 2, argv + 2);
  }
  std::vector<std::string> names;
  for (const tqkv::cli::Command& command : tqkv::cli::AllCommands()) names.emplace_back(command.name);
  const std::string closest = tqkv::ClosestMatch(name, names);
  fprintf(stderr, "tqkv: unknown subcommand '%s'%s%s%s\n\n", argv[1], closest.empty() ? "" : "; did you mean '",
          closest.c_str(), closest.empty() ? "" : "'?");
  PrintUsage(stderr);
  return 2;
}
