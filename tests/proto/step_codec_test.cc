#include "proto/step_codec.h"

#include <cstdint>
#include <limits>

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

// Every field of a descriptor compared; return_logits is not carried (proto/step_codec.h).
void ExpectSameStep(const StepDescriptor& a, const StepDescriptor& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.seqs.size(), b.seqs.size());
  for (size_t i = 0; i < a.seqs.size(); ++i) {
    SCOPED_TRACE(i);
    const SequenceStep& x = a.seqs[i];
    const SequenceStep& y = b.seqs[i];
    EXPECT_EQ(x.slot, y.slot);
    EXPECT_EQ(x.position, y.position);
    EXPECT_EQ(x.num_tokens, y.num_tokens);
    EXPECT_EQ(x.sample, y.sample);
    EXPECT_EQ(x.sampling.temperature, y.sampling.temperature);
    EXPECT_EQ(x.sampling.top_k, y.sampling.top_k);
    EXPECT_EQ(x.sampling.top_p, y.sampling.top_p);
    EXPECT_EQ(x.sampling.seed, y.sampling.seed);
    EXPECT_EQ(x.sampling.min_p, y.sampling.min_p);
    EXPECT_EQ(x.sampling.presence_penalty, y.sampling.presence_penalty);
    EXPECT_EQ(x.sampling.frequency_penalty, y.sampling.frequency_penalty);
    EXPECT_EQ(x.sampling.repetition_penalty, y.sampling.repetition_penalty);
    EXPECT_EQ(x.sample_index, y.sample_index);
    ASSERT_EQ(x.seen.size(), y.seen.size());
    for (size_t k = 0; k < x.seen.size(); ++k) {
      EXPECT_EQ(x.seen[k].id, y.seen[k].id);
      EXPECT_EQ(x.seen[k].output_count, y.seen[k].output_count);
      EXPECT_EQ(x.seen[k].in_prompt, y.seen[k].in_prompt);
    }
    EXPECT_EQ(x.logprobs, y.logprobs);
    EXPECT_EQ(x.prompt_logprobs, y.prompt_logprobs);
    EXPECT_EQ(x.next_prompt_token, y.next_prompt_token);
    EXPECT_EQ(x.kv_out_key, y.kv_out_key);
    EXPECT_EQ(x.block_table, y.block_table);
  }
}

TEST(StepCodec, RoundTripsEveryFieldAtItsEdges) {
  StepDescriptor step;
  step.id = std::numeric_limits<uint64_t>::max();
  SequenceStep full;
  full.slot = std::numeric_limits<int32_t>::max();
  full.position = 0;
  full.num_tokens = 3;
  full.sample = false;
  full.sampling = {.temperature = 2.0f,
                   .top_k = 1,
                   .top_p = 0.01f,
                   .seed = std::numeric_limits<uint64_t>::max(),
                   .min_p = 1.0f,
                   .presence_penalty = -2.0f,
                   .frequency_penalty = 2.0f,
                   .repetition_penalty = 100.0f};
  full.sample_index = std::numeric_limits<uint64_t>::max() - 1;
  full.seen = {{.id = 0, .output_count = 0, .in_prompt = true},
               {.id = std::numeric_limits<int32_t>::max(), .output_count = 7, .in_prompt = false}};
  full.logprobs = 0;
  full.prompt_logprobs = kMaxTopLogprobs;
  full.next_prompt_token = 0;
  full.kv_out_key = std::numeric_limits<uint64_t>::max();
  full.block_table = {7, 0, std::numeric_limits<int32_t>::max(), 3};  // pages in any order
  step.seqs.push_back(full);
  SequenceStep plain;  // every default: decode, greedy, no logprobs, no penalties
  plain.slot = 0;
  plain.position = std::numeric_limits<int32_t>::max() - 1;
  step.seqs.push_back(plain);
  SequenceStep last_chunk;  // prompt logprobs on the chunk that samples: no next prompt token
  last_chunk.num_tokens = 2;
  last_chunk.logprobs = kMaxTopLogprobs;
  last_chunk.prompt_logprobs = 0;
  last_chunk.next_prompt_token = -1;
  step.seqs.push_back(last_chunk);
  step.tokens = {0, 1, std::numeric_limits<int32_t>::max(), 5, kPreviousSample, 9};
  const v1::StepRequest req = ToStepRequest(step, /*assignment_id=*/1);
  ExpectSameStep(FromStepRequest(req), step);
  // And through the bytes, as the wire carries it.
  v1::StepRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(req.SerializeAsString()));
  ExpectSameStep(FromStepRequest(parsed), step);
}

TEST(StepCodec, RoundTripsAnEmptyStep) {
  StepDescriptor step;
  ExpectSameStep(FromStepRequest(ToStepRequest(step, 0)), step);
}

TEST(FromStepRequest, ReadsAnUnsetRepetitionPenaltyAsOff) {
  v1::StepRequest req;
  req.add_seqs();
  EXPECT_EQ(FromStepRequest(req).seqs[0].sampling.repetition_penalty, 1.0f);
}

TEST(FromStepRequest, ReadsSeenTokensUpToTheShortestList) {
  v1::StepRequest req;
  v1::SequenceStep* s = req.add_seqs();
  s->add_seen_token_ids(4);
  s->add_seen_token_ids(5);
  s->add_seen_output_counts(1);
  s->add_seen_in_prompt(true);
  s->add_seen_in_prompt(false);
  const std::vector<SeenToken> seen = FromStepRequest(req).seqs[0].seen;
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].id, 4);
  EXPECT_EQ(seen[0].output_count, 1);
  EXPECT_TRUE(seen[0].in_prompt);
}

TEST(StepCodec, RoundTripsLogprobs) {
  std::vector<SequenceLogprobs> in(3);
  in[0].seq = 0;
  in[0].has_sampled = true;
  in[0].sampled = {.token = 3, .logprob = -0.5f, .top = {{3, -0.5f}, {9, -2.0f}}};
  in[1].seq = 2;  // prompt logprobs only
  in[1].prompt = {{.token = 1, .logprob = 0.0f, .top = {}},
                  {.token = 2, .logprob = -std::numeric_limits<float>::infinity(), .top = {{7, -1.0f}}}};
  in[2].seq = std::numeric_limits<int32_t>::max();  // asked, nothing scored yet
  v1::StepResult r;
  AddLogprobs(in, r);
  const std::vector<SequenceLogprobs> out = LogprobsFromProto(r);
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(out[i].seq, in[i].seq);
    EXPECT_EQ(out[i].has_sampled, in[i].has_sampled);
    EXPECT_EQ(out[i].sampled.token, in[i].sampled.token);
    EXPECT_EQ(out[i].sampled.logprob, in[i].sampled.logprob);
    EXPECT_EQ(out[i].sampled.top, in[i].sampled.top);
    ASSERT_EQ(out[i].prompt.size(), in[i].prompt.size());
    for (size_t k = 0; k < in[i].prompt.size(); ++k) {
      EXPECT_EQ(out[i].prompt[k].token, in[i].prompt[k].token);
      EXPECT_EQ(out[i].prompt[k].logprob, in[i].prompt[k].logprob);
      EXPECT_EQ(out[i].prompt[k].top, in[i].prompt[k].top);
    }
  }
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

TEST(StepCodec, RoundTripsARowsConstraint) {
  StepDescriptor step;
  step.seqs.resize(2);
  auto c = std::make_shared<structured::Constraint>();
  c->kind = structured::Constraint::kChoice;
  c->options = {"yes", "no"};
  step.seqs[0].constraint = c;
  const StepDescriptor back = FromStepRequest(ToStepRequest(step, 1));
  ASSERT_NE(back.seqs[0].constraint, nullptr);
  EXPECT_EQ(back.seqs[0].constraint->kind, structured::Constraint::kChoice);
  EXPECT_EQ(back.seqs[0].constraint->options, c->options);
  EXPECT_EQ(back.seqs[1].constraint, nullptr);  // free text stays unset
}

}  // namespace
}  // namespace tandem
