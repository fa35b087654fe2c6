#include <gtest/gtest.h>

#include <string>

#include "ess/core/error.h"
#include "ess/model/model_spec.h"
#include "ess/sim/memory_model.h"
#include "sim/sim_test_util.h"

namespace ess::sim {
namespace {

using testing::dsv32;
using testing::paper_dep;
using testing::paper_hw;

constexpr double kFp8 = 1.0 + 4.0 / 16384.0;

TEST(sim_memory, WeightsByHand) {
  const MemoryModel mem(dsv32(), paper_hw(), paper_dep(), 32768);
  // Per layer: q_a 7168x1536 + q_b 1536x128x192 + kv_a 7168x576 + kv_b 512x128x256 + o 128x128x7168
  //          + indexer wq_b 1536x64x128 + wk 7168x128 + weights_proj 7168x64 = 201,064,448 params.
  // 61 layers + the MTP layer (MTP 2) = 62.
  EXPECT_EQ(mem.cache_layers(), 62);
  EXPECT_DOUBLE_EQ(mem.weights().attention, 201064448.0 * 62 * kFp8);
  // Routed experts: 256 / EP 32 = 8 per GPU, 3 x 7168 x 2048 params each, 58 + 1 MoE layers.
  EXPECT_DOUBLE_EQ(mem.weights().routed_experts, 8.0 * 44040192.0 * 59 * kFp8);
  EXPECT_DOUBLE_EQ(mem.weights().shared_experts, 44040192.0 * 59 * kFp8);
  EXPECT_DOUBLE_EQ(mem.weights().dense_ffn, 3.0 * 7168 * 18432 * 3 * kFp8);
  // Embedding + LM head in BF16, plus the MTP eh_proj (2H x H).
  EXPECT_DOUBLE_EQ(mem.weights().embedding, 2.0 * 7168 * 129280 * 2 + 2.0 * 7168 * 7168 * 2);
  EXPECT_NEAR(mem.weights().total() / 1e9, 41.18, 0.01);
}

TEST(sim_memory, CachesByHand) {
  const MemoryModel mem(dsv32(), paper_hw(), paper_dep(), 32768);
  EXPECT_DOUBLE_EQ(mem.indexer_bytes_per_request(), 32768.0 * 62 * 132);
  EXPECT_DOUBLE_EQ(mem.latent_bytes_per_request(6554), 6554.0 * 62 * 656);
  EXPECT_EQ(mem.min_slots(), 2 * 2048);
  // Budget = 150.75 GB x 0.85 - weights.
  EXPECT_DOUBLE_EQ(mem.cache_budget(), 150.75e9 * 0.85 - mem.weights().total());
  const double per_request_full = 32768.0 * 62 * (132 + 656);
  EXPECT_EQ(mem.max_batch(32768), static_cast<int>(mem.cache_budget() / per_request_full));
  // Host: 8 GPUs x B x context x 62 layers x 656 B.
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(160), 8.0 * 160 * 32768 * 62 * 656);
}

TEST(sim_memory, NoMtpLayerWithoutMtp) {
  Deployment d = paper_dep();
  d.mtp_tokens = 1;
  d.accept_ratio = 1.0;
  const MemoryModel mem(dsv32(), paper_hw(), d, 32768);
  EXPECT_EQ(mem.cache_layers(), 61);
  EXPECT_EQ(mem.min_slots(), 2048);
}

TEST(sim_memory, SlotsForBatchIsTheMostThatFits) {
  const MemoryModel mem(dsv32(), paper_hw(), paper_dep(), 32768);
  for (int b : {60, 64, 100, 160, 200}) {
    const std::int32_t s = mem.slots_for_batch(b);
    EXPECT_NO_THROW(mem.check_fits(b, s));
    if (s < 32768) {
      EXPECT_THROW(mem.check_fits(b, s + 1), Error) << b;
    }
  }
  EXPECT_EQ(mem.slots_for_batch(10), 32768);  // capped at the context
}

TEST(sim_memory, BatchThatCannotFitIsAClearError) {
  const MemoryModel mem(dsv32(), paper_hw(), paper_dep(), 32768);
  try {
    mem.slots_for_batch(400);
    FAIL() << "batch 400 fitted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch 400 cannot fit"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mem.check_fits(0, 4096), Error);
  EXPECT_THROW(mem.check_fits(10, 100), Error);  // below T x top-k
}

// Models whose attention the step model does not describe are refused by name, not sized as DSA.
TEST(sim_memory, ModelsOtherThanDsaAreRefusedByName) {
  for (const char* file : {"deepseek-v4-flash.json", "minimax-m3.json"}) {
    const ModelSpec m = ModelSpec::from_file(std::string(ESS_SOURCE_DIR "/configs/models/") + file);
    try {
      MemoryModel mem(m, paper_hw(), paper_dep(), 32768);
      FAIL() << file << " was sized";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not modelled yet"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(m.name), std::string::npos) << e.what();
    }
  }
}

TEST(sim_memory, WeightsLargerThanTheGpuAreRefused) {
  HardwareProfile hw = paper_hw();
  hw.hbm_capacity_gb = 40;
  EXPECT_THROW(MemoryModel(dsv32(), hw, paper_dep(), 32768), Error);
}

}  // namespace
}  // namespace ess::sim
