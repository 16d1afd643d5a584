// Reads one stage's tensors from a Hugging Face checkpoint into the engine's layout.
//
// Names, with or without the "transformer." (GPT-2) / "model." (Llama) prefix:
//   GPT-2: wte, wpe, h.{i}.ln_1, h.{i}.attn.c_attn (hidden, 3 * hidden), h.{i}.attn.c_proj,
//          h.{i}.ln_2, h.{i}.mlp.c_fc (hidden, inter), h.{i}.mlp.c_proj (inter, hidden), ln_f.
//          Conv1D stores (in, out); every matrix is transposed to (out, in) here.
//   Llama: embed_tokens, layers.{i}.input_layernorm, layers.{i}.self_attn.{q,k,v,o}_proj,
//          layers.{i}.post_attention_layernorm, layers.{i}.mlp.{gate,up,down}_proj, norm.
//   Both:  lm_head.weight (never prefixed), or the token embedding when the head is tied.
// GPT-2's attn.bias / attn.masked_bias are causal-mask buffers, not weights, and are never read.
#include "worker/weights.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tandem {
namespace {

// Resolves a tensor name given without its architecture prefix to the spelling the checkpoint
// uses, and reads it as floats of exactly `shape`.
class TensorReader {
 public:
  TensorReader(Checkpoint& ckpt, std::string prefix) : ckpt_(ckpt), prefix_(std::move(prefix)) {}

  absl::StatusOr<std::vector<float>> Read(const std::string& name,
                                          const std::vector<int64_t>& shape) {
    ASSIGN_OR_RETURN(std::string found, Resolve(name));
    return ckpt_.ReadFloat(found, shape);
  }

  // A Conv1D weight stored (in, out), returned as (out, in).
  absl::StatusOr<std::vector<float>> ReadTransposed(const std::string& name, int64_t in,
                                                    int64_t out) {
    ASSIGN_OR_RETURN(std::vector<float> stored, Read(name, {in, out}));
    std::vector<float> t(stored.size());
    for (int64_t i = 0; i < in; ++i) {
      for (int64_t o = 0; o < out; ++o) t[o * in + i] = stored[i * out + o];
    }
    return t;
  }

 private:
  absl::StatusOr<std::string> Resolve(const std::string& name) const {
    const std::string prefixed = prefix_ + name;
    if (ckpt_.contains(prefixed)) return prefixed;
    if (ckpt_.contains(name)) return name;
    return absl::NotFoundError(absl::StrCat("checkpoint ", ckpt_.dir().string(), " has no tensor '",
                                            prefixed, "' (nor '", name, "')"));
  }

  Checkpoint& ckpt_;
  std::string prefix_;
};

absl::StatusOr<LayerWeights> LoadGpt2Layer(TensorReader& r, const ModelConfig& c, int i) {
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  const std::string p = absl::StrCat("h.", i, ".");
  LayerWeights l;
  ASSIGN_OR_RETURN(l.attn_norm_w, r.Read(p + "ln_1.weight", {h}));
  ASSIGN_OR_RETURN(l.attn_norm_b, r.Read(p + "ln_1.bias", {h}));
  // c_attn is (h, 3h) with q, k, v column blocks: transposed, they become q, k, v row blocks.
  ASSIGN_OR_RETURN(l.wqkv, r.ReadTransposed(p + "attn.c_attn.weight", h, 3 * h));
  ASSIGN_OR_RETURN(l.bqkv, r.Read(p + "attn.c_attn.bias", {3 * h}));
  ASSIGN_OR_RETURN(l.wo, r.ReadTransposed(p + "attn.c_proj.weight", h, h));
  ASSIGN_OR_RETURN(l.bo, r.Read(p + "attn.c_proj.bias", {h}));
  ASSIGN_OR_RETURN(l.mlp_norm_w, r.Read(p + "ln_2.weight", {h}));
  ASSIGN_OR_RETURN(l.mlp_norm_b, r.Read(p + "ln_2.bias", {h}));
  ASSIGN_OR_RETURN(l.w_in, r.ReadTransposed(p + "mlp.c_fc.weight", h, inter));
  ASSIGN_OR_RETURN(l.b_in, r.Read(p + "mlp.c_fc.bias", {inter}));
  ASSIGN_OR_RETURN(l.w_out, r.ReadTransposed(p + "mlp.c_proj.weight", inter, h));
  ASSIGN_OR_RETURN(l.b_out, r.Read(p + "mlp.c_proj.bias", {h}));
  return l;
}

// Appends `rows` to `dst`: stacking row-major (out, in) matrices that share `in`.
void AppendRows(std::vector<float>& dst, const std::vector<float>& rows) {
  dst.insert(dst.end(), rows.begin(), rows.end());
}

absl::StatusOr<LayerWeights> LoadLlamaLayer(TensorReader& r, const ModelConfig& c, int i) {
  const int64_t h = c.hidden_size, inter = c.intermediate_size;
  const int64_t q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const std::string p = absl::StrCat("layers.", i, ".");
  LayerWeights l;
  ASSIGN_OR_RETURN(l.attn_norm_w, r.Read(p + "input_layernorm.weight", {h}));
  ASSIGN_OR_RETURN(std::vector<float> wq, r.Read(p + "self_attn.q_proj.weight", {q_dim, h}));
  ASSIGN_OR_RETURN(std::vector<float> wk, r.Read(p + "self_attn.k_proj.weight", {kv_dim, h}));
  ASSIGN_OR_RETURN(std::vector<float> wv, r.Read(p + "self_attn.v_proj.weight", {kv_dim, h}));
  l.wqkv.reserve(wq.size() + wk.size() + wv.size());
  AppendRows(l.wqkv, wq);
  AppendRows(l.wqkv, wk);
  AppendRows(l.wqkv, wv);
  ASSIGN_OR_RETURN(l.wo, r.Read(p + "self_attn.o_proj.weight", {h, q_dim}));
  ASSIGN_OR_RETURN(l.mlp_norm_w, r.Read(p + "post_attention_layernorm.weight", {h}));
  ASSIGN_OR_RETURN(std::vector<float> gate, r.Read(p + "mlp.gate_proj.weight", {inter, h}));
  ASSIGN_OR_RETURN(std::vector<float> up, r.Read(p + "mlp.up_proj.weight", {inter, h}));
  l.w_in.reserve(gate.size() + up.size());
  AppendRows(l.w_in, gate);
  AppendRows(l.w_in, up);
  ASSIGN_OR_RETURN(l.w_out, r.Read(p + "mlp.down_proj.weight", {h, inter}));
  return l;
}

}  // namespace

absl::StatusOr<StageWeights> LoadStageWeights(Checkpoint& ckpt, int first_layer, int last_layer) {
  const ModelConfig& c = ckpt.config();
  if (first_layer < 0 || last_layer > c.num_layers || first_layer >= last_layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer range [", first_layer, ", ", last_layer, ") of ", ckpt.dir().string(),
                     " is not a non-empty range within the model's ", c.num_layers,
                     " layers (need 0 <= first < last <= ", c.num_layers, ")"));
  }
  const bool gpt2 = c.arch == Arch::kGpt2;
  TensorReader r(ckpt, gpt2 ? "transformer." : "model.");
  const int64_t h = c.hidden_size, vocab = c.vocab_size;
  const std::string tok_name = gpt2 ? "wte.weight" : "embed_tokens.weight";

  StageWeights w;
  w.first_layer = first_layer;
  w.last_layer = last_layer;
  w.has_embedding = first_layer == 0;
  w.has_head = last_layer == c.num_layers;

  if (w.has_embedding) {
    ASSIGN_OR_RETURN(w.tok_embedding, r.Read(tok_name, {vocab, h}));
    if (gpt2) {
      ASSIGN_OR_RETURN(w.pos_embedding, r.Read("wpe.weight", {c.max_positions, h}));
    }
  }
  w.layers.reserve(last_layer - first_layer);
  for (int i = first_layer; i < last_layer; ++i) {
    ASSIGN_OR_RETURN(LayerWeights l, gpt2 ? LoadGpt2Layer(r, c, i) : LoadLlamaLayer(r, c, i));
    w.layers.push_back(std::move(l));
  }
  if (w.has_head) {
    ASSIGN_OR_RETURN(w.final_norm_w, r.Read(gpt2 ? "ln_f.weight" : "norm.weight", {h}));
    if (gpt2) {
      ASSIGN_OR_RETURN(w.final_norm_b, r.Read("ln_f.bias", {h}));
    }
    // Tied: the head is the token embedding, whatever lm_head.weight holds (as in transformers).
    if (c.tie_word_embeddings) {
      if (w.has_embedding) {
        w.lm_head = w.tok_embedding;
      } else {
        ASSIGN_OR_RETURN(w.lm_head, r.Read(tok_name, {vocab, h}));
      }
    } else {
      // lm_head sits outside "model."/"transformer."; TensorReader also tries it unprefixed.
      ASSIGN_OR_RETURN(w.lm_head, r.Read("lm_head.weight", {vocab, h}));
    }
  }
  return w;
}

}  // namespace tandem
