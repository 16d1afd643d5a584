// tandem-bench: the CUDA engine's own speed, one stage in-process, no service.
//
// Benchmark: for each prompt length of `--prompt` (a list: one stage loaded per length, its
// KV-cache sized for it) and each batch size, prefill that many tokens per sequence, then decode
// `--new_tokens` tokens greedily; prints the time to first token (the prefill step, median of 3)
// and prefill tokens/s, decode ms/step and tokens/s, the bytes a decode step reads (weights +
// KV-cache) per second against the measured device-to-device copy bandwidth, and the GPU memory
// in use. A prompt + new tokens beyond the model's context is refused. Markdown on stdout, JSON
// with --json.
//
// Logit dump: --dump_logits IN.json OUT.json, IN = {"prompts": [[ids...], ...], "steps": N}; OUT
// holds, per prompt, the last-position logits after prefill ("logits"), N greedy tokens and the
// logits of the decode step that chose the last of them ("final_logits").
//
// Tensor parallelism: --tensor_parallel 1,2 runs every measurement with the stage whole on GPU 0
// and split over GPUs 0 and 1 (worker/cuda/cuda_tensor_parallel.h), one table row per size; the
// GB/s are the bytes of the whole model per second, over all of its GPUs.
//
// Precision agreement: --agreement N runs N seeded prompts (lengths cycling through --prompt)
// through a reference stage in --dtype (fp16/bf16 weights and KV-cache) and a stage in the
// precision --quantization and --kv_cache_dtype ask for, both decoding --new_tokens - 1 steps fed
// the reference's greedy tokens, and compares every position's next-token distribution: KL
// divergence, top-1 agreement, logits error (logit_agreement.h); --json writes them ("agreement":
// every position; "prefill", "decode"), which tandem-loadgen compare shows beside a run's speed
// when it is the run folder's accuracy.json.
//
// CPU load: --cpu_load loads the whole model with the CPU backend (fp32 on the host) instead and
// prints only that load time, for comparison with the CUDA backend's "load".
//
// GEMV sweep: --gemv_sweep times the GEMV kernels alone on the model's decode projections at the
// --batch row counts (1, 2, 4, 8) for every launch shape (gemv_sweep.h); needs only config.json.
//
// usage: tandem-bench --model DIR [--batch 1,8,64] [--prompt 128,2048] [--new_tokens 128]
//        [--dtype f16] [--graphs=true] [--gemv_max_rows 4] [--batch_invariant]
//        [--tensor_parallel 1,2] [--kv_cache_dtype auto|fp8] [--profile] [--json OUT.json]
//        | --model DIR [--dtype f16] --dump_logits IN.json OUT.json
//        | --model DIR --agreement N [--quantization fp8] [--kv_cache_dtype fp8]
//          [--test_dtype bf16] [--prompt 128] [--new_tokens 33] [--json OUT.json]
//        | --model DIR [--dtype f16] [--batch 1,2,4] --gemv_sweep [--json OUT.json]
//        | --model DIR --cpu_load
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/decode_profile.h"
#include "bench/gemv_sweep.h"
#include "bench/logit_agreement.h"
#include "common/flags_usage.h"
#include "common/model_config.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/context_fit.h"
#include "worker/cpu/cpu_stage.h"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/cuda_stage.h"
#include "worker/cuda/cuda_tensor_parallel.h"

ABSL_FLAG(std::string, model, "", "checkpoint folder (config.json + safetensors)");
ABSL_FLAG(std::string, batch, "1,64", "comma-separated batch sizes");
ABSL_FLAG(std::string, prompt, "128", "comma-separated prompt lengths (tokens per sequence)");
ABSL_FLAG(int, new_tokens, 128, "generated tokens per sequence (the first comes from prefill)");
ABSL_FLAG(std::string, dtype, "f16", "f16 or bf16");
ABSL_FLAG(std::string, quantization, "",
          "fp8: the linear layers' weights quantized to FP8 (E4M3, per output channel) at load; "
          "empty: as the checkpoint stores them (FP8 checkpoints run in FP8)");
ABSL_FLAG(std::string, tensor_parallel, "1",
          "comma-separated tensor-parallel sizes: each measurement with the stage over GPUs "
          "0..N-1");
ABSL_FLAG(bool, graphs, true, "replay decode steps from CUDA graphs");
ABSL_FLAG(int, gemv_max_rows, tandem::CudaOptions{}.gemv_max_rows,
          "decode passes of at most this many rows use the GEMV kernels (0: cuBLAS throughout)");
ABSL_FLAG(bool, gemv_sweep, false,
          "time the GEMV kernels alone on the model's projections for every launch shape");
ABSL_FLAG(bool, batch_invariant, false,
          "results independent of the batch: pinned GEMM algorithms, no GEMV, unsplit attention "
          "(CudaOptions::batch_invariant)");
ABSL_FLAG(bool, profile, false,
          "time each decode step on the device too (bench/decode_profile.h): device time, "
          "forward pass, device idle between steps, host time to launch");
ABSL_FLAG(bool, cpu_load, false,
          "load the model with the CPU backend instead and print only its load time");
ABSL_FLAG(std::string, kv_page_size, "16",
          "comma-separated KV page sizes (16, the service's default): 0 for contiguous slots, a "
          "power of two >= 4 for a paged cache whose sequences hold interleaved pages (e.g. 0,16 "
          "measures both in one call)");
ABSL_FLAG(double, kv_memory_fraction, 0.9, "share of free GPU memory for the KV-cache");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "the KV-cache's element type: auto (--dtype) or fp8 (= fp8_e4m3: E4M3 codes over the "
          "checkpoint's per-layer k_scale/v_scale, else 1; needs --kv_page_size > 0)");
ABSL_FLAG(int, agreement, 0,
          "N > 0: compare the next-token distributions of N prompts in the precision that "
          "--quantization and --kv_cache_dtype ask for against --dtype's (KL, top-1 agreement)");
ABSL_FLAG(std::string, test_dtype, "",
          "with --agreement: the compared stage's activation and weight dtype (f16 or bf16; "
          "default --dtype), e.g. bf16 against f16 as a scale for FP8's figures");
ABSL_FLAG(std::string, json, "", "write the results as JSON to this file");
ABSL_FLAG(std::string, dump_logits, "",
          "IN.json: dump prefill logits and greedy tokens of its prompts to the next argument");

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB cudaMemcpy.
absl::StatusOr<double> CopyBandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    cudaFree(a);
    cudaGetLastError();
    return absl::ResourceExhaustedError("no room for the 2 GiB copy-bandwidth test");
  }
  cudaMemset(a, 1, bytes);
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int reps = 10;
  cudaEventRecord(e0);
  for (int i = 0; i < reps; ++i) cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes * reps / (ms * 1e-3);
}

// Bytes of weights one decode step reads: every layer's matrices and norms, the final norm and
// the LM head (embedding rows are negligible).
// `linear_elem`: bytes per element of the layers' linear weights (1 for FP8), `elem` of the rest.
double WeightBytesPerStep(const ModelConfig& c, size_t elem, size_t linear_elem) {
  const double h = c.hidden_size, inter = c.intermediate_size;
  const double qkv = (c.q_dim() + 2.0 * c.kv_dim()) * h, o = h * c.q_dim();
  const double mlp = c.arch == Arch::kLlama ? 3 * h * inter : 2 * h * inter;
  const double linear = (qkv + o + mlp) * linear_elem;
  return c.num_layers * (linear + 4 * h * elem) +
         (static_cast<double>(c.vocab_size) * h + 2 * h) * elem;
}

struct BatchResult {
  int tp, batch, prompt, page_size;
  double prefill_s, prefill_tok_s, decode_ms_step, decode_tok_s, e2e_tok_s, gb_s;
  CudaDecodeProfile profile;  // --profile: the measured decode steps
};

// A paged cache's pages as the benchmark deals them: page j of sequence b is j * max_slots + b,
// so that every sequence's pages are interleaved with the others' (as an owner handing out pages
// to sequences growing side by side does).
void AttachTable(SequenceStep& s, int page_size, int max_slots) {
  if (page_size == 0) return;
  const int pages = (s.position + s.num_tokens + page_size - 1) / page_size;
  s.block_table.resize(pages);
  for (int j = 0; j < pages; ++j) s.block_table[j] = j * max_slots + s.slot;
}

StepDescriptor PrefillStep(int batch, int prompt, const ModelConfig& c, uint64_t round,
                           int page_size, int max_slots) {
  StepDescriptor step;
  for (int b = 0; b < batch; ++b) {
    SequenceStep s;
    s.slot = b;
    s.position = 0;
    s.num_tokens = prompt;
    AttachTable(s, page_size, max_slots);
    step.seqs.push_back(s);
    for (int t = 0; t < prompt; ++t) {
      step.tokens.push_back(
          static_cast<int32_t>(RandomBits(round * 1000003 + b, t) % c.vocab_size));
    }
  }
  return step;
}

absl::StatusOr<std::vector<int>> BatchSizes() {
  std::vector<int> batches;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_batch), ',')) {
    int b = 0;
    if (!absl::SimpleAtoi(part, &b) || b < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--batch: bad batch size '", part, "'"));
    }
    batches.push_back(b);
  }
  return batches;
}

absl::StatusOr<std::vector<int>> PageSizes() {
  std::vector<int> sizes;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_kv_page_size), ',')) {
    int p = 0;
    if (!absl::SimpleAtoi(part, &p) || p < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_page_size: bad page size '", part, "' (0 for contiguous slots)"));
    }
    sizes.push_back(p);
  }
  return sizes;
}

absl::StatusOr<std::vector<int>> PromptLengths() {
  std::vector<int> prompts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_prompt), ',')) {
    int p = 0;
    if (!absl::SimpleAtoi(part, &p) || p < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--prompt: bad prompt length '", part, "'"));
    }
    prompts.push_back(p);
  }
  return prompts;
}

// The CUDA stage's options from the flags (--graphs, --gemv_max_rows, --batch_invariant).
CudaOptions OptionsFromFlags(DType dtype) {
  CudaOptions opt;
  opt.dtype = dtype;
  opt.cuda_graphs = absl::GetFlag(FLAGS_graphs);
  opt.gemv_max_rows = absl::GetFlag(FLAGS_gemv_max_rows);
  opt.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  return opt;
}

// --quantization and --kv_cache_dtype into `spec` (FP8 weights quantized at load, an FP8
// KV-cache), checked against the page sizes the stages will have; returns the KV-cache dtype.
absl::StatusOr<KvCacheDType> ApplyPrecisionFlags(StageSpec& spec, const std::vector<int>& pages) {
  const std::string quantization = absl::GetFlag(FLAGS_quantization);
  if (!quantization.empty() && quantization != "fp8") {
    return absl::InvalidArgumentError(
        absl::StrCat("--quantization: '", quantization, "' (expected fp8, or empty for none)"));
  }
  spec.quantize_fp8 = quantization == "fp8";
  ASSIGN_OR_RETURN(const KvCacheDType kv_cache_dtype,
                   ParseKvCacheDType(absl::GetFlag(FLAGS_kv_cache_dtype), "--kv_cache_dtype"));
  spec.kv_cache_fp8 = kv_cache_dtype == KvCacheDType::kFp8E4M3;
  if (spec.kv_cache_fp8 && std::count(pages.begin(), pages.end(), 0) > 0) {
    return absl::InvalidArgumentError(
        "--kv_cache_dtype fp8 needs the paged KV-cache: --kv_page_size 0 (contiguous slots) "
        "cannot hold it");
  }
  return kv_cache_dtype;
}

absl::Status GemvSweep() {
  const std::string model = absl::GetFlag(FLAGS_model);
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(model));
  ASSIGN_OR_RETURN(DType dtype, ParseHalfDTypeFlag(absl::GetFlag(FLAGS_dtype), "--dtype"));
  ASSIGN_OR_RETURN(std::vector<int> rows, BatchSizes());
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string quantization = absl::GetFlag(FLAGS_quantization);
  if (!quantization.empty() && quantization != "fp8") {
    return absl::InvalidArgumentError(
        absl::StrCat("--quantization: '", quantization, "' (expected fp8, or empty for none)"));
  }
  const bool fp8 = quantization == "fp8";
  std::printf("GEMV sweep: model %s (%s, hidden %d), %s%s, device %s\n\n", model.c_str(),
              std::string(ArchName(c.arch)).c_str(), c.hidden_size,
              std::string(DTypeName(dtype)).c_str(), fp8 ? ", FP8 weights" : "", prop.name);
  return RunGemvSweep(c, dtype, fp8, rows, absl::GetFlag(FLAGS_json));
}

// One batch size on a loaded stage: round 0 warms up (cuBLAS heuristics, graph capture of the
// bucket), round 1 is measured; the prefill step three times, timed by its median, then `steps`
// - 1 greedy decode steps.
absl::StatusOr<BatchResult> MeasureBatch(Stage& stage, const ModelConfig& c, int batch, int prompt,
                                         int steps, int page_size, int max_slots,
                                         double weight_bytes, double kv_token_bytes,
                                         DecodeProfiler* profiler) {
  BatchResult r{1, batch, prompt, page_size, 0, 0, 0, 0, 0, 0, {}};
  for (int round = 0; round < 2; ++round) {
    StepDescriptor pre = PrefillStep(batch, prompt, c, round, page_size, max_slots);
    // The prefill step three times (it rewrites the same positions), timed by its median.
    std::vector<double> prefill_s;
    StepOutput out;
    auto t0 = Clock::now(), t1 = t0;
    for (int rep = 0; rep < (round == 1 ? 3 : 1); ++rep) {
      t0 = Clock::now();
      ASSIGN_OR_RETURN(out, stage.Step(pre, Activations{}));
      t1 = Clock::now();
      prefill_s.push_back(Seconds(t0, t1));
    }
    std::sort(prefill_s.begin(), prefill_s.end());
    std::vector<int32_t> last = out.tokens;
    if (profiler) profiler->Take();
    double kv_bytes = 0;
    const int decode_steps = round == 0 ? std::min(steps - 1, 3) : steps - 1;
    for (int i = 0; i < decode_steps; ++i) {
      StepDescriptor step;
      step.id = i + 1;
      for (int b = 0; b < batch; ++b) {
        SequenceStep s;
        s.slot = b;
        s.position = prompt + i;
        s.num_tokens = 1;
        s.sample_index = i + 1;
        AttachTable(s, page_size, max_slots);
        step.seqs.push_back(s);
        kv_bytes += (prompt + i + 1) * kv_token_bytes;
      }
      step.tokens = last;
      ASSIGN_OR_RETURN(StepOutput o, stage.Step(step, Activations{}));
      last = std::move(o.tokens);
    }
    const auto t2 = Clock::now();
    if (round == 1) {
      r.prefill_s = prefill_s[prefill_s.size() / 2];
      r.prefill_tok_s = batch * prompt / r.prefill_s;
      const double decode_s = Seconds(t1, t2);
      const int n = std::max(decode_steps, 1);
      r.decode_ms_step = decode_s / n * 1e3;
      r.decode_tok_s = decode_steps > 0 ? batch * decode_steps / decode_s : 0;
      r.e2e_tok_s = batch * steps / Seconds(t0, t2);
      r.gb_s = decode_steps > 0
                   ? (weight_bytes * decode_steps + kv_bytes) / decode_s / 1e9
                   : 0;
      if (profiler) {
        r.profile = profiler->Take();
      }
    }
  }
  return r;
}

// --tensor_parallel: the sizes each run splits the stage over.
absl::StatusOr<std::vector<int>> TensorParallelSizes() {
  std::vector<int> tps;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_tensor_parallel), ',')) {
    int tp = 0;
    if (!absl::SimpleAtoi(part, &tp) || tp < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tensor_parallel: '", part, "' (expected sizes of at least 1, such as 1,2)"));
    }
    tps.push_back(tp);
  }
  return tps;
}

// What a run measured besides its rows: the model, the settings, the device.
struct RunInfo {
  std::string model;
  ModelConfig config;
  DType dtype;
  std::string weights;  // the linear layers' precision, in words
  KvCacheDType kv_cache_dtype;
  std::vector<int> prompts;
  int steps;
  CudaOptions options;
  double copy_bw;        // bytes/s
  bool copy_after_free;  // measured after freeing the stage (reads low)
  size_t used_bytes;     // GPU memory in use
  double weight_bytes;   // per decode step
  double load_s;
  std::string device;
};

// The run's header lines and one table row per measurement (and the profile with --profile).
void PrintReport(const RunInfo& run, const std::vector<BatchResult>& results, bool profile) {
  const ModelConfig& c = run.config;
  std::printf(
      "model %s (%s, %d layers, hidden %d), %s, linear weights %s, KV-cache %s, prompt %s, "
      "new %d, graphs %s, gemv_max_rows %d, batch_invariant %s\n",
      run.model.c_str(), std::string(ArchName(c.arch)).c_str(), c.num_layers, c.hidden_size,
      std::string(DTypeName(run.dtype)).c_str(), run.weights.c_str(),
      std::string(KvCacheDTypeName(run.kv_cache_dtype)).c_str(),
      absl::GetFlag(FLAGS_prompt).c_str(), run.steps, run.options.cuda_graphs ? "on" : "off",
      run.options.gemv_max_rows, run.options.batch_invariant ? "on" : "off");
  std::printf(
      "device %s, copy bandwidth %.0f GB/s (read + write%s), load %.1f s, GPU memory in use "
      "%.2f GiB\n\n",
      run.device.c_str(), run.copy_bw / 1e9,
      run.copy_after_free ? "; after freeing the stage, reads low" : "", run.load_s,
      run.used_bytes / double(1 << 30));
  std::printf("| TP | batch | prompt | KV page | TTFT (prefill ms) | prefill tok/s | "
              "decode ms/step | decode tok/s | end-to-end tok/s | decode GB/s | %% of copy bw |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const BatchResult& r : results) {
    const std::string page = r.page_size == 0 ? "slots" : absl::StrCat(r.page_size);
    std::printf("| %d | %d | %d | %s | %.2f | %.0f | %.3f | %.0f | %.0f | %.0f | %.0f%% |\n",
                r.tp, r.batch, r.prompt, page.c_str(), r.prefill_s * 1e3, r.prefill_tok_s,
                r.decode_ms_step, r.decode_tok_s, r.e2e_tok_s, r.gb_s,
                100 * r.gb_s * 1e9 / run.copy_bw);
  }
  if (profile) {
    std::vector<DecodeProfileRow> rows;
    for (const BatchResult& r : results) rows.push_back({r.batch, 0, r.profile});
    std::printf("\n%s", DecodeProfileTable(rows).c_str());
  }
}

// The run and its rows as JSON at `path` (--json).
absl::Status WriteJson(const std::string& path, const RunInfo& run,
                       const std::vector<BatchResult>& results) {
  nlohmann::json j;
  j["model"] = run.model;
  j["arch"] = std::string(ArchName(run.config.arch));
  j["dtype"] = std::string(DTypeName(run.dtype));
  j["linear_weights"] = run.weights;
  j["kv_cache_dtype"] = std::string(KvCacheDTypeName(run.kv_cache_dtype));
  j["device"] = run.device;
  j["prompt"] = run.prompts.front();
  j["prompts"] = run.prompts;
  j["new_tokens"] = run.steps;
  j["cuda_graphs"] = run.options.cuda_graphs;
  j["gemv_max_rows"] = run.options.gemv_max_rows;
  j["batch_invariant"] = run.options.batch_invariant;
  j["copy_bandwidth_gb_s"] = run.copy_bw / 1e9;
  j["copy_bandwidth_after_freeing_the_stage"] = run.copy_after_free;
  j["gpu_memory_used_bytes"] = run.used_bytes;
  j["weight_bytes_per_step"] = run.weight_bytes;
  j["load_seconds"] = run.load_s;
  for (const BatchResult& r : results) {
    j["results"].push_back({{"tensor_parallel", r.tp}, {"batch", r.batch}, {"prompt", r.prompt},
                            {"kv_page_size", r.page_size},
                            {"prefill_seconds", r.prefill_s}, {"ttft_ms", r.prefill_s * 1e3},
                            {"prefill_tok_s", r.prefill_tok_s},
                            {"decode_ms_per_step", r.decode_ms_step},
                            {"decode_tok_s", r.decode_tok_s}, {"end_to_end_tok_s", r.e2e_tok_s},
                            {"decode_gb_s", r.gb_s}});
  }
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) return absl::InternalError("cannot write " + path);
  return absl::OkStatus();
}

absl::Status Bench() {
  const std::string model = absl::GetFlag(FLAGS_model);
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(model));
  ASSIGN_OR_RETURN(DType dtype, ParseHalfDTypeFlag(absl::GetFlag(FLAGS_dtype), "--dtype"));
  ASSIGN_OR_RETURN(std::vector<int> batches, BatchSizes());
  ASSIGN_OR_RETURN(std::vector<int> prompts, PromptLengths());
  ASSIGN_OR_RETURN(std::vector<int> page_sizes, PageSizes());
  const int new_tokens = absl::GetFlag(FLAGS_new_tokens);
  if (new_tokens < 1) return absl::InvalidArgumentError("--new_tokens must be >= 1");
  for (int prompt : prompts) {
    RETURN_IF_ERROR(CheckPromptFitsContext(prompt, new_tokens, c.max_positions, model));
  }
  StageSpec spec;
  spec.model_dir = model;
  spec.max_slots = *std::max_element(batches.begin(), batches.end());
  CudaOptions opt = OptionsFromFlags(dtype);
  opt.kv_memory_fraction = static_cast<float>(absl::GetFlag(FLAGS_kv_memory_fraction));
  const bool profile = absl::GetFlag(FLAGS_profile);
  const int steps = new_tokens;
  // Which precision the linear layers run in: FP8 when quantized at load or stored so.
  ASSIGN_OR_RETURN(const KvCacheDType kv_cache_dtype, ApplyPrecisionFlags(spec, page_sizes));
  const bool fp8 = spec.quantize_fp8 || c.quantization.fp8();
  const std::string weights =
      fp8 ? (c.quantization.fp8() ? "fp8 e4m3 (" + QuantizationName(c.quantization) + ")"
                                  : std::string("fp8 e4m3 (quantized at load, per channel)"))
          : std::string(DTypeName(dtype));
  const double weight_bytes = WeightBytesPerStep(c, DTypeSize(dtype), fp8 ? 1 : DTypeSize(dtype));
  const double kv_token_bytes =
      2.0 * c.num_layers * c.kv_dim() * (spec.kv_cache_fp8 ? 1 : DTypeSize(dtype));
  std::vector<BatchResult> results;
  double load_s = 0;
  std::unique_ptr<DecodeProfiler> profiler;  // --profile; outlives every stage it observes
  if (profile) {
    ASSIGN_OR_RETURN(profiler, DecodeProfiler::Create());
  }
  ASSIGN_OR_RETURN(std::vector<int> tps, TensorParallelSizes());
  if (profile && *std::max_element(tps.begin(), tps.end()) > 1) {
    return absl::InvalidArgumentError(
        "--profile observes a stage on one GPU: use it with --tensor_parallel 1");
  }
  std::unique_ptr<Stage> stage;
  for (int tp : tps) {
    for (int prompt : prompts) {
      for (int page_size : page_sizes) {
        // One stage per prompt length and page size, its KV-cache sized for prompt + new tokens:
        // contiguous slots, or (paged) the pages of every slot's full sequence.
        stage.reset();
        spec.max_seq_len = prompt + new_tokens - 1;
        spec.kv_page_size = page_size;
        spec.kv_pages = page_size == 0 ? 0
                                       : spec.max_slots *
                                             ((spec.max_seq_len + page_size - 1) / page_size);
        const auto t_load = Clock::now();
        ASSIGN_OR_RETURN(stage, MakeCudaTensorParallelStage(spec, opt, tp));
        load_s = Seconds(t_load, Clock::now());
        if (profiler) RETURN_IF_ERROR(stage->SetDecodeObserver(profiler.get()));
        for (int batch : batches) {
          ASSIGN_OR_RETURN(BatchResult r,
                           MeasureBatch(*stage, c, batch, prompt, steps, page_size, spec.max_slots,
                                        weight_bytes, kv_token_bytes, profiler.get()));
          r.tp = tp;
          results.push_back(r);
        }
      }
    }
  }
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  // The copy test last: on an H100, a process that has launched more than a few kernels (its
  // device-to-device copies included) on a stream other than the stage's runs the cuBLAS GEMMs of
  // its decode graphs ~3% slower from then on (docs/performance.md). With the stage still loaded;
  // where its KV-cache leaves no room, after freeing it (said so: that once read 14% low).
  absl::StatusOr<double> copy_bw = CopyBandwidth();
  const bool after_free = absl::IsResourceExhausted(copy_bw.status());
  if (after_free) {
    stage.reset();
    copy_bw = CopyBandwidth();
  }
  RETURN_IF_ERROR(copy_bw.status());
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const RunInfo run{.model = model, .config = c, .dtype = dtype, .weights = weights,
                    .kv_cache_dtype = kv_cache_dtype, .prompts = prompts, .steps = steps,
                    .options = opt, .copy_bw = *copy_bw, .copy_after_free = after_free,
                    .used_bytes = total_b - free_b, .weight_bytes = weight_bytes,
                    .load_s = load_s, .device = prop.name};
  PrintReport(run, results, profile);
  const std::string json_path = absl::GetFlag(FLAGS_json);
  if (!json_path.empty()) RETURN_IF_ERROR(WriteJson(json_path, run, results));
  return absl::OkStatus();
}

absl::Status DumpLogits(const std::string& in_path, const std::string& out_path) {
  std::ifstream f(in_path);
  if (!f) return absl::NotFoundError("cannot read " + in_path);
  nlohmann::json in;
  try {
    in = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(in_path, ": ", e.what()));
  }
  std::vector<std::vector<int32_t>> prompts;
  int steps = 0;
  try {
    prompts = in.at("prompts").get<std::vector<std::vector<int32_t>>>();
    steps = in.value("steps", 32);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(in_path, ": expected {\"prompts\": [[ids...]], \"steps\": N}: ", e.what()));
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(model));
  ASSIGN_OR_RETURN(DType dtype, ParseHalfDTypeFlag(absl::GetFlag(FLAGS_dtype), "--dtype"));
  size_t longest = 1;
  for (const auto& p : prompts) {
    if (p.empty()) return absl::InvalidArgumentError(in_path + ": an empty prompt");
    longest = std::max(longest, p.size());
  }
  StageSpec spec;
  spec.model_dir = model;
  spec.max_slots = 1;
  spec.max_seq_len = std::min<int>(c.max_positions, longest + steps);
  const CudaOptions opt = OptionsFromFlags(dtype);
  ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, MakeCudaStage(spec, opt));

  std::ofstream out(out_path);
  out << "{\"model\": " << nlohmann::json(model).dump() << ", \"dtype\": \"" << DTypeName(dtype)
      << "\", \"results\": [";
  for (size_t p = 0; p < prompts.size(); ++p) {
    StepDescriptor pre;
    SequenceStep s;
    s.num_tokens = static_cast<int>(prompts[p].size());
    pre.seqs.push_back(s);
    pre.tokens = prompts[p];
    pre.return_logits = true;
    ASSIGN_OR_RETURN(StepOutput o, stage->Step(pre, Activations{}));
    std::vector<int32_t> tokens = o.tokens;
    std::vector<float> final_logits = o.logits;  // the logits that chose the last token
    for (int i = 1; i < steps && s.num_tokens + i <= spec.max_seq_len; ++i) {
      StepDescriptor d;
      SequenceStep ds;
      ds.position = s.num_tokens + i - 1;
      ds.sample_index = i;
      d.seqs.push_back(ds);
      d.tokens = {tokens.back()};
      d.return_logits = i + 1 == steps;
      ASSIGN_OR_RETURN(StepOutput od, stage->Step(d, Activations{}));
      tokens.push_back(od.tokens[0]);
      if (d.return_logits) final_logits = std::move(od.logits);
    }
    // Logits with 7 significant digits: JSON of a 50k vocabulary stays small enough.
    out << (p ? ", " : "") << "{\"tokens\": " << nlohmann::json(tokens).dump() << ", \"logits\": [";
    char buf[32];
    for (size_t i = 0; i < o.logits.size(); ++i) {
      std::snprintf(buf, sizeof(buf), "%s%.7g", i ? "," : "", o.logits[i]);
      out << buf;
    }
    out << "], \"final_logits\": [";
    for (size_t i = 0; i < final_logits.size(); ++i) {
      std::snprintf(buf, sizeof(buf), "%s%.7g", i ? "," : "", final_logits[i]);
      out << buf;
    }
    out << "]}";
  }
  out << "]}\n";
  if (!out) return absl::InternalError("cannot write " + out_path);
  return absl::OkStatus();
}

absl::Status Agreement(int count) {
  if (count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--agreement ", count, ": the number of prompts to compare must be >= 1"));
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(model));
  ASSIGN_OR_RETURN(DType dtype, ParseHalfDTypeFlag(absl::GetFlag(FLAGS_dtype), "--dtype"));
  ASSIGN_OR_RETURN(std::vector<int> lengths, PromptLengths());
  ASSIGN_OR_RETURN(std::vector<int> page_sizes, PageSizes());
  const int new_tokens = absl::GetFlag(FLAGS_new_tokens);
  if (new_tokens < 1) return absl::InvalidArgumentError("--new_tokens must be >= 1");
  if (c.quantization.fp8()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--agreement compares a precision against the checkpoint's own fp16/bf16 weights; ", model,
        " holds FP8 weights"));
  }
  const int longest = *std::max_element(lengths.begin(), lengths.end());
  RETURN_IF_ERROR(CheckPromptFitsContext(longest, new_tokens, c.max_positions, model));
  StageSpec reference;
  reference.model_dir = model;
  reference.max_slots = 1;
  reference.max_seq_len = longest + new_tokens - 1;
  reference.kv_page_size = page_sizes.front();
  reference.kv_pages =
      reference.kv_page_size == 0
          ? 0
          : (reference.max_seq_len + reference.kv_page_size - 1) / reference.kv_page_size;
  StageSpec test = reference;
  ASSIGN_OR_RETURN(const KvCacheDType kv_cache_dtype,
                   ApplyPrecisionFlags(test, {test.kv_page_size}));
  DType test_dtype = dtype;
  if (!absl::GetFlag(FLAGS_test_dtype).empty()) {
    ASSIGN_OR_RETURN(test_dtype,
                     ParseHalfDTypeFlag(absl::GetFlag(FLAGS_test_dtype), "--test_dtype"));
  }
  const CudaOptions opt = OptionsFromFlags(dtype);
  ASSIGN_OR_RETURN(std::unique_ptr<Stage> ref_stage, MakeCudaStage(reference, opt));
  CudaOptions test_opt = opt;
  test_opt.dtype = test_dtype;
  ASSIGN_OR_RETURN(std::unique_ptr<Stage> test_stage, MakeCudaStage(test, test_opt));

  // One step on both stages: the logits of each (the reference's greedy token into `next`).
  LogitAgreement prefill, decode, all;
  auto both = [&](StepDescriptor& step, LogitAgreement& into, int32_t& next) -> absl::Status {
    step.return_logits = true;
    for (SequenceStep& s : step.seqs) AttachTable(s, reference.kv_page_size, 1);
    ASSIGN_OR_RETURN(StepOutput r, ref_stage->Step(step, Activations{}));
    ASSIGN_OR_RETURN(StepOutput t, test_stage->Step(step, Activations{}));
    if (r.logits.size() != static_cast<size_t>(c.vocab_size) ||
        t.logits.size() != r.logits.size()) {
      return absl::InternalError(absl::StrCat("a step returned ", r.logits.size(), " and ",
                                              t.logits.size(), " logits, expected ", c.vocab_size));
    }
    const PositionAgreement p = ComparePosition(r.logits, t.logits);
    into.Add(p);
    all.Add(p);
    next = r.tokens.at(0);
    return absl::OkStatus();
  };
  for (int i = 0; i < count; ++i) {
    const int len = lengths[i % lengths.size()];
    StepDescriptor pre;
    SequenceStep s;
    s.num_tokens = len;
    pre.seqs.push_back(s);
    for (int t = 0; t < len; ++t) {
      pre.tokens.push_back(static_cast<int32_t>(RandomBits(7919 + i, t) % c.vocab_size));
    }
    int32_t next = 0;
    RETURN_IF_ERROR(both(pre, prefill, next));
    for (int k = 1; k < new_tokens; ++k) {
      StepDescriptor d;
      SequenceStep ds;
      ds.position = len + k - 1;
      ds.sample_index = k;
      d.seqs.push_back(ds);
      d.tokens = {next};
      RETURN_IF_ERROR(both(d, decode, next));
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const std::string name = std::string(DTypeName(dtype));
  const std::string test_name = std::string(DTypeName(test_opt.dtype));
  std::printf(
      "Next-token agreement: model %s, device %s; reference: %s weights, %s KV-cache; test: %s "
      "weights, %s KV-cache; %d prompts of %s tokens, %d steps each fed the reference's tokens\n",
      model.c_str(), prop.name, name.c_str(), name.c_str(),
      test.quantize_fp8 ? "fp8 e4m3 (quantized at load, per channel)" : test_name.c_str(),
      kv_cache_dtype == KvCacheDType::kFp8E4M3 ? "fp8 e4m3" : test_name.c_str(), count,
      absl::GetFlag(FLAGS_prompt).c_str(), new_tokens - 1);
  std::printf("prefill (last position): %s\n", prefill.Summary().c_str());
  std::printf("decode: %s\n", decode.Summary().c_str());
  std::printf("all: %s\n", all.Summary().c_str());
  const std::string json_path = absl::GetFlag(FLAGS_json);
  if (!json_path.empty()) {
    const nlohmann::json j = {
        {"model", model},
        {"device", prop.name},
        {"reference", {{"weights", name}, {"kv_cache", name}}},
        {"test",
         {{"weights", test.quantize_fp8 ? std::string("fp8") : test_name},
          {"kv_cache",
           kv_cache_dtype == KvCacheDType::kFp8E4M3 ? std::string("fp8_e4m3") : test_name}}},
        {"prompts", count},
        {"steps", new_tokens - 1},
        {"prefill", prefill.ToJson()},
        {"decode", decode.ToJson()},
        {"agreement", all.ToJson()}};
    std::ofstream out(json_path);
    out << j.dump(2) << "\n";
    if (!out) return absl::InternalError("cannot write " + json_path);
  }
  return absl::OkStatus();
}

absl::Status CpuLoad() {
  StageSpec spec;
  spec.model_dir = absl::GetFlag(FLAGS_model);
  spec.max_slots = 1;
  spec.max_seq_len = 16;  // a small KV-cache: the time is the weights'
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, MakeCpuStage(spec));
  std::printf("CPU backend load %.2f s (%s)\n", Seconds(t0, Clock::now()),
              spec.model_dir.string().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  tandem::SetProgramUsage(
      "tandem-bench --model DIR [--batch 1,64] [--prompt 128] [--new_tokens 128] "
      "[--dtype f16|bf16] [--json FILE]");
  std::vector<char*> rest = tandem::ParseFlags(argc, argv);
  if (absl::GetFlag(FLAGS_model).empty()) {
    std::cerr << "tandem-bench: --model DIR is required\n";
    return 2;
  }
  absl::Status st;
  const std::string dump_in = absl::GetFlag(FLAGS_dump_logits);
  if (!dump_in.empty()) {
    if (rest.size() != 2) {
      std::cerr << "tandem-bench: --dump_logits IN.json OUT.json\n";
      return 2;
    }
    st = tandem::DumpLogits(dump_in, rest[1]);
  } else if (absl::GetFlag(FLAGS_agreement) != 0) {
    st = tandem::Agreement(absl::GetFlag(FLAGS_agreement));
  } else if (absl::GetFlag(FLAGS_cpu_load)) {
    st = tandem::CpuLoad();
  } else if (absl::GetFlag(FLAGS_gemv_sweep)) {
    st = tandem::GemvSweep();
  } else {
    st = tandem::Bench();
  }
  if (!st.ok()) {
    std::cerr << "tandem-bench: " << st << "\n";
    return 1;
  }
  return 0;
}
