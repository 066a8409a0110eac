// The flags of one `tqkv <subcommand>`, parsed by CLI11 (CLI/CLI.hpp, the
// Debian package libcli11-dev). This layer only registers each flag the way
// every subcommand spells it and turns CLI11's outcome into an absl::Status
// worded like the CLI's other errors; CLI11 itself stays out of the
// subcommands' headers (it is large, and header-only).
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
// value may start with one '-', e.g. `--offset -3`; a value that starts with
// "--" is taken for a forgotten value and refused); `--name` for a switch,
// which sets it to true, and `--name=true|false|1|0` to set it explicitly
// (`--name=` gives a valued flag the empty value). A flag given twice takes
// the last value. `--help` or `-h` asks for help, and wins over errors found
// after the arguments are read. Positional arguments are not accepted. Flags are
// registered in kebab-case; the snake_case spelling names the same flag
// (`--head_dim 64` is `--head-dim 64`), so a flag can be written the way
// tqkv-server spells its own. Integers are base-10 int64 (no hex, no octal
// from a leading 0), numbers finite.
//
// Thread safety: none; a FlagSet is built and used by one thread.
#ifndef TQKV_CLIENT_CLI_FLAGS_H_
#define TQKV_CLIENT_CLI_FLAGS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace tqkv {

class FlagSet {
 public:
  // `subcommand` names the command in Usage() and in error messages ("tqkv
  // <subcommand>"); the one-line `description` only appears in Usage().
  explicit FlagSet(std::string subcommand, std::string description = "");
  ~FlagSet();

  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;

  // Registers `--name`. `name` is given without the leading dashes and uses
  // lowercase words joined by '-' (e.g. "head-dim"; "head_dim" on the command
  // line is the same flag). `target` is not owned, must outlive Parse(), and
  // is written only when the flag is given; its value at registration is shown
  // in Usage() as the default. Registering a name twice, a name that is not
  // [a-z0-9-]+, "help", or a null target is a programming error that Parse()
  // reports as INTERNAL.
  void AddString(std::string name, std::string* target, std::string help);
  void AddInt(std::string name, int64_t* target, std::string help);
  void AddDouble(std::string name, double* target, std::string help);
  // A comma-separated list of integers ("3, 5,7"; items trimmed, empty items
  // dropped); the given list replaces the default.
  void AddIntList(std::string name, std::vector<int64_t>* target, std::string help);
  // A switch: `--name` sets *target to true.
  void AddBool(std::string name, bool* target, std::string help);

  // Like the above, but Parse() fails unless the flag is given.
  void AddRequiredString(std::string name, std::string* target, std::string help);
  void AddRequiredInt(std::string name, int64_t* target, std::string help);

  // Parses `argv[0..argc)`, the arguments after the subcommand name (not the
  // program name). Targets of the flags given may be written even when the
  // parse fails. May be called again; each call starts from no flags given.
  //
  // Errors:
  //   IsHelpRequest(status)  `--help` or `-h` was given. Print Usage() and
  //                          exit successfully.
  //   INVALID_ARGUMENT       an unknown flag (with "did you mean --x?" when a
  //                          registered name is close), a missing value, a
  //                          value that does not parse ("--head-dim: expected
  //                          an integer, got 'abc'"), a missing required flag
  //                          ("'tqkv encode' requires --keys (missing)"), or a
  //                          positional argument.
  //   INTERNAL               a registration error (see AddString).
  absl::Status Parse(int argc, const char* const* argv);
  absl::Status Parse(const std::vector<std::string>& args);

  // True if `--name` (either spelling) appeared in the last Parse(), even
  // with the default value. False for unregistered names.
  bool IsSet(std::string_view name) const;

  // `--old_name` (either spelling, with or without `=value`) as a deprecated
  // spelling of the flag `--new_name`: Parse() reads it as `--new_name`, so
  // IsSet(new_name) is then true, and Warnings() says to use the new name.
  // Giving both is INVALID_ARGUMENT. Usage() lists the old name in its
  // footer. Names as for AddString; `old_name` must not be registered.
  void AddDeprecatedAlias(std::string old_name, std::string new_name);

  // One line per deprecated alias the last Parse() read ("--window is
  // deprecated; use --recent"), for the caller to print to stderr.
  const std::vector<std::string>& Warnings() const { return warnings_; }

  // CLI11's help for the subcommand: "Usage: tqkv <subcommand> [OPTIONS]",
  // the description, then one line per flag in registration order with its
  // value type, its default ("=128") or REQUIRED, and its help.
  std::string Usage() const;

 private:
  // Checks `name` and `target` and records the name; false (the problem kept
  // for Parse()) when either is wrong or an earlier flag was. The caller then
  // adds the CLI11 option.
  bool Register(const std::string& name, const void* target);
  CLI::Option* Find(std::string_view name) const;
  // `args` with each deprecated alias renamed (recording a warning);
  // INVALID_ARGUMENT when an alias and its flag are both given.
  absl::StatusOr<std::vector<std::string>> RenameAliases(const std::vector<std::string>& args);
  absl::Status UnknownArgument(const std::string& arg) const;
  absl::Status MissingRequired() const;

  std::string subcommand_;
  std::unique_ptr<CLI::App> app_;
  std::vector<std::string> names_;                            // registered names, kebab-case
  std::vector<std::pair<std::string, std::string>> aliases_;  // (deprecated, new), kebab-case
  std::vector<std::string> warnings_;                         // of the last Parse()
  std::string registration_error_;                            // first registration error, if any
};

// True for the status Parse() returns when help was requested.
bool IsHelpRequest(const absl::Status& status);

// The candidate closest to `word` by edit distance, if it is close enough to
// be a plausible typo (fewer than 3 edits); "" otherwise. For the "did you
// mean" of unknown flags and subcommands.
std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_FLAGS_H_
