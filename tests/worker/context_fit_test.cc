// CheckPromptFitsContext: the refusal tandem-bench gives a prompt + new tokens beyond the context;
// KvCacheBytes: the checked size of a KV-cache.
#include "worker/context_fit.h"

#include <climits>
#include <cstdint>

#include "absl/strings/str_cat.h"
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

// max_slots 2^27 x 4 layers x max_seq_len 2^30 x kv_dim 32 floats is 2^64: it wrapped to a
// zero-byte cache that the first step wrote past.
TEST(KvCacheBytesTest, ASizeThatOverflowsIsInvalidNamingEverySize) {
  const absl::StatusOr<int64_t> bytes = KvCacheBytes(
      {.slots = 1 << 27, .layers = 4, .positions = 1 << 30, .kv_dim = 32, .element_bytes = 4},
      INT64_MAX, "host memory");
  ASSERT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument) << bytes.status();
  EXPECT_THAT(bytes.status().message(),
              HasSubstr("134217728 slots x 4 layers x 1073741824 positions x 32 (kv_dim) x 4 "
                        "bytes x 2 (K and V)"));
  EXPECT_THAT(bytes.status().message(), HasSubstr("overflows 64 bits"));
}

TEST(KvCacheBytesTest, ASizeBeyondTheBudgetIsResourceExhaustedAndOneWithinIsExact) {
  const KvCacheShape shape{
      .slots = 16, .layers = 26, .positions = 2048, .kv_dim = 3200, .element_bytes = 2};
  const int64_t exact = int64_t{16} * 26 * 2048 * 3200 * 2 * 2;
  const absl::StatusOr<int64_t> fits = KvCacheBytes(shape, exact, "GPU memory");
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(*fits, exact);
  const absl::StatusOr<int64_t> over = KvCacheBytes(shape, exact - 1, "GPU memory");
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr(absl::StrCat("needs ", exact, " bytes")));
  EXPECT_THAT(over.status().message(), HasSubstr("of GPU memory are available"));
}

}  // namespace
}  // namespace tandem
