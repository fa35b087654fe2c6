// Scalar number formats of the DeepSeek-V3.2 caches: FP8 e4m3 ("e4m3fn": no infinities,
// max finite 448, NaN = S.1111.111) and bfloat16. Conversions round to nearest, ties to
// even; FP8 saturates to +-448 (as quantizers do after dividing by the block scale).
#pragma once

#include <bit>
#include <cstdint>

namespace ess {

inline constexpr float kFp8E4m3Max = 448.0f;

// Decodes one FP8 e4m3fn byte exactly.
float fp8_e4m3_to_float(std::uint8_t bits);
// Encodes a float to FP8 e4m3fn, round-to-nearest-even, saturating at +-448; NaN -> NaN.
std::uint8_t fp8_e4m3_from_float(float x);

// bfloat16 <-> float. The conversion to bf16 rounds to nearest, ties to even; NaN stays NaN.
inline float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}
inline std::uint16_t bf16_from_float(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and non-zero
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

// The block scale of the latent cache, FlashMLA's quantizer (tests/quant.py): a power of two,
// scale = 2^ceil(log2(max(amax / 448, 1e-4))), so that amax / scale <= 448 and
// dequantization (fp8 * scale) is exact in fp32.
float pow2_block_scale(float amax);

// The block scale of the indexer keys, the model's own act_quant with scale_fmt "ue8m0"
// (DeepSeek-V3.2's inference kernel.py): amax floored at 1e-4 before the division,
// scale = 2^ceil(log2(max(amax, 1e-4) / 448)). Differs from pow2_block_scale for amax below
// 0.0448 (448 x 1e-4), where that one's floor applies to the ratio.
float ue8m0_act_scale(float amax);

// The tile scale of DeepSeek-V4's C4 latent entries (SGLang's k_cache_reference.py,
// _quant_k_cache_fused_kernel): amax floored at 1e-8, scale = 2^ceil(log2(max(amax, 1e-8) / 448)),
// stored as its exponent byte.
float c4_kv_scale(float amax);

}  // namespace ess
