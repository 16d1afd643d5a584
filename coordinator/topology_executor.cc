#include "coordinator/topology_executor.h"

#include <optional>
#include <utility>

#include "absl/strings/str_join.h"
#include "coordinator/pipeline_link.h"
#include "spdlog/spdlog.h"

namespace tandem {

std::vector<v1::AssignStageRequest> StageRequests(const StageSettings& settings, int id,
                                                  uint64_t assignment,
                                                  const std::vector<std::string>& addresses,
                                                  const std::vector<LayerRange>& ranges) {
  const int stages = static_cast<int>(addresses.size());
  std::vector<v1::AssignStageRequest> requests(stages);
  for (int s = 0; s < stages; ++s) {
    v1::AssignStageRequest& req = requests[s];
    req.set_assignment_id(assignment);
    req.set_pipeline_id(id);
    req.set_stage(s);
    req.set_num_stages(stages);
    req.set_model_dir(settings.model_dir);
    req.set_first_layer(ranges[s].first);
    req.set_last_layer(ranges[s].last);
    req.set_max_slots(settings.max_slots);
    req.set_max_seq_len(settings.max_seq_len);
    req.set_max_step_rows(settings.max_step_rows);
    req.set_kv_page_size(settings.kv_page_size);
    req.set_kv_pages(settings.kv_pages);
    req.set_kv_cache_dtype(settings.kv_cache_dtype);
    req.set_tensor_parallel(settings.tensor_parallel);
    if (s + 1 < stages) req.set_next_address(addresses[s + 1]);
  }
  return requests;
}

bool PrepareStages(int id, const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                   std::vector<v1::AssignStageRequest>& requests, bool all_cuda) {
  const absl::Time t0 = absl::Now();
  std::vector<v1::AssignStageResponse> responses;
  if (std::optional<StageAssignError> err =
          AssignPipelineStages(channels, requests, kAssignTimeout, &responses, all_cuda)) {
    spdlog::warn("pipeline {} not prepared ahead (its stages load when assigned): stage {}: {}",
                 id, err->stage, err->status.error_message());
    return false;
  }
  int64_t placed = 0;
  for (const v1::AssignStageResponse& r : responses) placed += r.placed_bytes();
  spdlog::info("pipeline {} prepared in {:.3f} s ({} bytes of weights placed ahead)", id,
               absl::ToDoubleSeconds(absl::Now() - t0), placed);
  return true;
}

void MakeKvLinks(int64_t worker, const std::shared_ptr<grpc::Channel>& channel,
                 const std::set<std::string>& sources) {
  const absl::Time t0 = absl::Now();
  v1::ImportKvRequest req;
  for (const std::string& a : sources) req.add_sources()->set_address(a);
  v1::ImportKvResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kHandoffTimeout));
  const grpc::Status st = v1::Worker::NewStub(channel)->ImportKv(&ctx, req, &resp);
  if (st.ok()) {
    spdlog::info("KV links of worker {} to {} made in {:.3f} s", worker,
                 absl::StrJoin(sources, ", "), absl::ToDoubleSeconds(absl::Now() - t0));
  } else {
    spdlog::warn("KV links of worker {} not made ahead (the move makes them): {}", worker,
                 st.error_message());
  }
}

void StageReleaser::Release(std::shared_ptr<grpc::Channel> channel, uint64_t assignment) {
  threads_.emplace_back([channel = std::move(channel), assignment] {
    v1::ReleaseStageRequest req;
    req.set_assignment_id(assignment);
    v1::ReleaseStageResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kAssignTimeout));
    const grpc::Status st = v1::Worker::NewStub(channel)->ReleaseStage(&ctx, req, &resp);
    if (!st.ok() && st.error_code() != grpc::StatusCode::UNIMPLEMENTED) {
      spdlog::warn("assignment {}: stage not released: {}", assignment, st.error_message());
    }
  });
}

void StageReleaser::Join() {
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

}  // namespace tandem
