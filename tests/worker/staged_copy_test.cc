// StagedCopy and SplitIntoChunks: chunks cover every byte once at unit boundaries, and the reader
// threads never refill a staging slot before the device has finished with it, with a fake device
// that transfers a slot's bytes only when the slot is next waited on (or at the end).
#include "worker/staged_copy.h"

#include <atomic>
#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(SplitIntoChunksTest, ChunksCoverEveryByteOnceInOrder) {
  const std::vector<CopyJob> jobs = {{nullptr, 10, 2}, {nullptr, 0, 2}, {nullptr, 7, 1}};
  const std::vector<CopyChunk> chunks = SplitIntoChunks(jobs, 4);
  ASSERT_EQ(chunks.size(), 5u);  // 10 = 4 + 4 + 2; none for the empty job; 7 = 4 + 3
  size_t expect_job = 0, expect_offset = 0;
  for (const CopyChunk& c : chunks) {
    if (c.job != expect_job) {
      EXPECT_EQ(expect_offset, jobs[expect_job].bytes) << "job " << expect_job << " not covered";
      expect_job = c.job;
      expect_offset = 0;
    }
    EXPECT_EQ(c.offset, expect_offset);
    EXPECT_LE(c.bytes, 4u);
    EXPECT_EQ(c.offset % jobs[c.job].unit, 0u);
    expect_offset += c.bytes;
  }
  EXPECT_EQ(expect_job, 2u);
  EXPECT_EQ(expect_offset, 7u);
}

TEST(SplitIntoChunksTest, ChunksAreWholeUnitsAndAtLeastOne) {
  // Rows of 6 bytes with a 16-byte limit: 12-byte chunks; a limit below a row gives one row.
  std::vector<CopyJob> jobs = {{nullptr, 30, 6}};
  for (const CopyChunk& c : SplitIntoChunks(jobs, 16)) EXPECT_EQ(c.bytes % 6, 0u);
  EXPECT_EQ(SplitIntoChunks(jobs, 16).size(), 3u);
  EXPECT_EQ(SplitIntoChunks(jobs, 4).size(), 5u);
}

// A device whose transfers complete late: Submit only records the chunk; the slot's bytes are
// copied into `device` when the slot is waited on again or at Flush. A refill before the wait
// would transfer the new bytes to the old chunk's place, and show in the result.
class LazyDevice final : public StagingTarget {
 public:
  LazyDevice(std::span<const CopyJob> jobs, std::vector<size_t> job_offsets, size_t slots,
             size_t slot_bytes, std::vector<std::byte>& device)
      : jobs_(jobs), job_offsets_(std::move(job_offsets)), slot_bytes_(slot_bytes),
        host_(slots * slot_bytes), pending_(slots), device_(device) {}

  absl::Status BeginThread(int) override { return absl::OkStatus(); }
  absl::Status WaitFree(int slot) override {
    Complete(slot);
    return absl::OkStatus();
  }
  std::byte* Buffer(int slot) override { return host_.data() + slot * slot_bytes_; }
  absl::Status Submit(int slot, const CopyChunk& chunk) override {
    if (fail_at_ >= 0 && submitted_++ == fail_at_) return absl::DataLossError("planted");
    pending_[slot] = chunk;
    pending_[slot].bytes += 1;  // marks a pending slot (bytes + 1 > 0)
    return absl::OkStatus();
  }
  void Flush() {
    for (size_t s = 0; s < pending_.size(); ++s) Complete(static_cast<int>(s));
  }
  void FailAt(int n) { fail_at_ = n; }

 private:
  void Complete(int slot) {
    CopyChunk& c = pending_[slot];
    if (c.bytes == 0) return;
    std::memcpy(device_.data() + job_offsets_[c.job] + c.offset, Buffer(slot), c.bytes - 1);
    c.bytes = 0;
  }

  std::span<const CopyJob> jobs_;
  std::vector<size_t> job_offsets_;
  size_t slot_bytes_;
  std::vector<std::byte> host_;
  std::vector<CopyChunk> pending_;  // per slot; bytes == 0 when none
  std::vector<std::byte>& device_;
  int fail_at_ = -1;
  std::atomic<int> submitted_{0};
};

struct Case {
  std::vector<std::byte> source;
  std::vector<CopyJob> jobs;
  std::vector<size_t> offsets;  // of each job in the concatenated result
};

// Jobs of random sizes (some empty) over one random source, with units 1, 2 and 6.
Case MakeCase(uint32_t seed) {
  std::mt19937 rng(seed);
  Case c;
  c.source.resize(1 << 16);
  for (std::byte& b : c.source) b = static_cast<std::byte>(rng());
  size_t at = 0;
  for (int j = 0; j < 40; ++j) {
    const size_t unit = std::vector<size_t>{1, 2, 6}[rng() % 3];
    const size_t bytes = (rng() % 200) * unit;
    if (at + bytes > c.source.size()) break;
    c.jobs.push_back({c.source.data() + at, bytes, unit});
    c.offsets.push_back(at);
    at += bytes;
  }
  c.source.resize(at);
  return c;
}

TEST(StagedCopyTest, EveryByteArrivesWithSlotsReusedOnlyAfterTheirWait) {
  for (int threads : {1, 3, 8}) {
    for (int slots : {1, 2, 3}) {
      Case c = MakeCase(static_cast<uint32_t>(threads * 10 + slots));
      const std::vector<CopyChunk> chunks = SplitIntoChunks(c.jobs, 50);
      std::vector<std::byte> device(c.source.size());
      LazyDevice target(c.jobs, c.offsets, static_cast<size_t>(threads * slots), 54, device);
      ASSERT_TRUE(StagedCopy(c.jobs, chunks, threads, slots, target).ok());
      target.Flush();
      EXPECT_TRUE(device == c.source) << threads << " threads, " << slots << " slots";
    }
  }
}

TEST(StagedCopyTest, FirstErrorIsReturned) {
  Case c = MakeCase(7);
  const std::vector<CopyChunk> chunks = SplitIntoChunks(c.jobs, 50);
  std::vector<std::byte> device(c.source.size());
  LazyDevice target(c.jobs, c.offsets, 4 * 2, 54, device);
  target.FailAt(5);
  const absl::Status status = StagedCopy(c.jobs, chunks, 4, 2, target);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("planted"));
}

}  // namespace
}  // namespace tandem
