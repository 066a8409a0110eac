// The CLI's flag layer over CLI11 (client/cli/flags.h): the syntax every
// subcommand accepts, its errors, and its help.
#include "client/cli/flags.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// The flags of an imaginary subcommand, with their defaults.
struct EncodeFlags {
  std::string keys;
  std::string preset = "tq3";
  int64_t head_dim = 128;
  double scale = 1.0;
  bool verbose = false;
  std::vector<int64_t> layers = {0, 1};

  void Register(FlagSet& flags) {
    flags.AddRequiredString("keys", &keys, "input .npy file");
    flags.AddString("preset", &preset, "codec preset");
    flags.AddInt("head-dim", &head_dim, "head dimension");
    flags.AddDouble("scale", &scale, "logit scale");
    flags.AddBool("verbose", &verbose, "print more");
    flags.AddIntList("layers", &layers, "layers to compress");
  }
};

absl::Status Parse(FlagSet& flags, std::vector<std::string> args) { return flags.Parse(args); }

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST(FlagSet, ParsesSpaceAndEqualsForms) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys", "k.npy", "--head-dim=64", "--scale", "-0.5", "--verbose",
                                      "--preset=tq4", "--layers", "3, 5,7"});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(f.keys, "k.npy");
  EXPECT_EQ(f.head_dim, 64);
  EXPECT_EQ(f.scale, -0.5);
  EXPECT_TRUE(f.verbose);
  EXPECT_EQ(f.preset, "tq4");
  EXPECT_THAT(f.layers, ElementsAre(3, 5, 7));
  EXPECT_TRUE(flags.IsSet("head-dim"));
  EXPECT_TRUE(flags.IsSet("layers"));
}

TEST(FlagSet, LeavesDefaultsWhenFlagsAreAbsent) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  ASSERT_TRUE(Parse(flags, {"--keys=k.npy"}).ok());
  EXPECT_EQ(f.preset, "tq3");
  EXPECT_EQ(f.head_dim, 128);
  EXPECT_EQ(f.scale, 1.0);
  EXPECT_FALSE(f.verbose);
  EXPECT_THAT(f.layers, ElementsAre(0, 1));
  EXPECT_FALSE(flags.IsSet("head-dim"));
  EXPECT_FALSE(flags.IsSet("no-such-flag"));
}

TEST(FlagSet, AcceptsCharArgvAndNegativeValues) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  char a0[] = "--keys", a1[] = "x.npy", a2[] = "--head-dim", a3[] = "-3", a4[] = "--layers", a5[] = "-1,2";
  char* argv[] = {a0, a1, a2, a3, a4, a5};
  absl::Status status = flags.Parse(6, argv);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(f.keys, "x.npy");
  EXPECT_EQ(f.head_dim, -3);
  EXPECT_THAT(f.layers, ElementsAre(-1, 2));
  EXPECT_EQ(flags.Parse(0, nullptr).code(), absl::StatusCode::kInvalidArgument);  // --keys
}

TEST(FlagSet, LastValueWins) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  ASSERT_TRUE(
      Parse(flags, {"--keys=a", "--keys", "b", "--verbose", "--verbose=false", "--layers=4", "--layers", "5,6"}).ok());
  EXPECT_EQ(f.keys, "b");
  EXPECT_FALSE(f.verbose);
  EXPECT_THAT(f.layers, ElementsAre(5, 6));  // replaced, not appended
}

TEST(FlagSet, SwitchTakesExplicitBooleans) {
  FlagSet flags("encode");
  EncodeFlags f;
  bool fast = true;
  f.Register(flags);
  flags.AddBool("fast", &fast, "use the fast path");
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--verbose=1", "--fast=0"}).ok());
  EXPECT_TRUE(f.verbose);
  EXPECT_FALSE(fast);
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--verbose=false", "--fast=true"}).ok());
  EXPECT_FALSE(f.verbose);
  EXPECT_TRUE(fast);
}

TEST(FlagSet, ValueMayContainEqualsOrBeEmpty) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  ASSERT_TRUE(Parse(flags, {"--keys=a=b.npy", "--preset="}).ok());
  EXPECT_EQ(f.keys, "a=b.npy");
  EXPECT_EQ(f.preset, "");
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--layers="}).ok());
  EXPECT_TRUE(f.layers.empty());
}

TEST(FlagSet, RejectsBadIntegerWithPreciseMessage) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head-dim", "abc"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "--head-dim: expected an integer, got 'abc'");
  // Base 10 only: CLI11's own conversion would take hex and read 010 as 8.
  for (const char* bad : {"12x", "1.5", "", " 12", "+-3", "0x10", "1e3"}) {
    status = Parse(flags, {"--keys=k", std::string("--head-dim=") + bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(Message(status), HasSubstr("expected an integer")) << bad;
  }
  status = Parse(flags, {"--keys=k", "--head-dim=99999999999999999999"});
  EXPECT_THAT(Message(status), HasSubstr("out of range"));
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--head-dim=+7"}).ok());
  EXPECT_EQ(f.head_dim, 7);
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--head-dim=010"}).ok());
  EXPECT_EQ(f.head_dim, 10);
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--head-dim=-9223372036854775808"}).ok());
  EXPECT_EQ(f.head_dim, INT64_MIN);
}

TEST(FlagSet, RejectsBadNumbers) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  for (const char* bad : {"abc", "nan", "inf", "1e999", "1.0.0", "0x1p3"}) {
    absl::Status status = Parse(flags, {"--keys=k", std::string("--scale=") + bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(Message(status), std::string("--scale: expected a finite number, got '") + bad + "'");
  }
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--scale=2.5e-3"}).ok());
  EXPECT_EQ(f.scale, 2.5e-3);
}

TEST(FlagSet, RejectsBadIntList) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  for (const char* bad : {"1,two,3", "1.5", "1 2", "99999999999999999999"}) {
    absl::Status status = Parse(flags, {"--keys=k", std::string("--layers=") + bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(Message(status), HasSubstr("--layers: expected a comma-separated list of integers")) << bad;
  }
  EXPECT_THAT(Message(Parse(flags, {"--keys=k", "--layers=1,two,3"})), HasSubstr("item 'two' is not an integer"));
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--layers", ",9, ,-2,"}).ok());
  EXPECT_THAT(f.layers, ElementsAre(9, -2));
}

TEST(FlagSet, RejectsUnknownFlagAndSuggestsACloseOne) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head-dmi", "64"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("unknown flag --head-dmi for 'tqkv encode'"));
  EXPECT_THAT(Message(status), HasSubstr("did you mean --head-dim?"));
  EXPECT_THAT(Message(status), HasSubstr("(see 'tqkv encode --help')"));
  status = Parse(flags, {"--keys=k", "--head_dmi=64"});
  EXPECT_THAT(Message(status), HasSubstr("unknown flag --head_dmi for 'tqkv encode'"));
  EXPECT_THAT(Message(status), HasSubstr("did you mean --head-dim?"));
  status = Parse(flags, {"--keys=k", "--completely-different"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), Not(HasSubstr("did you mean")));
  status = Parse(flags, {"--keys=k", "-v"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("unknown flag '-v'"));
}

TEST(FlagSet, UnknownFlagIsReportedBeforeTheRequiredFlagItMisspells) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--kyes", "k.npy"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("did you mean --keys?"));
}

TEST(FlagSet, SnakeCaseSpellingNamesTheSameFlag) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head_dim", "64"});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(f.head_dim, 64);
  EXPECT_TRUE(flags.IsSet("head-dim"));
  EXPECT_TRUE(flags.IsSet("head_dim"));
  status = Parse(flags, {"--keys=k", "--head_dim=32", "--head-dim", "16"});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(f.head_dim, 16);  // one flag: the last value wins
}

// A renamed flag keeps its old spelling as a deprecated alias (tqkv calibrate
// and bench attend: --window is now --recent): it sets the new flag, in every
// form, and says so; together with the new name it is an error.
TEST(FlagSet, ADeprecatedAliasSetsItsFlagAndWarns) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--keys", "k", "--window", "64"}, {"--keys", "k", "--window=64"}, {"--window_old=64", "--keys", "k"}}) {
    FlagSet flags("calibrate");
    EncodeFlags f;
    f.Register(flags);
    int64_t recent = 0;
    flags.AddInt("recent", &recent, "exact recent tokens");
    flags.AddDeprecatedAlias("window", "recent");
    flags.AddDeprecatedAlias("window-old", "recent");
    const absl::Status status = Parse(flags, args);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(recent, 64);
    EXPECT_TRUE(flags.IsSet("recent"));
    ASSERT_EQ(flags.Warnings().size(), 1u);
    EXPECT_THAT(flags.Warnings()[0], HasSubstr("is deprecated; use --recent"));
    EXPECT_THAT(flags.Usage(), HasSubstr("--window is a deprecated spelling of --recent"));
    // The warnings are the last Parse()'s.
    ASSERT_TRUE(Parse(flags, {"--keys", "k", "--recent", "8"}).ok());
    EXPECT_EQ(recent, 8);
    EXPECT_TRUE(flags.Warnings().empty());
    const absl::Status both = Parse(flags, {"--keys", "k", "--recent", "8", "--window", "9"});
    EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument) << both;
    EXPECT_THAT(Message(both), HasSubstr("give only --recent"));
  }
  FlagSet flags("calibrate");
  EncodeFlags f;
  f.Register(flags);
  flags.AddDeprecatedAlias("head-dimension", "no-such-flag");
  EXPECT_EQ(Parse(flags, {"--keys", "k"}).code(), absl::StatusCode::kInternal);
}

TEST(FlagSet, RejectsMissingValue) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head-dim"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("--head-dim"));
  EXPECT_THAT(Message(status), HasSubstr("missing"));
  // The next flag is not taken for the value.
  for (const char* next : {"--verbose", "--head-dim=3"}) {
    status = Parse(flags, {"--keys", next});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << next;
    EXPECT_THAT(Message(status), HasSubstr("--keys: missing value")) << next;
  }
  status = Parse(flags, {"--keys=k", "--preset", "--verbose"});
  EXPECT_THAT(Message(status), HasSubstr("--preset: missing value"));
  status = Parse(flags, {"--keys=k", "--head-dim", "--verbose"});
  EXPECT_THAT(Message(status), HasSubstr("--head-dim: missing value"));
  // --preset takes "--scale" (refused), which leaves "2" unclaimed: the
  // forgotten value is what is reported.
  status = Parse(flags, {"--keys=k", "--preset", "--scale", "2"});
  EXPECT_THAT(Message(status), HasSubstr("--preset: missing value ('--scale' is a flag)"));
}

TEST(FlagSet, RejectsValueForSwitchUnlessBoolean) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  for (const char* bad : {"yes", "maybe", "2"}) {
    absl::Status status = Parse(flags, {"--keys=k", std::string("--verbose=") + bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(Message(status), HasSubstr("expected true or false")) << bad;
  }
  // A switch never takes the next argument, so that becomes a stray one.
  absl::Status status = Parse(flags, {"--keys=k", "--verbose", "true"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("unexpected argument 'true'"));
}

TEST(FlagSet, RejectsMissingRequiredFlagsNamingThemAll) {
  FlagSet flags("encode");
  std::string keys, values;
  int64_t tokens = 0;
  flags.AddRequiredString("keys", &keys, "");
  flags.AddRequiredString("values", &values, "");
  flags.AddRequiredInt("tokens", &tokens, "");
  absl::Status status = Parse(flags, {"--values", "v.npy"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "'tqkv encode' requires --keys, --tokens (all missing)");
  status = Parse(flags, {"--values", "v.npy", "--tokens=3"});
  EXPECT_EQ(Message(status), "'tqkv encode' requires --keys (missing)");
  EXPECT_TRUE(Parse(flags, {"--values", "v", "--tokens=3", "--keys=k"}).ok());
}

TEST(FlagSet, RequiredFlagIsCheckedAgainOnEachParse) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--verbose"}).ok());
  EXPECT_TRUE(flags.IsSet("verbose"));
  EXPECT_EQ(Parse(flags, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(flags.IsSet("verbose"));
}

TEST(FlagSet, RejectsPositionalArguments) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  for (const char* stray : {"extra.npy", "-", "--"}) {
    absl::Status status = Parse(flags, {"--keys=k", stray});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << stray;
    EXPECT_THAT(Message(status), HasSubstr(std::string("unexpected argument '") + stray + "'"));
  }
}

TEST(FlagSet, HelpIsRecognisableAndWinsOverErrors) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--help"},
                                               {"-h"},
                                               {"--bogus", "--help"},
                                               {"--keys=k", "-h"},
                                               {"--head-dim=abc", "--help"}}) {
    absl::Status status = Parse(flags, args);
    EXPECT_TRUE(IsHelpRequest(status)) << status;
  }
  EXPECT_FALSE(IsHelpRequest(absl::OkStatus()));
  EXPECT_FALSE(IsHelpRequest(absl::CancelledError("help")));
  EXPECT_FALSE(IsHelpRequest(Parse(flags, {"--bogus"})));
}

// The help line of `flag` in `usage` ("" when there is none).
std::string LineOf(const std::string& usage, const std::string& flag) {
  size_t at = usage.find("  " + flag + " ");
  if (at == std::string::npos) return "";
  return usage.substr(at, usage.find('\n', at) - at);
}

TEST(FlagSet, UsageListsFlagsWithTypesDefaultsAndRequired) {
  FlagSet flags("encode", "Compresses a K/V tensor.");
  EncodeFlags f;
  f.Register(flags);
  bool fast = true;
  flags.AddBool("fast", &fast, "use the fast path");
  const std::string usage = flags.Usage();
  EXPECT_THAT(usage, HasSubstr("Usage: tqkv encode [OPTIONS]"));
  EXPECT_THAT(usage, HasSubstr("Compresses a K/V tensor."));
  EXPECT_THAT(LineOf(usage, "--keys"), HasSubstr("--keys TEXT REQUIRED"));
  EXPECT_THAT(LineOf(usage, "--keys"), HasSubstr("input .npy file"));
  // CLI11 2.1 (Debian 12) writes a default as INT=128, 2.4 (Ubuntu 24.04) as INT [128].
  for (const auto& [flag, type, fallback, help] :
       std::vector<std::tuple<std::string, std::string, std::string, std::string>>{
           {"--head-dim", "INT", "128", "head dimension"},
           {"--preset", "TEXT", "tq3", "codec preset"},
           {"--scale", "FLOAT", "1", "logit scale"},
           {"--layers", "INT,...", "0,1", "layers to compress"}}) {
    const std::string line = LineOf(usage, flag);
    EXPECT_THAT(line, HasSubstr(flag + " " + type)) << usage;
    EXPECT_THAT(line, ::testing::AnyOf(HasSubstr("=" + fallback + " "), HasSubstr("[" + fallback + "]"))) << usage;
    EXPECT_THAT(line, HasSubstr(help)) << usage;
  }
  EXPECT_THAT(usage, HasSubstr("--verbose "));
  EXPECT_THAT(usage, HasSubstr("use the fast path (on by default; --fast=false turns it off)"));
  EXPECT_THAT(usage, HasSubstr("-h,--help"));
  // One spelling per flag; the footer names the other.
  EXPECT_THAT(usage, Not(HasSubstr("--head_dim INT")));
  EXPECT_THAT(usage, HasSubstr("snake_case spelling (--head_dim is --head-dim)"));
  // Flags appear in registration order.
  EXPECT_LT(usage.find("--keys"), usage.find("--preset"));
  EXPECT_LT(usage.find("--preset"), usage.find("--head-dim"));
}

TEST(FlagSet, RegistrationMistakesAreInternalErrors) {
  std::string a, b;
  {
    FlagSet flags("encode");
    flags.AddString("out", &a, "");
    flags.AddString("out", &b, "");
    absl::Status status = Parse(flags, {});
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(Message(status), HasSubstr("'out'"));
    EXPECT_THAT(Message(status), HasSubstr("registered twice"));
  }
  {
    FlagSet flags("encode");
    flags.AddString("--out", &a, "");
    EXPECT_EQ(Parse(flags, {}).code(), absl::StatusCode::kInternal);
  }
  {
    FlagSet flags("encode");
    flags.AddString("head_dim", &a, "");  // registered kebab-case only
    EXPECT_EQ(Parse(flags, {}).code(), absl::StatusCode::kInternal);
  }
  {
    FlagSet flags("encode");
    flags.AddString("help", &a, "");
    EXPECT_EQ(Parse(flags, {}).code(), absl::StatusCode::kInternal);
  }
  {
    FlagSet flags("encode");
    flags.AddInt("n", nullptr, "");
    EXPECT_EQ(Parse(flags, {}).code(), absl::StatusCode::kInternal);
  }
}

TEST(ClosestMatch, SuggestsOnlyCloseCandidates) {
  const std::vector<std::string> commands = {"attend", "append", "info", "distortion"};
  EXPECT_EQ(ClosestMatch("atend", commands), "attend");
  EXPECT_EQ(ClosestMatch("inof", commands), "info");
  EXPECT_EQ(ClosestMatch("frobnicate", commands), "");
  EXPECT_EQ(ClosestMatch("x", {}), "");
}

}  // namespace
}  // namespace tqkv
