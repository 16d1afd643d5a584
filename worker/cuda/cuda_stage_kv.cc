// KV blocks in and out of the CUDA stage's cache: exports to the host or to device memory,
// imports, and the write-outs a step fills layer by layer as it goes.
#include "worker/cuda/cuda_stage_impl.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tandem {
namespace {
// Moves go through a slot's contiguous rows: a place with pages, or any place on a paged stage,
// is not moved yet.
absl::Status NoPages(const char* what, const KvPlace& place, bool paged) {
  if (!paged && place.block_table.empty()) return absl::OkStatus();
  return absl::UnimplementedError(
      absl::StrCat(what, ": slot ", place.slot, " names ", place.block_table.size(),
                   " pages; the CUDA stage does not move a paged KV-cache yet"));
}
}  // namespace

absl::StatusOr<KvBlock> CudaStage::ExportKv(const KvPlace& place, int positions, int first_layer,
                                            int num_layers) const {
  RETURN_IF_ERROR(NoPages("KV export", place, paged()));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, first_layer_,
                                first_layer_ + num_layers_, max_slots_,
                                slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
  KvBlock b = SizedKvBlock(opt_.dtype, first_layer, num_layers, c_.num_kv_heads, c_.head_dim,
                           positions);
  // Per layer: the slot's rows gathered into the block's layout on the device, then one copy
  // each of K and V to the host, all on the stage's stream behind the steps queued before.
  CUDA_CHECK(cudaSetDevice(opt_.device));
  const size_t layer_bytes = static_cast<size_t>(positions) * RowBytes(c_.kv_dim());
  for (int l = 0; l < num_layers; ++l) {
    const int layer = first_layer - first_layer_ + l;
    const auto [k_stage, v_stage] = KvStaging(layer);
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(layer), VCache(layer), slot, k_stage, v_stage,
                                            positions, c_.num_kv_heads, c_.head_dim,
                                            seq_capacity_, /*to_block=*/true, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(b.k.data() + l * layer_bytes, k_stage, layer_bytes,
                               cudaMemcpyDeviceToHost, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(b.v.data() + l * layer_bytes, v_stage, layer_bytes,
                               cudaMemcpyDeviceToHost, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  return b;
}

absl::StatusOr<KvBlock> CudaStage::DeviceKvBlock(int first_layer, int num_layers,
                                                 int positions) const {
  KvBlock b = KvBlockOf(opt_.dtype, first_layer, num_layers, c_.num_kv_heads, c_.head_dim,
                        positions);
  const size_t bytes = b.expected_bytes();
  ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> mem, SharedDeviceBytes(opt_.device, 2 * bytes));
  b.device_k = mem;
  b.device_v = std::shared_ptr<uint8_t>(mem, mem.get() + bytes);
  return b;
}

absl::StatusOr<KvBlock> CudaStage::ExportKvToDevice(const KvPlace& place, int positions,
                                                    int first_layer, int num_layers) const {
  RETURN_IF_ERROR(NoPages("KV export", place, paged()));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, first_layer_,
                                first_layer_ + num_layers_, max_slots_,
                                slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
  ASSIGN_OR_RETURN(KvBlock b, DeviceKvBlock(first_layer, num_layers, positions));
  // Per layer: the slot's rows gathered straight into the block, on the stage's stream.
  const size_t layer_bytes = static_cast<size_t>(positions) * RowBytes(c_.kv_dim());
  for (int l = 0; l < num_layers; ++l) {
    const int layer = first_layer - first_layer_ + l;
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(
        KCache(layer), VCache(layer), slot, b.device_k.get() + l * layer_bytes,
        b.device_v.get() + l * layer_bytes, positions, c_.num_kv_heads, c_.head_dim, seq_capacity_,
        /*to_block=*/true, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  return b;
}

absl::Status CudaStage::ImportKv(const KvPlace& place, const KvBlock& block) {
  RETURN_IF_ERROR(NoPages("KV import", place, paged()));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvBlock(block, slot, c_, opt_.dtype, first_layer_,
                               first_layer_ + num_layers_, max_slots_, max_seq_len_));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  const size_t layer_bytes = static_cast<size_t>(block.positions) * RowBytes(c_.kv_dim());
  if (block.on_device()) {
    // Device memory of this GPU only (a block of another GPU comes over a KvLink first).
    for (const uint8_t* p : {block.device_k.get(), block.device_v.get()}) {
      cudaPointerAttributes attr{};
      CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
      if (attr.type != cudaMemoryTypeDevice || attr.device != opt_.device) {
        return absl::InvalidArgumentError(
            absl::StrCat("KV block: in the memory of ",
                         attr.type == cudaMemoryTypeDevice ? absl::StrCat("device ", attr.device)
                                                           : std::string("no device"),
                         ", this stage runs on device ", opt_.device));
      }
    }
    for (int l = 0; l < block.num_layers; ++l) {
      const int layer = block.first_layer - first_layer_ + l;
      RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(
          KCache(layer), VCache(layer), slot, block.device_k.get() + l * layer_bytes,
          block.device_v.get() + l * layer_bytes, block.positions, c_.num_kv_heads, c_.head_dim,
          seq_capacity_, /*to_block=*/false, stream_.get()));
    }
    RETURN_IF_ERROR(Drain());
    cached_len_[slot] = block.positions;
    return absl::OkStatus();
  }
  // The reverse of ExportKv's copies, per layer.
  for (int l = 0; l < block.num_layers; ++l) {
    const int layer = block.first_layer - first_layer_ + l;
    const auto [k_stage, v_stage] = KvStaging(layer);
    CUDA_CHECK(cudaMemcpyAsync(k_stage, block.k.data() + l * layer_bytes, layer_bytes,
                               cudaMemcpyHostToDevice, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(v_stage, block.v.data() + l * layer_bytes, layer_bytes,
                               cudaMemcpyHostToDevice, stream_.get()));
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(layer), VCache(layer), slot, k_stage, v_stage,
                                            block.positions, c_.num_kv_heads, c_.head_dim,
                                            seq_capacity_, /*to_block=*/false, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  cached_len_[slot] = block.positions;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<KvOut>> CudaStage::OpenKvOut(const KvPlace& place, int positions) {
  RETURN_IF_ERROR(NoPages("KV write-out", place, paged()));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvOut(slot, positions, first_layer_, first_layer_ + num_layers_,
                             max_slots_, max_seq_len_));
  ASSIGN_OR_RETURN(KvBlock b, DeviceKvBlock(first_layer_, num_layers_, positions));
  auto out = std::make_shared<KvOut>(std::move(b), slot);
  kv_outs_.Add(out);
  return out;
}

absl::Status CudaStage::WriteOut(KvOut& out, int l) {
  KvBlock& b = out.block_to_write();
  const size_t layer_bytes = static_cast<size_t>(b.positions) * RowBytes(c_.kv_dim());
  RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(l), VCache(l), out.slot(),
                                          b.device_k.get() + l * layer_bytes,
                                          b.device_v.get() + l * layer_bytes, b.positions,
                                          c_.num_kv_heads, c_.head_dim, seq_capacity_,
                                          /*to_block=*/true, stream_.get()));
  auto written = std::make_shared<cuda::Event>();
  CUDA_CHECK(cudaEventCreateWithFlags(written->put(), cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(written->get(), stream_.get()));
  out.Written(l, [written, device = opt_.device]() -> absl::Status {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaEventSynchronize(written->get()));
    return absl::OkStatus();
  });
  return absl::OkStatus();
}

}  // namespace tandem
