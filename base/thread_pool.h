// A small fixed-size thread pool for the CPU backend's kernels. ParallelFor
// splits [0, n) into tasks; the calling thread works too, so a pool of
// `threads` workers uses threads + 1 cores at most while a call runs. Calls
// from several caller threads share the workers. No allocation per task; one
// small job record per call.
#ifndef TQKV_BASE_THREAD_POOL_H_
#define TQKV_BASE_THREAD_POOL_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace tqkv {

class ThreadPool {
 public:
  // `workers` extra threads (0: every call runs on its caller).
  explicit ThreadPool(int workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs body(i) for every i in [0, n), in any order and on any thread, and
  // returns when all are done. body must not throw.
  void ParallelFor(int n, const std::function<void(int)>& body);

  int workers() const { return static_cast<int>(threads_.size()); }

 private:
  struct Job {
    const std::function<void(int)>* body;
    int n;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
  };
  // Claims and runs tasks of `job` until none are left.
  static void Drain(Job& job);
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace tqkv

#endif  // TQKV_BASE_THREAD_POOL_H_
