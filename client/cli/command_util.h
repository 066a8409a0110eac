// Helpers shared by the CLI's subcommands: flag parsing with the standard
// --help and usage-error handling, the exit-code conventions, and --json
// output.
#ifndef TQKV_CLIENT_CLI_COMMAND_UTIL_H_
#define TQKV_CLIENT_CLI_COMMAND_UTIL_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "client/cli/flags.h"
#include "nlohmann/json.hpp"

namespace tqkv {
namespace cli {

inline constexpr int kExitFailure = 1;  // the work failed: bad data, I/O
inline constexpr int kExitUsage = 2;    // malformed command line

// Parses flags. Returns -1 to go on, or the exit code to return now: 0 after
// printing --help, kExitUsage after printing the error and the usage.
int ParseOrExit(FlagSet& flags, int argc, const char* const* argv);

// What --json prints: an nlohmann-json value whose object members keep the
// order they were set in (the order of the text output).
using Json = nlohmann::ordered_json;

// Prints `value` on stdout, indented by two spaces, and a newline. Integers
// print as integers, doubles as the shortest text that reads back to the same
// double, non-finite numbers as null; bytes that are not UTF-8 (in a path or
// a sequence id) print as U+FFFD where nlohmann would otherwise throw.
void PrintJson(const Json& value);

// `count` floats as a JSON array, each number the shortest decimal that reads
// back as the same float: 0.1 rather than the 0.10000000149011612 that a
// float widened to double prints as.
Json FloatArray(const float* values, size_t count);

// Prints the status to stderr; returns kExitFailure.
int Fail(const absl::Status& status);

// Prints the message to stderr; returns kExitUsage.
int UsageError(const std::string& message);

// The port a target without one goes to: tqkv-server's default gRPC port.
inline constexpr int kDefaultServerPort = 50051;

// `target` with ":50051" added when it names a host without a port
// ("localhost", "10.0.0.7", "[::1]"); gRPC would otherwise dial the https
// port 443. Targets with a port, with a scheme ("dns:///h:1", "unix:/p") and
// bare IPv6 addresses ("::1", ambiguous) are returned unchanged.
std::string WithDefaultPort(const std::string& target);

// Like Fail(), for the status of a call to the server at `target`: when the
// server could not be reached at all (UNAVAILABLE from gRPC's channel:
// refused, unresolvable, connection closed), one line that says so and asks
// "is tqkv-server running at <target>?" instead of gRPC's text. An
// UNAVAILABLE the server itself sent is printed as Fail() does.
int FailRpc(const absl::Status& status, const std::string& target);

// The FailRpc() text for an unreachable server, or "" when `status` is not
// one (exposed for the load generator's final message).
std::string UnreachableMessage(const absl::Status& status, const std::string& target);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_COMMAND_UTIL_H_
