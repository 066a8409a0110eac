// The transport floor of a decode step: what one round trip of the decode
// loop's message sizes costs through gRPC alone, with no protobuf, no cache
// and no kernel. A loopback echo server in a child process answers each
// message with the size it asks for, after handing it to a worker thread as
// tqkv-server hands work to its executor. `tqkv load` figures are read
// against it: the time a decode step spends outside the kernels cannot go
// below this.
#ifndef TQKV_CLIENT_CLI_TRANSPORT_FLOOR_H_
#define TQKV_CLIENT_CLI_TRANSPORT_FLOOR_H_

#include <cstdint>

#include <memory>

#include "absl/status/statusor.h"

namespace tqkv {
namespace cli {

struct TransportFloorOptions {
  int64_t request_bytes = 0;
  int64_t response_bytes = 0;
  int64_t messages = 2000;  // round trips timed, after 50 of warm-up
  bool unary = false;       // a call per message instead of one bidi stream
};

struct TransportFloor {
  double p50_us = 0;
  double p90_us = 0;
  double p99_us = 0;
};

// The echo server, in a process forked from this one; stopped (and reaped)
// on destruction.
class EchoServerProcess {
 public:
  // REQUIRES: gRPC not yet used in this process (it is not fork-safe).
  // UNAVAILABLE when the fork fails or the child cannot bind a loopback port.
  static absl::StatusOr<std::unique_ptr<EchoServerProcess>> Start();
  ~EchoServerProcess();
  int port() const { return port_; }

 private:
  EchoServerProcess(int pid, int port, int stop_fd) : pid_(pid), port_(port), stop_fd_(stop_fd) {}
  int pid_, port_, stop_fd_;
};

// Round trips to the echo server at 127.0.0.1:`port`. INVALID_ARGUMENT for
// sizes outside [8, 256 MiB] (the request carries the response size) or
// fewer than 10 messages; UNAVAILABLE when a call fails.
absl::StatusOr<TransportFloor> MeasureTransportFloor(int port, const TransportFloorOptions& options);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_TRANSPORT_FLOOR_H_
