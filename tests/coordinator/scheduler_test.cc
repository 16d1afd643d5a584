#include "coordinator/scheduler.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kNow = absl::UnixEpoch() + absl::Hours(1);

// Ids 1..9 decode to the pieces below (a tokenizer's Decode in miniature).
TextDecoder TableDecoder() {
  static const std::map<int32_t, std::string> kText = {{1, "Hello"}, {2, " wor"}, {3, "ld"},
                                                       {4, " E"},    {5, "ND"},   {6, "!"}};
  return [](std::span<const int32_t> ids) -> absl::StatusOr<std::string> {
    std::string out;
    for (int32_t id : ids) {
      auto it = kText.find(id);
      out += it == kText.end() ? "?" : it->second;
    }
    return out;
  };
}

SchedulerOptions Options() {
  SchedulerOptions o;
  o.max_waiting = 8;
  o.max_slots = 4;
  o.max_batch = 16;
  o.prefill_chunk = 512;
  o.micro_batches = 1;
  o.decode_ahead = false;  // one step at a time; the decode-ahead tests turn it on
  o.vocab_size = 100;
  o.context_length = 1000;
  o.decode = TableDecoder();
  return o;
}

ValidatedRequest Request(std::vector<int32_t> prompt, int max_new_tokens = 50) {
  ValidatedRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  return r;
}

RequestState::Snapshot Peek(const std::shared_ptr<RequestState>& r) {
  RequestState::Snapshot s;
  r->WaitMore(s, absl::InfinitePast());
  return s;
}

// The one step pipeline `id` forms next; an empty one (which no result fits) when there is none.
StepDescriptor NextStep(Scheduler& s, int id) {
  std::vector<StepDescriptor> steps = s.FormSteps(id);
  EXPECT_EQ(steps.size(), 1u);
  return steps.empty() ? StepDescriptor{} : std::move(steps[0]);
}

// Runs step `step` of pipeline `id` with every sampling row drawing `token`; the result comes at
// `at`.
absl::Status AnswerAt(Scheduler& s, int id, const StepDescriptor& step, int32_t token,
                      absl::Time at) {
  std::vector<int32_t> tokens;
  for (const SequenceStep& row : step.seqs) {
    if (row.sample) tokens.push_back(token);
  }
  return s.OnStepResult(id, step.id, tokens, {}, at);
}

absl::Status Answer(Scheduler& s, int id, const StepDescriptor& step, int32_t token) {
  return AnswerAt(s, id, step, token, kNow);
}

// ---------------------------------------------------------------------------------------------
// Step formation

TEST(Scheduler, FormsOneStepPerStageWithTheReadySequencesSpreadEvenly) {
  SchedulerOptions o = Options();
  o.max_slots = 8;
  Scheduler s(o);
  s.AddPipeline(0, /*stages=*/2);
  for (int i = 0; i < 5; ++i) s.Enqueue(Request({10 + i, 20 + i}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);  // two stages: two micro-batches in flight
  EXPECT_EQ(steps[0].id, 1u);
  EXPECT_EQ(steps[1].id, 2u);
  ASSERT_EQ(steps[0].seqs.size(), 3u);  // ceil(5 / 2)
  ASSERT_EQ(steps[1].seqs.size(), 2u);
  EXPECT_THAT(steps[0].tokens, ElementsAre(10, 20, 11, 21, 12, 22));
  EXPECT_THAT(steps[1].tokens, ElementsAre(13, 23, 14, 24));
  for (const SequenceStep& row : steps[0].seqs) {
    EXPECT_EQ(row.position, 0);
    EXPECT_EQ(row.num_tokens, 2);
    EXPECT_TRUE(row.sample);
  }
  EXPECT_THAT(s.FormSteps(0), IsEmpty());  // every sequence is in a step already
}

// Sequences that arrive while a micro-batch is in flight do not all pile into the next one: a
// step takes an even share of the pipeline's sequences (1 + 5 would stay 1 + 5 step after step,
// each costing a stage nearly the same), and those left out go first once a step returns.
TEST(Scheduler, MicroBatchesTakeAnEvenShareAndThoseLeftOutGoFirst) {
  SchedulerOptions o = Options();
  o.max_slots = 8;
  Scheduler s(o);
  s.AddPipeline(0, /*stages=*/2);
  s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  const StepDescriptor a = NextStep(s, 0);
  ASSERT_EQ(a.seqs.size(), 1u);
  for (int i = 0; i < 5; ++i) s.Enqueue(Request({2 + i}), kNow);
  s.Admit(kNow);
  const StepDescriptor b = NextStep(s, 0);
  EXPECT_THAT(b.tokens, ElementsAre(2, 3, 4)) << "a share of ceil(6 / 2), not all five";
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  ASSERT_TRUE(Answer(s, 0, a, 9).ok());
  const StepDescriptor c = NextStep(s, 0);
  EXPECT_THAT(c.tokens, ElementsAre(5, 6, 9)) << "the two left out first, then the first one";
  ASSERT_TRUE(Answer(s, 0, b, 9).ok());
  EXPECT_EQ(NextStep(s, 0).seqs.size(), 3u);
}

TEST(Scheduler, CapsAStepAtMaxBatch) {
  SchedulerOptions o = Options();
  o.max_batch = 2;
  o.max_slots = 8;
  o.micro_batches = 3;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  for (int i = 0; i < 7; ++i) s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  // 7 ready over 3 free micro-batches would be 3 + 2 + 2; max_batch makes it 2 + 2 + 2.
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 3u);
  for (const StepDescriptor& step : steps) EXPECT_EQ(step.seqs.size(), 2u);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());  // three steps in flight: no room for the seventh
  ASSERT_TRUE(Answer(s, 0, steps[1], 7).ok());
  const std::vector<StepDescriptor> next = s.FormSteps(0);
  ASSERT_EQ(next.size(), 1u);
  ASSERT_EQ(next[0].seqs.size(), 2u);  // two of the three ready ones
  EXPECT_EQ(next[0].id, 4u);
}

TEST(Scheduler, DecodeStepsFeedTheNewestTokenAtTheNextPosition) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1, 2, 3});
  r.sampling.temperature = 0.5f;
  r.sampling.seed = 42;
  s.Enqueue(r, kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].seqs[0].sample_index, 0u);
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  const SequenceStep& row = steps[0].seqs[0];
  EXPECT_EQ(row.position, 3);
  EXPECT_EQ(row.num_tokens, 1);
  EXPECT_TRUE(row.sample);
  EXPECT_EQ(row.sample_index, 1u);
  EXPECT_EQ(row.sampling.temperature, 0.5f);
  EXPECT_EQ(row.sampling.seed, 42u);
  EXPECT_THAT(steps[0].tokens, ElementsAre(7));
  EXPECT_EQ(steps[0].id, 2u);
}

TEST(Scheduler, SendsSeenTokensOnlyWithAPenaltyAndOnlyOnSamplingRows) {
  SchedulerOptions o = Options();
  o.prefill_chunk = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({4, 5, 4});
  r.sampling.repetition_penalty = 1.5f;
  s.Enqueue(r, kNow);
  s.Enqueue(Request({4, 5, 4}), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_THAT(steps[0].seqs[0].seen, IsEmpty());  // a prompt chunk samples nothing
  ASSERT_TRUE(Answer(s, 0, steps[0], 0).ok());
  steps = s.FormSteps(0);
  ASSERT_TRUE(Answer(s, 0, steps[0], 5).ok());  // prompt done: token 5 sampled
  steps = s.FormSteps(0);
  std::map<int32_t, std::pair<int32_t, bool>> seen;
  for (const SeenToken& t : steps[0].seqs[0].seen) seen[t.id] = {t.output_count, t.in_prompt};
  EXPECT_EQ(seen, (std::map<int32_t, std::pair<int32_t, bool>>{{4, {0, true}}, {5, {1, true}}}));
  EXPECT_THAT(steps[0].seqs[1].seen, IsEmpty());  // no penalty
}

// ---------------------------------------------------------------------------------------------
// Decode ahead

SchedulerOptions AheadOptions() {
  SchedulerOptions o = Options();
  o.decode_ahead = true;
  return o;
}

TEST(Scheduler, DecodeAheadSendsTheNextStepFeedingThePreviousSampleWithTheNextCounter) {
  Scheduler s(AheadOptions());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1, 2, 3});
  r.sampling.temperature = 0.5f;
  r.sampling.seed = 42;
  auto req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);  // the prompt, and the decode step behind it
  EXPECT_THAT(steps[0].tokens, ElementsAre(1, 2, 3));
  EXPECT_EQ(steps[0].seqs[0].sample_index, 0u);
  EXPECT_THAT(steps[1].tokens, ElementsAre(kPreviousSample));
  const SequenceStep& ahead = steps[1].seqs[0];
  EXPECT_EQ(ahead.slot, steps[0].seqs[0].slot);
  EXPECT_EQ(ahead.position, 3);
  EXPECT_EQ(ahead.num_tokens, 1);
  EXPECT_TRUE(ahead.sample);
  EXPECT_EQ(ahead.sample_index, 1u);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());  // two steps in flight
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  std::vector<StepDescriptor> next = s.FormSteps(0);
  ASSERT_EQ(next.size(), 1u);  // the token 7 is fed already: the next one goes ahead again
  EXPECT_THAT(next[0].tokens, ElementsAre(kPreviousSample));
  EXPECT_EQ(next[0].seqs[0].position, 4);
  EXPECT_EQ(next[0].seqs[0].sample_index, 2u);
  ASSERT_TRUE(Answer(s, 0, steps[1], 8).ok());
  ASSERT_TRUE(Answer(s, 0, next[0], 9).ok());
  EXPECT_THAT(Peek(req).tokens, ElementsAre(7, 8, 9));
  next = s.FormSteps(0);
  ASSERT_EQ(next.size(), 2u);  // nothing in flight: the newest token, and a step ahead of it
  EXPECT_THAT(next[0].tokens, ElementsAre(9));
  EXPECT_EQ(next[0].seqs[0].position, 5);
  EXPECT_EQ(next[0].seqs[0].sample_index, 3u);
  EXPECT_EQ(next[1].seqs[0].position, 6);
}

TEST(Scheduler, DecodeAheadDropsTheTokenSampledAfterTheEnd) {
  Scheduler s(AheadOptions());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1});
  r.stop_token_ids = {5};
  auto req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_TRUE(Answer(s, 0, steps[0], 5).ok());
  EXPECT_TRUE(Peek(req).done);
  EXPECT_EQ(s.free_slots(0), 4);  // freed at once, with the step ahead still in flight
  ASSERT_TRUE(Answer(s, 0, steps[1], 6).ok());  // its token goes nowhere
  EXPECT_THAT(Peek(req).tokens, ElementsAre(5));
  EXPECT_EQ(Peek(req).finish, v1::FINISH_REASON_STOP);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
}

TEST(Scheduler, DecodeAheadStopsAtTheLengthWithoutAStepPast) {
  Scheduler s(AheadOptions());
  s.AddPipeline(0, 1);
  auto req = s.Enqueue(Request({1}, /*max_new_tokens=*/2), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);  // tokens 1 and 2
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  EXPECT_THAT(s.FormSteps(0), IsEmpty());  // the token in flight is the last one
  ASSERT_TRUE(Answer(s, 0, steps[1], 8).ok());
  EXPECT_THAT(Peek(req).tokens, ElementsAre(7, 8));
  EXPECT_EQ(Peek(req).finish, v1::FINISH_REASON_LENGTH);

  s.Enqueue(Request({1}, /*max_new_tokens=*/1), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.FormSteps(0).size(), 1u);  // one token: nothing to go ahead with
}

TEST(Scheduler, DecodeAheadWaitsForTheTokenWithPenaltiesPromptLogprobsOrSeveralStages) {
  Scheduler s(AheadOptions());
  s.AddPipeline(0, 1);
  ValidatedRequest penalty = Request({1});
  penalty.sampling.presence_penalty = 0.5f;
  s.Enqueue(penalty, kNow);
  ValidatedRequest scored = Request({1, 2});
  scored.prompt_logprobs = 0;
  s.Enqueue(scored, kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.FormSteps(0).size(), 1u);

  Scheduler two(AheadOptions());
  two.AddPipeline(0, 2);
  two.Enqueue(Request({1}), kNow);
  two.Admit(kNow);
  const std::vector<StepDescriptor> steps = two.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);  // the first stage cannot feed what the last one sampled
  EXPECT_THAT(steps[0].tokens, ElementsAre(1));
}

// Two stages whose first gets the last one's tokens over the link: each micro-batch's next step
// goes out while its step before is in flight, the same sequences in the same order, so that the
// first stage's rows feed the tokens of one step each.
TEST(Scheduler, DecodeAheadOfTwoStagesFedByTheLastKeepsEachMicroBatchsSequences) {
  Scheduler s(AheadOptions());
  s.AddPipeline(0, 2, PipelineRole::kBoth, /*fed_by_last=*/true);
  EXPECT_EQ(s.decode_ahead(0), 1);
  for (int i = 0; i < 4; ++i) s.Enqueue(Request({1, 2}), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 4u);  // two micro-batches, each with a step ahead behind it
  auto slots = [](const StepDescriptor& d) {
    std::vector<int> v;
    for (const SequenceStep& r : d.seqs) v.push_back(r.slot);
    return v;
  };
  EXPECT_EQ(slots(steps[0]).size(), 2u);
  EXPECT_EQ(slots(steps[2]), slots(steps[0]));
  EXPECT_EQ(slots(steps[3]), slots(steps[1]));
  EXPECT_THAT(steps[2].tokens, ElementsAre(kPreviousSample, kPreviousSample));
  EXPECT_EQ(steps[2].seqs[0].position, 2);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  std::vector<StepDescriptor> next = s.FormSteps(0);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(slots(next[0]), slots(steps[0]));
  EXPECT_THAT(next[0].tokens, ElementsAre(kPreviousSample, kPreviousSample));
  EXPECT_EQ(next[0].seqs[0].position, 3);

  Scheduler off(Options());  // decode_ahead false
  off.AddPipeline(0, 2, PipelineRole::kBoth, /*fed_by_last=*/true);
  EXPECT_EQ(off.decode_ahead(0), 0);
}

// The first stage's steps take turns between micro-batches: a micro-batch's next step goes in
// only once another's is behind its newest (so that the first stage runs that one while the last
// samples the tokens it feeds), unless it is the only one.
TEST(Scheduler, DecodeAheadOfTwoStagesTakesTurnsBetweenMicroBatches) {
  SchedulerOptions o = AheadOptions();
  o.max_slots = 8;
  Scheduler s(o);
  s.AddPipeline(0, 2, PipelineRole::kBoth, /*fed_by_last=*/true);
  s.Enqueue(Request({1, 2}), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> a = s.FormSteps(0);
  ASSERT_EQ(a.size(), 2u);  // the only micro-batch: its step ahead right behind it
  EXPECT_THAT(a[1].tokens, ElementsAre(kPreviousSample));
  for (int i = 0; i < 3; ++i) s.Enqueue(Request({3}), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> b = s.FormSteps(0);
  // The newcomers open the second micro-batch, with an even share of the four (the third waits),
  // and do not go ahead at once, which would follow their step right behind.
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].seqs.size(), 2u);
  ASSERT_TRUE(Answer(s, 0, a[0], 7).ok());
  // The first micro-batch again, behind the newcomers' step, with the newcomer left out; then
  // the second, whole, behind that.
  std::vector<StepDescriptor> next = s.FormSteps(0);
  ASSERT_EQ(next.size(), 2u);
  ASSERT_EQ(next[0].seqs.size(), 2u);
  EXPECT_EQ(next[0].seqs[0].slot, a[0].seqs[0].slot);
  EXPECT_EQ(next[0].seqs[0].position, 3);
  EXPECT_THAT(next[0].tokens, ElementsAre(kPreviousSample, 3));
  EXPECT_EQ(next[1].seqs.size(), 2u);
  EXPECT_THAT(next[1].tokens, ElementsAre(kPreviousSample, kPreviousSample));
  EXPECT_THAT(s.FormSteps(0), IsEmpty());  // four steps in flight
  // A newcomer while both micro-batches are in flight joins the next one to go ahead, behind it.
  s.Enqueue(Request({4}), kNow);
  s.Admit(kNow);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  ASSERT_TRUE(Answer(s, 0, a[1], 8).ok());
  next = s.FormSteps(0);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_THAT(next[0].tokens, ElementsAre(kPreviousSample, kPreviousSample, 4));
}

TEST(Scheduler, DecodeAheadPutsSequencesWithNothingInFlightFirst) {
  SchedulerOptions o = AheadOptions();
  o.max_batch = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  for (int i = 0; i < 4; ++i) s.Enqueue(Request({10 + i}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_THAT(steps[0].tokens, ElementsAre(10, 11));
  EXPECT_THAT(steps[1].tokens, ElementsAre(12, 13));  // not the first two again, ahead
}

// Results of a one-stage pipeline 0.1 ms apart, each with the next step queued behind it: the
// stage's step time is 0.1 ms, so a sequence goes ten steps ahead within decode_ahead_time = 1 ms,
// each row one position and one counter further, all feeding the slot's previous sample.
TEST(Scheduler, DecodeAheadGoesAsManyStepsAheadAsFitInItsTime) {
  SchedulerOptions o = AheadOptions();
  o.decode_ahead_time = absl::Milliseconds(1);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  auto req = s.Enqueue(Request({1, 2, 3}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.decode_ahead(0), 1) << "one step until a step time is measured";
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  const absl::Duration gap = absl::Microseconds(100);
  ASSERT_TRUE(AnswerAt(s, 0, steps[0], 7, kNow).ok());
  ASSERT_TRUE(AnswerAt(s, 0, steps[1], 8, kNow + gap).ok());
  EXPECT_EQ(s.decode_ahead(0), 10);
  steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 11u);  // the newest token, and ten steps ahead of it
  EXPECT_THAT(steps[0].tokens, ElementsAre(8));
  for (size_t i = 0; i < steps.size(); ++i) {
    ASSERT_EQ(steps[i].seqs.size(), 1u);
    EXPECT_EQ(steps[i].seqs[0].position, 4 + static_cast<int>(i));
    EXPECT_EQ(steps[i].seqs[0].sample_index, 2 + i);
    if (i > 0) EXPECT_THAT(steps[i].tokens, ElementsAre(kPreviousSample));
  }
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  absl::Time t = kNow + gap;
  for (size_t i = 0; i < steps.size(); ++i) {
    t += gap;
    ASSERT_TRUE(AnswerAt(s, 0, steps[i], 20 + static_cast<int32_t>(i), t).ok());
  }
  EXPECT_EQ(Peek(req).tokens.size(), 13u);
  EXPECT_EQ(Peek(req).tokens.back(), 30);
}

// The step time counts only gaps between results that came back to back: a result that left
// nothing in flight (the stage then waits for the coordinator) starts no gap. Steps slower than
// decode_ahead_time go one step ahead; fast ones at most kMaxDecodeAhead.
TEST(Scheduler, DecodeAheadStepTimeSkipsIdleGapsAndStaysWithinOneAndTheMost) {
  SchedulerOptions o = AheadOptions();
  o.decode_ahead_time = absl::Milliseconds(1);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_TRUE(AnswerAt(s, 0, steps[0], 7, kNow).ok());
  ASSERT_TRUE(AnswerAt(s, 0, steps[1], 8, kNow + absl::Milliseconds(5)).ok());
  EXPECT_EQ(s.decode_ahead(0), 1) << "5 ms steps";
  steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_TRUE(AnswerAt(s, 0, steps[0], 9, kNow + absl::Milliseconds(10)).ok());
  // The last result left nothing in flight: the 100 ms until the next one are not a step.
  ASSERT_TRUE(AnswerAt(s, 0, steps[1], 10, kNow + absl::Milliseconds(11)).ok());
  const int before = s.decode_ahead(0);
  steps = s.FormSteps(0);
  ASSERT_FALSE(steps.empty());
  for (size_t i = 0; i < steps.size(); ++i) {
    ASSERT_TRUE(AnswerAt(s, 0, steps[i], 11, kNow + absl::Milliseconds(111 + i)).ok());
  }
  EXPECT_EQ(s.decode_ahead(0), before);

  Scheduler fast(o);
  fast.AddPipeline(0, 1);
  fast.Enqueue(Request({1}), kNow);
  fast.Admit(kNow);
  steps = fast.FormSteps(0);
  ASSERT_TRUE(AnswerAt(fast, 0, steps[0], 7, kNow).ok());
  ASSERT_TRUE(AnswerAt(fast, 0, steps[1], 8, kNow + absl::Microseconds(1)).ok());
  EXPECT_EQ(fast.decode_ahead(0), kMaxDecodeAhead);
  EXPECT_EQ(fast.FormSteps(0).size(), static_cast<size_t>(1 + kMaxDecodeAhead));

  SchedulerOptions off = o;
  off.decode_ahead = false;
  Scheduler none(off);
  none.AddPipeline(0, 1);
  EXPECT_EQ(none.decode_ahead(0), 0);
}

// Far ahead, a sequence still stops exactly: at its length no step goes past the last token, and
// at a stop token the tokens sampled ahead of it go nowhere.
TEST(Scheduler, DecodeAheadFarAheadEndsExactlyAtTheLengthAndAtAStopToken) {
  SchedulerOptions o = AheadOptions();
  o.decode_ahead_time = absl::Milliseconds(1);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  // Measure a 0.1 ms step time with a first request.
  auto first = s.Enqueue(Request({1}, /*max_new_tokens=*/2), kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_TRUE(AnswerAt(s, 0, steps[0], 7, kNow).ok());
  ASSERT_TRUE(AnswerAt(s, 0, steps[1], 8, kNow + absl::Microseconds(100)).ok());
  ASSERT_TRUE(Peek(first).done);
  ASSERT_EQ(s.decode_ahead(0), 10);

  auto shortreq = s.Enqueue(Request({1}, /*max_new_tokens=*/4), kNow);
  s.Admit(kNow);
  steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 4u) << "four tokens: the prompt's and three ahead, none past";
  absl::Time t = kNow + absl::Microseconds(100);
  for (size_t i = 0; i < steps.size(); ++i) {
    t += absl::Microseconds(100);
    ASSERT_TRUE(AnswerAt(s, 0, steps[i], 40 + static_cast<int32_t>(i), t).ok());
  }
  EXPECT_THAT(Peek(shortreq).tokens, ElementsAre(40, 41, 42, 43));
  EXPECT_EQ(Peek(shortreq).finish, v1::FINISH_REASON_LENGTH);

  ValidatedRequest r = Request({1});
  r.stop_token_ids = {5};
  auto stopped = s.Enqueue(r, kNow);
  s.Admit(kNow);
  steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 11u);
  const std::vector<int32_t> sampled = {3, 4, 5, 6, 5, 7, 8, 9, 10, 11, 12};
  for (size_t i = 0; i < steps.size(); ++i) {
    t += absl::Microseconds(100);
    ASSERT_TRUE(AnswerAt(s, 0, steps[i], sampled[i], t).ok());
    if (i == 2) EXPECT_EQ(s.free_slots(0), 4) << "the slot is free at the stop token";
  }
  EXPECT_THAT(Peek(stopped).tokens, ElementsAre(3, 4, 5));
  EXPECT_EQ(Peek(stopped).finish, v1::FINISH_REASON_STOP);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
}

TEST(Scheduler, DecodeAheadCancelSkipsBothStepsInFlight) {
  Scheduler s(AheadOptions());
  s.AddPipeline(0, 1);
  auto req = s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  s.Cancel(req, absl::CancelledError("client"), kNow);
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  ASSERT_TRUE(Answer(s, 0, steps[1], 8).ok());
  EXPECT_THAT(Peek(req).tokens, IsEmpty());
  EXPECT_EQ(Peek(req).status.code(), absl::StatusCode::kCancelled);
}

// ---------------------------------------------------------------------------------------------
// Chunked prefill

TEST(Scheduler, NewRequestsArrivingTogetherAreAdmittedIntoOnePromptStep) {
  SchedulerOptions o = Options();
  o.admission_quiet = absl::Milliseconds(1);
  o.admission_wait = absl::Milliseconds(5);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  EXPECT_EQ(s.admit_at(), absl::InfinitePast());
  s.Enqueue(Request({1, 2}), kNow);
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(1));
  s.Admit(kNow + absl::Microseconds(500));
  EXPECT_EQ(s.waiting(), 1);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  s.Enqueue(Request({3, 4, 5}), kNow + absl::Microseconds(600));
  EXPECT_EQ(s.admit_at(), kNow + absl::Microseconds(1600));
  s.Admit(kNow + absl::Microseconds(1599));  // the newest came 0.999 ms ago
  EXPECT_EQ(s.waiting(), 2);
  s.Admit(kNow + absl::Microseconds(1600));
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.admit_at(), absl::InfinitePast());
  const StepDescriptor step = NextStep(s, 0);  // both prompts in one step
  ASSERT_EQ(step.seqs.size(), 2u);
  EXPECT_THAT(step.tokens, ElementsAre(1, 2, 3, 4, 5));
}

TEST(Scheduler, AdmissionHoldsNewRequestsBackAtMostTheWaitAndNeverAFullBatchOrResumedOnes) {
  SchedulerOptions o = Options();
  o.max_waiting = 16;
  o.max_slots = 8;
  o.admission_quiet = absl::Milliseconds(1);
  o.admission_wait = absl::Milliseconds(5);
  {  // Arrivals every 0.8 ms: the oldest goes in 5 ms after it came, with the others.
    Scheduler s(o);
    s.AddPipeline(0, 1);
    for (int i = 0; i < 7; ++i) s.Enqueue(Request({1}), kNow + i * absl::Microseconds(800));
    EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(5));
    s.Admit(kNow + absl::Microseconds(4999));
    EXPECT_EQ(s.waiting(), 7);
    s.Admit(kNow + absl::Milliseconds(5));
    EXPECT_EQ(s.waiting(), 0);
    EXPECT_EQ(s.running(0), 7);
  }
  {  // max_batch waiting: nothing to gain by waiting.
    o.max_batch = 3;
    Scheduler s(o);
    s.AddPipeline(0, 1);
    s.Enqueue(Request({1}), kNow);
    s.Enqueue(Request({2}), kNow);
    EXPECT_NE(s.admit_at(), absl::InfinitePast());
    s.Enqueue(Request({3}), kNow);
    EXPECT_EQ(s.admit_at(), absl::InfinitePast());
    s.Admit(kNow);
    EXPECT_EQ(s.running(0), 3);
  }
  {  // As many waiting as free slots: neither.
    o.max_batch = 16;
    Scheduler s(o);
    s.AddPipeline(0, 1);
    for (int i = 0; i < 6; ++i) s.Enqueue(Request({1}, 100), kNow - absl::Seconds(1));
    s.Admit(kNow);
    ASSERT_EQ(s.running(0), 6);  // two of eight slots left
    s.Enqueue(Request({2}), kNow);
    EXPECT_NE(s.admit_at(), absl::InfinitePast());
    s.Enqueue(Request({3}), kNow);
    EXPECT_EQ(s.admit_at(), absl::InfinitePast());
    s.Admit(kNow);
    EXPECT_EQ(s.running(0), 8);
  }
  {  // A resumed sequence goes in at once; a new request beside it waits.
    o.max_batch = 16;
    Scheduler s(o);
    s.AddPipeline(0, 1);
    s.Enqueue(Request({1, 2, 3}), kNow);
    s.Admit(kNow + absl::Milliseconds(1));
    ASSERT_EQ(s.running(0), 1);
    ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
    s.RemovePipeline(0, absl::UnavailableError("worker 1 is down"), kNow, /*resume=*/true);
    s.AddPipeline(1, 1);
    const absl::Time later = kNow + absl::Seconds(1);
    s.Enqueue(Request({4}), later);
    s.Admit(later);
    EXPECT_EQ(s.running(1), 1);
    EXPECT_EQ(s.waiting(), 1);
    EXPECT_THAT(NextStep(s, 1).tokens, ElementsAre(1, 2, 3, 7));
  }
  {  // Zero: at once.
    o.admission_quiet = absl::ZeroDuration();
    Scheduler s(o);
    s.AddPipeline(0, 1);
    s.Enqueue(Request({1}), kNow);
    EXPECT_EQ(s.admit_at(), absl::InfinitePast());
    s.Admit(kNow);
    EXPECT_EQ(s.running(0), 1);
  }
}

// Admission that holds new requests: 1 ms of quiet, 20 ms at most, `max_slots` slots.
SchedulerOptions HoldingOptions(int max_slots) {
  SchedulerOptions o = Options();
  o.max_slots = max_slots;
  o.admission_quiet = absl::Milliseconds(1);
  o.admission_wait = absl::Milliseconds(20);
  return o;
}

TEST(Scheduler, AdmissionWaitsForTheSuccessorsOfSequencesThatEndOrAreAboutTo) {
  SchedulerOptions o = HoldingOptions(8);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  const absl::Time t0 = kNow - absl::Milliseconds(10);
  for (int i = 0; i < 4; ++i) s.Enqueue(Request({1}, /*max_new_tokens=*/3), t0);
  s.Admit(kNow);
  ASSERT_EQ(s.running(0), 4);
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow).ok());  // one token each, two to go
  // All four reach their length within two steps: a new request waits for them (up to the wait).
  s.Enqueue(Request({2}), kNow + absl::Milliseconds(1));
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(21));
  s.Admit(kNow + absl::Milliseconds(5));
  EXPECT_EQ(s.waiting(), 1);
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow + absl::Milliseconds(6)).ok());
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(21));
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow + absl::Milliseconds(8)).ok());
  ASSERT_EQ(s.running(0), 0);  // all four ended at once: held for their successors too
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(21));
  for (int i = 0; i < 4; ++i) s.Enqueue(Request({3}), kNow + absl::Milliseconds(10));
  // They came: then the quiet time after the newest arrival.
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(11));
  s.Admit(kNow + absl::Microseconds(10999));
  EXPECT_EQ(s.waiting(), 5);
  s.Admit(kNow + absl::Milliseconds(11));
  EXPECT_EQ(s.running(0), 5);

  // One of five about to end is not many: only the quiet time after the newest arrival.
  Scheduler few(o);
  few.AddPipeline(0, 1);
  few.Enqueue(Request({1}, 3), t0);
  for (int i = 0; i < 4; ++i) few.Enqueue(Request({1}, 100), t0);
  few.Admit(kNow);
  ASSERT_EQ(few.running(0), 5);
  ASSERT_TRUE(AnswerAt(few, 0, NextStep(few, 0), 5, kNow).ok());
  few.Enqueue(Request({2}), kNow + absl::Milliseconds(1));
  EXPECT_EQ(few.admit_at(), kNow + absl::Milliseconds(2));
}

// A round split in two comes together again: six of eight sequences end and their successors
// would fill the six free slots, but the other two end within a few tokens, so the six wait for
// them and their successors (up to the wait), and all eight go in as one prompt step.
TEST(Scheduler, AdmissionJoinsTheSuccessorsOfARoundThatEndsInTwoParts) {
  SchedulerOptions o = HoldingOptions(8);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  const absl::Time t0 = kNow - absl::Milliseconds(10);
  for (int i = 0; i < 6; ++i) s.Enqueue(Request({1}, /*max_new_tokens=*/1), t0);
  for (int i = 0; i < 2; ++i) s.Enqueue(Request({1}, /*max_new_tokens=*/3), t0);
  s.Admit(kNow);
  ASSERT_EQ(s.running(0), 8);
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow).ok());
  ASSERT_EQ(s.running(0), 2);  // the six ended; two to go for the other two
  for (int i = 0; i < 6; ++i) s.Enqueue(Request({2}), kNow + absl::Milliseconds(1));
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(21));
  s.Admit(kNow + absl::Milliseconds(2));
  EXPECT_EQ(s.waiting(), 6);
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow + absl::Milliseconds(3)).ok());
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow + absl::Milliseconds(5)).ok());
  ASSERT_EQ(s.running(0), 0);
  for (int i = 0; i < 2; ++i) s.Enqueue(Request({3}), kNow + absl::Milliseconds(6));
  EXPECT_EQ(s.admit_at(), absl::InfinitePast());  // every slot taken by those waiting
  s.Admit(kNow + absl::Milliseconds(6));
  EXPECT_EQ(s.running(0), 8);
  const StepDescriptor step = NextStep(s, 0);
  EXPECT_EQ(step.seqs.size(), 8u);
}

// A round that ends in one step: its successors arrive spread out (a few now, the others a few
// milliseconds later); the first are held for the others, past the quiet time, until as many
// have come as ended (then they fill every free slot and go in at once), or until the wait.
TEST(Scheduler, AdmissionWaitsForTheSuccessorsOfARoundThatEndedAtOnce) {
  SchedulerOptions o = HoldingOptions(8);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  for (int i = 0; i < 8; ++i) s.Enqueue(Request({1}, /*max_new_tokens=*/1), kNow);
  s.Admit(kNow);
  ASSERT_EQ(s.running(0), 8);
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow + absl::Milliseconds(1)).ok());
  ASSERT_EQ(s.running(0), 0);  // all eight ended in one step
  for (int i = 0; i < 3; ++i) s.Enqueue(Request({2}, 1), kNow + absl::Milliseconds(2));
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(21));  // not 3 ms (the quiet time)
  s.Admit(kNow + absl::Milliseconds(4));
  EXPECT_EQ(s.waiting(), 3);
  for (int i = 0; i < 5; ++i) s.Enqueue(Request({3}, 1), kNow + absl::Milliseconds(9));
  EXPECT_EQ(s.admit_at(), absl::InfinitePast());  // every slot taken by those waiting
  s.Admit(kNow + absl::Milliseconds(9));
  EXPECT_EQ(s.running(0), 8);
  const StepDescriptor round = NextStep(s, 0);
  EXPECT_EQ(round.seqs.size(), 8u);

  // The next round: only two successors come; they go in once the wait after the end is over.
  ASSERT_TRUE(AnswerAt(s, 0, round, 5, kNow + absl::Milliseconds(30)).ok());
  ASSERT_EQ(s.running(0), 0);
  for (int i = 0; i < 2; ++i) s.Enqueue(Request({4}), kNow + absl::Milliseconds(31));
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(50));
  s.Admit(kNow + absl::Milliseconds(49));
  EXPECT_EQ(s.waiting(), 2);
  s.Admit(kNow + absl::Milliseconds(50));
  EXPECT_EQ(s.running(0), 2);
}

// Sequences that end one or a few at a time (an open loop's) hold nobody past the quiet time.
TEST(Scheduler, AdmissionAfterASingleEndWaitsOnlyTheQuietTime) {
  SchedulerOptions o = HoldingOptions(10);
  Scheduler s(o);
  s.AddPipeline(0, 1);
  const absl::Time t0 = kNow - absl::Milliseconds(10);
  s.Enqueue(Request({1}, /*max_new_tokens=*/1), t0);
  for (int i = 0; i < 7; ++i) s.Enqueue(Request({1}, /*max_new_tokens=*/50), t0);
  s.Admit(kNow);
  ASSERT_EQ(s.running(0), 8);
  ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, kNow + absl::Milliseconds(1)).ok());
  ASSERT_EQ(s.running(0), 7);  // one of eight ended: three slots free
  s.Enqueue(Request({2}), kNow + absl::Milliseconds(2));
  EXPECT_EQ(s.admit_at(), kNow + absl::Milliseconds(3));
}

TEST(Scheduler, FeedsALongPromptInChunksAndSamplesAfterTheLast) {
  SchedulerOptions o = Options();
  o.prefill_chunk = 4;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}), kNow);
  s.Admit(kNow);
  const std::vector<std::vector<int32_t>> want_tokens = {{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10}};
  for (int chunk = 0; chunk < 3; ++chunk) {
    const std::vector<StepDescriptor> steps = s.FormSteps(0);
    ASSERT_EQ(steps.size(), 1u) << chunk;
    const SequenceStep& row = steps[0].seqs[0];
    EXPECT_EQ(row.position, 4 * chunk);
    EXPECT_EQ(row.num_tokens, chunk < 2 ? 4 : 2);
    EXPECT_EQ(row.sample, chunk == 2);
    EXPECT_EQ(steps[0].tokens, want_tokens[chunk]);
    ASSERT_TRUE(Answer(s, 0, steps[0], 6).ok());
  }
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].seqs[0].position, 10);
  EXPECT_EQ(steps[0].seqs[0].num_tokens, 1);
}

// ---------------------------------------------------------------------------------------------
// Prefill budget

TEST(Scheduler, PrefillBudgetBoundsAStepsPromptTokensAndChunksTheLastThatFits) {
  SchedulerOptions o = Options();
  o.prefill_budget = 6;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1, 2}), kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  s.Enqueue(Request({1, 2, 3, 4, 5}), kNow);
  s.Enqueue(Request({11, 12, 13, 14, 15}), kNow);
  s.Admit(kNow);
  // The decode, the older prompt whole, one token of the younger.
  StepDescriptor step = NextStep(s, 0);
  ASSERT_EQ(step.seqs.size(), 3u);
  EXPECT_EQ(step.seqs[0].num_tokens, 1);
  EXPECT_TRUE(step.seqs[0].sample);
  EXPECT_EQ(step.seqs[1].num_tokens, 5);
  EXPECT_TRUE(step.seqs[1].sample);
  EXPECT_EQ(step.seqs[2].num_tokens, 1);
  EXPECT_FALSE(step.seqs[2].sample);
  EXPECT_EQ(step.tokens, (std::vector<int32_t>{7, 1, 2, 3, 4, 5, 11}));
  ASSERT_TRUE(Answer(s, 0, step, 7).ok());
  // Two decodes, the rest of the younger prompt from where it stopped.
  step = NextStep(s, 0);
  ASSERT_EQ(step.seqs.size(), 3u);
  EXPECT_EQ(step.seqs[2].position, 1);
  EXPECT_EQ(step.seqs[2].num_tokens, 4);
  EXPECT_TRUE(step.seqs[2].sample);
  EXPECT_EQ(step.tokens, (std::vector<int32_t>{7, 7, 12, 13, 14, 15}));
}

TEST(Scheduler, PrefillBudgetFeedsALongPromptAcrossStepsToItsEnd) {
  SchedulerOptions o = Options();
  o.prefill_chunk = 4;
  o.prefill_budget = 3;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}), kNow);
  s.Admit(kNow);
  for (int chunk = 0; chunk < 4; ++chunk) {
    const StepDescriptor step = NextStep(s, 0);
    ASSERT_EQ(step.seqs.size(), 1u) << chunk;
    EXPECT_EQ(step.seqs[0].position, 3 * chunk);
    EXPECT_EQ(step.seqs[0].num_tokens, chunk < 3 ? 3 : 1);
    EXPECT_EQ(step.seqs[0].sample, chunk == 3);
    ASSERT_TRUE(Answer(s, 0, step, 6).ok());
  }
  const StepDescriptor step = NextStep(s, 0);
  EXPECT_EQ(step.seqs[0].position, 10);
  EXPECT_THAT(step.tokens, ElementsAre(6));
}

TEST(Scheduler, PrefillBudgetServesPromptsOldestFirstWhileNewOnesArrive) {
  SchedulerOptions o = Options();
  o.prefill_budget = 4;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1, 2, 3, 4, 5, 6}), kNow);
  s.Enqueue(Request({11, 12}), kNow);
  s.Admit(kNow);
  StepDescriptor step = NextStep(s, 0);
  EXPECT_EQ(step.tokens, (std::vector<int32_t>{1, 2, 3, 4}));
  ASSERT_TRUE(Answer(s, 0, step, 7).ok());
  // A younger prompt that would fit whole waits behind the older ones.
  s.Enqueue(Request({21, 22, 23, 24}), kNow);
  s.Admit(kNow);
  step = NextStep(s, 0);
  EXPECT_EQ(step.tokens, (std::vector<int32_t>{5, 6, 11, 12}));
  ASSERT_TRUE(Answer(s, 0, step, 7).ok());
  step = NextStep(s, 0);
  EXPECT_EQ(step.tokens, (std::vector<int32_t>{7, 7, 21, 22, 23, 24}));
}

TEST(Scheduler, PrefillBudgetNeverHoldsBackADecodeBehindAPromptLeftOut) {
  SchedulerOptions o = AheadOptions();
  o.prefill_budget = 4;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1, 2}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> first = s.FormSteps(0);
  ASSERT_EQ(first.size(), 2u);  // the prompt, and the decode step behind it
  ASSERT_TRUE(Answer(s, 0, first[0], 7).ok());
  s.Enqueue(Request({11, 12, 13, 14, 15, 16}), kNow);
  s.Enqueue(Request({21, 22}), kNow);
  s.Admit(kNow);
  // Ready: the two prompts, then the sequence going ahead; the second prompt does not fit.
  const StepDescriptor step = NextStep(s, 0);
  ASSERT_EQ(step.seqs.size(), 2u);
  EXPECT_EQ(step.seqs[0].num_tokens, 4);
  EXPECT_EQ(step.seqs[1].num_tokens, 1);
  EXPECT_EQ(step.tokens, (std::vector<int32_t>{11, 12, 13, 14, kPreviousSample}));
}

TEST(Scheduler, ScoresPromptLogprobsChunkByChunkWithTheNextPromptToken) {
  SchedulerOptions o = Options();
  o.prefill_chunk = 3;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({11, 12, 13, 14, 15});
  r.prompt_logprobs = 2;
  r.logprobs = 1;
  s.Enqueue(r, kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  EXPECT_EQ(steps[0].seqs[0].prompt_logprobs, 2);
  EXPECT_EQ(steps[0].seqs[0].next_prompt_token, 14);  // the first token of the next chunk
  EXPECT_EQ(steps[0].seqs[0].logprobs, -1);           // nothing sampled in this chunk
  ASSERT_TRUE(Answer(s, 0, steps[0], 0).ok());
  steps = s.FormSteps(0);
  EXPECT_EQ(steps[0].seqs[0].prompt_logprobs, 2);
  EXPECT_EQ(steps[0].seqs[0].next_prompt_token, -1);
  EXPECT_EQ(steps[0].seqs[0].logprobs, 1);
  ASSERT_TRUE(Answer(s, 0, steps[0], 6).ok());
  steps = s.FormSteps(0);
  EXPECT_EQ(steps[0].seqs[0].prompt_logprobs, -1);  // the prompt is scored
}

// ---------------------------------------------------------------------------------------------
// Results, logprobs and stop rules

TEST(Scheduler, AppendsTokensAndLogprobsToTheRequest) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1, 2}, 2);
  r.logprobs = 0;
  r.prompt_logprobs = 0;
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  std::vector<SequenceLogprobs> lp(1);
  lp[0].seq = 0;
  lp[0].has_sampled = true;
  lp[0].sampled = {.token = 8, .logprob = -0.5f, .top = {}};
  lp[0].prompt = {{.token = 2, .logprob = -1.5f, .top = {}}};
  ASSERT_TRUE(s.OnStepResult(0, steps[0].id, std::vector<int32_t>{8}, lp, kNow).ok());
  steps = s.FormSteps(0);
  ASSERT_TRUE(Answer(s, 0, steps[0], 9).ok());
  const RequestState::Snapshot snap = Peek(req);
  EXPECT_THAT(snap.tokens, ElementsAre(8, 9));
  ASSERT_EQ(snap.logprobs.size(), 1u);  // the second result carried none
  EXPECT_EQ(snap.logprobs[0].logprob, -0.5f);
  ASSERT_EQ(snap.prompt_logprobs.size(), 1u);
  EXPECT_EQ(snap.prompt_logprobs[0].token, 2);
  EXPECT_TRUE(snap.done);
  EXPECT_EQ(snap.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(snap.admitted, kNow);
}

TEST(Scheduler, EndsOnAnyOfSeveralEosIdsAndFreesTheSlot) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1});
  r.eos_token_id = 50;
  r.eos_token_ids = {50, 51};
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  EXPECT_FALSE(Peek(req).done);
  steps = s.FormSteps(0);
  ASSERT_TRUE(Answer(s, 0, steps[0], 51).ok());  // the second EOS id
  const RequestState::Snapshot snap = Peek(req);
  EXPECT_TRUE(snap.done);
  EXPECT_TRUE(snap.status.ok());
  EXPECT_EQ(snap.finish, v1::FINISH_REASON_EOS);
  EXPECT_THAT(snap.tokens, ElementsAre(7, 51));
  EXPECT_EQ(s.running(0), 0);
  EXPECT_EQ(s.used_slots(0), 0);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
}

TEST(Scheduler, EndsOnAStopTokenId) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1});
  r.stop_token_ids = {30, 31};
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 31).ok());
  EXPECT_EQ(Peek(req).finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(Peek(req).text_limit, -1);
}

TEST(Scheduler, EndsAtTheEarliestOfSeveralStopStringsWithTheTextCut) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1});
  r.stop_strings = {"lo w", "or"};  // both in "Hello wor"; "lo w" starts first
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  for (int32_t token : {1, 2}) ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), token).ok());
  const RequestState::Snapshot snap = Peek(req);
  EXPECT_TRUE(snap.done);
  EXPECT_EQ(snap.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(snap.text_limit, 3);  // "Hel"
}

TEST(Scheduler, EndsOnAStopStringSplitAcrossTokens) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1});
  r.stop_strings = {"END"};
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 1).ok());  // "Hello"
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 4).ok());  // "Hello E"
  EXPECT_FALSE(Peek(req).done);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 5).ok());  // "Hello END"
  const RequestState::Snapshot snap = Peek(req);
  EXPECT_TRUE(snap.done);
  EXPECT_EQ(snap.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(snap.text_limit, 6);
}

TEST(Scheduler, MinTokensKeepsASequenceGoingPastEos) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1});
  r.eos_token_ids = {50};
  r.min_tokens = 2;
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 50).ok());
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 50).ok());
  EXPECT_FALSE(Peek(req).done);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 50).ok());
  EXPECT_EQ(Peek(req).finish, v1::FINISH_REASON_EOS);
  EXPECT_EQ(Peek(req).tokens.size(), 3u);
}

TEST(Scheduler, EndsWithLengthAtMaxNewTokens) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> req = s.Enqueue(Request({1}, 3), kNow);
  s.Admit(kNow);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  EXPECT_EQ(Peek(req).finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(Peek(req).tokens.size(), 3u);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
}

TEST(Scheduler, RefusesResultsThatDoNotFitTheStepNamingThePipeline) {
  Scheduler s(Options());
  s.AddPipeline(3, 1);
  s.Enqueue(Request({1}), kNow);
  s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(3);
  const absl::Status unknown = s.OnStepResult(3, 99, std::vector<int32_t>{1, 1}, {}, kNow);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(unknown.message(), HasSubstr("pipeline 3: result for unknown step 99"));
  const absl::Status count = s.OnStepResult(3, steps[0].id, std::vector<int32_t>{1}, {}, kNow);
  EXPECT_EQ(count.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(count.message(), HasSubstr("1 tokens returned, 2 expected"));
}

TEST(Scheduler, RefusesASampledTokenOutsideTheVocabulary) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  const absl::Status st = Answer(s, 0, NextStep(s, 0), 100);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(st.message(), HasSubstr("sampled token 100 outside the vocabulary"));
}

// ---------------------------------------------------------------------------------------------
// Cancellation

TEST(Scheduler, CancelsAWaitingRequestBeforeItIsAdmitted) {
  Scheduler s(Options());
  std::shared_ptr<RequestState> req = s.Enqueue(Request({1}), kNow);
  s.Cancel(req, absl::CancelledError("client left"), kNow);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(Peek(req).status.code(), absl::StatusCode::kCancelled);
  s.AddPipeline(0, 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 0);
}

TEST(Scheduler, CancelFreesTheSlotAtOnceAndTheStepInFlightSkipsTheSequence) {
  SchedulerOptions o = Options();
  o.max_slots = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> a = s.Enqueue(Request({1}), kNow);
  std::shared_ptr<RequestState> b = s.Enqueue(Request({2}), kNow);
  std::shared_ptr<RequestState> c = s.Enqueue(Request({3}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 1);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps[0].seqs.size(), 2u);
  s.Cancel(a, absl::DeadlineExceededError("deadline"), kNow);
  EXPECT_EQ(Peek(a).status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.free_slots(0), 1);
  s.Admit(kNow);  // c takes a's slot while a's step is still in flight
  EXPECT_EQ(s.waiting(), 0);
  // The step's result still carries a token for a; b gets its own.
  ASSERT_TRUE(s.OnStepResult(0, steps[0].id, std::vector<int32_t>{8, 9}, {}, kNow).ok());
  EXPECT_THAT(Peek(a).tokens, IsEmpty());
  EXPECT_THAT(Peek(b).tokens, ElementsAre(9));
  const std::vector<StepDescriptor> next = s.FormSteps(0);
  ASSERT_EQ(next[0].seqs.size(), 2u);
  EXPECT_EQ(next[0].seqs[0].slot, 1);  // b
  EXPECT_EQ(next[0].seqs[1].slot, 0);  // c, in a's old slot, from position 0
  EXPECT_EQ(next[0].seqs[1].position, 0);
}

// ---------------------------------------------------------------------------------------------
// Admission and slot accounting

TEST(Scheduler, AdmitsOnlyWhileSlotsAreFreeAndReusesTheFreedOne) {
  SchedulerOptions o = Options();
  o.max_slots = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (int i = 0; i < 3; ++i) reqs.push_back(s.Enqueue(Request({1}, i == 0 ? 1 : 9), kNow));
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 2);
  EXPECT_EQ(s.used_slots(0), 2);
  EXPECT_EQ(s.free_slots(0), 0);
  EXPECT_EQ(s.waiting(), 1);
  EXPECT_EQ(Peek(reqs[2]).admitted, absl::InfinitePast());
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());  // the first is done after one token
  EXPECT_EQ(s.used_slots(0), 1);
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.used_slots(0), 2);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps[0].seqs.size(), 2u);
  EXPECT_EQ(steps[0].seqs[1].slot, 0);  // the third request in the first's slot
}

TEST(Scheduler, AdmitsIntoTheLeastBusyPipelineAndNeverADrainingOne) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  s.AddPipeline(1, 1);
  s.AddPipeline(2, 1);
  s.SetDraining(2);
  for (int i = 0; i < 5; ++i) s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 3);  // 0, 1, 0, 1, 0: the lower id on ties
  EXPECT_EQ(s.running(1), 2);
  EXPECT_EQ(s.running(2), 0);
  EXPECT_TRUE(s.draining(2));
}

// Room (CheckRoom): the service holds its slots plus max_waiting requests, running or waiting.
TEST(Scheduler, RefusesARequestOnlyWhenTheSlotsAndTheWaitingBoundAreTaken) {
  SchedulerOptions o = Options();  // 4 slots a pipeline
  o.max_waiting = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  EXPECT_EQ(s.capacity(), 4);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(s.CheckRoom(1, 4).ok()) << i;
    s.Enqueue(Request({1}), kNow);
  }
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 4);
  ASSERT_TRUE(s.CheckRoom(1, 4).ok());  // the sixth waits behind the four running, as the fifth
  s.Enqueue(Request({1}), kNow);
  const absl::Status full = s.CheckRoom(1, 4);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("6 of the 6 requests it holds (4 KV slots plus "
                                        "--max_waiting 2)"));
  EXPECT_THAT(full.message(), HasSubstr("retry later"));
}

// A closed loop of as many clients as slots, whose requests admission holds back until they
// arrive together: waiting requests that free slots will take are not counted against the bound,
// even with none allowed beyond the slots.
TEST(Scheduler, AClosedLoopOfAsManyClientsAsSlotsIsNeverRefused) {
  SchedulerOptions o = HoldingOptions(4);
  o.max_waiting = 0;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  for (int round = 0; round < 3; ++round) {
    const absl::Time t = kNow + absl::Milliseconds(100 * round);
    // Each client's next request arrives before the scheduler admits the ones before it.
    std::vector<std::shared_ptr<RequestState>> requests;
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(s.CheckRoom(1, 4).ok()) << "round " << round << " client " << i;
      requests.push_back(s.Enqueue(Request({1}, /*max_new_tokens=*/2), t));
    }
    EXPECT_EQ(s.waiting(), 4);
    // A fifth client would be one too many.
    EXPECT_EQ(s.CheckRoom(1, 4).code(), absl::StatusCode::kResourceExhausted);
    s.Admit(t + absl::Milliseconds(30));
    ASSERT_EQ(s.running(0), 4);
    ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, t + absl::Milliseconds(31)).ok());
    ASSERT_TRUE(AnswerAt(s, 0, NextStep(s, 0), 5, t + absl::Milliseconds(32)).ok());
    for (const auto& r : requests) ASSERT_TRUE(Peek(r).done);
  }
}

// The sequences of a request (prompts x n) are counted together: on an idle service a request of
// more sequences than the waiting bound fits in the free slots; one that does not fit now is
// refused whole.
TEST(Scheduler, CountsTheSequencesOfARequestTogether) {
  SchedulerOptions o = Options();
  o.max_slots = 128;
  o.max_waiting = 64;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  EXPECT_TRUE(s.CheckRoom(81, 128).ok());
  EXPECT_TRUE(s.CheckRoom(192, 128).ok());
  for (int i = 0; i < 150; ++i) s.Enqueue(Request({1}), kNow);
  EXPECT_TRUE(s.CheckRoom(42, 128).ok());
  const absl::Status full = s.CheckRoom(43, 128);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("this one has 43"));
}

// A request of more sequences than the slots and the waiting bound can ever hold is invalid,
// whether or not the service is busy, naming the limits and the flags that raise them.
TEST(Scheduler, ARequestThatCanNeverBeAdmittedIsInvalidNotRetryLater) {
  SchedulerOptions o = Options();  // 4 slots a pipeline
  o.max_waiting = 3;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.AddPipeline(1, 1);
  EXPECT_TRUE(s.CheckRoom(11, 8).ok());
  const absl::Status never = s.CheckRoom(12, 8);
  EXPECT_EQ(never.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(never.message(), HasSubstr("12 sequences"));
  EXPECT_THAT(never.message(), HasSubstr("11 (8 KV slots"));
  EXPECT_THAT(never.message(), HasSubstr("--max_waiting 3"));
  EXPECT_THAT(never.message(), HasSubstr("--max_slots"));
  for (int i = 0; i < 11; ++i) s.Enqueue(Request({1}), kNow);
  EXPECT_EQ(s.CheckRoom(1, 8).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.CheckRoom(12, 8).code(), absl::StatusCode::kInvalidArgument);
  // Before the planned pipelines serve (or while one is lost), a request they would hold waits
  // for them or is refused for now, not as invalid.
  Scheduler starting(o);
  EXPECT_EQ(starting.capacity(), 0);
  EXPECT_TRUE(starting.CheckRoom(3, 8).ok());
  EXPECT_EQ(starting.CheckRoom(11, 8).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(starting.CheckRoom(12, 8).code(), absl::StatusCode::kInvalidArgument);
}

// Without a bound of its own, the service holds as many waiting requests as its planned slots,
// at least kMinDefaultWaiting.
TEST(Scheduler, TheWaitingBoundDefaultsToThePlannedSlotsAtLeast128) {
  SchedulerOptions o = Options();
  o.max_waiting = -1;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  s.AddPipeline(1, 1);
  EXPECT_TRUE(s.CheckRoom(8 + 128, 8).ok());
  EXPECT_EQ(s.CheckRoom(8 + 129, 8).code(), absl::StatusCode::kInvalidArgument);
  // Planned for 200 slots, of which 8 serve: 200 may wait, 400 fit once all serve.
  EXPECT_TRUE(s.CheckRoom(208, 200).ok());
  EXPECT_EQ(s.CheckRoom(400, 200).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.CheckRoom(401, 200).code(), absl::StatusCode::kInvalidArgument);
  for (int i = 0; i < 130; ++i) s.Enqueue(Request({1}), kNow);
  EXPECT_TRUE(s.CheckRoom(6, 8).ok());
  EXPECT_EQ(s.CheckRoom(7, 8).code(), absl::StatusCode::kResourceExhausted);
}

TEST(Scheduler, NamesRequestsWithoutAnId) {
  Scheduler s(Options());
  ValidatedRequest named = Request({1});
  named.request_id = "mine";
  EXPECT_EQ(s.Enqueue(named, kNow)->request().request_id, "mine");
  EXPECT_EQ(s.Enqueue(Request({1}), kNow)->request().request_id, "req-1");
}

TEST(Scheduler, RemovingAPipelineFailsItsSequencesAndForgetsItsSteps) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> req = s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  s.RemovePipeline(0, absl::UnavailableError("worker 1 is down"), kNow);
  EXPECT_EQ(Peek(req).status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.running(0), 0);
  EXPECT_EQ(Answer(s, 0, steps[0], 7).code(), absl::StatusCode::kInternal);
}

// Pipeline `lost` goes (a worker down: its sequences resume) and a one-stage pipeline `next`
// comes and admits.
void LoseAndReplace(Scheduler& s, int lost, int next) {
  s.RemovePipeline(lost, absl::UnavailableError("a worker is down"), kNow, /*resume=*/true);
  s.AddPipeline(next, 1);
  s.Admit(kNow);
}

// Resuming after a lost pipeline: the sequence is fed its prompt and every token it has, on the
// pipeline that takes it next, and continues where it was, with the same sampling counter.
TEST(Scheduler, ResumedSequenceRecomputesPromptAndTokensAndContinuesWithTheSameCounter) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1, 2, 3}, 5);
  r.sampling.temperature = 0.5f;
  r.sampling.seed = 42;
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 8).ok());
  const StepDescriptor lost = NextStep(s, 0);  // feeds 8, would sample the third token
  s.RemovePipeline(0, absl::UnavailableError("worker 1 is down"), kNow, /*resume=*/true);
  EXPECT_FALSE(Peek(req).done);
  EXPECT_EQ(s.waiting(), 1);
  EXPECT_EQ(Answer(s, 0, lost, 9).code(), absl::StatusCode::kInternal);  // forgotten
  s.AddPipeline(1, 1);
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.running(1), 1);
  const StepDescriptor again = NextStep(s, 1);
  EXPECT_THAT(again.tokens, ElementsAre(1, 2, 3, 7, 8));
  ASSERT_EQ(again.seqs.size(), 1u);
  EXPECT_EQ(again.seqs[0].position, 0);
  EXPECT_EQ(again.seqs[0].num_tokens, 5);
  EXPECT_TRUE(again.seqs[0].sample);
  EXPECT_EQ(again.seqs[0].sample_index, 2u);  // the third token's counter, as without the loss
  ASSERT_TRUE(Answer(s, 1, again, 9).ok());
  const StepDescriptor decode = NextStep(s, 1);
  EXPECT_THAT(decode.tokens, ElementsAre(9));
  EXPECT_EQ(decode.seqs[0].position, 5);
  EXPECT_EQ(decode.seqs[0].sample_index, 3u);
  ASSERT_TRUE(Answer(s, 1, decode, 4).ok());
  ASSERT_TRUE(Answer(s, 1, NextStep(s, 1), 5).ok());  // the fifth token: max_new_tokens
  const RequestState::Snapshot done = Peek(req);
  EXPECT_TRUE(done.done);
  EXPECT_TRUE(done.status.ok()) << done.status;
  EXPECT_EQ(done.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_THAT(done.tokens, ElementsAre(7, 8, 9, 4, 5));  // none lost, none repeated
  EXPECT_EQ(s.used_slots(1), 0);
}

// A sequence lost in the middle of its prompt starts the prompt over; stop strings see the text
// of the tokens from before the loss.
TEST(Scheduler, ResumedSequenceKeepsItsChunksAndItsStopStringAcrossTheLoss) {
  SchedulerOptions o = Options();
  o.prefill_chunk = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  ValidatedRequest r = Request({1, 2, 3});
  r.stop_strings = {"world"};
  std::shared_ptr<RequestState> req = s.Enqueue(r, kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 0).ok());  // the first chunk, no sample
  LoseAndReplace(s, 0, 1);
  StepDescriptor step = NextStep(s, 1);
  EXPECT_THAT(step.tokens, ElementsAre(1, 2));
  EXPECT_FALSE(step.seqs[0].sample);
  ASSERT_TRUE(Answer(s, 1, step, 0).ok());
  step = NextStep(s, 1);
  EXPECT_THAT(step.tokens, ElementsAre(3));
  ASSERT_TRUE(Answer(s, 1, step, 2).ok());  // " wor"
  LoseAndReplace(s, 1, 2);
  step = NextStep(s, 2);
  EXPECT_THAT(step.tokens, ElementsAre(1, 2));
  ASSERT_TRUE(Answer(s, 2, step, 0).ok());
  step = NextStep(s, 2);
  EXPECT_THAT(step.tokens, ElementsAre(3, 2));
  ASSERT_TRUE(Answer(s, 2, step, 3).ok());  // "ld": " world" ends it
  const RequestState::Snapshot done = Peek(req);
  EXPECT_TRUE(done.done);
  EXPECT_EQ(done.finish, v1::FINISH_REASON_STOP);
  EXPECT_THAT(done.tokens, ElementsAre(2, 3));
}

// Resumed sequences go ahead of every request that was waiting, in their admission order.
TEST(Scheduler, ResumedSequencesAreAdmittedBeforeWaitingRequests) {
  SchedulerOptions o = Options();
  o.max_slots = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> a = s.Enqueue(Request({1}), kNow);
  std::shared_ptr<RequestState> b = s.Enqueue(Request({2}), kNow);
  s.Admit(kNow);
  std::shared_ptr<RequestState> c = s.Enqueue(Request({3}), kNow);  // no slot: waits
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 1);
  s.RemovePipeline(0, absl::UnavailableError("worker 1 is down"), kNow, /*resume=*/true);
  EXPECT_EQ(s.waiting(), 3);
  s.AddPipeline(1, 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(1), 2);
  EXPECT_EQ(s.waiting(), 1);
  const StepDescriptor step = NextStep(s, 1);
  EXPECT_THAT(step.tokens, ElementsAre(1, 2));  // a and b; c still waits
}

// Each sequence is resumed at most max_resumes times, then fails with the cause; without resume
// (a failed step, the coordinator stopping) it fails at once, as does one scoring its prompt.
TEST(Scheduler, ResumesAtMostMaxResumesTimesAndOnlyWhenAsked) {
  SchedulerOptions o = Options();
  o.max_resumes = 2;
  Scheduler s(o);
  std::shared_ptr<RequestState> req = s.Enqueue(Request({1}), kNow);
  for (int id = 0; id < 3; ++id) {
    s.AddPipeline(id, 1);
    s.Admit(kNow);
    (void)s.FormSteps(id);
    s.RemovePipeline(id, absl::UnavailableError("worker is down"), kNow, /*resume=*/true);
  }
  const RequestState::Snapshot third = Peek(req);
  EXPECT_TRUE(third.done);
  EXPECT_EQ(third.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(third.status.message(), HasSubstr("worker is down"));
  EXPECT_THAT(third.status.message(), HasSubstr("resumed 2 times"));
  EXPECT_EQ(s.waiting(), 0);

  std::shared_ptr<RequestState> plain = s.Enqueue(Request({1}), kNow);
  ValidatedRequest scored = Request({1, 2});
  scored.prompt_logprobs = 1;
  std::shared_ptr<RequestState> scoring = s.Enqueue(scored, kNow);
  s.AddPipeline(9, 1);
  s.Admit(kNow);
  s.RemovePipeline(9, absl::InternalError("step failed"), kNow);
  EXPECT_EQ(Peek(plain).status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(Peek(scoring).status.code(), absl::StatusCode::kInternal);
}

// A resumed sequence still waiting can be cancelled (a deadline) or failed with the queue.
TEST(Scheduler, ResumedSequenceWaitingCanBeCancelledOrFailed) {
  Scheduler s(Options());
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> a = s.Enqueue(Request({1}), kNow);
  std::shared_ptr<RequestState> b = s.Enqueue(Request({2}), kNow);
  s.Admit(kNow);
  s.RemovePipeline(0, absl::UnavailableError("worker 1 is down"), kNow, /*resume=*/true);
  s.Cancel(a, absl::DeadlineExceededError("deadline"), kNow);
  EXPECT_EQ(Peek(a).status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.waiting(), 1);
  s.FailWaiting(absl::UnavailableError("no pipeline"), kNow);
  EXPECT_EQ(Peek(b).status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.waiting(), 0);
  s.AddPipeline(1, 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(1), 0);
}

// ---------------------------------------------------------------------------------------------
// Prefill and decode pipelines

// Ends every KV stream formed so far with `st` (the coordinator's "kv-stream" thread's part):
// the hand-offs of their sequences then go as they would without one.
void EndKvStreams(Scheduler& s,
                  const absl::Status& st = absl::UnavailableError("no KV stream in this test")) {
  for (const Scheduler::KvStream& k : s.TakeKvStreams()) s.KvStreamEnded(k.id, st);
}

// A prefill pipeline (0) and a decode pipeline (1), one stage each.
Scheduler Disaggregated(SchedulerOptions o = AheadOptions()) {
  Scheduler s(o);
  s.AddPipeline(0, 1, PipelineRole::kPrefill);
  s.AddPipeline(1, 1, PipelineRole::kDecode);
  return s;
}

// A sequence that ended in a hand-off keeps its two slots until the hand-off ends; its client's
// next request arrives meanwhile and is taken, to wait for the slot.
TEST(Scheduler, TheNextRequestOfAClientIsTakenBeforeTheSlotOfItsLastIsFreed) {
  SchedulerOptions o = AheadOptions();
  o.max_slots = 1;
  o.max_waiting = 0;
  Scheduler s = Disaggregated(o);
  EXPECT_EQ(s.capacity(), 1);  // the decode slots bound what runs at once
  ASSERT_TRUE(s.CheckRoom(1, 1).ok());
  auto a = s.Enqueue(Request({1, 2}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.CheckRoom(1, 1).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  EndKvStreams(s);
  std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  s.Cancel(a, absl::CancelledError("client"), kNow);
  EXPECT_EQ(s.used_slots(1), 1);
  ASSERT_TRUE(s.CheckRoom(1, 1).ok());
  s.Enqueue(Request({3}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 1);
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 1);
}

// The prompt runs in the prefill pipeline (no step ahead there), with a decode slot set aside; the
// first token reaches the client at once; then the sequence leaves the prefill pipeline, both
// slots held, until its KV-cache is in the decode slot, where it continues with the newest token
// at the next position and counter.
TEST(Scheduler, APromptRunsInAPrefillPipelineAndDecodesInADecodePipelineAfterItsHandoff) {
  Scheduler s = Disaggregated();
  auto req = s.Enqueue(Request({1, 2, 3}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 1);
  EXPECT_EQ(s.running(1), 0);
  EXPECT_EQ(s.used_slots(1), 1) << "a decode slot is set aside at admission";
  EXPECT_EQ(s.decode_ahead(0), 0);
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u) << "nothing goes ahead in a prefill pipeline";
  EXPECT_THAT(steps[0].tokens, ElementsAre(1, 2, 3));
  EXPECT_THAT(s.FormSteps(1), IsEmpty());
  EXPECT_FALSE(s.handoffs_ready());
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  EndKvStreams(s);
  EXPECT_THAT(Peek(req).tokens, ElementsAre(7));
  ASSERT_TRUE(s.handoffs_ready());
  const std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_FALSE(s.handoffs_ready());
  EXPECT_EQ(hs[0].from_pipeline, 0);
  EXPECT_EQ(hs[0].from_slot, steps[0].seqs[0].slot);
  EXPECT_EQ(hs[0].positions, 3);
  EXPECT_EQ(hs[0].to_pipeline, 1);
  EXPECT_EQ(s.running(0), 0);
  EXPECT_EQ(s.used_slots(0), 1) << "the prefill slot is read until the hand-off ends";
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  EXPECT_THAT(s.FormSteps(1), IsEmpty()) << "no step before its KV-cache is there";
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  EXPECT_EQ(s.used_slots(0), 0);
  EXPECT_EQ(s.running(1), 1);
  steps = s.FormSteps(1);
  ASSERT_EQ(steps.size(), 2u) << "the newest token, and a step ahead in the decode pipeline";
  EXPECT_THAT(steps[0].tokens, ElementsAre(7));
  EXPECT_EQ(steps[0].seqs[0].slot, hs[0].to_slot);
  EXPECT_EQ(steps[0].seqs[0].position, 3);
  EXPECT_EQ(steps[0].seqs[0].sample_index, 1u);
  ASSERT_TRUE(Answer(s, 1, steps[0], 8).ok());
  ASSERT_TRUE(Answer(s, 1, steps[1], 9).ok());
  EXPECT_THAT(Peek(req).tokens, ElementsAre(7, 8, 9));
  EXPECT_FALSE(s.handoffs_ready());
}

// A prompt in chunks hands off once, after the chunk that samples, with every position fed.
TEST(Scheduler, AChunkedPromptIsHandedOffAfterItsLastChunk) {
  SchedulerOptions o = AheadOptions();
  o.prefill_chunk = 2;
  Scheduler s = Disaggregated(o);
  s.Enqueue(Request({1, 2, 3, 4, 5}), kNow);
  s.Admit(kNow);
  for (int chunk = 0; chunk < 2; ++chunk) {
    ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 0).ok());
    EndKvStreams(s);
    EXPECT_FALSE(s.handoffs_ready()) << "chunk " << chunk;
  }
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  EndKvStreams(s);
  const std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_EQ(hs[0].positions, 5);
}

// Admission needs room in a prefill pipeline and in a decode pipeline: with four decode slots,
// a fifth request waits although the prefill pipeline has room, until a sequence ends.
TEST(Scheduler, AdmissionWaitsForADecodeSlotAsWellAsAPrefillSlot) {
  SchedulerOptions o = AheadOptions();
  o.max_slots = 4;
  Scheduler s(o);
  s.AddPipeline(0, 1, PipelineRole::kPrefill);
  s.AddPipeline(1, 1, PipelineRole::kDecode);
  s.AddPipeline(2, 1, PipelineRole::kPrefill);
  std::vector<std::shared_ptr<RequestState>> reqs;
  for (int i = 0; i < 5; ++i) reqs.push_back(s.Enqueue(Request({1}), kNow));
  s.Admit(kNow);
  EXPECT_EQ(s.running(0) + s.running(2), 4);
  EXPECT_EQ(s.running(0), 2) << "prompts spread over the prefill pipelines";
  EXPECT_EQ(s.used_slots(1), 4);
  EXPECT_EQ(s.waiting(), 1);
  s.Cancel(reqs[0], absl::CancelledError("client"), kNow);
  EXPECT_EQ(s.used_slots(1), 3) << "a sequence that ends frees the decode slot set aside";
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(s.used_slots(1), 4);
}

// A hand-off that fails frees both slots and recomputes the sequence through a prefill pipeline
// (its prompt and the token it has); one whose sequence ended meanwhile keeps both slots until
// it is done, and the sequence is not recomputed.
TEST(Scheduler, AFailedHandoffRecomputesAndAnEndedSequenceKeepsItsSlotsUntilTheHandoffEnds) {
  Scheduler s = Disaggregated();
  auto a = s.Enqueue(Request({1, 2}), kNow);
  auto b = s.Enqueue(Request({3}), kNow);
  s.Admit(kNow);
  const std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 1u);
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  EndKvStreams(s);
  std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 2u);
  s.Cancel(b, absl::CancelledError("client"), kNow);
  EXPECT_EQ(s.used_slots(0), 2);
  EXPECT_EQ(s.used_slots(1), 2);
  s.HandedOff(hs[1].id, true, absl::OkStatus(), kNow);
  EXPECT_EQ(s.used_slots(0), 1);
  EXPECT_EQ(s.used_slots(1), 1);
  EXPECT_EQ(s.running(1), 0);
  s.HandedOff(hs[0].id, false, absl::UnavailableError("fetch failed"), kNow);
  EXPECT_EQ(s.used_slots(0), 0);
  EXPECT_EQ(s.used_slots(1), 0);
  EXPECT_EQ(s.waiting(), 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 1);
  const StepDescriptor again = NextStep(s, 0);
  EXPECT_THAT(again.tokens, ElementsAre(1, 2, 7));
  EXPECT_EQ(again.seqs[0].sample_index, 1u);
  ASSERT_TRUE(Answer(s, 0, again, 8).ok());
  EndKvStreams(s);
  EXPECT_THAT(Peek(a).tokens, ElementsAre(7, 8));
  EXPECT_EQ(s.TakeHandoffs().size(), 1u);
}

// A sequence that ends with its first token is not handed off, and its decode slot is free again.
// Without a decode pipeline (or once its decode pipeline is gone) a prefill pipeline serves as
// both.
TEST(Scheduler, NoHandoffForASequenceThatEndsOrWithoutADecodePipeline) {
  Scheduler s = Disaggregated();
  auto one = s.Enqueue(Request({1}, /*max_new_tokens=*/1), kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  EndKvStreams(s);
  EXPECT_TRUE(Peek(one).done);
  EXPECT_FALSE(s.handoffs_ready());
  EXPECT_EQ(s.used_slots(1), 0);

  auto orphan = s.Enqueue(Request({1}, 3), kNow);
  s.Admit(kNow);
  const StepDescriptor prompt = NextStep(s, 0);
  s.RemovePipeline(1, absl::UnavailableError("decode worker down"), kNow, /*resume=*/true);
  ASSERT_TRUE(Answer(s, 0, prompt, 7).ok());
  EndKvStreams(s);
  EXPECT_FALSE(s.handoffs_ready()) << "its decode pipeline is gone: it decodes where it is";
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 8).ok());
  EndKvStreams(s);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 9).ok());
  EXPECT_THAT(Peek(orphan).tokens, ElementsAre(7, 8, 9));

  Scheduler only(AheadOptions());
  only.AddPipeline(0, 1, PipelineRole::kPrefill);
  auto r = only.Enqueue(Request({1}, 2), kNow);
  only.Admit(kNow);
  ASSERT_TRUE(Answer(only, 0, NextStep(only, 0), 7).ok());
  EXPECT_FALSE(only.handoffs_ready());
  ASSERT_TRUE(Answer(only, 0, NextStep(only, 0), 8).ok());
  EXPECT_THAT(Peek(r).tokens, ElementsAre(7, 8));
}

// In `s` (one decode slot): a sequence handed off to the decode pipeline ends with a stop token
// while the step after it, which still uses its slot, is in flight; that step in `ahead`.
void StopWhileAStepAheadRuns(Scheduler& s, StepDescriptor& ahead) {
  ValidatedRequest r = Request({1});
  r.stop_token_ids = {5};
  s.Enqueue(r, kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  EndKvStreams(s);
  const std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  const std::vector<StepDescriptor> decode = s.FormSteps(1);
  ASSERT_EQ(decode.size(), 2u);
  ASSERT_TRUE(Answer(s, 1, decode[0], 5).ok());  // the stop token
  ahead = decode[1];
}

// A decode slot freed while a step that uses it still runs (decode-ahead after a stop token) is
// written by an import only once that step is done: the import is outside the step order.
TEST(Scheduler, AHandoffWaitsForTheStepsStillUsingItsDecodeSlot) {
  SchedulerOptions o = AheadOptions();
  o.max_slots = 1;
  Scheduler s = Disaggregated(o);
  StepDescriptor ahead;
  ASSERT_NO_FATAL_FAILURE(StopWhileAStepAheadRuns(s, ahead));
  EXPECT_EQ(s.free_slots(1), 1) << "a sequence that ends frees its slot at once";
  std::vector<Scheduler::Handoff> hs;

  s.Enqueue(Request({2}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.used_slots(1), 1) << "the next sequence sets the slot aside";
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 8).ok());
  EndKvStreams(s);
  EXPECT_FALSE(s.handoffs_ready()) << "the step ahead still uses the slot";
  EXPECT_THAT(s.TakeHandoffs(), IsEmpty());
  ASSERT_TRUE(Answer(s, 1, ahead, 6).ok());
  EXPECT_TRUE(s.handoffs_ready());
  hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_EQ(hs[0].to_slot, ahead.seqs[0].slot);
}

// A decode pipeline lost while a hand-off into it runs: the sequence is recomputed even though
// its KV-cache was written (there is nowhere to decode it).
TEST(Scheduler, AHandoffIntoALostDecodePipelineIsRecomputed) {
  Scheduler s = Disaggregated();
  s.AddPipeline(2, 1, PipelineRole::kDecode);
  auto req = s.Enqueue(Request({1}), kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  EndKvStreams(s);
  const std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  s.RemovePipeline(hs[0].to_pipeline, absl::UnavailableError("down"), kNow, true);
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  EXPECT_EQ(s.used_slots(0), 0);
  EXPECT_EQ(s.waiting(), 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 1) << "through the prefill pipeline again";
  EXPECT_FALSE(Peek(req).done);
}

// The step that ends a prompt in a prefill pipeline writes its KV-cache out (the chunks before it
// do not), and a KV stream into its decode slot starts as that step is formed: the hand-off
// waits for the stream, and one that came through moves nothing more.
TEST(Scheduler, APromptsLastStepWritesItsKvCacheOutAndStreamsItIntoItsDecodeSlot) {
  SchedulerOptions o = AheadOptions();
  o.prefill_chunk = 2;
  Scheduler s = Disaggregated(o);
  auto req = s.Enqueue(Request({1, 2, 3, 4, 5}), kNow);
  s.Admit(kNow);
  for (int chunk = 0; chunk < 2; ++chunk) {
    const StepDescriptor step = NextStep(s, 0);
    EXPECT_EQ(step.seqs[0].kv_out_key, 0u) << "chunk " << chunk;
    EXPECT_FALSE(s.kv_streams_ready()) << "chunk " << chunk;
    ASSERT_TRUE(Answer(s, 0, step, 0).ok());
  }
  const StepDescriptor last = NextStep(s, 0);
  ASSERT_NE(last.seqs[0].kv_out_key, 0u);
  ASSERT_TRUE(s.kv_streams_ready());
  const std::vector<Scheduler::KvStream> ks = s.TakeKvStreams();
  ASSERT_EQ(ks.size(), 1u);
  EXPECT_FALSE(s.kv_streams_ready());
  EXPECT_EQ(ks[0].seq, last.seqs[0].kv_out_key);
  EXPECT_EQ(ks[0].step, last.id);
  EXPECT_EQ(ks[0].from_pipeline, 0);
  EXPECT_EQ(ks[0].to_pipeline, 1);
  EXPECT_EQ(ks[0].positions, 5);
  ASSERT_TRUE(Answer(s, 0, last, 7).ok());
  EXPECT_THAT(Peek(req).tokens, ElementsAre(7));
  EXPECT_FALSE(s.handoffs_ready()) << "the hand-off waits for the stream";
  s.KvStreamEnded(ks[0].id, absl::OkStatus());
  ASSERT_TRUE(s.handoffs_ready());
  const std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_TRUE(hs[0].streamed);
  EXPECT_EQ(hs[0].kv_out_step, last.id);
  EXPECT_EQ(hs[0].to_slot, ks[0].to_slot);
  EXPECT_EQ(hs[0].positions, 5);
  s.HandedOff(hs[0].id, true, absl::OkStatus(), kNow);
  const std::vector<StepDescriptor> decode = s.FormSteps(1);
  ASSERT_FALSE(decode.empty());
  EXPECT_EQ(decode[0].seqs[0].slot, ks[0].to_slot);
  EXPECT_EQ(decode[0].seqs[0].position, 5);
  EXPECT_EQ(decode[0].seqs[0].kv_out_key, 0u) << "decode steps write nothing out";
}

// A stream that failed, whether it ends before or after the first token, leaves the hand-off to
// move the KV-cache after the prompt, from the step's write-out.
TEST(Scheduler, AFailedKvStreamLeavesTheHandoffToMoveTheKvCache) {
  Scheduler s = Disaggregated();
  s.Enqueue(Request({1, 2}), kNow);
  s.Admit(kNow);
  const StepDescriptor prompt = NextStep(s, 0);
  const std::vector<Scheduler::KvStream> ks = s.TakeKvStreams();
  ASSERT_EQ(ks.size(), 1u);
  s.KvStreamEnded(ks[0].id, absl::UnavailableError("fetch failed"));
  EXPECT_FALSE(s.handoffs_ready()) << "no first token yet";
  ASSERT_TRUE(Answer(s, 0, prompt, 7).ok());
  const std::vector<Scheduler::Handoff> hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_FALSE(hs[0].streamed);
  EXPECT_EQ(hs[0].kv_out_step, prompt.id);
}

// A decode slot that a step in flight still uses gets no stream (the import would race that
// step): the prompt is still written out, and handed off once the step is done.
TEST(Scheduler, NoKvStreamIntoADecodeSlotThatAStepInFlightUses) {
  SchedulerOptions o = AheadOptions();
  o.max_slots = 1;
  Scheduler s = Disaggregated(o);
  StepDescriptor ahead;
  ASSERT_NO_FATAL_FAILURE(StopWhileAStepAheadRuns(s, ahead));
  std::vector<Scheduler::Handoff> hs;

  s.Enqueue(Request({2}), kNow);
  s.Admit(kNow);
  const StepDescriptor prompt = NextStep(s, 0);
  EXPECT_NE(prompt.seqs[0].kv_out_key, 0u);
  EXPECT_FALSE(s.kv_streams_ready());
  ASSERT_TRUE(Answer(s, 0, prompt, 8).ok());
  EXPECT_FALSE(s.handoffs_ready());
  ASSERT_TRUE(Answer(s, 1, ahead, 6).ok());
  hs = s.TakeHandoffs();
  ASSERT_EQ(hs.size(), 1u);
  EXPECT_FALSE(hs[0].streamed);
  EXPECT_EQ(hs[0].kv_out_step, prompt.id);
}

// A prompt whose first token is its last (max_tokens 1, or the context's end) is not written out
// and gets no stream: it never decodes.
TEST(Scheduler, APromptThatEndsWithItsFirstTokenIsNotWrittenOut) {
  Scheduler s = Disaggregated();
  s.Enqueue(Request({1, 2}, /*max_new_tokens=*/1), kNow);
  s.Enqueue(Request({3}, /*max_new_tokens=*/2), kNow);
  s.Admit(kNow);
  const StepDescriptor prompt = NextStep(s, 0);
  ASSERT_EQ(prompt.seqs.size(), 2u);
  EXPECT_EQ(prompt.seqs[0].kv_out_key, 0u);
  EXPECT_NE(prompt.seqs[1].kv_out_key, 0u);
  const std::vector<Scheduler::KvStream> ks = s.TakeKvStreams();
  ASSERT_EQ(ks.size(), 1u);
  EXPECT_EQ(ks[0].seq, prompt.seqs[1].kv_out_key);
}

// A sequence that ends while its stream runs (its first token is its last, or the client went
// away) leaves its decode slot to the stream until the stream ends: nothing else is imported
// there meanwhile.
TEST(Scheduler, AKvStreamKeepsItsDecodeSlotUntilItEndsWhateverHappensToItsSequence) {
  SchedulerOptions o = AheadOptions();
  o.max_slots = 2;
  Scheduler s = Disaggregated(o);
  ValidatedRequest stops = Request({1});
  stops.stop_token_ids = {7};
  auto one = s.Enqueue(stops, kNow);
  auto gone = s.Enqueue(Request({2, 3}), kNow);
  s.Admit(kNow);
  const StepDescriptor prompt = NextStep(s, 0);
  const std::vector<Scheduler::KvStream> ks = s.TakeKvStreams();
  ASSERT_EQ(ks.size(), 2u);
  s.Cancel(gone, absl::CancelledError("client"), kNow);
  ASSERT_TRUE(Answer(s, 0, prompt, 7).ok());
  EXPECT_TRUE(Peek(one).done);
  EXPECT_FALSE(s.handoffs_ready());
  EXPECT_EQ(s.used_slots(1), 2) << "both decode slots are the streams'";
  s.Enqueue(Request({4}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 1) << "no decode slot to set aside";
  s.KvStreamEnded(ks[1].id, absl::OkStatus());
  EXPECT_EQ(s.used_slots(1), 1);
  s.KvStreamEnded(ks[0].id, absl::UnavailableError("fetch failed"));
  EXPECT_EQ(s.used_slots(1), 0);
  s.Admit(kNow);
  EXPECT_EQ(s.waiting(), 0);
}

// ---------------------------------------------------------------------------------------------
// Moving sequences with their KV-cache

// A paused pipeline forms no step and admits nothing; once its steps are done its sequences
// leave with their slot and the positions they were fed, and continue in the slot of the new
// pipeline where they stopped: the next step feeds the newest token at the next position with
// the next counter, nothing fed again.
TEST(Scheduler, MovedSequenceContinuesWhereItWasWithoutRecomputing) {
  SchedulerOptions o = Options();
  o.decode_ahead = true;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> other = s.Enqueue(Request({5}), kNow);
  s.Admit(kNow);
  std::shared_ptr<RequestState> req = s.Enqueue(Request({1, 2, 3}, 6), kNow);
  s.Admit(kNow);
  s.Cancel(other, absl::CancelledError("gone"), kNow);  // req keeps slot 1; slot 0 is free
  // Two steps in flight (the prompt, and decode-ahead's next one) when the pause comes: both end
  // as usual.
  std::vector<StepDescriptor> steps = s.FormSteps(0);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[1].tokens[0], kPreviousSample);
  s.Pause(0);
  EXPECT_THAT(s.FormSteps(0), IsEmpty());
  std::shared_ptr<RequestState> late = s.Enqueue(Request({4}), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.running(0), 1) << "a paused pipeline admits nothing";
  EXPECT_EQ(s.steps_in_flight(0), 2);
  ASSERT_TRUE(Answer(s, 0, steps[0], 7).ok());
  ASSERT_TRUE(Answer(s, 0, steps[1], 8).ok());
  EXPECT_EQ(s.steps_in_flight(0), 0);
  const std::vector<Scheduler::Held> held = s.Detach(0);
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].slot, 1);
  EXPECT_EQ(held[0].positions, 4);  // 1 2 3 7 fed; 8 not yet
  EXPECT_EQ(s.held(), 1);
  EXPECT_EQ(s.waiting(), 1);  // `late` only
  s.AddPipeline(1, 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(1), 0) << "held sequences take their slots before waiting requests";
  const std::optional<Scheduler::Target> to = s.PlaceHeld(held[0].seq);
  ASSERT_TRUE(to.has_value());
  EXPECT_EQ(to->pipeline, 1);
  EXPECT_EQ(to->slot, 0);
  EXPECT_EQ(s.held(), 0);
  EXPECT_THAT(s.FormSteps(1), IsEmpty()) << "no step before its KV-cache is in place";
  s.Moved(held[0].seq, true, absl::OkStatus(), kNow);
  s.Admit(kNow);  // now `late` comes in too
  EXPECT_EQ(s.running(1), 2);
  const std::vector<StepDescriptor> after = s.FormSteps(1);  // and decode-ahead's next one
  ASSERT_FALSE(after.empty());
  const StepDescriptor& next = after[0];
  ASSERT_EQ(next.seqs.size(), 2u);
  EXPECT_EQ(next.seqs[0].slot, 0);
  EXPECT_EQ(next.seqs[0].position, 4);
  EXPECT_EQ(next.seqs[0].num_tokens, 1);
  EXPECT_EQ(next.seqs[0].sample_index, 2u);
  EXPECT_EQ(next.tokens[0], 8);
  ASSERT_TRUE(Answer(s, 1, next, 9).ok());
  EXPECT_THAT(Peek(req).tokens, ElementsAre(7, 8, 9));
  EXPECT_FALSE(Peek(req).done);
}

// A sequence whose KV-cache did not arrive, or that found no room, is recomputed instead; one
// cancelled while held or while it moves is skipped.
TEST(Scheduler, SequenceWhoseMoveFailsIsRecomputedAndCancelledOnesAreSkipped) {
  SchedulerOptions o = Options();
  o.max_slots = 2;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> a = s.Enqueue(Request({1, 2}), kNow);
  std::shared_ptr<RequestState> b = s.Enqueue(Request({3}), kNow);
  s.Admit(kNow);
  ASSERT_TRUE(Answer(s, 0, NextStep(s, 0), 7).ok());
  s.Pause(0);
  const std::vector<Scheduler::Held> held = s.Detach(0);
  ASSERT_EQ(held.size(), 2u);
  ASSERT_EQ(s.waiting(), 0);
  EXPECT_FALSE(s.PlaceHeld(held[0].seq).has_value()) << "no pipeline yet";
  s.AddPipeline(1, 1);
  ASSERT_TRUE(s.PlaceHeld(held[0].seq).has_value());
  s.Moved(held[0].seq, false, absl::UnavailableError("ImportKv failed"), kNow);
  EXPECT_EQ(s.running(1), 0);
  EXPECT_EQ(s.used_slots(1), 0);
  EXPECT_EQ(s.waiting(), 1);  // back in the queue, to be recomputed
  s.Cancel(b, absl::CancelledError("client went away"), kNow);
  EXPECT_EQ(s.held(), 0);
  s.Moved(held[1].seq, true, absl::OkStatus(), kNow);  // ended meanwhile: nothing happens
  s.Admit(kNow);
  const StepDescriptor again = NextStep(s, 1);
  EXPECT_THAT(again.tokens, ElementsAre(1, 2, 7));
  EXPECT_EQ(again.seqs[0].position, 0);
  EXPECT_EQ(Peek(b).status.code(), absl::StatusCode::kCancelled);
}

// A sequence admitted into the paused pipeline but not fed yet has no KV-cache to move: it
// starts in the new layout from its prompt, before the waiting requests and after the moved ones
// are placed, and is not counted as recomputed.
TEST(Scheduler, SequenceNotFedYetStartsOverWithoutAMove) {
  SchedulerOptions o = Options();
  o.max_batch = 1;
  o.micro_batches = 1;
  Scheduler s(o);
  s.AddPipeline(0, 1);
  std::shared_ptr<RequestState> fed = s.Enqueue(Request({1, 2}, 2), kNow);
  std::shared_ptr<RequestState> unfed = s.Enqueue(Request({3, 4}), kNow);
  s.Admit(kNow);
  const StepDescriptor first = NextStep(s, 0);  // max_batch 1: only `fed`'s prompt
  ASSERT_THAT(first.tokens, ElementsAre(1, 2));
  s.Pause(0);
  ASSERT_TRUE(Answer(s, 0, first, 7).ok());
  std::shared_ptr<RequestState> later = s.Enqueue(Request({5}), kNow);
  const std::vector<Scheduler::Held> held = s.Detach(0);
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].positions, 2);
  EXPECT_EQ(s.waiting(), 2);  // `unfed` and `later`
  s.AddPipeline(1, 1);
  s.Admit(kNow);
  EXPECT_EQ(s.running(1), 0) << "the held sequence is placed first";
  ASSERT_TRUE(s.PlaceHeld(held[0].seq).has_value());
  s.Moved(held[0].seq, true, absl::OkStatus(), kNow);
  s.Admit(kNow);
  EXPECT_EQ(s.running(1), 3);
  const StepDescriptor decode = NextStep(s, 1);  // `fed` decodes on at its position
  EXPECT_THAT(decode.tokens, ElementsAre(7));
  EXPECT_EQ(decode.seqs[0].position, 2);
  ASSERT_TRUE(Answer(s, 1, decode, 8).ok());  // its second token: max_new_tokens
  EXPECT_TRUE(Peek(fed).done);
  const StepDescriptor prompt = NextStep(s, 1);  // then `unfed` from its prompt
  EXPECT_THAT(prompt.tokens, ElementsAre(3, 4));
  EXPECT_EQ(prompt.seqs[0].position, 0);
  EXPECT_EQ(prompt.seqs[0].sample_index, 0u);
}

TEST(Scheduler, FailWaitingEndsEveryQueuedRequest) {
  Scheduler s(Options());
  std::shared_ptr<RequestState> a = s.Enqueue(Request({1}), kNow);
  std::shared_ptr<RequestState> b = s.Enqueue(Request({1}), kNow);
  s.FailWaiting(absl::UnavailableError("shutting down"), kNow);
  EXPECT_EQ(s.waiting(), 0);
  EXPECT_EQ(Peek(a).status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Peek(b).status.code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tandem
