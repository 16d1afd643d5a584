#include "bench/gemv_sweep.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/cuda/cuda_check.h"
#include "worker/cuda/kernels.h"

namespace tandem {
namespace {

using cuda::GemvEpilogue;
using cuda::GemvTuning;

struct Projection {
  const char* name;
  GemvEpilogue epilogue;
  int out, in;
  int w_rows;  // 2 * out for SwiGLU
};

std::vector<Projection> Projections(const ModelConfig& c) {
  const int h = c.hidden_size, inter = c.intermediate_size;
  const int qkv = c.q_dim() + 2 * c.kv_dim();
  if (c.arch == Arch::kLlama) {
    return {{"qkv", GemvEpilogue::kStore, qkv, h, qkv},
            {"out (+residual)", GemvEpilogue::kResidual, h, c.q_dim(), h},
            {"gate+up (SwiGLU)", GemvEpilogue::kSwiGlu, inter, h, 2 * inter},
            {"down (+residual)", GemvEpilogue::kResidual, h, inter, h},
            {"lm head (fp32)", GemvEpilogue::kF32, c.vocab_size, h, c.vocab_size}};
  }
  return {{"qkv", GemvEpilogue::kStore, qkv, h, qkv},
          {"out (+residual)", GemvEpilogue::kResidual, h, c.q_dim(), h},
          {"fc (GELU)", GemvEpilogue::kGelu, inter, h, inter},
          {"proj (+residual)", GemvEpilogue::kResidual, h, inter, h},
          {"lm head (fp32)", GemvEpilogue::kF32, c.vocab_size, h, c.vocab_size}};
}

// Replays `graph` `reps` times; seconds per replay.
absl::StatusOr<double> TimeGraph(cudaGraphExec_t graph, cudaStream_t stream, int reps) {
  CUDA_CHECK(cudaGraphLaunch(graph, stream));  // warm-up
  cuda::Event e0, e1;
  RETURN_IF_ERROR(e0.Create());
  RETURN_IF_ERROR(e1.Create());
  CUDA_CHECK(cudaEventRecord(e0.get(), stream));
  for (int i = 0; i < reps; ++i) CUDA_CHECK(cudaGraphLaunch(graph, stream));
  CUDA_CHECK(cudaEventRecord(e1.get(), stream));
  CUDA_CHECK(cudaEventSynchronize(e1.get()));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0.get(), e1.get()));
  return ms * 1e-3 / reps;
}

// Captures what `enqueue` puts on `stream` into an instantiated graph.
template <typename F>
absl::Status Capture(cudaStream_t stream, cuda::GraphExec& exec, F enqueue) {
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  absl::Status s = enqueue();
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &g);
  cuda::Graph graph(g);
  RETURN_IF_ERROR(s);
  CUDA_CHECK(end);
  return exec.Instantiate(graph.get());
}

}  // namespace

absl::Status RunGemvSweep(const ModelConfig& c, DType dtype, bool fp8, const std::vector<int>& rows,
                          const std::string& json_path) {
  for (int m : rows) {
    if (!cuda::GemvSupported(m, 8)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gemv_sweep takes row counts of 1, 2, 4 or 8, got ", m));
    }
  }
  const size_t elem = DTypeSize(dtype);
  int sm_count = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  cuda::Stream stream;
  RETURN_IF_ERROR(stream.Create());
  const cudaStream_t s = stream.get();
  const int max_rows = *std::max_element(rows.begin(), rows.end());
  const int hidden = c.hidden_size;
  // The norm kernel in front of each GEMV: one row of the hidden width, as at batch 1.
  cuda::DeviceBuffer norm_x, norm_w, norm_out;
  RETURN_IF_ERROR(norm_x.Allocate(hidden * elem));
  RETURN_IF_ERROR(norm_w.Allocate(hidden * elem));
  RETURN_IF_ERROR(norm_out.Allocate(hidden * elem));
  CUDA_CHECK(cudaMemset(norm_x.get(), 0x11, hidden * elem));
  CUDA_CHECK(cudaMemset(norm_w.get(), 0x11, hidden * elem));
  auto norm = [&] {
    return cuda::LaunchNorm(dtype, c.arch == Arch::kLlama, norm_x.get(), nullptr, norm_w.get(),
                            norm_w.get(), nullptr, norm_out.get(), 1, hidden, 1e-5f, s);
  };

  nlohmann::json results = nlohmann::json::array();
  std::printf(
      "| projection | out × in | MB | rows | rows/warp | K split | codes/lane | µs | GB/s |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  for (const Projection& p : Projections(c)) {
    // The stage keeps the LM head in the activations' type.
    const bool codes = fp8 && p.epilogue != GemvEpilogue::kF32;
    const size_t w_elem = codes ? 1 : elem;
    const size_t w_bytes = static_cast<size_t>(p.w_rows) * p.in * w_elem;
    // Enough copies that no GEMV finds its weights in L2 (50 MB on an H100).
    const int copies =
        static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / w_bytes + 1, 4, 512));
    cuda::DeviceBuffer w, x, y, scales;
    RETURN_IF_ERROR(w.Allocate(w_bytes * copies));
    if (codes) {
      // One scale per row for every copy (0x11 codes are small normal E4M3 values).
      RETURN_IF_ERROR(scales.Allocate(static_cast<size_t>(p.w_rows) * sizeof(float)));
      CUDA_CHECK(cudaMemset(scales.get(), 0, static_cast<size_t>(p.w_rows) * sizeof(float)));
    }
    RETURN_IF_ERROR(x.Allocate(static_cast<size_t>(max_rows) * p.in * elem));
    RETURN_IF_ERROR(y.Allocate(static_cast<size_t>(max_rows) * p.out * sizeof(float)));
    CUDA_CHECK(cudaMemset(w.get(), 0x11, w_bytes * copies));
    CUDA_CHECK(cudaMemset(x.get(), 0x11, static_cast<size_t>(max_rows) * p.in * elem));
    CUDA_CHECK(cudaMemset(y.get(), 0, static_cast<size_t>(max_rows) * p.out * sizeof(float)));
    cuda::GraphExec norms_only;
    RETURN_IF_ERROR(Capture(s, norms_only, [&]() -> absl::Status {
      for (int i = 0; i < copies; ++i) RETURN_IF_ERROR(norm());
      return absl::OkStatus();
    }));
    const int reps = std::max(3, 2000 / copies);
    ASSIGN_OR_RETURN(const double norms_s, TimeGraph(norms_only.get(), s, reps));
    const double norm_s = norms_s / copies;
    for (int m : rows) {
      const bool paired = p.epilogue == GemvEpilogue::kSwiGlu || m >= 4;
      std::vector<GemvTuning> variants = {GemvTuning{}};  // the shape's own choice first
      for (int rpw : {1, 2}) {
        if (paired && rpw == 1) continue;
        for (int split : {1, 2, 4}) {
          if (!codes) {
            variants.push_back(GemvTuning{rpw, split});
            continue;
          }
          for (int lane_codes : {8, 16}) {
            if (lane_codes == 16 && p.in % 16 != 0) continue;
            variants.push_back(GemvTuning{rpw, split, lane_codes});
          }
        }
      }
      const GemvTuning chosen = cuda::GemvTuningFor(m, p.out, p.in, sm_count, codes);
      for (const GemvTuning& v : variants) {
        cuda::GraphExec pairs;
        RETURN_IF_ERROR(Capture(s, pairs, [&]() -> absl::Status {
          for (int i = 0; i < copies; ++i) {
            RETURN_IF_ERROR(norm());
            if (codes) {
              RETURN_IF_ERROR(cuda::GemvFp8(dtype, p.epilogue, x.get(), w.as<char>() + i * w_bytes,
                                            scales.as<float>(), nullptr, y.get(), m, p.out, p.in, s,
                                            v));
            } else {
              RETURN_IF_ERROR(cuda::Gemv(dtype, p.epilogue, x.get(), w.as<char>() + i * w_bytes,
                                         nullptr, y.get(), m, p.out, p.in, s, v));
            }
          }
          return absl::OkStatus();
        }));
        ASSIGN_OR_RETURN(const double pair_s, TimeGraph(pairs.get(), s, reps));
        const double gemv_s = std::max(pair_s / copies - norm_s, 1e-9);
        const bool is_auto = v.rows_per_warp == 0;
        const int rpw = is_auto ? (paired ? 2 : chosen.rows_per_warp) : v.rows_per_warp;
        const int split = is_auto ? chosen.k_split : v.k_split;
        const int lane_codes =
            !codes ? 0 : (v.fp8_lane_codes != 0 ? v.fp8_lane_codes : (p.in % 16 == 0 ? 16 : 8));
        const double gb_s = w_bytes / gemv_s / 1e9;
        std::printf("| %s | %d × %d | %.1f | %d | %s%d | %s%d | %s | %.2f | %.0f |\n", p.name,
                    p.out, p.in, w_bytes / 1e6, m, is_auto ? "auto: " : "", rpw,
                    is_auto ? "auto: " : "", split, codes ? absl::StrCat(lane_codes).c_str() : "-",
                    gemv_s * 1e6, gb_s);
        results.push_back({{"projection", p.name},
                           {"out", p.out},
                           {"in", p.in},
                           {"weight_bytes", w_bytes},
                           {"rows", m},
                           {"auto", is_auto},
                           {"rows_per_warp", rpw},
                           {"k_split", split},
                           {"fp8", codes},
                           {"fp8_lane_codes", lane_codes},
                           {"us", gemv_s * 1e6},
                           {"gb_s", gb_s},
                           {"norm_us", norm_s * 1e6}});
      }
    }
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << nlohmann::json{{"gemv_sweep", results}}.dump(2) << "\n";
    if (!f) return absl::InternalError("cannot write " + json_path);
  }
  return absl::OkStatus();
}

}  // namespace tandem
