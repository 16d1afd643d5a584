// For the GPU tests of the transports: how many CUDA devices there are, and a skip (reported
// SKIPPED, which the GPU scripts count as a failure) where a test needs more.
#pragma once

#include <cuda_runtime.h>

namespace tandem::testing {

inline int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace tandem::testing

#define REQUIRE_GPUS(n)                                                                            \
  do {                                                                                             \
    if (::tandem::testing::GpuCount() < (n)) {                                                     \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, found " << ::tandem::testing::GpuCount(); \
    }                                                                                              \
  } while (0)
