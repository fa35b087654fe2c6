#include "ess/model/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

namespace ess {
namespace {

TEST(Fp8E4m3, DecodesKnownCodes) {
  EXPECT_EQ(fp8_e4m3_to_float(0x00), 0.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_float(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0xB8), -1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x3C), 1.5f);
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);  // max finite
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xFF)));
}

TEST(Fp8E4m3, EveryFiniteCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const float v = fp8_e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(v)) continue;
    EXPECT_EQ(fp8_e4m3_from_float(v), b) << "code " << b << " value " << v;
  }
}

// Independent reference: the nearest finite code by exhaustive search, ties to the even code,
// saturating at +-448.
std::uint8_t nearest_code(float x) {
  int best = -1;
  double best_err = 0.0;
  for (int b = 0; b < 256; ++b) {
    const float v = fp8_e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(v) || std::signbit(v) != std::signbit(x)) continue;
    const double err = std::fabs(static_cast<double>(v) - static_cast<double>(x));
    if (best < 0 || err < best_err || (err == best_err && (b & 1) == 0 && (best & 1) == 1)) {
      best = b;
      best_err = err;
    }
  }
  return static_cast<std::uint8_t>(best);
}

TEST(Fp8E4m3, EncodesToTheNearestCodeTiesToEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-460.0f, 460.0f);
  std::uniform_real_distribution<float> small(-0.05f, 0.05f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (i % 2 == 0) ? wide(rng) : small(rng);
    ASSERT_EQ(fp8_e4m3_from_float(x), nearest_code(std::fmin(std::fmax(x, -448.0f), 448.0f))) << "x = " << x;
  }
  // Exact midpoints between neighbouring codes.
  for (int b = 0; b < 0x7E; ++b) {
    const double lo = fp8_e4m3_to_float(static_cast<std::uint8_t>(b));
    const double hi = fp8_e4m3_to_float(static_cast<std::uint8_t>(b + 1));
    const auto mid = static_cast<float>((lo + hi) / 2);
    EXPECT_EQ(fp8_e4m3_from_float(mid), (b & 1) == 0 ? b : b + 1) << "midpoint of codes " << b << ", " << b + 1;
  }
}

TEST(Fp8E4m3, SaturatesAndKeepsNaN) {
  EXPECT_EQ(fp8_e4m3_from_float(1e6f), 0x7E);
  EXPECT_EQ(fp8_e4m3_from_float(-1e6f), 0xFE);
  EXPECT_EQ(fp8_e4m3_from_float(INFINITY), 0x7E);
  EXPECT_EQ(fp8_e4m3_from_float(NAN) & 0x7F, 0x7F);
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(-2.0f), 0xC000);
  EXPECT_EQ(bf16_from_float(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // tie -> even (down)
  EXPECT_EQ(bf16_from_float(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(bf16_from_float(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(NAN))));
  for (int b = 0; b < 65536; b += 7) {
    const float v = bf16_to_float(static_cast<std::uint16_t>(b));
    if (!std::isnan(v)) {
      EXPECT_EQ(bf16_from_float(v), b);
    }
  }
}

TEST(Pow2BlockScale, IsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(pow2_block_scale(448.0f), 1.0f);
  EXPECT_EQ(pow2_block_scale(449.0f), 2.0f);
  EXPECT_EQ(pow2_block_scale(56.0f), 0.125f);
  EXPECT_EQ(pow2_block_scale(0.0f), std::ldexp(1.0f, -13));  // floor 1e-4 -> 2^-13
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> e(-10.0f, 20.0f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(e(rng));
    const float s = pow2_block_scale(amax);
    int ex = 0;
    EXPECT_EQ(std::frexp(s, &ex), 0.5f) << "not a power of two";
    EXPECT_LE(amax / s, 448.0f);
    if (amax / 448.0f > std::ldexp(1.0f, -13)) {
      EXPECT_GT(amax / s, 224.0f) << "amax " << amax << " scale " << s;  // the smallest that fits
    } else {
      EXPECT_EQ(s, std::ldexp(1.0f, -13)) << "amax " << amax;  // below the 1e-4 floor
    }
  }
}

// The indexer keys' scale is the model's act_quant (ue8m0): amax floored at 1e-4 before the
// division by 448. It agrees with pow2_block_scale from amax = 448 x 1e-4 up, and keeps shrinking
// below it where that one stops at 2^-13.
TEST(Ue8m0ActScale, FloorsAmaxNotTheRatio) {
  EXPECT_EQ(ue8m0_act_scale(448.0f), 1.0f);
  EXPECT_EQ(ue8m0_act_scale(449.0f), 2.0f);
  EXPECT_EQ(ue8m0_act_scale(0.01f), std::ldexp(1.0f, -15));   // 0.01 / 448 = 2.2e-5 -> 2^-15 (not 2^-13)
  EXPECT_EQ(ue8m0_act_scale(0.0f), std::ldexp(1.0f, -22));    // 1e-4 / 448 = 2.2e-7 -> 2^-22
  EXPECT_EQ(ue8m0_act_scale(1e-5f), ue8m0_act_scale(1e-4f));  // the floor
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> e(-16.0f, 20.0f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(e(rng));
    const float s = ue8m0_act_scale(amax);
    int ex = 0;
    EXPECT_EQ(std::frexp(s, &ex), 0.5f) << "not a power of two";
    EXPECT_LE(std::fmax(amax, 1e-4f) / s, 448.0f);
    EXPECT_GT(std::fmax(amax, 1e-4f) / s, 224.0f) << "amax " << amax << " scale " << s;
    if (amax >= 448.0f * 1e-4f) {
      EXPECT_EQ(s, pow2_block_scale(amax)) << "amax " << amax;
    }
  }
}

}  // namespace
}  // namespace ess
