#include "ess/model/entry_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ess/core/error.h"
#include "ess/model/model_spec.h"
#include "ess/model/numerics.h"

namespace ess {
namespace {

void check_finite(std::span<const float> v, const char* what) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    ESS_CHECK(std::isfinite(v[i]), "{}[{}] is {}: cache entries must be finite", what, i, v[i]);
  }
}

// Quantizes `values` (a multiple of `tile` long) into FP8 bytes with one power-of-two scale per
// tile, `scale_of(amax)`.
void quantize_tiles(std::span<const float> values, int tile, std::uint8_t* fp8, float* scales, float (*scale_of)(float)) {
  const auto n = static_cast<std::size_t>(tile);
  for (std::size_t t = 0; t * n < values.size(); ++t) {
    const auto part = values.subspan(t * n, n);
    float amax = 0.0f;
    for (float v : part) amax = std::fmax(amax, std::fabs(v));
    const float scale = scale_of(amax);
    scales[t] = scale;
    for (std::size_t i = 0; i < n; ++i) {
      fp8[t * n + i] = fp8_e4m3_from_float(part[i] / scale);  // exact division by 2^k
    }
  }
}

// A power of two's exponent byte (ue8m0: 2^(byte - 127)), and back.
std::uint8_t ue8m0_byte(float pow2) { return static_cast<std::uint8_t>(std::ilogb(pow2) + 127); }
float ue8m0_value(std::uint8_t byte) { return std::ldexp(1.0f, static_cast<int>(byte) - 127); }

}  // namespace

LatentLayout LatentLayout::for_model(const ModelSpec& m) {
  LatentLayout l{m.kv_lora_rank, m.qk_rope_head_dim};
  if (m.kv_cache_dtype == "bfloat16" && !m.is_minimax_m3() && !m.is_deepseek_v4()) {
    l.scales = ScaleFormat::kNone;   // SGLang's DSA pool in bf16: kv_lora_rank + qk_rope_head_dim bf16 values
  } else if (m.is_minimax_m3()) {  // one KV head's K and V (SGLang's HiSparseMHAMainPool, head_num 1)
    l = LatentLayout{};
    l.kv_dim = m.head_dim;
    l.kv_value_bytes = m.kv_value_bytes;
  } else if (m.is_deepseek_v4()) {  // head_dim values: NoPE, then RoPE (SGLang's NopeFp8RopeBf16Pack)
    l.nope_dim = m.head_dim - m.qk_rope_head_dim;
    l.tile = 64;
    l.scales = ScaleFormat::kUe8m0;
  }
  l.validate();
  return l;
}

void LatentLayout::validate() const {
  if (key_value()) {
    ESS_CHECK(kv_value_bytes == 1 || kv_value_bytes == 2 || kv_value_bytes == 4,
              "latent layout: K / V values of {} bytes (1: fp8, 2: bf16 or fp16, 4: fp32)", kv_value_bytes);
    ESS_CHECK(value_bytes() % kVectorBytes == 0,
              "latent layout: a key of {} values x {} bytes is not a multiple of {} bytes (it moves in 16-byte chunks, "
              "its value apart)",
              kv_dim, kv_value_bytes, kVectorBytes);
    return;
  }
  ESS_CHECK(kv_dim == 0, "latent layout: kv_dim = {} is negative", kv_dim);
  if (!quantized()) {
    ESS_CHECK(nope_dim > 0 && rope_dim > 0 && data_bytes() % kVectorBytes == 0,
              "latent layout: a bf16 latent of {} NoPE and {} RoPE values must have both parts and be a multiple of "
              "{} bytes",
              nope_dim, rope_dim, kVectorBytes);
    return;
  }
  const bool fp32 = scales == ScaleFormat::kFp32;
  ESS_CHECK(tile == (fp32 ? kQuantTile : 64), "latent layout: tiles of {} values with {} scales (expected {})", tile,
            fp32 ? "fp32" : "ue8m0", fp32 ? kQuantTile : 64);
  ESS_CHECK(nope_dim > 0 && nope_dim % tile == 0,
            "latent layout: the NoPE part of {} values (kv_lora_rank{}) must be a positive multiple of {}", nope_dim,
            fp32 ? "" : " - qk_rope_head_dim", tile);
  ESS_CHECK(rope_dim > 0, "latent layout: qk_rope_head_dim = {} must be positive", rope_dim);
  ESS_CHECK(fp32 || value_bytes() % kVectorBytes == 0,
            "latent layout: a C4 entry's value of {} bytes (NoPE {} + RoPE {} x 2) is not a multiple of {} bytes (it moves "
            "in 16-byte chunks, its scales apart)",
            value_bytes(), nope_dim, rope_dim, kVectorBytes);
  ESS_CHECK(!fp32 || data_bytes() % kVectorBytes == 0,
            "latent layout: entry of {} bytes (kv_lora_rank {}, qk_rope_head_dim {}) is not a "
            "multiple of {} bytes",
            data_bytes(), nope_dim, rope_dim, kVectorBytes);
}

IndexerLayout IndexerLayout::for_model(const ModelSpec& m) {
  IndexerLayout l{m.index_head_dim};
  l.validate();
  return l;
}

void IndexerLayout::validate() const {
  ESS_CHECK(head_dim == kQuantTile,
            "indexer layout: index_head_dim = {} unsupported: the DeepSeek-V3.2 indexer page stores "
            "one fp32 scale per token, i.e. exactly {} FP8 values",
            head_dim, kQuantTile);
}

void quantize_latent(const LatentLayout& layout, std::span<const float> nope,
                     std::span<const float> rope, std::span<std::uint8_t> out) {
  ESS_CHECK(!layout.key_value(), "quantize_latent: a K / V entry (MiniMax-M3's) holds no latent");
  ESS_CHECK(nope.size() == static_cast<std::size_t>(layout.nope_dim),
            "quantize_latent: nope has {} values, expected {}", nope.size(), layout.nope_dim);
  ESS_CHECK(rope.size() == static_cast<std::size_t>(layout.rope_dim),
            "quantize_latent: rope has {} values, expected {}", rope.size(), layout.rope_dim);
  ESS_CHECK(out.size() == layout.bytes(), "quantize_latent: output has {} bytes, expected {}",
            out.size(), layout.bytes());
  check_finite(nope, "latent nope");
  check_finite(rope, "latent rope");
  std::fill(out.begin(), out.end(), std::uint8_t{0});
  std::vector<float> scales(static_cast<std::size_t>(layout.num_scales()));
  if (!layout.quantized()) {
    for (int i = 0; i < layout.nope_dim; ++i) {
      const std::uint16_t b = bf16_from_float(nope[i]);
      std::memcpy(out.data() + 2u * i, &b, 2);
    }
  } else if (layout.scales == ScaleFormat::kFp32) {
    quantize_tiles(nope, layout.tile, out.data() + layout.nope_offset(), scales.data(), pow2_block_scale);
    std::memcpy(out.data() + layout.scale_offset(), scales.data(), scales.size() * sizeof(float));
  } else {
    quantize_tiles(nope, layout.tile, out.data() + layout.nope_offset(), scales.data(), c4_kv_scale);
    for (std::size_t t = 0; t < scales.size(); ++t) out[layout.scale_offset() + t] = ue8m0_byte(scales[t]);
  }
  for (int i = 0; i < layout.rope_dim; ++i) {
    const std::uint16_t b = bf16_from_float(rope[i]);
    std::memcpy(out.data() + layout.rope_offset() + 2u * i, &b, 2);
  }
}

namespace {

void put_kv_value(int bytes, float x, std::uint8_t* at) {
  if (bytes == 1) {
    *at = fp8_e4m3_from_float(x);
  } else if (bytes == 2) {
    const std::uint16_t b = bf16_from_float(x);
    std::memcpy(at, &b, 2);
  } else {
    std::memcpy(at, &x, 4);
  }
}

float get_kv_value(int bytes, const std::uint8_t* at) {
  if (bytes == 1) return fp8_e4m3_to_float(*at);
  if (bytes == 2) {
    std::uint16_t b = 0;
    std::memcpy(&b, at, 2);
    return bf16_to_float(b);
  }
  float x = 0;
  std::memcpy(&x, at, 4);
  return x;
}

}  // namespace

void encode_key_value(const LatentLayout& layout, std::span<const float> key, std::span<const float> value,
                      std::span<std::uint8_t> out) {
  ESS_CHECK(layout.key_value(), "encode_key_value: a latent layout holds no K / V entry");
  const auto n = static_cast<std::size_t>(layout.kv_dim);
  ESS_CHECK(key.size() == n && value.size() == n, "encode_key_value: key and value have {} and {} values, expected {}",
            key.size(), value.size(), n);
  ESS_CHECK(out.size() == layout.bytes(), "encode_key_value: output has {} bytes, expected {}", out.size(),
            layout.bytes());
  check_finite(key, "key");
  check_finite(value, "value");
  std::fill(out.begin(), out.end(), std::uint8_t{0});
  const int w = layout.kv_value_bytes;
  for (std::size_t d = 0; d < n; ++d) {
    put_kv_value(w, key[d], out.data() + d * static_cast<std::size_t>(w));
    put_kv_value(w, value[d], out.data() + layout.value_bytes() + d * static_cast<std::size_t>(w));
  }
}

void decode_key_value(const LatentLayout& layout, std::span<const std::uint8_t> entry, std::span<float> key,
                      std::span<float> value) {
  ESS_CHECK(layout.key_value(), "decode_key_value: a latent layout holds no K / V entry");
  const auto n = static_cast<std::size_t>(layout.kv_dim);
  ESS_CHECK(entry.size() == layout.bytes() && key.size() == n && value.size() == n,
            "decode_key_value: an entry of {} bytes into {} and {} values, expected {} bytes and {} values",
            entry.size(), key.size(), value.size(), layout.bytes(), n);
  const int w = layout.kv_value_bytes;
  for (std::size_t d = 0; d < n; ++d) {
    key[d] = get_kv_value(w, entry.data() + d * static_cast<std::size_t>(w));
    value[d] = get_kv_value(w, entry.data() + layout.value_bytes() + d * static_cast<std::size_t>(w));
  }
}

void dequantize_latent(const LatentLayout& layout, std::span<const std::uint8_t> entry,
                       std::span<float> nope, std::span<float> rope) {
  ESS_CHECK(!layout.key_value(), "dequantize_latent: a K / V entry (MiniMax-M3's) holds no latent");
  ESS_CHECK(entry.size() == layout.bytes(), "dequantize_latent: entry has {} bytes, expected {}",
            entry.size(), layout.bytes());
  ESS_CHECK(nope.size() == static_cast<std::size_t>(layout.nope_dim) &&
                rope.size() == static_cast<std::size_t>(layout.rope_dim),
            "dequantize_latent: outputs have {} and {} values, expected {} and {}", nope.size(),
            rope.size(), layout.nope_dim, layout.rope_dim);
  if (!layout.quantized()) {
    for (int d = 0; d < layout.nope_dim; ++d) {
      std::uint16_t b = 0;
      std::memcpy(&b, entry.data() + 2u * d, 2);
      nope[d] = bf16_to_float(b);
    }
  }
  for (int t = 0; t < layout.num_scales(); ++t) {
    float scale = 0.0f;
    if (layout.scales == ScaleFormat::kFp32) {
      std::memcpy(&scale, entry.data() + layout.scale_offset() + 4u * t, 4);
    } else {
      scale = ue8m0_value(entry[layout.scale_offset() + static_cast<std::size_t>(t)]);
    }
    for (int i = 0; i < layout.tile; ++i) {
      const int d = t * layout.tile + i;
      nope[d] = fp8_e4m3_to_float(entry[layout.nope_offset() + d]) * scale;
    }
  }
  for (int i = 0; i < layout.rope_dim; ++i) {
    std::uint16_t b = 0;
    std::memcpy(&b, entry.data() + layout.rope_offset() + 2u * i, 2);
    rope[i] = bf16_to_float(b);
  }
}

void quantize_indexer_key(const IndexerLayout& layout, std::span<const float> key,
                          std::span<std::uint8_t> page, int j) {
  ESS_CHECK(key.size() == static_cast<std::size_t>(layout.head_dim),
            "quantize_indexer_key: key has {} values, expected {}", key.size(), layout.head_dim);
  ESS_CHECK(page.size() == layout.page_bytes(), "quantize_indexer_key: page has {} bytes, expected {}",
            page.size(), layout.page_bytes());
  ESS_CHECK(j >= 0 && j < kPageTokens, "quantize_indexer_key: token {} outside a {}-token page", j,
            kPageTokens);
  layout.validate();
  check_finite(key, "indexer key");
  float scale = 0.0f;
  quantize_tiles(key, kQuantTile, page.data() + layout.key_offset(j), &scale, ue8m0_act_scale);
  std::memcpy(page.data() + layout.scale_offset(j), &scale, 4);
}

void dequantize_indexer_key(const IndexerLayout& layout, std::span<const std::uint8_t> page, int j,
                            std::span<float> key) {
  ESS_CHECK(page.size() == layout.page_bytes() && j >= 0 && j < kPageTokens &&
                key.size() == static_cast<std::size_t>(layout.head_dim),
            "dequantize_indexer_key: page of {} bytes, token {}, key of {} values (expected {}, "
            "[0, {}), {})",
            page.size(), j, key.size(), layout.page_bytes(), kPageTokens, layout.head_dim);
  float scale = 0.0f;
  std::memcpy(&scale, page.data() + layout.scale_offset(j), 4);
  for (int d = 0; d < layout.head_dim; ++d) {
    key[d] = fp8_e4m3_to_float(page[layout.key_offset(j) + d]) * scale;
  }
}

}  // namespace ess
