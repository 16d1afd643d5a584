// OpenAI's response and chunk shapes, and the server-sent events' framing.
#include "coordinator/openai/response_format.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::openai {
namespace {

using nlohmann::json;

const ResponseHead kHead{.id = "cmpl-1", .created = 1700000000, .model = "m"};

TEST(CompletionResponse, HasOpenAIsShape) {
  const json r = CompletionResponse(
      kHead,
      {{.index = 0, .text = "ab", .finish = v1::FINISH_REASON_EOS},
       {.index = 1, .text = "cd", .finish = v1::FINISH_REASON_LENGTH}},
      {nullptr, nullptr}, {.prompt_tokens = 3, .completion_tokens = 5});
  EXPECT_EQ(r, json::parse(R"({
    "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "text": "ab", "logprobs": null, "finish_reason": "stop"},
                {"index": 1, "text": "cd", "logprobs": null, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})"));
}

TEST(ChatResponse, HasOpenAIsShape) {
  const json r = ChatResponse(kHead, {{.index = 0, .text = "hi", .finish = v1::FINISH_REASON_STOP}},
                              {}, {.prompt_tokens = 1, .completion_tokens = 1});
  EXPECT_EQ(r, json::parse(R"({
    "id": "cmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "logprobs": null, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})"));
}

TEST(Chunks, CarryUsageNullOnlyWhenTheStreamAskedForUsage) {
  json c = CompletionChunk(kHead, 2, "x", nullptr, v1::FINISH_REASON_UNSPECIFIED, false);
  EXPECT_FALSE(c.contains("usage"));
  EXPECT_EQ(c["choices"][0], json::parse(R"({"index": 2, "text": "x", "logprobs": null,
                                             "finish_reason": null})"));
  c = ChatChunk(kHead, 0, {{"content", "y"}}, nullptr, v1::FINISH_REASON_LENGTH, true);
  EXPECT_EQ(c["object"], "chat.completion.chunk");
  EXPECT_TRUE(c["usage"].is_null());
  EXPECT_EQ(c["choices"][0]["delta"], json::parse(R"({"content": "y"})"));
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  const json u = UsageChunk(kHead, "chat.completion.chunk", {2, 3});
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["total_tokens"], 5);
}

TEST(SseEvent, FramesOneLineOfJsonAndNeverThrowsOnBadUtf8) {
  EXPECT_EQ(SseEvent({{"a", "b\nc"}}), "data: {\"a\":\"b\\nc\"}\n\n");
  EXPECT_EQ(SseEvent({{"a", std::string("\xff")}}), "data: {\"a\":\"\xEF\xBF\xBD\"}\n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
}

TEST(Logprobs, HaveEachEndpointsShape) {
  const std::vector<TokenLogprob> lp = {{.token = 1, .logprob = -0.5f, .top = {{1, -0.5f}}}};
  const json completion = CompletionLogprobs(nullptr, lp, 4);
  EXPECT_EQ(completion["token_logprobs"], json::parse("[-0.5]"));
  EXPECT_EQ(completion["text_offset"], json::parse("[4]"));
  EXPECT_EQ(completion["tokens"].size(), 1u);
  EXPECT_EQ(completion["top_logprobs"][0].size(), 1u);
  const json chat = ChatLogprobs(nullptr, lp);
  ASSERT_EQ(chat["content"].size(), 1u);
  EXPECT_EQ(chat["content"][0]["logprob"], -0.5);
  EXPECT_TRUE(chat["content"][0]["bytes"].is_array());
  EXPECT_EQ(chat["content"][0]["top_logprobs"][0]["logprob"], -0.5);
}

TEST(Logprobs, NameTokensByIdWhenAskedSoThatTokensWithoutTextStayApart) {
  // Without a tokenizer every token's text is "": by text the two alternatives would be one key.
  const std::vector<TokenLogprob> lp = {
      {.token = 7, .logprob = -0.25f, .top = {{7, -0.25f}, {9, -1.5f}}}};
  const json by_text = CompletionLogprobs(nullptr, lp, 0);
  EXPECT_EQ(by_text["top_logprobs"][0].size(), 1u);
  const json completion = CompletionLogprobs(nullptr, lp, 0, /*tokens_as_ids=*/true);
  EXPECT_EQ(completion["tokens"], json::parse(R"(["token_id:7"])"));
  EXPECT_EQ(completion["top_logprobs"][0], json::parse(R"({"token_id:7": -0.25, "token_id:9": -1.5})"));
  EXPECT_EQ(completion["text_offset"], json::parse("[0]"));  // offsets still count text
  const json chat = ChatLogprobs(nullptr, lp, /*tokens_as_ids=*/true);
  EXPECT_EQ(chat["content"][0]["token"], "token_id:7");
  ASSERT_EQ(chat["content"][0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(chat["content"][0]["top_logprobs"][1]["token"], "token_id:9");
}

}  // namespace
}  // namespace tandem::openai
