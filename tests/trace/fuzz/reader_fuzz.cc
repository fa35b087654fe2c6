// libFuzzer target for the trace reader (and, on inputs that pass validation, the analyzer).
// Any input must either parse or raise ess::Error: no crash, no hang, no sanitizer report.
// Built with clang only (-DESS_FUZZ=ON); run briefly by scripts/fuzz.sh.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "ess/core/error.h"
#include "ess/trace/analyzer.h"
#include "ess/trace/format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto reader = ess::trace::TraceReader::from_bytes(std::span(data, size), "fuzz-input");
    // Bound the work per input (the fuzzer looks for crashes, not for slow but valid traces).
    std::int64_t ids = 0;
    std::int64_t longest = 0;
    for (std::size_t i = 0; i < reader.requests(); ++i) {
      const auto& r = reader.request(i);
      ids += r.steps * r.layers * r.mtp * r.topk;
      for (auto l : r.lengths) longest = std::max(longest, l);
    }
    if (longest > (1 << 16) || reader.requests() > 64) return 0;
    reader.validate_all();
    if (ids > 0 && ids <= 4096 && longest <= 4096 && reader.meta().layers <= 64) {
      ess::trace::AnalyzeConfig c;
      c.slots = {reader.meta().mtp * reader.meta().topk};
      c.steady_from = 0;
      c.recommend = false;
      c.threads = 1;
      (void)ess::trace::analyze(reader, c);
    }
  } catch (const ess::Error&) {
    // Rejected with a message: the expected outcome for most inputs.
  }
  return 0;
}
