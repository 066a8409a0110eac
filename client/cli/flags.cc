#include "client/cli/flags.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace tqkv {
namespace {

// Marks the status Parse() returns for --help, so that IsHelpRequest() does
// not depend on the message text.
constexpr char kHelpPayloadUrl[] = "type.googleapis.com/tqkv.cli.HelpRequested";

// Debian's abseil has its own string_view type; convert at the boundary.
absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// Strict base-10 int64: an optional sign, digits, nothing else.
absl::StatusOr<int64_t> ParseInt(std::string_view text) {
  std::string_view body = text;
  if (!body.empty() && body.front() == '+') body.remove_prefix(1);
  const bool bad_sign = body.size() != text.size() && !body.empty() && body.front() == '-';
  int64_t value = 0;
  const char* end = body.data() + body.size();
  const auto [ptr, ec] = std::from_chars(body.data(), end, value);
  if (!body.empty() && !bad_sign && ptr == end && ec == std::errc::result_out_of_range) {
    return absl::InvalidArgumentError(absl::StrCat("expected an integer in [-2^63, 2^63), got '",
                                                   Absl(text), "' (out of range)"));
  }
  if (body.empty() || bad_sign || ptr != end || ec != std::errc()) {
    return absl::InvalidArgumentError(absl::StrCat("expected an integer, got '", Absl(text), "'"));
  }
  return value;
}

// A finite decimal or scientific number ("0.5", "-1e-3"); nan, inf and
// values that overflow a double are rejected.
absl::StatusOr<double> ParseDouble(std::string_view text) {
  std::string_view body = text;
  if (!body.empty() && body.front() == '+') body.remove_prefix(1);
  const bool bad_sign = body.size() != text.size() && !body.empty() && body.front() == '-';
  double value = 0;
  const char* end = body.data() + body.size();
  const auto [ptr, ec] = std::from_chars(body.data(), end, value);
  if (body.empty() || bad_sign || ptr != end || ec != std::errc() || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a finite number, got '", Absl(text), "'"));
  }
  return value;
}

absl::StatusOr<bool> ParseBool(std::string_view text) {
  if (text == "true" || text == "1") return true;
  if (text == "false" || text == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat("expected true or false, got '", Absl(text), "'"));
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

bool ValidName(std::string_view name) {
  if (name.empty() || name.front() == '-') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
  });
}

// "head_dim" -> "head-dim": snake_case spellings name the same flags.
std::string Kebab(std::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

}  // namespace

FlagSet::FlagSet(std::string subcommand, std::string description)
    : subcommand_(std::move(subcommand)), description_(std::move(description)) {}

void FlagSet::Add(std::string name, Type type, void* target, std::string help, bool required) {
  std::string problem;
  if (!ValidName(name)) {
    problem = "is not a valid flag name; want [a-z0-9-]+ without leading dashes";
  } else if (name == "help") {
    problem = "is reserved";
  } else if (Find(name) != nullptr) {
    problem = "is registered twice";
  } else if (target == nullptr) {
    problem = "has a null target";
  }
  if (!problem.empty()) {
    if (registration_error_.empty()) {
      registration_error_ = absl::StrCat("flag '", name, "' of 'tqkv ", subcommand_, "' ", problem);
    }
    return;
  }
  Flag flag{std::move(name), type, target, std::move(help), "", required, false};
  switch (type) {
    case Type::kString:
      flag.default_text = absl::StrCat("\"", *static_cast<std::string*>(target), "\"");
      break;
    case Type::kInt:
      flag.default_text = absl::StrCat(*static_cast<int64_t*>(target));
      break;
    case Type::kDouble:
      flag.default_text = absl::StrCat(*static_cast<double*>(target));
      break;
    case Type::kIntList:
      flag.default_text = absl::StrJoin(*static_cast<std::vector<int64_t>*>(target), ",");
      if (flag.default_text.empty()) flag.default_text = "none";
      break;
    case Type::kBool:
      flag.default_text = *static_cast<bool*>(target) ? "true" : "false";
      break;
  }
  flags_.push_back(std::move(flag));
}

void FlagSet::AddString(std::string name, std::string* target, std::string help) {
  Add(std::move(name), Type::kString, target, std::move(help), /*required=*/false);
}
void FlagSet::AddInt(std::string name, int64_t* target, std::string help) {
  Add(std::move(name), Type::kInt, target, std::move(help), /*required=*/false);
}
void FlagSet::AddDouble(std::string name, double* target, std::string help) {
  Add(std::move(name), Type::kDouble, target, std::move(help), /*required=*/false);
}
void FlagSet::AddIntList(std::string name, std::vector<int64_t>* target, std::string help) {
  Add(std::move(name), Type::kIntList, target, std::move(help), /*required=*/false);
}
void FlagSet::AddBool(std::string name, bool* target, std::string help) {
  Add(std::move(name), Type::kBool, target, std::move(help), /*required=*/false);
}
void FlagSet::AddRequiredString(std::string name, std::string* target, std::string help) {
  Add(std::move(name), Type::kString, target, std::move(help), /*required=*/true);
}
void FlagSet::AddRequiredInt(std::string name, int64_t* target, std::string help) {
  Add(std::move(name), Type::kInt, target, std::move(help), /*required=*/true);
}

FlagSet::Flag* FlagSet::Find(std::string_view name) {
  const std::string kebab = Kebab(name);
  for (Flag& flag : flags_) {
    if (flag.name == kebab) return &flag;
  }
  return nullptr;
}

bool FlagSet::IsSet(std::string_view name) const {
  const std::string kebab = Kebab(name);
  for (const Flag& flag : flags_) {
    if (flag.name == kebab) return flag.set;
  }
  return false;
}

absl::Status FlagSet::SetValue(Flag& flag, std::string_view value) {
  absl::Status status;
  switch (flag.type) {
    case Type::kString:
      *static_cast<std::string*>(flag.target) = std::string(value);
      break;
    case Type::kInt: {
      absl::StatusOr<int64_t> parsed = ParseInt(value);
      if (parsed.ok()) *static_cast<int64_t*>(flag.target) = *parsed;
      status = parsed.status();
      break;
    }
    case Type::kDouble: {
      absl::StatusOr<double> parsed = ParseDouble(value);
      if (parsed.ok()) *static_cast<double*>(flag.target) = *parsed;
      status = parsed.status();
      break;
    }
    case Type::kIntList: {
      absl::StatusOr<std::vector<int64_t>> parsed = ParseIntList(value);
      if (parsed.ok()) *static_cast<std::vector<int64_t>*>(flag.target) = *std::move(parsed);
      status = parsed.status();
      break;
    }
    case Type::kBool: {
      absl::StatusOr<bool> parsed = ParseBool(value);
      if (parsed.ok()) *static_cast<bool*>(flag.target) = *parsed;
      status = parsed.status();
      break;
    }
  }
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag.name, ": ", status.message()));
  }
  flag.set = true;
  return absl::OkStatus();
}

absl::Status FlagSet::Parse(int argc, const char* const* argv) {
  std::vector<std::string> args;
  args.reserve(argc > 0 ? argc : 0);
  for (int i = 0; i < argc; ++i) args.emplace_back(argv[i]);
  return Parse(args);
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  if (!registration_error_.empty()) return absl::InternalError(registration_error_);
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      absl::Status help =
          absl::CancelledError(absl::StrCat("help requested for 'tqkv ", subcommand_, "'"));
      help.SetPayload(kHelpPayloadUrl, absl::Cord("1"));
      return help;
    }
  }
  for (Flag& flag : flags_) flag.set = false;

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    if (arg.size() < 3 || arg.substr(0, 2) != "--") {
      if (arg.size() >= 2 && arg[0] == '-' && arg[1] != '-') {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag '", Absl(arg),
                                                       "'; flags are spelled --name (see 'tqkv ",
                                                       subcommand_, " --help')"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", Absl(arg), "'; 'tqkv ", subcommand_,
                       "' takes only --flags (see 'tqkv ", subcommand_, " --help')"));
    }
    const size_t eq = arg.find('=');
    const std::string_view name = arg.substr(2, eq == std::string_view::npos ? arg.npos : eq - 2);
    Flag* flag = Find(name);
    if (flag == nullptr) {
      std::string message =
          absl::StrCat("unknown flag --", Absl(name), " for 'tqkv ", subcommand_, "'");
      const Flag* best = nullptr;
      size_t best_distance = 3;  // suggest only close matches
      for (const Flag& candidate : flags_) {
        const size_t d = EditDistance(Kebab(name), candidate.name);
        if (d < best_distance) {
          best = &candidate;
          best_distance = d;
        }
      }
      if (best != nullptr) absl::StrAppend(&message, "; did you mean --", best->name, "?");
      absl::StrAppend(&message, " (see 'tqkv ", subcommand_, " --help')");
      return absl::InvalidArgumentError(message);
    }
    if (eq != std::string_view::npos) {
      absl::Status status = SetValue(*flag, arg.substr(eq + 1));
      if (!status.ok()) return status;
      continue;
    }
    if (flag->type == Type::kBool) {
      *static_cast<bool*>(flag->target) = true;
      flag->set = true;
      continue;
    }
    // The next argument is the value, unless there is none or it is itself a
    // --flag (a negative number such as -3 is a value).
    if (i + 1 >= args.size() || (args[i + 1].size() >= 2 && args[i + 1].compare(0, 2, "--") == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag->name, ": missing value; use --", flag->name, " <value>"));
    }
    absl::Status status = SetValue(*flag, args[++i]);
    if (!status.ok()) return status;
  }

  std::vector<std::string> missing;
  for (const Flag& flag : flags_) {
    if (flag.required && !flag.set) missing.push_back(absl::StrCat("--", flag.name));
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'tqkv ", subcommand_, "' requires ", absl::StrJoin(missing, ", "),
                     missing.size() == 1 ? " (missing)" : " (all missing)"));
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("usage: tqkv ", subcommand_, " [flags]\n");
  if (!description_.empty()) absl::StrAppend(&out, "\n", description_, "\n");
  absl::StrAppend(&out, "\nflags:\n");

  std::vector<std::pair<std::string, std::string>> rows;
  for (const Flag& flag : flags_) {
    const char* value = "";
    switch (flag.type) {
      case Type::kString:
        value = " <string>";
        break;
      case Type::kInt:
        value = " <int>";
        break;
      case Type::kDouble:
        value = " <number>";
        break;
      case Type::kIntList:
        value = " <int,int,...>";
        break;
      case Type::kBool:
        value = "";
        break;
    }
    std::string detail = flag.help;
    if (flag.required) {
      absl::StrAppend(&detail, " (required)");
    } else if (flag.type == Type::kBool && flag.default_text == "true") {
      absl::StrAppend(&detail, " (default: true; --", flag.name, "=false to turn off)");
    } else if (flag.type != Type::kBool) {
      absl::StrAppend(&detail, " (default: ", flag.default_text, ")");
    }
    rows.emplace_back(absl::StrCat("--", flag.name, value), std::move(detail));
  }
  rows.emplace_back("--help", "show this help");

  size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  for (const auto& [left, right] : rows) {
    absl::StrAppend(&out, "  ", left, std::string(width - left.size() + 2, ' '), right, "\n");
  }
  return out;
}

bool IsHelpRequest(const absl::Status& status) {
  return status.code() == absl::StatusCode::kCancelled &&
         status.GetPayload(kHelpPayloadUrl).has_value();
}

std::vector<std::string> SplitCommaList(std::string_view text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = Trim(text.substr(start, end - start));
    if (!item.empty()) items.emplace_back(item);
    start = end + 1;
  }
  return items;
}

absl::StatusOr<std::vector<int64_t>> ParseIntList(std::string_view text) {
  std::vector<int64_t> values;
  for (const std::string& item : SplitCommaList(text)) {
    absl::StatusOr<int64_t> value = ParseInt(item);
    if (!value.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected a comma-separated list of integers, got '", Absl(text),
                       "': item '", item, "' is not an integer in [-2^63, 2^63)"));
    }
    values.push_back(*value);
  }
  return values;
}

}  // namespace tqkv
