// The Megatron split of a stage's weights over tensor-parallel ranks (tensor_parallel.h).
#include "worker/tensor_parallel.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tandem {
namespace {

// Rows [first, first + count) of a row-major (rows, cols) matrix, appended to `out`.
void AppendRows(const std::vector<float>& m, int cols, int first, int count,
                std::vector<float>& out) {
  const auto begin = m.begin() + static_cast<ptrdiff_t>(first) * cols;
  out.insert(out.end(), begin, begin + static_cast<ptrdiff_t>(count) * cols);
}

// Columns [first, first + count) of a row-major (rows, cols) matrix, as (rows, count).
std::vector<float> Columns(const std::vector<float>& m, int cols, int first, int count) {
  const int rows = static_cast<int>(m.size() / cols);
  std::vector<float> out;
  out.reserve(static_cast<size_t>(rows) * count);
  for (int r = 0; r < rows; ++r) {
    const auto row = m.begin() + static_cast<ptrdiff_t>(r) * cols + first;
    out.insert(out.end(), row, row + count);
  }
  return out;
}

// The rank's q, k and v rows of a (q_dim + 2 * kv_dim, cols) stack (cols 1 for a bias).
std::vector<float> QkvRows(const ModelConfig& c, const std::vector<float>& m, int cols,
                           const RankHeads& h) {
  if (m.empty()) return {};
  const int hd = c.head_dim;
  std::vector<float> out;
  AppendRows(m, cols, h.first * hd, h.count * hd, out);
  AppendRows(m, cols, c.q_dim() + h.first_kv * hd, h.kv_count * hd, out);
  AppendRows(m, cols, c.q_dim() + c.kv_dim() + h.first_kv * hd, h.kv_count * hd, out);
  return out;
}

}  // namespace

absl::Status CheckTensorParallel(const ModelConfig& c, int ranks) {
  if (ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel size ", ranks, " (expected at least 1)"));
  }
  if (c.num_heads % ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel size ", ranks, " does not divide the model's ", c.num_heads,
                     " attention heads (choose a divisor of ", c.num_heads, ")"));
  }
  if (c.num_kv_heads % ranks != 0 && ranks % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor-parallel size ", ranks, " neither divides nor is a multiple of the model's ",
        c.num_kv_heads, " key/value heads"));
  }
  if (c.intermediate_size % ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel size ", ranks, " does not divide the model's MLP width ",
                     c.intermediate_size));
  }
  return absl::OkStatus();
}

ModelConfig RankConfig(const ModelConfig& c, int ranks) {
  ModelConfig r = c;
  r.num_heads = c.num_heads / ranks;
  r.num_kv_heads = std::max(1, c.num_kv_heads / ranks);
  r.intermediate_size = c.intermediate_size / ranks;
  return r;
}

RankHeads HeadsOfRank(const ModelConfig& c, int rank, int ranks) {
  RankHeads h;
  h.count = c.num_heads / ranks;
  h.first = rank * h.count;
  // A rank's query heads read K/V heads first / group ..., group query heads to one K/V head.
  const int group = c.num_heads / c.num_kv_heads;
  h.kv_count = std::max(1, c.num_kv_heads / ranks);
  h.first_kv = h.first / group;
  return h;
}

LayerWeights ShardLayer(const ModelConfig& c, const LayerWeights& w, int rank, int ranks) {
  const RankHeads h = HeadsOfRank(c, rank, ranks);
  const int hidden = c.hidden_size, inter = c.intermediate_size, part = inter / ranks;
  LayerWeights s;
  s.attn_norm_w = w.attn_norm_w;
  s.attn_norm_b = w.attn_norm_b;
  s.wqkv = QkvRows(c, w.wqkv, hidden, h);
  s.bqkv = QkvRows(c, w.bqkv, 1, h);
  s.q_norm_w = w.q_norm_w;
  s.k_norm_w = w.k_norm_w;
  s.wo = Columns(w.wo, c.q_dim(), h.first * c.head_dim, h.count * c.head_dim);
  if (rank == 0) s.bo = w.bo;
  s.mlp_norm_w = w.mlp_norm_w;
  s.mlp_norm_b = w.mlp_norm_b;
  // Llama's w_in stacks gate rows then up rows: the rank takes its slice of each.
  AppendRows(w.w_in, hidden, rank * part, part, s.w_in);
  if (c.arch == Arch::kLlama) AppendRows(w.w_in, hidden, inter + rank * part, part, s.w_in);
  if (!w.b_in.empty()) AppendRows(w.b_in, 1, rank * part, part, s.b_in);
  s.w_out = Columns(w.w_out, inter, rank * part, part);
  if (rank == 0) s.b_out = w.b_out;
  return s;
}

StageWeights ShardStage(const ModelConfig& c, const StageWeights& w, int rank, int ranks) {
  StageWeights s;
  s.first_layer = w.first_layer;
  s.last_layer = w.last_layer;
  s.has_embedding = w.has_embedding;
  s.has_head = w.has_head && rank == 0;
  s.tok_embedding = w.tok_embedding;
  s.pos_embedding = w.pos_embedding;
  s.layers.reserve(w.layers.size());
  for (const LayerWeights& l : w.layers) s.layers.push_back(ShardLayer(c, l, rank, ranks));
  if (s.has_head) {
    s.final_norm_w = w.final_norm_w;
    s.final_norm_b = w.final_norm_b;
    s.lm_head = w.lm_head;
  }
  return s;
}

namespace {

// Whether `b` is a host block of `heads` K/V heads of the model's head size whose bytes match
// its fields; `what` names it in the error.
absl::Status CheckHostBlock(const ModelConfig& c, const KvBlock& b, int heads,
                            const std::string& what) {
  if (b.on_device()) {
    return absl::InvalidArgumentError(what + ": a block in device memory (host blocks only)");
  }
  if (b.num_kv_heads != heads || b.head_dim != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", b.num_kv_heads, " K/V heads of ",
                                                   b.head_dim, ", expected ", heads, " of ",
                                                   c.head_dim));
  }
  const size_t bytes = b.expected_bytes();
  if (bytes == 0 || b.k.size() != bytes || b.v.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", b.k.size(), " and ", b.v.size(),
                                                   " bytes of K and V, expected ", bytes));
  }
  return absl::OkStatus();
}

// A host block of `b`'s header (layers, positions, dtype, scales) with `heads` K/V heads, its K
// and V zeros: built from the fields alone, so that none of `b`'s K/V bytes are copied.
KvBlock EmptyBlockLike(const KvBlock& b, int heads) {
  KvBlock e;
  e.version = b.version;
  e.dtype = b.dtype;
  e.first_layer = b.first_layer;
  e.num_layers = b.num_layers;
  e.num_kv_heads = heads;
  e.head_dim = b.head_dim;
  e.positions = b.positions;
  e.scales = b.scales;
  e.k.assign(e.expected_bytes(), 0);
  e.v.assign(e.expected_bytes(), 0);
  return e;
}

// Copies heads [from_head, from_head + count) of every (layer, position) row of `src` (rows of
// src_heads heads) to heads [to_head, ...) of the rows of `dst` (rows of dst_heads heads).
void CopyHeads(const std::vector<uint8_t>& src, int src_heads, int from_head,
               std::vector<uint8_t>& dst, int dst_heads, int to_head, int count, size_t head_bytes,
               int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(src.data() + (r * src_heads + from_head) * head_bytes, count * head_bytes,
                dst.data() + (r * dst_heads + to_head) * head_bytes);
  }
}

}  // namespace

absl::StatusOr<KvBlock> RankKvBlock(const ModelConfig& c, const KvBlock& whole, int rank,
                                    int ranks) {
  RETURN_IF_ERROR(CheckHostBlock(c, whole, c.num_kv_heads, "KV block for a tensor-parallel rank"));
  const RankHeads h = HeadsOfRank(c, rank, ranks);
  KvBlock part = EmptyBlockLike(whole, h.kv_count);
  const size_t head_bytes = static_cast<size_t>(c.head_dim) * DTypeSize(whole.dtype);
  const int64_t rows = static_cast<int64_t>(whole.num_layers) * whole.positions;
  CopyHeads(whole.k, c.num_kv_heads, h.first_kv, part.k, h.kv_count, 0, h.kv_count, head_bytes,
            rows);
  CopyHeads(whole.v, c.num_kv_heads, h.first_kv, part.v, h.kv_count, 0, h.kv_count, head_bytes,
            rows);
  return part;
}

absl::StatusOr<KvBlock> WholeKvBlock(const ModelConfig& c, const std::vector<KvBlock>& parts,
                                     int ranks) {
  if (static_cast<int>(parts.size()) != ranks || ranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV block of a tensor-parallel stage: ", parts.size(), " parts from ", ranks, " ranks"));
  }
  const KvBlock& first = parts.front();
  for (int r = 0; r < ranks; ++r) {
    const KvBlock& p = parts[r];
    const std::string what = absl::StrCat("KV block of tensor-parallel rank ", r);
    RETURN_IF_ERROR(CheckHostBlock(c, p, HeadsOfRank(c, r, ranks).kv_count, what));
    if (p.dtype != first.dtype || p.first_layer != first.first_layer ||
        p.num_layers != first.num_layers || p.positions != first.positions ||
        p.version != first.version) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": layers [", p.first_layer, ", ", p.first_layer + p.num_layers, "), ", p.positions,
          " positions of ", std::string(DTypeName(p.dtype)), "; rank 0's: [", first.first_layer,
          ", ", first.first_layer + first.num_layers, "), ", first.positions, " of ",
          std::string(DTypeName(first.dtype))));
    }
  }
  KvBlock whole = EmptyBlockLike(first, c.num_kv_heads);
  const size_t head_bytes = static_cast<size_t>(c.head_dim) * DTypeSize(first.dtype);
  const int64_t rows = static_cast<int64_t>(first.num_layers) * first.positions;
  int next = 0;  // the first K/V head no rank before this one held
  for (int r = 0; r < ranks; ++r) {
    const RankHeads h = HeadsOfRank(c, r, ranks);
    if (h.first_kv + h.kv_count <= next) continue;  // a replica of heads already taken
    CopyHeads(parts[r].k, h.kv_count, 0, whole.k, c.num_kv_heads, h.first_kv, h.kv_count,
              head_bytes, rows);
    CopyHeads(parts[r].v, h.kv_count, 0, whole.v, c.num_kv_heads, h.first_kv, h.kv_count,
              head_bytes, rows);
    next = h.first_kv + h.kv_count;
  }
  return whole;
}

absl::Status RankError(size_t rank, const absl::Status& st) {
  return absl::Status(st.code(), absl::StrCat("tensor-parallel rank ", rank, ": ", st.message()));
}

absl::StatusOr<KvBlock> ExportSplitKv(const ModelConfig& c,
                                      const std::vector<std::unique_ptr<Stage>>& ranks,
                                      const KvPlace& place, int positions, int first_layer,
                                      int num_layers) {
  std::vector<KvBlock> parts;
  for (size_t r = 0; r < ranks.size(); ++r) {
    absl::StatusOr<KvBlock> part = ranks[r]->ExportKv(place, positions, first_layer, num_layers);
    if (!part.ok()) return RankError(r, part.status());
    parts.push_back(*std::move(part));
  }
  return WholeKvBlock(c, parts, static_cast<int>(ranks.size()));
}

absl::Status ImportSplitKv(const ModelConfig& c, const std::vector<std::unique_ptr<Stage>>& ranks,
                           const KvPlace& place, const KvBlock& block) {
  std::vector<KvBlock> parts;
  for (size_t r = 0; r < ranks.size(); ++r) {
    ASSIGN_OR_RETURN(KvBlock part,
                     RankKvBlock(c, block, static_cast<int>(r), static_cast<int>(ranks.size())));
    parts.push_back(std::move(part));
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (absl::Status st = ranks[r]->ImportKv(place, parts[r]); !st.ok()) return RankError(r, st);
  }
  return absl::OkStatus();
}

}  // namespace tandem
