// CheckPromptFitsContext: the refusal tandem-bench gives a prompt + new tokens beyond the context.
#include "worker/context_fit.h"

#include <climits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

TEST(ContextFitTest, PromptAndNewTokensUpToTheContextFit) {
  // 2,048 positions: the prompt and every new token but the last.
  EXPECT_TRUE(CheckPromptFitsContext(2048, 1, 2048, "/m").ok());
  EXPECT_TRUE(CheckPromptFitsContext(2017, 32, 2048, "/m").ok());
  EXPECT_TRUE(CheckPromptFitsContext(1, 2048, 2048, "/m").ok());
}

TEST(ContextFitTest, OnePositionBeyondIsRefusedNamingPromptTokensAndContext) {
  const absl::Status st = CheckPromptFitsContext(2048, 32, 2048, "/models/openllama-3b");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("--prompt 2048 with --new_tokens 32 needs 2079 positions"));
  EXPECT_THAT(st.message(), HasSubstr("context of 2048"));
  EXPECT_THAT(st.message(), HasSubstr("/models/openllama-3b/config.json"));
  EXPECT_EQ(CheckPromptFitsContext(2018, 32, 2048, "/m").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ContextFitTest, HugeLengthsDoNotWrapAround) {
  const absl::Status st = CheckPromptFitsContext(INT_MAX, INT_MAX, 2048, "/m");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("needs 4294967293 positions"));
}

TEST(ContextFitTest, NonPositiveLengthsAreRefused) {
  EXPECT_THAT(CheckPromptFitsContext(0, 1, 2048, "/m").message(), HasSubstr("prompt length 0"));
  EXPECT_THAT(CheckPromptFitsContext(5, 0, 2048, "/m").message(), HasSubstr("new tokens 0"));
}

}  // namespace
}  // namespace tandem
