#include "cache/page_allocator.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tqkv {
namespace {

using ::testing::ElementsAre;

TEST(PageAllocatorTest, AllocatesAllOrNothing) {
  PageAllocator pages(4);
  std::vector<int32_t> got;
  ASSERT_TRUE(pages.Allocate(3, &got));
  EXPECT_THAT(got, ElementsAre(0, 1, 2));
  EXPECT_EQ(pages.num_free(), 1);
  EXPECT_EQ(pages.num_used(), 3);
  EXPECT_FALSE(pages.Allocate(2, &got));
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(pages.num_free(), 1);
  for (int32_t page : got) {
    EXPECT_EQ(pages.refs(page), 1);
    EXPECT_EQ(pages.pins(page), 0);
    EXPECT_FALSE(pages.is_free(page));
  }
  EXPECT_TRUE(pages.Allocate(0, &got));
  EXPECT_EQ(got.size(), 3u);
}

TEST(PageAllocatorTest, PageIsFreeOnlyWithoutHoldersAndPins) {
  PageAllocator pages(2);
  std::vector<int32_t> got;
  ASSERT_TRUE(pages.Allocate(1, &got));
  const int32_t page = got[0];
  pages.AddRef(page);  // a fork
  pages.Pin(page);     // a read
  pages.Release(page);
  EXPECT_EQ(pages.num_free(), 1);
  pages.Release(page);
  EXPECT_EQ(pages.refs(page), 0);
  EXPECT_FALSE(pages.is_free(page));
  EXPECT_EQ(pages.num_free(), 1);  // pinned
  pages.Unpin(page);
  EXPECT_TRUE(pages.is_free(page));
  EXPECT_EQ(pages.num_free(), 2);
}

TEST(PageAllocatorTest, RecentlyFreedPagesGoOutFirst) {
  PageAllocator pages(3);
  std::vector<int32_t> got;
  ASSERT_TRUE(pages.Allocate(3, &got));
  pages.Release(1);
  pages.Release(2);
  std::vector<int32_t> again;
  ASSERT_TRUE(pages.Allocate(2, &again));
  EXPECT_THAT(again, ElementsAre(2, 1));
  EXPECT_EQ(pages.num_free(), 0);
}

TEST(PageAllocatorTest, EmptyPool) {
  PageAllocator pages(0);
  std::vector<int32_t> got;
  EXPECT_FALSE(pages.Allocate(1, &got));
  EXPECT_TRUE(pages.Allocate(0, &got));
  EXPECT_EQ(pages.num_pages(), 0);
}

}  // namespace
}  // namespace tqkv
