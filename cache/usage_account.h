// What a group of sequences holds across caches, against optional limits: the
// server keeps one per tenant (service/auth.h). A KvCache charges a
// sequence's account for the pool pages the sequence holds (page_bytes
// each; a page shared by two sequences of the account counts twice, so the
// figure bounds what the account can make the pool hold), its sequence and
// its tokens (the layer with most tokens), from creation to drop or
// eviction.
//
// Limits are checked before a page is allocated or a sequence created, so a
// call refused for its account changes nothing; 0 means no limit. Sequences
// that were charged before a limit was lowered are not dropped.
//
// Thread safety: every method is thread-safe (atomics). TryCharge* reserve
// atomically: two concurrent calls cannot both pass a limit only one fits.
#ifndef TQKV_CACHE_USAGE_ACCOUNT_H_
#define TQKV_CACHE_USAGE_ACCOUNT_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace tqkv {

class UsageAccount {
 public:
  // `description` names the account in errors, e.g. "tenant 'team-a'".
  UsageAccount(std::string description, uint64_t max_bytes, int64_t max_sequences)
      : description_(std::move(description)), max_bytes_(max_bytes), max_sequences_(max_sequences) {}
  UsageAccount(const UsageAccount&) = delete;
  UsageAccount& operator=(const UsageAccount&) = delete;

  const std::string& description() const { return description_; }
  uint64_t max_bytes() const { return max_bytes_; }
  int64_t max_sequences() const { return max_sequences_; }
  uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  int64_t sequences() const { return sequences_.load(std::memory_order_relaxed); }
  int64_t tokens() const { return tokens_.load(std::memory_order_relaxed); }
  // Calls refused for a limit, ever.
  uint64_t refusals() const { return refusals_.load(std::memory_order_relaxed); }

  // Adds `bytes` unless that takes the account past max_bytes: then
  // RESOURCE_EXHAUSTED saying what it holds, what `what` needs, and the
  // limit, and nothing is added.
  absl::Status TryChargeBytes(uint64_t bytes, const char* what) {
    uint64_t held = bytes_.load(std::memory_order_relaxed);
    do {
      if (max_bytes_ != 0 && bytes > 0 && (held > max_bytes_ || bytes > max_bytes_ - held)) {
        refusals_.fetch_add(1, std::memory_order_relaxed);
        return absl::ResourceExhaustedError(absl::StrFormat(
            "%s is at its quota: it holds %d bytes of pages, %s needs %d more, and max_bytes is %d; drop "
            "sequences it no longer needs",
            description_, held, what, bytes, max_bytes_));
      }
    } while (!bytes_.compare_exchange_weak(held, held + bytes, std::memory_order_relaxed));
    return absl::OkStatus();
  }
  // Adds (or, negative, gives back) bytes without a check: what a call
  // reserved with TryChargeBytes and did not use, or pages given back.
  void AdjustBytes(int64_t delta) { bytes_.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed); }

  // Counts one more sequence unless that passes max_sequences.
  absl::Status TryAddSequence() {
    int64_t held = sequences_.load(std::memory_order_relaxed);
    do {
      if (max_sequences_ != 0 && held >= max_sequences_) {
        refusals_.fetch_add(1, std::memory_order_relaxed);
        return absl::ResourceExhaustedError(
            absl::StrFormat("%s is at its quota: it holds %d sequences and max_sequences is %d; drop sequences it no "
                            "longer needs",
                            description_, held, max_sequences_));
      }
    } while (!sequences_.compare_exchange_weak(held, held + 1, std::memory_order_relaxed));
    return absl::OkStatus();
  }
  void RemoveSequence() { sequences_.fetch_sub(1, std::memory_order_relaxed); }

  // What a call reserves before it allocates: `bytes` and, when it creates
  // one, a sequence. All or nothing: on a refusal nothing stays reserved.
  absl::Status TryReserve(bool new_sequence, uint64_t bytes, const char* what) {
    if (new_sequence) {
      if (absl::Status added = TryAddSequence(); !added.ok()) return added;
    }
    absl::Status charged = TryChargeBytes(bytes, what);
    if (!charged.ok() && new_sequence) RemoveSequence();
    return charged;
  }
  // Gives back what TryReserve reserved.
  void Unreserve(bool new_sequence, uint64_t bytes) {
    AdjustBytes(-static_cast<int64_t>(bytes));
    if (new_sequence) RemoveSequence();
  }

  // Tokens are counted, not limited.
  void AddTokens(int64_t delta) { tokens_.fetch_add(delta, std::memory_order_relaxed); }

 private:
  const std::string description_;
  const uint64_t max_bytes_;
  const int64_t max_sequences_;
  std::atomic<uint64_t> bytes_{0};
  std::atomic<int64_t> sequences_{0};
  std::atomic<int64_t> tokens_{0};
  std::atomic<uint64_t> refusals_{0};
};

}  // namespace tqkv

#endif  // TQKV_CACHE_USAGE_ACCOUNT_H_
