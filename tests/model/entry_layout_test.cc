#include "ess/model/entry_layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <random>
#include <vector>

#include "ess/core/error.h"
#include "ess/model/model_spec.h"
#include "ess/model/numerics.h"

namespace ess {
namespace {

TEST(LatentLayout, PinsTheDeepSeekV32ByteLayout) {
  const LatentLayout l = LatentLayout::for_model(ModelSpec::deepseek_v32_exp());
  EXPECT_EQ(l.nope_dim, 512);
  EXPECT_EQ(l.rope_dim, 64);
  EXPECT_EQ(l.num_scales(), 4);
  EXPECT_EQ(l.nope_offset(), 0u);
  EXPECT_EQ(l.scale_offset(), 512u);
  EXPECT_EQ(l.rope_offset(), 528u);
  EXPECT_EQ(l.bytes(), 656u);
  EXPECT_EQ(l.bytes(), 41u * 16u);
}

TEST(LatentLayout, QuantizesToTheExactBytes) {
  const LatentLayout l;
  std::vector<float> nope(512, 0.0f), rope(64, 0.0f);
  nope[0] = 1.0f;        // tile 0: amax 1 -> scale 2^-8, 1 / 2^-8 = 256 -> fp8 0x78
  nope[128] = -448.0f;   // tile 1: amax 448 -> scale 1 -> fp8 0xFE
  nope[129] = 3.0f;      //   3 -> 0x44 (1.5 x 2^1)
  nope[300] = 0.1f;      // tile 2: amax 0.1 -> 0.1/448 = 2^-12.13 -> scale 2^-12; 409.6 -> 416 (0x7D)
  rope[0] = 1.0f;        // bf16 0x3F80
  rope[63] = -2.0f;      // bf16 0xC000
  std::vector<std::uint8_t> e(656, 0xAA);
  quantize_latent(l, nope, rope, e);

  EXPECT_EQ(e[0], 0x78);
  EXPECT_EQ(e[1], 0x00);
  EXPECT_EQ(e[128], 0xFE);
  EXPECT_EQ(e[129], 0x44);
  EXPECT_EQ(e[300], 0x7D);
  const auto scale_at = [&](int t) {
    float s = 0.0f;
    std::memcpy(&s, e.data() + 512 + 4 * t, 4);
    return s;
  };
  EXPECT_EQ(scale_at(0), std::ldexp(1.0f, -8));
  EXPECT_EQ(scale_at(1), 1.0f);
  EXPECT_EQ(scale_at(2), std::ldexp(1.0f, -12));
  EXPECT_EQ(scale_at(3), std::ldexp(1.0f, -13));  // all-zero tile: the 1e-4 floor
  // Little-endian fp32 2^-8 = 0x3B800000.
  EXPECT_EQ(e[512], 0x00);
  EXPECT_EQ(e[513], 0x00);
  EXPECT_EQ(e[514], 0x80);
  EXPECT_EQ(e[515], 0x3B);
  // RoPE part as little-endian bf16 from byte 528.
  EXPECT_EQ(e[528], 0x80);
  EXPECT_EQ(e[529], 0x3F);
  EXPECT_EQ(e[528 + 126], 0x00);
  EXPECT_EQ(e[528 + 127], 0xC0);
}

TEST(LatentLayout, RoundTripErrorIsBoundedAndRequantizingIsLossless) {
  const LatentLayout l;
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> nope(512), rope(64), nope2(512), rope2(64);
  for (int rep = 0; rep < 50; ++rep) {
    for (std::size_t d = 0; d < nope.size(); ++d) nope[d] = n(rng) * std::ldexp(1.0f, static_cast<int>(d / 128) * 3 - 4);
    for (float& v : rope) v = n(rng);
    std::vector<std::uint8_t> e(656), e2(656);
    quantize_latent(l, nope, rope, e);
    dequantize_latent(l, e, nope2, rope2);
    for (int t = 0; t < 4; ++t) {
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i) amax = std::fmax(amax, std::fabs(nope[t * 128 + i]));
      for (int i = 0; i < 128; ++i) {
        const int d = t * 128 + i;
        // e4m3: 3 mantissa bits -> relative error <= 2^-4 in the normal range; absolute
        // error of subnormals <= half the smallest step of the tile.
        EXPECT_LE(std::fabs(nope2[d] - nope[d]),
                  std::fmax(std::fabs(nope[d]) * 0.0625f, pow2_block_scale(amax) * std::ldexp(1.0f, -10)))
            << "d = " << d;
      }
    }
    for (int i = 0; i < 64; ++i) EXPECT_LE(std::fabs(rope2[i] - rope[i]), std::fabs(rope[i]) * std::ldexp(1.0f, -8));
    // Dequantized values are representable: quantizing them again loses nothing. (The bytes
    // may differ: a tile whose amax rounded up to exactly 448 x 2^k gets the smaller scale.)
    quantize_latent(l, nope2, rope2, e2);
    std::vector<float> nope3(512), rope3(64);
    dequantize_latent(l, e2, nope3, rope3);
    EXPECT_EQ(nope3, nope2);
    EXPECT_EQ(rope3, rope2);
  }
}

// DeepSeek-V4's C4 entry as SGLang stores it (dsv4_main_kv_store.py: 448 FP8 NoPE values, 64 bf16
// RoPE values, 7 ue8m0 scales; deepseek_v4/kvcacheio.cuh: a 576-byte value and an 8-byte scale).
TEST(LatentLayout, PinsTheDeepSeekV4C4ByteLayout) {
  const LatentLayout l{448, 64, 64, ScaleFormat::kUe8m0};
  EXPECT_EQ(l.num_scales(), 7);
  EXPECT_EQ(l.nope_offset(), 0u);
  EXPECT_EQ(l.rope_offset(), 448u);
  EXPECT_EQ(l.value_bytes(), 576u);
  EXPECT_EQ(l.scale_offset(), 576u);
  EXPECT_EQ(l.scale_bytes(), 8u);
  EXPECT_EQ(l.data_bytes(), 584u);
  EXPECT_EQ(l.bytes(), 592u);
  const C4Page page = C4Page::of(l);  // kvcacheio.cuh's kPageBytes and kScaleOffset
  EXPECT_EQ(page.bytes(), 37440u);
  EXPECT_EQ(page.scale_offset(), 36864u);
}

// The C4 quantizer's bytes, worked by hand from SGLang's reference kernel (_quant_k_cache_fused_kernel:
// amax floored at 1e-8, scale = 2^ceil(log2(amax / 448)), fp8 = clamp(x / scale), scale byte =
// exponent + 127), on 64-value tiles.
TEST(LatentLayout, QuantizesC4EntriesToTheExactBytes) {
  const LatentLayout l{448, 64, 64, ScaleFormat::kUe8m0};
  std::vector<float> nope(448, 0.0f), rope(64, 0.0f);
  nope[0] = 1.0f;       // tile 0: amax 1 -> 1/448 = 2^-8.8 -> scale 2^-8 (byte 119); 256 -> 0x78
  nope[64] = -448.0f;   // tile 1: amax 448 -> scale 1 (byte 127); -448 -> 0xFE
  nope[65] = 3.0f;      //   3 -> 0x44
  nope[200] = 0.1f;     // tile 3: 0.1/448 = 2^-12.13 -> scale 2^-12 (byte 115); 409.6 -> 416 (0x7D)
  rope[0] = 1.0f;       // bf16 0x3F80 at 448
  rope[63] = -2.0f;     // bf16 0xC000 at 574
  std::vector<std::uint8_t> e(592, 0xAA);
  quantize_latent(l, nope, rope, e);
  EXPECT_EQ(e[0], 0x78);
  EXPECT_EQ(e[64], 0xFE);
  EXPECT_EQ(e[65], 0x44);
  EXPECT_EQ(e[200], 0x7D);
  EXPECT_EQ(e[1], 0x00);
  EXPECT_EQ(e[448], 0x80);
  EXPECT_EQ(e[449], 0x3F);
  EXPECT_EQ(e[574], 0x00);
  EXPECT_EQ(e[575], 0xC0);
  // Scales: tiles 0..6. An all-zero tile: amax floored at 1e-8 -> 1e-8/448 = 2^-35.4 -> 2^-35 (byte 92).
  const std::uint8_t scales[8] = {119, 127, 92, 115, 92, 92, 92, 0};
  for (int t = 0; t < 8; ++t) EXPECT_EQ(e[576 + static_cast<std::size_t>(t)], scales[t]) << "scale byte " << t;
  for (std::size_t i = 584; i < 592; ++i) EXPECT_EQ(e[i], 0) << "padding byte " << i;
  std::vector<float> n2(448), r2(64);
  dequantize_latent(l, e, n2, r2);
  EXPECT_EQ(n2[0], 1.0f);
  EXPECT_EQ(n2[64], -448.0f);
  EXPECT_EQ(n2[65], 3.0f);
  EXPECT_EQ(n2[200], 416.0f / 4096.0f);
  EXPECT_EQ(r2[63], -2.0f);
  std::vector<std::uint8_t> again(592);
  quantize_latent(l, n2, r2, again);  // requantizing what was dequantized gives the same bytes
  EXPECT_EQ(again, e);
}

TEST(LatentLayout, ReadsTheDeepSeekV4EntryFromItsConfig) {
  ModelSpec m = ModelSpec::deepseek_v32_exp();
  m.model_type = "deepseek_v4";
  m.head_dim = 512;
  m.qk_rope_head_dim = 64;
  const LatentLayout l = LatentLayout::for_model(m);
  EXPECT_EQ(l.nope_dim, 448);
  EXPECT_EQ(l.tile, 64);
  EXPECT_EQ(l.scales, ScaleFormat::kUe8m0);
  EXPECT_EQ(l.bytes(), 592u);
  EXPECT_THROW((LatentLayout{448, 64, 128, ScaleFormat::kUe8m0}.validate()), Error);  // V4 tiles are 64
  EXPECT_THROW((LatentLayout{450, 64, 64, ScaleFormat::kUe8m0}.validate()), Error);
}

// SGLang's DSA pool in bf16 (--kv-cache-dtype bfloat16, its default on Hopper): the latent's 576
// values in bf16, NoPE then RoPE, no scales; stored bf16-rounded and read back exactly.
TEST(LatentLayout, PinsTheBf16LatentAndStoresItExactly) {
  nlohmann::json j = ModelSpec::deepseek_v32_exp().to_json();
  j["kv_cache_dtype"] = "bf16";
  const ModelSpec m = ModelSpec::from_json(j, "bf16");
  EXPECT_EQ(m.kv_cache_dtype, "bfloat16");
  const LatentLayout l = LatentLayout::for_model(m);
  EXPECT_EQ(l.scales, ScaleFormat::kNone);
  EXPECT_EQ(l.num_scales(), 0);
  EXPECT_EQ(l.rope_offset(), 1024u);
  EXPECT_EQ(l.bytes(), 1152u);
  EXPECT_EQ(m.latent_entry_bytes(), 1152u);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> nope(512), rope(64), nope2(512), rope2(64);
  for (float& v : nope) v = normal(rng);
  for (float& v : rope) v = normal(rng);
  std::vector<std::uint8_t> entry(l.bytes());
  quantize_latent(l, nope, rope, entry);
  for (int d = 0; d < 512; ++d) {
    std::uint16_t b = 0;
    std::memcpy(&b, entry.data() + 2 * d, 2);
    ASSERT_EQ(b, bf16_from_float(nope[static_cast<std::size_t>(d)])) << d;
  }
  dequantize_latent(l, entry, nope2, rope2);
  for (int d = 0; d < 512; ++d) {
    ASSERT_EQ(nope2[static_cast<std::size_t>(d)], bf16_to_float(bf16_from_float(nope[static_cast<std::size_t>(d)])));
  }
  for (int d = 0; d < 64; ++d) {
    ASSERT_EQ(rope2[static_cast<std::size_t>(d)], bf16_to_float(bf16_from_float(rope[static_cast<std::size_t>(d)])));
  }
  // fp8_e4m3 (or no flag) keeps the FP8 entry; other dtypes and a bf16 DeepSeek-V4 are refused by name.
  j["kv_cache_dtype"] = "fp8_e4m3";
  EXPECT_EQ(ModelSpec::from_json(j, "fp8").latent_entry_bytes(), 656u);
  j["kv_cache_dtype"] = "fp8_e5m2";
  EXPECT_THROW(ModelSpec::from_json(j, "e5m2"), Error);
  nlohmann::json v4 = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json").to_json();
  v4["kv_cache_dtype"] = "bfloat16";
  try {
    ModelSpec::from_json(v4, "v4");
    ADD_FAILURE() << "a bf16 DeepSeek-V4 cache was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("HiSparse C4 pool is FP8"), std::string::npos) << e.what();
  }
}

TEST(LatentLayout, RejectsBadInput) {
  const LatentLayout l;
  std::vector<float> nope(512, 0.0f), rope(64, 0.0f);
  std::vector<std::uint8_t> e(656);
  nope[7] = NAN;
  EXPECT_THROW(quantize_latent(l, nope, rope, e), Error);
  nope[7] = INFINITY;
  EXPECT_THROW(quantize_latent(l, nope, rope, e), Error);
  nope[7] = 0.0f;
  std::vector<std::uint8_t> short_entry(655);
  EXPECT_THROW(quantize_latent(l, nope, rope, short_entry), Error);
  std::vector<float> short_rope(63);
  EXPECT_THROW(quantize_latent(l, nope, short_rope, e), Error);
  EXPECT_THROW((LatentLayout{500, 64}.validate()), Error);  // not a multiple of 128
  EXPECT_THROW((LatentLayout{512, 60}.validate()), Error);  // 648 bytes: not a multiple of 16
  try {
    quantize_latent(l, nope, rope, short_entry);
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("655"), std::string::npos) << err.what();
  }
}

TEST(IndexerLayout, PinsThePageLayout) {
  const IndexerLayout l = IndexerLayout::for_model(ModelSpec::deepseek_v32_exp());
  EXPECT_EQ(l.entry_bytes(), 132u);
  EXPECT_EQ(l.page_bytes(), 64u * 132u);
  EXPECT_EQ(l.key_offset(0), 0u);
  EXPECT_EQ(l.key_offset(5), 640u);
  EXPECT_EQ(l.scale_offset(0), 8192u);  // 64 x 128 FP8 bytes first, then the scales
  EXPECT_EQ(l.scale_offset(5), 8212u);

  std::vector<std::uint8_t> page(l.page_bytes(), 0);
  std::vector<float> key(128, 0.0f);
  key[0] = 3.0f;   // amax 3 -> scale 2^-7; 3 / 2^-7 = 384 = 1.5 x 2^8 -> 0x7C
  key[1] = -1.5f;  // -192 = -1.5 x 2^7 -> 0xF4
  quantize_indexer_key(l, key, page, 5);
  EXPECT_EQ(page[640], 0x7C);
  EXPECT_EQ(page[641], 0xF4);
  float s = 0.0f;
  std::memcpy(&s, page.data() + 8212, 4);
  EXPECT_EQ(s, std::ldexp(1.0f, -7));
  // Nothing outside token 5's key and scale was written.
  for (std::size_t i = 0; i < page.size(); ++i) {
    if ((i >= 640 && i < 768) || (i >= 8212 && i < 8216)) continue;
    ASSERT_EQ(page[i], 0) << "byte " << i;
  }
  std::vector<float> back(128);
  dequantize_indexer_key(l, page, 5, back);
  EXPECT_EQ(back[0], 3.0f);
  EXPECT_EQ(back[1], -1.5f);
  EXPECT_EQ(back[2], 0.0f);
  EXPECT_THROW(quantize_indexer_key(l, key, page, 64), Error);
  EXPECT_THROW((IndexerLayout{256}.validate()), Error);
  // A small key (amax 0.01) takes the model's act_quant scale, 2^-15: 0.01 / 2^-15 = 327.68 -> 320.
  std::fill(key.begin(), key.end(), 0.0f);
  key[0] = 0.01f;
  quantize_indexer_key(l, key, page, 6);
  std::memcpy(&s, page.data() + l.scale_offset(6), 4);
  EXPECT_EQ(s, std::ldexp(1.0f, -15));
  EXPECT_EQ(fp8_e4m3_to_float(page[l.key_offset(6)]), 320.0f);
}

}  // namespace
}  // namespace ess
