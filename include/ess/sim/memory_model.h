// Memory model of one decode GPU: weights under the deployment's sharding, the indexer cache
// (always whole on the GPU), the latent cache (Sparse Memory Pool: slots per request-layer),
// activations and workspace, the CUDA context; and the host side (Total Memory Pool of all
// GPUs of a node against host DRAM). All sizes in bytes.
#pragma once

#include <cstdint>

#include "ess/model/model_spec.h"
#include "ess/sim/deployment.h"
#include "ess/sim/hardware.h"

namespace ess::sim {

struct WeightBytes {
  double attention = 0;       // MLA + indexer projections, every layer (+ the MTP layer)
  double dense_ffn = 0;       // the first_k_dense_replace layers' FFN
  double shared_experts = 0;
  double routed_experts = 0;  // this GPU's share under expert parallelism
  double embedding = 0;       // embedding + LM head (+ the MTP layer's eh_proj), BF16
  double router = 0;
  double total() const { return attention + dense_ffn + shared_experts + routed_experts + embedding + router; }
};

// Throws ess::Error naming the model unless its layers are what the step model models: DSA's
// (DeepSeek-V3.2, GLM-5.x). DeepSeek-V4 is refused, with the reason.
void require_dsa_layers(const ModelSpec& m);

class MemoryModel {
 public:
  // `min_slots`: the pool's floor (MissModel::min_slots: from the measured MTP working set);
  // 0 = min(T x top-k, context), a pool no step can overflow.
  MemoryModel(const ModelSpec& model, const HardwareProfile& hw, const Deployment& dep,
              std::int64_t context, double min_slots = 0);

  const WeightBytes& weights() const { return weights_; }
  int cache_layers() const { return cache_layers_; }  // layers holding a cache (+ MTP layer)
  // Layers holding indexer keys and weights (+ MTP layer): a layer that reuses its leader's top-k
  // (ModelSpec::shared_index) has neither.
  int indexer_layers() const { return indexer_layers_; }
  double hbm_bytes() const;
  // HBM x mem_fraction_static - weights: what the indexer and latent caches may use.
  double cache_budget() const { return cache_budget_; }
  // (1 - mem_fraction_static) x HBM - CUDA context: what activations and workspace may use.
  double activation_budget() const;
  double indexer_bytes_per_request() const;                  // whole context, every indexer layer
  double latent_bytes_per_request(double slots) const;       // slots x cache layers x 656
  double activation_bytes(int batch) const;                  // B x T tokens in flight + workspace
  // Smallest pool a plan may use: as constructed (at least one query token's top-k; a step
  // whose working set exceeds the pool runs in query groups).
  std::int32_t min_slots() const { return min_slots_; }

  // Largest batch whose caches fit with `slots` per request-layer (0 when none fits).
  int max_batch(double slots) const;
  // Most slots per request-layer that fit `batch` requests (capped at the context). Throws
  // ess::Error naming the batch when even min_slots() does not fit or activations overflow.
  std::int32_t slots_for_batch(int batch) const;
  // Throws unless `batch` requests with `slots` each fit (message names what overflows).
  void check_fits(int batch, double slots) const;

  // Host: the Total Memory Pool of all GPUs of a node (every token of every layer). With a
  // shared prompt prefix (prefix_share of the context common to every request of a GPU), its
  // full pages are held once per GPU's pool.
  double host_pool_bytes_per_node(int batch, double prefix_share = 0) const;

 private:
  ModelSpec model_;
  HardwareProfile hw_;
  Deployment dep_;
  std::int64_t context_;
  int cache_layers_ = 0;
  int indexer_layers_ = 0;
  WeightBytes weights_;
  double cache_budget_ = 0;
  std::int32_t min_slots_ = 0;
};

}  // namespace ess::sim
