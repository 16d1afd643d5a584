// A sequence's KV-cache between real tandem-worker processes: worker A runs a prompt, stashes its
// KV-cache (ExportKv), worker B fetches it worker to worker (ImportKv -> A's FetchKv) into
// another slot, and the next step samples the same token on both. Bad requests and a peer that
// sends chunks that do not fit are refused naming the problem, and the worker keeps serving.
#include <unistd.h>

#include <filesystem>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "tests/integration/cluster.h"
#include "tools/model_generator.h"
#include "worker/transport/kv_wire.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 4;  // tiny-llama

std::filesystem::path TempPath(const std::string& name) {
  return std::filesystem::path(::testing::TempDir()) / absl::StrCat(name, "-", getpid());
}

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  return ctx;
}

// A worker process without a coordinator, driven by the test's RPCs.
struct Worker {
  std::unique_ptr<Process> process;
  std::string address;
  std::unique_ptr<v1::Worker::Stub> stub;

  grpc::Status Assign(uint64_t assignment, const std::filesystem::path& model, int first,
                      int last) {
    v1::AssignStageRequest req;
    req.set_assignment_id(assignment);
    req.set_stage(0);
    req.set_num_stages(1);
    req.set_model_dir(model.string());
    req.set_first_layer(first);
    req.set_last_layer(last);
    req.set_max_slots(4);
    req.set_max_seq_len(64);
    v1::AssignStageResponse resp;
    return stub->AssignStage(Context().get(), req, &resp);
  }
  // One step of one sequence; its sampled token (greedy), or -1 with the error in `status`.
  // `kv_out_key` nonzero: the step writes the sequence's KV-cache out under that key.
  int32_t Step(uint64_t assignment, int slot, int position, std::vector<int32_t> tokens,
               std::string* error = nullptr, uint64_t kv_out_key = 0) {
    auto ctx = Context();
    auto stream = stub->Steps(ctx.get());
    v1::StepRequest req;
    req.set_assignment_id(assignment);
    req.set_step_id(1);
    v1::SequenceStep* s = req.add_seqs();
    s->set_slot(slot);
    s->set_position(position);
    s->set_num_tokens(static_cast<int>(tokens.size()));
    s->set_sample(true);
    s->set_top_p(1.0f);  // greedy (temperature 0)
    s->set_kv_out_key(kv_out_key);
    req.mutable_tokens()->Assign(tokens.begin(), tokens.end());
    stream->Write(req);
    // The worker drops the steps it has not run once the stream's writes end: read first.
    v1::StepResult r;
    const bool got = stream->Read(&r);
    stream->WritesDone();
    (void)stream->Finish();
    if (!got || r.error_code() != 0 || r.tokens_size() != 1) {
      if (error) *error = r.error_message();
      return -1;
    }
    return r.tokens(0);
  }
};

class KvMoveTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<ModelConfig> c = PresetConfig("tiny-llama");
    ASSERT_TRUE(c.ok());
    ASSERT_EQ(c->num_layers, kLayers);
    ASSERT_TRUE(WriteRandomCheckpoint(*c, GeneratorOptions{.seed = 11}, Model()).ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(Model(), ec);
  }
  static const std::filesystem::path& Model() {
    static const std::filesystem::path dir = TempPath("tandem-kv-move-model");
    return dir;
  }

  // A prepare (AssignStageRequest.prepare) of assignment `id`: the whole model as one stage, as
  // Worker::Assign asks for it.
  static v1::AssignStageRequest PrepareOf(uint64_t id) {
    v1::AssignStageRequest req;
    req.set_assignment_id(id);
    req.set_stage(0);
    req.set_num_stages(1);
    req.set_model_dir(Model().string());
    req.set_first_layer(0);
    req.set_last_layer(kLayers);
    req.set_max_slots(4);
    req.set_max_seq_len(64);
    req.set_prepare(true);
    return req;
  }

  Worker StartWorker(const std::string& name, const std::string& step_trace = "") {
    Worker w;
    absl::StatusOr<std::unique_ptr<Process>> p = Process::Start(
        {TANDEM_WORKER_BIN, "--coordinator=127.0.0.1:1", "--listen=127.0.0.1:0",
         "--metrics_address=", absl::StrCat("--step_trace=", step_trace)},
        TempPath(absl::StrCat("kv-", name, "-",
                              ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                              ".log")));
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return w;
    w.process = *std::move(p);
    absl::StatusOr<int> port = w.process->WaitForPort();
    EXPECT_TRUE(port.ok()) << port.status();
    w.address = absl::StrCat("127.0.0.1:", port.value_or(1));
    w.stub = v1::Worker::NewStub(
        grpc::CreateChannel(w.address, grpc::InsecureChannelCredentials()));
    return w;
  }

  // Positions [from, to) of A's slot `a_slot` (assignment `a_id`) and B's `b_slot` (`b_id`),
  // each fed its own greedy token from `first` on: the same tokens.
  static void ExpectSameTokens(Worker& a, uint64_t a_id, int a_slot, Worker& b, uint64_t b_id,
                               int b_slot, int32_t first, int from, int to) {
    int32_t ta = first, tb = first;
    for (int pos = from; pos < to; ++pos) {
      ta = a.Step(a_id, a_slot, pos, {ta});
      tb = b.Step(b_id, b_slot, pos, {tb});
      ASSERT_GE(ta, 0);
      EXPECT_EQ(tb, ta) << "position " << pos;
    }
  }

  static grpc::Status Export(Worker& w, uint64_t assignment, uint64_t key, int slot,
                             int positions, int64_t* bytes = nullptr) {
    v1::ExportKvRequest req;
    req.set_assignment_id(assignment);
    v1::KvSequence* s = req.add_seqs();
    s->set_key(key);
    s->set_slot(slot);
    s->set_positions(positions);
    v1::ExportKvResponse resp;
    grpc::Status st = w.stub->ExportKv(Context().get(), req, &resp);
    if (bytes) *bytes = resp.bytes();
    return st;
  }

  // Imports `key` into `slot` from the given sources ({address, first layer, layers}); with
  // `stream` ({assignment, step}; step nonzero) from what that step of the sources writes out.
  static grpc::Status Import(Worker& w, uint64_t assignment, uint64_t key, int slot,
                             const std::vector<std::tuple<std::string, int, int>>& sources,
                             v1::ImportKvResponse* resp,
                             std::pair<uint64_t, uint64_t> stream = {0, 0}) {
    v1::ImportKvRequest req;
    req.set_assignment_id(assignment);
    req.set_stream_step(stream.second);
    v1::KvSequence* s = req.add_seqs();
    s->set_key(key);
    s->set_slot(slot);
    for (const auto& [address, first, n] : sources) {
      v1::KvSource* src = req.add_sources();
      src->set_address(address);
      src->set_assignment_id(stream.first);
      src->set_first_layer(first);
      src->set_num_layers(n);
    }
    return w.stub->ImportKv(Context().get(), req, resp);
  }
};

const std::vector<int32_t> kPrompt = {5, 17, 99, 250, 3, 42};

// A's whole-model stage runs the prompt in slot 0; B's, half of it from A over gRPC and half from
// its own stash, takes it in slot 2; both sample the same next tokens.
TEST_F(KvMoveTest, ASequenceMovedToAnotherWorkerContinuesWithTheSameTokens) {
  const std::filesystem::path trace = TempPath("kv-move-steps.tsv");
  std::filesystem::remove(trace);
  Worker a = StartWorker("a", trace.string()), b = StartWorker("b");
  ASSERT_TRUE(a.stub && b.stub);
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  ASSERT_TRUE(b.Assign(2, Model(), 0, kLayers).ok());
  std::string why;
  const int32_t first = a.Step(1, 0, 0, kPrompt, &why);
  ASSERT_GE(first, 0) << why << a.process->Log();
  // B runs the same prompt in slot 0, and stashes it: the local source of the layers [2, 4).
  ASSERT_EQ(b.Step(2, 0, 0, kPrompt), first);
  int64_t bytes = 0;
  ASSERT_TRUE(Export(a, 1, 7, 0, 6, &bytes).ok());
  EXPECT_EQ(bytes, 2 * kLayers * 6 * 32 * 4);  // K and V: layers x positions x 2 heads x 16 x f32
  ASSERT_TRUE(Export(b, 2, 7, 0, 6).ok());
  v1::ImportKvResponse resp;
  grpc::Status s = Import(b, 2, 7, 2, {{a.address, 0, 2}, {"", 2, 2}}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message() << b.process->Log();
  EXPECT_EQ(resp.bytes(), bytes);
  EXPECT_EQ(resp.fetched_bytes(), bytes / 2);
  // The moved slot continues as the original does, step after step.
  ExpectSameTokens(a, 1, 0, b, 2, 2, first, 6, 12);
  // A's step trace has a line per step: the prompt (1 sequence, 6 tokens, 1 prompt), then decodes.
  std::vector<std::vector<std::string>> lines;
  const std::string text = ReadFile(trace);
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    lines.push_back(absl::StrSplit(line, '\t'));
  }
  ASSERT_EQ(lines.size(), 7u);
  ASSERT_EQ(lines[0].size(), 8u);
  EXPECT_EQ(lines[0][2], "1");
  EXPECT_EQ(lines[0][3], "6");
  EXPECT_EQ(lines[0][4], "1");
  EXPECT_EQ(lines[1][3], "1");
  EXPECT_EQ(lines[1][4], "0");
  // A slot that got nothing refuses to continue.
  std::string error;
  EXPECT_EQ(b.Step(2, 3, 6, {first}, &error), -1);
  EXPECT_THAT(error, HasSubstr("past the 0 tokens cached"));
}

// A prefill worker's hand-off while the prompt runs: B's import of what A's step 1 writes out is
// asked before the step, waits for it, and gets each layer as A writes it (over gRPC here); the
// slot then continues as A's does. A fetch of a write-out that the step did not make, or of
// another assignment's step, fails at once naming why.
TEST_F(KvMoveTest, AnImportOfAStepsWriteOutWaitsForTheStepAndContinuesWithTheSameTokens) {
  Worker a = StartWorker("a"), b = StartWorker("b");
  ASSERT_TRUE(a.stub && b.stub);
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  ASSERT_TRUE(b.Assign(2, Model(), 0, kLayers).ok());
  v1::ImportKvResponse resp;
  std::future<grpc::Status> imported = std::async(std::launch::async, [&] {
    return Import(b, 2, 7, 2, {{a.address, 0, kLayers}}, &resp, {1, 1});
  });
  EXPECT_EQ(imported.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the import waits for the step";
  std::string why;
  const int32_t first = a.Step(1, 0, 0, kPrompt, &why, /*kv_out_key=*/7);
  ASSERT_GE(first, 0) << why << a.process->Log();
  const grpc::Status s = imported.get();
  ASSERT_TRUE(s.ok()) << s.error_message() << b.process->Log() << a.process->Log();
  EXPECT_EQ(resp.bytes(), 2 * kLayers * 6 * 32 * 4);
  EXPECT_EQ(resp.fetched_bytes(), resp.bytes());
  ExpectSameTokens(a, 1, 0, b, 2, 2, first, 6, 10);
  // Step 1 has run and wrote out key 7 only; assignment 5 is not A's.
  v1::ImportKvResponse none;
  grpc::Status st = Import(b, 2, 8, 3, {{a.address, 0, kLayers}}, &none, {1, 1});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("sequence 8: not written out by step 1"));
  st = Import(b, 2, 7, 3, {{a.address, 0, kLayers}}, &none, {5, 1});
  EXPECT_THAT(st.error_message(), HasSubstr("this worker holds another assignment"));
  // Dropped, the write-out is gone.
  v1::DropKvRequest drop;
  drop.add_keys(7);
  v1::DropKvResponse dropped;
  ASSERT_TRUE(a.stub->DropKv(Context().get(), drop, &dropped).ok());
  st = Import(b, 2, 7, 3, {{a.address, 0, kLayers}}, &none, {1, 1});
  EXPECT_THAT(st.error_message(), HasSubstr("sequence 7: not written out by step 1"));
}

TEST_F(KvMoveTest, BadExportsAndImportsAreRefusedNamingTheProblem) {
  Worker a = StartWorker("a"), b = StartWorker("b");
  ASSERT_TRUE(a.stub && b.stub);
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  ASSERT_TRUE(b.Assign(2, Model(), 2, kLayers).ok());
  ASSERT_GE(a.Step(1, 0, 0, kPrompt), 0);
  grpc::Status s = Export(a, 9, 7, 0, 6);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("assignment 9: this worker holds assignment 1"));
  s = Export(a, 1, 7, 0, 7);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("sequence 7:"));
  EXPECT_THAT(s.error_message(), HasSubstr("holds 6 positions"));
  s = Export(a, 1, 7, 5, 6);
  EXPECT_THAT(s.error_message(), HasSubstr("slot 5"));
  ASSERT_TRUE(Export(a, 1, 7, 0, 6).ok());

  v1::ImportKvResponse resp;
  struct Case {
    std::vector<std::tuple<std::string, int, int>> sources;
    const char* says;
  };
  const Case cases[] = {
      {{{a.address, 2, 1}}, "layers [3, 4) of this stage's [2, 4) have no source"},
      {{{a.address, 2, 1}, {a.address, 2, 2}}, "layers [2, 4) do not continue this stage's [2, 4) at 3"},
      {{{a.address, 1, 3}}, "layers [1, 4) do not continue this stage's [2, 4) at 2"},
      {{{a.address, 2, 3}}, "layers [2, 5) do not continue"},
      {{}, "layers [2, 4) of this stage's [2, 4) have no source"},
      {{{"", 2, 2}}, "sequence 7: not in this worker's KV stash"},
  };
  for (const Case& c : cases) {
    s = Import(b, 2, 7, 1, c.sources, &resp);
    EXPECT_NE(s.error_code(), grpc::StatusCode::OK) << c.says;
    EXPECT_THAT(s.error_message(), HasSubstr(c.says));
  }
  s = Import(b, 2, 8, 1, {{a.address, 2, 2}}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("KV from ", a.address)));
  EXPECT_THAT(s.error_message(), HasSubstr("sequence 8: not in this worker's KV stash"));
  s = Import(b, 2, 7, 4, {{a.address, 2, 2}}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("slot 4"));
  // Two sequences into one slot.
  v1::ImportKvRequest twice;
  twice.set_assignment_id(2);
  for (uint64_t key : {7, 7}) {
    v1::KvSequence* q = twice.add_seqs();
    q->set_key(key);
    q->set_slot(1);
  }
  v1::KvSource* src = twice.add_sources();
  src->set_address(a.address);
  src->set_first_layer(2);
  src->set_num_layers(2);
  s = b.stub->ImportKv(Context().get(), twice, &resp);
  EXPECT_THAT(s.error_message(), HasSubstr("slot 1 is given twice"));
  // Still serving: the good import works and the slot continues.
  s = Import(b, 2, 7, 1, {{a.address, 2, 2}}, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // After DropKv the stash is empty.
  v1::DropKvResponse dropped;
  ASSERT_TRUE(a.stub->DropKv(Context().get(), {}, &dropped).ok());
  s = Import(b, 2, 7, 1, {{a.address, 2, 2}}, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
}

// Prefill hand-offs stash one sequence at a time while earlier ones are still being fetched: a
// stash keeps every key until DropKv names it (a key exported again is replaced), and a decode
// worker importing from it meanwhile gets the right sequence.
// A prepared assignment (AssignStageRequest.prepare) leaves the current stage serving until the
// same request comes without `prepare`, which then serves in its place. A prepare of a bad request
// is refused naming the field and changes nothing. An import of no sequence and no assignment
// (links only) is answered by a worker whatever stage it holds. ReleaseStage drops only the stage
// it names.
TEST_F(KvMoveTest, APreparedAssignmentWaitsForItsRequestWhileTheCurrentStageServes) {
  Worker a = StartWorker("a");
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  const int32_t first = a.Step(1, 0, 0, kPrompt);
  ASSERT_GE(first, 0);

  v1::AssignStageRequest req = PrepareOf(2);
  v1::AssignStageResponse resp;
  grpc::Status st = a.stub->AssignStage(Context().get(), req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_GE(a.Step(1, 0, static_cast<int>(kPrompt.size()), {first}), 0);
  EXPECT_EQ(a.Step(2, 1, 0, kPrompt), -1);

  v1::AssignStageRequest bad = req;
  bad.set_stage(3);
  st = a.stub->AssignStage(Context().get(), bad, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("stage: 3 of 1"));
  bad = req;
  bad.set_model_dir((Model() / "missing").string());
  st = a.stub->AssignStage(Context().get(), bad, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("missing"));
  EXPECT_GE(a.Step(1, 2, 0, kPrompt), 0);

  v1::ImportKvRequest links;
  links.add_sources()->set_address(a.address);
  v1::ImportKvResponse imported;
  st = a.stub->ImportKv(Context().get(), links, &imported);
  EXPECT_TRUE(st.ok()) << st.error_message();

  req.set_prepare(false);
  st = a.stub->AssignStage(Context().get(), req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(a.Step(2, 1, 0, kPrompt), first);
  EXPECT_EQ(a.Step(1, 3, 0, kPrompt), -1);

  // Releasing an assignment the worker no longer holds changes nothing; releasing its own drops
  // the stage.
  v1::ReleaseStageRequest release;
  release.set_assignment_id(1);
  v1::ReleaseStageResponse released;
  st = a.stub->ReleaseStage(Context().get(), release, &released);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_FALSE(released.released());
  EXPECT_EQ(a.Step(2, 2, 0, kPrompt), first);
  release.set_assignment_id(2);
  st = a.stub->ReleaseStage(Context().get(), release, &released);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(released.released());
  EXPECT_EQ(a.Step(2, 3, 0, kPrompt), -1);
}

// A prepared assignment that no AssignStage takes (its pipeline was not built) is dropped by
// ReleaseStage of its id, while the current stage keeps serving; the same request afterwards is
// loaded afresh, not taken from the prepare.
TEST_F(KvMoveTest, APreparedAssignmentThatIsNotTakenIsReleased) {
  Worker a = StartWorker("a");
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  const int32_t first = a.Step(1, 0, 0, kPrompt);
  ASSERT_GE(first, 0);
  v1::AssignStageRequest req = PrepareOf(2);
  v1::AssignStageResponse resp;
  grpc::Status st = a.stub->AssignStage(Context().get(), req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();

  v1::ReleaseStageRequest release;
  release.set_assignment_id(3);  // neither held nor prepared
  v1::ReleaseStageResponse released;
  st = a.stub->ReleaseStage(Context().get(), release, &released);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_FALSE(released.released());
  release.set_assignment_id(2);
  st = a.stub->ReleaseStage(Context().get(), release, &released);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(released.released());
  EXPECT_THAT(a.process->Log(), HasSubstr("assignment 2: prepared stage released"));
  EXPECT_GE(a.Step(1, 1, 0, kPrompt), 0);  // the current stage serves on

  req.set_prepare(false);
  st = a.stub->AssignStage(Context().get(), req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(a.Step(2, 1, 0, kPrompt), first);
  const std::string log = a.process->Log();
  const size_t ready = log.find("assignment 2: pipeline");
  ASSERT_NE(ready, std::string::npos) << log;
  const std::string line = log.substr(ready, log.find('\n', ready) - ready);
  EXPECT_THAT(line, ::testing::Not(HasSubstr("(prepared)")));
}

TEST_F(KvMoveTest, TheStashKeepsEachExportUntilItsKeyIsDropped) {
  Worker a = StartWorker("a"), b = StartWorker("b");
  ASSERT_TRUE(a.stub && b.stub);
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  ASSERT_TRUE(b.Assign(2, Model(), 0, kLayers).ok());
  const std::vector<int32_t> other = {9, 8, 7};
  const int32_t first = a.Step(1, 0, 0, kPrompt);
  const int32_t other_first = a.Step(1, 1, 0, other);
  ASSERT_GE(first, 0);
  ASSERT_GE(other_first, 0);
  ASSERT_TRUE(Export(a, 1, 7, 0, 6).ok());
  ASSERT_TRUE(Export(a, 1, 8, 1, 1).ok());
  ASSERT_TRUE(Export(a, 1, 8, 1, 3).ok()) << "exported again: replaced";
  v1::ImportKvResponse resp;
  ASSERT_TRUE(Import(b, 2, 7, 0, {{a.address, 0, kLayers}}, &resp).ok());
  ASSERT_TRUE(Import(b, 2, 8, 3, {{a.address, 0, kLayers}}, &resp).ok());
  EXPECT_EQ(resp.bytes(), 2 * kLayers * 3 * 32 * 4) << "the second export of key 8, 3 positions";
  EXPECT_EQ(b.Step(2, 0, 6, {first}), a.Step(1, 0, 6, {first}));
  EXPECT_EQ(b.Step(2, 3, 3, {other_first}), a.Step(1, 1, 3, {other_first}));
  v1::DropKvRequest drop;
  drop.add_keys(7);
  v1::DropKvResponse dropped;
  ASSERT_TRUE(a.stub->DropKv(Context().get(), drop, &dropped).ok());
  EXPECT_EQ(Import(b, 2, 7, 0, {{a.address, 0, kLayers}}, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(Import(b, 2, 8, 3, {{a.address, 0, kLayers}}, &resp).ok()) << "key 8 is kept";
}

// The NCCL path's refusals on a worker that cannot take it (the CPU backend): an export asked to
// stay on the GPU stashes in host memory as without the ask, and a fetch over NCCL is refused with
// FAILED_PRECONDITION before anything is sent (the fetching worker then falls back to gRPC), while
// the same keys still come over gRPC.
TEST_F(KvMoveTest, AWorkerWithoutNcclStashesInHostMemoryAndRefusesNcclFetches) {
  Worker a = StartWorker("a"), b = StartWorker("b");
  ASSERT_TRUE(a.stub && b.stub);
  ASSERT_TRUE(a.Assign(1, Model(), 0, kLayers).ok());
  ASSERT_TRUE(b.Assign(2, Model(), 0, kLayers).ok());
  const int32_t first = a.Step(1, 0, 0, kPrompt);
  ASSERT_GE(first, 0);
  v1::ExportKvRequest req;
  req.set_assignment_id(1);
  req.set_device(true);
  v1::KvSequence* seq = req.add_seqs();
  seq->set_key(4);
  seq->set_slot(0);
  seq->set_positions(6);
  v1::ExportKvResponse exported;
  ASSERT_TRUE(a.stub->ExportKv(Context().get(), req, &exported).ok());
  EXPECT_EQ(exported.bytes(), 2 * kLayers * 6 * 32 * 4);

  v1::FetchKvRequest fetch;
  fetch.add_keys(4);
  fetch.set_first_layer(0);
  fetch.set_num_layers(kLayers);
  fetch.set_nccl_id(std::string(128, 'x'));
  fetch.set_nccl_join(true);
  std::unique_ptr<grpc::ClientContext> ctx = Context();
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader = a.stub->FetchKv(ctx.get(), fetch);
  v1::KvChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk)) << "nothing is sent";
  const grpc::Status refused = reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("this worker has no NCCL"));

  v1::ImportKvResponse resp;
  ASSERT_TRUE(Import(b, 2, 4, 1, {{a.address, 0, kLayers}}, &resp).ok());
  EXPECT_EQ(resp.fetched_bytes(), exported.bytes());
  EXPECT_EQ(b.Step(2, 1, 6, {first}), a.Step(1, 0, 6, {first}));
}

// A peer whose FetchKv sends a chunk that does not fit the importing stage.
class BadPeer final : public v1::Worker::Service {
 public:
  explicit BadPeer(v1::KvChunk chunk) : chunk_(std::move(chunk)) {}
  grpc::Status FetchKv(grpc::ServerContext*, const v1::FetchKvRequest*,
                       grpc::ServerWriter<v1::KvChunk>* writer) override {
    writer->Write(chunk_);
    return grpc::Status::OK;
  }

 private:
  v1::KvChunk chunk_;
};

TEST_F(KvMoveTest, ChunksFromAPeerThatDoNotFitAreRefusedAndNothingIsWritten) {
  Worker b = StartWorker("b");
  ASSERT_TRUE(b.stub);
  ASSERT_TRUE(b.Assign(2, Model(), 0, kLayers).ok());
  v1::KvChunk good;
  good.set_version(1);
  good.set_key(7);
  good.set_dtype("F32");
  good.set_layer(0);
  good.set_num_kv_heads(2);
  good.set_head_dim(16);
  good.set_total_positions(1);
  good.set_first_position(0);
  good.set_positions(1);
  good.set_k(std::string(128, '\0'));
  good.set_v(std::string(128, '\0'));
  struct Case {
    const char* says;
    void (*spoil)(v1::KvChunk&);
  };
  const Case cases[] = {
      {"version 3", [](v1::KvChunk& c) { c.set_version(3); }},
      {"3 KV heads of 16, the model has 2 of 16", [](v1::KvChunk& c) { c.set_num_kv_heads(3); }},
      {"65 positions, this stage holds 1 to 64", [](v1::KvChunk& c) { c.set_total_positions(65); }},
      {"layer 4 is not within the expected [0, 4)", [](v1::KvChunk& c) { c.set_layer(4); }},
      {"127 bytes of K", [](v1::KvChunk& c) { c.mutable_k()->pop_back(); }},
      // Fits, but the other layers never come.
      {"layer 1 has 0 of its 1 positions", [](v1::KvChunk&) {}},
  };
  for (const Case& c : cases) {
    v1::KvChunk chunk = good;
    c.spoil(chunk);
    BadPeer peer(chunk);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&peer);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    ASSERT_NE(server, nullptr);
    v1::ImportKvResponse resp;
    grpc::Status s = Import(b, 2, 7, 1, {{absl::StrCat("127.0.0.1:", port), 0, kLayers}}, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.says;
    EXPECT_THAT(s.error_message(), HasSubstr(c.says));
    server->Shutdown();
  }
  // Nothing was written: slot 1 holds no positions, and the worker still serves.
  std::string error;
  EXPECT_EQ(b.Step(2, 1, 1, {3}, &error), -1);
  EXPECT_THAT(error, HasSubstr("past the 0 tokens cached"));
  EXPECT_GE(b.Step(2, 1, 0, kPrompt), 0);
}

}  // namespace
}  // namespace tandem::testing
