#include "client/cli/command_util.h"

#include <cstdio>

namespace tqkv {
namespace cli {

int ParseOrExit(FlagSet& flags, int argc, const char* const* argv) {
  absl::Status status = flags.Parse(argc, argv);
  if (status.ok()) return -1;
  if (IsHelpRequest(status)) {
    printf("%s", flags.Usage().c_str());
    return 0;
  }
  fprintf(stderr, "tqkv: %s\n\n%s", std::string(status.message()).c_str(), flags.Usage().c_str());
  return kExitUsage;
}

int Fail(const absl::Status& status) {
  fprintf(stderr, "tqkv: %s\n", status.ToString().c_str());
  return kExitFailure;
}

int UsageError(const std::string& message) {
  fprintf(stderr, "tqkv: %s\n", message.c_str());
  return kExitUsage;
}

}  // namespace cli
}  // namespace tqkv
