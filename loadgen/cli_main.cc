// tandem-cli: a small command-line client of the Inference and Admin services.
//   tandem-cli generate --prompt "Once upon a time" [--stream] [--addr HOST:PORT]
//   tandem-cli info | topology | workers | set-topology --stages S --replicas R
//   tandem-cli drain | undrain --worker_id ID
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/flags_usage.h"
#include "common/security/credentials.h"
#include "common/security/tls_flags.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"

ABSL_FLAG(std::string, addr, "127.0.0.1:50051", "the coordinator's host:port");
ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(std::string, token_ids, "", "prompt as comma-separated token ids (instead of --prompt)");
ABSL_FLAG(bool, stream, false, "print tokens as they are generated");
ABSL_FLAG(int, max_new_tokens, 32, "tokens to generate at most");
ABSL_FLAG(double, temperature, 0.0, "0: greedy");
ABSL_FLAG(int, top_k, 0, "0: no limit");
ABSL_FLAG(double, top_p, 1.0, "(0, 1]");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "sampling seed (unset: a fresh one per call)");
ABSL_FLAG(double, min_p, 0.0, "[0, 1]; 0: off");
ABSL_FLAG(double, presence_penalty, 0.0, "[-2, 2]; 0: off");
ABSL_FLAG(double, frequency_penalty, 0.0, "[-2, 2]; 0: off");
ABSL_FLAG(double, repetition_penalty, 1.0, "(0, 100]; 1: off");
ABSL_FLAG(int, n, 1, "sequences to generate (without --stream)");
ABSL_FLAG(int, logprobs, -1,
          "-1: none; K in [0, 20]: print each generated token's logprob and K alternatives");
ABSL_FLAG(std::vector<std::string>, stop, {}, "stop strings, comma-separated");
ABSL_FLAG(bool, ignore_eos, false, "keep generating past end-of-sequence");
ABSL_FLAG(bool, show_ids, false, "also print the generated token ids");
ABSL_FLAG(int, timeout_ms, 0, "request deadline (0: none)");
ABSL_FLAG(int, stages, 1, "set-topology: stages per replica");
ABSL_FLAG(int, replicas, 1, "set-topology: replicas");
ABSL_FLAG(std::optional<int>, prefill_replicas, std::nullopt,
          "set-topology: of the replicas, those that run prompts only (unset: as before)");
ABSL_FLAG(std::optional<int>, tensor_parallel, std::nullopt,
          "set-topology: ranks each stage is split over, on workers of at least so many (0: each "
          "worker's own; unset: as before)");
ABSL_FLAG(int64_t, worker_id, 0, "drain, undrain: the worker's id (from 'workers')");
ABSL_FLAG(std::string, api_key, "", "key for generate and info (env TANDEM_API_KEY)");
ABSL_FLAG(std::string, admin_key, "",
          "key for topology, workers, set-topology, drain and undrain (env TANDEM_ADMIN_KEY; "
          "empty: the --api_key)");

namespace {

constexpr const char* kUsage =
    "tandem-cli COMMAND [flags]\n"
    "  generate --prompt TEXT [--stream] [--max_new_tokens N] [--temperature T] [--addr "
    "HOST:PORT]\n"
    "  info                      model information\n"
    "  topology                  pipelines and their workers\n"
    "  workers                   registered workers\n"
    "  set-topology --stages S --replicas R [--tensor_parallel N]\n"
    "  drain --worker_id ID      take a worker out of service\n"
    "  undrain --worker_id ID    put a drained worker back\n";

int Fail(const grpc::Status& s) {
  static const char* const kNames[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int code = static_cast<int>(s.error_code());
  std::fprintf(stderr, "error: %s: %s\n", code >= 0 && code <= 16 ? kNames[code] : "?",
               s.error_message().c_str());
  return 1;
}

const char* FinishName(tandem::v1::FinishReason f) {
  switch (f) {
    case tandem::v1::FINISH_REASON_LENGTH: return "length";
    case tandem::v1::FINISH_REASON_STOP: return "stop";
    case tandem::v1::FINISH_REASON_EOS: return "eos";
    default: return "unspecified";
  }
}

int Generate(const std::shared_ptr<grpc::Channel>& channel) {
  tandem::v1::GenerateRequest req;
  req.set_prompt(absl::GetFlag(FLAGS_prompt));
  if (const std::string ids = absl::GetFlag(FLAGS_token_ids); !ids.empty()) {
    for (absl::string_view part : absl::StrSplit(ids, ',', absl::SkipEmpty())) {
      int id = 0;
      if (!absl::SimpleAtoi(part, &id)) {
        std::fprintf(stderr, "error: --token_ids: '%s' is not an integer\n",
                     std::string(part).c_str());
        return 2;
      }
      req.add_token_ids(id);
    }
  }
  req.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  req.mutable_sampling()->set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  req.mutable_sampling()->set_top_k(absl::GetFlag(FLAGS_top_k));
  req.mutable_sampling()->set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  tandem::v1::SamplingParams* sampling = req.mutable_sampling();
  if (const std::optional<uint64_t> seed = absl::GetFlag(FLAGS_seed)) sampling->set_seed(*seed);
  sampling->set_min_p(static_cast<float>(absl::GetFlag(FLAGS_min_p)));
  sampling->set_presence_penalty(static_cast<float>(absl::GetFlag(FLAGS_presence_penalty)));
  sampling->set_frequency_penalty(static_cast<float>(absl::GetFlag(FLAGS_frequency_penalty)));
  sampling->set_repetition_penalty(static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty)));
  sampling->set_n(absl::GetFlag(FLAGS_n));
  if (absl::GetFlag(FLAGS_stream) && absl::GetFlag(FLAGS_n) > 1) {
    std::fprintf(stderr, "error: --n above 1 prints whole sequences: leave out --stream\n");
    return 2;
  }
  if (const int k = absl::GetFlag(FLAGS_logprobs); k >= 0) {
    sampling->set_logprobs(true);
    sampling->set_top_logprobs(k);
  }
  for (const std::string& s : absl::GetFlag(FLAGS_stop)) req.add_stop(s);
  req.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  req.set_timeout_ms(absl::GetFlag(FLAGS_timeout_ms));
  auto stub = tandem::v1::Inference::NewStub(channel);
  grpc::ClientContext ctx;
  tandem::v1::Usage usage;
  tandem::v1::Timings timings;
  tandem::v1::FinishReason finish = tandem::v1::FINISH_REASON_UNSPECIFIED;
  std::vector<int32_t> ids;
  if (absl::GetFlag(FLAGS_stream)) {
    auto reader = stub->GenerateStream(&ctx, req);
    tandem::v1::GenerateStreamResponse msg;
    while (reader->Read(&msg)) {
      std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
      std::fflush(stdout);
      ids.insert(ids.end(), msg.token_ids().begin(), msg.token_ids().end());
      if (msg.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
        finish = msg.finish_reason();
        usage = msg.usage();
        timings = msg.timings();
      }
    }
    grpc::Status s = reader->Finish();
    std::printf("\n");
    std::fflush(stdout);
    if (!s.ok()) return Fail(s);
  } else {
    tandem::v1::GenerateResponse resp;
    grpc::Status s = stub->Generate(&ctx, req, &resp);
    if (!s.ok()) return Fail(s);
    for (const tandem::v1::Choice& c : resp.choices()) {
      if (resp.choices_size() > 1) std::printf("[%d] ", c.index());
      std::printf("%s\n", c.text().c_str());
      for (const tandem::v1::TokenLogprob& l : c.logprobs()) {
        std::fprintf(stderr, "token %d logprob %.4f", l.token_id(), l.logprob());
        for (const tandem::v1::TopLogprob& t : l.top_logprobs()) {
          std::fprintf(stderr, "  %d:%.4f", t.token_id(), t.logprob());
        }
        std::fprintf(stderr, "\n");
      }
    }
    ids.assign(resp.token_ids().begin(), resp.token_ids().end());
    finish = resp.finish_reason();
    usage = resp.usage();
    timings = resp.timings();
  }
  if (absl::GetFlag(FLAGS_show_ids)) {
    std::fprintf(stderr, "ids:");
    for (int32_t id : ids) std::fprintf(stderr, " %d", id);
    std::fprintf(stderr, "\n");
  }
  std::fprintf(stderr,
               "[finish: %s, prompt %d + %d tokens, queue %.3f s, first token %.3f s, total "
               "%.3f s]\n",
               FinishName(finish), usage.prompt_tokens(), usage.completion_tokens(),
               timings.queue_seconds(), timings.time_to_first_token_seconds(),
               timings.total_seconds());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::SetProgramUsage(kUsage);
  std::vector<char*> args = tandem::ParseFlags(argc, argv);
  if (args.size() != 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string command = args[1];
  const std::string api_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_api_key), "TANDEM_API_KEY");
  std::string admin_key = tandem::FlagOrEnv(absl::GetFlag(FLAGS_admin_key), "TANDEM_ADMIN_KEY");
  if (admin_key.empty()) admin_key = api_key;
  const tandem::TlsFiles tls = tandem::TlsFilesFromFlags();
  absl::StatusOr<tandem::ClientAuth> inference_auth = tandem::MakeClientAuth(tls, api_key);
  absl::StatusOr<tandem::ClientAuth> admin_auth = tandem::MakeClientAuth(tls, admin_key);
  if (!inference_auth.ok() || !admin_auth.ok()) {
    std::fprintf(stderr, "error: %s\n",
                 std::string((inference_auth.ok() ? admin_auth : inference_auth).status().message())
                     .c_str());
    return 2;
  }
  auto channel = tandem::MakeChannel(absl::GetFlag(FLAGS_addr), *inference_auth);
  if (command == "generate") return Generate(channel);
  auto admin =
      tandem::v1::Admin::NewStub(tandem::MakeChannel(absl::GetFlag(FLAGS_addr), *admin_auth));
  grpc::ClientContext ctx;
  grpc::Status s;
  std::string out;
  if (command == "info") {
    tandem::v1::ModelInfo info;
    s = tandem::v1::Inference::NewStub(channel)->GetModelInfo(&ctx, {}, &info);
    out = info.DebugString();
  } else if (command == "topology") {
    tandem::v1::Topology t;
    s = admin->GetTopology(&ctx, {}, &t);
    out = t.DebugString();
  } else if (command == "workers") {
    tandem::v1::ListWorkersResponse w;
    s = admin->ListWorkers(&ctx, {}, &w);
    out = w.DebugString();
  } else if (command == "drain") {
    tandem::v1::DrainRequest req;
    req.set_worker_id(absl::GetFlag(FLAGS_worker_id));
    tandem::v1::Topology t;
    s = admin->Drain(&ctx, req, &t);
    out = t.DebugString();
  } else if (command == "undrain") {
    tandem::v1::UndrainRequest req;
    req.set_worker_id(absl::GetFlag(FLAGS_worker_id));
    tandem::v1::Topology t;
    s = admin->Undrain(&ctx, req, &t);
    out = t.DebugString();
  } else if (command == "set-topology") {
    tandem::v1::SetTopologyRequest req;
    req.set_stages(absl::GetFlag(FLAGS_stages));
    req.set_replicas(absl::GetFlag(FLAGS_replicas));
    if (auto p = absl::GetFlag(FLAGS_prefill_replicas)) req.set_prefill_replicas(*p);
    if (auto t = absl::GetFlag(FLAGS_tensor_parallel)) req.set_tensor_parallel(*t);
    tandem::v1::Topology t;
    s = admin->SetTopology(&ctx, req, &t);
    out = t.DebugString();
  } else {
    std::fprintf(stderr, "unknown command '%s'\n%s", command.c_str(), kUsage);
    return 2;
  }
  if (!s.ok()) return Fail(s);
  std::fputs(out.c_str(), stdout);
  return 0;
}
