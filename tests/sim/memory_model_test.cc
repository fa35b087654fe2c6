#include <gtest/gtest.h>

#include <cmath>
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

// A deployment the step model does not describe for a model is refused by name, not sized as DSA:
// MiniMax-M3 under data-parallel attention (SGLang's HiSparse holds one KV head per rank).
TEST(sim_memory, MiniMaxM3UnderDataParallelAttentionIsRefusedByName) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/minimax-m3.json");
  try {
    MemoryModel mem(m, paper_hw(), paper_dep(), 32768);
    FAIL() << "MiniMax-M3 was sized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one KV head per rank"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(m.name), std::string::npos) << e.what();
  }
}

// DeepSeek-V4-Flash's caches per request at 32K, as SGLang's pools size them: the C4 cache (21
// layers of ratio 4, an entry per 4 tokens) is what offloads; the C4 indexer keys (132 B per C4
// entry), the 20 C128 layers' entries, the 43 layers' windows and the compressors' fp32 state rings
// stay. An entry is 584 B; pages of 256 tokens padded to a multiple of 576 B: 64 C4 entries or 256
// window tokens in 65 x 576 B (585 B each), 2 C128 entries in 3 x 576 B (864 B each). The window as
// the scheduler holds it at worst: 128 + 128 (eviction interval) + 256 + 256 = 768 tokens; the C4
// states 8 rows per 256 of them (24), of 4 x 512 + 4 x 128 fp32; the C128 states 128 rows of 2 x 512.
TEST(sim_memory, DeepSeekV4KeepsItsC4CacheOffloadableAndTheRestResident) {
  const ModelSpec m = ModelSpec::from_file(ESS_SOURCE_DIR "/configs/models/deepseek-v4-flash.json");
  Deployment dep = paper_dep();
  dep.mtp_tokens = 1;
  const MemoryModel mem(m, paper_hw(), dep, 32768);
  const V4Caches v4 = V4Caches::of(m);
  EXPECT_EQ(v4.c4_layers, 21);
  EXPECT_EQ(v4.c128_layers, 20);
  EXPECT_DOUBLE_EQ(v4.entry_data_bytes, 584);
  EXPECT_DOUBLE_EQ(v4.entry_bytes, 585);
  EXPECT_DOUBLE_EQ(v4.c128_entry_bytes, 864);
  EXPECT_DOUBLE_EQ(v4.window_tokens, 768);
  EXPECT_EQ(mem.cache_layers(), 21);
  EXPECT_EQ(mem.context_entries(), 8192);
  EXPECT_DOUBLE_EQ(mem.indexer_bytes_per_request(), 8192.0 * 21 * 132);
  EXPECT_DOUBLE_EQ(mem.latent_bytes_per_request(1000), 1000.0 * 21 * 585);
  const double states = 21 * 24 * (2048 + 512) * 4.0 + 20 * 128 * 1024 * 4.0;
  const double resident = 256.0 * 20 * 864 + 768.0 * 43 * 585 + states;
  EXPECT_DOUBLE_EQ(mem.resident_bytes_per_request(), mem.indexer_bytes_per_request() + resident);
  // Offload frees the C4 cache of all but the pool: each request takes its resident caches and a pool
  // of 1639 C4 entries (20 %) a layer, where whole it took all 8192.
  const int whole = mem.max_batch(8192), pooled = mem.max_batch(1639);
  const double per = mem.resident_bytes_per_request();
  EXPECT_EQ(whole, static_cast<int>(std::floor(mem.cache_budget() / (per + 8192.0 * 21 * 585))));
  EXPECT_EQ(pooled, static_cast<int>(std::floor(mem.cache_budget() / (per + 1639.0 * 21 * 585))));
  EXPECT_GT(pooled, 19 * whole / 10);
  // The host pool: every C4 entry of every request, in 592-byte host entries.
  EXPECT_DOUBLE_EQ(mem.host_pool_bytes_per_node(1), 8.0 * 8192 * 21 * 592);
}

TEST(sim_memory, WeightsLargerThanTheGpuAreRefused) {
  HardwareProfile hw = paper_hw();
  hw.hbm_capacity_gb = 40;
  EXPECT_THROW(MemoryModel(dsv32(), hw, paper_dep(), 32768), Error);
}

}  // namespace
}  // namespace ess::sim
