// The sampling controls end to end on loopback (a real coordinator and two CPU workers serving a
// random tiny Llama): fresh and fixed seeds, n sequences, generated and prompt logprobs, and the
// penalties, each checked against the single-process CPU engine stepping the same rule.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/sampling.h"

namespace tandem::testing {
namespace {

std::filesystem::path& ModelDir() {
  static std::filesystem::path dir;
  return dir;
}

const std::vector<int32_t> kPrompt = {11, 402, 97, 5, 260, 33, 71};

class SamplingControlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelDir() = std::filesystem::path(::testing::TempDir()) /
                 absl::StrFormat("tandem-sampling-model-%d", getpid());
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 11}, ModelDir());
    ASSERT_TRUE(s.ok()) << s;
    // Prompts are prefilled in chunks of 3 tokens, so prompt logprobs cross chunk boundaries.
    absl::StatusOr<std::unique_ptr<Cluster>> cluster =
        Cluster::Start({.model_dir = ModelDir(), .workers = 2, .stages = 2, .replicas = 1,
                        .coordinator_flags = {"--prefill_chunk=3"}});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    std::error_code ec;
    std::filesystem::remove_all(ModelDir(), ec);
  }

  static Stage& Engine() {
    static std::unique_ptr<Stage> stage = [] {
      absl::StatusOr<std::unique_ptr<Stage>> s = MakeCpuStage(
          {.model_dir = ModelDir(), .first_layer = 0, .last_layer = -1, .max_slots = 1});
      EXPECT_TRUE(s.ok()) << s.status();
      return *std::move(s);
    }();
    return *stage;
  }

  // The single-process engine with the service's step semantics and the penalties' bookkeeping
  // done here: one sequence, prompt in one step, then one token per step.
  static std::vector<int32_t> Oracle(const SamplingParams& sampling, int max_new_tokens) {
    Stage& stage = Engine();
    std::map<int32_t, SeenToken> seen;
    if (sampling.repetition_penalty != 1.0f) {
      for (int32_t t : kPrompt) seen[t] = {.id = t, .output_count = 0, .in_prompt = true};
    }
    StepDescriptor d;
    d.seqs.resize(1);
    d.seqs[0].num_tokens = static_cast<int>(kPrompt.size());
    d.seqs[0].sampling = sampling;
    d.tokens = kPrompt;
    std::vector<int32_t> out;
    while (static_cast<int>(out.size()) < max_new_tokens) {
      d.seqs[0].seen.clear();
      for (const auto& [id, s] : seen) d.seqs[0].seen.push_back(s);
      absl::StatusOr<StepOutput> o = stage.Step(d, Activations{});
      EXPECT_TRUE(o.ok()) << o.status();
      if (!o.ok()) return out;
      const int32_t t = o->tokens.at(0);
      out.push_back(t);
      if (sampling.has_penalties()) {
        seen[t].id = t;
        ++seen[t].output_count;
      }
      d.seqs[0].position += d.seqs[0].num_tokens;
      d.seqs[0].num_tokens = 1;
      d.seqs[0].sample_index = out.size();
      d.tokens = {t};
    }
    return out;
  }

  // The raw logits after `prefix`, from the single-process engine.
  static std::vector<float> LogitsAfter(const std::vector<int32_t>& prefix) {
    StepDescriptor d;
    d.seqs.resize(1);
    d.seqs[0].num_tokens = static_cast<int>(prefix.size());
    d.tokens = prefix;
    d.return_logits = true;
    absl::StatusOr<StepOutput> o = Engine().Step(d, Activations{});
    EXPECT_TRUE(o.ok()) << o.status();
    return o.ok() ? o->logits : std::vector<float>{};
  }

  static v1::GenerateRequest Request(int max_new_tokens) {
    v1::GenerateRequest r;
    r.mutable_token_ids()->Assign(kPrompt.begin(), kPrompt.end());
    r.set_max_new_tokens(max_new_tokens);
    r.set_ignore_eos(true);
    return r;
  }

  static v1::GenerateResponse Generate(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GenerateResponse resp;
    const grpc::Status s = cluster_->inference().Generate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message() << "\n" << cluster_->Logs();
    return resp;
  }

  static std::vector<int32_t> Tokens(const v1::GenerateResponse& r) {
    return {r.token_ids().begin(), r.token_ids().end()};
  }

  static int Distinct(const std::vector<int32_t>& tokens) {
    return static_cast<int>(std::set<int32_t>(tokens.begin(), tokens.end()).size());
  }

  static Cluster* cluster_;
};

Cluster* SamplingControlsTest::cluster_ = nullptr;

TEST_F(SamplingControlsTest, UnseededSamplingDiffersAcrossCallsAndASeedRepeats) {
  // 16 tokens at temperature 1 over a random model's 512-token vocabulary: two fresh seeds
  // agreeing on all of them is vanishingly unlikely.
  v1::GenerateRequest req = Request(16);
  req.mutable_sampling()->set_temperature(1.0f);
  const std::vector<int32_t> a = Tokens(Generate(req)), b = Tokens(Generate(req)),
                             c = Tokens(Generate(req));
  EXPECT_FALSE(a == b && b == c) << "three unseeded calls gave the same tokens";
  req.mutable_sampling()->set_seed(42);
  const std::vector<int32_t> seeded = Tokens(Generate(req));
  EXPECT_EQ(Tokens(Generate(req)), seeded);
  EXPECT_EQ(seeded, Oracle({.temperature = 1.0f, .seed = 42}, 16));
  // A seed of 0, set, is a seed like any other.
  req.mutable_sampling()->set_seed(0);
  EXPECT_EQ(Tokens(Generate(req)), Oracle({.temperature = 1.0f, .seed = 0}, 16));
}

TEST_F(SamplingControlsTest, NReturnsThatManySequencesWithSeedsFromTheRequests) {
  v1::GenerateRequest req = Request(10);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(100);
  req.mutable_sampling()->set_n(3);
  const v1::GenerateResponse resp = Generate(req);
  ASSERT_EQ(resp.choices_size(), 3);
  int completion = 0;
  for (int i = 0; i < 3; ++i) {
    const v1::Choice& c = resp.choices(i);
    EXPECT_EQ(c.index(), i);
    EXPECT_EQ(c.finish_reason(), v1::FINISH_REASON_LENGTH);
    const std::vector<int32_t> tokens(c.token_ids().begin(), c.token_ids().end());
    EXPECT_EQ(tokens, Oracle({.temperature = 1.0f, .seed = 100 + static_cast<uint64_t>(i)}, 10))
        << "choice " << i;
    completion += c.token_ids_size();
  }
  EXPECT_NE(Tokens(resp), std::vector<int32_t>(resp.choices(1).token_ids().begin(),
                                               resp.choices(1).token_ids().end()));
  // The n = 1 fields are choice 0's; usage counts the prompt once and every choice's tokens.
  EXPECT_EQ(Tokens(resp), std::vector<int32_t>(resp.choices(0).token_ids().begin(),
                                               resp.choices(0).token_ids().end()));
  EXPECT_EQ(resp.usage().prompt_tokens(), static_cast<int>(kPrompt.size()));
  EXPECT_EQ(resp.usage().completion_tokens(), completion);
  EXPECT_EQ(completion, 30);

  // The stream carries the same sequences, each message naming its index, and the usage last.
  grpc::ClientContext ctx;
  auto reader = cluster_->inference().GenerateStream(&ctx, req);
  v1::GenerateStreamResponse msg;
  std::map<int, std::vector<int32_t>> streamed;
  std::map<int, int> finished;
  int usage_messages = 0;
  while (reader->Read(&msg)) {
    ASSERT_EQ(usage_messages, 0) << "a message after the usage";
    streamed[msg.index()].insert(streamed[msg.index()].end(), msg.token_ids().begin(),
                                 msg.token_ids().end());
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) ++finished[msg.index()];
    if (msg.has_usage()) {
      ++usage_messages;
      EXPECT_EQ(msg.usage().completion_tokens(), 30);
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(usage_messages, 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(streamed[i], std::vector<int32_t>(resp.choices(i).token_ids().begin(),
                                                resp.choices(i).token_ids().end()));
    EXPECT_EQ(finished[i], 1);
  }
}

TEST_F(SamplingControlsTest, GreedyLogprobsAreTheTopAlternativeAndMatchTheEngine) {
  v1::GenerateRequest req = Request(6);
  req.mutable_sampling()->set_logprobs(true);
  req.mutable_sampling()->set_top_logprobs(5);
  const v1::GenerateResponse resp = Generate(req);
  ASSERT_EQ(resp.choices_size(), 1);
  const v1::Choice& c = resp.choices(0);
  ASSERT_EQ(c.logprobs_size(), c.token_ids_size());
  std::vector<int32_t> prefix = kPrompt;
  for (int i = 0; i < c.logprobs_size(); ++i) {
    const v1::TokenLogprob& l = c.logprobs(i);
    EXPECT_EQ(l.token_id(), c.token_ids(i));
    ASSERT_EQ(l.top_logprobs_size(), 5);
    EXPECT_EQ(l.top_logprobs(0).token_id(), l.token_id());
    EXPECT_EQ(l.top_logprobs(0).logprob(), l.logprob());
    for (int k = 1; k < 5; ++k) {
      EXPECT_LE(l.top_logprobs(k).logprob(), l.top_logprobs(k - 1).logprob());
    }
    // The engine's raw logits, log-softmaxed here in double.
    const std::vector<float> logits = LogitsAfter(prefix);
    double sum = 0;
    float mx = -INFINITY;
    for (float x : logits) mx = std::max(mx, x);
    for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
    EXPECT_NEAR(l.logprob(), logits[l.token_id()] - mx - std::log(sum), 1e-4) << "token " << i;
    prefix.push_back(l.token_id());
  }
  EXPECT_EQ(resp.prompt_logprobs_size(), 0);
}

TEST_F(SamplingControlsTest, PromptLogprobsScoreEveryPromptTokenAfterTheFirstAcrossChunks) {
  v1::GenerateRequest req = Request(2);
  req.mutable_sampling()->set_prompt_logprobs(true);
  req.mutable_sampling()->set_prompt_top_logprobs(3);
  const v1::GenerateResponse resp = Generate(req);
  ASSERT_EQ(resp.prompt_logprobs_size(), static_cast<int>(kPrompt.size()) - 1);
  for (int i = 0; i < resp.prompt_logprobs_size(); ++i) {
    const v1::TokenLogprob& l = resp.prompt_logprobs(i);
    EXPECT_EQ(l.token_id(), kPrompt[i + 1]);
    EXPECT_EQ(l.top_logprobs_size(), 3);
    const std::vector<int32_t> prefix(kPrompt.begin(), kPrompt.begin() + i + 1);
    const TokenLogprob want = ComputeLogprob(LogitsAfter(prefix), kPrompt[i + 1], 3);
    EXPECT_NEAR(l.logprob(), want.logprob, 1e-4) << "prompt token " << i + 1;
    EXPECT_EQ(l.top_logprobs(0).token_id(), want.top[0].first);
  }
  EXPECT_EQ(resp.choices(0).logprobs_size(), 0);
}

TEST_F(SamplingControlsTest, PenaltiesFollowTheEngineAndChangeRepetitionTheWayTheyShould) {
  constexpr int kTokens = 32;
  const std::vector<int32_t> plain = Tokens(Generate(Request(kTokens)));
  ASSERT_EQ(plain, Oracle({}, kTokens));
  // Greedy decoding of this random model repeats itself; the premise of the comparisons.
  ASSERT_LT(Distinct(plain), kTokens - 4) << ::testing::PrintToString(plain);

  v1::GenerateRequest req = Request(kTokens);
  req.mutable_sampling()->set_presence_penalty(2.0f);
  req.mutable_sampling()->set_frequency_penalty(2.0f);
  const std::vector<int32_t> penalised = Tokens(Generate(req));
  EXPECT_EQ(penalised,
            Oracle({.presence_penalty = 2.0f, .frequency_penalty = 2.0f}, kTokens));
  EXPECT_GT(Distinct(penalised), Distinct(plain));

  // Negative penalties reward what was said: fewer distinct tokens than without.
  req.mutable_sampling()->set_presence_penalty(-2.0f);
  req.mutable_sampling()->set_frequency_penalty(-2.0f);
  const std::vector<int32_t> rewarded = Tokens(Generate(req));
  EXPECT_EQ(rewarded,
            Oracle({.presence_penalty = -2.0f, .frequency_penalty = -2.0f}, kTokens));
  EXPECT_LT(Distinct(rewarded), Distinct(plain));

  // The repetition penalty also looks at the prompt.
  v1::GenerateRequest rep = Request(kTokens);
  rep.mutable_sampling()->set_repetition_penalty(5.0f);
  const std::vector<int32_t> repeated = Tokens(Generate(rep));
  EXPECT_EQ(repeated, Oracle({.repetition_penalty = 5.0f}, kTokens));
  EXPECT_GT(Distinct(repeated), Distinct(plain));
}

TEST_F(SamplingControlsTest, MinPOneSamplesLikeGreedy) {
  v1::GenerateRequest req = Request(12);
  req.mutable_sampling()->set_temperature(1.5f);
  req.mutable_sampling()->set_min_p(1.0f);
  EXPECT_EQ(Tokens(Generate(req)), Oracle({}, 12));
}

}  // namespace
}  // namespace tandem::testing
