// Work lists and the item-claiming thread pool (run_items).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <unistd.h>

namespace tinyserve_native {

// ------------------------------------------------------------------------------------------------------------
// work lists
// ------------------------------------------------------------------------------------------------------------

inline int64_t chunk_size(int64_t total, int64_t min_chunk, int64_t align) {
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  int64_t ch = std::max<int64_t>(min_chunk, (total + 4 * nt - 1) / (4 * nt));
  return (ch + align - 1) / align * align;
}

// ------------------------------------------------------------------------------------------------------------
// parallel regions that never wait for a thread that has not started
//
// Pool::run(n, nt, f) calls f(i) for i in [0, n): the calling thread and up to nt - 1 helper threads claim items one
// at a time from a shared ticket, (generation << 32) | next item, and the caller returns once every item is done.
// A helper that is descheduled (another process holds its core) costs only the items it has already claimed: unlike
// at::parallel_for under OpenMP, whose region ends in a barrier that waits for every team member, a helper that
// wakes late finds the ticket moved on and does nothing. Items are claimed one by one, so a slow thread takes fewer.
// Helpers start at the first parallel call (never at load), spin for 20 us when idle, then sleep on a condition
// variable (a sleeping helper neither holds a core that Inductor's OpenMP threads need between the kernel's calls,
// nor loses its turn to a process that spins on its core); a forked child starts its own. One caller at a time: a second concurrent caller runs its items itself.
// TINYSERVE_NATIVE_SCHED=omp (read at load; set_scheduling below) runs the same claiming inside at::parallel_for
// instead.
// ------------------------------------------------------------------------------------------------------------

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

class Pool {
 public:
  using Fn = void (*)(const void*, int64_t);

  static Pool& current();

  template <typename F>
  void run(int64_t n, int64_t nt, const F& f) {
    if (n <= 0) return;
    nt = std::max<int64_t>(1, std::min(nt, n));
    std::unique_lock<std::mutex> mine(caller_, std::try_to_lock);
    if (nt == 1 || !mine.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    while (started_ < nt - 1) std::thread(&Pool::helper, this, started_++).detach();
    const uint64_t g = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    Job& j = jobs_[g & 1];  // job g - 1 is done and job g - 2's slot is free: a stale helper reads the other slot
    j.fn.store([](const void* x, int64_t i) { (*static_cast<const F*>(x))(i); }, std::memory_order_relaxed);
    err_ = nullptr;
    j.ctx.store(&f, std::memory_order_relaxed);
    j.n.store(n, std::memory_order_relaxed);
    j.helpers.store(nt - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(g << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(mu_); }
      cv_.notify_all();
    }
    work(g);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n;) {  // items claimed by helpers still running
      cpu_relax();
      if (++spins > 2000) {
        std::this_thread::yield();
        spins = 0;
      }
    }
    if (err_) std::rethrow_exception(err_);  // the first item that threw, as at::parallel_for does
  }

 private:
  struct Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> ctx{nullptr};
    std::atomic<int64_t> n{0}, helpers{0};
  };

  // claim and run items of generation g until none is left or a newer job is published
  void work(uint64_t g);

  void helper(int64_t id);

  const pid_t pid_ = getpid();
  std::mutex caller_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  int64_t started_ = 0;     // helpers started (under caller_)
  std::exception_ptr err_;  // the first exception of the current job (under mu_)
  Job jobs_[2];
};

// Which threads run the items of one call.
//   omp:  at::parallel_for, the OpenMP team the rest of the graph (inductor, MKL) already keeps spinning; the
//         fastest on a machine with a free core per thread, but its closing barrier waits for a descheduled thread.
//   pool: the item-claiming Pool above; the caller waits only for items a helper has claimed, so a thread that
//         another process descheduled delays one item, not the call. On an idle machine its helpers compete with
//         OpenMP's spinning workers for the cores (about 0.4 ms per call at 8K on 2 cores).
// TINYSERVE_NATIVE_SCHED=omp or =pool, read once when the module loads, forces one (set_scheduling changes it in a
// running process); by default (auto) the pool runs while the machine is
// oversubscribed (more runnable tasks than this process may use cores, sampled from /proc/loadavg every 50 ms,
// with hysteresis) and OpenMP otherwise.
enum class Sched { kOmp, kPool };
Sched scheduling();
// "omp", "pool" or "auto", and what auto chose last
const char* scheduling_name();
// force "omp" or "pool", or let "auto" choose, from now on in this process; returns the previous setting's name
std::string set_scheduling(const std::string& name);

// f(i) for i in [0, n), items claimed one at a time by at most at::get_num_threads() threads
template <typename F>
inline void run_items(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  if (scheduling() == Sched::kPool) return Pool::current().run(n, nt, f);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  });
}

}  // namespace tinyserve_native
