// KvBlock <-> KvChunk (kv_wire.h).
#include "worker/transport/kv_wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem {
namespace {

// Bytes of one position of one layer, K or V.
size_t RowBytes(DType dtype, int num_kv_heads, int head_dim) {
  return DTypeSize(dtype) * static_cast<size_t>(num_kv_heads) * static_cast<size_t>(head_dim);
}


// A chunk of sequence `key` with `block`'s fields that every chunk of it carries.
v1::KvChunk ChunkOf(uint64_t key, const KvBlock& block) {
  v1::KvChunk c;
  c.set_version(KvBlock::kVersion);
  c.set_key(key);
  c.set_dtype(std::string(DTypeName(block.dtype)));
  c.set_num_kv_heads(block.num_kv_heads);
  c.set_head_dim(block.head_dim);
  c.set_total_positions(block.positions);
  return c;
}

// A block of F8_E4M3 carries one pair of scales per layer; one of another dtype none.
absl::Status CheckBlockScales(const KvBlock& block) {
  const size_t want = block.dtype == DType::kF8E4M3 ? static_cast<size_t>(block.num_layers) : 0;
  if (block.scales.size() == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("KV block of ", std::string(DTypeName(block.dtype)), " and ", block.num_layers,
                   " layers has ", block.scales.size(), " pairs of scales, not ", want));
}

absl::Status CheckHeldLayers(const KvBlock& block, int first_layer, int num_layers) {
  if (num_layers < 1 || first_layer < block.first_layer ||
      num_layers > block.first_layer + block.num_layers - first_layer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV layers [", first_layer, ", ", static_cast<int64_t>(first_layer) + num_layers,
        ") are not within the held [", block.first_layer, ", ",
        block.first_layer + block.num_layers, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KvBlock> SliceKvLayers(const KvBlock& block, int first_layer, int num_layers) {
  if (absl::Status s = CheckHeldLayers(block, first_layer, num_layers); !s.ok()) return s;
  if (absl::Status s = CheckBlockScales(block); !s.ok()) return s;
  KvBlock out = block;
  out.first_layer = first_layer;
  out.num_layers = num_layers;
  if (!block.scales.empty()) {
    const auto from = block.scales.begin() + (first_layer - block.first_layer);
    out.scales.assign(from, from + num_layers);
  }
  const size_t layer_bytes = RowBytes(block.dtype, block.num_kv_heads, block.head_dim) *
                             static_cast<size_t>(block.positions);
  const size_t from = layer_bytes * static_cast<size_t>(first_layer - block.first_layer);
  const size_t n = layer_bytes * static_cast<size_t>(num_layers);
  if (block.on_device()) {  // views into the same device memory
    out.device_k = std::shared_ptr<uint8_t>(block.device_k, block.device_k.get() + from);
    out.device_v = std::shared_ptr<uint8_t>(block.device_v, block.device_v.get() + from);
    return out;
  }
  out.k.assign(block.k.begin() + from, block.k.begin() + from + n);
  out.v.assign(block.v.begin() + from, block.v.begin() + from + n);
  return out;
}

absl::StatusOr<bool> ForEachKvChunk(uint64_t key, const KvBlock& block, int64_t max_chunk_bytes,
                                    const std::function<bool(const v1::KvChunk&)>& emit,
                                    int first_layer, int num_layers) {
  if (first_layer < 0) first_layer = block.first_layer;
  if (num_layers < 0) num_layers = block.first_layer + block.num_layers - first_layer;
  if (absl::Status s = CheckHeldLayers(block, first_layer, num_layers); !s.ok()) return s;
  if (absl::Status s = CheckBlockScales(block); !s.ok()) return s;
  if (block.on_device()) {
    return absl::FailedPreconditionError("the KV block is in device memory, not in host memory");
  }
  const size_t row = RowBytes(block.dtype, block.num_kv_heads, block.head_dim);
  const int per_chunk = static_cast<int>(std::clamp<int64_t>(
      max_chunk_bytes / static_cast<int64_t>(2 * row), 1, std::max(block.positions, 1)));
  v1::KvChunk c = ChunkOf(key, block);
  for (int l = first_layer - block.first_layer; l < first_layer - block.first_layer + num_layers;
       ++l) {
    c.set_layer(block.first_layer + l);
    if (!block.scales.empty()) {
      c.set_k_scale(block.scales[l].k);
      c.set_v_scale(block.scales[l].v);
    }
    const size_t layer_at = row * static_cast<size_t>(block.positions) * static_cast<size_t>(l);
    for (int p = 0; p < block.positions; p += per_chunk) {
      const int n = std::min(per_chunk, block.positions - p);
      const size_t at = layer_at + row * static_cast<size_t>(p);
      const size_t bytes = row * static_cast<size_t>(n);
      c.set_first_position(p);
      c.set_positions(n);
      c.set_k(block.k.data() + at, bytes);
      c.set_v(block.v.data() + at, bytes);
      if (!emit(c)) return false;
    }
  }
  return true;
}

namespace {

template <typename... Parts>
absl::Status BadChunk(const v1::KvChunk& c, Parts&&... parts) {
  return absl::InvalidArgumentError(
      absl::StrCat("KV chunk of sequence ", c.key(), ": ", std::forward<Parts>(parts)...));
}

// A KV-cache's element type on the wire: an activation type, or the FP8 KV-cache's codes.
absl::StatusOr<DType> ParseKvDType(const std::string& name) {
  if (name == DTypeName(DType::kF8E4M3)) return DType::kF8E4M3;
  return ParseDType(name);
}

// A scale of an F8_E4M3 chunk: a finite number > 0.
bool GoodScale(float s) { return std::isfinite(s) && s > 0.0f; }

// The checks of every chunk against the receiving stage: version, dtype (and its scales),
// layer, dims, positions.
absl::StatusOr<DType> CheckChunkFields(const v1::KvChunk& c, const KvShape& shape) {
  if (c.version() != static_cast<uint32_t>(KvBlock::kVersion)) {
    return BadChunk(c, "version ", c.version(), ", this worker reads version ", KvBlock::kVersion);
  }
  absl::StatusOr<DType> dtype = ParseKvDType(c.dtype());
  if (!dtype.ok()) {
    return BadChunk(c, "dtype '", c.dtype(), "' is none of F32, F16, BF16, F8_E4M3");
  }
  const bool fp8 = *dtype == DType::kF8E4M3;
  if (!fp8 && (c.k_scale() != 0.0f || c.v_scale() != 0.0f || c.k_scales_size() > 0 ||
               c.v_scales_size() > 0)) {
    return BadChunk(c, "dtype ", c.dtype(), " with scales; only F8_E4M3 chunks have scales");
  }
  if (fp8 && !c.nccl() && !(GoodScale(c.k_scale()) && GoodScale(c.v_scale()))) {
    return BadChunk(c, "F8_E4M3 with k_scale ", c.k_scale(), " and v_scale ", c.v_scale(),
                    " (each must be a finite number > 0)");
  }
  if (c.layer() < shape.first_layer || c.layer() - shape.first_layer >= shape.num_layers) {
    return BadChunk(c, "layer ", c.layer(), " is not within the expected [", shape.first_layer,
                    ", ", shape.first_layer + shape.num_layers, ")");
  }
  if (c.num_kv_heads() != shape.num_kv_heads || c.head_dim() != shape.head_dim) {
    return BadChunk(c, c.num_kv_heads(), " KV heads of ", c.head_dim(), ", the model has ",
                    shape.num_kv_heads, " of ", shape.head_dim);
  }
  if (c.total_positions() < 1 || c.total_positions() > shape.max_positions) {
    return BadChunk(c, c.total_positions(), " positions, this stage holds 1 to ",
                    shape.max_positions, " per slot");
  }
  return *dtype;
}

}  // namespace

v1::KvChunk NcclKvHeader(uint64_t key, const KvBlock& block) {
  v1::KvChunk c = ChunkOf(key, block);
  c.set_layer(block.first_layer);
  c.set_num_layers(block.num_layers);
  c.set_first_position(0);
  c.set_positions(block.positions);
  c.set_nccl(true);
  for (const KvScales& s : block.scales) {
    c.add_k_scales(s.k);
    c.add_v_scales(s.v);
  }
  return c;
}

absl::StatusOr<KvBlock> KvBlockOfNcclHeader(const v1::KvChunk& c, const KvShape& shape) {
  absl::StatusOr<DType> dtype = CheckChunkFields(c, shape);
  if (!dtype.ok()) return dtype.status();
  if (!c.nccl()) return BadChunk(c, "its bytes were to come over NCCL, it says they do not");
  if (c.layer() != shape.first_layer || c.num_layers() != shape.num_layers) {
    return BadChunk(c, "layers [", c.layer(), ", ",
                    static_cast<int64_t>(c.layer()) + c.num_layers(), "), expected [",
                    shape.first_layer, ", ", shape.first_layer + shape.num_layers, ")");
  }
  if (c.first_position() != 0 || c.positions() != c.total_positions()) {
    return BadChunk(c, "positions [", c.first_position(), ", ",
                    static_cast<int64_t>(c.first_position()) + c.positions(), ") of ",
                    c.total_positions(), ", expected all of them");
  }
  if (!c.k().empty() || !c.v().empty()) {
    return BadChunk(c, c.k().size() + c.v().size(), " bytes in the message, expected none");
  }
  KvBlock b = KvBlockOf(*dtype, shape.first_layer, shape.num_layers, shape.num_kv_heads,
                        shape.head_dim, c.total_positions());
  if (*dtype == DType::kF8E4M3) {
    if (c.k_scales_size() != c.num_layers() || c.v_scales_size() != c.num_layers()) {
      return BadChunk(c, "F8_E4M3 with ", c.k_scales_size(), " k_scales and ", c.v_scales_size(),
                      " v_scales for ", c.num_layers(), " layers (one of each per layer)");
    }
    for (int l = 0; l < c.num_layers(); ++l) {
      if (!GoodScale(c.k_scales(l)) || !GoodScale(c.v_scales(l))) {
        return BadChunk(c, "layer ", c.layer() + l, ": F8_E4M3 with k_scale ", c.k_scales(l),
                        " and v_scale ", c.v_scales(l), " (each must be a finite number > 0)");
      }
      b.scales.push_back({.k = c.k_scales(l), .v = c.v_scales(l)});
    }
  }
  return b;
}

absl::Status KvAssembler::Add(const v1::KvChunk& c) {
  auto bad = [&c](auto&&... parts) { return BadChunk(c, parts...); };
  absl::StatusOr<DType> dtype = CheckChunkFields(c, shape_);
  if (!dtype.ok()) return dtype.status();
  if (c.nccl()) return bad("its bytes come over NCCL, this fetch is over gRPC");
  auto [it, fresh] = partial_.try_emplace(c.key());
  Partial& p = it->second;
  if (fresh) {
    p.block = SizedKvBlock(*dtype, shape_.first_layer, shape_.num_layers, shape_.num_kv_heads,
                           shape_.head_dim, c.total_positions());
    if (*dtype == DType::kF8E4M3) p.block.scales.resize(shape_.num_layers);
    p.filled.assign(shape_.num_layers, 0);
  } else if (c.total_positions() != p.block.positions) {
    return bad(c.total_positions(), " positions, its earlier chunks said ", p.block.positions);
  } else if (*dtype != p.block.dtype) {
    return bad("dtype ", c.dtype(), ", its earlier chunks said ",
               std::string(DTypeName(p.block.dtype)));
  }
  const int l = c.layer() - shape_.first_layer;
  if (c.first_position() != p.filled[l]) {
    return bad("layer ", c.layer(), " continues at position ", c.first_position(),
               ", expected ", p.filled[l]);
  }
  if (*dtype == DType::kF8E4M3) {
    // The layer's first chunk says its scales; the others repeat them.
    KvScales& scales = p.block.scales[l];
    const KvScales said{.k = c.k_scale(), .v = c.v_scale()};
    if (p.filled[l] > 0 && !(said == scales)) {
      return bad("layer ", c.layer(), ": k_scale ", said.k, " and v_scale ", said.v,
                 ", its earlier chunks said ", scales.k, " and ", scales.v);
    }
    scales = said;
  }
  if (c.positions() < 1 || c.positions() > p.block.positions - c.first_position()) {
    return bad(c.positions(), " positions from ", c.first_position(), " of ",
               p.block.positions);
  }
  const size_t row = RowBytes(p.block.dtype, shape_.num_kv_heads, shape_.head_dim);
  const size_t bytes = row * static_cast<size_t>(c.positions());
  if (c.k().size() != bytes || c.v().size() != bytes) {
    return bad(c.k().size(), " bytes of K and ", c.v().size(), " of V, the fields say ", bytes,
               " each");
  }
  const size_t at = row * (static_cast<size_t>(p.block.positions) * static_cast<size_t>(l) +
                           static_cast<size_t>(c.first_position()));
  std::memcpy(p.block.k.data() + at, c.k().data(), bytes);
  std::memcpy(p.block.v.data() + at, c.v().data(), bytes);
  p.filled[l] += c.positions();
  return absl::OkStatus();
}

absl::StatusOr<KvBlock> KvAssembler::Take(uint64_t key) {
  auto it = partial_.find(key);
  if (it == partial_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("no KV arrived for sequence ", key));
  }
  Partial p = std::move(it->second);
  partial_.erase(it);
  for (int l = 0; l < shape_.num_layers; ++l) {
    if (p.filled[l] != p.block.positions) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV of sequence ", key, ": layer ", shape_.first_layer + l, " has ",
                       p.filled[l], " of its ", p.block.positions, " positions"));
    }
  }
  return std::move(p.block);
}

}  // namespace tandem
