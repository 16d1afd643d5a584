// Steps streams to a pipeline's workers.
#include "coordinator/pipeline_link.h"

#include "absl/strings/str_cat.h"
#include "common/thread_name.h"

namespace tandem {

PipelineLink::PipelineLink(std::vector<std::shared_ptr<grpc::Channel>> channels,
                           Callbacks callbacks, const std::string& name)
    : callbacks_(std::move(callbacks)) {
  for (size_t s = 0; s < channels.size(); ++s) {
    auto st = std::make_unique<StageStream>();
    auto stub = v1::Worker::NewStub(channels[s]);
    st->stream = stub->Steps(&st->context);
    stages_.push_back(std::move(st));
  }
  for (size_t s = 0; s < stages_.size(); ++s) {
    stages_[s]->reader = std::thread([this, s, name] {
      SetThreadName(absl::StrCat(name, "-", s));
      ReadLoop(static_cast<int>(s));
    });
  }
}

PipelineLink::~PipelineLink() { Close(); }

void PipelineLink::Queue(v1::StepRequest step) {
  absl::MutexLock lock(&queue_mu_);
  queued_.push_back(std::move(step));
}

bool PipelineLink::Flush() {
  absl::MutexLock flush(&flush_mu_);
  bool ok = true;
  while (true) {
    v1::StepRequest step;
    {
      absl::MutexLock lock(&queue_mu_);
      if (queued_.empty()) return ok;
      step = std::move(queued_.front());
      queued_.pop_front();
    }
    ok &= Write(step);
  }
}

bool PipelineLink::Write(const v1::StepRequest& step) {
  for (auto& stage : stages_) {
    StageStream& st = *stage;
    absl::MutexLock lock(&st.write_mu);
    if (st.broken || closing_.load()) return false;
    if (!st.stream->Write(step)) {
      st.broken = true;
      return false;
    }
  }
  return true;
}

void PipelineLink::ReadLoop(int stage) {
  StageStream& st = *stages_[stage];
  const bool last = stage + 1 == static_cast<int>(stages_.size());
  v1::StepResult result;
  while (st.stream->Read(&result)) {
    if (closing_.load()) continue;
    if (last || result.error_code() != 0) callbacks_.on_result(stage, result);
  }
  grpc::Status status;
  {
    absl::MutexLock lock(&st.write_mu);
    st.broken = true;
    status = st.stream->Finish();
  }
  if (closing_.load()) return;
  absl::Status s(static_cast<absl::StatusCode>(status.error_code()),
                 status.ok() ? "the worker ended the step stream" : status.error_message());
  if (status.ok()) s = absl::UnavailableError("the worker ended the step stream");
  callbacks_.on_broken(stage, s);
}

std::optional<StageAssignError> AssignPipelineStages(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels,
    std::vector<v1::AssignStageRequest>& requests, absl::Duration timeout,
    std::vector<v1::AssignStageResponse>* responses, bool nccl_capable) {
  const int stages = static_cast<int>(requests.size());
  responses->assign(stages, v1::AssignStageResponse());
  auto assign = [&](int s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    return v1::Worker::NewStub(channels[s])->AssignStage(&ctx, requests[s], &(*responses)[s]);
  };
  std::string transport = "grpc";
  if (stages > 1 && !requests[0].transport().empty()) {
    transport = requests[0].transport();  // chosen when the stages were prepared
  } else if (stages > 1 && nccl_capable) {
    v1::PrepareLinkRequest req;
    req.set_assignment_id(requests[0].assignment_id());
    req.set_num_stages(stages);
    v1::PrepareLinkResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    grpc::Status st = v1::Worker::NewStub(channels[0])->PrepareLink(&ctx, req, &resp);
    if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      resp.set_transport("grpc");  // a worker that predates PrepareLink links over gRPC only
    } else if (!st.ok()) {
      return StageAssignError{0, grpc::Status(st.error_code(),
                                              "PrepareLink: " + st.error_message())};
    }
    if (resp.transport() == "nccl") {
      transport = "nccl";
    } else if (!resp.transport().empty() && resp.transport() != "grpc") {
      return StageAssignError{
          0, grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("PrepareLink: unknown transport '", resp.transport(), "'"))};
    }
    for (v1::AssignStageRequest& r : requests) {
      r.set_transport(transport);
      if (transport == "nccl") r.set_nccl_id(resp.nccl_id());
    }
  } else if (stages > 1) {
    for (v1::AssignStageRequest& r : requests) r.set_transport(transport);
  }
  if (transport != "nccl") {
    for (int s = 0; s < stages; ++s) {
      grpc::Status st = assign(s);
      if (!st.ok()) return StageAssignError{s, st};
    }
    return std::nullopt;
  }
  // Every rank must be inside its join at the same time: one thread per stage.
  std::vector<grpc::Status> results(stages);
  std::vector<std::thread> threads;
  for (int s = 0; s < stages; ++s) {
    threads.emplace_back([&, s] { results[s] = assign(s); });
  }
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < stages; ++s) {
    if (!results[s].ok()) return StageAssignError{s, results[s]};
  }
  return std::nullopt;
}

void PipelineLink::Close() {
  absl::MutexLock lock(&close_mu_);
  if (closed_) return;
  closed_ = true;
  closing_.store(true);
  for (auto& st : stages_) st->context.TryCancel();
  for (auto& st : stages_) {
    if (st->reader.joinable()) st->reader.join();
  }
}

}  // namespace tandem
