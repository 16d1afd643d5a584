// A worker's KV-cache moves (worker/service/kv_moves.h) over CPU stages of a random tiny
// checkpoint, without gRPC servers: export and import through the stash, the stash kept in
// (pretend) device memory and spilled to the host, what a fetch is sent, and the life of a step's
// write-outs; an FP8 KV-cache moved through a fetch's chunks.
#include "worker/service/kv_moves.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/model_generator.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/transport/kv_wire.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 4;  // tiny-llama's
constexpr int kMaxSeqLen = 32;

std::filesystem::path ModelDir() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path d = std::filesystem::path(TANDEM_TEST_TMPDIR) /
                                    ("kv_moves_test_model_" + std::to_string(getpid()));
    absl::StatusOr<ModelConfig> config = PresetConfig("tiny-llama");
    EXPECT_TRUE(config.ok()) << config.status();
    GeneratorOptions options;
    options.seed = 7;
    // Read by stages whose KV-cache is FP8 only.
    options.kv_scales = {{0.011f, 0.0093f}, {0.017f, 0.006f}, {0.009f, 0.013f}, {0.021f, 0.0071f}};
    const absl::Status st = WriteRandomCheckpoint(*config, options, d);
    EXPECT_TRUE(st.ok()) << st;
    return d;
  }();
  return dir;
}

// The KvBlock a pretend device holds: the same bytes behind device_k and device_v, none in k, v.
KvBlock OnPretendDevice(KvBlock b) {
  auto copy = [](const std::vector<uint8_t>& bytes) {
    std::shared_ptr<uint8_t> p(new uint8_t[bytes.size()], std::default_delete<uint8_t[]>());
    std::memcpy(p.get(), bytes.data(), bytes.size());
    return p;
  };
  b.device_k = copy(b.k);
  b.device_v = copy(b.v);
  b.k.clear();
  b.v.clear();
  return b;
}

// A block of the pretend device copied back to host memory.
absl::StatusOr<KvBlock> PretendToHost(const KvBlock& d) {
  KvBlock b = d;
  b.device_k.reset();
  b.device_v.reset();
  b.k.assign(d.device_k.get(), d.device_k.get() + d.expected_bytes());
  b.v.assign(d.device_v.get(), d.device_v.get() + d.expected_bytes());
  return b;
}

// A backend of that pretend device whose KV link is never joined: NCCL is there but the other
// worker cannot be reached over it.
class PretendGpuBackend final : public Backend {
 public:
  absl::StatusOr<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec) override {
    return MakeCpuStage(spec);
  }
  absl::StatusOr<KvBlock> KvToHost(const KvBlock& block) const override {
    return PretendToHost(block);
  }
  bool has_kv_link() const override { return true; }
  absl::StatusOr<std::string> MakeNcclId() override { return std::string("id"); }
  absl::StatusOr<std::unique_ptr<KvLink>> JoinKvLink(const std::string&, int,
                                                     std::function<bool()>) override {
    return absl::UnavailableError("not in this test");
  }
};

// A CPU stage that also exports into a pretend device memory (ExportKvToDevice), as a GPU stage
// keeps a stash for NCCL.
class PretendDeviceStage : public Stage {
 public:
  explicit PretendDeviceStage(std::unique_ptr<Stage> cpu) : cpu_(std::move(cpu)) {}
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override {
    return cpu_->Step(step, in);
  }
  const ModelConfig& config() const override { return cpu_->config(); }
  int kv_pages() const override { return cpu_->kv_pages(); }
  absl::StatusOr<KvBlock> ExportKv(const KvPlace& place, int positions, int first_layer,
                                   int num_layers) const override {
    return cpu_->ExportKv(place, positions, first_layer, num_layers);
  }
  absl::StatusOr<KvBlock> ExportKvToDevice(const KvPlace& place, int positions, int first_layer,
                                           int num_layers) const override {
    absl::StatusOr<KvBlock> b = cpu_->ExportKv(place, positions, first_layer, num_layers);
    if (!b.ok()) return b.status();
    return OnPretendDevice(*std::move(b));
  }
  absl::Status ImportKv(const KvPlace& place, const KvBlock& block) override {
    return cpu_->ImportKv(place, block);
  }

 private:
  std::unique_ptr<Stage> cpu_;
};

// page_size > 0: a KV-cache of 16 pages of that many positions, in FP8 with `fp8`.
std::unique_ptr<Assignment> MakeAssignment(uint64_t id, bool pretend_device = false,
                                           int page_size = 0, bool fp8 = false) {
  StageSpec spec;
  spec.model_dir = ModelDir();
  spec.max_slots = 4;
  spec.max_seq_len = kMaxSeqLen;
  spec.kv_page_size = page_size;
  spec.kv_pages = page_size > 0 ? 16 : 0;
  spec.kv_cache_fp8 = fp8;
  absl::StatusOr<std::unique_ptr<Stage>> stage = MakeCpuStage(spec);
  EXPECT_TRUE(stage.ok()) << stage.status();
  if (!stage.ok()) return nullptr;
  auto a = std::make_unique<Assignment>();
  a->id = id;
  a->first_layer = 0;
  a->last_layer = kLayers;
  a->max_seq_len = kMaxSeqLen;
  a->engine =
      pretend_device ? std::make_unique<PretendDeviceStage>(*std::move(stage)) : *std::move(stage);
  return a;
}

// One row of a step: `tokens` of slot `slot` from `position`, sampled greedily.
StepDescriptor OneRow(uint64_t id, int slot, int position, std::vector<int32_t> tokens,
                      uint64_t kv_out_key = 0) {
  StepDescriptor d;
  d.id = id;
  SequenceStep row;
  row.slot = slot;
  row.position = position;
  row.num_tokens = static_cast<int32_t>(tokens.size());
  row.kv_out_key = kv_out_key;
  d.seqs.push_back(row);
  d.tokens = std::move(tokens);
  return d;
}

const std::vector<int32_t> kPrompt = {3, 17, 29, 41, 5, 60};

// Prefills slot `slot` of `a` with kPrompt; the token it samples.
int32_t Prefill(Assignment& a, int slot, uint64_t step_id = 1) {
  absl::StatusOr<StepOutput> out = a.engine->Step(OneRow(step_id, slot, 0, kPrompt), {});
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? out->tokens.at(0) : -1;
}

// The next `n` greedy tokens of slot `slot` after `token` at `position`.
std::vector<int32_t> Decode(Assignment& a, int slot, int position, int32_t token, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<StepOutput> o = a.engine->Step(OneRow(100 + i, slot, position + i, {token}), {});
    EXPECT_TRUE(o.ok()) << o.status();
    if (!o.ok()) break;
    token = o->tokens.at(0);
    out.push_back(token);
  }
  return out;
}

v1::ExportKvRequest ExportRequest(uint64_t assignment, uint64_t key, int slot, int positions,
                                  bool device = false) {
  v1::ExportKvRequest req;
  req.set_assignment_id(assignment);
  req.set_device(device);
  v1::KvSequence* s = req.add_seqs();
  s->set_key(key);
  s->set_slot(slot);
  s->set_positions(positions);
  return req;
}

// An import of `key` into slot `slot` from this worker's own stash (or `stream_step`'s write-outs
// of assignment `from`), in the given layer ranges.
v1::ImportKvRequest OwnImport(uint64_t assignment, uint64_t key, int slot,
                              const std::vector<std::pair<int, int>>& ranges, uint64_t from = 0,
                              uint64_t stream_step = 0) {
  v1::ImportKvRequest req;
  req.set_assignment_id(assignment);
  req.set_stream_step(stream_step);
  v1::KvSequence* s = req.add_seqs();
  s->set_key(key);
  s->set_slot(slot);
  for (const auto& [first, num] : ranges) {
    v1::KvSource* src = req.add_sources();
    src->set_first_layer(first);
    src->set_num_layers(num);
    src->set_assignment_id(from);
  }
  return req;
}

// What a fetch of `req` is sent, put together again.
absl::StatusOr<KvBlock> Fetched(KvMoves& kv, const v1::FetchKvRequest& req, uint64_t key) {
  const absl::StatusOr<ModelConfig> c = LoadModelConfig(ModelDir());
  if (!c.ok()) return c.status();
  KvAssembler assembler({.first_layer = req.first_layer(),
                         .num_layers = req.num_layers(),
                         .num_kv_heads = c->num_kv_heads,
                         .head_dim = c->head_dim,
                         .max_positions = kMaxSeqLen});
  absl::Status bad;
  const KvChunkSink sink{.write =
                             [&](const v1::KvChunk& c) {
                               bad.Update(assembler.Add(c));
                               return bad.ok();
                             },
                         .cancelled = [] { return false; }};
  if (absl::Status st = kv.Send(req, sink); !st.ok()) return st;
  if (!bad.ok()) return bad;
  return assembler.Take(key);
}

v1::FetchKvRequest FetchOf(uint64_t key, int first_layer = 0, int num_layers = kLayers) {
  v1::FetchKvRequest req;
  req.add_keys(key);
  req.set_first_layer(first_layer);
  req.set_num_layers(num_layers);
  return req;
}

TEST(KvMovesTest, ExportedThenImportedInTwoLayerRangesContinuesAsTheOriginal) {
  std::unique_ptr<Assignment> from = MakeAssignment(1), to = MakeAssignment(2);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  const int32_t next = Prefill(*from, /*slot=*/0);
  const int positions = static_cast<int>(kPrompt.size());
  KvMoves kv({});
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*from, ExportRequest(1, /*key=*/7, 0, positions), exported).ok());
  EXPECT_GT(exported.bytes(), 0);
  v1::ImportKvResponse imported;
  const absl::Status st = kv.Import(*to, OwnImport(2, 7, /*slot=*/3, {{2, 2}, {0, 2}}), imported);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(imported.bytes(), exported.bytes());
  EXPECT_EQ(imported.fetched_bytes(), 0);  // all from this worker's stash
  EXPECT_EQ(Decode(*to, 3, positions, next, 4), Decode(*from, 0, positions, next, 4));
}

// A sequence on pages moves to other pages of another stage (its tables given with the
// sequence) and to a contiguous slot, and continues as the original there.
TEST(KvMovesTest, ASequenceOnPagesMovesToOtherPagesAndToASlot) {
  std::unique_ptr<Assignment> from = MakeAssignment(1, false, 4), to = MakeAssignment(2, false, 4),
                              slots = MakeAssignment(3);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  ASSERT_NE(slots, nullptr);
  const std::vector<int32_t> from_pages = {9, 2, 14}, to_pages = {3, 15, 0};
  StepDescriptor prefill = OneRow(1, 0, 0, kPrompt);
  prefill.seqs[0].block_table = {9, 2};
  absl::StatusOr<StepOutput> first = from->engine->Step(prefill, {});
  ASSERT_TRUE(first.ok()) << first.status();
  const int positions = static_cast<int>(kPrompt.size());
  // Greedy decode of `n` tokens of `slot` on `pages` (none: a contiguous slot).
  auto decode = [&](Assignment& a, int slot, const std::vector<int32_t>& pages, int n) {
    std::vector<int32_t> out;
    int32_t token = first->tokens.at(0);
    for (int i = 0; i < n; ++i) {
      StepDescriptor d = OneRow(100 + i, slot, positions + i, {token});
      d.seqs[0].block_table = pages;
      absl::StatusOr<StepOutput> o = a.engine->Step(d, {});
      EXPECT_TRUE(o.ok()) << o.status();
      if (!o.ok()) break;
      token = o->tokens.at(0);
      out.push_back(token);
    }
    return out;
  };
  KvMoves kv({});
  v1::ExportKvRequest req = ExportRequest(1, /*key=*/7, 0, positions);
  req.mutable_seqs(0)->add_block_table(9);
  v1::ExportKvResponse exported;
  EXPECT_THAT(kv.Export(*from, req, exported).message(), HasSubstr("block table of 1 pages"));
  req.mutable_seqs(0)->add_block_table(2);
  ASSERT_TRUE(kv.Export(*from, req, exported).ok());
  v1::ImportKvRequest into_pages = OwnImport(2, 7, /*slot=*/1, {{0, kLayers}});
  into_pages.mutable_seqs(0)->mutable_block_table()->Add(to_pages.begin(), to_pages.begin() + 2);
  v1::ImportKvResponse imported;
  ASSERT_TRUE(kv.Import(*to, into_pages, imported).ok());
  ASSERT_TRUE(kv.Import(*slots, OwnImport(3, 7, /*slot=*/2, {{0, kLayers}}), imported).ok());
  const std::vector<int32_t> want = decode(*from, 0, from_pages, 4);
  EXPECT_EQ(decode(*to, 1, to_pages, 4), want);
  EXPECT_EQ(decode(*slots, 2, {}, 4), want);
}

// A sequence of an FP8 KV-cache, stashed and fetched as chunks (F8_E4M3 codes with each layer's
// scales), goes into another FP8 stage's pages and continues there with the logits, bit for bit,
// of the original. A stage whose KV-cache is fp32, or whose scales differ, refuses the block
// naming both sides.
TEST(KvMovesTest, AnFp8SequenceMovesThroughAFetchAndContinuesAsTheOriginal) {
  std::unique_ptr<Assignment> from = MakeAssignment(1, false, 4, true),
                              to = MakeAssignment(2, false, 4, true),
                              fp32 = MakeAssignment(3, false, 4, false);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  ASSERT_NE(fp32, nullptr);
  const std::vector<int32_t> from_pages = {9, 2, 14}, to_pages = {3, 15, 0};
  StepDescriptor prefill = OneRow(1, 0, 0, kPrompt);
  prefill.seqs[0].block_table = {9, 2};
  absl::StatusOr<StepOutput> first = from->engine->Step(prefill, {});
  ASSERT_TRUE(first.ok()) << first.status();
  const int positions = static_cast<int>(kPrompt.size());
  KvMoves kv({});
  v1::ExportKvRequest req = ExportRequest(1, /*key=*/7, 0, positions);
  req.mutable_seqs(0)->add_block_table(9);
  req.mutable_seqs(0)->add_block_table(2);
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*from, req, exported).ok());
  // One byte an element of K and of V (an fp32 cache would export four).
  EXPECT_EQ(exported.bytes(), 2 * kLayers * positions * from->engine->config().kv_dim());
  absl::StatusOr<KvBlock> fetched = Fetched(kv, FetchOf(7), 7);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->dtype, DType::kF8E4M3);
  ASSERT_EQ(fetched->scales.size(), size_t{kLayers});
  EXPECT_EQ(fetched->scales[2], (KvScales{0.009f, 0.013f}));
  const KvPlace into(1, {to_pages.begin(), to_pages.begin() + 2});
  const absl::Status st = to->engine->ImportKv(into, *fetched);
  ASSERT_TRUE(st.ok()) << st;
  // Greedy decode of 4 tokens of `slot` on `pages`: each step's logits.
  auto decode = [&](Assignment& a, int slot, const std::vector<int32_t>& pages) {
    std::vector<std::vector<float>> logits;
    int32_t token = first->tokens.at(0);
    for (int i = 0; i < 4; ++i) {
      StepDescriptor d = OneRow(100 + i, slot, positions + i, {token});
      d.seqs[0].block_table = pages;
      d.return_logits = true;
      absl::StatusOr<StepOutput> o = a.engine->Step(d, {});
      EXPECT_TRUE(o.ok()) << o.status();
      if (!o.ok()) break;
      token = o->tokens.at(0);
      logits.push_back(o->logits);
    }
    return logits;
  };
  EXPECT_EQ(decode(*to, 1, to_pages), decode(*from, 0, from_pages));

  absl::Status refused = fp32->engine->ImportKv(into, *fetched);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("dtype F8_E4M3, this stage's KV-cache holds F32"));
  v1::ImportKvResponse imported;
  v1::ImportKvRequest own = OwnImport(3, 7, /*slot=*/1, {{0, kLayers}});
  own.mutable_seqs(0)->mutable_block_table()->Add(to_pages.begin(), to_pages.begin() + 2);
  refused = kv.Import(*fp32, own, imported);
  EXPECT_THAT(refused.message(), HasSubstr("sequence 7: KV block: dtype F8_E4M3"));
  KvBlock other = *fetched;
  other.scales[3].v = 0.5f;
  refused = to->engine->ImportKv(into, other);
  EXPECT_THAT(refused.message(),
              HasSubstr("layer 3 is F8_E4M3 codes of k_scale 0.0209999997, v_scale 0.5; this "
                        "stage's KV-cache of that layer holds codes of k_scale 0.0209999997, "
                        "v_scale 0.00710000005"));
}

TEST(KvMovesTest, ImportRefusesSourcesThatLeaveLayersOutOrASlotTwice) {
  std::unique_ptr<Assignment> a = MakeAssignment(1);
  ASSERT_NE(a, nullptr);
  Prefill(*a, 0);
  KvMoves kv({});
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 7, 0, 6), exported).ok());
  v1::ImportKvResponse resp;
  const absl::Status gap = kv.Import(*a, OwnImport(1, 7, 1, {{0, 3}}), resp);
  EXPECT_EQ(gap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(gap.message(), HasSubstr("layers [3, 4) of this stage's [0, 4) have no source"));
  const absl::Status overlap = kv.Import(*a, OwnImport(1, 7, 1, {{0, 3}, {2, 2}}), resp);
  EXPECT_THAT(overlap.message(), HasSubstr("do not continue"));
  v1::ImportKvRequest twice = OwnImport(1, 7, 1, {{0, kLayers}});
  *twice.add_seqs() = twice.seqs(0);
  EXPECT_THAT(kv.Import(*a, twice, resp).message(), HasSubstr("slot 1 is given twice"));
}

TEST(KvMovesTest, AFetchOrImportOfAnUnknownSequenceIsNotFoundNamingIt) {
  std::unique_ptr<Assignment> a = MakeAssignment(1);
  ASSERT_NE(a, nullptr);
  KvMoves kv({});
  const absl::StatusOr<KvBlock> fetched = Fetched(kv, FetchOf(99), 99);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(fetched.status().message(), HasSubstr("sequence 99"));
  v1::ImportKvResponse resp;
  EXPECT_EQ(kv.Import(*a, OwnImport(1, 99, 0, {{0, kLayers}}), resp).code(),
            absl::StatusCode::kNotFound);
}

TEST(KvMovesTest, AFetchIsSentTheStashedLayersAskedFor) {
  std::unique_ptr<Assignment> a = MakeAssignment(1);
  ASSERT_NE(a, nullptr);
  Prefill(*a, 2);
  KvMoves kv({});
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 5, 2, 6), exported).ok());
  const absl::StatusOr<KvBlock> want = a->engine->ExportKv(2, 6, 1, 2);
  ASSERT_TRUE(want.ok());
  const absl::StatusOr<KvBlock> got = Fetched(kv, FetchOf(5, 1, 2), 5);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->first_layer, 1);
  EXPECT_EQ(got->num_layers, 2);
  EXPECT_EQ(got->k, want->k);
  EXPECT_EQ(got->v, want->v);
  // Dropped, it is gone; a drop of nothing named drops everything.
  kv.Drop(std::vector<uint64_t>{5});
  EXPECT_EQ(kv.Stashed(5).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 6, 2, 6), exported).ok());
  kv.Drop({});
  EXPECT_EQ(kv.Stashed(6).status().code(), absl::StatusCode::kNotFound);
}

// With NCCL (here pretend), an export asked for in device memory stays there; a new stage that
// needs the room spills it to the host, and a fetch over gRPC copies it to the host.
TEST(KvMovesTest, ADeviceStashIsSpilledToHostAndFetchedOverGrpcFromEither) {
  std::unique_ptr<Assignment> a = MakeAssignment(1, /*pretend_device=*/true);
  ASSERT_NE(a, nullptr);
  Prefill(*a, 0);
  Prefill(*a, 1);
  PretendGpuBackend backend;
  KvMoves kv({.backend = &backend});
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 1, 0, 6, /*device=*/true), exported).ok());
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 2, 1, 6, /*device=*/true), exported).ok());
  ASSERT_TRUE(kv.Stashed(1).ok());
  EXPECT_TRUE((*kv.Stashed(1))->on_device());
  const absl::StatusOr<KvBlock> want = a->engine->ExportKv(0, 6, 0, kLayers);
  ASSERT_TRUE(want.ok());
  absl::StatusOr<KvBlock> from_device = Fetched(kv, FetchOf(1), 1);
  ASSERT_TRUE(from_device.ok()) << from_device.status();
  EXPECT_EQ(from_device->k, want->k);
  EXPECT_TRUE((*kv.Stashed(1))->on_device());  // the host copy was the fetch's only

  EXPECT_EQ(kv.SpillToHost(), 2);
  EXPECT_FALSE((*kv.Stashed(1))->on_device());
  EXPECT_FALSE((*kv.Stashed(2))->on_device());
  EXPECT_EQ(kv.SpillToHost(), 0);
  absl::StatusOr<KvBlock> from_host = Fetched(kv, FetchOf(1), 1);
  ASSERT_TRUE(from_host.ok()) << from_host.status();
  EXPECT_EQ(from_host->k, want->k);
  EXPECT_EQ(from_host->v, want->v);
}

TEST(KvMovesTest, WithoutNcclAnExportAskedForInDeviceMemoryStaysOnTheHost) {
  std::unique_ptr<Assignment> a = MakeAssignment(1, /*pretend_device=*/true);
  ASSERT_NE(a, nullptr);
  Prefill(*a, 0);
  KvMoves kv({});
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 1, 0, 6, /*device=*/true), exported).ok());
  EXPECT_FALSE((*kv.Stashed(1))->on_device());
}

// A step with kv_out_key writes its sequence out as it runs: fetched by that step (as a stream,
// or imported on this worker), replaced by an export of the key, and given up at once by fetches
// that can no longer be served.
TEST(KvMovesTest, AStepsWriteOutIsFetchedByItsStepUntilDroppedOrReplaced) {
  std::unique_ptr<Assignment> a = MakeAssignment(1), b = MakeAssignment(1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  KvMoves kv({});
  kv.BeginAssignment(1);
  const StepDescriptor prefill = OneRow(/*id=*/4, /*slot=*/0, 0, kPrompt, /*kv_out_key=*/9);
  kv.OpenKvOuts(*a, prefill);
  absl::StatusOr<StepOutput> out = a->engine->Step(prefill, {});
  ASSERT_TRUE(out.ok()) << out.status();
  const WriteOutRef ref{.assignment = 1, .step = 4};
  absl::StatusOr<std::shared_ptr<KvOut>> written = kv.WrittenOut(9, ref, absl::Now());
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE((*written)->AwaitAll(absl::Now()).ok());
  EXPECT_EQ(kv.Stashed(9).status().code(), absl::StatusCode::kNotFound);  // not stashed

  const absl::StatusOr<KvBlock> want = a->engine->ExportKv(0, 6, 0, kLayers);
  ASSERT_TRUE(want.ok());
  v1::FetchKvRequest streamed = FetchOf(9);
  streamed.set_stream_step(4);
  streamed.set_stream_assignment(1);
  const absl::StatusOr<KvBlock> got = Fetched(kv, streamed, 9);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->k, want->k);
  EXPECT_EQ(got->v, want->v);
  v1::ImportKvResponse imported;
  ASSERT_TRUE(kv.Import(*b, OwnImport(1, 9, 2, {{0, kLayers}}, 1, 4), imported).ok());
  EXPECT_EQ(Decode(*b, 2, 6, out->tokens[0], 3), Decode(*a, 0, 6, out->tokens[0], 3));

  // A step that has passed without writing the key out, and an assignment not current, fail at
  // once naming the step.
  const absl::Time later = absl::Now() + absl::Seconds(60);
  const absl::Status passed = kv.WrittenOut(9, {.assignment = 1, .step = 3}, later).status();
  EXPECT_EQ(passed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(passed.message(), HasSubstr("not written out by step 3"));
  EXPECT_THAT(kv.WrittenOut(9, {.assignment = 5, .step = 4}, later).status().message(),
              HasSubstr("holds another assignment"));
  // A fetch of a step still to come ends when the steps' stream does (ended here until the
  // fetch, on its thread, has seen an end after it began to wait).
  absl::Status waiting;
  std::atomic<bool> done{false};
  std::thread fetch([&] {
    waiting = kv.WrittenOut(9, {.assignment = 1, .step = 8}, later).status();
    done.store(true);
  });
  while (!done.load()) {
    kv.EndSteps();
    absl::SleepFor(absl::Milliseconds(1));
  }
  fetch.join();
  EXPECT_THAT(waiting.message(), HasSubstr("the steps' stream ended"));

  // Exporting the key replaces the write-out with the stash's block; dropping it drops both.
  v1::ExportKvResponse exported;
  ASSERT_TRUE(kv.Export(*a, ExportRequest(1, 9, 0, 6), exported).ok());
  EXPECT_THAT(kv.WrittenOut(9, ref, later).status().message(), HasSubstr("not written out"));
  EXPECT_TRUE(kv.Stashed(9).ok());
  kv.Drop(std::vector<uint64_t>{9});
  EXPECT_FALSE(kv.Stashed(9).ok());
}

// A prefill step's write-out of an FP8 stage's pages, fetched by its step (each layer as the step
// writes it: F8_E4M3 chunks with the layer's scales), goes into another FP8 stage's pages, where
// the sequence continues with the original's logits.
TEST(KvMovesTest, AnFp8WriteOutIsFetchedWithItsScalesAndContinuesAsTheOriginal) {
  std::unique_ptr<Assignment> a = MakeAssignment(1, false, 4, true),
                              b = MakeAssignment(1, false, 4, true);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> a_pages = {9, 2, 14}, b_pages = {3, 15, 0};
  KvMoves kv({});
  kv.BeginAssignment(1);
  StepDescriptor prefill = OneRow(/*id=*/4, /*slot=*/0, 0, kPrompt, /*kv_out_key=*/9);
  prefill.seqs[0].block_table = {9, 2};
  kv.OpenKvOuts(*a, prefill);
  absl::StatusOr<StepOutput> out = a->engine->Step(prefill, {});
  ASSERT_TRUE(out.ok()) << out.status();
  v1::FetchKvRequest streamed = FetchOf(9);
  streamed.set_stream_step(4);
  streamed.set_stream_assignment(1);
  const absl::StatusOr<KvBlock> got = Fetched(kv, streamed, 9);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->dtype, DType::kF8E4M3);
  ASSERT_EQ(got->scales.size(), size_t{kLayers});
  EXPECT_EQ(got->scales[1], (KvScales{0.017f, 0.006f}));
  v1::ImportKvRequest into = OwnImport(1, 9, /*slot=*/2, {{0, kLayers}}, 1, 4);
  into.mutable_seqs(0)->mutable_block_table()->Add(b_pages.begin(), b_pages.begin() + 2);
  v1::ImportKvResponse imported;
  const absl::Status st = kv.Import(*b, into, imported);
  ASSERT_TRUE(st.ok()) << st;
  const int positions = static_cast<int>(kPrompt.size());
  auto decode = [&](Assignment& x, int slot, const std::vector<int32_t>& pages) {
    std::vector<std::vector<float>> logits;
    int32_t token = out->tokens.at(0);
    for (int i = 0; i < 3; ++i) {
      StepDescriptor d = OneRow(100 + i, slot, positions + i, {token});
      d.seqs[0].block_table = pages;
      d.return_logits = true;
      absl::StatusOr<StepOutput> o = x.engine->Step(d, {});
      EXPECT_TRUE(o.ok()) << o.status();
      if (!o.ok()) break;
      token = o->tokens.at(0);
      logits.push_back(o->logits);
    }
    return logits;
  };
  EXPECT_EQ(decode(*b, 2, b_pages), decode(*a, 0, a_pages));
}

TEST(KvMovesTest, AWriteOutTheStageCannotOpenFailsItsFetchAtOnce) {
  std::unique_ptr<Assignment> a = MakeAssignment(1);
  ASSERT_NE(a, nullptr);
  KvMoves kv({});
  kv.BeginAssignment(1);
  // Slot 7 is past the stage's 4.
  kv.OpenKvOuts(*a, OneRow(2, /*slot=*/7, 0, kPrompt, /*kv_out_key=*/3));
  absl::StatusOr<std::shared_ptr<KvOut>> out =
      kv.WrittenOut(3, {.assignment = 1, .step = 2}, absl::Now());
  ASSERT_TRUE(out.ok()) << out.status();
  const absl::Status failed = (*out)->AwaitAll(absl::Now() + absl::Seconds(60));
  EXPECT_THAT(failed.message(), HasSubstr("sequence 3"));
  EXPECT_THAT(failed.message(), HasSubstr("slot 7"));
  // A new assignment drops the write-outs of the one before.
  kv.BeginAssignment(2);
  EXPECT_THAT(kv.WrittenOut(3, {.assignment = 1, .step = 2}, absl::Now()).status().message(),
              HasSubstr("holds another assignment"));
}

}  // namespace
}  // namespace tandem
