// The emulated CUDA target's kernel launchers: the same functions, launch shapes and argument
// checks as the .cu launchers (flashtrans.cu, swap_engine_gpu.cu, offload.cu, split.cu), each
// running its kernel's own CTA program on the CTA emulator (cta_emulator.h) to completion.
// Every launch records its kernel for coverage and is followed by a check of every
// allocation's guards; FlashTrans's accesses (made through its policy) must each lie inside
// one allocation of the device (device memory or mapped pinned host memory).
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>

#include "device.h"
#include "streams.h"
#include "runtime/cuda/backend_impl.h"
#include "runtime/cuda/smem_limit.h"
#include "runtime/offload/offload_cta.h"
#include "runtime/ops/flashtrans/flashtrans_cta.h"
#include "runtime/ops/gpu_swap/swap_engine_cta.h"
#include "runtime/ops/gpu_swap/swap_engine_launch.h"
#include "runtime/ops/launch_args.h"
#include "runtime/ops/split/split.h"
#include "runtime/ops/split/split_cta.h"
#include "testing/emulator/cta_emulator.h"

namespace ess::cuda {
namespace {

using emu::Device;

// What a <<<blocks, threads, smem, stream>>> launch checks before it runs.
cudaError_t admit(const char* kernel, long long blocks, int threads, std::size_t smem, std::size_t static_smem, Stream stream) {
  Device& d = Device::get();
  if (const cudaError_t f = d.injected(kernel); f != cudaSuccess) return f;
  if (!d.valid_stream(static_cast<cudaStream_t>(stream))) {
    return d.fail(cudaErrorInvalidResourceHandle, std::string(kernel) + ": launched on a stream that is not live", true);
  }
  if (blocks <= 0 || blocks > 0x7fffffffLL || threads <= 0 || threads > 1024) {
    return d.fail(cudaErrorInvalidValue,
                  std::string(kernel) + ": launch of " + std::to_string(blocks) + " blocks of " + std::to_string(threads) + " threads",
                  false);
  }
  if (smem + static_smem > static_cast<std::size_t>(Device::kSharedMemoryOptin)) {
    return d.fail(cudaErrorInvalidValue,
                  std::string(kernel) + ": " + std::to_string(smem) + " bytes of dynamic shared memory exceed the block's limit",
                  false);
  }
  return cudaSuccess;
}

// Issues `program` as the launch on `stream` (streams.h: it runs at once, or when a synchronization
// needs it), in clusters of `cluster` blocks (1: a launch without clusters; cudaLaunchKernelEx with
// a cluster dimension otherwise), then checks the device's guards. The program holds copies of its
// arguments, as a launch's parameters are copied when it is issued.
template <typename Program>
cudaError_t run(const char* kernel, long long blocks, int threads, std::size_t smem, Stream stream, Program program,
                int cluster = 1) {
  const std::uint64_t seed = Device::get().next_seed();
  return emu::enqueue(static_cast<cudaStream_t>(stream), kernel, [=]() -> cudaError_t {
    emu::launch_clusters(kernel, static_cast<unsigned>(blocks), cluster, threads, smem, seed, program);
    return Device::get().check_guards(std::string("after ") + kernel)
               ? cudaSuccess
               : Device::get().fail(cudaErrorIllegalAddress, std::string(kernel) + ": out-of-range write", false);
  });
}

// FlashTrans's policy: 16-byte accesses, each inside one allocation (the first stray one of
// a launch is reported).
class FlashTransPrims {
 public:
  FlashTransPrims(emu::Cta& c, bool& reported) : c_(c), reported_(reported) {}
  int tid() const { return c_.tid(); }
  int threads() const { return c_.threads(); }
  unsigned block() const { return c_.block(); }
  unsigned blocks() const { return c_.blocks(); }
  flashtrans::Chunk load(const flashtrans::Chunk* p) const {
    check(p, 16, "read");
    flashtrans::Chunk v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  void store(flashtrans::Chunk* p, const flashtrans::Chunk& v) const {
    check(p, 16, "write");
    std::memcpy(p, &v, sizeof v);
  }
  std::uint64_t load8(const std::uint64_t* p) const {
    check(p, 8, "read");
    std::uint64_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  void store8(std::uint64_t* p, std::uint64_t v) const {
    check(p, 8, "write");
    std::memcpy(p, &v, sizeof v);
  }

 private:
  void check(const void* p, std::uintptr_t n, const char* what) const {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % n, 0u) << "flashtrans: a " << n << "-byte " << what << " not " << n << "-byte aligned";
    if (!reported_ && Device::get().find(p, n) == nullptr) {
      reported_ = true;
      ADD_FAILURE() << "flashtrans: a " << n << "-byte global " << what << " at " << p << " lies outside every allocation";
    }
  }
  emu::Cta& c_;
  bool& reported_;
};

void swap_step_marker() {}  // stands for the step kernel in the shared-memory limit's calls

}  // namespace

int flashtrans_cuda(const EntryCopy& c, Stream stream) {
  if (!check_args(c).empty()) return cudaErrorInvalidValue;
  if (c.count <= 0) return cudaSuccess;
  const FlashTransGrid g = flashtrans_grid(c);
  if (const cudaError_t e = admit("flashtrans", g.blocks, g.threads, 0, 0, stream); e != cudaSuccess) return e;
  auto reported = std::make_shared<bool>(false);
  return run("flashtrans", g.blocks, g.threads, 0, stream, [c, reported](emu::Cta& cta, std::uint8_t*) {
    FlashTransPrims p(cta, *reported);
    flashtrans::copy_entries_cta(flashtrans::copy_plan(c), p);
  });
}

int swap_step_raise_smem_limit() {
  static DynamicSmemLimit limit;
  return limit.raise(swap_step_marker);
}

int swap_step_cluster_limit(int, std::int32_t) { return kSwapMaxCluster; }  // the emulator holds any

int launch_swap_step(const GpuSwapStep& step, const SwapState& state, int ranks, Stream stream) {
  const int positions = step.query_tokens * step.topk;
  const std::size_t smem = swap_step_smem_bytes(positions, state.slots, ranks);
  const int hash_cap = swap_hash_capacity(positions);
  if (ranks < 1 || ranks > kSwapMaxCluster || (ranks & (ranks - 1)) != 0 || hash_cap % ranks != 0) {
    return Device::get().fail(cudaErrorInvalidValue, "swap_step: a cluster of " + std::to_string(ranks) + " blocks", false);
  }
  const long long blocks = static_cast<long long>(step.batch) * ranks;
  if (const cudaError_t e = admit("swap_step", blocks, swap::kStepThreads, smem, kSwapStepStaticSmemBound, stream);
      e != cudaSuccess) {
    return e;
  }
  auto program = [=](emu::Cta& p, std::uint8_t* sm) {
    swap::swap_step_cta(step, state.slots, state.layers, hash_cap, state.order, state.stamp, state.token, state.clock, sm, p);
  };
  return run(ranks == 1 ? "swap_step" : "swap_step_cluster", blocks, swap::kStepThreads, smem, stream, program, ranks);
}

int launch_swap_reset(const SwapState& state, int row, Stream stream) {
  if (const cudaError_t e = admit("swap_reset", swap::kResetBlocks, swap::kResetThreads, 0, 0, stream); e != cudaSuccess) return e;
  return run("swap_reset", swap::kResetBlocks, swap::kResetThreads, 0, stream, [=](emu::Cta& p, std::uint8_t*) {
    swap::swap_reset_cta(state.order, state.stamp, state.token, state.clock, state.slots, state.layers, row, p);
  });
}

int launch_swap_diff(const std::int32_t* before, const std::int32_t* after, std::int32_t slots, std::int32_t* out_tokens,
                     std::int32_t* out_slots, std::int32_t* count, Stream stream) {
  if (const cudaError_t e = admit("swap_diff", 1, swap::kStepThreads, 0, kSwapStepStaticSmemBound, stream); e != cudaSuccess) return e;
  return run("swap_diff", 1, swap::kStepThreads, 0, stream, [=](emu::Cta& p, std::uint8_t*) {
    swap::swap_diff_cta(before, after, slots, out_tokens, out_slots, count, p);
  });
}

int launch_mask_ids(const StepShape& s, std::int32_t* lru_ids, Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  if (const cudaError_t e = admit("offload_mask", s.batch, offload::kThreads, 0, 0, stream); e != cudaSuccess) return e;
  return run("offload_mask", s.batch, offload::kThreads, 0, stream,
             [=](emu::Cta& p, std::uint8_t*) { offload::mask_cta(s, lru_ids, p); });
}

int launch_finalize_rows(const StepShape& s, const std::int32_t* lru_slots, std::int32_t* slot_ids, std::int32_t* physical,
                         Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  if (const cudaError_t e = admit("offload_finalize", s.batch, offload::kThreads, 0, 0, stream); e != cudaSuccess) return e;
  return run("offload_finalize", s.batch, offload::kThreads, 0, stream,
             [=](emu::Cta& p, std::uint8_t*) { offload::finalize_cta(s, lru_slots, slot_ids, physical, p); });
}

int launch_whole_halves(const StepShape& s, const WholeHalves& h, Stream stream) {
  if (s.batch <= 0) return cudaSuccess;
  if (const cudaError_t e = admit("offload_whole_halves", s.batch, offload::kThreads, 0, 0, stream); e != cudaSuccess) return e;
  return run("offload_whole_halves", s.batch, offload::kThreads, 0, stream,
             [=](emu::Cta& p, std::uint8_t*) { offload::whole_halves_cta(s, h, p); });
}

int launch_host_fill_list(const HostFillList& f, Stream stream) {
  if (f.units == nullptr && !f.reserved ? f.max_count <= 0 : f.length <= f.first) {
    return cudaMemsetAsync(f.total, 0, 8, static_cast<cudaStream_t>(stream));
  }
  if (const cudaError_t e = admit("offload_host_fill_list", 1, offload::kListThreads, 0, 0, stream); e != cudaSuccess) return e;
  return run("offload_host_fill_list", 1, offload::kListThreads, 0, stream,
             [=](emu::Cta& p, std::uint8_t*) { offload::host_fill_list_cta(f, p); });
}

int launch_write_back_list(const WriteBackList& w, Stream stream) {
  if (w.batch <= 0) return cudaSuccess;
  if (const cudaError_t e = admit("offload_write_back_list", 1, offload::kListThreads, 0, 0, stream); e != cudaSuccess) return e;
  return run("offload_write_back_list", 1, offload::kListThreads, 0, stream,
             [=](emu::Cta& p, std::uint8_t*) { offload::write_back_list_cta(w, p); });
}

int split_misses_cuda(const ess::SplitArgs& a, Stream stream) {
  if (!check_args(a).empty()) return cudaErrorInvalidValue;
  if (a.batch == 0) return cudaSuccess;
  if (const cudaError_t e = admit("split", a.batch, split::kThreads, 0, 0, stream); e != cudaSuccess) return e;
  if (const cudaError_t e = run("split_miss_offsets", 1, split::kScanThreads, 0, stream,
                                [=](emu::Cta& p, std::uint8_t*) { split::miss_offsets_cta(a.counts, a.batch, a.miss_offsets, a.total, p); });
      e != cudaSuccess) {
    return e;
  }
  return run("split", a.batch, split::kThreads, 0, stream, [=](emu::Cta& p, std::uint8_t*) { split::split_cta(a, p); });
}

// Ops whose kernels run in their own emulation tests (warp_emulator.h, the indexer's and
// merge's emulation tests) but not behind this target's backend table yet.
int sparse_mla_decode_cuda(const SparseMlaArgs&, Stream) { return cudaErrorNotSupported; }
int merge_states_cuda(const MergeArgs&, Stream) { return cudaErrorNotSupported; }
int indexer_logits_cuda(const IndexerArgs&, Stream) { return cudaErrorNotSupported; }
int topk_cuda(const TopkArgs&, Stream) { return cudaErrorNotSupported; }

}  // namespace ess::cuda
