// CudaHandle (worker/cuda/cuda_check.h) over a stand-in handle type whose release is counted, so
// that ownership is checked without a GPU: released once, on destruction, on put() and on a move
// onto a holder; never for null, never twice after a move.
#include <map>
#include <utility>

#include "gtest/gtest.h"
#include "worker/cuda/cuda_check.h"

namespace tandem::cuda {
namespace {

struct FakeObject {};
using FakeHandle = FakeObject*;

std::map<FakeHandle, int>& Released() {
  static std::map<FakeHandle, int> released;
  return released;
}

cudaError_t ReleaseFake(FakeHandle h) {
  ++Released()[h];
  return cudaSuccess;
}

using Owner = CudaHandle<FakeHandle, ReleaseFake>;

class CudaHandleTest : public ::testing::Test {
 protected:
  void SetUp() override { Released().clear(); }
  FakeObject a_, b_;
};

TEST_F(CudaHandleTest, ReleasesItsHandleOnceWhenItGoes) {
  {
    Owner owner(&a_);
    EXPECT_EQ(owner.get(), &a_);
  }
  EXPECT_EQ(Released()[&a_], 1);
  {
    Owner empty;
  }
  EXPECT_EQ(Released().size(), 1u);  // nothing released for null
}

TEST_F(CudaHandleTest, PutReleasesTheHandleHeldBeforeTheNewOneIsWritten) {
  Owner owner(&a_);
  *owner.put() = &b_;
  EXPECT_EQ(Released()[&a_], 1);
  EXPECT_EQ(owner.get(), &b_);
  owner.Reset();
  EXPECT_EQ(Released()[&b_], 1);
  EXPECT_EQ(owner.get(), nullptr);
}

TEST_F(CudaHandleTest, AMoveHandsOverTheHandleAndReleasesWhatTheTargetHeld) {
  Owner first(&a_);
  Owner second(std::move(first));
  EXPECT_EQ(first.get(), nullptr);
  EXPECT_EQ(second.get(), &a_);
  Owner third(&b_);
  third = std::move(second);
  EXPECT_EQ(Released()[&b_], 1);
  EXPECT_EQ(Released().count(&a_), 0u);
  EXPECT_EQ(third.get(), &a_);
  third.Reset();
  first.Reset();
  second.Reset();
  EXPECT_EQ(Released()[&a_], 1);  // once, by its last holder
}

}  // namespace
}  // namespace tandem::cuda
