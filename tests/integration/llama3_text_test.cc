// A coordinator serving a folder with Meta's Llama-3 tokenizer files (tokenizer.json with its
// BOS template, tokenizer_config.json, generation_config.json listing EOS ids 128001 and 128009)
// next to random weights of a small Llama-3-shaped model (vocabulary 128256). The LM head is set
// so that greedy decoding always picks an EOS id: row 128001 is +100 and row 128009 is -100 along
// the one dimension the final norm keeps, so which one wins follows the sign of that dimension;
// the embeddings of two tokens are +1000 and -1000 there, which sets the sign at their position
// whatever the random layers add.
// Shows: GetModelInfo reports the text settings (both EOS ids), a text prompt gets BOS first, and
// generation stops at whichever of the two EOS ids comes.
// Usage (from llama3_text_test.sh): llama3_text_test <folder with the Llama-3 tokenizer files>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <span>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"

namespace tandem::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;

constexpr int32_t kBos = 128000, kEndOfText = 128001, kEndOfTurn = 128009;
// Prompts ending in these tokens make greedy decoding pick 128001 and 128009.
constexpr int32_t kPicksEndOfText = 1000, kPicksEndOfTurn = 2000;

fs::path& Llama3Files() {
  static fs::path dir;
  return dir;
}

std::string Read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void Write(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Rewrites f32 tensor `name` of a single-file checkpoint in place through `edit`.
void EditTensor(const fs::path& file, const std::string& name,
                const std::function<void(std::span<float>)>& edit) {
  std::string bytes = Read(file);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len));
  ASSERT_TRUE(header.contains(name)) << name;
  ASSERT_EQ(header[name]["dtype"], "F32");
  const size_t begin = 8 + header_len + header[name]["data_offsets"][0].get<size_t>();
  const size_t end = 8 + header_len + header[name]["data_offsets"][1].get<size_t>();
  std::vector<float> values((end - begin) / sizeof(float));
  std::memcpy(values.data(), bytes.data() + begin, end - begin);
  edit(values);
  std::memcpy(bytes.data() + begin, values.data(), end - begin);
  Write(file, bytes);
}

class Llama3TextTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::path(::testing::TempDir()) / absl::StrFormat("tandem-llama3-text-%d", getpid());
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok()) << c.status();
    c->vocab_size = 128256;
    c->bos_token_id = kBos;
    c->eos_token_id = kEndOfText;  // config.json names one EOS; generation_config.json two
    c->dtype = DType::kF32;
    ASSERT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 3}, dir_).ok());
    // Meta's files: the package's tokenizer.json with the BOS template Meta's current one has.
    nlohmann::json tok = nlohmann::json::parse(Read(Llama3Files() / "tokenizer.json"));
    tok["post_processor"] = {
        {"type", "Sequence"},
        {"processors",
         {{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false},
           {"use_regex", true}},
          {{"type", "TemplateProcessing"},
           {"single", {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                       {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
           {"pair", nlohmann::json::array()},
           {"special_tokens",
            {{"<|begin_of_text|>",
              {{"id", "<|begin_of_text|>"}, {"ids", {kBos}}, {"tokens", {"<|begin_of_text|>"}}}}}}}}}};
    Write(dir_ / "tokenizer.json", tok.dump());
    fs::copy_file(Llama3Files() / "tokenizer_config.json", dir_ / "tokenizer_config.json",
                  fs::copy_options::overwrite_existing);
    Write(dir_ / "generation_config.json",
          nlohmann::json({{"bos_token_id", kBos}, {"eos_token_id", {kEndOfText, kEndOfTurn}},
                          {"do_sample", true}, {"temperature", 0.6}, {"top_p", 0.9}})
              .dump());
    // Greedy always picks 128001 or 128009, by the last prompt token (see the file comment).
    const size_t hidden = c->hidden_size;
    EditTensor(dir_ / "model.safetensors", "model.embed_tokens.weight", [&](std::span<float> e) {
      e[kPicksEndOfText * hidden] = 1000.0f;
      e[kPicksEndOfTurn * hidden] = -1000.0f;
    });
    EditTensor(dir_ / "model.safetensors", "model.norm.weight", [](std::span<float> norm) {
      std::fill(norm.begin(), norm.end(), 0.0f);
      norm[0] = 1.0f;
    });
    EditTensor(dir_ / "model.safetensors", "lm_head.weight", [&](std::span<float> head) {
      std::fill(head.begin(), head.end(), 0.0f);
      head[kEndOfText * hidden] = 100.0f;
      head[kEndOfTurn * hidden] = -100.0f;
    });

    absl::StatusOr<std::unique_ptr<Cluster>> cluster =
        Cluster::Start({.model_dir = dir_, .workers = 1, .stages = 1, .replicas = 1});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static v1::GenerateResponse Generate(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    const grpc::Status s = cluster_->inference().Generate(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message() << "\n" << cluster_->Logs();
    return resp;
  }

  static fs::path dir_;
  static Cluster* cluster_;
};

fs::path Llama3TextTest::dir_;
Cluster* Llama3TextTest::cluster_ = nullptr;

TEST_F(Llama3TextTest, ModelInfoReportsTheTextSettings) {
  ASSERT_NE(cluster_, nullptr);
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(cluster_->inference().GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_TRUE(info.has_tokenizer());
  EXPECT_EQ(info.bos_token_id(), kBos);
  EXPECT_THAT(info.eos_token_ids(), ElementsAre(kEndOfText, kEndOfTurn));
  EXPECT_TRUE(info.add_bos_token());
  EXPECT_TRUE(info.has_chat_template());
}

TEST_F(Llama3TextTest, TextPromptGetsBosFirst) {
  ASSERT_NE(cluster_, nullptr);
  auto tok = Tokenizer::FromTokenizerJson(Llama3Files() / "tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int32_t> text_ids = (*tok)->Encode("Hello world", false).value();
  ASSERT_THAT(text_ids, ElementsAre(9906, 1917));  // Hugging Face's ids for "Hello world"
  v1::GenerateRequest req;
  req.set_prompt("Hello world");
  req.set_max_new_tokens(1);
  req.mutable_sampling()->set_prompt_logprobs(true);
  const v1::GenerateResponse resp = Generate(req);
  EXPECT_EQ(resp.usage().prompt_tokens(), 3);
  // Logprobs are given for prompt tokens 1..: the first of them is "Hello", so BOS came first.
  ASSERT_GE(resp.prompt_logprobs_size(), 1);
  EXPECT_EQ(resp.prompt_logprobs(0).token_id(), 9906);
}

// With ignore_eos the first token shows which EOS id greedy decoding picks; without it the request
// ends there with finish reason EOS, whichever of the two it is.
TEST_F(Llama3TextTest, StopsAtEitherEosId) {
  ASSERT_NE(cluster_, nullptr);
  for (const auto [last, eos] : {std::pair{kPicksEndOfText, kEndOfText},
                                 std::pair{kPicksEndOfTurn, kEndOfTurn}}) {
    for (int32_t middle : {5, 300, 9000}) {
      v1::GenerateRequest req;
      req.add_token_ids(kBos);
      req.add_token_ids(middle);
      req.add_token_ids(last);
      req.set_max_new_tokens(3);
      req.set_ignore_eos(true);
      const v1::GenerateResponse ignored = Generate(req);
      ASSERT_GE(ignored.token_ids_size(), 1);
      EXPECT_EQ(ignored.token_ids(0), eos) << "prompt ending in " << last;
      EXPECT_EQ(ignored.finish_reason(), v1::FINISH_REASON_LENGTH);

      req.set_ignore_eos(false);
      const v1::GenerateResponse stopped = Generate(req);
      EXPECT_EQ(stopped.finish_reason(), v1::FINISH_REASON_EOS) << "EOS id " << eos;
      EXPECT_EQ(stopped.usage().completion_tokens(), 1) << "EOS id " << eos;
    }
  }
}

}  // namespace
}  // namespace tandem::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <folder with the Llama-3 tokenizer files>\n", argv[0]);
    return 2;
  }
  tandem::testing::Llama3Files() = argv[1];
  return RUN_ALL_TESTS();
}
