#include "client/cli/flags.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"

namespace tqkv {
namespace {

// Marks the status Parse() returns for --help, so that IsHelpRequest() does
// not depend on the message text.
constexpr char kHelpPayloadUrl[] = "type.googleapis.com/tqkv.cli.HelpRequested";

// Debian's abseil has its own string_view type; convert at the boundary.
absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// "head-dim" -> "head_dim", and back: the two spellings of one flag.
std::string Replace(std::string_view name, char from, char to) {
  std::string out(name);
  std::replace(out.begin(), out.end(), from, to);
  return out;
}

// The CLI11 name list of a flag: "--head-dim,--head_dim".
std::string OptionNames(const std::string& name) {
  std::string names = absl::StrCat("--", name);
  if (name.find('-') != std::string::npos) absl::StrAppend(&names, ",--", Replace(name, '-', '_'));
  return names;
}

bool ValidName(std::string_view name) {
  if (name.empty() || name.front() == '-') return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'; });
}

// CLI11 takes the next argument as the value even when it is another flag
// (`--keys --verbose` would set keys to "--verbose"); a value that starts
// with "--" is far more often a forgotten one than a real one.
std::string RefuseFlagAsValue(const std::string& value, const std::string& flag) {
  if (value.size() > 2 && value.compare(0, 2, "--") == 0) {
    return absl::StrCat("missing value ('", value, "' is a flag); use ", flag, " <value>");
  }
  return "";
}

// Strict base-10 int64: an optional sign, digits, nothing else. CLI11's own
// conversion (strtoll with base 0) would read "010" as 8 and take "0x10".
absl::Status ParseInt(std::string_view text, int64_t* value) {
  std::string_view body = text;
  if (!body.empty() && body.front() == '+') body.remove_prefix(1);
  const bool bad_sign = body.size() != text.size() && !body.empty() && body.front() == '-';
  const char* end = body.data() + body.size();
  const auto [ptr, ec] = std::from_chars(body.data(), end, *value);
  if (!body.empty() && !bad_sign && ptr == end && ec == std::errc::result_out_of_range) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected an integer in [-2^63, 2^63), got '", Absl(text), "' (out of range)"));
  }
  if (body.empty() || bad_sign || ptr != end || ec != std::errc()) {
    return absl::InvalidArgumentError(absl::StrCat("expected an integer, got '", Absl(text), "'"));
  }
  return absl::OkStatus();
}

// CLI11 transforms (run on each value before CLI11 converts it): "" when the
// value is good, else the reason, which CLI11 reports as "--flag: reason".
CLI::Validator IntegerValue(const std::string& flag) {
  return CLI::Validator(
      [flag](std::string& text) {
        std::string refused = RefuseFlagAsValue(text, flag);
        if (!refused.empty()) return refused;
        int64_t value = 0;
        absl::Status status = ParseInt(text, &value);
        if (!status.ok()) return std::string(status.message());
        text = absl::StrCat(value);  // canonical decimal for CLI11's conversion
        return std::string();
      },
      "");
}

// A finite decimal or scientific number ("0.5", "-1e-3"); nan, inf, hex and
// values that overflow a double are refused.
CLI::Validator NumberValue(const std::string& flag) {
  return CLI::Validator(
      [flag](std::string& text) {
        std::string refused = RefuseFlagAsValue(text, flag);
        if (!refused.empty()) return refused;
        std::string_view body = text;
        if (!body.empty() && body.front() == '+') body.remove_prefix(1);
        const bool bad_sign = body.size() != text.size() && !body.empty() && body.front() == '-';
        double value = 0;
        const char* end = body.data() + body.size();
        const auto [ptr, ec] = std::from_chars(body.data(), end, value);
        if (body.empty() || bad_sign || ptr != end || ec != std::errc() || !std::isfinite(value)) {
          return absl::StrCat("expected a finite number, got '", text, "'");
        }
        return std::string();
      },
      "");
}

CLI::Validator StringValue(const std::string& flag) {
  return CLI::Validator([flag](std::string& text) { return RefuseFlagAsValue(text, flag); }, "");
}

// Only true|false|1|0 after `--switch=` (CLI11 alone also reads yes/no,
// on/off, and digits as counts).
CLI::Validator SwitchValue() {
  return CLI::Validator(
      [](std::string& text) {
        if (text == "true" || text == "1" || text == "false" || text == "0") return std::string();
        return absl::StrCat("expected true or false, got '", text, "'");
      },
      "");
}

// Splits "1, -2,,3" into {1, -2, 3}: items trimmed, empty items dropped.
absl::Status ParseIntList(std::string_view text, std::vector<int64_t>* values) {
  values->clear();
  for (absl::string_view item : absl::StrSplit(Absl(text), ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    int64_t value = 0;
    if (!ParseInt(std::string_view(item.data(), item.size()), &value).ok()) {
      return absl::InvalidArgumentError(absl::StrCat("expected a comma-separated list of integers, got '", Absl(text),
                                                     "': item '", item, "' is not an integer in [-2^63, 2^63)"));
    }
    values->push_back(value);
  }
  return absl::OkStatus();
}

// CLI11's help, with the usage line before the description rather than after
// it, and each flag shown once: its snake_case alias is the same flag, and
// the footer says so.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_help(const CLI::App* app, std::string name, CLI::AppFormatMode mode) const override {
    std::string out = make_usage(app, std::move(name));
    const std::string description = make_description(app);
    if (!description.empty()) absl::StrAppend(&out, "\n", description);
    absl::StrAppend(&out, make_groups(app, mode), "\n", make_footer(app));
    return out;
  }

  std::string make_option_name(const CLI::Option* option, bool is_positional) const override {
    if (is_positional) return CLI::Formatter::make_option_name(option, is_positional);
    std::vector<std::string> names;
    for (const std::string& name : option->get_snames()) names.push_back("-" + name);
    for (const std::string& name : option->get_lnames()) {
      if (name.find('_') == std::string::npos) names.push_back("--" + name);
    }
    return absl::StrJoin(names, ",");
  }
};

absl::Status HelpRequested(const std::string& subcommand) {
  absl::Status help = absl::CancelledError(absl::StrCat("help requested for 'tqkv ", subcommand, "'"));
  help.SetPayload(kHelpPayloadUrl, absl::Cord("1"));
  return help;
}

// Levenshtein distance, for "did you mean" suggestions.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

FlagSet::FlagSet(std::string subcommand, std::string description)
    : subcommand_(std::move(subcommand)),
      app_(std::make_unique<CLI::App>(std::move(description), absl::StrCat("tqkv ", subcommand_))) {
  app_->set_help_flag("-h,--help", "show this help");
  // Unknown arguments are collected rather than thrown, so that Parse() can
  // name the first one and suggest a registered flag.
  app_->allow_extras();
  app_->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app_->formatter(std::make_shared<HelpFormatter>());
}

FlagSet::~FlagSet() = default;

bool FlagSet::Register(const std::string& name, const void* target) {
  if (!registration_error_.empty()) return false;  // Parse() reports the first
  std::string problem;
  if (!ValidName(name)) {
    problem = "is not a valid flag name; want [a-z0-9-]+ without leading dashes";
  } else if (name == "help") {
    problem = "is reserved";
  } else if (std::find(names_.begin(), names_.end(), name) != names_.end()) {
    problem = "is registered twice";
  } else if (target == nullptr) {
    problem = "has a null target";
  }
  if (!problem.empty()) {
    registration_error_ = absl::StrCat("flag '", name, "' of 'tqkv ", subcommand_, "' ", problem);
    return false;
  }
  names_.push_back(name);
  // The snake_case note once, before any alias lines (AddDeprecatedAlias).
  const std::string footer = app_->get_footer();
  if (name.find('-') != std::string::npos && footer.find("snake_case") == std::string::npos) {
    app_->footer(absl::StrCat("Each flag also takes its snake_case spelling (--", Replace(name, '-', '_'), " is --",
                              name, ").", footer.empty() ? "" : "\n", footer));
  }
  return true;
}

void FlagSet::AddString(std::string name, std::string* target, std::string help) {
  if (!Register(name, target)) return;
  CLI::Option* option = app_->add_option(OptionNames(name), *target, std::move(help));
  option->transform(StringValue("--" + name));
  if (!target->empty()) option->default_str(*target);
}

void FlagSet::AddInt(std::string name, int64_t* target, std::string help) {
  if (!Register(name, target)) return;
  CLI::Option* option = app_->add_option(OptionNames(name), *target, std::move(help));
  option->transform(IntegerValue("--" + name))->default_str(absl::StrCat(*target));
}

void FlagSet::AddDouble(std::string name, double* target, std::string help) {
  if (!Register(name, target)) return;
  CLI::Option* option = app_->add_option(OptionNames(name), *target, std::move(help));
  option->transform(NumberValue("--" + name))->default_str(absl::StrCat(*target));
}

void FlagSet::AddIntList(std::string name, std::vector<int64_t>* target, std::string help) {
  if (!Register(name, target)) return;
  const std::string flag = "--" + name;
  CLI::Option* option = app_->add_option_function<std::string>(
      OptionNames(name),
      [target, flag](const std::string& text) {
        absl::Status status = ParseIntList(text, target);
        if (!status.ok()) throw CLI::ValidationError(flag, std::string(status.message()));
      },
      std::move(help));
  option->transform(StringValue(flag))->type_name("INT,...");
  option->default_str(target->empty() ? "none" : absl::StrJoin(*target, ","));
}

void FlagSet::AddBool(std::string name, bool* target, std::string help) {
  if (!Register(name, target)) return;
  // A switch shows no default; one that is on says how to turn it off.
  if (*target) absl::StrAppend(&help, " (on by default; --", name, "=false turns it off)");
  app_->add_flag(OptionNames(name), *target, std::move(help))->check(SwitchValue());
}

void FlagSet::AddRequiredString(std::string name, std::string* target, std::string help) {
  AddString(name, target, std::move(help));
  if (CLI::Option* option = Find(name)) option->required();
}

void FlagSet::AddRequiredInt(std::string name, int64_t* target, std::string help) {
  AddInt(name, target, std::move(help));
  if (CLI::Option* option = Find(name)) option->required()->default_str("");
}

void FlagSet::AddDeprecatedAlias(std::string old_name, std::string new_name) {
  if (!registration_error_.empty()) return;
  if (!ValidName(old_name) || std::find(names_.begin(), names_.end(), old_name) != names_.end() ||
      std::find(names_.begin(), names_.end(), new_name) == names_.end()) {
    registration_error_ = absl::StrCat("alias '", old_name, "' of 'tqkv ", subcommand_,
                                       "' is not a free valid name for the registered flag '", new_name, "'");
    return;
  }
  aliases_.emplace_back(old_name, new_name);
  app_->footer(absl::StrCat(app_->get_footer(), app_->get_footer().empty() ? "" : "\n", "--", old_name,
                            " is a deprecated spelling of --", new_name, "."));
}

absl::StatusOr<std::vector<std::string>> FlagSet::RenameAliases(const std::vector<std::string>& args) {
  std::vector<std::string> out = args;
  for (const auto& [old_name, new_name] : aliases_) {
    bool old_given = false, new_given = false;
    for (std::string& arg : out) {
      if (arg == "--") break;
      if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
      const size_t equals = arg.find('=');
      const std::string name = Replace(std::string_view(arg).substr(2, equals - 2), '_', '-');
      if (name == new_name) new_given = true;
      if (name != old_name) continue;
      old_given = true;
      arg = absl::StrCat("--", new_name, equals == std::string::npos ? "" : arg.substr(equals));
    }
    if (old_given && new_given) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", old_name, " is a deprecated spelling of --", new_name, "; give only --", new_name));
    }
    if (old_given) warnings_.push_back(absl::StrCat("--", old_name, " is deprecated; use --", new_name));
  }
  return out;
}

CLI::Option* FlagSet::Find(std::string_view name) const {
  return app_->get_option_no_throw(absl::StrCat("--", Replace(name, '_', '-')));
}

bool FlagSet::IsSet(std::string_view name) const {
  const CLI::Option* option = Find(name);
  return option != nullptr && option->count() > 0;
}

absl::Status FlagSet::Parse(int argc, const char* const* argv) {
  std::vector<std::string> args;
  args.reserve(argc > 0 ? argc : 0);
  for (int i = 0; i < argc; ++i) args.emplace_back(argv[i]);
  return Parse(args);
}

absl::Status FlagSet::Parse(const std::vector<std::string>& given) {
  if (!registration_error_.empty()) return absl::InternalError(registration_error_);
  warnings_.clear();
  ASSIGN_OR_RETURN(const std::vector<std::string> args, RenameAliases(given));
  // CLI11 reads from the back. It reads `--name=` as `--name` with no value
  // and would take the next argument for it; pass the empty value instead.
  std::vector<std::string> reversed;
  reversed.reserve(args.size());
  for (auto arg = args.rbegin(); arg != args.rend(); ++arg) {
    const CLI::Option* option = nullptr;
    if (arg->size() > 3 && arg->back() == '=' && arg->compare(0, 2, "--") == 0 && arg->find('=') == arg->size() - 1) {
      option = Find(std::string_view(*arg).substr(2, arg->size() - 3));
    }
    if (option != nullptr && option->get_type_size() != 0) {
      reversed.emplace_back();
      reversed.push_back(arg->substr(0, arg->size() - 1));
    } else {
      reversed.push_back(*arg);
    }
  }
  try {
    app_->parse(reversed);
  } catch (const CLI::CallForHelp&) {
    return HelpRequested(subcommand_);
  } catch (const CLI::ParseError& error) {
    // CLI11 converts values after reading every argument: a --help read
    // before the error still asks for help.
    if (app_->get_help_ptr()->count() > 0) return HelpRequested(subcommand_);
    // A value that does not parse is the first thing to fix: with `--a --b 2`
    // (--a's value forgotten) CLI11 gives --a the value "--b" and leaves "2"
    // unclaimed, and the complaint about --a is the one that helps.
    if (dynamic_cast<const CLI::ValidationError*>(&error) != nullptr ||
        dynamic_cast<const CLI::ConversionError*>(&error) != nullptr) {
      return absl::InvalidArgumentError(error.what());
    }
    // Otherwise an unknown flag wins: CLI11 reads arguments in order, so it
    // came before an argument error, and a misspelt required flag is better
    // reported as the typo than as missing.
    if (!app_->remaining().empty()) return UnknownArgument(app_->remaining().front());
    if (dynamic_cast<const CLI::RequiredError*>(&error) != nullptr) return MissingRequired();
    return absl::InvalidArgumentError(error.what());
  }
  if (!app_->remaining().empty()) return UnknownArgument(app_->remaining().front());
  return absl::OkStatus();
}

absl::Status FlagSet::UnknownArgument(const std::string& arg) const {
  const std::string see = absl::StrCat(" (see 'tqkv ", subcommand_, " --help')");
  if (arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
    const std::string name = arg.substr(2, arg.find('=') == std::string::npos ? arg.npos : arg.find('=') - 2);
    std::string message = absl::StrCat("unknown flag --", name, " for 'tqkv ", subcommand_, "'");
    std::vector<std::string> candidates = names_;
    candidates.push_back("help");
    const std::string closest = ClosestMatch(Replace(name, '_', '-'), candidates);
    if (!closest.empty()) absl::StrAppend(&message, "; did you mean --", closest, "?");
    return absl::InvalidArgumentError(absl::StrCat(message, see));
  }
  if (arg.size() >= 2 && arg[0] == '-' && arg[1] != '-') {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag '", arg, "'; flags are spelled --name", see));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unexpected argument '", arg, "'; 'tqkv ", subcommand_, "' takes only --flags", see));
}

// CLI11 names the first missing flag; this names them all at once.
absl::Status FlagSet::MissingRequired() const {
  std::vector<std::string> missing;
  for (const CLI::Option* option : app_->get_options()) {
    if (option->get_required() && option->count() == 0) missing.push_back(option->get_name());
  }
  return absl::InvalidArgumentError(absl::StrCat("'tqkv ", subcommand_, "' requires ", absl::StrJoin(missing, ", "),
                                                 missing.size() == 1 ? " (missing)" : " (all missing)"));
}

std::string FlagSet::Usage() const { return app_->help(); }

bool IsHelpRequest(const absl::Status& status) {
  return status.code() == absl::StatusCode::kCancelled && status.GetPayload(kHelpPayloadUrl).has_value();
}

std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 3;  // suggest only close matches
  for (const std::string& candidate : candidates) {
    const size_t d = EditDistance(word, candidate);
    if (d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best;
}

}  // namespace tqkv
