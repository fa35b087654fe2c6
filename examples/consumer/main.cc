// One engine-side use of ESS, written as a serving engine would: an Offload over two layers of
// DeepSeek-V3.2's latent cache, two requests admitted with their prompts' entries, LRU-Warmup,
// one decode step whose new entries are written back, then the per-layer step, whose rows are
// checked to hold exactly the host entries of the tokens selected; and the analysis library's
// memory model sizing the same deployment. Runs on the CPU backend, where every pointer is
// host memory (with Backend::kCuda they are device memory and the calls go on a stream).
// Exit status 0 when every row checked is exact.
#include <cstdio>
#include <cstring>
#include <vector>

#include "ess/runtime/offload.h"
#include "ess/sim/memory_model.h"
#include "ess/version.h"

int main() {
  const ess::ModelSpec model = ess::ModelSpec::deepseek_v32_exp();
  ess::OffloadConfig config = ess::OffloadConfig::for_model(model, /*max_requests=*/2, /*slots=*/2048,
                                                            /*max_context=*/4096);
  config.layers = 2;  // two of the model's layers keep the example small
  config.reserve_newest = true;
  config.backend = ess::Backend::kCpu;
  ess::Offload offload(config);
  const std::size_t E = config.layout.bytes();
  const auto entry = [&](ess::RequestId id, int layer, std::int64_t token) {
    std::vector<std::uint8_t> e(E);
    for (std::size_t i = 0; i < E; ++i) e[i] = static_cast<std::uint8_t>(id * 31 + layer * 7 + token * 13 + i);
    return e;
  };

  // Admission: the prompt's entries into the host pool, then LRU-Warmup from the prefill's
  // last top-k windows ([layers][windows][topk]).
  const std::int64_t prompt = 3000;
  const int K = config.topk, W = 4;
  std::vector<std::int32_t> rows;
  for (ess::RequestId id : {7, 9}) {
    rows.push_back(offload.admit(id, prompt));
    for (int l = 0; l < config.layers; ++l) {
      for (std::int64_t t = 0; t < prompt; ++t) {
        const auto e = entry(id, l, t);
        std::memcpy(offload.host_entry(id, l, t).data(), e.data(), E);
      }
    }
    std::vector<std::int32_t> windows(static_cast<std::size_t>(config.layers) * W * K);
    for (std::size_t i = 0; i < windows.size(); ++i) windows[i] = static_cast<std::int32_t>((i * 7) % prompt);
    offload.warmup(id, windows, W);
  }

  // A decode step: one new token per request, its entries written by the model into the
  // reserved rows; then each layer's step and the write-back of the new entries.
  std::vector<std::int32_t> lengths;
  for (ess::RequestId id : {7, 9}) {
    offload.extend(id, 1);
    lengths.push_back(static_cast<std::int32_t>(offload.length(id)));
  }
  std::vector<std::int32_t> topk(2 * static_cast<std::size_t>(K)), physical(topk.size());
  std::vector<std::int32_t> counts(4);
  bool exact = true;
  for (int l = 0; l < config.layers; ++l) {
    for (std::size_t b = 0; b < 2; ++b) {
      const ess::RequestId id = b == 0 ? 7 : 9;
      const auto e = entry(id, l, lengths[b] - 1);
      std::memcpy(offload.buffer().layer_base[static_cast<std::size_t>(l)] +
                      offload.buffer().rows.offset(rows[b] * offload.rows_per_request() + config.slots),
                  e.data(), E);
      for (int k = 0; k < K; ++k) topk[b * K + static_cast<std::size_t>(k)] = (k * 11 + static_cast<int>(b)) % lengths[b];
    }
    ess::LayerStep step;
    step.layer = l;
    step.batch = 2;
    step.rows = rows.data();
    step.topk = topk.data();
    step.lengths = lengths.data();
    step.physical = physical.data();  // what FlashMLA's sparse decode reads as its indices
    step.counts = counts.data();
    offload.step(step);
    ess::WriteBack wb;
    wb.layer = l;
    wb.batch = 2;
    wb.rows = rows.data();
    wb.lengths = lengths.data();
    offload.write_back(wb);
    for (std::size_t i = 0; i < topk.size(); ++i) {
      const ess::RequestId id = i < static_cast<std::size_t>(K) ? 7 : 9;
      const std::vector<std::uint8_t> got = offload.read_row(l, physical[i]);
      exact = exact && got == entry(id, l, topk[i]);
    }
    std::printf("layer %d: request 7 %d hits %d misses, request 9 %d hits %d misses\n", l, counts[0], counts[1], counts[2],
                counts[3]);
  }
  const ess::OffloadStats st = offload.stats();
  std::printf("ESS %s: %lld layer steps, %lld warm-up fills, host pool %.1f of %.1f MB; rows %s\n", ESS_VERSION,
              static_cast<long long>(st.steps), static_cast<long long>(st.warmup_fills), static_cast<double>(st.host_bytes_used) / 1e6,
              static_cast<double>(st.host_bytes_capacity) / 1e6, exact ? "exact" : "NOT EXACT");

  // The analysis side: how many requests of 32K context one H200 of the paper's deployment
  // holds with 6554 slots per request-layer (a Sparse Memory Ratio of 0.2).
  const ess::sim::MemoryModel mm(model, ess::sim::HardwareProfile::shipped("h200"),
                                 ess::sim::Deployment::shipped("paper-table1"), 32768);
  std::printf("h200, paper-table1, 32K context: max batch %d resident, %d with ESS at ratio 0.2\n", mm.max_batch(32768),
              mm.max_batch(6554));
  return exact ? 0 : 1;
}
