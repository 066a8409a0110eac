// Process-wide allocator settings for a process that moves many large,
// short-lived buffers (gRPC messages of 100 KB - 10 MB, their tensors).
//
// Why: glibc's malloc serves blocks above its mmap threshold (128 KB at
// start, raised dynamically) with fresh mmap()s and returns freed heap tops
// to the kernel past its trim threshold, so a server answering large
// messages pays a page fault for every 4 KiB of every message, several
// times over (the request, its parse, the tensors, the response). Measured
// on a decode-loop message (8 sequences, Llama-3.1-8B shape, 320 KB): the
// serialize/parse/convert path takes ~10x longer with the defaults (see
// docs/service.md, "Concurrency and limits"). Keeping blocks below `mmap_threshold_bytes` in the
// heap and keeping up to `trim_threshold_bytes` of freed heap top makes the
// pages stay mapped and warm.
//
// Cost: up to trim_threshold_bytes of freed memory per malloc arena stays
// with the process instead of going back to the kernel; blocks larger than
// mmap_threshold_bytes (the page pool) are still mmapped.
//
// Call it once at the start of main(), before threads start; tqkv-server and
// the tqkv CLI do. A library must not: it is the program's choice. No-op
// where the C library is not glibc.
#ifndef TQKV_BASE_MALLOC_TUNING_H_
#define TQKV_BASE_MALLOC_TUNING_H_

#include <cstddef>

namespace tqkv {

struct MallocTuning {
  // glibc accepts at most 32 MiB here on 64-bit.
  size_t mmap_threshold_bytes = size_t{32} << 20;
  size_t trim_threshold_bytes = size_t{256} << 20;
};

// Returns true when the settings were applied.
bool TuneMallocForLargeMessages(const MallocTuning& tuning = MallocTuning());

}  // namespace tqkv

#endif  // TQKV_BASE_MALLOC_TUNING_H_
