// The item-claiming thread pool: the shared instance, claiming items, helper threads (see pool.h).
#include "pool.h"

#include <c10/util/Exception.h>
#include <sched.h>

#include <cstdio>

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

namespace {

// 0: auto, 1: omp, 2: pool, by name (anything else: -1)
int scheduling_code(const char* s) {
  if (std::strcmp(s, "auto") == 0) return 0;
  if (std::strcmp(s, "omp") == 0) return 1;
  if (std::strcmp(s, "pool") == 0) return 2;
  return -1;
}

// the forced scheduling: TINYSERVE_NATIVE_SCHED, read once when the module loads (an unknown value: auto), then
// what set_scheduling sets
std::atomic<int> forced{[] {
  const char* s = std::getenv("TINYSERVE_NATIVE_SCHED");
  return s == nullptr ? 0 : std::max(0, scheduling_code(s));
}()};

int forced_scheduling() { return forced.load(std::memory_order_relaxed); }

// the cores this process may run on
int usable_cores() {
  static const int n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

// tasks runnable right now, system-wide (the "running/total" field of /proc/loadavg); -1 when unreadable
int runnable_tasks() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double a, b, c;
  int running = -1, total = 0;
  if (std::fscanf(f, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) running = -1;
  std::fclose(f);
  return running;
}

std::atomic<int64_t> next_sample_ns{0};
std::atomic<int> busy_score{0};  // 0..4: +1 per oversubscribed sample, -1 per other; the pool from 2 up

}  // namespace

Sched scheduling() {
  const int forced = forced_scheduling();
  if (forced != 0) return forced == 1 ? Sched::kOmp : Sched::kPool;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t due = next_sample_ns.load(std::memory_order_relaxed);
  if (now >= due && next_sample_ns.compare_exchange_strong(due, now + 50000000, std::memory_order_relaxed)) {
    const int r = runnable_tasks();
    // the caller itself is one of the runnable tasks; OpenMP's workers count while they spin
    const bool over = r > usable_cores();
    const int s = busy_score.load(std::memory_order_relaxed);
    busy_score.store(over ? std::min(s + 1, 4) : std::max(s - 1, 0), std::memory_order_relaxed);
  }
  return busy_score.load(std::memory_order_relaxed) >= 2 ? Sched::kPool : Sched::kOmp;
}

std::string set_scheduling(const std::string& name) {
  const int code = scheduling_code(name.c_str());
  TORCH_CHECK_VALUE(code >= 0, "set_scheduling: argument 'name' must be auto, omp or pool, got ", name);
  static const char* const names[] = {"auto", "omp", "pool"};
  return names[forced.exchange(code, std::memory_order_relaxed)];
}

const char* scheduling_name() {
  const int forced = forced_scheduling();
  if (forced != 0) return forced == 1 ? "omp" : "pool";
  return scheduling() == Sched::kPool ? "auto (pool: the machine is oversubscribed)"
                                      : "auto (omp: a free core per thread)";
}

}  // namespace tinyserve_native
