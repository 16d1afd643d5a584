#include "coordinator/stop_rules.h"

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem {
namespace {

// Each id decodes to a fixed piece of text; ids not listed are an error, as a tokenizer's are.
TextDecoder TableDecoder() {
  static const std::map<int32_t, std::string> kText = {
      {1, "Hello"}, {2, " wor"}, {3, "ld"}, {4, " E"}, {5, "ND"}, {6, " STOP"}, {7, "!"}};
  return [](std::span<const int32_t> ids) -> absl::StatusOr<std::string> {
    std::string out;
    for (int32_t id : ids) {
      auto it = kText.find(id);
      if (it == kText.end()) return absl::InvalidArgumentError("unknown id");
      out += it->second;
    }
    return out;
  };
}

ValidatedRequest Request() {
  ValidatedRequest r;
  r.prompt = {1, 2};
  r.max_new_tokens = 100;
  return r;
}

// One call on a sequence's text of its own.
StopDecision Check(const ValidatedRequest& r, const std::vector<int32_t>& generated,
                   int context_length = 1000) {
  StopText text(TableDecoder());
  return CheckStop(r, generated, context_length, &text);
}

TEST(CheckStop, GoesOnWhenNoRuleMatches) {
  const StopDecision d = Check(Request(), {1, 2});
  EXPECT_FALSE(d.ends());
  EXPECT_EQ(d.text_limit, -1);
}

TEST(CheckStop, EndsWithEosOnAnyOfSeveralEosIds) {
  ValidatedRequest r = Request();
  r.eos_token_id = 50;
  r.eos_token_ids = {50, 60};
  EXPECT_EQ(Check(r, {1, 60}).finish, FinishReason::kEos);
  EXPECT_EQ(Check(r, {1, 50}).finish, FinishReason::kEos);
  EXPECT_FALSE(Check(r, {1, 55}).ends());
}

TEST(CheckStop, EndsWithStopOnAStopTokenId) {
  ValidatedRequest r = Request();
  r.stop_token_ids = {7, 9};
  EXPECT_EQ(Check(r, {1, 9}).finish, FinishReason::kStop);
  EXPECT_EQ(Check(r, {1, 9}).text_limit, -1);
  EXPECT_FALSE(Check(r, {1, 8}).ends());
}

TEST(CheckStop, CutsBeforeTheEarliestOfSeveralStopStrings) {
  ValidatedRequest r = Request();
  // "Hello world STOP": " STOP" starts at 11, "wor" at 6; the earlier one wins whatever the order
  // of the list.
  for (const std::vector<std::string>& stops :
       {std::vector<std::string>{" STOP", "wor"}, std::vector<std::string>{"wor", " STOP"}}) {
    r.stop_strings = stops;
    const StopDecision d = Check(r, {1, 2, 3, 6});
    EXPECT_EQ(d.finish, FinishReason::kStop);
    EXPECT_EQ(d.text_limit, 6) << stops[0];
  }
}

TEST(CheckStop, MatchesAStopStringSplitAcrossTokens) {
  ValidatedRequest r = Request();
  r.stop_strings = {"END"};
  EXPECT_FALSE(Check(r, {1, 4}).ends());  // "Hello E": only a prefix so far
  const StopDecision d = Check(r, {1, 4, 5});  // "Hello END"
  EXPECT_EQ(d.finish, FinishReason::kStop);
  EXPECT_EQ(d.text_limit, 6);
}

TEST(CheckStop, IgnoresStopStringsWithoutADecoder) {
  ValidatedRequest r = Request();
  r.stop_strings = {"Hello"};
  EXPECT_FALSE(CheckStop(r, std::vector<int32_t>{1}, 1000, nullptr).ends());
}

// As the scheduler calls it: token by token with the sequence's own text, which decodes a few ids
// per token and searches only what the new tokens may have made a match of.
TEST(CheckStop, TokenByTokenFindsTheMatchAtItsOffsetDecodingFewIds) {
  ValidatedRequest r = Request();
  r.stop_strings = {"!! ", "ld E"};
  r.max_new_tokens = 10000;
  size_t decoded = 0;
  const TextDecoder table = TableDecoder();
  StopText text([&](std::span<const int32_t> ids) {
    decoded += ids.size();
    return table(ids);
  });
  std::vector<int32_t> generated;
  size_t bytes = 0;
  for (int i = 0; i < 500; ++i) {  // "Hello wor" 500 times: no match
    generated.push_back(i % 2 == 0 ? 1 : 2);
    bytes += i % 2 == 0 ? 5 : 4;
    ASSERT_FALSE(CheckStop(r, generated, 100000, &text).ends()) << i;
  }
  EXPECT_LT(decoded, 8 * generated.size());  // all of them each time: 125,250
  for (int32_t id : {3, 4}) {  // "ld", " E": "ld E" spans both
    generated.push_back(id);
    const StopDecision d = CheckStop(r, generated, 100000, &text);
    if (id == 3) {
      EXPECT_FALSE(d.ends());
      continue;
    }
    EXPECT_EQ(d.finish, FinishReason::kStop);
    EXPECT_EQ(d.text_limit, static_cast<int>(bytes));
  }
}

TEST(CheckStop, MinTokensHoldsBackEosAndStopsButNotLength) {
  ValidatedRequest r = Request();
  r.eos_token_ids = {60};
  r.stop_token_ids = {9};
  r.stop_strings = {"Hello"};
  r.min_tokens = 2;
  EXPECT_FALSE(Check(r, {60}).ends());
  EXPECT_FALSE(Check(r, {1, 9}).ends());
  EXPECT_EQ(Check(r, {1, 9, 60}).finish, FinishReason::kEos);  // the third token may end it
  r.max_new_tokens = 2;
  EXPECT_EQ(Check(r, {1, 9}).finish, FinishReason::kLength);
}

TEST(CheckStop, EndsWithLengthAtMaxNewTokens) {
  ValidatedRequest r = Request();
  r.max_new_tokens = 3;
  EXPECT_FALSE(Check(r, {1, 2}).ends());
  EXPECT_EQ(Check(r, {1, 2, 3}).finish, FinishReason::kLength);
}

TEST(CheckStop, EndsWithLengthWhenTheNextTokenWouldPassTheContext) {
  ValidatedRequest r = Request();  // a prompt of 2
  // Context 5: the third token would be fed at position 2 + 3 - 1 = 4, the last one; the fourth
  // at 5, past it.
  EXPECT_FALSE(Check(r, {1, 2, 3}, 5).ends());
  EXPECT_EQ(Check(r, {1, 2, 3, 7}, 5).finish, FinishReason::kLength);
}

TEST(CheckStop, EosWinsOverAStopTokenAndLength) {
  ValidatedRequest r = Request();
  r.eos_token_ids = {9};
  r.stop_token_ids = {9};
  r.max_new_tokens = 1;
  EXPECT_EQ(Check(r, {9}).finish, FinishReason::kEos);
}

}  // namespace
}  // namespace tandem
