#include "base/malloc_tuning.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace tqkv {

bool TuneMallocForLargeMessages(const MallocTuning& tuning) {
#if defined(__GLIBC__)
  // mallopt takes an int; glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit
  // (HEAP_MAX / 2) and refuses larger values, so ask for at most that.
  const size_t kMaxMmapThreshold = size_t{32} << 20;
  const size_t mmap = tuning.mmap_threshold_bytes < kMaxMmapThreshold ? tuning.mmap_threshold_bytes : kMaxMmapThreshold;
  const size_t kMaxInt = 0x7fffffff;
  const size_t trim = tuning.trim_threshold_bytes < kMaxInt ? tuning.trim_threshold_bytes : kMaxInt;
  const bool ok_mmap = mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap)) == 1;
  const bool ok_trim = mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim)) == 1;
  return ok_mmap && ok_trim;
#else
  (void)tuning;
  return false;
#endif
}

}  // namespace tqkv
