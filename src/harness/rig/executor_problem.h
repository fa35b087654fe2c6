// The decode-step executor's test problems, shared by its device test (executor_test.cc) and
// its host half (executor_host_test.cc): the configurations, and the check of one query
// token's attention against the CPU reference on the rig's own data (rig_data.h).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <vector>

#include "ess/model/model_spec.h"
#include "ess/model/numerics.h"
#include "harness/rig/config.h"
#include "harness/rig/rig_data.h"
#include "testing/accuracy.h"

namespace ess::executor_test {

using rig::ExecutorConfig;
using rig::StepInputs;

// Two layers, three requests, four steps at 8K: small enough for every schedule in a few
// seconds, large enough for misses in every step (so the copies are exercised).
inline ExecutorConfig tiny(OverlapMode mode, bool offload = true) {
  ExecutorConfig c;
  c.layers = 2;
  c.batch = 3;
  c.context = 8192;
  c.steps = 4;
  c.warm_steps = 0;
  c.ratio = 0.5;  // 4096 slots: the smallest pool that holds a T = 2 working set
  c.overlap = mode;
  c.offload = offload;
  c.stand_in_gemms = false;
  return c;
}

// The configurations of the device test, each with what it replays.
inline std::vector<ExecutorConfig> device_test_configs() {
  std::vector<ExecutorConfig> v = {tiny(OverlapMode::kNone), tiny(OverlapMode::kNone, false)};
  ExecutorConfig many = tiny(OverlapMode::kDualAttention);
  many.batch = 5;
  many.steps = 6;
  v.push_back(many);
  ExecutorConfig one = tiny(OverlapMode::kDualBatchAttention);
  one.batch = 1;
  one.steps = 5;
  one.warm_steps = 2;
  v.push_back(one);
  ExecutorConfig reserved = tiny(OverlapMode::kNone);
  reserved.reserve_newest = true;
  v.push_back(reserved);
  return v;
}

// The query tokens whose attention each run checks against the reference: the first and the
// last of the batch, in every layer, at the last step.
struct TokenAt {
  int step, layer, b, t;
};
inline std::vector<TokenAt> checked_tokens(const StepInputs& in) {
  std::vector<TokenAt> v;
  for (int l = 0; l < in.layers; ++l) {
    v.push_back({in.steps - 1, l, 0, 0});
    if (in.batch * in.mtp > 1) v.push_back({in.steps - 1, l, in.batch - 1, in.mtp - 1});
  }
  return v;
}

// out: [batch][T][heads][512] bf16 bits; lse: [batch][T][heads] (one layer of one step).
// `merged`: the DA / DBA schedules merge two partial decodes (the contract's merged bound).
inline test::DecodeCheck check_token(const rig::RigData& rig, const StepInputs& in, const TokenAt& at,
                                    std::span<const std::uint16_t> out, std::span<const float> lse, bool merged) {
  const rig::TokenProblem tp = rig::token_problem(rig, in, at.step, at.layer, at.b, at.t);
  const std::size_t H = static_cast<std::size_t>(rig.heads());
  const std::size_t V = static_cast<std::size_t>(rig.layout().nope_dim);
  const std::size_t token = static_cast<std::size_t>(at.b) * static_cast<std::size_t>(in.mtp) + static_cast<std::size_t>(at.t);
  std::vector<float> o(H * V);
  for (std::size_t i = 0; i < o.size(); ++i) o[i] = bf16_to_float(out[token * H * V + i]);
  return test::check_decode_token(tp.params, tp.q, tp.entries, o, true, lse.subspan(token * H, H), 0.0, merged);
}

// Every value finite (outputs start poisoned with NaN, so an unwritten one is caught) and not
// all of a layer's output zero.
inline void expect_written(std::span<const std::uint16_t> out, const std::string& where) {
  std::size_t non_finite = 0, nonzero = 0;
  for (const std::uint16_t v : out) {
    const float f = bf16_to_float(v);
    non_finite += std::isfinite(f) ? 0 : 1;
    nonzero += f != 0.0f ? 1 : 0;
  }
  EXPECT_EQ(non_finite, 0u) << where << ": " << non_finite << " of " << out.size() << " outputs not finite (unwritten?)";
  EXPECT_GT(nonzero, out.size() / 2) << where << ": outputs mostly zero";
}

}  // namespace ess::executor_test
