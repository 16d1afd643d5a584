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
      {{.index = 0, .text = "ab", .finish = v1::FINISH_REASON_EOS, .stop_reason = nullptr},
       {.index = 1, .text = "cd", .finish = v1::FINISH_REASON_STOP, .stop_reason = "\n"}},
      {nullptr, nullptr}, {.prompt_tokens = 3, .completion_tokens = 5});
  EXPECT_EQ(r, json::parse(R"({
    "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "text": "ab", "logprobs": null, "finish_reason": "stop",
                 "stop_reason": null},
                {"index": 1, "text": "cd", "logprobs": null, "finish_reason": "stop",
                 "stop_reason": "\n"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})"));
}

TEST(ChatResponse, HasOpenAIsShape) {
  const json r = ChatResponse(
      kHead, {{.index = 0, .text = "hi", .finish = v1::FINISH_REASON_STOP, .stop_reason = 128009}},
      {}, {.prompt_tokens = 1, .completion_tokens = 1});
  EXPECT_EQ(r, json::parse(R"({
    "id": "cmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "logprobs": null, "finish_reason": "stop", "stop_reason": 128009}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})"));
}

TEST(Chunks, CarryUsageNullOnlyWhenTheStreamAskedForUsage) {
  json c = CompletionChunk(kHead, 2, "x", nullptr, v1::FINISH_REASON_UNSPECIFIED, false);
  EXPECT_FALSE(c.contains("usage"));
  EXPECT_EQ(c["choices"][0], json::parse(R"({"index": 2, "text": "x", "logprobs": null,
                                             "finish_reason": null, "stop_reason": null})"));
  c = ChatChunk(kHead, 0, {{"content", "y"}}, nullptr, v1::FINISH_REASON_LENGTH, true);
  EXPECT_EQ(c["object"], "chat.completion.chunk");
  EXPECT_TRUE(c["usage"].is_null());
  EXPECT_EQ(c["choices"][0]["delta"], json::parse(R"({"content": "y"})"));
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  c = ChatChunk(kHead, 0, json::object(), nullptr, v1::FINISH_REASON_STOP, false, "END");
  EXPECT_EQ(c["choices"][0]["stop_reason"], "END");
  c = CompletionChunk(kHead, 0, "", nullptr, v1::FINISH_REASON_STOP, false, 13);
  EXPECT_EQ(c["choices"][0]["stop_reason"], 13);
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

TEST(StopReasonJson, IsTheStopStringOrTokenThatEndedTheChoiceAndNullOtherwise) {
  const std::vector<int32_t> tokens = {5, 6, 7};
  const std::vector<std::string> stops = {"xx", "END", "E"};
  // A stop string: the one at the cut, even where another of the list matches there too later
  // in the list order, or earlier in the text (inside min_tokens, where it did not stop).
  EXPECT_EQ(StopReasonJson(v1::FINISH_REASON_STOP, tokens, 3, "abcEND", stops), "END");
  EXPECT_EQ(StopReasonJson(v1::FINISH_REASON_STOP, tokens, 5, "xxabcEND", {"xx", "END"}), "END");
  // A stop token: its id.
  EXPECT_EQ(StopReasonJson(v1::FINISH_REASON_STOP, tokens, -1, "", stops), 7);
  EXPECT_TRUE(StopReasonJson(v1::FINISH_REASON_EOS, tokens, -1, "", stops).is_null());
  EXPECT_TRUE(StopReasonJson(v1::FINISH_REASON_LENGTH, tokens, -1, "", stops).is_null());
  EXPECT_TRUE(StopReasonJson(v1::FINISH_REASON_UNSPECIFIED, tokens, -1, "", stops).is_null());
}

TEST(EchoedLogprobs, PutThePromptsTokensFirstWithNullForTheFirst) {
  const std::vector<int32_t> prompt = {3, 4, 5};
  const std::vector<TokenLogprob> prompt_lp = {
      {.token = 4, .logprob = -1.0f, .top = {{4, -1.0f}}},
      {.token = 5, .logprob = -2.0f, .top = {{5, -2.0f}}}};
  const std::vector<TokenLogprob> generated = {{.token = 6, .logprob = -0.5f, .top = {{6, -0.5f}}}};
  const json lp = EchoedLogprobs(nullptr, prompt, prompt_lp,
                                 CompletionLogprobs(nullptr, generated, 0, true), true);
  EXPECT_EQ(lp["tokens"],
            json::parse(R"(["token_id:3", "token_id:4", "token_id:5", "token_id:6"])"));
  EXPECT_EQ(lp["token_logprobs"], json::parse("[null, -1.0, -2.0, -0.5]"));
  EXPECT_EQ(lp["top_logprobs"], json::parse(R"([null, {"token_id:4": -1.0},
                                                 {"token_id:5": -2.0}, {"token_id:6": -0.5}])"));
  EXPECT_EQ(lp["text_offset"].size(), 4u);
}

}  // namespace
}  // namespace tandem::openai
