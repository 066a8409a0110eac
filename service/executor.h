// CallExecutor: the worker threads the service runs cache and kernel work on,
// off gRPC's callback threads, with a bounded number of pending calls.
//
// A handler checks auth, submits the call's work and returns; the work
// finishes the call's reactor when it completes. So a slow kernel, or an
// append waiting for another append to the same sequence, holds one executor
// thread and never a gRPC thread: unrelated calls keep being accepted and
// run on the other threads.
//
// Bounds. At most `max_pending` calls are pending (queued or running) and
// their requests hold at most `max_pending_bytes` bytes; a call beyond either
// bound is refused at once with RESOURCE_EXHAUSTED (it never waits in an
// unbounded queue). One call larger than max_pending_bytes is still admitted
// when nothing else is pending, so that the bound never refuses a request the
// server's max message size allows.
//
// Thread safety: all methods are thread-safe. The destructor runs the calls
// still queued, then joins the threads.
#ifndef TQKV_SERVICE_EXECUTOR_H_
#define TQKV_SERVICE_EXECUTOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace tqkv {
namespace service {

struct ExecutorOptions {
  // Worker threads; 0 means 2 x the hardware concurrency (at least 4): more
  // than the cores, so that calls blocked on a sequence's append lock do not
  // idle the CPU.
  int threads = 0;
  // Calls queued or running at once.
  int max_pending = 1024;
  // Request bytes of those calls.
  size_t max_pending_bytes = size_t{1} << 30;
};

class CallExecutor {
 public:
  // threads <= 0 takes the default; max_pending below 1 counts as 1.
  explicit CallExecutor(const ExecutorOptions& options);
  ~CallExecutor();

  CallExecutor(const CallExecutor&) = delete;
  CallExecutor& operator=(const CallExecutor&) = delete;

  // Queues `work`, charged `request_bytes` until it returns. OK: `work` will
  // run exactly once on an executor thread. RESOURCE_EXHAUSTED, naming the
  // bound: `work` is dropped unrun.
  absl::Status Submit(size_t request_bytes, absl::AnyInvocable<void() &&> work);

  struct Stats {
    int threads = 0;
    int running = 0;
    int queued = 0;
    size_t pending_bytes = 0;
    int max_pending = 0;
    size_t max_pending_bytes = 0;
    uint64_t completed = 0;  // calls run, ever
    uint64_t rejected = 0;   // calls refused, ever
  };
  Stats GetStats() const;

 private:
  struct Task {
    size_t bytes = 0;
    absl::AnyInvocable<void() &&> work;
  };
  void WorkerLoop();

  const int max_pending_;
  const size_t max_pending_bytes_;
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace service
}  // namespace tqkv

#endif  // TQKV_SERVICE_EXECUTOR_H_
