// KV blocks in and out of the CUDA stage's cache (its slots, or its pages through a place's block
// table): exports to the host or to device memory, imports, and the write-outs a step fills layer
// by layer as it goes.
#include "worker/cuda/cuda_stage_impl.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace tandem {
namespace {
// A move's block table in device memory: its own small buffer (moves are rare), freed once the
// copies that read it have drained. Empty for a place without pages.
absl::StatusOr<DeviceBuffer> UploadTable(const KvPlace& place) {
  DeviceBuffer table;
  if (place.block_table.empty()) return table;
  const size_t bytes = place.block_table.size() * sizeof(int32_t);
  RETURN_IF_ERROR(table.Allocate(bytes));
  CUDA_CHECK(cudaMemcpy(table.get(), place.block_table.data(), bytes, cudaMemcpyHostToDevice));
  return table;
}
}  // namespace

absl::Status CudaStage::CopyKvLayer(const KvPlace& place, const int32_t* table, int layer,
                                    void* k_block, void* v_block, int positions,
                                    bool to_block) const {
  if (!paged()) {
    return cuda::LaunchKvBlockCopy(KCache(layer), VCache(layer), place.slot, k_block, v_block,
                                   positions, c_.num_kv_heads, c_.head_dim, seq_capacity_,
                                   to_block, stream_.get());
  }
  cuda::KvPages pages = Pages(layer);
  pages.block_table = table;
  pages.table_stride = static_cast<int>(place.block_table.size());
  return cuda::LaunchKvBlockCopyPaged(pages, /*seq=*/0, k_block, v_block, positions,
                                      c_.num_kv_heads, c_.head_dim, to_block, stream_.get());
}

absl::StatusOr<KvBlock> CudaStage::ExportKv(const KvPlace& place, int positions, int first_layer,
                                            int num_layers) const {
  RETURN_IF_ERROR(
      CheckKvPlace("KV export", place, positions, page_size_, num_pages_, max_seq_len_));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, first_layer_,
                                first_layer_ + num_layers_, max_slots_,
                                slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  KvBlock b = SizedKvBlock(KvDType(), first_layer, num_layers, c_.num_kv_heads, c_.head_dim,
                           positions);
  b.scales = ScalesOf(first_layer, num_layers);
  if (paged()) {
    // No staging rows beside the pages: gathered into device memory, then copied whole (the
    // block's layout is the same in both).
    ASSIGN_OR_RETURN(const KvBlock d, ExportKvToDevice(place, positions, first_layer, num_layers));
    CUDA_CHECK(cudaMemcpy(b.k.data(), d.device_k.get(), b.k.size(), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.v.data(), d.device_v.get(), b.v.size(), cudaMemcpyDeviceToHost));
    return b;
  }
  // Per layer: the slot's rows (or pages) gathered into the block's layout on the device, then
  // one copy each of K and V to the host, all on the stage's stream behind the steps queued
  // before.
  const size_t layer_bytes = static_cast<size_t>(positions) * KvRowBytes(c_.kv_dim());
  for (int l = 0; l < num_layers; ++l) {
    const int layer = first_layer - first_layer_ + l;
    const auto [k_stage, v_stage] = KvStaging(layer);
    RETURN_IF_ERROR(CopyKvLayer(place, nullptr, layer, k_stage, v_stage, positions,
                                /*to_block=*/true));
    CUDA_CHECK(cudaMemcpyAsync(b.k.data() + l * layer_bytes, k_stage, layer_bytes,
                               cudaMemcpyDeviceToHost, stream_.get()));
    CUDA_CHECK(cudaMemcpyAsync(b.v.data() + l * layer_bytes, v_stage, layer_bytes,
                               cudaMemcpyDeviceToHost, stream_.get()));
  }
  RETURN_IF_ERROR(Drain());
  return b;
}

absl::StatusOr<KvBlock> CudaStage::DeviceKvBlock(int first_layer, int num_layers, int positions,
                                                 std::span<const int32_t> table) const {
  KvBlock b = KvBlockOf(KvDType(), first_layer, num_layers, c_.num_kv_heads, c_.head_dim,
                        positions);
  b.scales = ScalesOf(first_layer, num_layers);
  const size_t bytes = b.expected_bytes(), table_bytes = table.size_bytes();
  ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> mem,
                   SharedDeviceBytes(opt_.device, 2 * bytes + table_bytes));
  b.device_k = mem;
  b.device_v = std::shared_ptr<uint8_t>(mem, mem.get() + bytes);
  if (table_bytes > 0) {
    CUDA_CHECK(
        cudaMemcpy(mem.get() + 2 * bytes, table.data(), table_bytes, cudaMemcpyHostToDevice));
  }
  return b;
}

absl::StatusOr<KvBlock> CudaStage::ExportKvToDevice(const KvPlace& place, int positions,
                                                    int first_layer, int num_layers) const {
  RETURN_IF_ERROR(
      CheckKvPlace("KV export", place, positions, page_size_, num_pages_, max_seq_len_));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvExport(slot, positions, first_layer, num_layers, first_layer_,
                                first_layer_ + num_layers_, max_slots_,
                                slot >= 0 && slot < max_slots_ ? cached_len_[slot] : 0));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  ASSIGN_OR_RETURN(const DeviceBuffer table, UploadTable(place));
  ASSIGN_OR_RETURN(KvBlock b, DeviceKvBlock(first_layer, num_layers, positions));
  // Per layer: the slot's rows (or pages) gathered straight into the block, on the stage's
  // stream.
  const size_t layer_bytes = static_cast<size_t>(positions) * KvRowBytes(c_.kv_dim());
  for (int l = 0; l < num_layers; ++l) {
    const int layer = first_layer - first_layer_ + l;
    RETURN_IF_ERROR(CopyKvLayer(place, table.as<int32_t>(), layer,
                                b.device_k.get() + l * layer_bytes,
                                b.device_v.get() + l * layer_bytes, positions, /*to_block=*/true));
  }
  RETURN_IF_ERROR(Drain());
  return b;
}

absl::Status CudaStage::ImportKv(const KvPlace& place, const KvBlock& block) {
  RETURN_IF_ERROR(
      CheckKvPlace("KV import", place, block.positions, page_size_, num_pages_, max_seq_len_));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvBlock(block, slot, c_, KvDType(), first_layer_,
                               first_layer_ + num_layers_, max_slots_, max_seq_len_, kv_scales_));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  if (paged() && !block.on_device()) {
    // No staging rows beside the pages: the whole block to device memory, then imported from
    // there.
    ASSIGN_OR_RETURN(KvBlock d,
                     DeviceKvBlock(block.first_layer, block.num_layers, block.positions));
    CUDA_CHECK(cudaMemcpy(d.device_k.get(), block.k.data(), block.k.size(),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d.device_v.get(), block.v.data(), block.v.size(),
                          cudaMemcpyHostToDevice));
    return ImportKv(place, d);
  }
  ASSIGN_OR_RETURN(const DeviceBuffer table, UploadTable(place));
  const size_t layer_bytes = static_cast<size_t>(block.positions) * KvRowBytes(c_.kv_dim());
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
      RETURN_IF_ERROR(CopyKvLayer(place, table.as<int32_t>(), layer,
                                  block.device_k.get() + l * layer_bytes,
                                  block.device_v.get() + l * layer_bytes, block.positions,
                                  /*to_block=*/false));
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
    RETURN_IF_ERROR(CopyKvLayer(place, nullptr, layer, k_stage, v_stage, block.positions,
                                /*to_block=*/false));
  }
  RETURN_IF_ERROR(Drain());
  cached_len_[slot] = block.positions;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<KvOut>> CudaStage::OpenKvOut(const KvPlace& place, int positions) {
  RETURN_IF_ERROR(
      CheckKvPlace("KV write-out", place, positions, page_size_, num_pages_, max_seq_len_));
  const int slot = place.slot;
  RETURN_IF_ERROR(CheckKvOut(slot, positions, first_layer_, first_layer_ + num_layers_,
                             max_slots_, max_seq_len_));
  CUDA_CHECK(cudaSetDevice(opt_.device));
  // Paged: the place's block table rides in the block's device memory, after V (WriteOut reads it
  // there while the step runs; it goes when the block does).
  ASSIGN_OR_RETURN(KvBlock b, DeviceKvBlock(first_layer_, num_layers_, positions,
                                            paged() ? std::span<const int32_t>(place.block_table)
                                                    : std::span<const int32_t>()));
  auto out = std::make_shared<KvOut>(std::move(b), place);
  kv_outs_.Add(out);
  return out;
}

absl::Status CudaStage::WriteOut(KvOut& out, int l) {
  KvBlock& b = out.block_to_write();
  const size_t layer_bytes = static_cast<size_t>(b.positions) * KvRowBytes(c_.kv_dim());
  uint8_t* k_block = b.device_k.get() + l * layer_bytes;
  uint8_t* v_block = b.device_v.get() + l * layer_bytes;
  if (paged()) {
    cuda::KvPages pages = Pages(l);
    pages.block_table = reinterpret_cast<const int32_t*>(b.device_v.get() + b.expected_bytes());
    pages.table_stride = static_cast<int>(out.place().block_table.size());
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopyPaged(pages, /*seq=*/0, k_block, v_block, b.positions,
                                                 c_.num_kv_heads, c_.head_dim, /*to_block=*/true,
                                                 stream_.get()));
  } else {
    RETURN_IF_ERROR(cuda::LaunchKvBlockCopy(KCache(l), VCache(l), out.slot(), k_block, v_block,
                                            b.positions, c_.num_kv_heads, c_.head_dim,
                                            seq_capacity_, /*to_block=*/true, stream_.get()));
  }
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
