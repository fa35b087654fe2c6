#include "harness/verify/decode_loop.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "ess/core/error.h"

namespace ess {
namespace {

VerifyConfig small() {
  VerifyConfig c;
  c.requests = 2;
  c.layers = 2;
  c.context = 300;
  c.steps = 6;
  c.mtp = 2;
  c.topk = 32;
  c.ratio = 0.3;  // 90 slots >= 64
  c.warmup_windows = 8;
  return c;
}

TEST(VerifyLoop, OffloadedAttentionIsBitIdenticalToTheFullCache) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const VerifyReport r = run_verify(m, small());
  EXPECT_TRUE(r.bitwise_equal) << r.first_mismatch;
  EXPECT_EQ(r.mismatched_outputs, 0);
  EXPECT_EQ(r.compared_outputs, 2 * 2 * 6 * 2);
  EXPECT_EQ(r.steps, 6);
  EXPECT_EQ(r.slots, 90);
  ASSERT_EQ(r.per_layer.size(), 2u);
  EXPECT_EQ(r.hits, r.per_layer[0].hits + r.per_layer[1].hits);
  EXPECT_EQ(r.misses, r.per_layer[0].misses + r.per_layer[1].misses);
  // Each request-layer-step's working set is at most T x K distinct tokens.
  EXPECT_LE(r.hits + r.misses, 2 * 2 * 6 * 2 * 32);
  EXPECT_GE(r.hits + r.misses, 2 * 2 * 6 * 32);
  EXPECT_GT(r.hits, 0);
  EXPECT_GT(r.misses, 0);
}

// The reserved newest rows take each step's new tokens out of the LRU; the write-back puts
// them into the host pool, which the loop checks entry by entry against what it generated.
TEST(VerifyLoop, ReservedNewestRowsAndTheWriteBackAreLossless) {
  VerifyConfig c = small();
  c.reserve_newest = true;
  const VerifyReport r = run_verify(ModelSpec::deepseek_v32_exp(), c);
  EXPECT_TRUE(r.bitwise_equal) << r.first_mismatch;
  EXPECT_EQ(r.mismatched_host_entries, 0);
  EXPECT_EQ(r.compared_outputs, 2 * 2 * 6 * 2);
  const VerifyReport plain = run_verify(ModelSpec::deepseek_v32_exp(), small());
  EXPECT_GT(r.hits + r.misses, 0);
  EXPECT_LT(r.misses, plain.misses);  // the newest tokens never miss
}

// A pool below T x K: steps whose query tokens select more distinct ids than it holds run in
// query groups, stay bit-identical, and are counted; a pool that holds T x K never splits.
TEST(VerifyLoop, StepsLargerThanThePoolRunInQueryGroupsLosslessly) {
  for (const bool reserve : {false, true}) {
    VerifyConfig c = small();
    c.mtp = 4;
    c.slots = 40;  // K 32 <= 40 < T x K 128
    c.query_drift = 0.4;
    c.reserve_newest = reserve;
    const VerifyReport r = run_verify(ModelSpec::deepseek_v32_exp(), c);
    EXPECT_TRUE(r.bitwise_equal) << r.first_mismatch;
    EXPECT_EQ(r.compared_outputs, 2 * 2 * 6 * 4);
    EXPECT_GT(r.split_steps, 0);
    EXPECT_LE(r.split_steps, 2 * 2 * 6);
    EXPECT_GE(r.group_calls, 1);
    c.inject_fault = true;  // the check still sees a flipped bit in a split step
    EXPECT_FALSE(run_verify(ModelSpec::deepseek_v32_exp(), c).bitwise_equal);
  }
  VerifyConfig whole = small();
  whole.mtp = 4;
  whole.slots = 128;
  const VerifyReport r = run_verify(ModelSpec::deepseek_v32_exp(), whole);
  EXPECT_EQ(r.split_steps, 0);
  EXPECT_EQ(r.group_calls, 0);
}

// Requests 1.. on request 0's prompt prefix: the host pool holds the shared pages once and
// every attention output stays bit-identical.
TEST(VerifyLoop, SharedPromptPrefixesAreLosslessAndSaveHostBytes) {
  VerifyConfig c = small();
  c.requests = 3;
  c.context = 512;
  const VerifyReport none = run_verify(ModelSpec::deepseek_v32_exp(), c);
  c.prefix_share = 0.5;  // 256 tokens: 4 pages per layer shared by 3 requests
  const VerifyReport half = run_verify(ModelSpec::deepseek_v32_exp(), c);
  EXPECT_TRUE(half.bitwise_equal) << half.first_mismatch;
  EXPECT_EQ(half.mismatched_host_entries, 0);
  EXPECT_EQ(half.host_bytes_unshared, none.host_bytes);
  EXPECT_EQ(none.host_bytes_unshared, none.host_bytes);
  const std::uint64_t page = 64 * 656;
  EXPECT_EQ(none.host_bytes - half.host_bytes, 2ull * 4 * 2 * page);  // 2 requests x 4 pages x 2 layers
  c.prefix_share = 1.5;
  EXPECT_THROW(run_verify(ModelSpec::deepseek_v32_exp(), c), Error);
}

// Residency: whole requests read every entry in place (no miss, no swap decision); adaptive
// demotes request 0 when its growth finds no free row and promotes it back once the last request
// finishes; both bit-identical, and the check still fails on a corrupted row.
TEST(VerifyLoop, WholeAndAdaptiveResidencyAreLossless) {
  VerifyConfig c = small();
  c.reserve_newest = true;
  c.residency = Residency::kWhole;
  VerifyReport r = run_verify(ModelSpec::deepseek_v32_exp(), c);
  EXPECT_TRUE(r.bitwise_equal) << r.first_mismatch;
  EXPECT_EQ(r.misses, 0);
  EXPECT_EQ(r.swap_launches, 0);
  EXPECT_EQ(r.whole_steps, 2 * 2 * 6);
  EXPECT_EQ(r.sparse_steps, 0);
  EXPECT_EQ(r.pool_rows, 2 * 4);  // 312 tokens in rows of 90
  c.inject_fault = true;
  EXPECT_FALSE(run_verify(ModelSpec::deepseek_v32_exp(), c).bitwise_equal);

  c = small();
  c.reserve_newest = true;
  c.residency = Residency::kAdaptive;
  c.context = 355;  // 4 rows of 90; the third step's growth needs a fifth
  c.slots = 90;
  r = run_verify(ModelSpec::deepseek_v32_exp(), c);
  EXPECT_TRUE(r.bitwise_equal) << r.first_mismatch;
  EXPECT_EQ(r.mismatched_host_entries, 0);
  EXPECT_EQ(r.pool_rows, 4 + 1);
  EXPECT_EQ(r.demotions, 1);
  EXPECT_EQ(r.promotions, 1);
  EXPECT_GT(r.whole_steps, 0);
  EXPECT_GT(r.sparse_steps, 0);
  EXPECT_GT(r.misses, 0);
  EXPECT_EQ(r.compared_outputs, (2 * 3 + 1 * 3) * 2 * 2);  // the last request finishes after 3 steps

  c.reserve_newest = false;
  EXPECT_THROW(run_verify(ModelSpec::deepseek_v32_exp(), c), Error);
}

// GLM-5.2's index sharing (layers 3, 4, 5 and 7 of the first 8 reuse the top-k of layers 2 and
// 6): each follower's step issued right after its leader's, or at its own turn; both lossless,
// with the same decisions (a follower's pool sees its leader's ids from the warm-up on, so its
// hits and misses are its leader's), and the check still fails on a corrupted follower row.
TEST(VerifyLoop, SharedIndexLayersPrefetchedAtTheirLeadersStepAreLossless) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/glm-5.2.json");
  VerifyConfig c = small();
  c.layers = 8;
  c.reserve_newest = true;
  const VerifyReport on = run_verify(m, c);
  EXPECT_TRUE(on.bitwise_equal) << on.first_mismatch;
  EXPECT_EQ(on.mismatched_host_entries, 0);
  EXPECT_EQ(on.shared_layers, (std::vector<int>{3, 4, 5, 7}));
  EXPECT_EQ(on.prefetched_steps, 4 * 6);
  EXPECT_EQ(on.compared_outputs, 2 * 8 * 6 * 2);
  c.shared_index_prefetch = false;
  const VerifyReport off = run_verify(m, c);
  EXPECT_TRUE(off.bitwise_equal) << off.first_mismatch;
  EXPECT_EQ(off.prefetched_steps, 0);
  for (int l = 0; l < 8; ++l) {
    const auto& a = on.per_layer[static_cast<std::size_t>(l)];
    const auto& b = off.per_layer[static_cast<std::size_t>(l)];
    const auto& leader = on.per_layer[static_cast<std::size_t>(m.index_leader(l))];
    EXPECT_EQ(a.hits, b.hits) << l;
    EXPECT_EQ(a.misses, b.misses) << l;
    EXPECT_EQ(a.hits, leader.hits) << l;
    EXPECT_EQ(a.misses, leader.misses) << l;
  }
  EXPECT_GT(on.misses, 0);
  c.shared_index_prefetch = true;
  c.inject_fault = true;  // a flipped bit in layer 7's rows, which its leader's step filled
  EXPECT_FALSE(run_verify(m, c).bitwise_equal);
  // A leader split into query groups: its followers step at their own turn, still lossless.
  c.inject_fault = false;
  c.mtp = 4;
  c.slots = 40;
  c.query_drift = 0.4;
  const VerifyReport split = run_verify(m, c);
  EXPECT_TRUE(split.bitwise_equal) << split.first_mismatch;
  EXPECT_GT(split.split_steps, 0);
  EXPECT_LT(split.prefetched_steps, 4 * 6);
}

// DeepSeek-V4's C4 cache end to end: entries of 4 tokens (a step adds one every fourth step), its
// layers with a C4 cache only, rows in two parts (C4 pages), sparse and adaptive residency; the
// check still catches a flipped bit of a row's scale part; MTP > 1 is refused by name.
TEST(VerifyLoop, DeepSeekV4sCompressedCacheIsLossless) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json");
  const std::vector<int> c4 = m.offloaded_layers();
  ASSERT_GE(c4.size(), 3u);
  VerifyConfig c = small();
  c.layers = 3;
  c.context = 1203;  // 300 entries; the first step's token completes the 301st
  c.mtp = 1;
  c.steps = 9;
  c.reserve_newest = true;
  c.topk = 64;
  c.slots = 75;  // request 0 whole fills its 4 rows: the 301st entry demotes it (adaptive)
  for (const Residency residency : {Residency::kSparse, Residency::kAdaptive}) {
    c.residency = residency;
    const VerifyReport r = run_verify(m, c);
    EXPECT_TRUE(r.bitwise_equal) << to_string(residency) << ": " << r.first_mismatch;
    EXPECT_EQ(r.mismatched_host_entries, 0);
    EXPECT_EQ(r.tokens_per_entry, 4);
    // adaptive: request 1 finishes after 4 steps (its rows let request 0 be promoted back)
    EXPECT_EQ(r.compared_outputs, residency == Residency::kSparse ? 2 * 3 * 9 : (9 + 4) * 3);
    if (residency == Residency::kAdaptive) {  // demoted at its growth, promoted when request 1 finishes
      EXPECT_GT(r.whole_steps, 0);
      EXPECT_GT(r.demotions, 0);
      EXPECT_GT(r.promotions, 0);
    }
    for (int l = 0; l < 3; ++l) EXPECT_EQ(r.per_layer[static_cast<std::size_t>(l)].model_layer, c4[static_cast<std::size_t>(l)]);
    EXPECT_GT(r.misses, 0);
  }
  c.residency = Residency::kSparse;
  c.inject_fault = true;
  EXPECT_FALSE(run_verify(m, c).bitwise_equal);
  c.inject_fault = false;
  c.mtp = 2;
  try {
    (void)run_verify(m, c);
    ADD_FAILURE() << "MTP 2 over a compressed cache was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--mtp = 2"), std::string::npos) << e.what();
  }
}

// MiniMax-M3: K / V entries in two regions (as SGLang's two tensors), a block top-k (the newest
// block and the best-scoring others, expanded to their tokens), grouped-query attention compared.
TEST(VerifyLoop, MiniMaxM3sKeyValueBlocksAreLossless) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/minimax-m3.json");
  VerifyConfig c = small();
  c.layers = 2;
  c.context = 1500;  // 12 blocks of 128, the last partly filled
  c.steps = 6;
  c.topk = 3 * 128;
  c.slots = 400;
  c.reserve_newest = true;
  for (const int mtp : {1, 2}) {
    for (const Residency residency : {Residency::kSparse, Residency::kAdaptive}) {
      c.mtp = mtp;
      c.residency = residency;
      const VerifyReport r = run_verify(m, c);
      EXPECT_TRUE(r.bitwise_equal) << to_string(residency) << " mtp " << mtp << ": " << r.first_mismatch;
      EXPECT_EQ(r.mismatched_host_entries, 0);
      EXPECT_GT(r.compared_outputs, 0);
      EXPECT_EQ(r.per_layer[0].model_layer, 3);  // the first sparse layer
      if (residency == Residency::kSparse) {
        EXPECT_GT(r.misses, 0);
      }
    }
  }
  c.residency = Residency::kSparse;
  c.mtp = 1;
  c.inject_fault = true;
  EXPECT_FALSE(run_verify(m, c).bitwise_equal);
  c.inject_fault = false;
  c.topk = 200;
  try {
    (void)run_verify(m, c);
    ADD_FAILURE() << "a top-k of 200 tokens over 128-token blocks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a multiple of its 128-token blocks"), std::string::npos) << e.what();
  }
}

// A bf16 latent (SGLang's DSA pool with --kv-cache-dtype bfloat16): 1,152-byte entries moved and
// read bit for bit; the fault still shows.
TEST(VerifyLoop, Bf16LatentIsLossless) {
  nlohmann::json j = ModelSpec::deepseek_v32_exp().to_json();
  j["kv_cache_dtype"] = "bfloat16";
  const ModelSpec m = ModelSpec::from_json(j, "bf16");
  VerifyConfig c = small();
  c.reserve_newest = true;
  const VerifyReport r = run_verify(m, c);
  EXPECT_TRUE(r.bitwise_equal) << r.first_mismatch;
  EXPECT_EQ(r.mismatched_host_entries, 0);
  EXPECT_GT(r.misses, 0);
  EXPECT_GT(r.compared_outputs, 0);
  c.inject_fault = true;
  EXPECT_FALSE(run_verify(m, c).bitwise_equal);
}

TEST(VerifyLoop, TheCheckCanFail) {
  VerifyConfig c = small();
  c.inject_fault = true;  // one flipped bit in one slot
  const VerifyReport r = run_verify(ModelSpec::deepseek_v32_exp(), c);
  EXPECT_FALSE(r.bitwise_equal);
  EXPECT_GE(r.mismatched_outputs, 1);
  EXPECT_NE(r.first_mismatch.find("request 0"), std::string::npos) << r.first_mismatch;
}

TEST(VerifyLoop, WarmupCutsTheFirstStepsMisses) {
  VerifyConfig warm = small();
  warm.warmup_windows = 32;
  warm.query_drift = 0.05;
  VerifyConfig cold = warm;
  cold.warmup_windows = 0;
  const VerifyReport a = run_verify(ModelSpec::deepseek_v32_exp(), warm);
  const VerifyReport b = run_verify(ModelSpec::deepseek_v32_exp(), cold);
  ASSERT_FALSE(a.misses_per_step.empty());
  EXPECT_LT(a.misses_per_step[0] * 2, b.misses_per_step[0]);
  EXPECT_TRUE(a.bitwise_equal && b.bitwise_equal);
}

TEST(VerifyLoop, IsDeterministicAndValidatesItsConfig) {
  const ModelSpec m = ModelSpec::deepseek_v32_exp();
  const VerifyReport a = run_verify(m, small());
  const VerifyReport b = run_verify(m, small());
  EXPECT_EQ(a.misses_per_step, b.misses_per_step);
  EXPECT_EQ(a.hits, b.hits);
  VerifyConfig bad = small();
  bad.layers = 62;
  EXPECT_THROW(run_verify(m, bad), Error);
  bad = small();
  bad.slots = 10;  // smaller than T x K = 64
  EXPECT_THROW(run_verify(m, bad), Error);
  bad = small();
  bad.ratio = 1.2;
  EXPECT_THROW(run_verify(m, bad), Error);
}

}  // namespace
}  // namespace ess
