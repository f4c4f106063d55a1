// Stage timing for development builds (-DTS_PROFILE).
// Part of the native CPU kernels of tinyserve-compile (overview: sparse_decode.cpp).
#pragma once

#include "simd.h"

namespace tinyserve_native {

// stage timing for development builds (-DTS_PROFILE): averages printed to stderr every 500 calls
#ifdef TS_PROFILE
// thread CPU time (meaningful with one thread; robust to preemption on a busy machine)
struct Prof {
  double acc[16] = {0}, lo[16] = {0};
  const char* names[16] = {nullptr};
  int64_t calls = 0;
  double t = 0;
  static double now() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
  }
  void start() { t = now(); }
  std::atomic<int64_t> task_ns[16] = {};
  const char* task_names[16] = {nullptr};
  void add(int kind, const char* name, double us) {
    task_ns[8 + kind].fetch_add(static_cast<int64_t>(us * 1000), std::memory_order_relaxed);
    task_names[8 + kind] = name;
  }
  void mark(int i, const char* name) {
    const double n = now(), d = n - t;
    acc[i] += d;
    lo[i] = (names[i] == nullptr || d < lo[i]) ? d : lo[i];
    names[i] = name;
    t = n;
  }
  void done() {
    if (++calls % 500) return;
    for (int i = 0; i < 16; ++i)
      if (names[i]) std::fprintf(stderr, "%s %.1f/%.1fus  ", names[i], acc[i] / calls, lo[i]);
    std::fprintf(stderr, "| tasks (thread cpu, summed over threads):");
    for (int i = 0; i < 16; ++i)
      if (task_names[i]) std::fprintf(stderr, " %s %.1fus", task_names[i], task_ns[i].load() * 1e-3 / calls);
    std::fprintf(stderr, "\n");
  }
};
inline Prof& prof() {
  static Prof p;
  return p;
}
#define TS_START() prof().start()
#define TS_MARK(i, name) prof().mark(i, name)
#define TS_DONE() prof().done()
#else
#define TS_START()
#define TS_MARK(i, name)
#define TS_DONE()
#endif

}  // namespace tinyserve_native
