#include "coordinator/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/flags_usage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/setting_values.h"

// The coordinator's flags, made as tandem-coordinator makes them.
TANDEM_DEFINE_SETTING_FLAGS(TANDEM_COORDINATOR_SETTINGS, tandem::CoordinatorConfig,
                            OverrideWithFlagsGiven)

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(CoordinatorConfigTest, ParsesEverySetting) {
  absl::StatusOr<CoordinatorConfig> c = ParseCoordinatorConfig(R"(
listen: 127.0.0.1:6000
model_dir: /models/tiny
stages: 2
replicas: 3
max_batch: 8
max_slots: 12
max_seq_len: 128
micro_batches: 4
max_waiting: 10
prefill_chunk: 64
prefill_budget: 96
decode_ahead: false
decode_ahead_ms: 2.5
max_resumes: 5
admission_quiet_ms: 0.5
admission_wait_ms: 3
heartbeat_interval_ms: 100
heartbeat_timeout_ms: 900
drain_timeout_s: 5.5
grpc_threads: 40
)",
                                                               "test.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "127.0.0.1:6000");
  EXPECT_EQ(c->model_dir, "/models/tiny");
  EXPECT_EQ(c->stages, 2);
  EXPECT_EQ(c->replicas, 3);
  EXPECT_EQ(c->max_batch, 8);
  EXPECT_EQ(c->max_slots, 12);
  EXPECT_EQ(c->max_seq_len, 128);
  EXPECT_EQ(c->micro_batches, 4);
  EXPECT_EQ(c->max_waiting, 10);
  EXPECT_EQ(c->prefill_chunk, 64);
  EXPECT_EQ(c->prefill_budget, 96);
  EXPECT_FALSE(c->decode_ahead);
  EXPECT_DOUBLE_EQ(c->decode_ahead_ms, 2.5);
  EXPECT_EQ(c->max_resumes, 5);
  EXPECT_DOUBLE_EQ(c->admission_quiet_ms, 0.5);
  EXPECT_DOUBLE_EQ(c->admission_wait_ms, 3.0);
  EXPECT_EQ(c->heartbeat_interval_ms, 100);
  EXPECT_EQ(c->heartbeat_timeout_ms, 900);
  EXPECT_DOUBLE_EQ(c->drain_timeout_s, 5.5);
  EXPECT_EQ(c->grpc_threads, 40);
  EXPECT_TRUE(ValidateCoordinatorConfig(*c).ok());
  EXPECT_EQ(RequestThreads(*c), 3 * 12 + 10 + 8);
}

TEST(CoordinatorConfigTest, EmptyFileGivesDefaults) {
  absl::StatusOr<CoordinatorConfig> c = ParseCoordinatorConfig("", "empty.yaml");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->stages, 1);
  EXPECT_TRUE(c->decode_ahead);
  EXPECT_DOUBLE_EQ(c->decode_ahead_ms, 1.0);
  EXPECT_DOUBLE_EQ(c->admission_quiet_ms, 0.5);
  EXPECT_DOUBLE_EQ(c->admission_wait_ms, 20.0);
  EXPECT_FALSE(c->prefill_budget.has_value());
  EXPECT_EQ(c->max_resumes, 3);
  // A paged KV-cache by default (its page size decided with the model), with vLLM's defaults.
  EXPECT_EQ(c->kv_page_size, -1);
  EXPECT_TRUE(Paged(*c));
  EXPECT_EQ(MaxSlots(*c), 256);
  EXPECT_EQ(MaxBatch(*c), 256);
  EXPECT_EQ(PrefillBudget(*c), 8192);
  // The waiting bound follows the slots, at least 128: threads for the slots and the bound.
  EXPECT_FALSE(c->max_waiting.has_value());
  EXPECT_EQ(RequestThreads(*c), 256 + 256 + 8);
  c->kv_page_size = 0;
  EXPECT_EQ(RequestThreads(*c), 16 + 128 + 8);
  c->replicas = 10;
  EXPECT_EQ(RequestThreads(*c), 160 + 160 + 8);
}

// Pages of 16 by default (openllama-3b's head_dim 100 included), except for a model whose heads
// the CUDA kernels cannot page (head_dim not a multiple of 4; or not of 8 and over 128, or more
// than 8 query heads per kv head), unless pages were asked for; an explicit size is kept.
TEST(CoordinatorConfigTest, TheDefaultPageSizeFollowsTheModelsHeadDim) {
  CoordinatorConfig c;
  EXPECT_EQ(WithModelDefaults(c, 128, 4).kv_page_size, 16);
  EXPECT_EQ(WithModelDefaults(c, 64, 4).kv_page_size, 16);
  EXPECT_EQ(WithModelDefaults(c, 100, 4).kv_page_size, 16);
  EXPECT_EQ(WithModelDefaults(c, 98, 4).kv_page_size, 0);
  EXPECT_EQ(WithModelDefaults(c, 102, 4).kv_page_size, 0);
  // head_dim 100 pages with up to 8 query heads per kv head (the register kernel's reach).
  EXPECT_EQ(WithModelDefaults(c, 100, 8).kv_page_size, 16);
  EXPECT_EQ(WithModelDefaults(c, 100, 16).kv_page_size, 0);
  EXPECT_EQ(WithModelDefaults(c, 132, 1).kv_page_size, 0);
  EXPECT_EQ(WithModelDefaults(c, 256, 16).kv_page_size, 16);
  EXPECT_FALSE(Paged(WithModelDefaults(c, 98, 4)));
  EXPECT_EQ(MaxSlots(WithModelDefaults(c, 98, 4)), 16);
  c.kv_pages = 1000;  // pages asked for: paged whatever the model
  EXPECT_EQ(WithModelDefaults(c, 98, 4).kv_page_size, 16);
  c.kv_pages.reset();
  c.kv_page_size = 0;
  EXPECT_EQ(WithModelDefaults(c, 128, 4).kv_page_size, 0);
  c.kv_page_size = 64;
  EXPECT_EQ(WithModelDefaults(c, 98, 4).kv_page_size, 64);
}

// vLLM's --kv-cache-dtype: auto by default, fp8 or fp8_e4m3 from YAML or a flag; any other value,
// and FP8 with contiguous slots, refused naming the setting and the value. FP8 pages the cache
// whatever the model's heads.
TEST(CoordinatorConfigTest, TheKvCacheDtypeIsAutoOrFp8AndFp8NeedsPages) {
  CoordinatorConfig c;
  c.model_dir = "/m";
  EXPECT_EQ(c.kv_cache_dtype, "auto");
  EXPECT_EQ(KvCacheDTypeOf(c), KvCacheDType::kAuto);
  absl::StatusOr<CoordinatorConfig> yaml =
      ParseCoordinatorConfig("model_dir: /m\nkv_cache_dtype: fp8_e4m3\n", "x.yaml");
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  EXPECT_EQ(KvCacheDTypeOf(*yaml), KvCacheDType::kFp8E4M3);
  EXPECT_TRUE(ValidateCoordinatorConfig(*yaml).ok());
  for (const char* bad : {"bogus", "fp8_e5m2", "int8"}) {
    c.kv_cache_dtype = bad;
    const absl::Status s = ValidateCoordinatorConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message(), absl::StrCat("config: kv_cache_dtype: '", bad,
                                        "' is not a KV-cache dtype (expected auto, fp8 or "
                                        "fp8_e4m3)"));
  }
  c.kv_cache_dtype = "fp8";
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());  // kv_page_size -1: 16
  c.kv_page_size = 0;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(),
              AllOf(HasSubstr("kv_cache_dtype fp8 keeps the KV-cache in pages"),
                    HasSubstr("kv_page_size 0 asks for contiguous slots")));
  c.kv_page_size = 4;
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.kv_page_size = -1;
  EXPECT_EQ(WithModelDefaults(c, 98, 4).kv_page_size, 16);  // slots for auto (above)
  c.kv_cache_dtype = "auto";
  EXPECT_EQ(WithModelDefaults(c, 98, 4).kv_page_size, 0);
}

// The defaults that follow the KV layout, and what a step's rows may number under them.
TEST(CoordinatorConfigTest, BatchPromptBudgetAndStepRowsFollowTheKvLayout) {
  CoordinatorConfig c;
  c.prefill_chunk = 512;
  c.kv_page_size = 0;  // contiguous slots: 16 a step, no prompt budget
  EXPECT_EQ(MaxSlots(c), 16);
  EXPECT_EQ(MaxBatch(c), 16);
  EXPECT_EQ(PrefillBudget(c), 0);
  EXPECT_EQ(MaxStepRows(c), 16 * 512);
  c.kv_page_size = 16;  // pages: 256 a step, 8192 prompt tokens, so 8192 + 255 decode rows + 1
  EXPECT_EQ(MaxBatch(c), 256);
  EXPECT_EQ(PrefillBudget(c), 8192);
  EXPECT_EQ(MaxStepRows(c), 8192 + 256);
  c.prefill_budget = 0;  // asked: no bound
  EXPECT_EQ(PrefillBudget(c), 0);
  EXPECT_EQ(MaxStepRows(c), 256 * 512);
  c.prefill_budget = 200000;  // a budget past every chunk bounds nothing
  EXPECT_EQ(MaxStepRows(c), 256 * 512);
  c.max_slots = 64;  // with pages, a step takes every slot
  c.prefill_budget.reset();
  EXPECT_EQ(MaxBatch(c), 64);
  EXPECT_EQ(MaxStepRows(c), 8192 + 64);
  c.max_batch = 8;
  c.prefill_budget = 96;
  EXPECT_EQ(MaxBatch(c), 8);
  EXPECT_EQ(MaxStepRows(c), 96 + 8);
  c.prefill_chunk = 4;  // chunks smaller than the budget
  EXPECT_EQ(MaxStepRows(c), 8 * 4);
}

TEST(CoordinatorConfigTest, UnknownKeyIsNamed) {
  absl::StatusOr<CoordinatorConfig> c = ParseCoordinatorConfig("stagez: 2\n", "x.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("stagez"));
  EXPECT_THAT(c.status().message(), HasSubstr("x.yaml"));
}

TEST(CoordinatorConfigTest, WrongTypeNamesTheSetting) {
  absl::StatusOr<CoordinatorConfig> c = ParseCoordinatorConfig("stages: two\n", "x.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("stages"));
}

TEST(CoordinatorConfigTest, ANonBooleanDecodeAheadNamesTheSetting) {
  absl::StatusOr<CoordinatorConfig> c = ParseCoordinatorConfig("decode_ahead: maybe\n", "x.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("decode_ahead"));
}

TEST(CoordinatorConfigTest, MalformedYamlIsAnErrorNotACrash) {
  EXPECT_FALSE(ParseCoordinatorConfig("stages: [1, 2\n", "x.yaml").ok());
  EXPECT_FALSE(ParseCoordinatorConfig("- a\n- b\n", "x.yaml").ok());
}

TEST(CoordinatorConfigTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadCoordinatorConfig("/nonexistent/tandem.yaml").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(CoordinatorConfigTest, ValidationNamesTheBadField) {
  CoordinatorConfig c;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("model_dir"));
  c.model_dir = "/m";
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.stages = 0;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("stages"));
  c.stages = 1;
  c.max_batch = -1;  // 0 is the default for the KV layout
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("max_batch"));
  c.max_batch = 1;
  c.prefill_budget = 0;  // no bound
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.prefill_budget = -1;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("prefill_budget"));
  c.prefill_budget = 0;
  c.max_resumes = 0;  // fail at once
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.max_resumes = -1;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("max_resumes"));
  c.max_resumes = 3;
  c.decode_ahead_ms = -1;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("decode_ahead_ms"));
  c.decode_ahead_ms = std::nan("");
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("decode_ahead_ms"));
  c.decode_ahead_ms = 0;  // one step ahead
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.admission_quiet_ms = -0.1;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("admission_quiet_ms"));
  c.admission_quiet_ms = 0;
  c.admission_wait_ms = std::nan("");
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("admission_wait_ms"));
  c.admission_wait_ms = 2;
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.grpc_threads = -1;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("grpc_threads must be >= 0"));
  c.grpc_threads = 0;  // as many as requests may run or wait
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.replicas = 2;
  c.prefill_replicas = 1;
  EXPECT_TRUE(ValidateCoordinatorConfig(c).ok());
  c.prefill_replicas = 2;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(),
              HasSubstr("prefill_replicas (2) must leave at least one of the 2 replicas"));
  c.prefill_replicas = -1;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("prefill_replicas"));
  c.prefill_replicas = 0;
  c.replicas = 1;
  c.heartbeat_timeout_ms = c.heartbeat_interval_ms;
  EXPECT_THAT(ValidateCoordinatorConfig(c).message(), HasSubstr("heartbeat_timeout_ms"));
}

// Every setting, changed from its default, reaches its field from its flag and from its YAML key.
TEST(CoordinatorConfigTest, EverySettingRoundTripsFromItsFlagAndItsYamlKey) {
  CoordinatorConfig want;
  std::vector<std::string> args = {"config_test"};
  std::string yaml;
  ForEachCoordinatorSetting(want, [&](std::string_view name, auto& field, double) {
    field = ChangedSetting(field);
    args.push_back(absl::StrCat("--", std::string(name), "=", SettingText(field)));
    absl::StrAppend(&yaml, std::string(name), ": ", SettingText(field), "\n");
  });
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  CoordinatorConfig from_flags;
  OverrideWithFlagsGiven(from_flags);
  absl::StatusOr<CoordinatorConfig> from_yaml = ParseCoordinatorConfig(yaml, "all.yaml");
  ASSERT_TRUE(from_yaml.ok()) << from_yaml.status() << "\n" << yaml;
  const CoordinatorConfig defaults;
#define EXPECT_SETTING_ROUND_TRIPS(type, name, default_value, least, help) \
  EXPECT_NE(want.name, defaults.name) << #name;                            \
  EXPECT_EQ(from_flags.name, want.name) << "--" #name;                     \
  EXPECT_EQ(from_yaml->name, want.name) << "YAML " #name;
  TANDEM_COORDINATOR_SETTINGS(EXPECT_SETTING_ROUND_TRIPS)
#undef EXPECT_SETTING_ROUND_TRIPS
}

// Each bounded setting, one below its bound (the others valid), is refused naming it.
TEST(CoordinatorConfigTest, EachBoundRefusesAValueBelowItNamingTheSetting) {
  int bounded = 0;
  for (int target = 0;; ++target) {
    CoordinatorConfig c;
    c.model_dir = "/m";
    std::string changed;
    int index = 0;
    ForEachCoordinatorSetting(c, [&](std::string_view name, auto& field, double least) {
      using T = std::remove_reference_t<decltype(field)>;
      if constexpr (std::is_same_v<T, int> || std::is_same_v<T, double> ||
                    std::is_same_v<T, std::optional<int>>) {
        if (least != kAnyValue && index++ == target) {
          field = static_cast<int>(least) - 1;
          changed = name;
        }
      }
    });
    if (changed.empty()) break;
    ++bounded;
    EXPECT_THAT(ValidateCoordinatorConfig(c).message(),
                HasSubstr(absl::StrCat("config: ", changed, " must be >= ")));
  }
  EXPECT_EQ(bounded, 25);
}

TEST(CheckModelDirTest, NamesWhatTheFolderIsNotAndWhatToGive) {
  const std::filesystem::path base =
      std::filesystem::path(::testing::TempDir()) / "check_model_dir_test";
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base / "empty");
  std::ofstream(base / "file") << "x";
  std::filesystem::create_directories(base / "model");
  std::ofstream(base / "model" / "config.json") << "{}";
  const absl::Status missing = CheckModelDir(base / "missing");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("no such folder"));
  EXPECT_THAT(CheckModelDir(base / "file").message(), HasSubstr("is a file, not a folder"));
  EXPECT_THAT(CheckModelDir(base / "empty").message(), HasSubstr("has no config.json"));
  EXPECT_THAT(CheckModelDir(base / "empty").message(),
              HasSubstr("folder of a Hugging Face checkpoint"));
  EXPECT_TRUE(CheckModelDir(base / "model").ok());
  std::filesystem::remove_all(base);
}

}  // namespace
}  // namespace tandem
