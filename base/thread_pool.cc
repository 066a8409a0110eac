#include "base/thread_pool.h"

namespace tqkv {

ThreadPool::ThreadPool(int workers) {
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void ThreadPool::Drain(Job& job) {
  for (int i = job.next.fetch_add(1); i < job.n; i = job.next.fetch_add(1)) {
    (*job.body)(i);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::ParallelFor(int n, const std::function<void(int)>& body) {
  if (n <= 0) return;
  if (n == 1 || threads_.empty()) {
    for (int i = 0; i < n; ++i) body(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->body = &body;
  job->n = n;
  {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(job);
  }
  Drain(*job);
  // Tasks claimed by workers may still run; wait for them without spinning.
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Job* j) { return j->done.load(std::memory_order_acquire) == j->n; }, job.get()));
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* pool) ABSL_NO_THREAD_SAFETY_ANALYSIS { return pool->stopping_ || !pool->jobs_.empty(); },
          this));
      if (jobs_.empty()) return;  // stopping
      job = jobs_.front();
      // A job stays queued until its tasks are all claimed, so every worker
      // can join it.
      if (job->next.load() >= job->n) {
        jobs_.pop_front();
        continue;
      }
    }
    Drain(*job);
    // Wake the caller waiting in ParallelFor: Await re-evaluates its
    // condition when the mutex is released.
    absl::MutexLock lock(&mu_);
  }
}

}  // namespace tqkv
