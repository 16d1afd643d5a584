// The OpenAI API's request bodies: every refusal with its HTTP status and the field it names, the
// defaults, and what the coordinator's request becomes.
#include "coordinator/openai/request_parsing.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded_json.h"
#include "coordinator/openai/api_error.h"
#include "coordinator/request_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::openai {
namespace {

using ::testing::HasSubstr;

struct Refusal {
  std::string body;
  std::string param;  // "" : no field
};

// Every invalid completion body: each is a 400 naming `param`.
const Refusal kCompletionRefusals[] = {
    {R"(not json)", ""},
    {R"([1, 2])", ""},
    {R"({})", "prompt"},
    {R"({"prompt": 3})", "prompt"},
    {R"({"prompt": ""})", "prompt"},
    {R"({"prompt": []})", "prompt"},
    {R"({"prompt": ["a", 3]})", "prompt[1]"},
    {R"({"prompt": ["a", ""]})", "prompt[1]"},
    {R"({"prompt": [1, "a"]})", "prompt[1]"},
    {R"({"prompt": [1, 2.5]})", "prompt[1]"},
    {R"({"prompt": [[1], []]})", "prompt[1]"},
    {R"({"prompt": [[1], [4294967296]]})", "prompt[1][0]"},
    {R"({"prompt": "a", "model": 3})", "model"},
    {R"({"prompt": "a", "n": 0})", "n"},
    {R"({"prompt": "a", "n": 17})", "n"},
    {R"({"prompt": "a", "n": 1.5})", "n"},
    {R"({"prompt": ["a","b","c","d","e","f","g","h","i"], "n": 16})", "n"},
    {R"({"prompt": "a", "stream": "yes"})", "stream"},
    {R"({"prompt": "a", "stream_options": {"include_usage": true}})", "stream_options"},
    {R"({"prompt": "a", "stream": true, "stream_options": 1})", "stream_options"},
    {R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": 1}})",
     "stream_options.include_usage"},
    {R"({"prompt": "a", "user": 7})", "user"},
    {R"({"prompt": "a", "temperature": -0.1})", "temperature"},
    {R"({"prompt": "a", "temperature": 2.5})", "temperature"},
    {R"({"prompt": "a", "temperature": "hot"})", "temperature"},
    {R"({"prompt": "a", "top_p": 0})", "top_p"},
    {R"({"prompt": "a", "top_p": 1.5})", "top_p"},
    {R"({"prompt": "a", "top_k": -2})", "top_k"},
    {R"({"prompt": "a", "top_k": 2.5})", "top_k"},
    {R"({"prompt": "a", "min_p": 1.5})", "min_p"},
    {R"({"prompt": "a", "presence_penalty": 2.5})", "presence_penalty"},
    {R"({"prompt": "a", "frequency_penalty": -3})", "frequency_penalty"},
    {R"({"prompt": "a", "repetition_penalty": 0})", "repetition_penalty"},
    {R"({"prompt": "a", "repetition_penalty": 101})", "repetition_penalty"},
    {R"({"prompt": "a", "seed": "x"})", "seed"},
    {R"({"prompt": "a", "seed": 1e30})", "seed"},
    {R"({"prompt": "a", "max_tokens": 0})", "max_tokens"},
    {R"({"prompt": "a", "max_tokens": "10"})", "max_tokens"},
    {R"({"prompt": "a", "max_completion_tokens": -1})", "max_completion_tokens"},
    {R"({"prompt": "a", "stop": 3})", "stop"},
    {R"({"prompt": "a", "stop": ""})", "stop"},
    {R"({"prompt": "a", "stop": ["x", ""]})", "stop[1]"},
    {R"({"prompt": "a", "stop": ["x", 1]})", "stop[1]"},
    {R"({"prompt": "a", "stop_token_ids": 3})", "stop_token_ids"},
    {R"({"prompt": "a", "stop_token_ids": [1, "x"]})", "stop_token_ids[1]"},
    {R"({"prompt": "a", "ignore_eos": 1})", "ignore_eos"},
    {R"({"prompt": "a", "min_tokens": -1})", "min_tokens"},
    {R"({"prompt": "a", "min_tokens": 5, "max_tokens": 4})", "min_tokens"},
    {R"({"prompt": "a", "timeout": 0})", "timeout"},
    {R"({"prompt": "a", "timeout": "1s"})", "timeout"},
    {R"({"prompt": "a", "logit_bias": {"1": 5}})", "logit_bias"},
    {R"({"prompt": "a", "best_of": 3})", "best_of"},
    {R"({"prompt": "a", "response_format": {"type": "xml"}})", "response_format.type"},
    {R"({"prompt": "a", "logprobs": 21})", "logprobs"},
    {R"({"prompt": "a", "logprobs": true})", "logprobs"},
    {R"({"prompt": "a", "echo": "yes"})", "echo"},
    {R"({"prompt": "a", "suffix": "b"})", "suffix"},
    {R"({"prompt": "a", "return_token_ids": 1})", "return_token_ids"},
    {R"({"prompt": "a", "return_tokens_as_token_ids": "yes"})", "return_tokens_as_token_ids"},
};

TEST(ParseCompletionRequest, RefusesEveryInvalidFieldWith400NamingIt) {
  for (const Refusal& r : kCompletionRefusals) {
    SCOPED_TRACE(r.body);
    absl::StatusOr<ApiRequest> got = ParseCompletionRequest(r.body);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(HttpStatusOf(got.status()), 400);
    EXPECT_EQ(ParamOf(got.status()), r.param);
    if (!r.param.empty()) EXPECT_THAT(std::string(got.status().message()), HasSubstr(r.param));
    const nlohmann::json body = ErrorBody(got.status());
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
    EXPECT_EQ(body["error"]["code"], 400);
    if (r.param.empty()) {
      EXPECT_TRUE(body["error"]["param"].is_null());
    } else {
      EXPECT_EQ(body["error"]["param"], r.param);
    }
  }
}

const Refusal kChatRefusals[] = {
    {R"({})", "messages"},
    {R"({"messages": {}})", "messages"},
    {R"({"messages": []})", "messages"},
    {R"({"messages": [3]})", "messages[0]"},
    {R"({"messages": [{"content": "hi"}]})", "messages[0].role"},
    {R"({"messages": [{"role": "robot", "content": "hi"}]})", "messages[0].role"},
    {R"({"messages": [{"role": "user"}]})", "messages[0].content"},
    {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
    {R"({"messages": [{"role": "user", "content": [5]}]})", "messages[0].content[0]"},
    {R"({"messages": [{"role": "user", "content": [{"text": "a"}]}]})",
     "messages[0].content[0].type"},
    {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
     "messages[0].content[0].type"},
    {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]})",
     "messages[0].content[0].text"},
    {R"({"messages": [{"role": "user", "content": "a"}], "tools": {}})", "tools"},
    {R"({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 1})",
     "add_generation_prompt"},
    {R"({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": []})",
     "chat_template_kwargs"},
    {R"({"messages": [{"role": "user", "content": "a"}], "continue_final_message": 1})",
     "continue_final_message"},
    {R"({"messages": [{"role": "assistant", "content": "a"}], "continue_final_message": true,
         "add_generation_prompt": true})",
     "continue_final_message"},
    {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}],
         "continue_final_message": true})",
     "messages[1].content"},
    {R"({"messages": [{"role": "user", "content": "a"}], "logprobs": 1})", "logprobs"},
    {R"({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})", "top_logprobs"},
    {R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 21})",
     "top_logprobs"},
    {R"({"messages": [{"role": "user", "content": "a"}], "temperature": 3})", "temperature"},
};

TEST(ParseChatRequest, RefusesEveryInvalidFieldWith400NamingIt) {
  for (const Refusal& r : kChatRefusals) {
    SCOPED_TRACE(r.body);
    absl::StatusOr<ApiRequest> got = ParseChatRequest(r.body);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(HttpStatusOf(got.status()), 400);
    EXPECT_EQ(ParamOf(got.status()), r.param);
  }
}

// `levels` arrays inside each other around 1.
std::string Nested(int levels) { return std::string(levels, '[') + "1" + std::string(levels, ']'); }

struct DeepBody {
  std::string body;
  std::string field;
  int levels;  // how deep the body nests
};

// Chat bodies whose chat_template_kwargs, tools or message carry `levels` nested arrays.
std::vector<DeepBody> DeepChatBodies(int levels) {
  const std::string message = R"({"role": "user", "content": "hi")";
  const std::string value = Nested(levels);
  return {
      {R"({"messages": [)" + message + R"(}], "chat_template_kwargs": {"x": )" + value + "}}",
       "chat_template_kwargs.x", levels + 2},
      {R"({"messages": [)" + message +
           R"(}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": )" +
           value + "}}}]}",
       "tools[0].function.parameters.x", levels + 5},
      {R"({"messages": [)" + message + R"(, "extra": )" + value + "}]}", "messages[0].extra",
       levels + 3},
  };
}

TEST(ParseChatRequest, JsonNestedThirtyThousandDeepIsRefusedNamingTheFieldAndLimit) {
  for (const DeepBody& b : DeepChatBodies(30000)) {
    absl::StatusOr<ApiRequest> got = ParseChatRequest(b.body);
    ASSERT_FALSE(got.ok()) << b.field;
    EXPECT_EQ(HttpStatusOf(got.status()), 400);
    EXPECT_THAT(ParamOf(got.status()), ::testing::StartsWith(b.field));
    EXPECT_THAT(got.status().message(), HasSubstr("deeper than 128 levels"));
  }
}

TEST(ParseChatRequest, JsonNestedAtTheLimitIsAcceptedAndOneLevelMoreRefused) {
  const std::vector<DeepBody> shapes = DeepChatBodies(0);
  for (size_t i = 0; i < shapes.size(); ++i) {
    // shapes[i].levels is the body's own nesting around the value.
    const int at_limit = kMaxJsonDepth - shapes[i].levels;
    EXPECT_TRUE(ParseChatRequest(DeepChatBodies(at_limit)[i].body).ok()) << shapes[i].field;
    EXPECT_FALSE(ParseChatRequest(DeepChatBodies(at_limit + 1)[i].body).ok()) << shapes[i].field;
  }
}

TEST(ParseChatRequest, ContinueFinalMessageTurnsTheGenerationPromptOffByDefault) {
  const std::string messages = R"("messages": [{"role": "assistant", "content": "Once"}])";
  absl::StatusOr<ApiRequest> r =
      ParseChatRequest(absl::StrCat("{", messages, R"(, "continue_final_message": true})"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->continue_final_message);
  EXPECT_FALSE(r->add_generation_prompt);
  r = ParseChatRequest(absl::StrCat("{", messages, "}"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->continue_final_message);
  EXPECT_TRUE(r->add_generation_prompt);
}

// The template sees objects as the client wrote them: Hugging Face's tojson keeps Python's dict
// order, and a sorted one changes the prompt's tokens.
TEST(ParseChatRequest, KeepsTheClientsKeyOrderInMessagesToolsAndKwargs) {
  absl::StatusOr<ApiRequest> r = ParseChatRequest(R"({
      "messages": [{"role": "user", "name": "z", "content": "a"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {
          "type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {}}}}}],
      "chat_template_kwargs": {"z": 1, "a": 2}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->messages[0].dump(), R"({"role":"user","name":"z","content":"a"})");
  EXPECT_EQ(r->tools[0]["function"]["parameters"]["properties"].dump(),
            R"({"zeta":{"type":"string"},"alpha":{}})");
  EXPECT_EQ(r->template_kwargs.dump(), R"({"z":1,"a":2})");
}

const Refusal kTokenizeRefusals[] = {
    {R"({})", "prompt"},
    {R"({"prompt": 3})", "prompt"},
    {R"({"prompt": "a", "messages": []})", "messages"},
    {R"({"messages": []})", "messages"},
    {R"({"messages": [{"role": "user"}]})", "messages[0].content"},
    {R"({"prompt": "a", "add_special_tokens": "no"})", "add_special_tokens"},
    {R"({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 0})",
     "add_generation_prompt"},
    {R"({"messages": [{"role": "user", "content": "a"}], "tools": 1})", "tools"},
    {R"({"messages": [{"role": "assistant", "content": "a"}], "continue_final_message": true,
         "add_generation_prompt": true})",
     "continue_final_message"},
};

TEST(ParseTokenizeRequest, RefusesEveryInvalidFieldWith400NamingIt) {
  for (const Refusal& r : kTokenizeRefusals) {
    SCOPED_TRACE(r.body);
    absl::StatusOr<TokenizeRequest> got = ParseTokenizeRequest(r.body);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(HttpStatusOf(got.status()), 400);
    EXPECT_EQ(ParamOf(got.status()), r.param);
  }
}

// vLLM's defaults: a prompt gets the tokenizer's special tokens, messages do not (the template
// writes its own BOS).
TEST(ParseTokenizeRequest, AddsSpecialTokensToAPromptButNotToMessagesByDefault) {
  absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(R"({"prompt": ""})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->chat);
  EXPECT_TRUE(r->add_special_tokens);
  r = ParseTokenizeRequest(R"({"prompt": "", "add_special_tokens": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->add_special_tokens);
  r = ParseTokenizeRequest(R"({"messages": [{"role": "assistant", "content": "a"}],
                               "continue_final_message": true, "tools": []})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->chat);
  EXPECT_FALSE(r->add_special_tokens);
  EXPECT_TRUE(r->conversation.continue_final_message);
  EXPECT_FALSE(r->conversation.add_generation_prompt);
  EXPECT_TRUE(r->conversation.tools.is_array());
  r = ParseTokenizeRequest(R"({"messages": [{"role": "user", "content": "a"}],
                               "add_special_tokens": true})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->add_special_tokens);
  EXPECT_TRUE(r->conversation.add_generation_prompt);
}

TEST(PromptRequest, EchoWithLogprobsAsksForThePromptsLogprobs) {
  absl::StatusOr<ApiRequest> r =
      ParseCompletionRequest(R"({"prompt": "a", "echo": true, "logprobs": 2})");
  ASSERT_TRUE(r.ok()) << r.status();
  v1::GenerateRequest g = PromptRequest(*r, {1, 2});
  EXPECT_TRUE(g.sampling().prompt_logprobs());
  EXPECT_EQ(g.sampling().prompt_top_logprobs(), 2);
  r = ParseCompletionRequest(R"({"prompt": "a", "logprobs": 2})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(PromptRequest(*r, {1, 2}).sampling().prompt_logprobs());
  EXPECT_EQ(ParamOf(ToApiError(absl::InvalidArgumentError("sampling.prompt_top_logprobs: x"),
                               Endpoint::kCompletions, "prompt")),
            "echo");
}

TEST(ParseJsonBody, EveryJsonEndpointsBodyIsBoundedTheSameWay) {
  absl::StatusOr<nlohmann::ordered_json> got = ParseJsonBody(R"({"prompt": )" + Nested(200) + "}");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(ParamOf(got.status()), "prompt[0][0][0][0][0]...");
  EXPECT_TRUE(ParseJsonBody(R"({"prompt": "a"})").ok());
  EXPECT_FALSE(ParseJsonBody("[1]").ok());
}

TEST(ParseCompletionRequest, DefaultsAreOpenAIs) {
  absl::StatusOr<ApiRequest> r = ParseCompletionRequest(R"({"prompt": "hi", "unknown": [1]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->n, 1);
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->seed.has_value());
  EXPECT_FALSE(r->logprobs.has_value());
  EXPECT_EQ(r->generation.sampling().temperature(), 1.0f);
  EXPECT_FALSE(r->generation.sampling().has_top_p());
  EXPECT_EQ(r->generation.max_new_tokens(), 16);
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0].text, "hi");
  // Nulls are absent fields, as OpenAI's clients send them.
  r = ParseCompletionRequest(R"({"prompt": "hi", "temperature": null, "stop": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generation.sampling().temperature(), 1.0f);
}

TEST(ParseCompletionRequest, ReadsVllmsTokenIdOptions) {
  absl::StatusOr<ApiRequest> plain = ParseCompletionRequest(R"({"prompt": "a"})");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->return_token_ids);
  EXPECT_FALSE(plain->tokens_as_ids);
  absl::StatusOr<ApiRequest> both = ParseCompletionRequest(
      R"({"prompt": "a", "return_token_ids": true, "return_tokens_as_token_ids": true})");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_TRUE(both->return_token_ids);
  EXPECT_TRUE(both->tokens_as_ids);
  absl::StatusOr<ApiRequest> chat = ParseChatRequest(
      R"({"messages": [{"role": "user", "content": "a"}], "return_token_ids": true})");
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_TRUE(chat->return_token_ids);
  EXPECT_FALSE(chat->tokens_as_ids);
}

TEST(ParseCompletionRequest, ReadsEveryPromptForm) {
  absl::StatusOr<ApiRequest> r = ParseCompletionRequest(R"({"prompt": ["a", "b"]})");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(r->prompts[1].text, "b");
  r = ParseCompletionRequest(R"({"prompt": [5, 6, 7]})");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_TRUE(r->prompts[0].is_tokens);
  EXPECT_EQ(r->prompts[0].token_ids, (std::vector<int32_t>{5, 6, 7}));
  r = ParseCompletionRequest(R"({"prompt": [[5], [6, 7]]})");
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(r->prompts[1].token_ids, (std::vector<int32_t>{6, 7}));
}

TEST(PromptRequest, CarriesEverySamplingField) {
  absl::StatusOr<ApiRequest> r = ParseCompletionRequest(R"({
      "prompt": "x", "n": 3, "seed": 42, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
      "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
      "repetition_penalty": 1.2, "max_completion_tokens": 9, "max_tokens": 5,
      "stop": "END", "stop_token_ids": [3], "ignore_eos": true, "logprobs": 2,
      "min_tokens": 4, "timeout": 1.5})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->min_tokens, 4);
  const v1::GenerateRequest g = PromptRequest(*r, {1, 2});
  EXPECT_EQ(g.token_ids_size(), 2);
  EXPECT_EQ(g.sampling().n(), 3);
  EXPECT_EQ(g.sampling().seed(), 42u);
  EXPECT_FLOAT_EQ(g.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().top_p(), 0.9f);
  EXPECT_EQ(g.sampling().top_k(), 7);
  EXPECT_FLOAT_EQ(g.sampling().min_p(), 0.1f);
  EXPECT_FLOAT_EQ(g.sampling().presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().frequency_penalty(), -0.5f);
  EXPECT_FLOAT_EQ(g.sampling().repetition_penalty(), 1.2f);
  EXPECT_TRUE(g.sampling().logprobs());
  EXPECT_EQ(g.sampling().top_logprobs(), 2);
  EXPECT_EQ(g.max_new_tokens(), 9);  // max_completion_tokens wins over max_tokens
  ASSERT_EQ(g.stop_size(), 1);
  EXPECT_EQ(g.stop(0), "END");
  EXPECT_EQ(g.stop_token_ids(0), 3);
  EXPECT_TRUE(g.ignore_eos());
  EXPECT_EQ(g.timeout_ms(), 1500u);
  // vLLM's top_k -1 is no limit.
  r = ParseCompletionRequest(R"({"prompt": "x", "top_k": -1})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(PromptRequest(*r, {1}).sampling().top_k(), 0);
}

TEST(ParseChatRequest, JoinsTextPartsAndKeepsTheRest) {
  absl::StatusOr<ApiRequest> r = ParseChatRequest(R"({
      "messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": "b"}]},
                   {"role": "assistant", "tool_calls": []}],
      "logprobs": true, "top_logprobs": 3, "add_generation_prompt": false,
      "tools": [{"type": "function", "function": {"name": "f"}}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->messages[1]["content"], "a\nb");
  EXPECT_EQ(r->messages[2]["content"], "");  // as vLLM gives it to templates
  EXPECT_EQ(r->logprobs, 3);
  EXPECT_FALSE(r->add_generation_prompt);
  EXPECT_EQ(r->tools.size(), 1u);
  EXPECT_FALSE(r->generation.has_max_new_tokens());  // chat: up to the context
  r = ParseChatRequest(R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->logprobs, 0);
}

// JSON text must be UTF-8; a body that is not gets a 400 naming the first bad byte rather than
// an error without a message.
TEST(ParseCompletionRequest, InvalidUtf8BodyIsRefusedNamingTheByteOffset) {
  for (const std::string body : {"{\"prompt\": \"ab\xFF\"}", "{\"prompt\": \"ab\xC3\"}"}) {
    absl::StatusOr<ApiRequest> r = ParseCompletionRequest(body);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(HttpStatusOf(r.status()), 400);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("not valid UTF-8: byte 14"));
  }
  absl::StatusOr<ApiRequest> r =
      ParseChatRequest("{\"messages\": [{\"role\": \"user\", \"content\": \"\xED\xA0\x80\"}]}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("not valid UTF-8: byte 43 (0xED)"));
}

// What the model limits is checked by ValidateRequest; its errors name the API's fields.
TEST(ToApiError, NamesTheApisFieldsForTheModelsLimits) {
  ModelLimits limits{.vocab_size = 100, .context_length = 32, .eos_token_id = 0};
  struct Case {
    std::string body;
    std::vector<int32_t> prompt;
    std::string param;
  } cases[] = {
      {R"({"prompt": "x"})", std::vector<int32_t>(40, 1), "prompt"},
      {R"({"prompt": "x"})", {1, 200}, "prompt"},
      {R"({"prompt": "x", "max_tokens": 33})", {1}, "max_tokens"},
      {R"({"prompt": "x", "stop_token_ids": [100]})", {1}, "stop_token_ids"},
      {absl::StrCat(R"({"prompt": "x", "stop": [)",
                    absl::StrJoin(std::vector<std::string>(33, R"("s")"), ","), "]}"),
       {1},
       "stop"},
      {absl::StrCat(R"({"prompt": "x", "stop": ")", std::string(1025, 's'), R"("})"), {1}, "stop"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    absl::StatusOr<ApiRequest> r = ParseCompletionRequest(c.body);
    ASSERT_TRUE(r.ok());
    absl::StatusOr<ValidatedRequest> v = ValidateRequest(PromptRequest(*r, c.prompt), limits,
                                                         nullptr);
    ASSERT_FALSE(v.ok());
    const absl::Status api = ToApiError(v.status(), Endpoint::kCompletions, "prompt");
    EXPECT_EQ(HttpStatusOf(api), 400);
    EXPECT_EQ(ParamOf(api), c.param) << api;
    EXPECT_THAT(std::string(api.message()), HasSubstr(c.param));
  }
  // Chat prompts are the rendered messages.
  absl::StatusOr<ApiRequest> r = ParseChatRequest(R"({"messages": [{"role":"user","content":"a"}]})");
  ASSERT_TRUE(r.ok());
  absl::StatusOr<ValidatedRequest> v =
      ValidateRequest(PromptRequest(*r, std::vector<int32_t>(40, 1)), limits, nullptr);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(ParamOf(ToApiError(v.status(), Endpoint::kChat, "messages")), "messages");
}

TEST(HttpStatusOf, MapsEveryOutcomeInOnePlace) {
  EXPECT_EQ(HttpStatusOf(absl::InvalidArgumentError("x")), 400);
  EXPECT_EQ(HttpStatusOf(absl::NotFoundError("x")), 404);
  EXPECT_EQ(HttpStatusOf(absl::ResourceExhaustedError("x")), 429);
  EXPECT_EQ(HttpStatusOf(absl::UnavailableError("x")), 503);
  EXPECT_EQ(HttpStatusOf(absl::DeadlineExceededError("x")), 504);
  EXPECT_EQ(HttpStatusOf(absl::InternalError("x")), 500);
  EXPECT_EQ(ErrorBody(absl::ResourceExhaustedError("full"))["error"]["type"], "rate_limit_error");
  EXPECT_EQ(ErrorBody(absl::ResourceExhaustedError("full"))["error"]["message"], "full");
}

}  // namespace
}  // namespace tandem::openai
