#include "coordinator/step_proto.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;

TEST(ToStepRequest, CarriesEveryFieldOfARow) {
  StepDescriptor step;
  step.id = 7;
  SequenceStep row;
  row.slot = 3;
  row.position = 12;
  row.num_tokens = 2;
  row.sample = true;
  row.sampling = {.temperature = 0.5f,
                  .top_k = 40,
                  .top_p = 0.9f,
                  .seed = 99,
                  .min_p = 0.1f,
                  .presence_penalty = 0.2f,
                  .frequency_penalty = 0.3f,
                  .repetition_penalty = 1.2f};
  row.sample_index = 5;
  row.seen = {{.id = 11, .output_count = 2, .in_prompt = true}};
  row.logprobs = 3;
  row.prompt_logprobs = 1;
  row.next_prompt_token = 42;
  step.seqs.push_back(row);
  step.tokens = {100, 101};
  const v1::StepRequest req = ToStepRequest(step, /*assignment_id=*/4);
  EXPECT_EQ(req.assignment_id(), 4u);
  EXPECT_EQ(req.step_id(), 7u);
  ASSERT_EQ(req.seqs_size(), 1);
  const v1::SequenceStep& ss = req.seqs(0);
  EXPECT_EQ(ss.slot(), 3);
  EXPECT_EQ(ss.position(), 12);
  EXPECT_EQ(ss.num_tokens(), 2);
  EXPECT_TRUE(ss.sample());
  EXPECT_EQ(ss.temperature(), 0.5f);
  EXPECT_EQ(ss.top_k(), 40);
  EXPECT_EQ(ss.top_p(), 0.9f);
  EXPECT_EQ(ss.seed(), 99u);
  EXPECT_EQ(ss.min_p(), 0.1f);
  EXPECT_EQ(ss.presence_penalty(), 0.2f);
  EXPECT_EQ(ss.frequency_penalty(), 0.3f);
  EXPECT_EQ(ss.repetition_penalty(), 1.2f);
  EXPECT_EQ(ss.sample_index(), 5u);
  EXPECT_THAT(ss.seen_token_ids(), ElementsAre(11));
  EXPECT_THAT(ss.seen_output_counts(), ElementsAre(2));
  EXPECT_THAT(ss.seen_in_prompt(), ElementsAre(true));
  EXPECT_TRUE(ss.logprobs());
  EXPECT_EQ(ss.top_logprobs(), 3);
  EXPECT_TRUE(ss.prompt_logprobs());
  EXPECT_EQ(ss.prompt_top_logprobs(), 1);
  EXPECT_EQ(ss.next_prompt_token(), 42);
  EXPECT_THAT(req.tokens(), ElementsAre(100, 101));
}

TEST(ToStepRequest, LeavesLogprobsOffWhenARowAsksForNone) {
  StepDescriptor step;
  step.seqs.emplace_back();
  const v1::SequenceStep ss = ToStepRequest(step, 1).seqs(0);
  EXPECT_FALSE(ss.logprobs());
  EXPECT_FALSE(ss.prompt_logprobs());
  EXPECT_EQ(ss.next_prompt_token(), 0);
}

TEST(LogprobsFromProto, ReadsSampledAndPromptEntries) {
  v1::StepResult r;
  v1::SequenceLogprobs* l = r.add_logprobs();
  l->set_seq(2);
  l->mutable_sampled()->set_token_id(5);
  l->mutable_sampled()->set_logprob(-0.25f);
  v1::TopLogprob* top = l->mutable_sampled()->add_top_logprobs();
  top->set_token_id(6);
  top->set_logprob(-1.0f);
  l->add_prompt()->set_token_id(8);
  r.add_logprobs()->set_seq(0);  // prompt logprobs only, none yet
  const std::vector<SequenceLogprobs> out = LogprobsFromProto(r);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].seq, 2);
  EXPECT_TRUE(out[0].has_sampled);
  EXPECT_EQ(out[0].sampled.token, 5);
  EXPECT_EQ(out[0].sampled.logprob, -0.25f);
  EXPECT_THAT(out[0].sampled.top, ElementsAre(std::make_pair(6, -1.0f)));
  ASSERT_EQ(out[0].prompt.size(), 1u);
  EXPECT_EQ(out[0].prompt[0].token, 8);
  EXPECT_FALSE(out[1].has_sampled);
}

}  // namespace
}  // namespace tandem
