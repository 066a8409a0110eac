#include "cache/page_allocator.h"

#include <cassert>

namespace tqkv {

PageAllocator::PageAllocator(int32_t num_pages) : pages_(num_pages) {
  free_.reserve(num_pages);
  // Pushed in reverse so that a fresh pool hands out pages 0, 1, 2, ...
  for (int32_t page = num_pages - 1; page >= 0; --page) free_.push_back(page);
}

bool PageAllocator::Allocate(int32_t count, std::vector<int32_t>* out) {
  if (count < 0 || count > num_free()) return false;
  for (int32_t i = 0; i < count; ++i) {
    const int32_t page = free_.back();
    free_.pop_back();
    assert(is_free(page));
    pages_[page].refs = 1;
    out->push_back(page);
  }
  return true;
}

void PageAllocator::AddRef(int32_t page) {
  assert(pages_[page].refs > 0);
  ++pages_[page].refs;
}

void PageAllocator::Release(int32_t page) {
  assert(pages_[page].refs > 0);
  --pages_[page].refs;
  FreeIfUnused(page);
}

void PageAllocator::Pin(int32_t page) {
  assert(!is_free(page));
  ++pages_[page].pins;
}

void PageAllocator::Unpin(int32_t page) {
  assert(pages_[page].pins > 0);
  --pages_[page].pins;
  FreeIfUnused(page);
}

void PageAllocator::FreeIfUnused(int32_t page) {
  if (is_free(page)) free_.push_back(page);
}

}  // namespace tqkv
