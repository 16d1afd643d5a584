// KV blocks on the wire: a block cut into chunks of any size comes back byte for byte, a layer
// slice is the right bytes, and a chunk that does not fit the receiving stage, its sequence's
// earlier chunks or its layer's position is refused naming the field; a block with a gap is not
// handed out. A block in device memory is sliced as views into the same memory and never cut
// into chunks of host bytes; the message that announces a block sent over NCCL carries its fields
// only and is refused, naming the field, where it does not fit every layer and position asked for.
// A block of an FP8 KV-cache travels with each layer's scales, in every chunk and in the NCCL
// header; chunks that lack them, disagree on them or carry them with another dtype are refused.
#include "worker/transport/kv_wire.h"

#include <cmath>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

// Layers [first, first + layers) of 2 KV heads of 3, `positions` positions, f16; byte i of K is
// i % 251 and of V 255 - i % 251, so that any misplaced byte shows.
KvBlock Block(int first, int layers, int positions) {
  KvBlock b;
  b.dtype = DType::kF16;
  b.first_layer = first;
  b.num_layers = layers;
  b.num_kv_heads = 2;
  b.head_dim = 3;
  b.positions = positions;
  b.k.resize(b.expected_bytes());
  b.v.resize(b.expected_bytes());
  for (size_t i = 0; i < b.k.size(); ++i) {
    b.k[i] = static_cast<uint8_t>(i % 251);
    b.v[i] = static_cast<uint8_t>(255 - i % 251);
  }
  return b;
}

KvShape ShapeOf(const KvBlock& b, int max_positions = 64) {
  return {.first_layer = b.first_layer,
          .num_layers = b.num_layers,
          .num_kv_heads = b.num_kv_heads,
          .head_dim = b.head_dim,
          .max_positions = max_positions};
}

std::vector<v1::KvChunk> Chunks(uint64_t key, const KvBlock& b, int64_t max_bytes) {
  std::vector<v1::KvChunk> out;
  absl::StatusOr<bool> all = ForEachKvChunk(key, b, max_bytes, [&](const v1::KvChunk& c) {
    out.push_back(c);
    return true;
  });
  EXPECT_TRUE(all.ok() && *all);
  return out;
}

TEST(KvWireTest, ChunksOfAnySizeComeBackByteForByte) {
  const KvBlock b = Block(2, 3, 7);  // 12 bytes per position of K
  // One position per chunk, three (the last one short) and the whole layer.
  for (int64_t max_bytes : {1, 24, 72, 1 << 20}) {
    const std::vector<v1::KvChunk> chunks = Chunks(5, b, max_bytes);
    const size_t per_layer = max_bytes <= 24 ? 7 : max_bytes == 72 ? 3 : 1;
    EXPECT_EQ(chunks.size(), 3 * per_layer) << max_bytes;
    KvAssembler a(ShapeOf(b));
    for (const v1::KvChunk& c : chunks) ASSERT_TRUE(a.Add(c).ok()) << a.Add(c);
    absl::StatusOr<KvBlock> got = a.Take(5);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->first_layer, 2);
    EXPECT_EQ(got->num_layers, 3);
    EXPECT_EQ(got->positions, 7);
    EXPECT_EQ(got->dtype, DType::kF16);
    EXPECT_EQ(got->k, b.k) << max_bytes;
    EXPECT_EQ(got->v, b.v) << max_bytes;
    EXPECT_FALSE(a.Take(5).ok()) << "taken twice";
  }
}

TEST(KvWireTest, SequencesAndLayersInterleavedStayApart) {
  const KvBlock x = Block(0, 2, 4);
  KvBlock y = Block(0, 2, 5);
  for (uint8_t& c : y.k) c ^= 0x5a;
  std::vector<v1::KvChunk> cx = Chunks(1, x, 24), cy = Chunks(2, y, 24);
  KvAssembler a(ShapeOf(x));
  // Layer 1 of x before its layer 0, and y's chunks in between.
  for (size_t i = cx.size() / 2; i < cx.size(); ++i) ASSERT_TRUE(a.Add(cx[i]).ok());
  for (const v1::KvChunk& c : cy) ASSERT_TRUE(a.Add(c).ok());
  for (size_t i = 0; i < cx.size() / 2; ++i) ASSERT_TRUE(a.Add(cx[i]).ok());
  absl::StatusOr<KvBlock> gx = a.Take(1), gy = a.Take(2);
  ASSERT_TRUE(gx.ok() && gy.ok());
  EXPECT_EQ(gx->k, x.k);
  EXPECT_EQ(gy->k, y.k);
  EXPECT_EQ(gy->positions, 5);
}

// Chunks of some of a block's layers are the chunks of their slice.
TEST(KvWireTest, ChunksOfALayerRangeAreThoseOfItsSlice) {
  const KvBlock b = Block(4, 4, 3);
  std::vector<v1::KvChunk> chunks;
  absl::StatusOr<bool> sent = ForEachKvChunk(
      1, b, 24,
      [&](const v1::KvChunk& c) {
        chunks.push_back(c);
        return true;
      },
      5, 2);
  ASSERT_TRUE(sent.ok() && *sent);
  KvAssembler a({.first_layer = 5, .num_layers = 2, .num_kv_heads = 2, .head_dim = 3,
                 .max_positions = 64});
  for (const v1::KvChunk& c : chunks) ASSERT_TRUE(a.Add(c).ok());
  absl::StatusOr<KvBlock> got = a.Take(1);
  absl::StatusOr<KvBlock> slice = SliceKvLayers(b, 5, 2);
  ASSERT_TRUE(got.ok() && slice.ok());
  EXPECT_EQ(got->k, slice->k);
  EXPECT_EQ(got->v, slice->v);
  EXPECT_THAT(ForEachKvChunk(1, b, 24, [](const v1::KvChunk&) { return true; }, 7, 2)
                  .status()
                  .message(),
              HasSubstr("[7, 9) are not within the held [4, 8)"));
  // A receiver that stops the stream stops the chunks.
  int calls = 0;
  absl::StatusOr<bool> stopped =
      ForEachKvChunk(1, b, 24, [&](const v1::KvChunk&) { return ++calls < 2; });
  ASSERT_TRUE(stopped.ok());
  EXPECT_FALSE(*stopped);
  EXPECT_EQ(calls, 2);
}

TEST(KvWireTest, SliceTakesTheLayersBytes) {
  const KvBlock b = Block(4, 4, 3);
  absl::StatusOr<KvBlock> s = SliceKvLayers(b, 5, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->first_layer, 5);
  EXPECT_EQ(s->num_layers, 2);
  const size_t layer = 3 * 2 * 3 * 2;  // positions x heads x head_dim x 2 bytes
  ASSERT_EQ(s->k.size(), 2 * layer);
  EXPECT_TRUE(std::equal(s->k.begin(), s->k.end(), b.k.begin() + layer));
  EXPECT_TRUE(std::equal(s->v.begin(), s->v.end(), b.v.begin() + layer));
  EXPECT_TRUE(SliceKvLayers(b, 4, 4).ok());
  EXPECT_THAT(SliceKvLayers(b, 3, 2).status().message(), HasSubstr("[3, 5)"));
  EXPECT_THAT(SliceKvLayers(b, 7, 2).status().message(), HasSubstr("not within the held [4, 8)"));
  EXPECT_FALSE(SliceKvLayers(b, 5, 0).ok());
}

TEST(KvWireTest, ChunksThatDoNotFitAreRefusedNamingTheField) {
  const KvBlock b = Block(0, 2, 4);
  const v1::KvChunk good = Chunks(9, b, 24).front();  // layer 0, positions [0, 1)
  struct Case {
    const char* says;
    void (*spoil)(v1::KvChunk&);
  };
  const Case cases[] = {
      {"version 2", [](v1::KvChunk& c) { c.set_version(2); }},
      {"dtype 'Q4' is none of", [](v1::KvChunk& c) { c.set_dtype("Q4"); }},
      {"layer 2 is not within the expected [0, 2)", [](v1::KvChunk& c) { c.set_layer(2); }},
      {"layer -1", [](v1::KvChunk& c) { c.set_layer(-1); }},
      {"3 KV heads of 3", [](v1::KvChunk& c) { c.set_num_kv_heads(3); }},
      {"2 KV heads of 4", [](v1::KvChunk& c) { c.set_head_dim(4); }},
      {"65 positions, this stage holds 1 to 64", [](v1::KvChunk& c) { c.set_total_positions(65); }},
      {"0 positions", [](v1::KvChunk& c) { c.set_total_positions(0); }},
      {"continues at position 1, expected 0", [](v1::KvChunk& c) { c.set_first_position(1); }},
      {"0 positions from 0", [](v1::KvChunk& c) { c.set_positions(0); }},
      {"5 positions from 0 of 4", [](v1::KvChunk& c) { c.set_positions(5); }},
      {"11 bytes of K and 12 of V", [](v1::KvChunk& c) { c.mutable_k()->pop_back(); }},
      {"12 bytes of K and 13 of V", [](v1::KvChunk& c) { c.mutable_v()->push_back('x'); }},
  };
  for (const Case& bad : cases) {
    v1::KvChunk c = good;
    bad.spoil(c);
    KvAssembler a(ShapeOf(b));
    const absl::Status s = a.Add(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.says;
    EXPECT_THAT(s.message(), HasSubstr(bad.says));
    EXPECT_THAT(s.message(), HasSubstr("sequence 9"));
  }
}

TEST(KvWireTest, LaterChunksMustAgreeWithTheFirstAndNotRepeat) {
  const KvBlock b = Block(0, 1, 4);
  std::vector<v1::KvChunk> chunks = Chunks(3, b, 24);  // four one-position chunks
  KvAssembler a(ShapeOf(b));
  ASSERT_TRUE(a.Add(chunks[0]).ok());
  EXPECT_THAT(a.Add(chunks[0]).message(), HasSubstr("continues at position 0, expected 1"));
  v1::KvChunk longer = chunks[1];
  longer.set_total_positions(5);
  EXPECT_THAT(a.Add(longer).message(), HasSubstr("5 positions, its earlier chunks said 4"));
  v1::KvChunk other_dtype = chunks[1];
  other_dtype.set_dtype("BF16");
  EXPECT_THAT(a.Add(other_dtype).message(), HasSubstr("dtype BF16, its earlier chunks said F16"));
  ASSERT_TRUE(a.Add(chunks[1]).ok());
  ASSERT_TRUE(a.Add(chunks[2]).ok());
  // The last position never came.
  EXPECT_THAT(a.Take(3).status().message(), HasSubstr("layer 0 has 3 of its 4 positions"));
  EXPECT_THAT(a.Take(4).status().message(), HasSubstr("no KV arrived for sequence 4"));
}

TEST(KvWireTest, ABlockMissingALayerIsNotHandedOut) {
  const KvBlock b = Block(0, 2, 2);
  std::vector<v1::KvChunk> chunks = Chunks(1, b, 1 << 20);  // one chunk per layer
  KvAssembler a(ShapeOf(b));
  ASSERT_TRUE(a.Add(chunks[1]).ok());
  EXPECT_THAT(a.Take(1).status().message(), HasSubstr("layer 0 has 0 of its 2 positions"));
}

// A block whose K and V stand in "device memory" (here host memory the test owns: slicing is
// pointer arithmetic only).
KvBlock DeviceBlock(int first, int layers, int positions, std::vector<uint8_t>& memory) {
  KvBlock b = Block(first, layers, positions);
  memory.assign(b.k.begin(), b.k.end());
  memory.insert(memory.end(), b.v.begin(), b.v.end());
  std::shared_ptr<uint8_t> all(memory.data(), [](uint8_t*) {});
  b.device_k = all;
  b.device_v = std::shared_ptr<uint8_t>(all, all.get() + b.k.size());
  b.k.clear();
  b.v.clear();
  return b;
}

TEST(KvWireTest, ADeviceBlockIsSlicedAsViewsAndNeverChunkedFromTheHost) {
  std::vector<uint8_t> memory;
  const KvBlock b = DeviceBlock(4, 4, 3, memory);
  ASSERT_TRUE(b.on_device());
  const size_t layer = 3 * 2 * 3 * 2;
  EXPECT_EQ(b.bytes(), 2 * 4 * layer);
  absl::StatusOr<KvBlock> s = SliceKvLayers(b, 6, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->k.empty() && s->v.empty());
  EXPECT_EQ(s->device_k.get(), memory.data() + 2 * layer);
  EXPECT_EQ(s->device_v.get(), memory.data() + 4 * layer + 2 * layer);
  EXPECT_EQ(s->bytes(), 2 * 2 * layer);
  EXPECT_THAT(SliceKvLayers(b, 7, 2).status().message(), HasSubstr("not within the held [4, 8)"));
  absl::StatusOr<bool> chunks =
      ForEachKvChunk(1, b, 1 << 20, [](const v1::KvChunk&) { return true; });
  EXPECT_EQ(chunks.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(KvWireTest, AnNcclHeaderCarriesTheFieldsOfEveryLayerAndPosition) {
  std::vector<uint8_t> memory;
  const KvBlock b = DeviceBlock(2, 3, 5, memory);
  const v1::KvChunk h = NcclKvHeader(7, b);
  EXPECT_TRUE(h.nccl());
  EXPECT_TRUE(h.k().empty() && h.v().empty());
  absl::StatusOr<KvBlock> got = KvBlockOfNcclHeader(h, ShapeOf(b));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->first_layer, 2);
  EXPECT_EQ(got->num_layers, 3);
  EXPECT_EQ(got->positions, 5);
  EXPECT_EQ(got->dtype, DType::kF16);
  EXPECT_EQ(got->expected_bytes(), b.expected_bytes());
  EXPECT_FALSE(got->on_device());
  // Over gRPC such a message is refused: its bytes are elsewhere.
  KvAssembler a(ShapeOf(b));
  EXPECT_THAT(a.Add(h).message(), HasSubstr("come over NCCL"));
}

TEST(KvWireTest, NcclHeadersThatDoNotFitAreRefusedNamingTheField) {
  std::vector<uint8_t> memory;
  const KvBlock b = DeviceBlock(2, 3, 5, memory);
  const v1::KvChunk good = NcclKvHeader(7, b);
  struct Case {
    const char* says;
    void (*spoil)(v1::KvChunk&);
  };
  const Case cases[] = {
      {"version 3", [](v1::KvChunk& c) { c.set_version(3); }},
      {"dtype 'X' is none of", [](v1::KvChunk& c) { c.set_dtype("X"); }},
      {"layers [3, 6), expected [2, 5)", [](v1::KvChunk& c) { c.set_layer(3); }},
      {"layers [2, 4), expected [2, 5)", [](v1::KvChunk& c) { c.set_num_layers(2); }},
      {"1 KV heads of 3", [](v1::KvChunk& c) { c.set_num_kv_heads(1); }},
      {"65 positions, this stage holds 1 to 64", [](v1::KvChunk& c) { c.set_total_positions(65); }},
      {"positions [1, 6) of 5, expected all", [](v1::KvChunk& c) { c.set_first_position(1); }},
      {"positions [0, 4) of 5, expected all", [](v1::KvChunk& c) { c.set_positions(4); }},
      {"1 bytes in the message", [](v1::KvChunk& c) { c.set_k("x"); }},
      {"were to come over NCCL", [](v1::KvChunk& c) { c.set_nccl(false); }},
  };
  for (const Case& bad : cases) {
    v1::KvChunk c = good;
    bad.spoil(c);
    const absl::Status s = KvBlockOfNcclHeader(c, ShapeOf(b)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.says;
    EXPECT_THAT(s.message(), HasSubstr(bad.says));
    EXPECT_THAT(s.message(), HasSubstr("sequence 7"));
  }
}

// Block(), as codes of an FP8 KV-cache with a pair of scales per layer.
KvBlock Fp8Block(int first, int layers, int positions) {
  KvBlock b = Block(first, layers, positions);
  b.dtype = DType::kF8E4M3;
  b.k.resize(b.expected_bytes());
  b.v.resize(b.expected_bytes());
  for (int l = 0; l < layers; ++l) {
    b.scales.push_back({.k = 0.5f + l, .v = 0.25f / (l + 1)});
  }
  return b;
}

TEST(KvWireTest, Fp8ChunksCarryTheirLayersScalesAndComeBackWithThem) {
  const KvBlock b = Fp8Block(2, 3, 7);  // 6 bytes per position of K
  for (int64_t max_bytes : {1, 36, 1 << 20}) {
    const std::vector<v1::KvChunk> chunks = Chunks(5, b, max_bytes);
    for (const v1::KvChunk& c : chunks) {
      EXPECT_EQ(c.dtype(), "F8_E4M3");
      EXPECT_EQ(c.k_scale(), b.scales[c.layer() - 2].k) << c.layer();
      EXPECT_EQ(c.v_scale(), b.scales[c.layer() - 2].v) << c.layer();
    }
    KvAssembler a(ShapeOf(b));
    for (const v1::KvChunk& c : chunks) ASSERT_TRUE(a.Add(c).ok()) << a.Add(c);
    absl::StatusOr<KvBlock> got = a.Take(5);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->dtype, DType::kF8E4M3);
    EXPECT_EQ(got->scales, b.scales) << max_bytes;
    EXPECT_EQ(got->k, b.k) << max_bytes;
    EXPECT_EQ(got->v, b.v) << max_bytes;
  }
  // A slice keeps its layers' scales, and its chunks are those of its layers.
  absl::StatusOr<KvBlock> s = SliceKvLayers(b, 3, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->scales, std::vector<KvScales>(b.scales.begin() + 1, b.scales.end()));
  EXPECT_EQ(Chunks(5, b, 1 << 20)[2].SerializeAsString(),
            Chunks(5, *s, 1 << 20)[1].SerializeAsString());
  // Chunks of other dtypes have no scales.
  for (const v1::KvChunk& c : Chunks(5, Block(2, 3, 7), 1 << 20)) {
    EXPECT_EQ(c.k_scale(), 0.0f);
    EXPECT_EQ(c.v_scale(), 0.0f);
  }
}

TEST(KvWireTest, Fp8ChunksWithoutGoodScalesOrWithScalesOfAnotherDtypeAreRefused) {
  const KvBlock b = Fp8Block(0, 2, 4);
  const v1::KvChunk good = Chunks(9, b, 6).front();  // layer 0, positions [0, 1)
  struct Case {
    const char* says;
    void (*spoil)(v1::KvChunk&);
  };
  const Case cases[] = {
      {"F8_E4M3 with k_scale 0 and v_scale 0.25", [](v1::KvChunk& c) { c.clear_k_scale(); }},
      {"F8_E4M3 with k_scale 0.5 and v_scale -1", [](v1::KvChunk& c) { c.set_v_scale(-1); }},
      {"F8_E4M3 with k_scale nan", [](v1::KvChunk& c) { c.set_k_scale(std::nanf("")); }},
      {"F8_E4M3 with k_scale inf", [](v1::KvChunk& c) { c.set_k_scale(INFINITY); }},
      {"dtype F16 with scales; only F8_E4M3 chunks have scales",
       [](v1::KvChunk& c) {
         c.set_dtype("F16");
         c.mutable_k()->append(c.k());
         c.mutable_v()->append(c.v());
       }},
  };
  for (const Case& bad : cases) {
    v1::KvChunk c = good;
    bad.spoil(c);
    KvAssembler a(ShapeOf(b));
    const absl::Status s = a.Add(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.says;
    EXPECT_THAT(s.message(), HasSubstr(bad.says));
  }
  // The chunks of a layer agree on its scales.
  std::vector<v1::KvChunk> chunks = Chunks(9, b, 6);
  KvAssembler a(ShapeOf(b));
  ASSERT_TRUE(a.Add(chunks[0]).ok());
  v1::KvChunk other = chunks[1];
  other.set_k_scale(0.75f);
  EXPECT_THAT(a.Add(other).message(),
              HasSubstr("layer 0: k_scale 0.75 and v_scale 0.25, its earlier chunks said 0.5 and "
                        "0.25"));
  // A block of F8_E4M3 without a pair per layer is not sent, nor sliced.
  KvBlock missing = b;
  missing.scales.pop_back();
  absl::StatusOr<bool> sent =
      ForEachKvChunk(1, missing, 1 << 20, [](const v1::KvChunk&) { return true; });
  EXPECT_THAT(sent.status().message(), HasSubstr("has 1 pairs of scales, not 2"));
  EXPECT_FALSE(SliceKvLayers(missing, 0, 1).ok());
}

TEST(KvWireTest, AnFp8NcclHeaderCarriesEveryLayersScales) {
  std::vector<uint8_t> memory;
  KvBlock b = DeviceBlock(2, 3, 5, memory);
  b.dtype = DType::kF8E4M3;
  b.scales = {{0.5f, 0.25f}, {2, 4}, {0.125f, 3}};
  const v1::KvChunk h = NcclKvHeader(7, b);
  EXPECT_EQ(h.dtype(), "F8_E4M3");
  EXPECT_THAT(h.k_scales(), ::testing::ElementsAre(0.5f, 2.0f, 0.125f));
  EXPECT_THAT(h.v_scales(), ::testing::ElementsAre(0.25f, 4.0f, 3.0f));
  absl::StatusOr<KvBlock> got = KvBlockOfNcclHeader(h, ShapeOf(b));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->dtype, DType::kF8E4M3);
  EXPECT_EQ(got->scales, b.scales);
  v1::KvChunk short_of_one = h;
  short_of_one.mutable_v_scales()->RemoveLast();
  EXPECT_THAT(KvBlockOfNcclHeader(short_of_one, ShapeOf(b)).status().message(),
              HasSubstr("F8_E4M3 with 3 k_scales and 2 v_scales for 3 layers"));
  v1::KvChunk zero = h;
  zero.set_k_scales(1, 0.0f);
  EXPECT_THAT(KvBlockOfNcclHeader(zero, ShapeOf(b)).status().message(),
              HasSubstr("layer 3: F8_E4M3 with k_scale 0 and v_scale 4"));
}

}  // namespace
}  // namespace tandem
