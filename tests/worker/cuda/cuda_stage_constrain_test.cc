// Constrained decoding on the CUDA stage: a batch of constrained (json_schema, choice) and free
// rows, greedy and at temperature 1, one with a penalty (the host rule), decoded for many steps
// on a tiny random Llama with its trained BPE tokenizer. Every constrained output is accepted by
// its grammar, ends with EOS and parses as the schema says; the free rows' tokens are those of the
// same batch with no constraint; only constrained steps stop being launched ahead. And the mask
// kernel against the bits on the host. Skipped where no GPU is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/rng.h"
#include "common/structured/grammar_cache.h"
#include "common/structured/token_mask.h"
#include "common/text_config.h"
#include "common/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/worker/cuda/cuda_test_util.h"
#include "tools/model_generator.h"
#include "worker/cuda/constrained_mask.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"

namespace tandem {
namespace {

// A tiny random Llama with a BPE tokenizer trained by the generator (a real tokenizer.json).
std::filesystem::path Checkpoint() {
  return cuda_test::PresetCheckpoint("cuda_stage_constrain_tiny-llama", "tiny-llama", 7);
}

constexpr char kSchema[] =
    R"({"type":"object","properties":{"name":{"type":"string","maxLength":6},)"
    R"("n":{"type":"integer"},"ok":{"type":"boolean"},"tag":{"enum":["red","green"]}},)"
    R"("required":["name","n","ok","tag"],"additionalProperties":false})";

std::shared_ptr<const structured::Constraint> SchemaConstraint() {
  auto c = std::make_shared<structured::Constraint>();
  c->kind = structured::Constraint::kJsonSchema;
  c->text = kSchema;
  return c;
}

std::shared_ptr<const structured::Constraint> ChoiceConstraint() {
  auto c = std::make_shared<structured::Constraint>();
  c->kind = structured::Constraint::kChoice;
  c->options = {"yes", "no", "maybe later"};
  return c;
}

struct Row {
  std::shared_ptr<const structured::Constraint> constraint;  // null: free text
  SamplingParams sampling;
};

// Six rows (a bucket of 8): schema at T=1, choice greedy, free at T=1, free greedy, schema
// greedy, choice at T=1 with a presence penalty (sampled again by the host rule).
std::vector<Row> Rows(bool constrained) {
  auto sampled = [](uint64_t seed) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.seed = seed;
    return p;
  };
  SamplingParams penalised = sampled(17);
  penalised.presence_penalty = 0.5f;
  std::vector<Row> rows = {{SchemaConstraint(), sampled(11)},
                           {ChoiceConstraint(), {}},
                           {nullptr, sampled(13)},
                           {nullptr, {}},
                           {SchemaConstraint(), {}},
                           {ChoiceConstraint(), penalised}};
  if (!constrained) {
    for (Row& r : rows) r.constraint = nullptr;
  }
  return rows;
}

constexpr int kPrompt = 5;
constexpr int kSteps = 120;  // every constrained text is shorter (the schema bounds its length)

// Prefill, then kSteps decode steps fed with the stage's own tokens; tokens per row.
std::vector<std::vector<int32_t>> Generate(Stage& stage, const std::vector<Row>& rows) {
  std::vector<std::vector<int32_t>> out(rows.size());
  StepDescriptor pre;
  for (size_t i = 0; i < rows.size(); ++i) {
    SequenceStep s;
    s.slot = static_cast<int>(i);
    s.num_tokens = kPrompt;
    s.sampling = rows[i].sampling;
    s.constraint = rows[i].constraint;
    pre.seqs.push_back(s);
    for (int t = 0; t < kPrompt; ++t) pre.tokens.push_back(1 + RandomBits(i, t) % 200);
  }
  StepDescriptor step = pre;
  for (int k = 0; k <= kSteps; ++k) {
    auto o = stage.Step(step, Activations{});
    EXPECT_TRUE(o.ok()) << "step " << k << ": " << o.status();
    if (!o.ok() || o->tokens.size() != rows.size()) return out;
    for (size_t i = 0; i < rows.size(); ++i) {
      out[i].push_back(o->tokens[i]);
      step.seqs[i].position = kPrompt + k;
      step.seqs[i].num_tokens = 1;
      step.seqs[i].sample_index = k + 1;
      std::vector<SeenToken>& seen = step.seqs[i].seen;
      auto it = std::find_if(seen.begin(), seen.end(),
                             [&](const SeenToken& t) { return t.id == o->tokens[i]; });
      if (it == seen.end()) it = seen.insert(seen.end(), SeenToken{.id = o->tokens[i]});
      ++it->output_count;
    }
    step.id = k + 1;
    step.tokens = o->tokens;
  }
  return out;
}

std::unique_ptr<Stage> CudaStageOf(const std::filesystem::path& dir) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.max_slots = 8;
  spec.max_seq_len = kPrompt + kSteps + 8;
  auto s = MakeCudaStage(spec, CudaOptions{});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

class CudaStageConstrainTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_F(CudaStageConstrainTest, EveryConstrainedOutputConformsAndFreeRowsAreUnchanged) {
  const std::filesystem::path dir = Checkpoint();
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto tokenizer = Tokenizer::FromDir(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  // Every EOS id the stage's grammars may end with (generation_config.json's too).
  auto text_config = LoadTextConfig(dir, *config, tokenizer->get());
  ASSERT_TRUE(text_config.ok()) << text_config.status();
  const std::vector<int32_t> eos = text_config->eos_token_ids;
  auto vocab = structured::VocabularyFromTokenizer(**tokenizer, eos);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  const structured::TokenMasker masker(*vocab);

  auto stage = CudaStageOf(dir);
  ASSERT_NE(stage, nullptr);
  const std::vector<Row> rows = Rows(true);
  const std::vector<std::vector<int32_t>> got = Generate(*stage, rows);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].constraint == nullptr) continue;
    auto grammar = structured::CompileCached(*rows[i].constraint);
    ASSERT_TRUE(grammar.ok()) << grammar.status();
    structured::Matcher m(*grammar);
    std::string text;
    bool ended = false;
    for (int32_t token : got[i]) {
      if (std::find(eos.begin(), eos.end(), token) != eos.end()) {
        ended = true;
        break;
      }
      ASSERT_TRUE(masker.Accept(m, token))
          << "row " << i << ": the grammar refuses token " << token << " after \"" << text
          << "\": the device sampled a token its mask should have set to -inf";
      text += vocab->token_bytes[token];
    }
    std::cout << "row " << i << " (temperature " << rows[i].sampling.temperature << "): " << text
              << (ended ? " <eos>" : " (no eos)") << "\n";
    EXPECT_TRUE(ended) << "row " << i << " did not end within " << kSteps << " tokens: " << text;
    EXPECT_TRUE(m.Accepting()) << "row " << i << " ended before its grammar accepts: " << text;
    if (rows[i].constraint->kind == structured::Constraint::kChoice) {
      EXPECT_TRUE(text == "yes" || text == "no" || text == "maybe later") << text;
    } else {
      const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      ASSERT_TRUE(j.is_object()) << "row " << i << " does not parse: " << text;
      EXPECT_EQ(j.size(), 4u) << text;
      EXPECT_TRUE(j["name"].is_string() && j["n"].is_number_integer() && j["ok"].is_boolean())
          << text;
      EXPECT_TRUE(j["tag"] == "red" || j["tag"] == "green") << text;
    }
  }

  stage.reset();  // its KV-cache's memory, for the next stage
  // The same batch with no constraint on a fresh stage: the free rows draw the same tokens
  // (rows do not mix in the forward pass, and the constrained step samples them again by the
  // same rule and seed).
  auto plain_stage = CudaStageOf(dir);
  ASSERT_NE(plain_stage, nullptr);
  const std::vector<std::vector<int32_t>> plain = Generate(*plain_stage, Rows(false));
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].constraint == nullptr) {
      EXPECT_EQ(got[i], plain[i]) << "free row " << i << " changed beside constrained rows";
    }
  }
}

TEST_F(CudaStageConstrainTest, OnlyConstrainedDecodeStepsRunWithoutLaunchAhead) {
  auto stage = CudaStageOf(Checkpoint());
  ASSERT_NE(stage, nullptr);
  StepDescriptor step;
  step.tokens = {3, 4};
  for (int i = 0; i < 2; ++i) {
    SequenceStep s;
    s.slot = i;
    s.position = 4;
    step.seqs.push_back(s);
  }
  EXPECT_TRUE(stage->CanLaunchDecode(step)) << "a free decode step must still be launched ahead";
  step.seqs[1].constraint = ChoiceConstraint();
  EXPECT_FALSE(stage->CanLaunchDecode(step))
      << "a constrained step needs the token of the step before for its mask";
}

// The mask kernel against the bits on the host: logits (3, 70), rows 2 and 0 masked (in that
// order), row 1 not; 70 ids end inside the third word.
TEST_F(CudaStageConstrainTest, MaskKernelSetsExactlyTheRefusedLogitsToMinusInfinity) {
  constexpr int kRows = 3, kVocab = 70, kWords = 3;
  std::vector<float> logits(kRows * kVocab);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 13) - 6.0f;
  std::vector<uint32_t> masks(2 * kWords);
  for (size_t i = 0; i < masks.size(); ++i) masks[i] = static_cast<uint32_t>(RandomBits(5, i));
  const std::vector<int32_t> mask_rows = {2, 0};
  cuda::DeviceBuffer d_logits, d_masks, d_rows;
  ASSERT_TRUE(d_logits.Allocate(logits.size() * 4).ok());
  ASSERT_TRUE(d_masks.Allocate(masks.size() * 4).ok());
  ASSERT_TRUE(d_rows.Allocate(mask_rows.size() * 4).ok());
  ASSERT_EQ(cudaMemcpy(d_logits.get(), logits.data(), logits.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_masks.get(), masks.data(), masks.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(d_rows.get(), mask_rows.data(), mask_rows.size() * 4, cudaMemcpyHostToDevice),
      cudaSuccess);
  ASSERT_TRUE(cuda::LaunchMaskLogits(d_logits.as<float>(), kVocab, d_masks.as<uint32_t>(), kWords,
                                     d_rows.as<int32_t>(), 2, nullptr)
                  .ok());
  std::vector<float> got(logits.size());
  ASSERT_EQ(cudaMemcpy(got.data(), d_logits.get(), got.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int r = 0; r < kRows; ++r) {
    const int k = r == 2 ? 0 : r == 0 ? 1 : -1;  // the row's mask, -1: none
    for (int id = 0; id < kVocab; ++id) {
      const bool allowed = k < 0 || ((masks[k * kWords + id / 32] >> (id % 32)) & 1u);
      const float want = allowed ? logits[r * kVocab + id] : -INFINITY;
      EXPECT_EQ(got[r * kVocab + id], want) << "row " << r << " id " << id;
    }
  }
}

}  // namespace
}  // namespace tandem
