// KvAssembler on any KvChunk a peer could send (the input in protobuf's text format, or else
// KvChunk's wire format), given once and then again one position further: each chunk is taken or
// refused with INVALID_ARGUMENT, and a block handed out holds exactly the bytes its fields say,
// which cut into chunks again and put together give the same block. The same chunk read as the
// header of a block sent over NCCL is taken or refused with INVALID_ARGUMENT, and a block taken
// has the shape's layers and the header's positions, and sizes its memory without overflow.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_support.h"
#include "worker/transport/kv_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::v1::KvChunk chunk;
  if (!tandem::fuzz::ParseTextOrBinary(std::string_view(reinterpret_cast<const char*>(data), size),
                                       chunk)) {
    return 0;
  }
  const tandem::KvShape shape{
      .first_layer = 0, .num_layers = 1, .num_kv_heads = 2, .head_dim = 3, .max_positions = 64};
  absl::StatusOr<tandem::KvBlock> over_nccl = tandem::KvBlockOfNcclHeader(chunk, shape);
  if (!over_nccl.ok()) {
    if (over_nccl.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  } else if (over_nccl->first_layer != shape.first_layer ||
             over_nccl->num_layers != shape.num_layers ||
             over_nccl->positions != chunk.total_positions() || over_nccl->positions < 1 ||
             over_nccl->positions > shape.max_positions || over_nccl->expected_bytes() == 0 ||
             over_nccl->on_device()) {
    std::abort();
  }
  tandem::KvAssembler assembler(shape);
  tandem::v1::KvChunk next = chunk;
  // One position further, where that is still an int32 (the assembler refuses either way).
  const int64_t after = int64_t{chunk.first_position()} + chunk.positions();
  next.set_first_position(after >= INT32_MIN && after <= INT32_MAX ? static_cast<int32_t>(after)
                                                                   : chunk.first_position());
  for (const tandem::v1::KvChunk* c : {&chunk, &next}) {
    const absl::Status s = assembler.Add(*c);
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) std::abort();
  }
  absl::StatusOr<tandem::KvBlock> block = assembler.Take(chunk.key());
  if (!block.ok()) {
    if (block.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  const size_t want = block->expected_bytes();
  if (want == 0 || block->k.size() != want || block->v.size() != want) std::abort();
  tandem::KvAssembler again(shape);
  absl::StatusOr<bool> sent = tandem::ForEachKvChunk(
      chunk.key(), *block, 7, [&](const tandem::v1::KvChunk& c) { return again.Add(c).ok(); });
  if (!sent.ok() || !*sent) std::abort();
  absl::StatusOr<tandem::KvBlock> round = again.Take(chunk.key());
  if (!round.ok() || round->k != block->k || round->v != block->v) std::abort();
  return 0;
}
