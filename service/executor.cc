#include "service/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"

namespace tqkv {
namespace service {

CallExecutor::CallExecutor(const ExecutorOptions& options)
    : max_pending_(std::max(1, options.max_pending)), max_pending_bytes_(options.max_pending_bytes) {
  int threads = options.threads;
  if (threads <= 0) {
    threads = std::max(4, 2 * static_cast<int>(std::thread::hardware_concurrency()));
  }
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

CallExecutor::~CallExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

absl::Status CallExecutor::Submit(size_t request_bytes, absl::AnyInvocable<void() &&> work) {
  absl::MutexLock lock(&mu_);
  const int pending = running_ + static_cast<int>(queue_.size());
  if (pending >= max_pending_) {
    ++rejected_;
    return absl::ResourceExhaustedError(
        absl::StrFormat("the server has %d calls pending (its --max_pending_calls); retry later", pending));
  }
  if (pending > 0 && pending_bytes_ + request_bytes > max_pending_bytes_) {
    ++rejected_;
    return absl::ResourceExhaustedError(
        absl::StrFormat("the server's pending calls hold %d request bytes and this one %d, over its "
                        "--max_pending_bytes %d; retry later",
                        pending_bytes_, request_bytes, max_pending_bytes_));
  }
  pending_bytes_ += request_bytes;
  queue_.push_back(Task{request_bytes, std::move(work)});
  return absl::OkStatus();
}

void CallExecutor::WorkerLoop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CallExecutor* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) { return e->stopping_ || !e->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    std::move(task.work)();
    absl::MutexLock lock(&mu_);
    --running_;
    pending_bytes_ -= task.bytes;
    ++completed_;
  }
}

CallExecutor::Stats CallExecutor::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.threads = static_cast<int>(threads_.size());
  s.running = running_;
  s.queued = static_cast<int>(queue_.size());
  s.pending_bytes = pending_bytes_;
  s.max_pending = max_pending_;
  s.max_pending_bytes = max_pending_bytes_;
  s.completed = completed_;
  s.rejected = rejected_;
  return s;
}

}  // namespace service
}  // namespace tqkv
