// Helpers shared by the CLI's subcommands: flag parsing with the standard
// --help and usage-error handling, and the exit-code conventions.
#ifndef TQKV_CLIENT_CLI_COMMAND_UTIL_H_
#define TQKV_CLIENT_CLI_COMMAND_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "client/cli/flags.h"

namespace tqkv {
namespace cli {

inline constexpr int kExitFailure = 1;  // the work failed: bad data, I/O
inline constexpr int kExitUsage = 2;    // malformed command line

// Parses flags. Returns -1 to go on, or the exit code to return now: 0 after
// printing --help, kExitUsage after printing the error and the usage.
int ParseOrExit(FlagSet& flags, int argc, const char* const* argv);

// Prints the status to stderr; returns kExitFailure.
int Fail(const absl::Status& status);

// Prints the message to stderr; returns kExitUsage.
int UsageError(const std::string& message);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_COMMAND_UTIL_H_
