// The CUDA stage's weights on the device: arenas placed earlier (StageSpec::placed) where they
// hold the stage's layers, the others uploaded from the checkpoint as one more arena.
#include "worker/cuda/cuda_stage_impl.h"
#include "worker/kv_scales.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

#include "common/rope.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace tandem {

namespace {

std::string CanonicalDir(const std::filesystem::path& dir) {
  std::error_code ec;
  const std::filesystem::path c = std::filesystem::weakly_canonical(dir, ec);
  return ec ? dir.string() : c.string();
}

}  // namespace

absl::StatusOr<StageArenas> ArenasFor(const StageSpec& spec, int first, int last,
                                      const CudaOptions& opt, bool tie_word_embeddings) {
  StageArenas out;
  const std::string dir = CanonicalDir(spec.model_dir);
  for (const std::shared_ptr<const PlacedWeights>& p : spec.placed) {
    auto c = std::dynamic_pointer_cast<const CudaPlacedWeights>(p);
    if (c != nullptr && c->Serves(dir, opt.dtype, opt.device)) out.usable.push_back(std::move(c));
  }
  int lo = last, hi = first;
  for (int l = first; l < last; ++l) {
    const bool held = std::any_of(out.usable.begin(), out.usable.end(),
                                  [l](const auto& c) { return c->Holds(l); });
    if (!held) lo = std::min(lo, l), hi = std::max(hi, l + 1);
  }
  if (lo >= hi) return out;
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(spec.model_dir));
  ASSIGN_OR_RETURN(StageSources w, FindStageWeights(*ckpt, lo, hi));
  const bool share_head = w.has_head && w.has_embedding && tie_word_embeddings;
  // FP8: quantized at load (--quantization fp8) or stored so.
  const bool fp8 = spec.quantize_fp8 || ckpt->config().quantization.fp8();
  ASSIGN_OR_RETURN(cuda::DeviceWeights uploaded,
                   cuda::UploadStageWeights(w, opt.dtype, share_head, {}, fp8));
  out.uploaded = std::make_shared<const CudaPlacedWeights>(dir, opt.dtype, opt.device,
                                                          std::move(uploaded));
  return out;
}

absl::Status CudaStage::UploadWeights(const StageSpec& spec) {
  const int last = spec.last_layer == -1 ? c_.num_layers : spec.last_layer;
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(spec.model_dir));
  ASSIGN_OR_RETURN(StageSources w, FindStageWeights(*ckpt, spec.first_layer, last));
  has_embedding_ = w.has_embedding;
  has_head_ = w.has_head;
  first_layer_ = w.first_layer;
  num_layers_ = static_cast<int>(w.layers.size());
  if (kv_fp8_) {
    ASSIGN_OR_RETURN(kv_scales_, LoadKvScales(*ckpt, spec.first_layer, last));
  }

  RETURN_IF_ERROR(stream_.Create());
  RETURN_IF_ERROR(cublas_.Create());
  CUBLAS_CHECK(cublasSetStream(cublas_.get(), stream_.get()));
  // A workspace of our own, so that graph capture never sees cuBLAS allocate.
  RETURN_IF_ERROR(cublas_workspace_.Allocate(32 << 20));
  CUBLAS_CHECK(cublasSetWorkspace(cublas_.get(), cublas_workspace_.get(), cublas_workspace_.size()));
  if (opt_.batch_invariant) {
    ASSIGN_OR_RETURN(fixed_gemm_, cuda::FixedAlgoGemm::Create(stream_.get()));
    const int inter = c_.intermediate_size;
    const int in_cols = c_.arch == Arch::kLlama ? 2 * inter : inter;
    for (auto [out, in] : {std::pair{c_.q_dim() + 2 * c_.kv_dim(), c_.hidden_size},
                           std::pair{c_.hidden_size, c_.q_dim()},
                           std::pair{in_cols, c_.hidden_size}, std::pair{c_.hidden_size, inter}}) {
      RETURN_IF_ERROR(fixed_gemm_->Prepare(opt_.dtype, out, in, false));
    }
    if (w.has_head) {
      RETURN_IF_ERROR(fixed_gemm_->Prepare(opt_.dtype, c_.vocab_size, c_.hidden_size, true));
    }
  }

  // Weights: arenas already placed where they hold the layers, the others copied from the mapped
  // checkpoint in their stored dtype into one more.
  const int end = first_layer_ + num_layers_;
  StageArenas arenas;
  if (rank_.shard != nullptr) {
    // A tensor-parallel rank: its shard from the host, in an arena of its own (not shared).
    const bool share_head = w.has_head && w.has_embedding && c_.tie_word_embeddings;
    ASSIGN_OR_RETURN(cuda::DeviceWeights shard,
                     cuda::UploadStageWeights(*rank_.shard, opt_.dtype, share_head));
    arenas.uploaded =
        std::make_shared<const CudaPlacedWeights>("", opt_.dtype, opt_.device, std::move(shard));
  } else {
    ASSIGN_OR_RETURN(arenas, ArenasFor(spec, first_layer_, end, opt_, c_.tie_word_embeddings));
  }
  std::vector<std::shared_ptr<const CudaPlacedWeights>> from = arenas.usable;
  if (arenas.uploaded != nullptr) from.insert(from.begin(), arenas.uploaded);
  placed_.clear();
  // The first arena holding `layer`, kept by the stage.
  auto arena_of = [&](int layer) -> const StageWeightsOf<const void*>& {
    for (const std::shared_ptr<const CudaPlacedWeights>& a : from) {
      if (!a->Holds(layer)) continue;
      if (std::find(placed_.begin(), placed_.end(), a) == placed_.end()) placed_.push_back(a);
      return a->tensors();
    }
    std::abort();  // ArenasFor leaves no layer without one
  };
  if (has_embedding_) {
    tok_embedding_ = arena_of(0).tok_embedding;
    pos_embedding_ = arena_of(0).pos_embedding;
  }
  size_t fp8_scratch = 0;  // bytes of the largest FP8 weight in dtype
  for (int layer = first_layer_; layer < end; ++layer) {
    const StageWeightsOf<const void*>& a = arena_of(layer);
    const LayerWeightsOf<const void*>& l = a.layers[layer - a.first_layer];
    DeviceLayer dl;
    for (const std::shared_ptr<const CudaPlacedWeights>& p : from) {
      if (&p->tensors() != &a) continue;
      const LayerWeightsOf<const float*>& s = p->scales().layers[layer - a.first_layer];
      dl.wqkv_scales = s.wqkv;
      dl.wo_scales = s.wo;
      dl.w_in_scales = s.w_in;
      dl.w_out_scales = s.w_out;
    }
    if (dl.wqkv_scales != nullptr) {
      const int64_t in_rows = c_.arch == Arch::kLlama ? 2 * int64_t{c_.intermediate_size}
                                                      : c_.intermediate_size;
      for (int64_t elements :
           {int64_t{c_.q_dim() + 2 * c_.kv_dim()} * c_.hidden_size,
            int64_t{c_.hidden_size} * c_.q_dim(), in_rows * c_.hidden_size,
            int64_t{c_.hidden_size} * c_.intermediate_size}) {
        fp8_scratch = std::max(fp8_scratch, static_cast<size_t>(elements) * DTypeSize(opt_.dtype));
      }
    }
    dl.attn_norm_w = l.attn_norm_w;
    dl.attn_norm_b = l.attn_norm_b;
    dl.wqkv = l.wqkv;
    dl.bqkv = l.bqkv;
    dl.q_norm_w = l.q_norm_w;
    dl.k_norm_w = l.k_norm_w;
    dl.wo = l.wo;
    dl.bo = l.bo;
    dl.mlp_norm_w = l.mlp_norm_w;
    dl.mlp_norm_b = l.mlp_norm_b;
    dl.w_in = l.w_in;
    dl.b_in = l.b_in;
    dl.w_out = l.w_out;
    dl.b_out = l.b_out;
    layers_.push_back(dl);
  }
  if (fp8_scratch > 0) RETURN_IF_ERROR(fp8_scratch_.Allocate(fp8_scratch));
  if (fp8_scratch > 0 && !opt_.batch_invariant) {
    // FP8 tensor cores where cuBLASLt has them; otherwise the dequantizing path.
    const int widest_out = std::max({c_.q_dim() + 2 * c_.kv_dim(), c_.hidden_size,
                                     (c_.arch == Arch::kLlama ? 2 : 1) * c_.intermediate_size});
    absl::StatusOr<std::unique_ptr<cuda::Fp8Gemm>> gemm =
        cuda::Fp8Gemm::Create(stream_.get(), widest_out);
    if (gemm.ok()) {
      fp8_gemm_ = *std::move(gemm);
    } else if (!absl::IsUnavailable(gemm.status())) {
      return gemm.status();
    }
  }
  if (has_head_) {
    const StageWeightsOf<const void*>& a = arena_of(end - 1);
    final_norm_w_ = a.final_norm_w;
    final_norm_b_ = a.final_norm_b;
    lm_head_ = a.lm_head;
  }
  if (c_.arch == Arch::kLlama) {
    const std::vector<float> inv_freq = RopeInverseFrequencies(c_);
    RETURN_IF_ERROR(inv_freq_.Allocate(inv_freq.size() * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(inv_freq_.get(), inv_freq.data(), inv_freq.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
  }
  return absl::OkStatus();
}

}  // namespace tandem
