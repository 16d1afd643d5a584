// The CPU backend on random tiny checkpoints: one range against split pipelines, batched against
// alone, chunked prefill against whole, against a naive double-precision forward from the Hugging
// Face tensors (cpu_stage_testing.h), sampling through the stage, and rejected steps.
#include "worker/cpu/cpu_stage.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/cpu/cpu_stage_testing.h"
#include "tools/model_generator.h"
#include "worker/kv_out.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using namespace cpu_test;

// ---------------------------------------------------------------------------------------------
// Tests over every tiny preset: GPT-2 (tied head), Llama with GQA (untied), Llama tied.

class CpuStageTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void TearDownTestSuite() { std::filesystem::remove_all(ModelsRoot()); }
  std::filesystem::path dir() { return ModelDir(GetParam()); }
  int vocab() { return LoadModelConfig(dir())->vocab_size; }
};

TEST_P(CpuStageTest, SplitIntoTwoAndThreeRangesGivesTheOneRangeLogits) {
  const int v = vocab();
  Pipeline one = MakePipeline(dir(), {});
  Pipeline two = MakePipeline(dir(), {2});
  Pipeline three = MakePipeline(dir(), {1, 3});
  ASSERT_EQ(two.size(), 2u);
  ASSERT_EQ(three.size(), 3u);

  std::vector<Seq> seqs = {
      {0, 0, Prompt(5, 1, v)}, {1, 0, Prompt(9, 2, v)}, {2, 0, Prompt(2, 3, v)}};
  for (int step = 0; step < 5; ++step) {  // prefill, then four decode steps
    const StepDescriptor d = MakeStep(seqs);
    const StepOutput a = RunPipeline(one, d), b = RunPipeline(two, d), c = RunPipeline(three, d);
    ASSERT_EQ(a.tokens.size(), 3u);
    ASSERT_EQ(a.logits.size(), 3u * v);
    EXPECT_LE(RelDiff(b.logits, a.logits), 1e-6) << "step " << step;
    EXPECT_LE(RelDiff(c.logits, a.logits), 1e-6) << "step " << step;
    EXPECT_EQ(b.tokens, a.tokens);
    EXPECT_EQ(c.tokens, a.tokens);
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i].position += static_cast<int32_t>(seqs[i].tokens.size());
      seqs[i].tokens = {a.tokens[i]};
    }
  }
}

// Moves the first `positions` of slot `from_slot` of `from` into slot `to_slot` of `to` (two
// pipelines of the same model), block by block: each layer range of `to`'s stages from the stage
// of `from` that holds it (the pipelines here split at layer 2 or not at all).
void MoveKv(const Pipeline& from, int from_slot, Pipeline& to, int to_slot, int positions,
            int layers) {
  for (auto [first, last] : {std::pair{0, 2}, std::pair{2, layers}}) {
    const Stage& src = *from[from.size() == 1 || first == 0 ? 0 : 1];
    Stage& dst = *to[to.size() == 1 || first == 0 ? 0 : 1];
    absl::StatusOr<KvBlock> block = src.ExportKv(from_slot, positions, first, last - first);
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_EQ(block->positions, positions);
    ASSERT_TRUE(dst.ImportKv(to_slot, *block).ok());
  }
}

// A sequence moved mid-generation: its KV-cache exported from a one-stage pipeline and
// imported, layer range by layer range, into the stages of a two-stage pipeline (another slot)
// continues there with the logits it would have had where it was.
TEST_P(CpuStageTest, KvMovedToAnotherLayoutContinuesWithTheSameLogits) {
  const int v = vocab();
  const int layers = LoadModelConfig(dir())->num_layers;
  Pipeline one = MakePipeline(dir(), {});
  Pipeline two = MakePipeline(dir(), {2});
  Seq a{1, 0, Prompt(7, 8, v)};
  for (int step = 0; step < 3; ++step) {  // prefill, then two decode steps on `one`
    const StepOutput o = RunPipeline(one, MakeStep({a}));
    a.position += static_cast<int32_t>(a.tokens.size());
    a.tokens = o.tokens;
  }
  ASSERT_NO_FATAL_FAILURE(MoveKv(one, 1, two, 3, a.position, layers));
  Seq moved = a;
  moved.slot = 3;
  for (int step = 0; step < 3; ++step) {
    const StepOutput x = RunPipeline(one, MakeStep({a}));
    const StepOutput y = RunPipeline(two, MakeStep({moved}));
    EXPECT_LE(RelDiff(y.logits, x.logits), 1e-6) << "step " << step;
    ASSERT_EQ(y.tokens, x.tokens);
    a.position = moved.position += 1;
    a.tokens = moved.tokens = x.tokens;
  }
  // And back: both stages' blocks into one stage (slot 2), the second at its layer 2.
  ASSERT_NO_FATAL_FAILURE(MoveKv(two, 3, one, 2, moved.position, layers));
  Seq back = a;
  back.slot = 2;
  for (int step = 0; step < 3; ++step) {
    const StepOutput x = RunPipeline(one, MakeStep({a}));
    const StepOutput y = RunPipeline(one, MakeStep({back}));
    EXPECT_LE(RelDiff(y.logits, x.logits), 1e-6) << "back, step " << step;
    ASSERT_EQ(y.tokens, x.tokens);
    a.position = back.position += 1;
    a.tokens = back.tokens = x.tokens;
  }
}

TEST_P(CpuStageTest, SequenceLogitsDoNotDependOnTheBatch) {
  const int v = vocab();
  Pipeline alone = MakePipeline(dir(), {});
  Pipeline batched = MakePipeline(dir(), {});
  Seq a{0, 0, Prompt(6, 4, v)};
  // In the batch, the same sequence sits in another slot, after a longer prefill and before a
  // shorter one.
  std::vector<Seq> batch = {
      {1, 0, Prompt(11, 5, v)}, {3, 0, Prompt(6, 4, v)}, {0, 0, Prompt(3, 6, v)}};
  for (int step = 0; step < 4; ++step) {
    const StepOutput x = RunPipeline(alone, MakeStep({a}));
    const StepOutput y = RunPipeline(batched, MakeStep(batch));
    ASSERT_EQ(y.tokens.size(), 3u);
    EXPECT_LE(RelDiff(Row(y.logits, 1, v), x.logits), 1e-5) << "step " << step;
    EXPECT_EQ(y.tokens[1], x.tokens[0]);
    a.position += static_cast<int32_t>(a.tokens.size());
    a.tokens = x.tokens;
    for (size_t i = 0; i < batch.size(); ++i) {
      batch[i].position += static_cast<int32_t>(batch[i].tokens.size());
      batch[i].tokens = {y.tokens[i]};
    }
  }
}

// The GEMMs' thread count is the process's; a prompt's logits are the same with one thread and
// with three (OpenBLAS splits rows and columns, not the sums).
TEST_P(CpuStageTest, LogitsAreTheSameWithOneGemmThreadOrSeveral) {
  const int v = vocab();
  const std::vector<Seq> batch = {{0, 0, Prompt(40, 4, v)}, {1, 0, Prompt(23, 5, v)}};
  ASSERT_TRUE(SetCpuThreads(1).ok());
  EXPECT_EQ(CpuThreads(), 1);
  Pipeline one = MakePipeline(dir(), {});
  const StepOutput x = RunPipeline(one, MakeStep(batch));
  ASSERT_TRUE(SetCpuThreads(3).ok());
  EXPECT_EQ(CpuThreads(), 3);
  Pipeline three = MakePipeline(dir(), {});
  const StepOutput y = RunPipeline(three, MakeStep(batch));
  ASSERT_TRUE(SetCpuThreads(1).ok());
  EXPECT_LE(RelDiff(y.logits, x.logits), 1e-6);
  EXPECT_EQ(y.tokens, x.tokens);
}

TEST(CpuThreadsTest, FewerThanOneIsRefused) {
  const int before = CpuThreads();
  absl::Status s = SetCpuThreads(0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("0 threads (expected at least 1)"));
  EXPECT_EQ(CpuThreads(), before);
}

TEST_P(CpuStageTest, PrefillInOneGoEqualsChunksAndTokenByToken) {
  const int v = vocab();
  const std::vector<int32_t> prompt = Prompt(10, 7, v);
  // The sequence's final prefill logits, then its logits for two decode steps, given a plan of
  // prefill chunk sizes.
  auto run = [&](const std::vector<int>& chunks) {
    Pipeline p = MakePipeline(dir(), {});
    std::vector<std::vector<float>> logits;
    int pos = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      Seq s{2, pos, {prompt.begin() + pos, prompt.begin() + pos + chunks[c]}};
      s.sample = c + 1 == chunks.size();
      const StepOutput out = RunPipeline(p, MakeStep({s}));
      EXPECT_EQ(out.tokens.size(), s.sample ? 1u : 0u);
      if (s.sample) logits.push_back(out.logits);
      pos += chunks[c];
    }
    for (int32_t next : {11, 222}) {
      logits.push_back(RunPipeline(p, MakeStep({{2, pos++, {next}}})).logits);
    }
    return logits;
  };
  const auto whole = run({10});
  const auto chunked = run({4, 3, 3});
  const auto single = run(std::vector<int>(10, 1));
  ASSERT_EQ(whole.size(), 3u);
  ASSERT_EQ(chunked.size(), 3u);
  ASSERT_EQ(single.size(), 3u);
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_LE(RelDiff(chunked[i], whole[i]), 1e-5) << i;
    EXPECT_LE(RelDiff(single[i], whole[i]), 1e-5) << i;
  }
}

TEST_P(CpuStageTest, MatchesANaiveForwardPassInDouble) {
  const int v = vocab();
  NaiveModel naive(dir());
  Pipeline p = MakePipeline(dir(), {});
  // 30 tokens: past the sliding windows of the tiny Mistral (16) and Qwen2 (24) checkpoints.
  std::vector<std::vector<int32_t>> history = {Prompt(30, 8, v), Prompt(3, 9, v)};
  std::vector<Seq> seqs = {{0, 0, history[0]}, {1, 0, history[1]}};
  for (int step = 0; step < 4; ++step) {
    const StepOutput out = RunPipeline(p, MakeStep(seqs));
    ASSERT_EQ(out.tokens.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      const Vec want = naive.Logits(history[i]).back();
      EXPECT_LE(RelDiff(Row(out.logits, i, v), want), 1e-5) << "step " << step << " seq " << i;
      seqs[i].position = static_cast<int32_t>(history[i].size());
      seqs[i].tokens = {out.tokens[i]};
      history[i].push_back(out.tokens[i]);
    }
  }
}

TEST_P(CpuStageTest, GreedyTokenIsTheArgmaxOfTheReturnedLogits) {
  const int v = vocab();
  Pipeline p = MakePipeline(dir(), {2});
  const StepOutput out =
      RunPipeline(p, MakeStep({{0, 0, Prompt(4, 10, v)}, {1, 0, Prompt(8, 11, v)}}));
  ASSERT_EQ(out.tokens.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const std::vector<float> row = Row(out.logits, i, v);
    EXPECT_EQ(out.tokens[i], std::max_element(row.begin(), row.end()) - row.begin());
  }
}

TEST_P(CpuStageTest, SeededSamplingIsReproducibleAndIndependentOfTheBatch) {
  const int v = vocab();
  SamplingParams sp;
  sp.temperature = 0.9f;
  sp.top_k = 40;
  sp.top_p = 0.95f;
  sp.seed = 1234;
  // Eight sampled tokens of one sequence, with `others` sharing every step.
  auto generate = [&](const SamplingParams& params, int others) {
    Pipeline p = MakePipeline(dir(), {1});
    std::vector<Seq> seqs;
    for (int o = 0; o < others; ++o) {
      Seq s{o + 1, 0, Prompt(3 + 2 * o, 20 + o, v)};
      s.sampling = sp;
      s.sampling.seed = 99 + o;
      seqs.push_back(s);
    }
    Seq mine{0, 0, Prompt(5, 12, v)};
    mine.sampling = params;
    seqs.insert(seqs.begin() + others / 2, mine);
    std::vector<int32_t> tokens;
    for (int step = 0; step < 8; ++step) {
      const StepOutput out = RunPipeline(p, MakeStep(seqs, /*return_logits=*/false));
      EXPECT_TRUE(out.logits.empty());
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (seqs[i].slot == 0) tokens.push_back(out.tokens[i]);
        seqs[i].position += static_cast<int32_t>(seqs[i].tokens.size());
        seqs[i].tokens = {out.tokens[i]};
        ++seqs[i].sample_index;
      }
    }
    return tokens;
  };
  const std::vector<int32_t> alone = generate(sp, 0);
  EXPECT_EQ(generate(sp, 0), alone);
  EXPECT_EQ(generate(sp, 2), alone);
  SamplingParams other_seed = sp;
  other_seed.seed = 4321;
  EXPECT_NE(generate(other_seed, 0), alone);
}

TEST_P(CpuStageTest, SamplesOnlySequencesThatAskInTheirOrder) {
  const int v = vocab();
  Pipeline p = MakePipeline(dir(), {});
  Seq a{0, 0, Prompt(4, 13, v)}, b{1, 0, Prompt(6, 14, v)}, c{2, 0, Prompt(2, 15, v)};
  b.sample = false;
  const StepOutput out = RunPipeline(p, MakeStep({a, b, c}));
  ASSERT_EQ(out.tokens.size(), 2u);
  ASSERT_EQ(out.logits.size(), 2u * v);
  Pipeline q = MakePipeline(dir(), {});
  const StepOutput only_c = RunPipeline(q, MakeStep({c}));
  EXPECT_LE(RelDiff(Row(out.logits, 1, v), only_c.logits), 1e-5);
}

TEST_P(CpuStageTest, ReusedSlotStartsAfresh) {
  const int v = vocab();
  Pipeline p = MakePipeline(dir(), {2});
  RunPipeline(p, MakeStep({{0, 0, Prompt(12, 16, v)}}));
  RunPipeline(p, MakeStep({{0, 12, {5}}}));
  const StepOutput reused = RunPipeline(p, MakeStep({{0, 0, Prompt(4, 17, v)}}));
  Pipeline fresh = MakePipeline(dir(), {2});
  const StepOutput want = RunPipeline(fresh, MakeStep({{0, 0, Prompt(4, 17, v)}}));
  EXPECT_EQ(reused.logits, want.logits);
}

TEST_P(CpuStageTest, NonLastStageReturnsHostFp32HiddenStates) {
  const int v = vocab();
  auto stage = MakeStage(dir(), 0, 2);
  auto out = stage->Step(MakeStep({{0, 0, Prompt(3, 18, v)}, {1, 0, Prompt(4, 19, v)}}), {});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->hidden.rows, 7);
  EXPECT_EQ(out->hidden.cols, stage->config().hidden_size);
  EXPECT_EQ(out->hidden.dtype, DType::kF32);
  EXPECT_EQ(out->hidden.where, Where::kHost);
  ASSERT_NE(out->hidden.data, nullptr);
  EXPECT_TRUE(out->tokens.empty());
  EXPECT_TRUE(out->logits.empty());
}

// A step that ends a prompt writes the slot's KV-cache out layer by layer as it goes (a prefill
// worker's hand-off): each layer is published while the step still runs (the slot does not hold
// the prompt's positions yet), in layer order, and the block then holds what ExportKv gives. The
// write-out of the second stage of a split holds its own layers.
TEST_P(CpuStageTest, AStepWritesItsKvCacheOutLayerByLayerAsItGoes) {
  const int v = vocab();
  const int layers = LoadModelConfig(dir())->num_layers;
  Pipeline two = MakePipeline(dir(), {2});
  Seq a{1, 0, Prompt(4, 3, v)};
  ASSERT_TRUE(RunPipeline(two, MakeStep({a})).tokens.size() == 1);
  a.position = 4;
  a.tokens = Prompt(3, 5, v);  // a second chunk: positions [4, 7)
  const int positions = 7;
  std::vector<std::shared_ptr<KvOut>> outs;
  std::vector<std::vector<int>> order(two.size());
  for (size_t i = 0; i < two.size(); ++i) {
    absl::StatusOr<std::shared_ptr<KvOut>> out = two[i]->OpenKvOut(a.slot, positions);
    ASSERT_TRUE(out.ok()) << out.status();
    Stage* stage = two[i].get();
    (*out)->OnPublished([&, i, stage](int layer) {
      order[i].push_back(layer);
      EXPECT_EQ(outs[i]->published(), layer + 1);
      // Mid-step: the slot holds the positions of the chunk before only.
      EXPECT_FALSE(stage->ExportKv(a.slot, positions, outs[i]->block().first_layer, 1).ok())
          << "layer " << layer << " was published after the step";
    });
    outs.push_back(*out);
  }
  RunPipeline(two, MakeStep({a}));
  for (size_t i = 0; i < two.size(); ++i) {
    const KvBlock& b = outs[i]->block();
    EXPECT_EQ(b.first_layer, i == 0 ? 0 : 2);
    EXPECT_EQ(b.num_layers, i == 0 ? 2 : layers - 2);
    EXPECT_EQ(b.positions, positions);
    std::vector<int> all(b.num_layers);
    for (int l = 0; l < b.num_layers; ++l) all[l] = l;
    EXPECT_EQ(order[i], all) << "stage " << i;
    ASSERT_TRUE(outs[i]->ended());
    ASSERT_TRUE(outs[i]->AwaitAll(absl::Now()).ok());
    absl::StatusOr<KvBlock> exported =
        two[i]->ExportKv(a.slot, positions, b.first_layer, b.num_layers);
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_EQ(b.k, exported->k) << "stage " << i;
    EXPECT_EQ(b.v, exported->v) << "stage " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// A KV-cache of 4-token pages: sequences scattered over shuffled, non-contiguous pages compute
// what the contiguous slots compute, bit for bit (the backend is batch-invariant).

constexpr int kPageSize = 4;

std::unique_ptr<Stage> MakePagedStage(const std::filesystem::path& dir, int first, int last,
                                      int pages) {
  StageSpec spec;
  spec.model_dir = dir;
  spec.first_layer = first;
  spec.last_layer = last;
  spec.max_slots = 4;
  spec.max_seq_len = 64;
  spec.kv_page_size = kPageSize;
  spec.kv_pages = pages;
  auto stage = MakeCpuStage(spec);
  EXPECT_TRUE(stage.ok()) << stage.status();
  return stage.ok() ? std::move(stage).value() : nullptr;
}

// `step` with each row's block table: pages[slot] holds the slot's pages in position order.
StepDescriptor WithTables(StepDescriptor step, const std::vector<std::vector<int32_t>>& pages) {
  for (SequenceStep& s : step.seqs) {
    const int needed = (s.position + s.num_tokens + kPageSize - 1) / kPageSize;
    s.block_table.assign(pages[s.slot].begin(), pages[s.slot].begin() + needed);
  }
  return step;
}

// Three sequences of different lengths over the same steps: prefill chunks that cross page
// boundaries in one batch, then decode steps; every step's logits, in order.
std::vector<std::vector<float>> RunMixedBatch(Pipeline& p, int v,
                                              const std::vector<std::vector<int32_t>>* pages) {
  auto run = [&](StepDescriptor step) {
    return RunPipeline(p, pages != nullptr ? WithTables(std::move(step), *pages) : step).logits;
  };
  std::vector<std::vector<float>> logits;
  const std::vector<int32_t> a = Prompt(11, 1, v), b = Prompt(6, 2, v), c = Prompt(3, 3, v);
  logits.push_back(run(MakeStep({{0, 0, {a.begin(), a.begin() + 5}}, {2, 0, b}})));
  logits.push_back(run(MakeStep({{0, 5, {a.begin() + 5, a.end()}}, {2, 6, {17}}, {3, 0, c}})));
  for (int i = 0; i < 3; ++i) {
    logits.push_back(run(MakeStep({{0, 11 + i, {40 + i}}, {2, 7 + i, {50 + i}}, {3, 3 + i, {9}}})));
  }
  return logits;
}

TEST_P(CpuStageTest, PagedKvCacheGivesTheContiguousLogitsBitForBit) {
  const int v = vocab(), layers = LoadModelConfig(dir())->num_layers;
  Pipeline contiguous = MakePipeline(dir(), {2});
  const std::vector<std::vector<float>> want = RunMixedBatch(contiguous, v, nullptr);

  // 4 slots' pages dealt from a shuffled pool of 24, so that no sequence's pages are adjacent
  // or in order.
  std::vector<int32_t> pool(24);
  for (int i = 0; i < 24; ++i) pool[i] = (i * 7 + 5) % 24;
  std::vector<std::vector<int32_t>> pages(4);
  for (int i = 0; i < 24; ++i) pages[i % 4].push_back(pool[i]);
  Pipeline paged;
  paged.push_back(MakePagedStage(dir(), 0, 2, 24));
  paged.push_back(MakePagedStage(dir(), 2, layers, 24));
  EXPECT_EQ(paged[0]->kv_pages(), 24);
  const std::vector<std::vector<float>> got = RunMixedBatch(paged, v, &pages);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i;
}

// One sequence decoded far past the short contexts above: a 3-token prompt, then decode steps up
// to the model's 256 positions, on slot 1 of contiguous slots and on shuffled 4-token pages; the
// logits of every step
// are equal bit for bit (the sampled streams of the two layouts must not part).
TEST_P(CpuStageTest, PagedKvCacheGivesTheContiguousLogitsOverALongSequence) {
  constexpr int kLen = 256, kPages = kLen / kPageSize + 8;
  const int v = vocab();
  auto contiguous = MakeStage(dir(), 0, -1, 2, kLen);
  StageSpec spec;
  spec.model_dir = dir();
  spec.first_layer = 0;
  spec.last_layer = -1;
  spec.max_slots = 2;
  spec.max_seq_len = kLen;
  spec.kv_page_size = kPageSize;
  spec.kv_pages = kPages;
  auto paged = MakeCpuStage(spec);
  ASSERT_TRUE(paged.ok()) << paged.status();
  std::vector<int32_t> pages(kPages);
  for (int i = 0; i < kPages; ++i) pages[i] = (i * 37 + 11) % kPages;
  std::vector<int32_t> tokens = Prompt(3, 7, v);
  int position = 0;
  for (int step = 0; position + static_cast<int>(tokens.size()) <= kLen - 1; ++step) {
    StepDescriptor d = MakeStep({{1, position, tokens}});
    absl::StatusOr<StepOutput> want = contiguous->Step(d, {});
    ASSERT_TRUE(want.ok()) << want.status();
    const int needed = (position + static_cast<int>(tokens.size()) + kPageSize - 1) / kPageSize;
    d.seqs[0].block_table.assign(pages.begin(), pages.begin() + needed);
    absl::StatusOr<StepOutput> got = (*paged)->Step(d, {});
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->logits, want->logits) << "step " << step << " at position " << position;
    position += static_cast<int>(tokens.size());
    tokens = {want->tokens.at(0)};
  }
}

// Batch invariance: six sequences, half of them sampled, each run alone (one row per step after
// its prompt) and then together, each starting a step after the other so that prompts of 3 to 17
// tokens share steps with decodes: every sequence's logits and tokens are the same bit for bit.
// (OpenBLAS's per-row results depend on a call's row count; the stage's GEMMs are made in calls
// of a fixed count.) A prompt cut into other chunks is not covered: attention's sums over the
// context follow BLAS's blocking of the step's context length.
TEST_P(CpuStageTest, ASequencesLogitsDoNotDependOnTheOtherRowsOfItsSteps) {
  constexpr int kSeqs = 6, kTokens = 24;
  const int v = vocab();
  auto alone = MakeStage(dir(), 0, -1, 1);
  auto together = MakeStage(dir(), 0, -1, kSeqs + 1);
  auto prompt = [&](int i) { return Prompt(i == 2 ? 17 : 3 + i, i + 1, v); };
  auto seq = [&](int i, int slot, int position, std::vector<int32_t> tokens, int index) {
    Seq s(slot, position, std::move(tokens));
    if (i % 2 == 1) s.sampling = {.temperature = 0.9f, .seed = 4100u + i};
    s.sample_index = index;
    return s;
  };
  std::vector<std::vector<std::vector<float>>> want(kSeqs);
  std::vector<std::vector<int32_t>> tokens(kSeqs);
  for (int i = 0; i < kSeqs; ++i) {
    std::vector<int32_t> t = prompt(i);
    for (int k = 0, position = 0; k < kTokens; ++k) {
      absl::StatusOr<StepOutput> o = alone->Step(MakeStep({seq(i, 0, position, t, k)}), {});
      ASSERT_TRUE(o.ok()) << o.status();
      want[i].push_back(o->logits);
      tokens[i].push_back(o->tokens.at(0));
      position += static_cast<int>(t.size());
      t = {o->tokens.at(0)};
    }
  }
  std::vector<int> position(kSeqs, 0), done(kSeqs, 0);
  for (int step = 0;; ++step) {
    std::vector<Seq> seqs;
    std::vector<int> who;
    for (int i = 0; i < kSeqs && i <= step; ++i) {
      if (done[i] == kTokens) continue;
      std::vector<int32_t> t{tokens[i][std::max(done[i] - 1, 0)]};
      if (done[i] == 0) t = prompt(i);
      seqs.push_back(seq(i, i + 1, position[i], t, done[i]));
      who.push_back(i);
    }
    if (seqs.empty()) break;
    absl::StatusOr<StepOutput> o = together->Step(MakeStep(seqs), {});
    ASSERT_TRUE(o.ok()) << o.status();
    for (size_t r = 0; r < who.size(); ++r) {
      const int i = who[r];
      position[i] += static_cast<int>(seqs[r].tokens.size());
      const std::vector<float> got(o->logits.begin() + r * v, o->logits.begin() + (r + 1) * v);
      ASSERT_EQ(got, want[i][done[i]]) << "sequence " << i << ", token " << done[i]
                                       << ", in a step of " << who.size() << " sequences";
      EXPECT_EQ(o->tokens.at(r), tokens[i][done[i]]) << "sequence " << i << ", token " << done[i];
      ++done[i];
    }
  }
  for (int i = 0; i < kSeqs; ++i) EXPECT_EQ(done[i], kTokens) << "sequence " << i;
}

INSTANTIATE_TEST_SUITE_P(TinyPresets, CpuStageTest,
                         ::testing::Values("tiny-gpt2", "tiny-llama", "tiny-llama-tied",
                                           "tiny-llama3", "tiny-mistral", "tiny-qwen2",
                                           "tiny-qwen2-window", "tiny-qwen3", "tiny-qwen3-tied",
                                           "tiny-gpt2-scaled", "tiny-openllama"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// A write-out's bounds are checked when it is opened; one whose step has no row ending it, or
// whose step fails, or whose stage goes away first ends with that error, so that nothing waits
// for it until a deadline.
TEST(CpuStageKvOutTest, AWriteOutThatNoStepFillsFailsNamingWhy) {
  std::unique_ptr<Stage> stage = MakeStage(ModelDir("tiny-llama"), 0, 4, /*max_slots=*/2,
                                           /*max_seq_len=*/16);
  ASSERT_NE(stage, nullptr);
  const int v = LoadModelConfig(ModelDir("tiny-llama"))->vocab_size;
  EXPECT_THAT(stage->OpenKvOut(2, 4).status().message(), ::testing::HasSubstr("slot 2"));
  EXPECT_THAT(stage->OpenKvOut(0, 17).status().message(), ::testing::HasSubstr("positions 17"));
  EXPECT_THAT(stage->OpenKvOut(0, 0).status().message(), ::testing::HasSubstr("positions 0"));

  // Another slot's step, and a row of the slot that ends elsewhere, fill nothing.
  std::shared_ptr<KvOut> other = *stage->OpenKvOut(0, 4);
  std::shared_ptr<KvOut> short_of = *stage->OpenKvOut(1, 5);
  stage->Step(MakeStep({Seq{1, 0, Prompt(4, 1, v)}}), {}).IgnoreError();
  EXPECT_THAT(other->AwaitAll(absl::Now()).message(), ::testing::HasSubstr("no row that ends it"));
  EXPECT_THAT(short_of->AwaitAll(absl::Now()).message(),
              ::testing::HasSubstr("no row that ends it"));

  // A step that fails (a token outside the vocabulary) fails its write-out with its error.
  std::shared_ptr<KvOut> failing = *stage->OpenKvOut(0, 2);
  const absl::StatusOr<StepOutput> bad = stage->Step(MakeStep({Seq{0, 0, {1, v}}}), {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(failing->AwaitAll(absl::Now()), bad.status());

  std::shared_ptr<KvOut> orphan = *stage->OpenKvOut(0, 2);
  stage.reset();
  EXPECT_EQ(orphan->AwaitAll(absl::Now()).code(), absl::StatusCode::kCancelled);
}

// ---------------------------------------------------------------------------------------------
// Rejected steps and specs

class CpuStageErrorTest : public ::testing::Test {
 protected:
  static void TearDownTestSuite() { std::filesystem::remove_all(ModelsRoot()); }
  void SetUp() override {
    dir_ = ModelDir("tiny-llama");
    vocab_ = LoadModelConfig(dir_)->vocab_size;
  }
  std::filesystem::path dir_;
  int vocab_ = 0;
};

TEST_F(CpuStageErrorTest, BadStepsAreRejectedNamingTheFieldAndLeaveTheStageUsable) {
  auto stage = MakeStage(dir_, 0, -1, /*max_slots=*/4, /*max_seq_len=*/32);
  auto clean = MakeStage(dir_, 0, -1, /*max_slots=*/4, /*max_seq_len=*/32);
  const StepDescriptor prefill = MakeStep({{0, 0, Prompt(5, 21, vocab_)}});
  ASSERT_TRUE(stage->Step(prefill, {}).ok());
  ASSERT_TRUE(clean->Step(prefill, {}).ok());

  struct Case {
    std::string name;
    StepDescriptor step;
    std::vector<std::string> message;
  };
  SamplingParams bad_temp, bad_k, bad_p;
  bad_temp.temperature = -1.0f;
  bad_k.top_k = -3;
  bad_p.top_p = 0.0f;
  auto with = [](Seq s, const SamplingParams& sp) {
    s.sampling = sp;
    return s;
  };
  std::vector<Case> cases = {
      {"slot below range", MakeStep({{-1, 0, {1}}}), {"sequence 0", "slot -1"}},
      {"slot above range", MakeStep({{1, 0, {1}}, {4, 0, {1}}}), {"sequence 1", "slot 4"}},
      {"slot twice", MakeStep({{1, 0, {1}}, {1, 0, {2}}}), {"sequence 1", "slot 1"}},
      {"no tokens", MakeStep({{1, 0, {}}}), {"num_tokens"}},
      {"negative position", MakeStep({{0, -1, {1}}}), {"position"}},
      {"past the context", MakeStep({{0, 5, Prompt(28, 1, vocab_)}}), {"position 5", "32"}},
      {"gap in the cache", MakeStep({{0, 6, {1}}}), {"position 6", "5 tokens", "slot 0"}},
      {"token id too large", MakeStep({{0, 5, {1, vocab_}}}), {"sequence 0", "token 1", "id"}},
      {"negative token id", MakeStep({{2, 0, {-4}}}), {"token 0", "-4"}},
      {"bad temperature", MakeStep({with({0, 5, {1}}, bad_temp)}), {"temperature"}},
      {"bad top_k", MakeStep({with({0, 5, {1}}, bad_k)}), {"top_k"}},
      {"bad top_p", MakeStep({{1, 0, {3}}, with({0, 5, {1}}, bad_p)}), {"sequence 1", "top_p"}},
  };
  StepDescriptor wrong_count = MakeStep({{0, 5, {1, 2}}});
  wrong_count.tokens.pop_back();
  cases.push_back({"token count", wrong_count, {"tokens", "1", "2"}});

  for (const Case& c : cases) {
    auto r = stage->Step(c.step, {});
    ASSERT_FALSE(r.ok()) << c.name;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(r.status().message(), HasSubstr("step " + std::to_string(c.step.id))) << c.name;
    for (const std::string& m : c.message) {
      EXPECT_THAT(r.status().message(), HasSubstr(m)) << c.name;
    }
  }
  // Nothing of the rejected steps reached the cache: the next decode matches a clean stage.
  const StepDescriptor decode = MakeStep({{0, 5, {17}}, {1, 0, {3, 4}}});
  auto got = stage->Step(decode, {});
  auto want = clean->Step(decode, {});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->logits, want->logits);
  EXPECT_EQ(got->tokens, want->tokens);
}

// A block table that does not fit the pool (a page out of range, too few pages for the row's
// tokens, longer than the context, a page named twice) or that names pages on a stage of
// contiguous slots is refused naming the row, the page or the count, and the stage serves the
// next step as if it had not come.
TEST_F(CpuStageErrorTest, BadBlockTablesAreRefusedNamingTheRowAndThePage) {
  auto stage = MakePagedStage(dir_, 0, -1, 8);
  auto refused = [&](std::vector<int32_t> table, int tokens, const std::string& what) {
    StepDescriptor step = MakeStep({{1, 0, {3}}, {0, 0, Prompt(tokens, 1, vocab_)}});
    step.seqs[0].block_table = {2};
    step.seqs[1].block_table = std::move(table);
    const absl::StatusOr<StepOutput> out = stage->Step(step, {});
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(out.status().message(), AllOf(HasSubstr("sequence 1 (slot 0)"), HasSubstr(what)));
  };
  refused({0, 8}, 5, "entry 1: page 8 is outside the stage's [0, 8) pages");
  refused({-1}, 1, "page -1");
  refused({0}, 5, "block table of 1 pages holds 4 positions, 5 need 2 pages of 4");
  refused(std::vector<int32_t>(17, 0), 5, "17 pages is longer than the context of 64");
  refused({3, 5, 3}, 9, "entries 0 and 2 both name page 3");

  auto contiguous = MakeStage(dir_, 0, -1, 4, 64);
  StepDescriptor with_pages = MakeStep({{0, 0, {3}}});
  with_pages.seqs[0].block_table = {0};
  EXPECT_THAT(contiguous->Step(with_pages, {}).status().message(),
              HasSubstr("names 1 pages, but this stage's KV-cache is contiguous slots"));

  StepDescriptor good = MakeStep({{0, 0, Prompt(5, 1, vocab_)}});
  good.seqs[0].block_table = {6, 1};
  const absl::StatusOr<StepOutput> got = stage->Step(good, {});
  ASSERT_TRUE(got.ok()) << got.status();
  const absl::StatusOr<StepOutput> want =
      contiguous->Step(MakeStep({{0, 0, Prompt(5, 1, vocab_)}}), {});
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->logits, want->logits);
}

// A sequence's KV-cache exported from pages and imported into other pages, or into a contiguous
// slot and back, continues with the logits of the sequence that never moved.
TEST_F(CpuStageErrorTest, KvMovesBetweenPagesAndSlotsContinueTheSequence) {
  const std::vector<int32_t> prompt = Prompt(10, 4, vocab_);
  auto contiguous = MakeStage(dir_, 0, -1, 4, 64);
  ASSERT_TRUE(contiguous->Step(MakeStep({{2, 0, prompt}}), {}).ok());
  const std::vector<float> want = contiguous->Step(MakeStep({{2, 10, {77}}}), {})->logits;
  const int layers = LoadModelConfig(dir_)->num_layers;

  auto paged = MakePagedStage(dir_, 0, -1, 12);
  const std::vector<int32_t> from = {9, 2, 5}, to = {0, 11, 3};
  StepDescriptor prefill = MakeStep({{1, 0, prompt}});
  prefill.seqs[0].block_table = from;
  ASSERT_TRUE(paged->Step(prefill, {}).ok());
  absl::StatusOr<KvBlock> block = paged->ExportKv(KvPlace(1, from), 10, 0, layers);
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_THAT(paged->ExportKv(KvPlace(1, {9, 2}), 10, 0, layers).status().message(),
              HasSubstr("KV export: slot 1: block table of 2 pages"));
  EXPECT_THAT(paged->ImportKv(KvPlace(3, {0, 12, 3}), *block).message(),
              HasSubstr("KV import: slot 3: block table entry 1: page 12"));

  // Pages to other pages of another slot.
  ASSERT_TRUE(paged->ImportKv(KvPlace(3, to), *block).ok());
  StepDescriptor next = MakeStep({{3, 10, {77}}});
  next.seqs[0].block_table = to;
  EXPECT_EQ(paged->Step(next, {})->logits, want);

  // Pages to a contiguous slot, and a contiguous slot to pages.
  auto slots = MakeStage(dir_, 0, -1, 4, 64);
  ASSERT_TRUE(slots->ImportKv(0, *block).ok());
  EXPECT_EQ(slots->Step(MakeStep({{0, 10, {77}}}), {})->logits, want);
  absl::StatusOr<KvBlock> back = contiguous->ExportKv(2, 10, 0, layers);
  ASSERT_TRUE(back.ok()) << back.status();
  auto other = MakePagedStage(dir_, 0, -1, 12);
  ASSERT_TRUE(other->ImportKv(KvPlace(0, {7, 4, 10}), *back).ok());
  next.seqs[0].slot = 0;
  next.seqs[0].block_table = {7, 4, 10};
  EXPECT_EQ(other->Step(next, {})->logits, want);
}

// The write-out of a prefill step on pages holds what ExportKv gathers from those pages.
TEST_F(CpuStageErrorTest, AWriteOutOnPagesHoldsThePagesPositions) {
  const int layers = LoadModelConfig(dir_)->num_layers;
  auto stage = MakePagedStage(dir_, 0, -1, 8);
  const std::vector<int32_t> table = {5, 0, 6};
  StepDescriptor first = MakeStep({{1, 0, Prompt(6, 2, vocab_)}});
  first.seqs[0].block_table = {5, 0};
  ASSERT_TRUE(stage->Step(first, {}).ok());
  absl::StatusOr<std::shared_ptr<KvOut>> out = stage->OpenKvOut(KvPlace(1, table), 9);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(stage->OpenKvOut(KvPlace(2, {5, 0}), 9).status().message(),
              HasSubstr("KV write-out: slot 2: block table of 2 pages"));
  StepDescriptor second = MakeStep({{1, 6, Prompt(3, 3, vocab_)}});
  second.seqs[0].block_table = table;
  ASSERT_TRUE(stage->Step(second, {}).ok());
  ASSERT_TRUE((*out)->AwaitAll(absl::Now()).ok());
  absl::StatusOr<KvBlock> exported = stage->ExportKv(KvPlace(1, table), 9, 0, layers);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ((*out)->block().k, exported->k);
  EXPECT_EQ((*out)->block().v, exported->v);
  // And the bytes are the sequence's: the same positions of a contiguous run.
  auto contiguous = MakeStage(dir_, 0, -1, 4, 64);
  ASSERT_TRUE(contiguous->Step(MakeStep({{1, 0, Prompt(6, 2, vocab_)}}), {}).ok());
  ASSERT_TRUE(contiguous->Step(MakeStep({{1, 6, Prompt(3, 3, vocab_)}}), {}).ok());
  EXPECT_EQ(contiguous->ExportKv(1, 9, 0, layers)->k, exported->k);
}

TEST_F(CpuStageErrorTest, BadActivationsAreRejectedOnLaterStages) {
  auto first = MakeStage(dir_, 0, 2);
  auto second = MakeStage(dir_, 2, -1);
  const StepDescriptor step = MakeStep({{0, 0, Prompt(3, 22, vocab_)}});
  auto hidden = first->Step(step, {});
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  const Activations good = hidden->hidden;

  Activations rows = good, cols = good, device = good, empty = good;
  rows.rows = 2;
  cols.cols = good.cols - 1;
  device.where = Where::kDevice;
  empty.data = nullptr;
  for (const auto& [name, in, want] :
       std::vector<std::tuple<std::string, Activations, std::string>>{
           {"rows", rows, "[2, 64]"},
           {"cols", cols, "[3, 63]"},
           {"device", device, "device"},
           {"no data", empty, "no data"}}) {
    auto r = second->Step(step, in);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(r.status().message(), HasSubstr(want)) << name;
  }
  auto ok = second->Step(step, good);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tokens.size(), 1u);
}

TEST_F(CpuStageErrorTest, LaterStageConvertsHalfPrecisionActivations) {
  auto first = MakeStage(dir_, 0, 2);
  auto second = MakeStage(dir_, 2, -1);
  auto half = MakeStage(dir_, 2, -1);
  const StepDescriptor step = MakeStep({{0, 0, Prompt(3, 23, vocab_)}});
  auto hidden = first->Step(step, {});
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  const Activations& f32 = hidden->hidden;
  auto buf = std::make_shared<std::vector<uint16_t>>(f32.rows * f32.cols);
  FromFloat(DType::kBF16, static_cast<const float*>(f32.data.get()), buf->size(), buf->data());
  Activations bf16 = f32;
  bf16.dtype = DType::kBF16;
  bf16.data = std::shared_ptr<void>(buf, buf->data());
  auto want = second->Step(step, f32);
  auto got = half->Step(step, bf16);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(RelDiff(got->logits, want->logits), 0.05);
}

// Every field of a KV block that does not fit the stage is named, and nothing is written: the
// slot goes on as before.
TEST_F(CpuStageErrorTest, KvBlocksThatDoNotFitAreRejectedNamingTheField) {
  using ::testing::HasSubstr;
  std::unique_ptr<Stage> src = MakeStage(dir_, 0, 2, 2, 64);
  std::unique_ptr<Stage> dst = MakeStage(dir_, 0, 2, 2, 32);
  ASSERT_TRUE(src->Step(MakeStep({{0, 0, Prompt(20, 1, vocab_)}}), {}).ok());
  EXPECT_THAT(src->ExportKv(0, 21, 0, 2).status().message(), HasSubstr("holds 20 positions"));
  EXPECT_THAT(src->ExportKv(2, 20, 0, 2).status().message(), HasSubstr("slot 2"));
  EXPECT_THAT(src->ExportKv(0, 20, 1, 2).status().message(), HasSubstr("layers [1, 3)"));
  absl::StatusOr<KvBlock> good = src->ExportKv(0, 20, 0, 2);
  ASSERT_TRUE(good.ok()) << good.status();
  auto expect_refused = [&](KvBlock b, int slot, const std::string& what) {
    const absl::Status s = dst->ImportKv(slot, b);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(s.message(), HasSubstr(what));
  };
  KvBlock b = *good;
  b.version = 2;
  expect_refused(b, 0, "version 2");
  expect_refused(*good, 2, "slot 2");
  b = *good;
  b.dtype = DType::kF16;
  expect_refused(b, 0, "dtype F16");
  b = *good;
  b.num_kv_heads += 1;
  expect_refused(b, 0, "KV heads");
  b = *good;
  b.head_dim *= 2;
  expect_refused(b, 0, "KV heads of");
  b = *good;
  b.first_layer = 1;
  expect_refused(b, 0, "layers [1, 3)");
  b = *good;
  b.num_layers = 0;
  expect_refused(b, 0, "layers [0, 0)");
  b = *good;
  b.positions = 33;  // past the destination's 32
  expect_refused(b, 0, "33 positions");
  b = *good;
  b.v.pop_back();
  expect_refused(b, 0, "bytes of K");
  // The slot is untouched: it holds nothing, so a decode step at position 20 is refused ...
  EXPECT_FALSE(dst->Step(MakeStep({{0, 20, {1}}}), {}).ok());
  // ... and the good block is taken, after which that step runs.
  ASSERT_TRUE(dst->ImportKv(0, *good).ok());
  EXPECT_TRUE(dst->Step(MakeStep({{0, 20, {1}}}), {}).ok());
}

TEST_F(CpuStageErrorTest, BadSpecsAreRejected) {
  StageSpec spec;
  spec.model_dir = dir_;
  for (auto [first, last] : std::vector<std::pair<int, int>>{{-1, 2}, {0, 5}, {2, 2}, {3, 1}}) {
    spec.first_layer = first;
    spec.last_layer = last;
    auto s = MakeCpuStage(spec);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << first << ", " << last;
    EXPECT_THAT(s.status().message(), HasSubstr("layer range")) << first << ", " << last;
  }
  spec.first_layer = 0;
  spec.last_layer = -1;

  StageSpec no_slots = spec;
  no_slots.max_slots = 0;
  EXPECT_THAT(MakeCpuStage(no_slots).status().message(), HasSubstr("max_slots"));

  StageSpec too_long = spec;
  too_long.max_seq_len = 100000;
  EXPECT_THAT(MakeCpuStage(too_long).status().message(),
              AllOf(HasSubstr("max_seq_len"), HasSubstr("100000")));

  StageSpec missing = spec;
  missing.model_dir = dir_ / "does-not-exist";
  EXPECT_FALSE(MakeCpuStage(missing).ok());
}

TEST_F(CpuStageErrorTest, CheckpointMissingATensorOrWithAWrongShapeIsRejected) {
  // Rewrite the checkpoint without one tensor, and with another one misshapen.
  const std::filesystem::path broken = ModelsRoot() / "broken";
  std::filesystem::create_directories(broken);
  std::filesystem::copy_file(dir_ / "config.json", broken / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto file = SafetensorsFile::Open(dir_ / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  auto rewrite = [&](const std::string& drop, const std::string& reshape) {
    std::vector<TensorToWrite> tensors;
    for (const std::string& name : (*file)->names()) {
      if (name == drop) continue;
      auto t = (*file)->tensor(name);
      TensorToWrite w{name, t->dtype, t->shape, {t->data.begin(), t->data.end()}};
      if (name == reshape) std::swap(w.shape[0], w.shape[1]);
      tensors.push_back(std::move(w));
    }
    EXPECT_TRUE(WriteSafetensors(broken / "model.safetensors", tensors).ok());
    StageSpec spec;
    spec.model_dir = broken;
    return MakeCpuStage(spec).status();
  };
  absl::Status missing = rewrite("model.layers.2.mlp.up_proj.weight", "");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("model.layers.2.mlp.up_proj.weight"));

  absl::Status shape = rewrite("", "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.message(), AllOf(HasSubstr("model.layers.1.mlp.down_proj.weight"),
                                     HasSubstr("[64, 160]"), HasSubstr("[160, 64]")));
}

// Biases under a config that says none (a Qwen2 checkpoint relabelled llama): refused naming the
// first unused tensor rather than served without them.
TEST(CpuStageFamilyTest, TensorsTheConfigDoesNotUseAreRefusedByName) {
  const std::filesystem::path qwen = ModelDir("tiny-qwen2");
  const std::filesystem::path relabelled = ModelsRoot() / "qwen2-as-llama";
  std::filesystem::create_directories(relabelled);
  std::filesystem::copy_file(qwen / "model.safetensors", relabelled / "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  auto config = LoadModelConfig(qwen);
  ASSERT_TRUE(config.ok()) << config.status();
  config->model_type = "llama";
  config->qkv_bias = false;
  {
    std::ofstream out(relabelled / "config.json");
    out << ModelConfigToJson(*config);
  }
  StageSpec spec;
  spec.model_dir = relabelled;
  const absl::Status st = MakeCpuStage(spec).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("'model.layers.0.self_attn.k_proj.bias'")) << st;
  // A later stage checks its own layers: layers 2-3 name their first bias.
  spec.first_layer = 2;
  const absl::Status later = MakeCpuStage(spec).status();
  EXPECT_THAT(later.message(), HasSubstr("'model.layers.2.self_attn.k_proj.bias'")) << later;
}

// Qwen3's q_norm / k_norm are checked both ways: a Qwen3 checkpoint labelled llama is refused
// naming a norm it would ignore, and a Llama checkpoint labelled qwen3 naming the norm it lacks.
TEST(CpuStageFamilyTest, Qwen3NormsMissingOrUnusedAreRefusedByName) {
  auto relabel = [](const std::string& preset, const std::string& type, bool qk_norm) {
    const std::filesystem::path from = ModelDir(preset);
    const std::filesystem::path to = ModelsRoot() / (preset + "-as-" + type);
    std::filesystem::create_directories(to);
    std::filesystem::copy_file(from / "model.safetensors", to / "model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
    auto config = LoadModelConfig(from);
    EXPECT_TRUE(config.ok()) << config.status();
    config->model_type = type;
    config->qk_norm = qk_norm;
    std::ofstream(to / "config.json") << ModelConfigToJson(*config);
    StageSpec spec;
    spec.model_dir = to;
    return MakeCpuStage(spec).status();
  };
  const absl::Status unused = relabel("tiny-qwen3", "llama", false);
  EXPECT_EQ(unused.code(), absl::StatusCode::kInvalidArgument) << unused;
  EXPECT_THAT(unused.message(), HasSubstr("'model.layers.0.self_attn.k_norm.weight'")) << unused;
  const absl::Status missing = relabel("tiny-llama", "qwen3", true);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("'model.layers.0.self_attn.q_norm.weight'")) << missing;
}

}  // namespace
}  // namespace tandem
