// The scheduler on a paged KV-cache (coordinator/scheduler_pages.cc), driven directly with a tiny
// pool. A fake stage stores each fed token in the page and row its block table names and
// "samples" a function of every token it reads back through the table, so that a wrong or
// reused page changes the outputs.
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "common/metrics.h"
#include "coordinator/scheduler.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

const absl::Time kNow = absl::UnixEpoch() + absl::Hours(1);

// The next token after `tokens` (a stand-in for a model: any change of any token changes it).
int32_t NextToken(const std::vector<int32_t>& tokens) {
  uint64_t h = 7;
  for (int32_t t : tokens) h = h * 31 + static_cast<uint64_t>(t) + 1;
  return static_cast<int32_t>(h % 97) + 1;
}

// What a request generates alone: the reference every scheduled run must equal.
std::vector<int32_t> Undisturbed(std::vector<int32_t> prompt, int max_new_tokens) {
  std::vector<int32_t> out;
  for (int i = 0; i < max_new_tokens; ++i) {
    out.push_back(NextToken(prompt));
    prompt.push_back(out.back());
  }
  return out;
}

// Every stage's pages: token ids where the KV-cache would be.
class FakeStage {
 public:
  FakeStage(int pages, int page_size)
      : page_size_(page_size), rows_(pages, std::vector<int32_t>(page_size, -1)) {}

  // Writes each row's tokens through its block table, then samples from what it reads back.
  std::vector<int32_t> Run(const StepDescriptor& step) {
    std::vector<int32_t> sampled;
    size_t t = 0;
    for (const SequenceStep& row : step.seqs) {
      const int end = row.position + row.num_tokens;
      EXPECT_EQ(row.block_table.size(), static_cast<size_t>((end + page_size_ - 1) / page_size_));
      for (int pos = row.position; pos < end; ++pos) {
        const int32_t token = step.tokens[t++];
        At(row, pos) = token == kPreviousSample ? last_sample_[row.slot] : token;
      }
      if (!row.sample) continue;
      std::vector<int32_t> seen;
      for (int pos = 0; pos < end; ++pos) seen.push_back(At(row, pos));
      sampled.push_back(NextToken(seen));
      last_sample_[row.slot] = sampled.back();
    }
    return sampled;
  }

  // A KV move: positions [0, positions) from `from`'s pages `src` into this stage's pages `dst`.
  void Import(const FakeStage& from, const std::vector<int32_t>& src,
              const std::vector<int32_t>& dst, int positions) {
    for (int pos = 0; pos < positions; ++pos) {
      rows_[dst[pos / page_size_]][pos % page_size_] =
          from.rows_[src[pos / page_size_]][pos % page_size_];
    }
  }

 private:
  int32_t& At(const SequenceStep& row, int pos) {
    return rows_[row.block_table[pos / page_size_]][pos % page_size_];
  }
  int page_size_;
  std::vector<std::vector<int32_t>> rows_;
  std::map<int, int32_t> last_sample_;  // by slot, for rows that feed kPreviousSample
};

SchedulerOptions PagedOptions(int page_size) {
  SchedulerOptions o;
  o.max_waiting = 64;
  o.max_slots = 16;
  o.max_batch = 16;
  o.prefill_chunk = 512;
  o.micro_batches = 1;
  o.decode_ahead = false;
  o.vocab_size = 100;
  o.context_length = 64;
  o.kv_page_size = page_size;
  o.kv_margin_tokens = 0;
  return o;
}

ValidatedRequest Request(std::vector<int32_t> prompt, int max_new_tokens) {
  ValidatedRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  return r;
}

std::vector<int32_t> Output(const std::shared_ptr<RequestState>& r) {
  RequestState::Snapshot s;
  r->WaitMore(s, absl::InfinitePast());
  return s.tokens;
}

bool Done(const std::shared_ptr<RequestState>& r) {
  RequestState::Snapshot s;
  r->WaitMore(s, absl::InfinitePast());
  return s.done;
}

// Admits, forms and answers steps of pipeline 0 until nothing is left to run; the steps run in
// the order they were formed. Returns the steps formed.
// At most `rounds` rounds of steps; of pipeline `pipeline`.
std::vector<StepDescriptor> RunAll(Scheduler& s, FakeStage& stage, int rounds = 1000,
                                   int pipeline = 0) {
  std::vector<StepDescriptor> all;
  for (int round = 0; round < rounds; ++round) {
    s.Admit(kNow);
    std::vector<StepDescriptor> steps = s.FormSteps(pipeline);
    if (steps.empty()) break;
    for (const StepDescriptor& step : steps) {
      const std::vector<int32_t> tokens = stage.Run(step);
      EXPECT_TRUE(s.OnStepResult(pipeline, step.id, tokens, {}, kNow).ok());
      all.push_back(step);
    }
  }
  return all;
}

TEST(SchedulerPages, AdmitsByFreePagesNotBySlots) {
  // Each prompt of 10 tokens holds 3 pages and reserves a fourth to grow into (margin 4).
  SchedulerOptions o = PagedOptions(4);
  o.kv_margin_tokens = 4;
  Scheduler m(o);
  m.AddPipeline(0, 1, PipelineRole::kBoth, false, 8);
  std::vector<int32_t> prompt(10, 5);
  for (int i = 0; i < 3; ++i) {
    prompt[0] = i + 1;
    m.Enqueue(Request(prompt, 4), kNow);
  }
  m.Admit(kNow);
  EXPECT_EQ(m.running(0), 2);  // 16 slots, but 8 pages hold two of them with their growth
  EXPECT_EQ(m.waiting(), 1);
  EXPECT_EQ(m.kv_page_counters(0)->pages_used, 6);
}

// One step in flight, several (a victim's rows in flight go stale), and steps going ahead of the
// tokens they feed.
struct InFlight {
  int micro_batches;
  bool decode_ahead;
};

class SchedulerPagesPreemption : public ::testing::TestWithParam<InFlight> {};

TEST_P(SchedulerPagesPreemption, PreemptsWhenThePoolRunsOutAndEveryOutputEqualsAnUndisturbedRun) {
  constexpr int kPages = 12;
  SchedulerOptions o = PagedOptions(2);
  o.micro_batches = GetParam().micro_batches;
  o.decode_ahead = GetParam().decode_ahead;
  Scheduler s(o);
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage stage(kPages, 2);
  std::vector<std::shared_ptr<RequestState>> requests;
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt = {i + 1, 2 * i + 3, 4, i + 7};
    prompt.resize(3 + i % 3, 9);
    expected.push_back(Undisturbed(prompt, 8));
    requests.push_back(s.Enqueue(Request(prompt, 8), kNow));
  }
  RunAll(s, stage);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_TRUE(Done(requests[i])) << i;
    EXPECT_EQ(Output(requests[i]), expected[i]) << "request " << i;
  }
  EXPECT_GT(s.kv_page_counters(0)->preemptions, 0);  // the load did not fit at once
  EXPECT_EQ(s.kv_page_counters(0)->pages_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Steps, SchedulerPagesPreemption,
                         ::testing::Values(InFlight{1, false}, InFlight{3, false},
                                           InFlight{2, true}));

TEST(SchedulerPages, RefusesARequestThatCanNeverFitNamingTokensAndCapacity) {
  Scheduler s(PagedOptions(4));
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, /*kv_pages=*/4);  // 16 tokens
  const absl::Status fits = s.CheckFits(10, 8);
  EXPECT_EQ(fits.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fits.message(), HasSubstr("needs 18 tokens"));
  EXPECT_THAT(fits.message(), HasSubstr("KV-cache pool of 16 tokens"));
  EXPECT_TRUE(s.CheckFits(10, 6).ok());
  // One that reached the queue anyway ends with that error rather than waiting for ever.
  std::shared_ptr<RequestState> r = s.Enqueue(Request(std::vector<int32_t>(10, 3), 8), kNow);
  s.Admit(kNow);
  RequestState::Snapshot snap;
  r->WaitMore(snap, absl::InfinitePast());
  EXPECT_TRUE(snap.done);
  EXPECT_EQ(snap.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.running(0), 0);
}

TEST(SchedulerPages, APromptStartingWithCachedPagesStartsItsPrefillAfterThem) {
  constexpr int kPages = 16;
  Scheduler s(PagedOptions(4));
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage stage(kPages, 4);
  const std::vector<int32_t> shared = {11, 12, 13, 14, 15, 16, 17, 18};
  std::vector<int32_t> a = shared;
  a.push_back(20);
  std::shared_ptr<RequestState> ra = s.Enqueue(Request(a, 3), kNow);
  RunAll(s, stage);
  std::vector<int32_t> b = shared;
  b.insert(b.end(), {30, 31});
  std::shared_ptr<RequestState> rb = s.Enqueue(Request(b, 3), kNow);
  const std::vector<StepDescriptor> steps = RunAll(s, stage);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps[0].seqs[0].position, 8);  // two cached pages of 4
  EXPECT_EQ(steps[0].seqs[0].num_tokens, 2);
  EXPECT_EQ(Output(ra), Undisturbed(a, 3));
  EXPECT_EQ(Output(rb), Undisturbed(b, 3));
  EXPECT_EQ(s.kv_page_counters(0)->prefix_hit_tokens, 8);
}

TEST(SchedulerPages, APrefixEvictedBeforeItsAdmissionIsComputedAgain) {
  constexpr int kPages = 4;
  Scheduler s(PagedOptions(4));
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage stage(kPages, 4);
  const std::vector<int32_t> a = {11, 12, 13, 14, 15, 16, 17, 18, 19};
  std::shared_ptr<RequestState> ra = s.Enqueue(Request(a, 2), kNow);
  RunAll(s, stage);
  // Another prompt takes every page, evicting a's cached ones.
  const std::vector<int32_t> c = {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52};
  std::shared_ptr<RequestState> rc = s.Enqueue(Request(c, 2), kNow);
  RunAll(s, stage);
  std::vector<int32_t> b = a;
  b.back() = 25;
  std::shared_ptr<RequestState> rb = s.Enqueue(Request(b, 2), kNow);
  const std::vector<StepDescriptor> steps = RunAll(s, stage);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps[0].seqs[0].position, 0);
  EXPECT_EQ(Output(rc), Undisturbed(c, 2));
  EXPECT_EQ(Output(rb), Undisturbed(b, 2));
}

TEST(SchedulerPages, CountsPrefixHitsAndPreemptionsInTheMetrics) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  constexpr int kPages = 16;
  Scheduler s(PagedOptions(4), &metrics);
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage stage(kPages, 4);
  const std::vector<int32_t> a = {11, 12, 13, 14, 15, 16, 17, 18, 19};
  s.Enqueue(Request(a, 2), kNow);
  RunAll(s, stage);
  s.Enqueue(Request(a, 2), kNow);
  RunAll(s, stage);
  EXPECT_EQ(metrics.prefix_cache_queries.Value(), 2);
  EXPECT_EQ(metrics.prefix_cache_hits.Value(), 1);
  EXPECT_EQ(metrics.prefix_cache_query_tokens.Value(), 18);
  EXPECT_EQ(metrics.prefix_cache_hit_tokens.Value(), 8);
  EXPECT_DOUBLE_EQ(metrics.prefix_cache_hit_rate.Value(), 8.0 / 18.0);
}

// A re-partition moves paged sequences with their KV-cache: each held sequence names the old
// pipeline's pages, is given pages of its own by the new pipeline's owner, and once they are
// filled goes on without recomputing anything, with the undisturbed outputs. A move that failed
// frees the new pages and recomputes the sequence.
TEST(SchedulerPages, ARepartitionMovesPagedSequencesToTheNewPipelinesPages) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  constexpr int kPages = 24;
  Scheduler s(PagedOptions(4), &metrics);
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage old_stage(kPages, 4), new_stage(kPages, 4);
  const std::vector<int32_t> a = {5, 6, 7, 8, 9, 10, 11}, b = {20, 21, 22, 23, 24, 25, 26, 27, 28};
  std::vector<std::shared_ptr<RequestState>> requests = {
      s.Enqueue(Request(a, 12), kNow), s.Enqueue(Request(b, 12), kNow),
      s.Enqueue(Request(a, 12), kNow)};
  RunAll(s, old_stage, /*rounds=*/5);

  s.Pause(0);
  std::vector<Scheduler::Held> held = s.Detach(0);
  ASSERT_EQ(held.size(), 3u);
  // Placed newest first, so that each lands on other pages than it had: a table passed through
  // rather than allocated reads the wrong rows.
  s.AddPipeline(1, 1, PipelineRole::kBoth, false, kPages);
  for (size_t i = held.size(); i-- > 0;) {
    const Scheduler::Held& h = held[i];
    const int64_t used = s.kv_page_counters(1)->pages_used;
    ASSERT_EQ(h.block_table.size(), static_cast<size_t>((h.positions + 3) / 4));
    const std::optional<Scheduler::Target> to = s.PlaceHeld(h.seq);
    ASSERT_TRUE(to.has_value());
    ASSERT_EQ(to->block_table.size(), h.block_table.size());
    if (i == 1) {
      EXPECT_EQ(s.kv_page_counters(1)->pages_used,
                used + static_cast<int64_t>(h.block_table.size()));
      s.Moved(h.seq, false, absl::UnavailableError("ImportKv failed"), kNow);
      EXPECT_EQ(s.kv_page_counters(1)->pages_used, used);
      continue;
    }
    new_stage.Import(old_stage, h.block_table, to->block_table, h.positions);
    s.Moved(h.seq, true, absl::OkStatus(), kNow);
  }
  EXPECT_EQ(metrics.migrated_sequences.Value(), 2);
  EXPECT_EQ(metrics.recomputed_sequences.Value(), 1);
  RunAll(s, new_stage, 1000, /*pipeline=*/1);
  EXPECT_EQ(Output(requests[0]), Undisturbed(a, 12));
  EXPECT_EQ(Output(requests[1]), Undisturbed(b, 12));
  EXPECT_EQ(Output(requests[2]), Undisturbed(a, 12));
  EXPECT_EQ(metrics.recomputed_sequences.Value(), 1);
  // Every sequence ended: no page is held (the failed move's pages were freed).
  EXPECT_EQ(s.kv_page_counters(1)->pages_used, 0);
}

// Steps answered one round late, so that a sequence preempted while a step is formed may have
// rows in the steps still in flight: those rows are stale (their sequence's epoch moved on), and
// their sampled tokens are dropped rather than emitted; the victim's pages, freed at once, are
// reused only by steps issued after those rows, so every output is the undisturbed one.
TEST(SchedulerPages, RowsOfASequencePreemptedWhileInFlightAreDroppedNotEmitted) {
  constexpr int kPages = 10;
  SchedulerOptions o = PagedOptions(2);
  o.micro_batches = 3;
  Scheduler s(o);
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage stage(kPages, 2);
  std::vector<std::shared_ptr<RequestState>> requests;
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 5; ++i) {
    const std::vector<int32_t> prompt = {i + 1, 3 * i + 2, 7};
    expected.push_back(Undisturbed(prompt, 9));
    requests.push_back(s.Enqueue(Request(prompt, 9), kNow));
  }
  std::deque<StepDescriptor> in_flight;
  int preempted_in_flight = 0;  // preemptions while the victim's rows were in flight
  for (int round = 0; round < 1000; ++round) {
    s.Admit(kNow);
    const int64_t before = s.kv_page_counters(0)->preemptions;
    std::vector<StepDescriptor> steps = s.FormSteps(0);
    if (s.kv_page_counters(0)->preemptions > before && !in_flight.empty()) ++preempted_in_flight;
    for (StepDescriptor& step : steps) in_flight.push_back(std::move(step));
    if (in_flight.empty()) break;
    // The oldest step comes back; the others stay in flight for the next round.
    if (steps.empty() || in_flight.size() > 2) {
      const StepDescriptor step = std::move(in_flight.front());
      in_flight.pop_front();
      ASSERT_TRUE(s.OnStepResult(0, step.id, stage.Run(step), {}, kNow).ok());
    }
  }
  EXPECT_GT(preempted_in_flight, 0) << "no sequence was preempted with steps in flight";
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_TRUE(Done(requests[i])) << i;
    EXPECT_EQ(Output(requests[i]), expected[i]) << "request " << i;
  }
  EXPECT_EQ(s.kv_page_counters(0)->pages_used, 0);
}

// n > 1: the sequences of one request (its id and prompt) after the first fork it once the first
// one's prompt step is formed: they share its full prompt pages (no copy, no compute) and hold
// only their last page of their own, and each gives the undisturbed output.
TEST(SchedulerPages, SiblingsShareTheirPromptsFullPagesThroughFork) {
  constexpr int kPages = 32;
  Scheduler s(PagedOptions(4));
  s.AddPipeline(0, 1, PipelineRole::kBoth, false, kPages);
  FakeStage stage(kPages, 4);
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5};  // 2 full pages + 3
  std::vector<std::shared_ptr<RequestState>> siblings;
  for (int i = 0; i < 4; ++i) {
    ValidatedRequest r = Request(prompt, 6);
    r.request_id = "req-n4";
    siblings.push_back(s.Enqueue(r, kNow));
  }
  std::vector<StepDescriptor> steps = RunAll(s, stage, /*rounds=*/1);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].seqs.size(), 1u) << "the siblings wait for the first one's prompt step";
  steps = RunAll(s, stage, /*rounds=*/1);
  ASSERT_EQ(s.running(0), 4);
  // The first one's 3 pages, and one page of its own for each of the other three.
  EXPECT_EQ(s.kv_page_counters(0)->pages_used, 6);
  int children = 0;
  for (const StepDescriptor& step : steps) {
    for (const SequenceStep& row : step.seqs) {
      if (row.num_tokens == 1) continue;  // the first one's decode
      ++children;
      EXPECT_EQ(row.position, 8) << "a child computes its last page only";
    }
  }
  EXPECT_EQ(children, 3);
  RunAll(s, stage);
  for (size_t i = 0; i < siblings.size(); ++i) {
    EXPECT_EQ(Output(siblings[i]), Undisturbed(prompt, 6)) << "sequence " << i;
  }
  EXPECT_EQ(s.kv_page_counters(0)->pages_used, 0);
}

// A prefill pipeline's sequence hands off on pages: the prompt's last step writes its KV-cache out
// as it runs (no stream: the decode pages are not given yet), the decode pipeline's owner gives it
// pages of its own, named in the hand-off with the prefill pages it leaves and the step whose
// write-out it imports; the import waits until the decode steps formed before those pages were
// given have ended (one may still write them), and the sequence decodes there with the
// undisturbed output; no page stays held on either side.
TEST(SchedulerPages, AHandoffMovesPrefillPagesIntoTheDecodePipelinesPages) {
  constexpr int kPages = 16;
  Scheduler s(PagedOptions(4));
  s.AddPipeline(0, 1, PipelineRole::kPrefill, false, kPages);
  s.AddPipeline(1, 1, PipelineRole::kDecode, false, kPages);
  FakeStage prefill(kPages, 4), decode(kPages, 4);
  const std::vector<int32_t> a = {4, 8, 15, 16, 23, 42}, b = {1, 1, 2, 3, 5, 8, 13};
  auto hand_off = [&](const Scheduler::Handoff& h) {
    EXPECT_EQ(h.from_table.size(), static_cast<size_t>((h.positions + 3) / 4));
    EXPECT_EQ(h.to_table.size(), h.from_table.size());
    decode.Import(prefill, h.from_table, h.to_table, h.positions);
    s.HandedOff(h.id, true, absl::OkStatus(), kNow);
  };
  auto run = [&](int pipeline, FakeStage& stage, const StepDescriptor& step) {
    ASSERT_TRUE(s.OnStepResult(pipeline, step.id, stage.Run(step), {}, kNow).ok());
  };
  auto ra = s.Enqueue(Request(a, 5), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  ASSERT_EQ(steps[0].seqs.size(), 1u);
  EXPECT_NE(steps[0].seqs[0].kv_out_key, 0u) << "the prompt's last step writes it out";
  EXPECT_TRUE(s.TakeKvStreams().empty()) << "no stream into pages not given yet";
  const uint64_t written_by = steps[0].id;
  run(0, prefill, steps[0]);
  std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_EQ(hs[0].kv_out_step, written_by);
  EXPECT_FALSE(hs[0].streamed);
  hand_off(hs[0]);
  // The first sequence's decode step in flight while the second one's prompt runs.
  std::vector<StepDescriptor> decoding = s.FormSteps(1);
  ASSERT_EQ(decoding.size(), 1u);
  auto rb = s.Enqueue(Request(b, 5), kNow);
  s.Admit(kNow);
  steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  run(0, prefill, steps[0]);
  EXPECT_FALSE(s.handoffs_ready()) << "a decode step formed before its pages were given runs";
  run(1, decode, decoding[0]);
  ASSERT_TRUE(s.handoffs_ready());
  hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  hand_off(hs[0]);
  EXPECT_EQ(s.kv_page_counters(0)->pages_used, 0) << "the prefill pages go with the hand-off";
  RunAll(s, decode, 1000, /*pipeline=*/1);
  EXPECT_EQ(Output(ra), Undisturbed(a, 5));
  EXPECT_EQ(Output(rb), Undisturbed(b, 5));
  EXPECT_EQ(s.kv_page_counters(1)->pages_used, 0);
}

// A sequence cancelled during its hand-off still holds the decode pipeline's pages it was given
// until the hand-off ends: a decode sequence that then runs out of pages does not take it for a
// running one (it preempts itself), and the hand-off's end frees them.
TEST(SchedulerPages, ThePagesOfAHandoffWhoseSequenceEndedAreNoPreemptionVictim) {
  Scheduler s(PagedOptions(4));
  s.AddPipeline(0, 1, PipelineRole::kPrefill, false, 16);
  s.AddPipeline(1, 1, PipelineRole::kDecode, false, 4);
  FakeStage prefill(16, 4), decode(4, 4);
  auto hand_off = [&]() {
    const std::vector<StepDescriptor> steps = s.FormSteps(0);
    ASSERT_EQ(steps.size(), 1u);
    ASSERT_TRUE(s.OnStepResult(0, steps[0].id, prefill.Run(steps[0]), {}, kNow).ok());
  };
  s.Enqueue(Request({1, 2, 3, 4, 5, 6}, 10), kNow);  // 16 positions: the whole decode pool
  s.Admit(kNow);
  hand_off();
  std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  decode.Import(prefill, hs[0].from_table, hs[0].to_table, hs[0].positions);
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  auto b = s.Enqueue(Request({7, 8, 9, 10, 11, 12}, 10), kNow);
  s.Admit(kNow);
  hand_off();
  hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  s.Cancel(b, absl::CancelledError("client gone"), kNow);
  ASSERT_EQ(s.kv_page_counters(1)->pages_used, 4);
  // The first sequence needs a third page at position 8, and none is free.
  for (int round = 0; round < 8 && s.running(1) > 0; ++round) {
    for (const StepDescriptor& step : s.FormSteps(1)) {
      ASSERT_TRUE(s.OnStepResult(1, step.id, decode.Run(step), {}, kNow).ok());
    }
  }
  EXPECT_EQ(s.running(1), 0);
  EXPECT_EQ(s.kv_page_counters(1)->preemptions, 1);
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  EXPECT_EQ(s.kv_page_counters(1)->pages_used, 0);
}

}  // namespace
}  // namespace tandem
