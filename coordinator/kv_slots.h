// KV-cache slots of one pipeline. The coordinator owns them: a slot id is the same on every stage
// of the pipeline, so one allocation here reserves the sequence's cache rows everywhere.
#pragma once

#include <optional>
#include <vector>

namespace tandem {

class KvSlotAllocator {
 public:
  explicit KvSlotAllocator(int capacity);
  // The lowest free slot, or nothing when all are taken.
  std::optional<int> Allocate();
  // Returns `slot`; false (and no change) when it is out of range or already free.
  bool Free(int slot);
  int capacity() const { return static_cast<int>(used_.size()); }
  int used() const { return num_used_; }
  int free() const { return capacity() - num_used_; }

 private:
  std::vector<bool> used_;
  int num_used_ = 0;
};

}  // namespace tandem
