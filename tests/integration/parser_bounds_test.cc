// Hostile structure in what a client sends, through a real coordinator: JSON nested 30,000 deep
// in chat_template_kwargs, tools or a message field, and a prompt on which the checkpoint's
// tokenizer regex backtracks catastrophically (`(a+)+$`). Each is refused with a 400 or
// INVALID_ARGUMENT naming the field or the pattern, and a normal request right after is answered.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/httplib.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kCatastrophicPattern[] = "(a+)+$";

std::filesystem::path TempPath(const std::string& name) {
  return std::filesystem::path(::testing::TempDir()) / absl::StrCat(name, "-", getpid());
}

nlohmann::json ReadJson(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void WriteJson(const std::filesystem::path& path, const nlohmann::json& json) {
  std::ofstream out(path, std::ios::trunc);
  out << json.dump();
}

// tiny-llama with a chat template that reads every message, the tools and the kwargs, and a
// tokenizer whose pre-tokenizer first splits on `(a+)+$` (harmless on text without a run of a's
// before a non-a at the end, exponential on such a run).
std::filesystem::path WriteModel() {
  const std::filesystem::path dir = TempPath("parser-bounds-model");
  absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
  EXPECT_TRUE(c.ok()) << c.status();
  const absl::Status s = WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 5}, dir);
  EXPECT_TRUE(s.ok()) << s;

  nlohmann::json tokenizer = ReadJson(dir / "tokenizer.json");
  nlohmann::json split = {{"type", "Split"},
                          {"pattern", {{"Regex", kCatastrophicPattern}}},
                          {"behavior", "Isolated"},
                          {"invert", false}};
  nlohmann::json steps = nlohmann::json::array({split});
  if (!tokenizer["pre_tokenizer"].is_null()) steps.push_back(tokenizer["pre_tokenizer"]);
  tokenizer["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", steps}};
  WriteJson(dir / "tokenizer.json", tokenizer);

  nlohmann::json config = nlohmann::json::object();
  if (std::filesystem::exists(dir / "tokenizer_config.json")) {
    config = ReadJson(dir / "tokenizer_config.json");
  }
  config["chat_template"] =
      "{% for m in messages %}{{ m.role }}: {{ m.content }} {{ m.extra | tojson }}\n{% endfor %}"
      "{{ tools | tojson }} {{ x | tojson }}";
  WriteJson(dir / "tokenizer_config.json", config);
  return dir;
}

class ParserBoundsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { model_ = new std::filesystem::path(WriteModel()); }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*model_);
    delete model_;
  }

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Cluster>> c =
        Cluster::Start({.model_dir = *model_, .coordinator_flags = {"--http_listen=127.0.0.1:0"}});
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
    std::smatch m;
    const std::string logs = cluster_->Logs();
    ASSERT_TRUE(std::regex_search(logs, m, std::regex("http on port ([0-9]+)"))) << logs;
    http_ = std::make_unique<httplib::Client>("127.0.0.1", std::stoi(m[1].str()));
    http_->set_read_timeout(120);
    http_->set_write_timeout(120);
  }

  httplib::Result Chat(const std::string& body) {
    return http_->Post("/v1/chat/completions", body, "application/json");
  }

  // A normal chat request is answered with a choice.
  void ExpectChatServed() {
    httplib::Result r = Chat(
        R"({"messages": [{"role": "user", "content": "Hello", "extra": {"k": [1]}}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": "none", "chat_template_kwargs": {"x": [1, 2]}, "max_tokens": 2})");
    ASSERT_TRUE(r) << httplib::to_string(r.error()) << cluster_->Logs();
    EXPECT_EQ(r->status, 200) << r->body << cluster_->Logs();
    EXPECT_THAT(r->body, HasSubstr("\"choices\""));
  }

  static std::filesystem::path* model_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<httplib::Client> http_;
};
std::filesystem::path* ParserBoundsTest::model_ = nullptr;

std::string Nested(int levels) { return std::string(levels, '[') + "1" + std::string(levels, ']'); }

TEST_F(ParserBoundsTest, JsonNestedThirtyThousandDeepIsRefusedAndTheServiceAnswers) {
  const std::string message = R"({"role": "user", "content": "hi")";
  const std::string deep = Nested(30000);
  const std::pair<std::string, std::string> bodies[] = {
      {R"({"messages": [)" + message + R"(}], "chat_template_kwargs": {"x": )" + deep + "}}",
       "chat_template_kwargs.x[0]"},
      {R"({"messages": [)" + message + R"(}], "tools": )" + deep + "}", "tools[0]"},
      {R"({"messages": [)" + message + R"(, "extra": )" + deep + "}]}", "messages[0].extra[0]"},
  };
  for (const auto& [body, param] : bodies) {
    httplib::Result r = Chat(body);
    ASSERT_TRUE(r) << httplib::to_string(r.error()) << cluster_->Logs();
    EXPECT_EQ(r->status, 400) << r->body;
    const nlohmann::json error = nlohmann::json::parse(r->body, nullptr, false);
    ASSERT_TRUE(error.is_object()) << r->body;
    EXPECT_THAT(error["error"]["param"].get<std::string>(), ::testing::StartsWith(param));
    EXPECT_THAT(r->body, HasSubstr("deeper than 128 levels"));
  }
  ExpectChatServed();
}

TEST_F(ParserBoundsTest, CatastrophicTokenizerRegexFailsTheRequestAndFreesTheCore) {
  // 40 a's and a 'b': `(a+)+$` tries 2^40 splits of the a's before giving up at each start.
  const std::string prompt = std::string(40, 'a') + "b";
  httplib::Result r =
      http_->Post("/v1/completions", nlohmann::json{{"prompt", prompt}, {"max_tokens", 2}}.dump(),
                  "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error()) << cluster_->Logs();
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_THAT(r->body, HasSubstr("tokenizer.json"));
  EXPECT_THAT(r->body, HasSubstr(kCatastrophicPattern));

  r = http_->Post("/tokenize", nlohmann::json{{"prompt", prompt}}.dump(), "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_THAT(r->body, HasSubstr(kCatastrophicPattern));

  v1::GenerateRequest req;
  req.set_prompt(prompt);
  req.set_max_new_tokens(2);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  v1::GenerateResponse resp;
  grpc::Status s = cluster_->inference().Generate(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(kCatastrophicPattern));

  // Normal requests over both APIs are answered right after.
  v1::GenerateRequest ok;
  ok.set_prompt("Hello");
  ok.set_max_new_tokens(2);
  grpc::ClientContext ok_ctx;
  ok_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  s = cluster_->inference().Generate(&ok_ctx, ok, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message() << cluster_->Logs();
  ExpectChatServed();
}

}  // namespace
}  // namespace tandem::testing
