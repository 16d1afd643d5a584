// Element types of checkpoints and activations, and conversions between them on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem {

// kF8E4M3 (OCP FP8 E4M3FN: no infinities, largest finite 448) is a storage type only, of scaled
// codes: of quantized weights, and of a KV-cache kept in FP8 (KvCacheDType); never of activations.
enum class DType { kF32, kF16, kBF16, kF8E4M3 };

// Bytes per element.
constexpr size_t DTypeSize(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kF8E4M3 ? 1 : 2;
}
// The safetensors spelling: "F32", "F16", "BF16", "F8_E4M3".
std::string_view DTypeName(DType t);
// Safetensors names of the types activations and KV-cache travel in (F32, F16, BF16); the
// checkpoint reader also takes F8_E4M3.
absl::StatusOr<DType> ParseDType(std::string_view name);
// torch_dtype spelling in config.json: "float32", "float16", "bfloat16".
std::string_view TorchDTypeName(DType t);
absl::StatusOr<DType> ParseTorchDType(std::string_view name);
// A 2-byte activation type as a command-line flag gives it (f16, fp16, float16, half, bf16,
// bfloat16); INVALID_ARGUMENT "<flag>: '<name>' (expected f16 or bf16)" otherwise.
absl::StatusOr<DType> ParseHalfDTypeFlag(std::string_view name, std::string_view flag);

// IEEE half <-> float, round to nearest even; handles subnormals, inf and NaN.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
// bfloat16 <-> float, round to nearest even (NaN stays NaN).
uint16_t FloatToBF16(float f);
float BF16ToFloat(uint16_t b);

// E4M3FN <-> float. FloatToE4M3 rounds to nearest even and saturates: finite values beyond
// +-448 (and infinities) become +-448; NaN becomes the NaN code 0x7f.
uint8_t FloatToE4M3(float f);
float E4M3ToFloat(uint8_t b);
// The largest finite E4M3FN value.
inline constexpr float kE4M3Max = 448.0f;

// The KV-cache's element type as a setting names it (vLLM's --kv-cache-dtype). kAuto: the
// model's dtype as the backend computes it (fp32 on the CPU backend, --dtype on CUDA). kFp8E4M3:
// E4M3 codes of each layer's K and V divided by the layer's scales (common/fp8_quantize.h,
// EncodeKvE4M3), one byte per element; it needs the paged KV-cache.
enum class KvCacheDType { kAuto, kFp8E4M3 };
// "auto" or "" (kAuto), "fp8" or "fp8_e4m3" (kFp8E4M3); INVALID_ARGUMENT
// "<what>: '<name>' is not a KV-cache dtype (expected auto, fp8 or fp8_e4m3)" otherwise.
absl::StatusOr<KvCacheDType> ParseKvCacheDType(std::string_view name, std::string_view what);
// "auto" or "fp8_e4m3": how settings, reports and AssignStageRequest spell it.
std::string_view KvCacheDTypeName(KvCacheDType t);

// Converts `n` elements of type `t` at `src` (any alignment) to float.
void ToFloat(DType t, const void* src, size_t n, float* dst);
// Converts `n` floats to type `t` at `dst` (any alignment).
void FromFloat(DType t, const float* src, size_t n, void* dst);

}  // namespace tandem
