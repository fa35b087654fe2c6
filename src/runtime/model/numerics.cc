#include "ess/model/numerics.h"

#include <array>
#include <cmath>

namespace ess {
namespace {

std::array<float, 256> make_fp8_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int sign = b >> 7;
    const int exp = (b >> 3) & 0xf;
    const int man = b & 0x7;
    float v = 0.0f;
    if (exp == 0xf && man == 0x7) {
      v = std::nanf("");
    } else if (exp == 0) {
      v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^(1-7)
    } else {
      v = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
    }
    t[b] = sign ? -v : v;
  }
  return t;
}

const std::array<float, 256> kFp8Table = make_fp8_table();

}  // namespace

float fp8_e4m3_to_float(std::uint8_t bits) { return kFp8Table[bits]; }

std::uint8_t fp8_e4m3_from_float(float x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) {
    return static_cast<std::uint8_t>(sign | 0x7f);
  }
  const float a = std::fabs(x);
  if (a >= kFp8E4m3Max) {
    return static_cast<std::uint8_t>(sign | 0x7e);  // saturate (also +-inf)
  }
  int code = 0;
  if (a < 0x1p-6f) {
    // Subnormal range: multiples of 2^-9. nearbyint rounds ties to even in the default mode.
    const float q = std::nearbyint(a * 512.0f);  // exact scaling by a power of two
    code = static_cast<int>(q);                  // 0..8; 8 is the smallest normal (0x08)
  } else {
    int e = 0;
    const float m = std::frexp(a, &e);         // a = m * 2^e, m in [0.5, 1)
    const float frac = (m * 2.0f - 1.0f) * 8.0f;  // mantissa in eighths, exact
    int man = static_cast<int>(std::nearbyint(frac));
    int exp = e - 1 + 7;
    if (man == 8) {
      man = 0;
      ++exp;
    }
    code = (exp << 3) | man;
    if (code > 0x7e) {
      code = 0x7e;
    }
  }
  return static_cast<std::uint8_t>(sign | code);
}

namespace {

// 2^ceil(log2(r)) for r > 0, computed exactly: r = m * 2^e with m in [0.5, 1), so the exponent
// is e - 1 when r is a power of two (m == 0.5) and e otherwise. (std::log2 can round a value
// just above a power of two down to the integer, which would give a scale one step too small.)
float pow2_ceil(float ratio) {
  int e = 0;
  const float m = std::frexp(ratio, &e);
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

}  // namespace

float pow2_block_scale(float amax) { return pow2_ceil(std::fmax(amax / kFp8E4m3Max, 1e-4f)); }

float ue8m0_act_scale(float amax) { return pow2_ceil(std::fmax(amax, 1e-4f) / kFp8E4m3Max); }

float c4_kv_scale(float amax) { return pow2_ceil(std::fmax(amax, 1e-8f) / kFp8E4m3Max); }

}  // namespace ess
