// tandem-pipeline-bench: a model split into N pipeline stages, one process and one GPU per stage,
// activations between neighbouring stages over NcclTransport; or, with --single, the whole model
// in one process on one GPU for the same prompts. No coordinator: the last stage returns each
// step's tokens to the first over the same communicator. Every step runs through the worker's
// StepRunner (worker/service/step_runner.h), as in tandem-worker.
//
// For each batch size: prefill `--prompt` random tokens per sequence (the same prompts in every
// mode), then greedy decode until `--new_tokens` tokens per sequence; a warm-up round (graph
// capture, first connections) precedes the measured one. Every process prints its figures and
// writes them with the generated tokens to --json. With --reference SINGLE.json, rank 0 checks
// that its tokens equal the single-stage run's and reports the step-time overhead of the hops
// (exit code 3 when any token differs).
//
// usage, N processes:  tandem-pipeline-bench --model DIR --world N --rank R --id_file PATH
//                        [--device R] [--batch 1,8,64] [--prompt 128] [--new_tokens 128]
//                        [--json OUT.json] [--reference SINGLE.json]
//                        [--stage_stream=false] [--device_send=false]
//        one process:  tandem-pipeline-bench --model DIR --single [--device 0] [--json OUT.json]
//                        [--split_local]
//        either:       [--profile] (each stage's decode steps timed on the device too)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "bench/decode_profile.h"
#include "common/flags_usage.h"
#include "common/model_config.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/cuda/cuda_stage.h"
#include "worker/service/step_runner.h"
#include "worker/transport/nccl_transport.h"

ABSL_FLAG(std::string, model, "", "checkpoint folder (config.json + safetensors)");
ABSL_FLAG(bool, single, false, "run the whole model in this one process (no NCCL)");
ABSL_FLAG(int, rank, 0, "this process's stage index");
ABSL_FLAG(int, world, 2, "stages (processes) in the pipeline");
ABSL_FLAG(std::string, id_file, "",
          "shared path: rank 0 writes the NCCL unique id there, the others read it");
ABSL_FLAG(int, device, -1, "CUDA device; -1: the rank (0 with --single)");
ABSL_FLAG(std::string, batch, "1,8,64", "comma-separated batch sizes");
ABSL_FLAG(int, prompt, 128, "prompt tokens per sequence");
ABSL_FLAG(int, new_tokens, 128, "generated tokens per sequence (the first comes from prefill)");
ABSL_FLAG(std::string, dtype, "f16", "f16 or bf16");
ABSL_FLAG(bool, graphs, true, "replay decode steps from CUDA graphs");
ABSL_FLAG(double, kv_memory_fraction, 0.5, "share of free GPU memory for the KV-cache");
ABSL_FLAG(int, timeout_s, 180, "seconds to wait for the id file, joining, and each transfer");
ABSL_FLAG(std::string, json, "", "write figures and tokens as JSON to this file");
ABSL_FLAG(bool, split_local, false,
          "with --single: the model as two stages in this process on the one GPU, the first's "
          "device output handed to the second (the cost of the split itself, without a hop)");
ABSL_FLAG(bool, stage_stream, true,
          "queue the transport's copies and NCCL operations on the stage's own stream "
          "(NcclTransportOptions::stream); false: on streams of the transport's own");
ABSL_FLAG(bool, device_send, true,
          "with --stage_stream: each decode step's send (activations, or the last stage's tokens) "
          "is queued behind its forward pass on the device (Stage::SetDecodeTail); false: sent "
          "once the host has seen the step finish");
ABSL_FLAG(bool, profile, false,
          "time each decode step of each stage on the device too (bench/decode_profile.h)");
ABSL_FLAG(std::string, reference, "",
          "single-stage JSON: rank 0 compares tokens and step times against it");

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

absl::StatusOr<std::vector<int>> ParseBatches(const std::string& flag) {
  std::vector<int> batches;
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    int b = 0;
    if (!absl::SimpleAtoi(part, &b) || b < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--batch: bad batch size '", part, "'"));
    }
    batches.push_back(b);
  }
  return batches;
}

// Rank 0 writes the id (to a temporary name, then renamed, so that a reader never sees half);
// the others wait for the file.
absl::StatusOr<std::string> ShareUniqueId(int rank, const std::string& path, int timeout_s) {
  if (path.empty()) return absl::InvalidArgumentError("--id_file is required with --world > 1");
  if (rank == 0) {
    ASSIGN_OR_RETURN(std::string id, MakeNcclUniqueId());
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(id.data(), static_cast<std::streamsize>(id.size()));
      if (!f) return absl::InternalError("cannot write " + tmp);
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
    return id;
  }
  const auto deadline = Clock::now() + std::chrono::seconds(timeout_s);
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::string id((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (id.size() == kNcclUniqueIdBytes) return id;
    }
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no NCCL unique id in ", path, " after ",
                                                      timeout_s, " s; did rank 0 start?"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

struct BatchResult {
  int batch = 0;
  double prefill_ms = 0, decode_ms_step = 0, decode_tok_s = 0, e2e_tok_s = 0;
  double step_ms = 0, send_ms = 0, recv_ms = 0;  // this rank's decode time in each part
  std::vector<CudaDecodeProfile> profiles;       // --profile: per stage of this process
  std::vector<std::vector<int32_t>> tokens;      // [sequence][generated token]
};

// --split_local: the first half's device output handed to the second half in this process.
class HandOff final : public ActivationTransport {
 public:
  absl::Status Send(uint64_t, const Activations& activations) override {
    held_ = activations;
    return absl::OkStatus();
  }
  absl::StatusOr<Activations> Recv(uint64_t, const std::function<bool()>&) override {
    return std::exchange(held_, Activations{});
  }

 private:
  Activations held_;
};

// One process's part of the pipeline (or all of it): its stages' StepRunners, run in turn.
class Runner {
 public:
  explicit Runner(std::vector<std::unique_ptr<StepRunner>> runners)
      : runners_(std::move(runners)) {}

  // Runs one step on this rank; rank 0 (or --single) returns the step's tokens.
  absl::StatusOr<std::vector<int32_t>> Step(StepDescriptor& step, BatchResult* r) {
    step.id = next_id_++;
    const auto none = [] { return false; };
    std::vector<int32_t> tokens;
    StepTimes sum;
    for (std::unique_ptr<StepRunner>& runner : runners_) {
      ASSIGN_OR_RETURN(StepRun run, runner->Run(step, none));
      if (!run.tokens.empty()) tokens = std::move(run.tokens);
      if (&runner == &runners_.front()) sum.recv = run.times.recv;
      sum.compute += run.times.compute;
      if (&runner == &runners_.back()) sum.send = run.times.send;
    }
    if (r != nullptr) {
      r->recv_ms += absl::ToDoubleMilliseconds(sum.recv);
      r->step_ms += absl::ToDoubleMilliseconds(sum.compute);
      r->send_ms += absl::ToDoubleMilliseconds(sum.send);
    }
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<StepRunner>> runners_;
  uint64_t next_id_ = 1;
};

absl::StatusOr<BatchResult> RunBatch(Runner& runner, const ModelConfig& c, int batch, int prompt,
                                     int steps, int round, int rank) {
  BatchResult r;
  r.batch = batch;
  r.tokens.assign(batch, {});
  StepDescriptor pre;
  for (int b = 0; b < batch; ++b) {
    SequenceStep s;
    s.slot = b;
    s.num_tokens = prompt;
    pre.seqs.push_back(s);
    for (int t = 0; t < prompt; ++t) {
      pre.tokens.push_back(static_cast<int32_t>(
          RandomBits(static_cast<uint64_t>(round) * 1000003 + batch * 7919 + b, t) % c.vocab_size));
    }
  }
  if (rank != 0) pre.tokens.clear();  // only the first stage reads tokens
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(std::vector<int32_t> last, runner.Step(pre, nullptr));
  const auto t1 = Clock::now();
  for (int b = 0; b < batch && rank == 0; ++b) r.tokens[b].push_back(last[b]);
  const int decode_steps = round == 0 ? std::min(steps - 1, 3) : steps - 1;
  for (int i = 0; i < decode_steps; ++i) {
    StepDescriptor step;
    for (int b = 0; b < batch; ++b) {
      SequenceStep s;
      s.slot = b;
      s.position = prompt + i;
      s.sample_index = i + 1;
      step.seqs.push_back(s);
    }
    if (rank == 0) step.tokens = last;
    ASSIGN_OR_RETURN(std::vector<int32_t> next, runner.Step(step, &r));
    if (rank == 0) {
      if (static_cast<int>(next.size()) != batch) {
        return absl::InternalError(absl::StrCat("decode step ", i, " returned ", next.size(),
                                                " tokens for a batch of ", batch));
      }
      for (int b = 0; b < batch; ++b) r.tokens[b].push_back(next[b]);
      last = std::move(next);
    }
  }
  const auto t2 = Clock::now();
  r.prefill_ms = Ms(t0, t1);
  const int n = std::max(decode_steps, 1);
  r.decode_ms_step = Ms(t1, t2) / n;
  r.decode_tok_s = decode_steps > 0 ? batch * decode_steps / (Ms(t1, t2) * 1e-3) : 0;
  r.e2e_tok_s = batch * (decode_steps + 1) / (Ms(t0, t2) * 1e-3);
  r.step_ms /= n;
  r.send_ms /= n;
  r.recv_ms /= n;
  if (rank != 0) r.tokens.clear();
  return r;
}

// Compares rank 0's tokens and step times with the single-stage run's JSON.
absl::StatusOr<bool> Compare(const std::string& path, std::vector<BatchResult>& results,
                             nlohmann::json& out) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError("cannot read --reference " + path);
  nlohmann::json ref;
  try {
    ref = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  bool all_same = true;
  try {
    for (const BatchResult& r : results) {
      const nlohmann::json* match = nullptr;
      for (const auto& e : ref.at("results")) {
        if (e.at("batch").get<int>() == r.batch) match = &e;
      }
      if (match == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(path, " has no result for batch ", r.batch));
      }
      const auto want = match->at("tokens").get<std::vector<std::vector<int32_t>>>();
      int differing = 0;
      for (size_t b = 0; b < r.tokens.size(); ++b) {
        if (b >= want.size() || want[b] != r.tokens[b]) ++differing;
      }
      if (want.size() != r.tokens.size()) differing = std::max<int>(differing, 1);
      const double ref_ms = match->at("decode_ms_per_step").get<double>();
      const double overhead = 100.0 * (r.decode_ms_step / ref_ms - 1.0);
      all_same = all_same && differing == 0;
      out.push_back({{"batch", r.batch},
                     {"tokens_identical", differing == 0},
                     {"sequences_differing", differing},
                     {"single_decode_ms_per_step", ref_ms},
                     {"pipeline_decode_ms_per_step", r.decode_ms_step},
                     {"hop_overhead_percent", overhead},
                     {"hop_overhead_ms", r.decode_ms_step - ref_ms}});
      std::printf(
          "batch %d: tokens %s (%d of %zu sequences differ), step %.3f ms vs %.3f ms "
          "single: %+.2f%% (%+.1f us)\n",
          r.batch, differing == 0 ? "identical" : "DIFFER", differing, r.tokens.size(),
          r.decode_ms_step, ref_ms, overhead, (r.decode_ms_step - ref_ms) * 1e3);
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return all_same;
}

// The step runners of this process: the two halves of --split_local handing off through
// `hand_off` (when `second` is set), else this rank's stage over `transport`.
absl::StatusOr<std::vector<std::unique_ptr<StepRunner>>> MakeRunners(Stage& stage, Stage* second,
                                                                     HandOff* hand_off,
                                                                     NcclTransport* transport,
                                                                     int rank, int world,
                                                                     bool device_send) {
  std::vector<std::unique_ptr<StepRunner>> runners;
  if (second != nullptr) {
    for (int half = 0; half < 2; ++half) {
      StepRunnerOptions o;
      o.stage = half;
      o.num_stages = 2;
      o.host_link = false;
      ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> r,
                       StepRunner::Create(half == 0 ? stage : *second, hand_off, o));
      runners.push_back(std::move(r));
    }
    return runners;
  }
  StepRunnerOptions o;
  o.stage = rank;
  o.num_stages = world;
  o.tokens_to_first = true;  // no coordinator: the last rank returns the tokens to rank 0
  o.host_link = false;
  o.device_sends = device_send;
  ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> r, StepRunner::Create(stage, transport, o));
  runners.push_back(std::move(r));
  return runners;
}

// The results as a Markdown table on stdout, and with --profile the decode profile of each stage
// (numbered by rank, or by half with --split_local).
void PrintTable(const std::vector<BatchResult>& results, bool split_local, int rank, bool profile) {
  std::printf(
      "| batch | prefill ms | decode ms/step | decode tok/s | end-to-end tok/s | "
      "recv ms/step | compute ms/step | send (+ tokens back) ms/step |\n"
      "|---|---|---|---|---|---|---|---|\n");
  for (const BatchResult& r : results) {
    std::printf("| %d | %.2f | %.3f | %.0f | %.0f | %.3f | %.3f | %.3f |\n", r.batch, r.prefill_ms,
                r.decode_ms_step, r.decode_tok_s, r.e2e_tok_s, r.recv_ms, r.step_ms, r.send_ms);
  }
  if (profile) {
    std::vector<DecodeProfileRow> rows;
    for (const BatchResult& r : results) {
      for (size_t i = 0; i < r.profiles.size(); ++i) {
        rows.push_back({r.batch, split_local ? static_cast<int>(i) : rank, r.profiles[i]});
      }
    }
    std::printf("\n%s", DecodeProfileTable(rows).c_str());
  }
}

// Each batch's figures and tokens, with its stages' decode profiles.
nlohmann::json ResultsJson(const std::vector<BatchResult>& results) {
  nlohmann::json out = nlohmann::json::array();
  for (const BatchResult& r : results) {
    out.push_back({{"batch", r.batch},
                   {"prefill_ms", r.prefill_ms},
                   {"decode_ms_per_step", r.decode_ms_step},
                   {"decode_tok_s", r.decode_tok_s},
                   {"end_to_end_tok_s", r.e2e_tok_s},
                   {"recv_ms_per_step", r.recv_ms},
                   {"compute_ms_per_step", r.step_ms},
                   {"send_ms_per_step", r.send_ms},
                   {"tokens", r.tokens}});
    for (const CudaDecodeProfile& p : r.profiles) {
      const DecodeStepTimes t = PerStep(p);
      out.back()["profile"].push_back({{"device_ms", t.device_ms},
                                       {"forward_ms", t.forward_ms},
                                       {"idle_us", t.idle_us},
                                       {"host_ms", t.host_ms},
                                       {"host_to_launch_us", t.host_to_launch_us},
                                       {"to_first_layer_us", t.to_first_layer_us},
                                       {"first_layer_us", t.first_layer_us},
                                       {"middle_layer_us", t.middle_layer_us},
                                       {"last_layer_us", t.last_layer_us},
                                       {"after_layers_us", t.after_layers_us}});
    }
  }
  return out;
}

// This rank's NCCL transport of options `to` and unique id `id`; with `stage`, on that stage's
// stream, whose waits then watch the transport (Stage::SetStreamWatch).
absl::StatusOr<std::unique_ptr<NcclTransport>> JoinTransport(NcclTransportOptions to,
                                                             const std::string& id, Stage* stage) {
  if (stage != nullptr) {
    ASSIGN_OR_RETURN(to.stream, stage->DeviceStream());
  }
  ASSIGN_OR_RETURN(std::unique_ptr<NcclTransport> transport, NcclTransport::Create(to, id));
  if (stage != nullptr) {
    NcclTransport* t = transport.get();
    RETURN_IF_ERROR(stage->SetStreamWatch([t] { return t->Watch(); }));
  }
  return transport;
}

// With --reference (rank 0): the tokens against the single-stage run's, into `j`; then `j` to
// --json. The exit code: 3 when any token differs, else 0.
absl::StatusOr<int> CompareAndWrite(nlohmann::json& j, std::vector<BatchResult>& results,
                                    int rank) {
  int code = 0;
  const std::string ref = absl::GetFlag(FLAGS_reference);
  if (!ref.empty() && rank == 0) {
    nlohmann::json cmp = nlohmann::json::array();
    ASSIGN_OR_RETURN(bool same, Compare(ref, results, cmp));
    j["comparison"] = cmp;
    j["tokens_identical"] = same;
    if (!same) code = 3;
  }
  const std::string json_path = absl::GetFlag(FLAGS_json);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << j.dump(1) << "\n";
    if (!f) return absl::InternalError("cannot write " + json_path);
  }
  return code;
}

// What the flags ask for, checked.
struct Plan {
  std::string model;
  bool single = false;
  int world = 1, rank = 0, device = 0, timeout_s = 0;
  ModelConfig c;
  DType dtype = DType::kF16;
  std::vector<int> batches;
  int prompt = 0, new_tokens = 0, max_batch = 0;
};

absl::StatusOr<Plan> ReadPlan() {
  Plan p;
  p.model = absl::GetFlag(FLAGS_model);
  p.single = absl::GetFlag(FLAGS_single);
  p.world = p.single ? 1 : absl::GetFlag(FLAGS_world);
  p.rank = p.single ? 0 : absl::GetFlag(FLAGS_rank);
  p.device = absl::GetFlag(FLAGS_device);
  if (p.device < 0) p.device = p.rank;
  p.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (p.world < 1 || p.rank < 0 || p.rank >= p.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", p.rank, " must be in [0, --world ", p.world, ")"));
  }
  ASSIGN_OR_RETURN(p.c, LoadModelConfig(p.model));
  if (p.world > p.c.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world ", p.world, " exceeds the model's ", p.c.num_layers, " layers"));
  }
  ASSIGN_OR_RETURN(p.dtype, ParseHalfDTypeFlag(absl::GetFlag(FLAGS_dtype), "--dtype"));
  ASSIGN_OR_RETURN(p.batches, ParseBatches(absl::GetFlag(FLAGS_batch)));
  p.prompt = absl::GetFlag(FLAGS_prompt);
  p.new_tokens = absl::GetFlag(FLAGS_new_tokens);
  if (p.prompt < 1 || p.new_tokens < 1) {
    return absl::InvalidArgumentError("--prompt and --new_tokens must be >= 1");
  }
  p.max_batch = *std::max_element(p.batches.begin(), p.batches.end());
  return p;
}

// This rank's stage (and with --split_local the second half of the model in the same process),
// each watched by its profiler with --profile.
struct LoadedStages {
  StageSpec spec;
  std::unique_ptr<Stage> stage, second;
  double load_s = 0;
};

absl::StatusOr<LoadedStages> LoadStages(const Plan& p, bool split_local,
                                        std::unique_ptr<DecodeProfiler> (&profilers)[2]) {
  LoadedStages l;
  StageSpec& spec = l.spec;
  spec.model_dir = p.model;
  spec.first_layer = p.c.num_layers * p.rank / p.world;
  spec.last_layer =
      p.rank == p.world - 1 ? p.c.num_layers : p.c.num_layers * (p.rank + 1) / p.world;
  if (split_local) spec.last_layer = p.c.num_layers / 2;
  spec.max_slots = p.max_batch;
  spec.max_seq_len = std::min(p.c.max_positions, p.prompt + p.new_tokens);
  CudaOptions opt;
  opt.device = p.device;
  opt.dtype = p.dtype;
  opt.cuda_graphs = absl::GetFlag(FLAGS_graphs);
  opt.kv_memory_fraction = static_cast<float>(absl::GetFlag(FLAGS_kv_memory_fraction));
  const auto t_load = Clock::now();
  ASSIGN_OR_RETURN(l.stage, MakeCudaStage(spec, opt));
  if (split_local) {
    StageSpec rest = spec;
    rest.first_layer = spec.last_layer;
    rest.last_layer = p.c.num_layers;
    ASSIGN_OR_RETURN(l.second, MakeCudaStage(rest, opt));
  }
  l.load_s = Ms(t_load, Clock::now()) * 1e-3;
  for (int i = 0; i < 2; ++i) {
    Stage* s = i == 0 ? l.stage.get() : l.second.get();
    if (profilers[i] != nullptr && s != nullptr) {
      RETURN_IF_ERROR(s->SetDecodeObserver(profilers[i].get()));
    }
  }
  return l;
}

// The run's settings and results as --json writes them.
nlohmann::json RunJson(const Plan& p, const LoadedStages& l, const std::string& device_name,
                       int steps, double join_s, bool stage_stream, bool device_send,
                       bool split_local, const std::vector<BatchResult>& results) {
  nlohmann::json j;
  j["mode"] = p.single ? "single" : "pipeline";
  j["rank"] = p.rank;
  j["world"] = p.world;
  j["model"] = p.model;
  j["dtype"] = std::string(DTypeName(p.dtype));
  j["device"] = device_name;
  j["layers"] = {l.spec.first_layer, l.spec.last_layer};
  j["prompt"] = p.prompt;
  j["new_tokens"] = steps;
  j["load_seconds"] = l.load_s;
  j["join_seconds"] = join_s;
  j["stage_stream"] = stage_stream;
  j["device_send"] = device_send;
  j["split_local"] = split_local;
  j["results"] = ResultsJson(results);
  return j;
}

absl::StatusOr<int> Run() {
  ASSIGN_OR_RETURN(const Plan p, ReadPlan());
  // The id first, so that every rank loads its weights while rank 0's bootstrap root waits.
  std::string id;
  if (p.world > 1) {
    ASSIGN_OR_RETURN(id, ShareUniqueId(p.rank, absl::GetFlag(FLAGS_id_file), p.timeout_s));
  }
  const bool split_local = p.single && absl::GetFlag(FLAGS_split_local);
  const bool profile = absl::GetFlag(FLAGS_profile);
  // --profile: one profiler per stage of this process, outliving the stages.
  std::unique_ptr<DecodeProfiler> profilers[2];
  for (int i = 0; profile && i < 2; ++i) {
    ASSIGN_OR_RETURN(profilers[i], DecodeProfiler::Create());
  }
  ASSIGN_OR_RETURN(LoadedStages l, LoadStages(p, split_local, profilers));

  std::unique_ptr<NcclTransport> transport;
  double join_s = 0;
  // Sending from behind the forward pass needs the transport on the stage's stream.
  const bool stage_stream = p.world > 1 && absl::GetFlag(FLAGS_stage_stream);
  const bool device_send = stage_stream && absl::GetFlag(FLAGS_device_send);
  if (p.world > 1) {
    NcclTransportOptions to;
    to.device = p.device;
    to.rank = p.rank;
    to.world = p.world;
    to.hidden_size = p.c.hidden_size;
    to.dtype = p.dtype;
    to.max_rows = static_cast<int64_t>(p.max_batch) * p.prompt;
    to.timeout = absl::Seconds(p.timeout_s);
    const auto t_join = Clock::now();
    ASSIGN_OR_RETURN(transport, JoinTransport(to, id, stage_stream ? l.stage.get() : nullptr));
    join_s = Ms(t_join, Clock::now()) * 1e-3;
  }

  const int steps = std::min(p.new_tokens, l.spec.max_seq_len - p.prompt + 1);
  HandOff hand_off;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<StepRunner>> runners,
                   MakeRunners(*l.stage, l.second.get(), &hand_off, transport.get(), p.rank,
                               p.world, device_send));
  Runner runner(std::move(runners));
  std::vector<BatchResult> results;
  for (int batch : p.batches) {
    for (int round = 0; round < 2; ++round) {
      ASSIGN_OR_RETURN(BatchResult r, RunBatch(runner, p.c, batch, p.prompt, steps, round, p.rank));
      for (int i = 0; profile && i < 2; ++i) {
        if (i == 0 || l.second != nullptr) r.profiles.push_back(profilers[i]->Take());
      }
      if (round == 1) results.push_back(std::move(r));
    }
  }

  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, p.device);
  std::printf(
      "%s: model %s, layers [%d, %d) of %d, %s, prompt %d, new %d, device %d (%s), "
      "load %.1f s, join %.2f s, transport on %s, decode output sent %s\n",
      p.single ? "single" : absl::StrCat("rank ", p.rank, "/", p.world).c_str(), p.model.c_str(),
      l.spec.first_layer, l.spec.last_layer, p.c.num_layers,
      std::string(DTypeName(p.dtype)).c_str(), p.prompt, steps, p.device, prop.name, l.load_s,
      join_s, stage_stream ? "the stage's stream" : "streams of its own",
      device_send ? "from behind the forward pass" : "after the host saw the step");
  PrintTable(results, split_local, p.rank, profile);
  std::fflush(stdout);
  nlohmann::json j =
      RunJson(p, l, prop.name, steps, join_s, stage_stream, device_send, split_local, results);
  return CompareAndWrite(j, results, p.rank);
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  tandem::SetProgramUsage(
      "tandem-pipeline-bench --model DIR (--single | --rank R --world N --id_file FILE) "
      "[--batch 1,8,64] [--json FILE]");
  tandem::ParseFlags(argc, argv);
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::cerr << "tandem-pipeline-bench: --model DIR is required\n";
    return 2;
  }
  absl::StatusOr<int> code = tandem::Run();
  if (!code.ok()) {
    std::cerr << "tandem-pipeline-bench: " << code.status() << "\n";
    return 1;
  }
  return *code;
}
