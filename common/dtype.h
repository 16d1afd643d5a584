// Element types of checkpoints and activations, and conversions between them on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace tandem {

enum class DType { kF32, kF16, kBF16 };

// Bytes per element.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
// The safetensors spelling: "F32", "F16", "BF16".
std::string_view DTypeName(DType t);
absl::StatusOr<DType> ParseDType(std::string_view name);  // safetensors names
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

// Converts `n` elements of type `t` at `src` (any alignment) to float.
void ToFloat(DType t, const void* src, size_t n, float* dst);
// Converts `n` floats to type `t` at `dst` (any alignment).
void FromFloat(DType t, const float* src, size_t n, void* dst);

}  // namespace tandem
