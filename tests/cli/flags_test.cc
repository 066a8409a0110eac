#include "client/cli/flags.h"

#include <cstdint>
#include <string>
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
  absl::Status status = Parse(flags, {"--keys", "k.npy", "--head-dim=64", "--scale", "-0.5",
                                      "--verbose", "--preset=tq4", "--layers", "3, 5,7"});
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(f.keys, "k.npy");
  EXPECT_EQ(f.head_dim, 64);
  EXPECT_EQ(f.scale, -0.5);
  EXPECT_TRUE(f.verbose);
  EXPECT_EQ(f.preset, "tq4");
  EXPECT_THAT(f.layers, ElementsAre(3, 5, 7));
  EXPECT_TRUE(flags.IsSet("head-dim"));
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

TEST(FlagSet, AcceptsCharArgv) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  char a0[] = "--keys", a1[] = "x.npy", a2[] = "--head-dim", a3[] = "-3";
  char* argv[] = {a0, a1, a2, a3};
  ASSERT_TRUE(flags.Parse(4, argv).ok());
  EXPECT_EQ(f.keys, "x.npy");
  EXPECT_EQ(f.head_dim, -3);
  EXPECT_TRUE(flags.Parse(0, nullptr).code() == absl::StatusCode::kInvalidArgument);
}

TEST(FlagSet, LastValueWins) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  ASSERT_TRUE(Parse(flags, {"--keys=a", "--keys", "b", "--verbose", "--verbose=false"}).ok());
  EXPECT_EQ(f.keys, "b");
  EXPECT_FALSE(f.verbose);
}

TEST(FlagSet, ValueMayContainEqualsOrBeEmpty) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  ASSERT_TRUE(Parse(flags, {"--keys=a=b.npy", "--preset="}).ok());
  EXPECT_EQ(f.keys, "a=b.npy");
  EXPECT_EQ(f.preset, "");
}

TEST(FlagSet, RejectsBadIntegerWithPreciseMessage) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head-dim", "abc"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "--head-dim: expected an integer, got 'abc'");
  for (const char* bad : {"12x", "1.5", "", " 12", "+-3", "0x10"}) {
    status = Parse(flags, {"--keys=k", std::string("--head-dim=") + bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(Message(status), HasSubstr("expected an integer")) << bad;
  }
  status = Parse(flags, {"--keys=k", "--head-dim=99999999999999999999"});
  EXPECT_THAT(Message(status), HasSubstr("out of range"));
  ASSERT_TRUE(Parse(flags, {"--keys=k", "--head-dim=+7"}).ok());
  EXPECT_EQ(f.head_dim, 7);
}

TEST(FlagSet, RejectsBadNumbers) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  for (const char* bad : {"abc", "nan", "inf", "1e999", "1.0.0", "--1"}) {
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
  absl::Status status = Parse(flags, {"--keys=k", "--layers=1,two,3"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("--layers: "));
  EXPECT_THAT(Message(status), HasSubstr("item 'two' is not an integer"));
}

TEST(FlagSet, RejectsUnknownFlagAndSuggestsACloseOne) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head-dmi", "64"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("unknown flag --head-dmi for 'tqkv encode'"));
  EXPECT_THAT(Message(status), HasSubstr("did you mean --head-dim?"));
  status = Parse(flags, {"--keys=k", "--head_dmi", "64"});
  EXPECT_THAT(Message(status), HasSubstr("unknown flag --head_dmi for 'tqkv encode'"));
  EXPECT_THAT(Message(status), HasSubstr("did you mean --head-dim?"));
  status = Parse(flags, {"--keys=k", "--completely-different"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), Not(HasSubstr("did you mean")));
  status = Parse(flags, {"--keys=k", "-v"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("unknown flag '-v'"));
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

TEST(FlagSet, RejectsMissingValue) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--head-dim"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "--head-dim: missing value; use --head-dim <value>");
  status = Parse(flags, {"--keys", "--verbose"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("--keys: missing value"));
}

TEST(FlagSet, RejectsValueForSwitchUnlessBoolean) {
  FlagSet flags("encode");
  EncodeFlags f;
  f.Register(flags);
  absl::Status status = Parse(flags, {"--keys=k", "--verbose=yes"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(status), "--verbose: expected true or false, got 'yes'");
  // A switch never takes the next argument, so that becomes a stray one.
  status = Parse(flags, {"--keys=k", "--verbose", "true"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("unexpected argument 'true'"));
}

TEST(FlagSet, RejectsMissingRequiredFlags) {
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
  ASSERT_TRUE(Parse(flags, {"--keys=k"}).ok());
  EXPECT_EQ(Parse(flags, {}).code(), absl::StatusCode::kInvalidArgument);
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
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--help"}, {"-h"}, {"--bogus", "--help"}, {"--keys=k", "-h"}}) {
    absl::Status status = Parse(flags, args);
    EXPECT_TRUE(IsHelpRequest(status)) << status;
  }
  EXPECT_FALSE(IsHelpRequest(absl::OkStatus()));
  EXPECT_FALSE(IsHelpRequest(absl::CancelledError("help")));
  EXPECT_FALSE(IsHelpRequest(Parse(flags, {"--bogus"})));
}

TEST(FlagSet, UsageListsFlagsWithTypesDefaultsAndRequired) {
  FlagSet flags("encode", "Compresses a K/V tensor.");
  EncodeFlags f;
  f.Register(flags);
  bool fast = true;
  flags.AddBool("fast", &fast, "use the fast path");
  const std::string usage = flags.Usage();
  EXPECT_THAT(usage, HasSubstr("usage: tqkv encode [flags]"));
  EXPECT_THAT(usage, HasSubstr("Compresses a K/V tensor."));
  EXPECT_THAT(usage, HasSubstr("--keys <string>"));
  EXPECT_THAT(usage, HasSubstr("input .npy file (required)"));
  EXPECT_THAT(usage, HasSubstr("--head-dim <int>"));
  EXPECT_THAT(usage, HasSubstr("head dimension (default: 128)"));
  EXPECT_THAT(usage, HasSubstr("codec preset (default: \"tq3\")"));
  EXPECT_THAT(usage, HasSubstr("--scale <number>"));
  EXPECT_THAT(usage, HasSubstr("--layers <int,int,...>"));
  EXPECT_THAT(usage, HasSubstr("(default: 0,1)"));
  EXPECT_THAT(usage, HasSubstr("--verbose "));
  EXPECT_THAT(usage, HasSubstr("--fast=false to turn off"));
  EXPECT_THAT(usage, HasSubstr("--help"));
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

TEST(SplitCommaList, TrimsAndDropsEmptyItems) {
  EXPECT_THAT(SplitCommaList("a, b,,c "), ElementsAre("a", "b", "c"));
  EXPECT_THAT(SplitCommaList("single"), ElementsAre("single"));
  EXPECT_TRUE(SplitCommaList("").empty());
  EXPECT_TRUE(SplitCommaList(" , ,").empty());
  EXPECT_THAT(SplitCommaList(",x,"), ElementsAre("x"));
}

TEST(ParseIntList, ParsesSignedIntegers) {
  absl::StatusOr<std::vector<int64_t>> values = ParseIntList("1, -2,+3,9223372036854775807");
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(1, -2, 3, INT64_MAX));
  values = ParseIntList("");
  ASSERT_TRUE(values.ok());
  EXPECT_TRUE(values->empty());
}

TEST(ParseIntList, RejectsNonIntegersNamingTheItem) {
  absl::StatusOr<std::vector<int64_t>> values = ParseIntList("64,128,x");
  EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(values.status()),
            "expected a comma-separated list of integers, got '64,128,x': item 'x' is not an "
            "integer in [-2^63, 2^63)");
  EXPECT_FALSE(ParseIntList("1.5").ok());
  EXPECT_FALSE(ParseIntList("99999999999999999999").ok());
  EXPECT_FALSE(ParseIntList("1 2").ok());
}

}  // namespace
}  // namespace tqkv
