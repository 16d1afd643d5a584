// KV slot allocation: a bitmap, lowest free slot first (keeps the used cache rows compact).
#include "coordinator/kv_slots.h"

namespace tandem {

KvSlotAllocator::KvSlotAllocator(int capacity) : used_(capacity > 0 ? capacity : 0, false) {}

std::optional<int> KvSlotAllocator::Allocate() {
  for (size_t i = 0; i < used_.size(); ++i) {
    if (!used_[i]) {
      used_[i] = true;
      ++num_used_;
      return static_cast<int>(i);
    }
  }
  return std::nullopt;
}

bool KvSlotAllocator::Free(int slot) {
  if (slot < 0 || slot >= capacity() || !used_[slot]) return false;
  used_[slot] = false;
  --num_used_;
  return true;
}

}  // namespace tandem
