#include "worker/constrained_sampling.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/structured/grammar_cache.h"
#include "common/tokenizer.h"
#include "gtest/gtest.h"
#include "tools/byte_level_bpe.h"
#include "worker/sampling.h"

namespace tandem {
namespace {

// ids: 0 eos, 1 "{", 2 "}", 3 "\"a\":", 4 "1", 5 "x", 6 "{\"a\":"
structured::Vocabulary Vocab() {
  structured::Vocabulary v;
  v.token_bytes = {"", "{", "}", "\"a\":", "1", "x", "{\"a\":"};
  v.special.assign(v.token_bytes.size(), false);
  v.special[0] = true;
  v.eos_ids = {0};
  return v;
}

SequenceStep Row(std::shared_ptr<const structured::Constraint> c, uint64_t index) {
  SequenceStep row;
  row.slot = 3;
  row.sample_index = index;
  row.constraint = std::move(c);
  return row;
}

std::shared_ptr<const structured::Constraint> Schema() {
  auto c = std::make_shared<structured::Constraint>();
  c->kind = structured::Constraint::kJsonSchema;
  c->text = R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]})";
  return c;
}

// Greedy over logits that prefer "x", then eos: the mask steers every step to the schema.
TEST(ConstrainedSamplingTest, GreedyDecodingFollowsTheSchemaThenEnds) {
  ConstrainedSampling cs(Vocab());
  auto constraint = Schema();
  std::string text;
  for (uint64_t i = 0; i < 8; ++i) {
    StepDescriptor step;
    step.seqs.push_back(Row(constraint, i));
    ASSERT_TRUE(cs.Prepare(step).ok());
    std::vector<float> logits = {1.0f, 0.1f, 0.45f, 0.3f, 0.4f, 5.0f, 0.05f};
    cs.Mask(step.seqs[0], logits);
    const int32_t token = SampleToken(logits, SamplingParams{}, i);
    cs.Advance(step.seqs[0], token);
    if (token == 0) break;
    text += Vocab().token_bytes[token];
  }
  EXPECT_EQ(text, R"({"a":1})");
}

TEST(ConstrainedSamplingTest, RefusesARowWhoseMatcherIsElsewhere) {
  ConstrainedSampling cs(Vocab());
  StepDescriptor step;
  step.seqs.push_back(Row(Schema(), 5));
  absl::Status s = cs.Prepare(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("slot 3"), std::string::npos);
}

TEST(ConstrainedSamplingTest, RefusesWithoutATokenizer) {
  ConstrainedSampling cs("/nonexistent-model-dir", {0});
  StepDescriptor step;
  step.seqs.push_back(Row(Schema(), 0));
  absl::Status s = cs.Prepare(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no tokenizer"), std::string::npos);
}

// A model folder whose config.json names no EOS and whose generation_config.json does: a finished
// grammar may end with that id (the one the coordinator stops at), and with nothing else.
TEST(ConstrainedSamplingTest, EndsWithTheEosOfGenerationConfig) {
  const std::filesystem::path dir = std::filesystem::path(TANDEM_TEST_TMPDIR) /
                                    absl::StrFormat("constrained_sampling_test-%d", getpid());
  std::filesystem::create_directories(dir);
  constexpr int32_t kEos = 400;
  std::ofstream(dir / "tokenizer.json")
      << TokenizerJson(TrainByteLevelBpe(TokenizerCorpus(), kEos), "<|endoftext|>", kEos);
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [400]})";
  ConstrainedSampling cs(dir, {});
  auto choice = std::make_shared<structured::Constraint>();
  choice->kind = structured::Constraint::kChoice;
  choice->options = {"the"};
  auto tokenizer = Tokenizer::FromDir(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const std::vector<int32_t> ids = (*tokenizer)->Encode("the", false).value();
  std::vector<float> logits(kEos + 1, 0.0f);
  for (uint64_t i = 0; i <= ids.size(); ++i) {
    StepDescriptor step;
    step.seqs.push_back(Row(choice, i));
    ASSERT_TRUE(cs.Prepare(step).ok());
    logits.assign(kEos + 1, 0.0f);
    cs.Mask(step.seqs[0], logits);
    if (i < ids.size()) cs.Advance(step.seqs[0], ids[i]);
  }
  std::filesystem::remove_all(dir);
  for (int32_t id = 0; id <= kEos; ++id) {
    EXPECT_EQ(std::isinf(logits[id]), id != kEos) << "token " << id;
  }
}

TEST(ConstrainedSamplingTest, UnconstrainedRowsAreUntouched) {
  ConstrainedSampling cs(Vocab());
  StepDescriptor step;
  step.seqs.push_back(Row(nullptr, 4));
  ASSERT_TRUE(cs.Prepare(step).ok());
  std::vector<float> logits = {1, 2, 3, 4, 5, 6, 7};
  cs.Mask(step.seqs[0], logits);
  EXPECT_EQ(logits, (std::vector<float>{1, 2, 3, 4, 5, 6, 7}));
}

// Three sampled rows, the middle one free: the two constrained rows are packed in row order with
// the bits the CPU path would allow, padded past the tokenizer's 7 ids to the model's 40.
TEST(ConstrainedSamplingTest, PacksTheConstrainedRowsMasksForTheDevice) {
  ConstrainedSampling cs(Vocab());
  StepDescriptor step;
  step.seqs.push_back(Row(Schema(), 0));
  step.seqs.push_back(Row(nullptr, 2));
  step.seqs.back().slot = 4;
  step.seqs.push_back(Row(Schema(), 0));
  step.seqs.back().slot = 5;
  ASSERT_TRUE(cs.Prepare(step).ok());
  cs.Advance(step.seqs[2], 1);  // slot 5's text is "{"
  EXPECT_TRUE(ConstrainedSampling::Constrains(step));
  constexpr int kWords = 2;  // a model of 40 ids
  std::vector<uint32_t> masks(3 * kWords, 0xdeadbeefu);
  std::vector<int32_t> rows(3, -1);
  // Logits rows in reverse order of the sequences.
  const std::vector<int> sample_seqs = {2, 1, 0};
  ASSERT_EQ(cs.PackMasks(step, sample_seqs, kWords, masks, rows), 2);
  EXPECT_EQ(rows[0], 0);
  EXPECT_EQ(rows[1], 2);
  // Slot 5 after "{": only "\"a\":" (3); slot 3 at the start: "{" (1) and "{\"a\":" (6).
  EXPECT_EQ(masks[0], 1u << 3);
  EXPECT_EQ(masks[1], 0u);
  EXPECT_EQ(masks[2], (1u << 1) | (1u << 6));
  EXPECT_EQ(masks[3], 0u);
  // The same tokens the CPU path leaves finite.
  for (int seq : {0, 2}) {
    std::vector<float> logits(7, 0.0f);
    cs.Mask(step.seqs[seq], logits);
    const uint32_t word = masks[(seq == 2 ? 0 : 1) * kWords];
    for (int id = 0; id < 7; ++id) {
      EXPECT_EQ(std::isinf(logits[id]), ((word >> id) & 1u) == 0) << "seq " << seq << " id " << id;
    }
  }
}

// A text the grammar has finished allows only the EOS ids.
TEST(ConstrainedSamplingTest, PacksOnlyEosForAFinishedText) {
  ConstrainedSampling cs(Vocab());
  StepDescriptor step;
  step.seqs.push_back(Row(Schema(), 0));
  ASSERT_TRUE(cs.Prepare(step).ok());
  for (int32_t token : {6, 4, 2}) cs.Advance(step.seqs[0], token);  // {"a":1}
  std::vector<uint32_t> masks(1);
  std::vector<int32_t> rows(1);
  ASSERT_EQ(cs.PackMasks(step, std::vector<int>{0}, 1, masks, rows), 1);
  EXPECT_EQ(masks[0], 1u << 0);
  step.seqs[0].constraint = nullptr;
  EXPECT_FALSE(ConstrainedSampling::Constrains(step));
  EXPECT_EQ(cs.PackMasks(step, std::vector<int>{0}, 1, masks, rows), 0);
}

}  // namespace
}  // namespace tandem
