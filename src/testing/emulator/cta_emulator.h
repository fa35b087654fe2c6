// A CPU emulator of CUDA thread blocks, for running a kernel's own device code (a CTA program
// written against a primitives policy) without a GPU.
//
// Every CUDA thread is a fiber (Boost.Context) on the calling OS thread; fibers run one at a time
// until they block on a barrier, in a seeded random order, so each barrier phase runs its
// threads in a different order per seed. A deadlock (a barrier not every thread reaches) fails
// the test. Shared memory is poisoned (0xa5 bytes) and framed by guard bytes that must be
// intact after the block; global buffers given to a launch can be framed the same way
// (Guarded), so a write out of range fails the test.
//
// Policies built here:
//   Cta          __syncthreads, __syncwarp, __ballot_sync, __match_any_sync, a block-wide exclusive sum (cub::BlockScan's ExclusiveSum,
//                whose storage may not be reused before a __syncthreads: checked), shared
//                atomics (fibers never run concurrently, so they are plain operations);
// warp_emulator.h adds the warp collectives, cp.async, ldmatrix and mma of the sparse MLA
// kernel on the same fibers.
//
// Coverage: each emulated launch records its kernel's name (Coverage); a test asserts that
// every kernel of a source ran.
#pragma once

#include <gtest/gtest.h>
#include <boost/context/fiber.hpp>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ess::emu {

// ---- fibers ----------------------------------------------------------------------------------
// Boost.Context fibers: a switch saves a few registers (no signal-mask system call, as
// swapcontext makes); stacks come from a per-OS-thread pool, reused block after block, carved
// from 2 MiB slabs the kernel may back with huge pages: a block's (or a cluster's) thousands of
// fibers then touch a few hundred TLB entries rather than one page each per switch.
class StackPool {
 public:
  static constexpr std::size_t kSlab = std::size_t{2} << 20;
  explicit StackPool(std::size_t bytes) : bytes_(bytes) {}
  boost::context::stack_context allocate() {
    if (free_.empty()) {
      const std::size_t per_slab = std::max<std::size_t>(1, kSlab / bytes_);
      const std::size_t slab = (per_slab * bytes_ + kSlab - 1) / kSlab * kSlab;
      char* p = static_cast<char*>(std::aligned_alloc(kSlab, slab));  // not zeroed: a fiber touches a few pages
      if (p == nullptr) throw std::bad_alloc();
      madvise(p, slab, MADV_HUGEPAGE);  // a hint: without it the stacks are ordinary pages
      blocks_.emplace_back(p);
      for (std::size_t i = 0; i < per_slab; ++i) free_.push_back(p + i * bytes_);
    }
    char* base = free_.back();
    free_.pop_back();
    boost::context::stack_context sc;
    sc.size = bytes_;
    sc.sp = base + bytes_;
    return sc;
  }
  void deallocate(boost::context::stack_context& sc) noexcept {
    free_.push_back(static_cast<char*>(sc.sp) - bytes_);
  }
  static StackPool& of(std::size_t bytes) {
    thread_local std::vector<std::unique_ptr<StackPool>> pools;
    for (auto& p : pools) {
      if (p->bytes_ == bytes) return *p;
    }
    pools.push_back(std::make_unique<StackPool>(bytes));
    return *pools.back();
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::size_t bytes_;
  std::vector<std::unique_ptr<char, Free>> blocks_;
  std::vector<char*> free_;
};

// The allocator Boost.Context asks for each fiber's stack.
class PooledStack {
 public:
  explicit PooledStack(StackPool& pool) : pool_(&pool) {}
  boost::context::stack_context allocate() { return pool_->allocate(); }
  void deallocate(boost::context::stack_context& sc) noexcept { pool_->deallocate(sc); }

 private:
  StackPool* pool_;
};

class Fibers {
 public:
  Fibers(int n, std::function<void(int)> body, std::uint64_t seed, std::size_t stack_bytes = 256 * 1024)
      : body_(std::move(body)), rng_(seed), pool_(StackPool::of(stack_bytes)) {
    fibers_.resize(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < fibers_.size(); ++i) {
      fibers_[i].ctx = boost::context::fiber(std::allocator_arg, PooledStack(pool_),
                                             [this, i](boost::context::fiber&& main) { return entry(static_cast<int>(i), std::move(main)); });
    }
  }

  // Groups run one at a time (fiber i in group i / group_size, the groups in a seeded order): a
  // group's fibers run until each is blocked or done before the next group's run at all, so one
  // block of a cluster runs ahead of the others as far as its own barriers let it.
  void run_groups_ahead(int group_size) {
    group_size_ = group_size;
    const int groups = (static_cast<int>(fibers_.size()) + group_size - 1) / group_size;
    group_order_.resize(static_cast<std::size_t>(groups));
    for (int g = 0; g < groups; ++g) group_order_[static_cast<std::size_t>(g)] = g;
    std::shuffle(group_order_.begin(), group_order_.end(), rng_);
  }

  // Runs every fiber to completion; false (with a test failure) on a deadlock.
  bool run() {
    std::vector<int> order(fibers_.size());
    bool ok = true;
    while (true) {
      order.clear();
      for (std::size_t i = 0; i < fibers_.size(); ++i) {
        if (!fibers_[i].done && !fibers_[i].blocked) order.push_back(static_cast<int>(i));
      }
      if (group_size_ > 0 && !order.empty()) {  // only the first group in group_order_ that can run
        int pick = -1;
        for (int g : group_order_) {
          for (int i : order) {
            if (i / group_size_ == g) {
              pick = g;
              break;
            }
          }
          if (pick >= 0) break;
        }
        std::erase_if(order, [&](int i) { return i / group_size_ != pick; });
      }
      if (order.empty()) {
        for (const auto& f : fibers_) {
          if (!f.done) {
            ADD_FAILURE() << "emulated block deadlocked: a barrier or warp collective was not reached by every thread";
            ok = false;
            break;
          }
        }
        break;
      }
      std::shuffle(order.begin(), order.end(), rng_);
      for (int i : order) {
        Fiber& f = fibers_[static_cast<std::size_t>(i)];
        if (f.done || f.blocked) continue;
        current_ = i;
        f.ctx = std::move(f.ctx).resume();  // back when it blocks or ends
      }
    }
    if (!ok) {
      // Unwind the fibers still blocked (Boost.Context forces their stacks to unwind).
      for (auto& f : fibers_) f.ctx = {};
    }
    return ok;
  }

  int current() const { return current_; }
  // Called by the current fiber: sleep until woken.
  void block() {
    Fiber& f = fibers_[static_cast<std::size_t>(current_)];
    f.blocked = true;
    f.main = std::move(f.main).resume();
  }
  void wake(int i) { fibers_[static_cast<std::size_t>(i)].blocked = false; }

 private:
  struct Fiber {
    boost::context::fiber ctx;   // the thread (while the scheduler holds it)
    boost::context::fiber main;  // the scheduler (while the thread runs)
    bool done = false;
    bool blocked = false;
  };
  boost::context::fiber entry(int i, boost::context::fiber&& main) {
    Fiber& f = fibers_[static_cast<std::size_t>(i)];
    f.main = std::move(main);
    try {
      body_(i);
    } catch (const boost::context::detail::forced_unwind&) {
      throw;  // a deadlocked block being torn down
    } catch (const std::exception& e) {  // never unwind across a context switch
      ADD_FAILURE() << "emulated thread " << i << " threw: " << e.what();
    }
    f.done = true;
    return std::move(f.main);
  }
  std::function<void(int)> body_;
  std::mt19937_64 rng_;
  StackPool& pool_;
  std::vector<Fiber> fibers_;
  int current_ = -1;
  int group_size_ = 0;  // run_groups_ahead; 0 = every fiber in every round
  std::vector<int> group_order_;
};

class Barrier {
 public:
  explicit Barrier(int expected) : expected_(expected) {}
  void arrive_and_wait(Fibers& f) {
    if (++arrived_ == expected_) {
      arrived_ = 0;
      for (int w : waiting_) f.wake(w);
      waiting_.clear();
      return;
    }
    waiting_.push_back(f.current());
    f.block();
  }

 private:
  int expected_;
  int arrived_ = 0;
  std::vector<int> waiting_;
};

// ---- guards --------------------------------------------------------------------------------------
inline constexpr std::uint8_t kGuardByte = 0x5c;
inline constexpr std::uint8_t kPoisonByte = 0xa5;

// A buffer of `n` values framed by guard bytes; intact() says whether anything wrote outside it.
template <typename T>
class Guarded {
 public:
  static constexpr std::size_t kGuard = 4096;
  explicit Guarded(std::size_t n = 0, std::uint8_t fill = kPoisonByte) { resize(n, fill); }
  void resize(std::size_t n, std::uint8_t fill = kPoisonByte) {
    n_ = n;
    bytes_.assign(2 * kGuard + n * sizeof(T) + alignof(std::max_align_t), kGuardByte);
    std::fill_n(data_bytes(), n * sizeof(T), fill);
  }
  T* data() { return reinterpret_cast<T*>(data_bytes()); }
  const T* data() const { return reinterpret_cast<const T*>(const_cast<Guarded*>(this)->data_bytes()); }
  std::size_t size() const { return n_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  std::vector<T> values() const { return std::vector<T>(data(), data() + n_); }
  void assign(const std::vector<T>& v) {
    resize(v.size());
    std::copy(v.begin(), v.end(), data());
  }
  // Empty when both guards are intact; else where the first damaged byte lies.
  std::string damage() const {
    const std::uint8_t* d = const_cast<Guarded*>(this)->data_bytes();
    for (std::size_t i = 0; i < kGuard; ++i) {
      if (d[-1 - static_cast<std::ptrdiff_t>(i)] != kGuardByte) return "written " + std::to_string(i + 1) + " bytes before it";
      if (d[n_ * sizeof(T) + i] != kGuardByte) return "written " + std::to_string(i) + " bytes past its end";
    }
    return {};
  }

 private:
  std::uint8_t* data_bytes() {
    auto p = reinterpret_cast<std::uintptr_t>(bytes_.data()) + kGuard;
    p = (p + alignof(std::max_align_t) - 1) / alignof(std::max_align_t) * alignof(std::max_align_t);
    return reinterpret_cast<std::uint8_t*>(p);
  }
  std::size_t n_ = 0;
  std::vector<std::uint8_t> bytes_;
};

// ---- global memory ranges -------------------------------------------------------------------------
// The buffers a launch may read and write; a policy checks every global access against them
// (once per launch a failure names the first access out of range).
class GlobalRanges {
 public:
  void readable(const void* p, std::size_t bytes, std::string name) { read_.push_back({static_cast<const std::uint8_t*>(p), bytes, std::move(name)}); }
  void writable(const void* p, std::size_t bytes, std::string name) {
    readable(p, bytes, name);
    write_.push_back({static_cast<const std::uint8_t*>(p), bytes, std::move(name)});
  }
  void check_read(const void* p, std::size_t bytes, const char* kernel) const { check(read_, p, bytes, kernel, "read"); }
  void check_write(const void* p, std::size_t bytes, const char* kernel) const { check(write_, p, bytes, kernel, "write"); }

 private:
  struct R {
    const std::uint8_t* begin;
    std::size_t bytes;
    std::string name;
  };
  void check(const std::vector<R>& rs, const void* p, std::size_t bytes, const char* kernel, const char* what) const {
    const auto* a = static_cast<const std::uint8_t*>(p);
    for (const R& r : rs) {
      if (a >= r.begin && a + bytes <= r.begin + r.bytes) return;
    }
    if (!reported_) {
      reported_ = true;
      ADD_FAILURE() << kernel << ": a " << bytes << "-byte global " << what << " at " << p
                    << " lies outside every buffer of the launch it may " << what;
    }
  }
  std::vector<R> read_, write_;
  mutable bool reported_ = false;
};

// ---- coverage ------------------------------------------------------------------------------------
class Coverage {
 public:
  static void ran(const std::string& kernel) {
    std::lock_guard<std::mutex> lock(mutex());
    names().insert(kernel);
  }
  static bool has(const std::string& kernel) {
    std::lock_guard<std::mutex> lock(mutex());
    return names().contains(kernel);
  }
  static std::set<std::string> all() {
    std::lock_guard<std::mutex> lock(mutex());
    return names();
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::set<std::string>& names() {
    static std::set<std::string> s;
    return s;
  }
};

// ---- one thread block: barriers, block scan, shared atomics --------------------------------------
struct CtaState {
  CtaState(int n_threads, std::size_t smem_bytes, Fibers& f)
      : fibers(f), threads(n_threads), all(n_threads), smem(smem_bytes, kPoisonByte),
        scan_pending(static_cast<std::size_t>(n_threads), 0) {
    for (int w = 0; w * 32 < n_threads; ++w) warp.push_back(std::make_unique<Barrier>(std::min(32, n_threads - 32 * w)));
    exchange.resize(warp.size());
  }
  Fibers& fibers;
  int threads;
  Barrier all;
  std::vector<std::unique_ptr<Barrier>> warp;  // __syncwarp of each warp
  // Warp collectives: each lane's value, and barriers of the lane subsets that take part.
  struct WarpExchange {
    std::array<std::uint32_t, 32> value{};
    std::map<unsigned, std::unique_ptr<Barrier>> subset;
  };
  std::vector<WarpExchange> exchange;
  Guarded<std::uint8_t> smem;
  std::vector<std::int64_t> scan;  // the items of a block scan, then their exclusive sums
  std::int64_t scan_total = 0;
  std::vector<std::uint8_t> scan_pending;  // per thread: a scan since its last __syncthreads
  bool scan_reuse_reported = false;
};

// A thread-block cluster (sm_90): its blocks run together on one set of fibers; a cluster barrier
// over all their threads; each block's shared memory reachable from the others (distributed
// shared memory).
struct ClusterState {
  explicit ClusterState(int threads) : all(threads) {}
  Barrier all;
  std::vector<CtaState*> ctas;  // by rank
};

// The policy of a CTA program on the emulator (one object per thread).
class Cta {
 public:
  Cta(CtaState& s, int tid, unsigned block, unsigned blocks, ClusterState* cluster = nullptr, int rank = 0)
      : s_(s), tid_(tid), block_(block), blocks_(blocks), cluster_(cluster), rank_(rank) {}
  int tid() const { return tid_; }
  int threads() const { return s_.threads; }
  unsigned block() const { return block_; }
  unsigned blocks() const { return blocks_; }
  void sync() const {
    s_.scan_pending[static_cast<std::size_t>(tid_)] = 0;
    s_.all.arrive_and_wait(s_.fibers);
  }
  // The cluster (cooperative_groups::this_cluster()): block_rank(), num_blocks(), sync() (every
  // thread of every block of the cluster; a __syncthreads as well), map_shared_rank(p, rank).
  // A launch without clusters is a cluster of one block.
  int rank() const { return rank_; }
  int ranks() const { return cluster_ == nullptr ? 1 : static_cast<int>(cluster_->ctas.size()); }
  void cluster_sync() const {
    if (cluster_ == nullptr) return sync();
    s_.scan_pending[static_cast<std::size_t>(tid_)] = 0;
    cluster_->all.arrive_and_wait(s_.fibers);
  }
  template <typename T>
  T* remote(T* p, int rank) const {
    const auto* at = reinterpret_cast<const std::uint8_t*>(p);
    const std::uint8_t* base = s_.smem.data();
    if (at < base || at + sizeof(T) > base + s_.smem.size()) {
      ADD_FAILURE() << "map_shared_rank of an address outside the block's shared memory";
      return p;
    }
    if (rank < 0 || rank >= ranks()) {
      ADD_FAILURE() << "map_shared_rank to rank " << rank << " of a cluster of " << ranks();
      return p;
    }
    if (cluster_ == nullptr) return p;
    return reinterpret_cast<T*>(cluster_->ctas[static_cast<std::size_t>(rank)]->smem.data() + (at - base));
  }
  void sync_warp() const { s_.warp[static_cast<std::size_t>(tid_ / 32)]->arrive_and_wait(s_.fibers); }
  // __ballot_sync(full mask, v): every lane of the warp takes part.
  unsigned ballot(bool v) const {
    auto& x = s_.exchange[static_cast<std::size_t>(tid_ / 32)];
    x.value[static_cast<std::size_t>(tid_ & 31)] = v ? 1u : 0u;
    sync_warp();
    unsigned m = 0;
    for (std::size_t l = 0; l < 32; ++l) m |= (x.value[l] & 1u) << l;
    sync_warp();  // every lane has read before a lane's next collective overwrites its value
    return m;
  }
  // __match_any_sync(mask, v): the lanes of `mask` (this one among them) take part; the result
  // is those of them holding v.
  unsigned match_any(unsigned mask, std::uint32_t v) const {
    const auto lane = static_cast<unsigned>(tid_ & 31);
    EXPECT_NE(mask & (1u << lane), 0u) << "thread " << tid_ << ": __match_any_sync with a mask without its own lane";
    auto& x = s_.exchange[static_cast<std::size_t>(tid_ / 32)];
    auto& bar = x.subset[mask];
    if (!bar) bar = std::make_unique<Barrier>(__builtin_popcount(mask));
    x.value[lane] = v;
    bar->arrive_and_wait(s_.fibers);
    unsigned m = 0;
    for (unsigned l = 0; l < 32; ++l) {
      if ((mask & (1u << l)) != 0u && x.value[l] == v) m |= 1u << l;
    }
    bar->arrive_and_wait(s_.fibers);
    return m;
  }
  // cub::BlockScan<T>::ExclusiveSum(value, rank, total): deposit, barrier, thread 0 sums,
  // barrier, read. Its storage is reused only after a __syncthreads, as cub requires.
  template <typename T>
  void exclusive_sum(T value, T& rank, T& total) const {
    T in[1] = {value}, out[1] = {};
    exclusive_sum(in, out, total);
    rank = out[0];
  }
  // The blocked-arrangement form: thread t holds items [t x N, t x N + N) of the sequence.
  template <typename T, int N>
  void exclusive_sum(const T (&in)[N], T (&out)[N], T& total) const {
    auto& pending = s_.scan_pending[static_cast<std::size_t>(tid_)];
    if (pending != 0 && !s_.scan_reuse_reported) {  // once per block
      s_.scan_reuse_reported = true;
      ADD_FAILURE() << "thread " << tid_ << ": a block scan reused its storage without a __syncthreads after the last one";
    }
    pending = 1;
    const auto n = static_cast<std::size_t>(N);
    s_.scan.resize(static_cast<std::size_t>(s_.threads) * n);
    for (std::size_t u = 0; u < n; ++u) s_.scan[static_cast<std::size_t>(tid_) * n + u] = static_cast<std::int64_t>(in[u]);
    s_.all.arrive_and_wait(s_.fibers);
    if (tid_ == 0) {
      std::int64_t run = 0;
      for (auto& v : s_.scan) {
        const std::int64_t x = v;
        v = run;
        run += x;
      }
      s_.scan_total = run;
    }
    s_.all.arrive_and_wait(s_.fibers);
    for (std::size_t u = 0; u < n; ++u) out[u] = static_cast<T>(s_.scan[static_cast<std::size_t>(tid_) * n + u]);
    total = static_cast<T>(s_.scan_total);
  }
  std::int32_t atomic_cas(std::int32_t* p, std::int32_t compare, std::int32_t value) const {
    const std::int32_t old = *p;
    if (old == compare) *p = value;
    return old;
  }
  void atomic_min(std::int32_t* p, std::int32_t value) const { *p = std::min(*p, value); }

 private:
  CtaState& s_;
  int tid_;
  unsigned block_, blocks_;
  ClusterState* cluster_;
  int rank_;
};

// Runs `program(cta, smem)` as `blocks` blocks of `threads` threads in clusters of `cluster`
// consecutive blocks (cudaLaunchAttributeClusterDimension): the blocks of a cluster run together,
// one cluster after another, each in one of two seeded schedules when it has more than one block:
// every thread of the cluster interleaved, or its blocks one after another as far as each can go
// before a cluster barrier (so a block that reads what another has not written yet, for want of a
// cluster barrier, reads it unwritten). Fails the test on a deadlock or a write outside a block's shared memory.
template <typename Program>
void launch_clusters(const std::string& kernel, unsigned blocks, int cluster, int threads, std::size_t smem_bytes,
                     std::uint64_t seed, Program&& program) {
  Coverage::ran(kernel);
  if (cluster < 1 || blocks % static_cast<unsigned>(cluster) != 0) {
    ADD_FAILURE() << kernel << ": " << blocks << " blocks are not whole clusters of " << cluster;
    return;
  }
  const auto n = static_cast<unsigned>(cluster);
  for (unsigned first = 0; first < blocks; first += n) {
    std::vector<std::unique_ptr<CtaState>> states;
    ClusterState cs(cluster * threads);
    Fibers fibers(
        cluster * threads,
        [&](int f) {
          const int rank = f / threads;
          Cta cta(*states[static_cast<std::size_t>(rank)], f % threads, first + static_cast<unsigned>(rank), blocks, &cs, rank);
          program(cta, states[static_cast<std::size_t>(rank)]->smem.data());
        },
        seed * 0x9E3779B97F4A7C15ull + first, 64 * 1024);
    for (int r = 0; r < cluster; ++r) {
      states.push_back(std::make_unique<CtaState>(threads, smem_bytes, fibers));
      cs.ctas.push_back(states.back().get());
    }
    if (cluster > 1 && ((seed + first) * 0x9E3779B97F4A7C15ull) >> 63) fibers.run_groups_ahead(threads);
    fibers.run();
    for (int r = 0; r < cluster; ++r) {
      const std::string damage = states[static_cast<std::size_t>(r)]->smem.damage();
      EXPECT_TRUE(damage.empty()) << kernel << " block " << first + static_cast<unsigned>(r) << ": shared memory " << damage;
    }
  }
}

// Runs `program(cta, smem)` as `blocks` blocks of `threads` threads, one block after another
// (clusters of one), each with its own seeded order; records `kernel` as run. Fails the test on a
// deadlock or a write outside the block's shared memory.
template <typename Program>
void launch(const std::string& kernel, unsigned blocks, int threads, std::size_t smem_bytes, std::uint64_t seed,
            Program&& program) {
  launch_clusters(kernel, blocks, 1, threads, smem_bytes, seed, std::forward<Program>(program));
}

}  // namespace ess::emu
