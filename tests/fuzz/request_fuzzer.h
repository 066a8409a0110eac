// The request fuzz target's entry point (request_fuzzer.cc) and its method
// selectors: an input's first byte modulo kMethods picks the rpc.
#ifndef TQKV_TESTS_FUZZ_REQUEST_FUZZER_H_
#define TQKV_TESTS_FUZZ_REQUEST_FUZZER_H_

#include <cstddef>
#include <cstdint>

namespace tqkv {
namespace fuzz {

enum Method : uint8_t {
  kAppend,
  kScoreQuery,
  kAttend,
  kAppendAttend,
  kCreateSequence,
  kForkSequence,
  kDropSequence,
  kGetSequence,
  kMethods,
};

// The server config (text-format tqkv.v1.ServerConfig) of the caches the
// target runs against; the seed corpus is made for them, and the gRPC-level
// fuzz test starts a server with it.
const char* HarnessConfig();

// Runs one input; never fails (a crash, a sanitizer report or a hang is the
// finding). Returns 0.
int RunOneInput(const uint8_t* data, size_t size);

}  // namespace fuzz
}  // namespace tqkv

#endif  // TQKV_TESTS_FUZZ_REQUEST_FUZZER_H_
