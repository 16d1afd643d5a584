// StepRunner over a scripted stage and transport that log every call: the order of receive, step
// and send on each kind of stage, posted against waited receives, tokens back to the first stage,
// sends from inside the step (device sends), and how cancellations and errors end a step.
#include "worker/service/step_runner.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelConfig TinyConfig() {
  ModelConfig c;
  c.hidden_size = 4;
  return c;
}

Activations HostRows(int64_t rows, Where where = Where::kHost) {
  Activations a;
  a.rows = rows;
  a.cols = 4;
  a.dtype = DType::kF32;
  a.where = where;
  a.data = std::make_shared<std::vector<float>>(rows * 4, 1.0f);
  return a;
}

// A stage that logs its steps, returns `rows` device or host rows, or tokens 100 + i for each
// sampled sequence; with a tail installed, calls it from inside Step as the CUDA stage does for
// decode steps.
class FakeStage final : public Stage {
 public:
  explicit FakeStage(std::vector<std::string>& log) : log_(log) {}
  absl::StatusOr<StepOutput> Step(const StepDescriptor& step, const Activations& in) override {
    log_.push_back(absl::StrCat("step ", step.id, " in ", in.rows));
    fed = step.tokens;
    if (in.arrival) {
      absl::StatusOr<absl::Time> t = in.arrival();
      if (!t.ok()) return t.status();
    }
    if (!fail.ok()) return fail;
    StepOutput out;
    int64_t rows = 0;
    for (const SequenceStep& s : step.seqs) rows += s.num_tokens;
    if (head) {
      for (size_t i = 0; i < step.seqs.size(); ++i) {
        if (step.seqs[i].sample) out.tokens.push_back(static_cast<int32_t>(100 + i));
      }
    } else {
      out.hidden = HostRows(rows, output_where);
    }
    if (tail) {
      static const int32_t kDeviceTokens[4] = {100, 101, 102, 103};
      if (absl::Status st = tail(step, out.hidden, head ? kDeviceTokens : nullptr); !st.ok()) {
        return st;
      }
    }
    return out;
  }
  const ModelConfig& config() const override { return config_; }

  bool head = false;
  std::vector<int32_t> fed;  // the tokens of the last step
  Where output_where = Where::kHost;
  absl::Status fail;
  DecodeSend tail;
  // A stage on a device copies its outputs to the host (counted) and keeps a decode tail; one on
  // the host answers as Stage's defaults do.
  bool on_device = true;
  mutable int copies = 0;
  absl::StatusOr<Activations> ToHost(const Activations& a) const override {
    if (!on_device) return Stage::ToHost(a);
    ++copies;
    Activations h = a;
    h.where = Where::kHost;
    return h;
  }
  absl::Status SetDecodeTail(DecodeTail t) override {
    if (!on_device) return Stage::SetDecodeTail(std::move(t));
    tail = std::move(t);
    return absl::OkStatus();
  }

 private:
  std::vector<std::string>& log_;
  ModelConfig config_ = TinyConfig();
};

class FakeTransport final : public ActivationTransport {
 public:
  explicit FakeTransport(std::vector<std::string>& log) : log_(log) {}
  absl::Status Send(uint64_t step_id, const Activations& a) override {
    log_.push_back(absl::StrCat("send ", step_id, " rows ", a.rows,
                                a.where == Where::kHost ? " host" : " device"));
    return absl::OkStatus();
  }
  absl::StatusOr<Activations> Recv(uint64_t step_id,
                                   const std::function<bool()>& cancelled) override {
    log_.push_back(absl::StrCat("recv ", step_id));
    if (cancelled()) return absl::CancelledError("recv cancelled");
    return HostRows(rows_on_recv);
  }
  absl::StatusOr<Activations> PostRecv(uint64_t step_id, int64_t rows,
                                       const std::function<bool()>& cancelled) override {
    log_.push_back(absl::StrCat("post ", step_id, " rows ", rows));
    if (cancelled()) return absl::CancelledError("post cancelled");
    Activations a = HostRows(rows);
    a.arrival = [this, step_id]() -> absl::StatusOr<absl::Time> {
      log_.push_back(absl::StrCat("arrival ", step_id));
      if (!arrival_error.ok()) return arrival_error;
      return absl::Now();
    };
    return a;
  }
  absl::Status SendTokens(uint64_t step_id, const std::vector<int32_t>& tokens) override {
    log_.push_back(absl::StrCat("send tokens ", step_id, " n ", tokens.size()));
    return absl::OkStatus();
  }
  absl::Status SendDeviceTokens(uint64_t step_id, const int32_t*, int64_t count) override {
    log_.push_back(absl::StrCat("send device tokens ", step_id, " n ", count));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<int32_t>> RecvTokens(uint64_t step_id,
                                                  const std::function<bool()>&) override {
    log_.push_back(absl::StrCat("recv tokens ", step_id));
    return std::vector<int32_t>{7, 8};
  }
  // Posted token receives: step s's k-th token is 1000 * s + k; a step is there once `arrived`
  // holds it (take waits for nothing).
  absl::StatusOr<PostedTokens> PostRecvTokens(uint64_t step_id, int64_t count) override {
    log_.push_back(absl::StrCat("post tokens ", step_id, " n ", count));
    PostedTokens p;
    p.arrived = [this, step_id] { return arrived.contains(step_id); };
    p.take = [this, step_id, count](const std::function<bool()>&)
        -> absl::StatusOr<std::vector<int32_t>> {
      log_.push_back(absl::StrCat("take tokens ", step_id));
      if (!take_error.ok()) return take_error;
      std::vector<int32_t> t;
      for (int64_t k = 0; k < count; ++k) t.push_back(static_cast<int32_t>(1000 * step_id + k));
      return t;
    };
    return p;
  }

  absl::Status SeparateTokens() override {
    separated = true;
    return absl::OkStatus();
  }

  int64_t rows_on_recv = 2;
  absl::Status arrival_error;
  bool separated = false;
  absl::flat_hash_set<uint64_t> arrived;
  absl::Status take_error;

 private:
  std::vector<std::string>& log_;
};

StepDescriptor Decode(uint64_t id, int seqs, bool sample = true) {
  StepDescriptor d;
  d.id = id;
  for (int i = 0; i < seqs; ++i) {
    SequenceStep s;
    s.slot = i;
    s.sample = sample;
    d.seqs.push_back(s);
  }
  d.tokens.assign(seqs, 1);
  return d;
}

const std::function<bool()> kNever = [] { return false; };

StepRunnerOptions Opt(int stage, int num_stages,
                      const std::function<void(StepRunnerOptions&)>& more = nullptr) {
  StepRunnerOptions o;
  o.stage = stage;
  o.num_stages = num_stages;
  if (more) more(o);
  return o;
}

class StepRunnerTest : public ::testing::Test {
 protected:
  std::vector<std::string> log;
  FakeStage stage{log};
  FakeTransport transport{log};
};

TEST_F(StepRunnerTest, MiddleStagePostsTheReceiveStepsThenSends) {
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 3));
  ASSERT_TRUE(runner.ok()) << runner.status();
  StepDescriptor d = Decode(7, 3);
  d.seqs[1].num_tokens = 4;  // a prompt chunk among decodes: 6 rows in all
  absl::StatusOr<StepRun> run = (*runner)->Run(d, kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(log, ElementsAre("post 7 rows 6", "step 7 in 6", "arrival 7", "arrival 7",
                               "send 7 rows 6 host"));
  EXPECT_TRUE(run->tokens.empty());
  EXPECT_EQ(run->times.recv_bytes, 6 * 4 * 4);
  EXPECT_EQ(run->times.send_bytes, 6 * 4 * 4);
}

TEST_F(StepRunnerTest, StepsRunInTheOrderGiven) {
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 3));
  ASSERT_TRUE(runner.ok()) << runner.status();
  for (uint64_t id : {4, 5, 6}) ASSERT_TRUE((*runner)->Run(Decode(id, 1), kNever).ok());
  std::vector<std::string> steps;
  for (const std::string& l : log) {
    if (l.rfind("post", 0) == 0 || l.rfind("send", 0) == 0) steps.push_back(l);
  }
  EXPECT_THAT(steps, ElementsAre("post 4 rows 1", "send 4 rows 1 host", "post 5 rows 1",
                                 "send 5 rows 1 host", "post 6 rows 1", "send 6 rows 1 host"));
}

TEST_F(StepRunnerTest, FirstStageReadsNoInput) {
  auto runner = StepRunner::Create(stage, &transport, Opt(0, 2));
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Run(Decode(1, 2), kNever).ok());
  EXPECT_THAT(log, ElementsAre("step 1 in 0", "send 1 rows 2 host"));
}

TEST_F(StepRunnerTest, LastStageReturnsItsTokensAndSendsNothing) {
  stage.head = true;
  StepDescriptor d = Decode(2, 3);
  d.seqs[1].sample = false;
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 2));
  ASSERT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<StepRun> run = (*runner)->Run(d, kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(run->tokens, ElementsAre(100, 102));
  for (const std::string& l : log) EXPECT_THAT(l, ::testing::Not(HasSubstr("send")));
}

TEST_F(StepRunnerTest, TokensGoBackToTheFirstStageWithoutACoordinator) {
  stage.head = true;
  auto last = StepRunner::Create(
      stage, &transport, Opt(1, 2, [&](StepRunnerOptions& o) { o.tokens_to_first = true; }));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_FALSE(transport.separated);  // the first stage waits for each step's tokens
  absl::StatusOr<StepRun> run = (*last)->Run(Decode(9, 2), kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->tokens.empty());
  EXPECT_EQ(log.back(), "send tokens 9 n 2");

  log.clear();
  stage.head = false;
  auto first = StepRunner::Create(
      stage, &transport, Opt(0, 2, [&](StepRunnerOptions& o) { o.tokens_to_first = true; }));
  ASSERT_TRUE(first.ok()) << first.status();
  run = (*first)->Run(Decode(9, 2), kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(log, ElementsAre("step 9 in 0", "send 9 rows 2 host", "recv tokens 9"));
  EXPECT_THAT(run->tokens, ElementsAre(7, 8));
}

TEST_F(StepRunnerTest, DeviceSendsLeaveTheStepFromInsideIt) {
  stage.output_where = Where::kDevice;
  {
    auto runner = StepRunner::Create(stage, &transport, Opt(0, 2, [&](StepRunnerOptions& o) {
                                       o.host_link = false;
                                       o.device_sends = true;
                                     }));
    ASSERT_TRUE(runner.ok()) << runner.status();
    EXPECT_TRUE((*runner)->device_sends());
    absl::StatusOr<StepRun> run = (*runner)->Run(Decode(1, 2), kNever);
    ASSERT_TRUE(run.ok()) << run.status();
    // Sent once, from the tail, before Step returned.
    EXPECT_THAT(log, ElementsAre("step 1 in 0", "send 1 rows 2 device"));
    EXPECT_EQ(run->times.send_bytes, 0);
    EXPECT_TRUE(static_cast<bool>(stage.tail));
  }
  EXPECT_FALSE(static_cast<bool>(stage.tail)) << "the runner's destructor clears the tail";
}

TEST_F(StepRunnerTest, LastStageSendsSampledTokensFromTheDeviceOnlyWhenEverySequenceSamples) {
  stage.head = true;
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 2, [&](StepRunnerOptions& o) {
                                     o.tokens_to_first = true;
                                     o.host_link = false;
                                     o.device_sends = true;
                                   }));
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Run(Decode(1, 3), kNever).ok());
  EXPECT_THAT(log, ElementsAre("post 1 rows 3", "step 1 in 3", "arrival 1",
                               "send device tokens 1 n 3", "arrival 1"));
  log.clear();
  // A sequence that does not sample: the host sends the sampled ones after the step.
  StepDescriptor d = Decode(2, 3);
  d.seqs[0].sample = false;
  ASSERT_TRUE((*runner)->Run(d, kNever).ok());
  EXPECT_THAT(log, ElementsAre("post 2 rows 3", "step 2 in 3", "arrival 2", "arrival 2",
                               "send tokens 2 n 2"));
}

TEST_F(StepRunnerTest, LastStageWithACoordinatorInstallsNoTail) {
  stage.head = true;
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 2, [&](StepRunnerOptions& o) {
                                     o.host_link = false;
                                     o.device_sends = true;
                                   }));
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_FALSE((*runner)->device_sends());
  EXPECT_FALSE(static_cast<bool>(stage.tail));
}

TEST_F(StepRunnerTest, ACancelledReceiveRunsNoStepAndTheNextStepRuns) {
  bool cancel = true;
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 3));
  ASSERT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<StepRun> run = (*runner)->Run(Decode(1, 1), [&] { return cancel; });
  EXPECT_EQ(run.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(log, ElementsAre("post 1 rows 1"));
  cancel = false;
  ASSERT_TRUE((*runner)->Run(Decode(2, 1), [&] { return cancel; }).ok());
  EXPECT_EQ(log.back(), "send 2 rows 1 host");
}

TEST_F(StepRunnerTest, AnInputThatNeverArrivesFailsTheStepWithTheTransportsError) {
  transport.arrival_error = absl::DeadlineExceededError("stage 0 silent for 60 s");
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 3));
  ASSERT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<StepRun> run = (*runner)->Run(Decode(1, 1), kNever);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(run.status().message()), HasSubstr("silent"));
  for (const std::string& l : log) EXPECT_THAT(l, ::testing::Not(HasSubstr("send")));
}

TEST_F(StepRunnerTest, AFailedStepSendsNothing) {
  stage.fail = absl::InvalidArgumentError("slot 9 of 8");
  auto runner = StepRunner::Create(stage, &transport, Opt(0, 2));
  ASSERT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<StepRun> run = (*runner)->Run(Decode(1, 1), kNever);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(log, ElementsAre("step 1 in 0"));
}

TEST_F(StepRunnerTest, HostLinkCopiesDeviceOutputToTheHostFirst) {
  stage.output_where = Where::kDevice;
  auto runner = StepRunner::Create(stage, &transport, Opt(0, 2));
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Run(Decode(1, 2), kNever).ok());
  EXPECT_EQ(stage.copies, 1);
  EXPECT_EQ(log.back(), "send 1 rows 2 host");

  stage.on_device = false;  // a host stage cannot copy device activations
  absl::StatusOr<StepRun> run = (*runner)->Run(Decode(2, 2), kNever);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(run.status().message()), HasSubstr("device activations"));
}

TEST_F(StepRunnerTest, DeviceSendsNeedAStageThatTakesADecodeTail) {
  stage.on_device = false;
  absl::Status s = StepRunner::Create(stage, &transport,
                                      Opt(0, 2,
                                          [&](StepRunnerOptions& o) {
                                            o.host_link = false;
                                            o.device_sends = true;
                                          }))
                       .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
}

TEST_F(StepRunnerTest, SingleStageFeedsTheTokenItsSlotSampledInTheStepBefore) {
  stage.head = true;
  auto runner = StepRunner::Create(stage, nullptr, Opt(0, 1));
  ASSERT_TRUE(runner.ok()) << runner.status();
  StepDescriptor first = Decode(1, 3);  // slots 0, 1, 2 sample 100, 101, 102
  first.seqs[1].sample = false;         // slot 1 samples nothing: 100, 102
  ASSERT_TRUE((*runner)->Run(first, kNever).ok());
  StepDescriptor next = Decode(2, 3);
  next.seqs[0].slot = 2;
  next.seqs[1].slot = 0;
  next.seqs[2].slot = 1;
  next.tokens = {kPreviousSample, kPreviousSample, 5};
  absl::StatusOr<StepRun> run = (*runner)->Run(next, kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(stage.fed, ElementsAre(102, 100, 5));
  EXPECT_THAT(next.tokens, ElementsAre(kPreviousSample, kPreviousSample, 5));  // a copy is fed
  // The newest sample of each slot: slot 2 sampled 100 in step 2.
  StepDescriptor third = Decode(3, 1);
  third.seqs[0].slot = 2;
  third.tokens = {kPreviousSample};
  ASSERT_TRUE((*runner)->Run(third, kNever).ok());
  EXPECT_THAT(stage.fed, ElementsAre(100));
}

TEST_F(StepRunnerTest, APreviousSampleNoSlotHoldsOrOnAStageOfSeveralIsRefused) {
  stage.head = true;
  auto single = StepRunner::Create(stage, nullptr, Opt(0, 1));
  ASSERT_TRUE(single.ok()) << single.status();
  StepDescriptor d = Decode(1, 2);
  d.seqs[1].slot = 3;
  d.tokens = {1, kPreviousSample};
  absl::StatusOr<StepRun> run = (*single)->Run(d, kNever);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status().message(), HasSubstr("slot 3 sampled no token before"));
  EXPECT_TRUE(log.empty());  // the stage ran nothing

  auto first = StepRunner::Create(stage, &transport, Opt(0, 2));
  ASSERT_TRUE(first.ok()) << first.status();
  run = (*first)->Run(d, kNever);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(run.status().message(), HasSubstr("only the single stage"));
  EXPECT_TRUE(log.empty());
  ASSERT_TRUE((*single)->Run(Decode(2, 1), kNever).ok());  // still usable
}

// Launched ahead (the Stage's default launch runs each step as it is launched): a row whose slot
// the unfinished step samples takes that step's token (the row's index among its sampled rows),
// the others the host's; tokens given are kept; at most two are unfinished.
TEST_F(StepRunnerTest, SingleStageLaunchesAheadFeedingTheSamplesOfTheUnfinishedStep) {
  stage.head = true;
  auto runner = StepRunner::Create(stage, nullptr, Opt(0, 1));
  ASSERT_TRUE(runner.ok()) << runner.status();
  StepDescriptor first = Decode(1, 3);  // slots 0, 1, 2; slot 1 samples nothing: 100, 102
  first.seqs[1].sample = false;
  ASSERT_TRUE((*runner)->CanLaunch(first));
  ASSERT_TRUE((*runner)->Launch(first).ok());
  StepDescriptor next = Decode(2, 3);
  next.seqs[0].slot = 2;
  next.seqs[1].slot = 0;
  next.seqs[2].slot = 1;
  next.tokens = {kPreviousSample, kPreviousSample, 5};
  ASSERT_TRUE((*runner)->Launch(next).ok());
  EXPECT_THAT(stage.fed, ElementsAre(102, 100, 5));
  EXPECT_EQ((*runner)->launched(), 2);
  absl::Status third = (*runner)->Launch(Decode(3, 1));
  EXPECT_EQ(third.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*runner)->LaunchedDone());
  absl::StatusOr<StepRun> done = (*runner)->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_THAT(done->tokens, ElementsAre(100, 102));
  done = (*runner)->Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_THAT(done->tokens, ElementsAre(100, 101, 102));  // slots 2, 0, 1
  EXPECT_EQ((*runner)->Finish().status().code(), absl::StatusCode::kFailedPrecondition);
  // Nothing unfinished: the host's newest samples, launched or run.
  StepDescriptor after = Decode(4, 3);
  after.tokens = {kPreviousSample, kPreviousSample, kPreviousSample};
  ASSERT_TRUE((*runner)->Launch(after).ok());
  EXPECT_THAT(stage.fed, ElementsAre(101, 102, 100));
  ASSERT_TRUE((*runner)->Finish().ok());
  ASSERT_TRUE((*runner)->Run(after, kNever).ok());
  EXPECT_THAT(stage.fed, ElementsAre(100, 101, 102));
}

TEST_F(StepRunnerTest, OnlySingleStagesLaunchDecodeStepsAheadAndABadOneLaunchesNothing) {
  stage.head = true;
  auto single = StepRunner::Create(stage, nullptr, Opt(0, 1));
  ASSERT_TRUE(single.ok()) << single.status();
  StepDescriptor prompt = Decode(1, 1);
  prompt.seqs[0].num_tokens = 2;
  prompt.tokens = {1, 2};
  EXPECT_FALSE((*single)->CanLaunch(prompt));
  EXPECT_EQ((*single)->Launch(prompt).code(), absl::StatusCode::kInvalidArgument);
  StepDescriptor logits = Decode(2, 1);
  logits.return_logits = true;
  EXPECT_FALSE((*single)->CanLaunch(logits));
  StepDescriptor unknown = Decode(3, 2);
  unknown.seqs[1].slot = 3;
  unknown.tokens = {1, kPreviousSample};
  absl::Status st = (*single)->Launch(unknown);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("slot 3 sampled no token before"));
  EXPECT_TRUE(log.empty());  // the stage ran nothing
  EXPECT_EQ((*single)->launched(), 0);

  auto first = StepRunner::Create(stage, &transport, Opt(0, 2));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE((*first)->CanLaunch(Decode(4, 1)));
  EXPECT_EQ((*first)->Launch(Decode(4, 1)).code(), absl::StatusCode::kInvalidArgument);
}

// The checks every backend's LaunchDecode makes (Stage::CheckLaunch), on the default.
TEST_F(StepRunnerTest, AStageRefusesTokensFromRowsTheStepBeforeDidNotSample) {
  stage.head = true;
  const std::vector<int> from_row0 = {0};
  EXPECT_EQ(stage.LaunchDecode(Decode(1, 1), from_row0).code(),
            absl::StatusCode::kInvalidArgument);  // no step before
  StepDescriptor first = Decode(1, 2);
  first.seqs[1].sample = false;
  ASSERT_TRUE(stage.LaunchDecode(first, {}).ok());
  const std::vector<int> from_row1 = {1};
  absl::Status st = stage.LaunchDecode(Decode(2, 1), from_row1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("row 1 of step 1, which samples none"));
  const std::vector<int> two_rows = {0, -1};
  EXPECT_EQ(stage.LaunchDecode(Decode(2, 1), two_rows).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stage.launched_decodes(), 1);
  ASSERT_TRUE(stage.LaunchDecode(Decode(2, 1), from_row0).ok());
  EXPECT_THAT(stage.fed, ElementsAre(100));
  EXPECT_EQ(stage.LaunchDecode(Decode(3, 1), {}).code(), absl::StatusCode::kFailedPrecondition);
}

// The first stage of two whose coordinator sends steps ahead: it posts the receive of each step's
// tokens once it has run it, and a row feeding its slot's previous sample waits for the tokens of
// the newest step that sampled that slot only.
TEST_F(StepRunnerTest, FirstStageFedByTheLastWaitsOnlyForTheStepsItsRowsFeedFrom) {
  auto runner = StepRunner::Create(
      stage, &transport, Opt(0, 2, [&](StepRunnerOptions& o) { o.feed_first = true; }));
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_TRUE((*runner)->feeds_previous_samples());
  EXPECT_TRUE(transport.separated);
  StepDescriptor a = Decode(1, 2);  // slots 0, 1
  StepDescriptor b = Decode(2, 2);  // slots 2, 3
  b.seqs[0].slot = 2;
  b.seqs[1].slot = 3;
  b.seqs[1].sample = false;  // a prompt chunk: slot 3 samples nothing
  ASSERT_TRUE((*runner)->Run(a, kNever).ok());
  ASSERT_TRUE((*runner)->Run(b, kNever).ok());
  EXPECT_THAT(log, ElementsAre("step 1 in 0", "send 1 rows 2 host", "post tokens 1 n 2",
                               "step 2 in 0", "send 2 rows 2 host", "post tokens 2 n 1"));
  log.clear();
  // a's sequences ahead of b's tokens: step 1's tokens are taken, step 2's are not waited for.
  StepDescriptor a2 = Decode(3, 2);
  a2.seqs[0].slot = 1;
  a2.seqs[1].slot = 0;
  a2.tokens = {kPreviousSample, kPreviousSample};
  absl::StatusOr<StepRun> run = (*runner)->Run(a2, kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(stage.fed, ElementsAre(1001, 1000));
  EXPECT_THAT(log, ElementsAre("take tokens 1", "step 3 in 0", "send 3 rows 2 host",
                               "post tokens 3 n 2"));
  log.clear();
  // Tokens that are there are taken before a step, in order, whether a row feeds them or not.
  transport.arrived = {2};
  StepDescriptor other = Decode(4, 1);
  other.seqs[0].slot = 5;
  ASSERT_TRUE((*runner)->Run(other, kNever).ok());
  EXPECT_EQ(log.front(), "take tokens 2");
  log.clear();
  // Slot 0 sampled in step 3 after step 1: its newest token is step 3's (and slot 2's step 2's).
  StepDescriptor next = Decode(5, 2);
  next.seqs[1].slot = 2;
  next.tokens = {kPreviousSample, kPreviousSample};
  ASSERT_TRUE((*runner)->Run(next, kNever).ok());
  EXPECT_THAT(stage.fed, ElementsAre(3001, 2000));
  EXPECT_EQ(log.front(), "take tokens 3");
}

TEST_F(StepRunnerTest, FirstStageFedByTheLastTakesTheOldestBeforePostingTooMany) {
  auto runner = StepRunner::Create(
      stage, &transport, Opt(0, 2, [&](StepRunnerOptions& o) { o.feed_first = true; }));
  ASSERT_TRUE(runner.ok()) << runner.status();
  for (uint64_t id = 1; id <= kMaxPostedTokenReceives + 1; ++id) {
    ASSERT_TRUE((*runner)->Run(Decode(id, 1), kNever).ok());
  }
  std::vector<std::string> tokens;
  for (const std::string& l : log) {
    if (l.find("tokens") != std::string::npos) tokens.push_back(l);
  }
  ASSERT_EQ(tokens.size(), kMaxPostedTokenReceives + 2u);
  EXPECT_EQ(tokens[kMaxPostedTokenReceives], "take tokens 1");
  EXPECT_EQ(tokens.back(), absl::StrCat("post tokens ", kMaxPostedTokenReceives + 1, " n 1"));
}

TEST_F(StepRunnerTest, FirstStageFedByTheLastFailsAStepWhoseTokensDoNotCome) {
  auto runner = StepRunner::Create(
      stage, &transport, Opt(0, 2, [&](StepRunnerOptions& o) { o.feed_first = true; }));
  ASSERT_TRUE(runner.ok()) << runner.status();
  ASSERT_TRUE((*runner)->Run(Decode(1, 1), kNever).ok());
  transport.take_error = absl::DeadlineExceededError("the last stage is silent");
  StepDescriptor d = Decode(2, 1);
  d.tokens = {kPreviousSample};
  log.clear();
  absl::StatusOr<StepRun> run = (*runner)->Run(d, kNever);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(log, ElementsAre("take tokens 1"));  // the step did not run
}

TEST_F(StepRunnerTest, LastStageFeedingTheFirstReturnsItsTokensAndSendsThemToo) {
  stage.head = true;
  auto runner = StepRunner::Create(stage, &transport, Opt(1, 2, [&](StepRunnerOptions& o) {
                                     o.feed_first = true;
                                     o.host_link = false;
                                     o.device_sends = true;
                                   }));
  ASSERT_TRUE(runner.ok()) << runner.status();
  EXPECT_TRUE((*runner)->device_sends());
  EXPECT_TRUE(transport.separated);
  StepDescriptor d = Decode(1, 2);
  d.tokens = {kPreviousSample, kPreviousSample};  // not read past the first stage
  absl::StatusOr<StepRun> run = (*runner)->Run(d, kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(run->tokens, ElementsAre(100, 101));
  EXPECT_THAT(stage.fed, ElementsAre(kPreviousSample, kPreviousSample));
  EXPECT_THAT(log, ElementsAre("post 1 rows 2", "step 1 in 2", "arrival 1",
                               "send device tokens 1 n 2", "arrival 1"));
  log.clear();
  StepDescriptor p = Decode(2, 2);
  p.seqs[1].sample = false;  // the host sends the sampled ones, after the step
  run = (*runner)->Run(p, kNever);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_THAT(run->tokens, ElementsAre(100));
  EXPECT_EQ(log.back(), "send tokens 2 n 1");
}

TEST_F(StepRunnerTest, OptionsThatDescribeNoStageAreRefused) {
  EXPECT_EQ(StepRunner::Create(stage, &transport, Opt(2, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StepRunner::Create(stage, &transport, Opt(-1, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status no_transport = StepRunner::Create(stage, nullptr, Opt(0, 2)).status();
  EXPECT_THAT(std::string(no_transport.message()), HasSubstr("no transport"));
  absl::Status host_tail =
      StepRunner::Create(stage, &transport,
                         Opt(0, 2, [&](StepRunnerOptions& o) { o.device_sends = true; }))
          .status();
  EXPECT_THAT(std::string(host_tail.message()), HasSubstr("device sends"));
  absl::Status both = StepRunner::Create(stage, &transport, Opt(1, 2, [&](StepRunnerOptions& o) {
                                           o.tokens_to_first = o.feed_first = true;
                                         }))
                          .status();
  EXPECT_THAT(std::string(both.message()), HasSubstr("not both"));
  EXPECT_TRUE(StepRunner::Create(stage, nullptr, Opt(0, 1)).ok());
}

}  // namespace
}  // namespace tandem
