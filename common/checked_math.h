// Overflow-checked arithmetic for sizes computed from numbers that a request, a flag or a
// checkpoint gives (cache bytes, worker counts, message bytes): the result, or nothing when it
// would not fit, so that no size wraps into a small one that a later allocation or index trusts.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>

namespace tandem {

// The product of `factors`, or nullopt when a factor is negative or the product exceeds `limit`.
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors,
                                             int64_t limit = std::numeric_limits<int64_t>::max()) {
  int64_t product = 1;
  for (int64_t f : factors) {
    if (f < 0 || __builtin_mul_overflow(product, f, &product)) return std::nullopt;
  }
  if (product > limit) return std::nullopt;
  return product;
}

// The sum of `terms`, or nullopt when a term is negative or the sum exceeds `limit`.
inline std::optional<int64_t> CheckedSum(std::initializer_list<int64_t> terms,
                                         int64_t limit = std::numeric_limits<int64_t>::max()) {
  int64_t sum = 0;
  for (int64_t t : terms) {
    if (t < 0 || __builtin_add_overflow(sum, t, &sum)) return std::nullopt;
  }
  if (sum > limit) return std::nullopt;
  return sum;
}

}  // namespace tandem
