// Byte layouts of one token's cache entries, exactly as FlashMLA / DeepGEMM / SGLang store
// them (see docs/architecture.md, "Cache entries").
//
// Latent (MLA) entry of DeepSeek-V3.2 / GLM-5, 656 bytes for kv_lora_rank 512 and
// qk_rope_head_dim 64:
//   [0, 512)    512 x FP8 e4m3   the "NoPE" latent, quantized per 128-value tile
//   [512, 528)  4 x fp32         the tile scales (amax / 448 rounded up to a power of two)
//   [528, 656)  64 x bf16        the RoPE part, unquantized
// 656 = 41 x 16 bytes, so the entry moves in 16-byte vector accesses.
//
// DeepSeek-V4's C4 (compressed) entry, 584 bytes of data in a 592-byte entry (head_dim 512 of
// which qk_rope_head_dim 64 is RoPE; SGLang's dsv4_main_kv_store.py and deepseek_v4/kvcacheio.cuh):
//   [0, 448)    448 x FP8 e4m3   the NoPE part, quantized per 64-value tile
//   [448, 576)  64 x bf16        the RoPE part
//   [576, 583)  7 x ue8m0        the tile scales as exponent bytes (2^(byte - 127)), one byte of padding
//   [584, 592)  padding          ESS's, so that entries stay 16-byte multiples in the host pool
// A C4 page keeps the first 576 bytes (the "value") and the 8 scale bytes apart: a device buffer in
// two parts (RowTail, LatentLayout::value_bytes()).
//
// MiniMax-M3's K / V entry (its sparse layers; one KV head per TP rank, as SGLang's HiSparse
// requires), 512 bytes for head_dim 128 in bf16: [0, 256) the key, [256, 512) the value. SGLang
// keeps K and V in two tensors: a device buffer in two parts, the value the tail.
//
// The same latent in a bf16 KV cache (SGLang's DSA with --kv-cache-dtype bfloat16, its default on
// Hopper), 1,152 bytes: [0, 1024) 512 x bf16 NoPE, [1024, 1152) 64 x bf16 RoPE, no scales.
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

// How a latent entry's tile scales are stored.
enum class ScaleFormat {
  kFp32,   // 4-byte floats, between the NoPE and the RoPE parts (DeepSeek-V3.2)
  kUe8m0,  // exponent bytes, after the RoPE part, padded to 8 bytes (DeepSeek-V4's C4 entries)
  kNone,   // no quantization: the NoPE part in bf16 too (a bf16 KV cache: SGLang's DSA default on Hopper)
};

struct LatentLayout {
  int nope_dim = 512;  // kv_lora_rank (V3.2); head_dim - qk_rope_head_dim (V4)
  int rope_dim = 64;   // qk_rope_head_dim
  int tile = kQuantTile;                    // values per scale: 128 (fp32 scales) or 64 (ue8m0)
  ScaleFormat scales = ScaleFormat::kFp32;
  // A K / V entry instead (MiniMax-M3's sparse layers): one KV head's key, then its value, kv_dim
  // values of kv_value_bytes each (2: bf16, the model's dtype; 1: an fp8 KV cache), no scales;
  // nope_dim, rope_dim, tile and scales unused. 0: a latent entry.
  int kv_dim = 0;
  int kv_value_bytes = 2;
  bool key_value() const { return kv_dim > 0; }

  bool quantized() const { return scales != ScaleFormat::kNone; }
  int num_scales() const { return key_value() || !quantized() ? 0 : nope_dim / tile; }
  std::size_t scale_bytes() const {  // the scales' span, padding included
    const auto n = static_cast<std::size_t>(num_scales());
    return scales == ScaleFormat::kFp32 ? 4u * n : (n + 7u) / 8u * 8u;
  }
  std::size_t nope_bytes() const { return static_cast<std::size_t>(nope_dim) * (quantized() ? 1u : 2u); }
  std::size_t nope_offset() const { return 0; }
  std::size_t scale_offset() const {
    return scales == ScaleFormat::kFp32 ? static_cast<std::size_t>(nope_dim) : value_bytes();
  }
  std::size_t rope_offset() const {
    return nope_bytes() + (scales == ScaleFormat::kFp32 ? scale_bytes() : 0u);
  }
  // NoPE and RoPE: the C4 page's "value" (its first part when a buffer keeps entries in two); the
  // key of a K / V entry (its first part, the value its second).
  std::size_t value_bytes() const {
    if (key_value()) return static_cast<std::size_t>(kv_dim) * static_cast<std::size_t>(kv_value_bytes);
    return nope_bytes() + 2u * static_cast<std::size_t>(rope_dim);
  }
  std::size_t data_bytes() const {  // every byte that means something
    return key_value() ? 2u * value_bytes() : value_bytes() + scale_bytes();
  }
  std::size_t bytes() const {  // the entry, padded to 16 bytes
    return (data_bytes() + kVectorBytes - 1) / kVectorBytes * kVectorBytes;
  }

  // DeepSeek-V4 (model_type "deepseek_v4"): the C4 entry; MiniMax-M3: the K / V entry of head_dim
  // values each; else the V3.2 entry of kv_lora_rank and qk_rope_head_dim (FP8, or bf16 with the
  // config's kv_cache_dtype bfloat16: ScaleFormat::kNone).
  static LatentLayout for_model(const ModelSpec& m);
  // Throws ess::Error unless nope_dim is a positive multiple of the tile (128 with fp32 scales,
  // 64 with ue8m0 ones), rope_dim > 0 and, with fp32 scales, the entry is a multiple of 16 bytes;
  // a K / V entry: kv_value_bytes 1, 2 or 4, the key a positive multiple of 16 bytes.
  void validate() const;
};

// DeepSeek-V4's C4 cache page as SGLang stores it (deepseek_v4/kvcacheio.cuh): its 64 entries'
// values (LatentLayout::value_bytes() each), then their scales (scale_bytes() each), the page
// padded to a multiple of 576 bytes (FlashMLA's page alignment): 37,440 bytes for V4's entries.
// A device buffer of such pages keeps each entry in two parts (RowTail).
struct C4Page {
  static constexpr int kRows = 64;
  static constexpr std::uint64_t kAlign = 576;
  std::uint64_t value_bytes = 0, scale_bytes = 0;
  std::uint64_t scale_offset() const { return value_bytes * kRows; }
  std::uint64_t bytes() const { return ((value_bytes + scale_bytes) * kRows + kAlign - 1) / kAlign * kAlign; }
  static C4Page of(const LatentLayout& l) { return {l.value_bytes(), l.scale_bytes()}; }
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
// into `out` (layout.bytes(); the padding after data_bytes() is zero), each tile's scale as the
// model's own code computes it: V3.2, amax / 448 floored at 1e-4 and rounded up to a power of two;
// V4 (SGLang's k_cache_reference.py), amax floored at 1e-8, / 448, rounded up to a power of two and
// stored as its exponent + 127. Non-finite input is an error.
void quantize_latent(const LatentLayout& layout, std::span<const float> nope,
                     std::span<const float> rope, std::span<std::uint8_t> out);
// Dequantizes one entry: nope[i] = fp8(byte i) * scale[i / tile], rope[i] = bf16 value. Exact.
void dequantize_latent(const LatentLayout& layout, std::span<const std::uint8_t> entry,
                       std::span<float> nope, std::span<float> rope);

// Stores one K / V entry (layout.key_value()): key and value, kv_dim floats each, as the cache
// keeps them (bf16 rounded to nearest even for kv_value_bytes 2, FP8 e4m3 unscaled for 1, fp32
// for 4); the padding after data_bytes() is zero. Non-finite input is an error.
void encode_key_value(const LatentLayout& layout, std::span<const float> key, std::span<const float> value,
                      std::span<std::uint8_t> out);
// Reads one back: exact.
void decode_key_value(const LatentLayout& layout, std::span<const std::uint8_t> entry, std::span<float> key,
                      std::span<float> value);

// Quantizes one indexer key (head_dim floats) into token j of an indexer page, with the model's
// own scale (ue8m0_act_scale).
void quantize_indexer_key(const IndexerLayout& layout, std::span<const float> key,
                          std::span<std::uint8_t> page, int j);
// Dequantizes token j of an indexer page: key[d] = fp8 * scale. Exact.
void dequantize_indexer_key(const IndexerLayout& layout, std::span<const std::uint8_t> page,
                            int j, std::span<float> key);

}  // namespace ess
