#include "coordinator/request_validation.h"

#include <limits>
#include <optional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

constexpr ModelLimits kLimits{
    .vocab_size = 100, .context_length = 32, .eos_token_id = 99, .eos_token_ids = {}};

v1::GenerateRequest Good() {
  v1::GenerateRequest r;
  r.add_token_ids(1);
  r.add_token_ids(2);
  r.set_max_new_tokens(4);
  return r;
}

void ExpectInvalid(const v1::GenerateRequest& r, const std::string& field) {
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  ASSERT_FALSE(v.ok()) << field;
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr(field));
}

TEST(RequestValidationTest, GoodRequestKeepsEveryField) {
  v1::GenerateRequest r = Good();
  r.mutable_sampling()->set_temperature(0.7f);
  r.mutable_sampling()->set_top_k(5);
  r.mutable_sampling()->set_top_p(0.5f);
  r.mutable_sampling()->set_seed(42);
  r.add_stop_token_ids(7);
  r.set_timeout_ms(1500);
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->prompt, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(v->max_new_tokens, 4);
  EXPECT_FLOAT_EQ(v->sampling.temperature, 0.7f);
  EXPECT_EQ(v->sampling.top_k, 5);
  EXPECT_FLOAT_EQ(v->sampling.top_p, 0.5f);
  EXPECT_EQ(v->sampling.seed, 42u);
  EXPECT_EQ(v->stop_token_ids, (std::vector<int32_t>{7}));
  EXPECT_EQ(v->eos_token_id, 99);
  EXPECT_EQ(v->timeout, absl::Milliseconds(1500));
}

TEST(RequestValidationTest, DefaultsFillUnsetFields) {
  v1::GenerateRequest r = Good();
  r.clear_max_new_tokens();
  r.set_ignore_eos(true);
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->max_new_tokens, 32);  // min(default, context)
  EXPECT_FLOAT_EQ(v->sampling.top_p, 1.0f);
  EXPECT_EQ(v->eos_token_id, -1);
  EXPECT_EQ(v->timeout, absl::InfiniteDuration());
}

TEST(RequestValidationTest, EmptyPromptNamesPrompt) {
  v1::GenerateRequest r = Good();
  r.clear_token_ids();
  ExpectInvalid(r, "prompt");
}

TEST(RequestValidationTest, TextPromptWithoutTokenizerNamesPrompt) {
  v1::GenerateRequest r = Good();
  r.clear_token_ids();
  r.set_prompt("hello");
  ExpectInvalid(r, "prompt");
}

TEST(RequestValidationTest, PromptAndTokenIdsTogetherAreRejected) {
  v1::GenerateRequest r = Good();
  r.set_prompt("hello");
  ExpectInvalid(r, "token_ids");
}

TEST(RequestValidationTest, PromptLongerThanContextNamesTokenIds) {
  v1::GenerateRequest r = Good();
  for (int i = 0; i < 31; ++i) r.add_token_ids(3);  // 33 > 32
  ExpectInvalid(r, "token_ids");
  r.mutable_token_ids()->RemoveLast();  // exactly the context: allowed
  EXPECT_TRUE(ValidateRequest(r, kLimits, nullptr).ok());
}

TEST(RequestValidationTest, TokenIdsOutsideVocabularyNameTheIndex) {
  v1::GenerateRequest r = Good();
  r.add_token_ids(100);
  ExpectInvalid(r, "token_ids[2]");
  r = Good();
  r.set_token_ids(0, -1);
  ExpectInvalid(r, "token_ids[0]");
}

TEST(RequestValidationTest, NegativeNanOrInfiniteTemperatureNamesTemperature) {
  for (float t : {-0.1f, std::nanf(""), std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity()}) {
    v1::GenerateRequest r = Good();
    r.mutable_sampling()->set_temperature(t);
    ExpectInvalid(r, "sampling.temperature");
  }
  v1::GenerateRequest r = Good();
  r.mutable_sampling()->set_temperature(std::numeric_limits<float>::max());
  EXPECT_TRUE(ValidateRequest(r, kLimits, nullptr).ok()) << "the largest finite temperature";
}

TEST(RequestValidationTest, TopPOutsideZeroOneNamesTopP) {
  for (float p : {0.0f, -0.5f, 1.0001f, 2.0f}) {
    v1::GenerateRequest r = Good();
    r.mutable_sampling()->set_top_p(p);
    ExpectInvalid(r, "sampling.top_p");
  }
  v1::GenerateRequest r = Good();
  r.mutable_sampling()->set_top_p(1.0f);
  EXPECT_TRUE(ValidateRequest(r, kLimits, nullptr).ok());
}

TEST(RequestValidationTest, NegativeTopKNamesTopK) {
  v1::GenerateRequest r = Good();
  r.mutable_sampling()->set_top_k(-1);
  ExpectInvalid(r, "sampling.top_k");
}

TEST(RequestValidationTest, MaxNewTokensZeroOrAboveContextNamesMaxNewTokens) {
  v1::GenerateRequest r = Good();
  r.set_max_new_tokens(0);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(33);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(-4);
  ExpectInvalid(r, "max_new_tokens");
}

TEST(RequestValidationTest, MaxNewTokensUpToTheContextIsAccepted) {
  v1::GenerateRequest r = Good();  // a prompt of 2 in a context of 32
  r.set_max_new_tokens(30);        // prompt + max_new_tokens == context
  ASSERT_TRUE(ValidateRequest(r, kLimits, nullptr).ok());
  r.set_max_new_tokens(32);  // the context itself: the length rule ends generation at the context
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->max_new_tokens, 32);
  r.set_max_new_tokens(33);
  ExpectInvalid(r, "max_new_tokens");
}

TEST(RequestValidationTest, BadStopTokenIdsAndStopStringsAreNamed) {
  v1::GenerateRequest r = Good();
  r.add_stop_token_ids(100);
  ExpectInvalid(r, "stop_token_ids[0]");
  r = Good();
  r.add_stop("");
  ExpectInvalid(r, "stop[0]");
  r = Good();
  r.add_stop("end");  // no tokenizer to match text with
  ExpectInvalid(r, "stop");
}

// The byte bound comes before tokenizing (a 60 MB prompt was tokenized in full, then refused):
// with no tokenizer at all the bound is what answers.
TEST(RequestValidationTest, PromptOverTheByteBoundIsRefusedBeforeTokenizing) {
  ASSERT_EQ(MaxPromptBytes(kLimits), 32 * kPromptBytesPerToken);
  v1::GenerateRequest r = Good();
  r.clear_token_ids();
  r.set_prompt(std::string(MaxPromptBytes(kLimits) + 1, 'a'));
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(),
              HasSubstr("prompt: 1025 bytes, more than the 1024 this model takes"));
  // At the bound the text goes on to the tokenizer (here: there is none).
  r.set_prompt(std::string(MaxPromptBytes(kLimits), 'a'));
  EXPECT_THAT(ValidateRequest(r, kLimits, nullptr).status().message(), HasSubstr("no tokenizer"));
}

TEST(RequestValidationTest, InvalidUtf8NamesTheFieldAndTheByteOffset) {
  v1::GenerateRequest r = Good();
  r.clear_token_ids();
  r.set_prompt("caf\xC3\xA9 \xFFok");
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("prompt: not valid UTF-8: byte 6 (0xFF)"));
  r = Good();
  r.add_stop("fine");
  r.add_stop("ab\xED\xA0\x80");  // a UTF-16 surrogate
  v = ValidateRequest(r, kLimits, nullptr);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("stop[1]: not valid UTF-8: byte 2 (0xED)"));
}

TEST(RequestValidationTest, StopStringCountAndBytesAreBounded) {
  v1::GenerateRequest r = Good();
  for (int i = 0; i <= kMaxStopStrings; ++i) r.add_stop("x");
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("stop: 33 stop strings, more than the 32"));
  r = Good();
  r.add_stop("x");
  r.add_stop(std::string(kMaxStopStringBytes + 1, 'y'));
  v = ValidateRequest(r, kLimits, nullptr);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(v.status().message(), HasSubstr("stop[1]: 1025 bytes, more than the 1024"));
}

TEST(RequestValidationTest, RequestByteBoundCoversTheLargestLegalRequest) {
  EXPECT_EQ(MaxRequestBytes(kLimits), 4 << 20);  // gRPC's default for a small context
  const ModelLimits large{
      .vocab_size = 128256, .context_length = 131072, .eos_token_id = -1, .eos_token_ids = {}};
  EXPECT_GT(MaxRequestBytes(large),
            MaxPromptBytes(large) + 5 * 131072 + kMaxStopStrings * (kMaxStopStringBytes + 2));
  EXPECT_LT(MaxRequestBytes(large), 2 * MaxPromptBytes(large) + (4 << 20));
}

TEST(RequestValidationTest, SamplingControlsKeepTheirValuesAndDefaultsAreNeutral) {
  v1::GenerateRequest r = Good();
  absl::StatusOr<ValidatedRequest> plain = ValidateRequest(r, kLimits, nullptr);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->seed.has_value());
  EXPECT_EQ(plain->n, 1);
  EXPECT_EQ(plain->logprobs, -1);
  EXPECT_EQ(plain->prompt_logprobs, -1);
  EXPECT_FALSE(plain->sampling.has_penalties());
  EXPECT_EQ(plain->sampling.min_p, 0.0f);

  v1::SamplingParams* s = r.mutable_sampling();
  s->set_seed(0);
  s->set_min_p(0.1f);
  s->set_presence_penalty(-1.5f);
  s->set_frequency_penalty(0.5f);
  s->set_repetition_penalty(1.2f);
  s->set_n(3);
  s->set_logprobs(true);
  s->set_top_logprobs(20);
  s->set_prompt_logprobs(true);
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, kLimits, nullptr);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->seed, std::optional<uint64_t>(0));
  EXPECT_FLOAT_EQ(v->sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(v->sampling.presence_penalty, -1.5f);
  EXPECT_FLOAT_EQ(v->sampling.frequency_penalty, 0.5f);
  EXPECT_FLOAT_EQ(v->sampling.repetition_penalty, 1.2f);
  EXPECT_EQ(v->n, 3);
  EXPECT_EQ(v->logprobs, 20);
  EXPECT_EQ(v->prompt_logprobs, 0);
}

TEST(RequestValidationTest, RejectsEachOutOfRangeSamplingControlNamingIt) {
  static constexpr float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::string field;
    void (*set)(v1::SamplingParams&);
  };
  const std::vector<Case> cases = {
      {"sampling.min_p", [](v1::SamplingParams& s) { s.set_min_p(-0.01f); }},
      {"sampling.min_p", [](v1::SamplingParams& s) { s.set_min_p(1.01f); }},
      {"sampling.min_p", [](v1::SamplingParams& s) { s.set_min_p(nan); }},
      {"sampling.presence_penalty", [](v1::SamplingParams& s) { s.set_presence_penalty(2.1f); }},
      {"sampling.presence_penalty", [](v1::SamplingParams& s) { s.set_presence_penalty(nan); }},
      {"sampling.frequency_penalty", [](v1::SamplingParams& s) { s.set_frequency_penalty(-2.1f); }},
      {"sampling.repetition_penalty",
       [](v1::SamplingParams& s) { s.set_repetition_penalty(0.0f); }},
      {"sampling.repetition_penalty",
       [](v1::SamplingParams& s) { s.set_repetition_penalty(-1.0f); }},
      {"sampling.repetition_penalty",
       [](v1::SamplingParams& s) { s.set_repetition_penalty(101.0f); }},
      {"sampling.n", [](v1::SamplingParams& s) { s.set_n(-1); }},
      {"sampling.n", [](v1::SamplingParams& s) { s.set_n(kMaxChoices + 1); }},
      {"sampling.top_logprobs",
       [](v1::SamplingParams& s) {
         s.set_logprobs(true);
         s.set_top_logprobs(21);
       }},
      {"sampling.top_logprobs",
       [](v1::SamplingParams& s) {
         s.set_logprobs(true);
         s.set_top_logprobs(-1);
       }},
      {"sampling.top_logprobs", [](v1::SamplingParams& s) { s.set_top_logprobs(2); }},
      {"sampling.prompt_top_logprobs",
       [](v1::SamplingParams& s) {
         s.set_prompt_logprobs(true);
         s.set_prompt_top_logprobs(21);
       }},
      {"sampling.prompt_top_logprobs", [](v1::SamplingParams& s) { s.set_prompt_top_logprobs(1); }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r = Good();
    c.set(*r.mutable_sampling());
    ExpectInvalid(r, c.field);
  }
}

TEST(RequestValidationTest, EveryEosIdStopsUnlessEosIsIgnored) {
  ModelLimits limits = kLimits;
  limits.eos_token_id = 98;
  limits.eos_token_ids = {98, 99};  // generation_config.json's list
  v1::GenerateRequest r = Good();
  absl::StatusOr<ValidatedRequest> v = ValidateRequest(r, limits, nullptr);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(IsEos(*v, 98));
  EXPECT_TRUE(IsEos(*v, 99));
  EXPECT_FALSE(IsEos(*v, 97));
  r.set_ignore_eos(true);
  v = ValidateRequest(r, limits, nullptr);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(IsEos(*v, 98));
  EXPECT_FALSE(IsEos(*v, 99));
}

}  // namespace
}  // namespace tandem
