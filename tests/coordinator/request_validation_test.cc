#include "coordinator/request_validation.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

constexpr ModelLimits kLimits{.vocab_size = 100, .context_length = 32, .eos_token_id = 99};

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

TEST(RequestValidationTest, NegativeOrNanTemperatureNamesTemperature) {
  v1::GenerateRequest r = Good();
  r.mutable_sampling()->set_temperature(-0.1f);
  ExpectInvalid(r, "sampling.temperature");
  r.mutable_sampling()->set_temperature(std::nanf(""));
  ExpectInvalid(r, "sampling.temperature");
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

}  // namespace
}  // namespace tandem
