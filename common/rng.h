// Counter-based random numbers: the same (seed, counter) gives the same value on the host and on
// the device, on every machine, whatever the batch or the order of calls. Used for seeded sampling
// and for the random-weight checkpoint generator.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__
#else
#define TANDEM_HOST_DEVICE
#endif

namespace tandem {

// splitmix64's finalizer: a bijective 64-bit mix.
TANDEM_HOST_DEVICE inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// 64 random bits for (seed, counter).
TANDEM_HOST_DEVICE inline uint64_t RandomBits(uint64_t seed, uint64_t counter) {
  return Mix64(Mix64(seed) ^ (counter * 0xd1b54a32d192ed03ull));
}

// Uniform in [0, 1) with 24 random bits: exact in float, identical everywhere.
TANDEM_HOST_DEVICE inline float UniformFloat(uint64_t seed, uint64_t counter) {
  return static_cast<float>(RandomBits(seed, counter) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace tandem
