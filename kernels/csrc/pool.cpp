// The item-claiming thread pool: the shared instance, claiming items, helper threads (see pool.h).
#include "pool.h"

namespace tinyserve_native {

Pool& Pool::current() {
  static std::atomic<Pool*> cur{nullptr};
  Pool* p = cur.load(std::memory_order_acquire);
  if (p == nullptr || p->pid_ != getpid()) {  // first use, or a forked child: the parent's helpers are not here
    Pool* q = new Pool();                       // never freed: detached helpers may outlive static destructors
    if (cur.compare_exchange_strong(p, q)) p = q;
    else delete q;
  }
  return *p;
}

void Pool::work(uint64_t g) {
  const Job& j = jobs_[g & 1];
  for (;;) {
    uint64_t s = ticket_.load(std::memory_order_acquire);
    if ((s >> 32) != (g & 0xffffffffu)) return;
    const int64_t i = static_cast<int64_t>(s & 0xffffffffu);
    const Fn fn = j.fn.load(std::memory_order_relaxed);
    const void* ctx = j.ctx.load(std::memory_order_relaxed);
    if (i >= j.n.load(std::memory_order_relaxed)) return;
    if (!ticket_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
    try {
      fn(ctx, i);  // the CAS succeeded on generation g with items left: the caller is still waiting for them
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!err_) err_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void Pool::helper(int64_t id) {
  uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
  for (;;) {
    uint64_t g = ticket_.load(std::memory_order_acquire) >> 32;
    const auto t0 = std::chrono::steady_clock::now();
    for (int spins = 0; g == seen; g = ticket_.load(std::memory_order_acquire) >> 32) {
      cpu_relax();
      if ((++spins & 255) == 0 && std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(20)) {
        std::unique_lock<std::mutex> lk(mu_);  // idle: sleep until the next job is published
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while ((g = ticket_.load(std::memory_order_seq_cst) >> 32) == seen) cv_.wait(lk);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        break;
      }
    }
    seen = g;
    if (id < jobs_[g & 1].helpers.load(std::memory_order_relaxed)) work(g);
  }
}

}  // namespace tinyserve_native
