// ParseModelConfig on any text: an accepted config has the invariants the engine builds on
// (positive sizes, heads dividing hidden size and each other, products that fit an int).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = tandem::ParseModelConfig(text, "config.json");
  if (!config.ok()) return 0;
  const tandem::ModelConfig& c = *config;
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_layers <= 0 ||
      c.num_heads <= 0 || c.num_kv_heads <= 0 || c.head_dim <= 0 || c.max_positions <= 0) {
    std::abort();
  }
  if (c.num_heads % c.num_kv_heads != 0) std::abort();
  if (!c.windowed_layers.empty() && static_cast<int>(c.windowed_layers.size()) != c.num_layers) {
    std::abort();
  }
  // The products the engine forms (UBSan reports an overflow inside them).
  const int64_t q = c.q_dim(), kv = c.kv_dim();
  if (q <= 0 || kv <= 0) std::abort();
  for (int layer = 0; layer < c.num_layers && layer < 4; ++layer) {
    (void)c.attention_scale(layer);
    if (c.attention_window(layer) < 0) std::abort();
  }
  // What the generator writes for an accepted config is read back as the same shape.
  auto again = tandem::ParseModelConfig(tandem::ModelConfigToJson(c), "config.json (written)");
  if (!again.ok() || again->hidden_size != c.hidden_size || again->num_layers != c.num_layers ||
      again->vocab_size != c.vocab_size || again->head_dim != c.head_dim) {
    std::abort();
  }
  return 0;
}
