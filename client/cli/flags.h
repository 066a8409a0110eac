// A tiny command-line parser for `tqkv <subcommand> --name value --switch`.
//
// Each subcommand builds one FlagSet, registers its flags with pointers to
// variables it owns (whose current values are the defaults), and parses the
// arguments that follow the subcommand name:
//
//   int64_t head_dim = 128;
//   std::string keys;
//   bool verbose = false;
//   FlagSet flags("encode", "Compresses a K/V tensor.");
//   flags.AddRequiredString("keys", &keys, "input .npy file, [tokens, head_dim]");
//   flags.AddInt("head-dim", &head_dim, "head dimension");
//   flags.AddBool("verbose", &verbose, "print per-layer statistics");
//   absl::Status status = flags.Parse(argc - 2, argv + 2);
//   if (IsHelpRequest(status)) { std::cout << flags.Usage(); return 0; }
//   if (!status.ok()) { std::cerr << status.message() << "\n"; return 2; }
//
// Accepted syntax: `--name value` and `--name=value` for valued flags (a
// value may start with '-', e.g. `--offset -3`, but `--name --other` is a
// missing value); `--name` for a switch, which sets it to true, and
// `--name=true|false|1|0` to set it explicitly. A flag given twice takes the
// last value. `--help` or `-h` anywhere asks for help. Positional arguments
// are not accepted. Flags are registered in kebab-case; the snake_case
// spelling names the same flag (`--head_dim 64` is `--head-dim 64`), so a
// flag can be written the way tqkv-server spells its own.
//
// Thread safety: none; a FlagSet is built and used by one thread.
#ifndef TQKV_CLIENT_CLI_FLAGS_H_
#define TQKV_CLIENT_CLI_FLAGS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tqkv {

class FlagSet {
 public:
  // `subcommand` and the one-line `description` only appear in Usage().
  explicit FlagSet(std::string subcommand, std::string description = "");

  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;

  // Registers `--name`. `name` is given without the leading dashes and uses
  // lowercase words joined by '-' (e.g. "head-dim"; "head_dim" on the command
  // line is the same flag). `target` is not owned,
  // must outlive Parse(), and is written only when the flag is given; its
  // value at registration is shown in Usage() as the default. Registering a
  // name twice, a name that is not [a-z0-9-]+, "help", or a null target is a
  // programming error that Parse() reports as INTERNAL.
  void AddString(std::string name, std::string* target, std::string help);
  void AddInt(std::string name, int64_t* target, std::string help);
  void AddDouble(std::string name, double* target, std::string help);
  // A comma-separated list of integers, parsed by ParseIntList(); the given
  // list replaces the default.
  void AddIntList(std::string name, std::vector<int64_t>* target, std::string help);
  // A switch: `--name` sets *target to true.
  void AddBool(std::string name, bool* target, std::string help);

  // Like the above, but Parse() fails unless the flag is given.
  void AddRequiredString(std::string name, std::string* target, std::string help);
  void AddRequiredInt(std::string name, int64_t* target, std::string help);

  // Parses `argv[0..argc)`, the arguments after the subcommand name (not the
  // program name). Targets of the flags given are written as each is parsed,
  // so on error some may already hold new values.
  //
  // Errors:
  //   IsHelpRequest(status)  `--help` or `-h` was given; nothing else is
  //                          checked. Print Usage() and exit successfully.
  //   INVALID_ARGUMENT       an unknown flag, a missing value, a value that
  //                          does not parse ("--head-dim: expected an integer,
  //                          got 'abc'"), a value given to a switch that is
  //                          not true/false, a missing required flag, or a
  //                          positional argument.
  //   INTERNAL               a registration error (see AddString).
  absl::Status Parse(int argc, const char* const* argv);
  absl::Status Parse(const std::vector<std::string>& args);

  // True if `--name` appeared in the last Parse() (even with the default
  // value). False for unregistered names.
  bool IsSet(std::string_view name) const;

  // Multi-line help: "usage: tqkv <subcommand> [flags]", the description,
  // then one line per flag in registration order with its value type, help,
  // and "(required)" or its default.
  std::string Usage() const;

 private:
  enum class Type { kString, kInt, kDouble, kIntList, kBool };
  struct Flag {
    std::string name;
    Type type;
    void* target;
    std::string help;
    std::string default_text;
    bool required = false;
    bool set = false;
  };

  void Add(std::string name, Type type, void* target, std::string help, bool required);
  Flag* Find(std::string_view name);
  absl::Status SetValue(Flag& flag, std::string_view value);

  std::string subcommand_;
  std::string description_;
  std::vector<Flag> flags_;
  std::string registration_error_;  // first registration error, if any
};

// True for the status Parse() returns when help was requested.
bool IsHelpRequest(const absl::Status& status);

// Splits "a, b,,c" into {"a", "b", "c"}: items are trimmed of ASCII
// whitespace and empty items are dropped, so "" gives an empty vector.
std::vector<std::string> SplitCommaList(std::string_view text);

// Parses a comma-separated list of base-10 int64 values ("1, 2,-3"), split as
// by SplitCommaList ("" gives an empty list). INVALID_ARGUMENT naming the bad
// item when one is not an integer or is out of range.
absl::StatusOr<std::vector<int64_t>> ParseIntList(std::string_view text);

}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_FLAGS_H_
