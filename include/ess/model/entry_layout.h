// Byte layouts of one token's cache entries, exactly as FlashMLA / DeepGEMM / SGLang store
// them for DeepSeek-V3.2 (see docs/architecture.md, "Cache entries").
//
// Latent (MLA) entry, 656 bytes for kv_lora_rank 512 and qk_rope_head_dim 64:
//   [0, 512)    512 x FP8 e4m3   the "NoPE" latent, quantized per 128-value tile
//   [512, 528)  4 x fp32         the tile scales (powers of two, see pow2_block_scale)
//   [528, 656)  64 x bf16        the RoPE part, unquantized
// 656 = 41 x 16 bytes, so the entry moves in 16-byte vector accesses.
//
// Indexer key entry, 132 bytes (index_head_dim 128): 128 x FP8 e4m3 + one fp32 scale.
// Indexer keys are stored per 64-token page: 64 x 128 FP8 bytes, then 64 fp32 scales.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ess {

struct ModelSpec;

inline constexpr int kQuantTile = 128;     // values per fp32 scale
inline constexpr int kPageTokens = 64;     // tokens per cache page (host pool, indexer pages)
inline constexpr int kVectorBytes = 16;    // the transfer unit entries are padded to

struct LatentLayout {
  int nope_dim = 512;  // kv_lora_rank
  int rope_dim = 64;   // qk_rope_head_dim

  int num_scales() const { return nope_dim / kQuantTile; }
  std::size_t nope_offset() const { return 0; }
  std::size_t scale_offset() const { return static_cast<std::size_t>(nope_dim); }
  std::size_t rope_offset() const { return scale_offset() + 4u * static_cast<std::size_t>(num_scales()); }
  std::size_t bytes() const { return rope_offset() + 2u * static_cast<std::size_t>(rope_dim); }

  static LatentLayout for_model(const ModelSpec& m);
  // Throws ess::Error unless nope_dim is a positive multiple of 128, rope_dim > 0 and the
  // entry size is a multiple of 16 bytes.
  void validate() const;
};

struct IndexerLayout {
  int head_dim = 128;  // index_head_dim

  std::size_t entry_bytes() const { return static_cast<std::size_t>(head_dim) + 4u; }
  std::size_t page_bytes() const { return kPageTokens * entry_bytes(); }
  // Offsets inside one 64-token page of token j (0 <= j < 64).
  std::size_t key_offset(int j) const { return static_cast<std::size_t>(j) * head_dim; }
  std::size_t scale_offset(int j) const {
    return static_cast<std::size_t>(kPageTokens) * head_dim + 4u * static_cast<std::size_t>(j);
  }

  static IndexerLayout for_model(const ModelSpec& m);
  void validate() const;  // head_dim must be 128 (one fp32 scale per token)
};

// Quantizes one latent vector (nope: layout.nope_dim floats, rope: layout.rope_dim floats)
// into `out` (layout.bytes()). Non-finite input is an error.
void quantize_latent(const LatentLayout& layout, std::span<const float> nope,
                     std::span<const float> rope, std::span<std::uint8_t> out);
// Dequantizes one entry: nope[i] = fp8(byte i) * scale[i / 128], rope[i] = bf16 value. Exact.
void dequantize_latent(const LatentLayout& layout, std::span<const std::uint8_t> entry,
                       std::span<float> nope, std::span<float> rope);

// Quantizes one indexer key (head_dim floats) into token j of an indexer page, with the model's
// own scale (ue8m0_act_scale).
void quantize_indexer_key(const IndexerLayout& layout, std::span<const float> key,
                          std::span<std::uint8_t> page, int j);
// Dequantizes token j of an indexer page: key[d] = fp8 * scale. Exact.
void dequantize_indexer_key(const IndexerLayout& layout, std::span<const std::uint8_t> page,
                            int j, std::span<float> key);

}  // namespace ess
