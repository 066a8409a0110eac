// The page pool's bookkeeping: which pages are free, and who holds the others.
//
// Each page has two counts. `refs` is the number of holders that own it: block
// tables of sequences, or an append in flight that allocated it and has not
// published it yet. `pins` is the number of in-flight reads (Attend, Score)
// of it. A page returns to the free list only when both reach zero, so a read
// that snapshotted a block table survives a concurrent Drop. Copy-on-write
// looks at `refs` only: a reader reads published slots and a writer writes
// slots beyond them, so a pin never forces a copy.
//
// Thread safety: none. The owning KvCache serializes every call under its
// lock. Allocate, Release and Unpin are O(1) per page (a stack of free ids).
#ifndef TQKV_CACHE_PAGE_ALLOCATOR_H_
#define TQKV_CACHE_PAGE_ALLOCATOR_H_

#include <cstdint>
#include <vector>

namespace tqkv {

class PageAllocator {
 public:
  // REQUIRES: num_pages >= 0.
  explicit PageAllocator(int32_t num_pages);

  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  int32_t num_pages() const { return static_cast<int32_t>(pages_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_pages() - num_free(); }

  // Takes `count` free pages, each with refs = 1 and pins = 0, and appends
  // their ids to `*out`. All or nothing: returns false, taking none, when
  // fewer than `count` are free.
  bool Allocate(int32_t count, std::vector<int32_t>* out);

  // One more holder of an allocated page (a fork).
  // REQUIRES: refs(page) > 0.
  void AddRef(int32_t page);
  // One holder fewer. Frees the page when no holder and no pin is left.
  // REQUIRES: refs(page) > 0.
  void Release(int32_t page);

  // A read in flight. Pinning keeps a page off the free list after its last
  // Release until the matching Unpin.
  // REQUIRES: the page is not free.
  void Pin(int32_t page);
  // REQUIRES: pins(page) > 0.
  void Unpin(int32_t page);

  int32_t refs(int32_t page) const { return pages_[page].refs; }
  int32_t pins(int32_t page) const { return pages_[page].pins; }
  bool is_free(int32_t page) const { return pages_[page].refs == 0 && pages_[page].pins == 0; }

 private:
  struct PageState {
    int32_t refs = 0;
    int32_t pins = 0;
  };

  void FreeIfUnused(int32_t page);

  std::vector<PageState> pages_;
  // Free page ids; a stack, so recently freed (cache-warm) pages go out first.
  std::vector<int32_t> free_;
};

}  // namespace tqkv

#endif  // TQKV_CACHE_PAGE_ALLOCATOR_H_
