// Native CPU kernels of tinyserve-compile: query-aware paged sparse decode and page-bound maintenance.
//
// Functions (a Python extension module; kernels/sparse_decode.py and kernels/bounds.py register them as the CPU
// kernels of the ops tinyserve::sparse_decode and tinyserve::cache_write, and kernels/native.py loads them):
//   sparse_decode   one call per sparse layer and decode step: bound scan, partial top-K selection with the
//                   forced pages, optional two-stage candidate ranking (whole pages, or single tokens with
//                   keep_tokens), exact attention with an online softmax
//   kept_pages      the same selection as sparse_decode, returned as a bool [B, Hkv, P] map (tests, debugging);
//                   with keep_tokens a page is marked when any of its tokens is kept
//   cache_write     index_copy_ of new keys into the cache, then the bounds of the touched pages (or all pages
//                   when ctrl[0] != 0)
//   rebuild_bounds  every page's bounds from the key cache
//
// The semantics are those of kernels/reference/ (sparse_decode_reference, page_bounds, store_bounds); see there
// for the algorithm. Page bounds are stored as float32, bfloat16 (rounded outward) or int8 codes on a per-page grid
// of step max(kabs / 126, FLT_MIN) (kabs: the page's exact max |k|), decoded as code * step in fp32.
// Work is split over (batch, KV head, chunk of pages or kept tokens); the chunks are claimed one at a time from a
// shared counter by the calling thread and helper threads (see Pool), and the chunks of one (batch, KV head) are
// merged with a log-sum-exp combine.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <exception>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#include <unistd.h>

namespace tinyserve_native {
namespace {

using at::vec::Vectorized;
using Vec = Vectorized<float>;
constexpr int VS = Vec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();
// prefetch distance, in blocks of VS tokens
constexpr int PF_BLOCKS = 6;

// ------------------------------------------------------------------------------------------------------------
// small vector helpers
// ------------------------------------------------------------------------------------------------------------

template <typename T>
inline Vec loadf(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// r[i] = sum of the 8 lanes of a[i]
inline __m256 reduce8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1);
  __m256 u1 = _mm256_hadd_ps(t2, t3);
  __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
  __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  return _mm256_add_ps(lo, hi);
}
#endif

// lane i of the result = sum of the lanes of a[i], for VS vectors
inline Vec reduce_rows(const Vec* a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256 y[16];
  for (int i = 0; i < 16; ++i) {
    __m512 z = a[i];
    __m256 lo = _mm512_castps512_ps256(z);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
    y[i] = _mm256_add_ps(lo, hi);
  }
  __m256 r0 = reduce8(y);
  __m256 r1 = reduce8(y + 8);
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(r0)), _mm256_castps_pd(r1), 1));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 y[8];
  for (int i = 0; i < 8; ++i) y[i] = a[i];
  return reduce8(y);
#else
  alignas(64) float out[VS];
  alignas(64) float tmp[VS];
  for (int i = 0; i < VS; ++i) {
    a[i].store(tmp);
    float s = 0.f;
    for (int j = 0; j < VS; ++j) s += tmp[j];
    out[i] = s;
  }
  return Vec::loadu(out);
#endif
}

inline float hmax(const float* x, int64_t n) {
  int64_t i = 0;
  float m = NEG_INF;
  if (n >= VS) {
    Vec mv(NEG_INF);
    for (; i + VS <= n; i += VS) mv = at::vec::maximum(mv, Vec::loadu(x + i));
    alignas(64) float t[VS];
    mv.store(t);
    for (int j = 0; j < VS; ++j) m = std::max(m, t[j]);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x <- exp(x - m) in place, returns the sum (m finite)
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  Vec mv(m), acc(0.f);
  for (; i + VS <= n; i += VS) {
    Vec e = (Vec::loadu(x + i) - mv).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float s = 0.f;
  if (i < n) {
    Vec e = (Vec::loadu(x + i, static_cast<int>(n - i)) - mv).exp_u20();
    e.store(x + i, static_cast<int>(n - i));
    alignas(64) float t[VS];
    e.store(t);
    for (int64_t j = 0; j < n - i; ++j) s += t[j];
  }
  alignas(64) float t[VS];
  acc.store(t);
  for (int j = 0; j < VS; ++j) s += t[j];
  return s;
}

// dst <- exp(src - m), returns the sum (m finite)
inline float exp_sub_to(const float* src, float* dst, int64_t n, float m) {
  int64_t i = 0;
  Vec mv(m), acc(0.f);
  for (; i + VS <= n; i += VS) {
    Vec e = (Vec::loadu(src + i) - mv).exp_u20();
    e.store(dst + i);
    acc = acc + e;
  }
  alignas(64) float t[VS];
  float s = 0.f;
  if (i < n) {
    const int r = static_cast<int>(n - i);
    Vec e = (Vec::loadu(src + i, r) - mv).exp_u20();
    e.store(dst + i, r);
    e.store(t);
    for (int j = 0; j < r; ++j) s += t[j];
  }
  acc.store(t);
  for (int j = 0; j < VS; ++j) s += t[j];
  return s;
}

inline float hsum(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
  if (n >= VS) {
    Vec a(0.f);
    for (; i + VS <= n; i += VS) a = a + Vec::loadu(x + i);
    alignas(64) float t[VS];
    a.store(t);
    for (int j = 0; j < VS; ++j) s += t[j];
  }
  for (; i < n; ++i) s += x[i];
  return s;
}

// grow-only buffer (no page faults per call once warm)
template <typename V>
inline typename V::value_type* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

inline void prefetch_row(const void* p, int64_t bytes, int locality) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (locality >= 3)
      __builtin_prefetch(c + off, 0, 3);
    else
      __builtin_prefetch(c + off, 0, 1);
  }
}

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

// grow-only scratch, one per thread and purpose (no page faults per call)
template <int Tag>
inline float* scratch_f(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// dispatch over the three cache dtypes (float32, bfloat16, float16)
template <typename F>
inline void dispatch_kv(at::ScalarType t, const char* name, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, bfloat16 or float16, got ", t);
  }
}

// dispatch over the three bounds dtypes (float32, bfloat16 rounded outward, int8 codes)
template <typename F>
inline void dispatch_bt(at::ScalarType t, const char* name, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kChar: f(int8_t{}); break;
    default: TORCH_CHECK(false, name, ": kmax/kmin must be float32, bfloat16 or int8, got ", t);
  }
}

// grid step of int8 bounds (reference.int8_bounds_step): one fp32 division, then the floor at the smallest normal
// number (NaN propagates, as torch.clamp_min)
inline float int8_step(float kabs) { return std::max(kabs / 126.f, std::numeric_limits<float>::min()); }

// ------------------------------------------------------------------------------------------------------------
// mask view: attn_mask expanded to [B, Hq, 1, L] and read through its strides
// ------------------------------------------------------------------------------------------------------------

struct MaskView {
  const void* ptr = nullptr;
  int kind = 0;  // 0 none, 1 bool, 2 float32, 3 bfloat16, 4 float16
  int64_t sb = 0, sh = 0, st = 0;
  bool per_head = false;

  inline float at(int64_t b, int64_t hq, int64_t t) const {
    const int64_t off = b * sb + hq * sh + t * st;
    switch (kind) {
      case 1:
        return static_cast<const bool*>(ptr)[off] ? 0.f : NEG_INF;
      case 2:
        return static_cast<const float*>(ptr)[off];
      case 3:
        return static_cast<float>(static_cast<const c10::BFloat16*>(ptr)[off]);
      case 4:
        return static_cast<float>(static_cast<const c10::Half*>(ptr)[off]);
      default:
        return 0.f;
    }
  }
  // max of the additive mask over tokens [t0, t1)
  inline float range_max(int64_t b, int64_t hq, int64_t t0, int64_t t1) const {
    float m = NEG_INF;
    if (kind == 1) {
      const bool* p = static_cast<const bool*>(ptr) + b * sb + hq * sh;
      for (int64_t t = t0; t < t1; ++t)
        if (p[t * st]) return 0.f;
      return NEG_INF;
    }
    for (int64_t t = t0; t < t1; ++t) m = std::max(m, at(b, hq, t));
    return m;
  }
};

MaskView make_mask(const c10::optional<at::Tensor>& attn_mask, int64_t B, int64_t Hq, int64_t L) {
  MaskView mv;
  if (!attn_mask.has_value() || !attn_mask->defined()) return mv;
  const at::Tensor& m0 = *attn_mask;
  TORCH_CHECK(m0.device().is_cpu(), "tinyserve (native): attn_mask must be a CPU tensor");
  at::Tensor m = m0;
  while (m.dim() < 4) m = m.unsqueeze(0);
  TORCH_CHECK(m.dim() == 4, "tinyserve (native): attn_mask must broadcast to [B, Hq, 1, L]");
  const bool head_dim = m.size(1) != 1;
  m = m.expand({B, Hq, 1, L});
  mv.ptr = m.data_ptr();
  switch (m.scalar_type()) {
    case at::kBool: mv.kind = 1; break;
    case at::kFloat: mv.kind = 2; break;
    case at::kBFloat16: mv.kind = 3; break;
    case at::kHalf: mv.kind = 4; break;
    default: TORCH_CHECK(false, "tinyserve (native): attn_mask must be bool or floating, got ", m.scalar_type());
  }
  mv.sb = m.stride(0);
  mv.sh = m.stride(1);
  mv.st = m.stride(3);
  mv.per_head = head_dim && Hq > 1;
  return mv;
}

// ------------------------------------------------------------------------------------------------------------
// per-call context
// ------------------------------------------------------------------------------------------------------------

enum RowMode : int { EMPTY = 0, DENSE = 1, ONE_STAGE = 2, TWO_ALL = 3, TWO_TOPK = 4 };

struct Row {
  int64_t ntok;    // valid tokens, min(valid_len, L)
  int64_t nvalid;  // valid pages, min(ceil(valid_len / S), P)
  int64_t newest;  // page of the newest token, or -1 when that page is past the cache
  int mode;
};

template <typename T, typename BT>
struct Ctx {
  int64_t B, Hq, Hkv, G, L, D, Dp, nv, S, P, K, cf, sinks;
  int64_t n1;        // candidate pages of the first stage, cf * K + candidate_extra / S (two-stage iff n1 > K)
  bool keep_tokens;  // two-stage: keep the K * S candidate tokens of highest share instead of K pages
  float scale, factor, base;
  const T* k;
  int64_t ksb, ksh, ksl;
  const T* v;
  int64_t vsb, vsh, vsl;
  const BT* kmax;
  const BT* kmin;
  const float* kabs;
  MaskView mask;
  const float* qs;    // [B*Hkv, G, Dp] q * scale
  const float* qp;    // [B*Hkv, G, Dp] max(q, 0)
  const float* qn;    // [B*Hkv, G, Dp] min(q, 0)
  const float* qabs;  // [B*Hkv, G] |q|_1
  std::vector<Row> rows;

  // first row of (batch, KV head) bh; token t is at + t * ksl (resp. vsl)
  inline const T* kbase(int64_t bh) const { return k + (bh / Hkv) * ksb + (bh % Hkv) * ksh; }
  inline const T* vbase(int64_t bh) const { return v + (bh / Hkv) * vsb + (bh % Hkv) * vsh; }
  inline bool direct() const { return std::is_same_v<T, float> && Dp == D; }
};

// n rows of T -> fp32 rows of Dp floats (zero padded) at dst
template <typename T>
inline void rows_to_f32(const T* const* src, int n, int64_t D, int64_t Dp, float* dst) {
  for (int r = 0; r < n; ++r) {
    const T* s = src[r];
    float* d = dst + r * Dp;
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(d, s, D * sizeof(float));
      i = D;
    } else {
      for (; i + VS <= D; i += VS) loadf(s + i).store(d + i);
      for (; i < D; ++i) d[i] = static_cast<float>(s[i]);
    }
    for (; i < Dp; ++i) d[i] = 0.f;
  }
}

// n rows of int8 bound codes -> fp32 rows of Dp floats (zero padded) at dst: code * step of the row's page
inline void int8_rows_to_f32(const int8_t* src, const float* kab, int n, int64_t D, int64_t Dp, float* dst) {
  for (int r = 0; r < n; ++r) {
    const int8_t* s = src + r * D;
    float* d = dst + r * Dp;
    const float step = int8_step(kab[r]);
    for (int64_t i = 0; i < D; ++i) d[i] = static_cast<float>(s[i]) * step;  // vectorised by the compiler
    for (int64_t i = D; i < Dp; ++i) d[i] = 0.f;
  }
}

// Micro-kernels on a block of VS fp32 rows stored contiguously (row stride nv * VS floats). NV > 0 fixes nv at
// compile time, so that every row is addressed with an immediate offset from one base register; NV == 0 is the
// generic version. One is picked per call (Kern::pick).

// out[g * ld + j] = q_g . row_j for j < n (the block has VS readable rows)
template <int NV>
void dot_block(const float* rows, int n, const float* q, int64_t G, int64_t nv_rt, float* out, int64_t ld) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
  for (int64_t g = 0; g < G; ++g) {
    Vec acc[VS];
    for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
    const float* qg = q + g * st;
    for (int64_t i = 0; i < nv; ++i) {
      const Vec qv = Vec::loadu(qg + i * VS);
      for (int j = 0; j < VS; ++j) acc[j] = at::vec::fmadd(qv, Vec::loadu(rows + j * st + i * VS), acc[j]);
    }
    reduce_rows(acc).store(out + g * ld, n);
  }
}

// r_j = relu(qp).M_j + min(q,0).m_j for the VS pages of a block (sum_d max(q_d M_jd, q_d m_jd))
template <int NV>
Vec bound_block(const float* M, const float* m, const float* qp, const float* qn, int64_t nv_rt) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
  Vec acc[VS];
  for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
  for (int64_t i = 0; i < nv; ++i) {
    const Vec a = Vec::loadu(qp + i * VS);
    const Vec z = Vec::loadu(qn + i * VS);
    for (int j = 0; j < VS; ++j) {
      acc[j] = at::vec::fmadd(a, Vec::loadu(M + j * st + i * VS), acc[j]);
      acc[j] = at::vec::fmadd(z, Vec::loadu(m + j * st + i * VS), acc[j]);
    }
  }
  return reduce_rows(acc);
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define TS_BF16_PAIRS 1
// bfloat16 pairs: one 32-bit lane holds channels 2i (low half) and 2i+1 (high half), so a shift and a mask give
// both as fp32 without shuffles; the query is stored in the same even/odd order (see permute_pairs)
#if defined(CPU_CAPABILITY_AVX512)
inline void bf16_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
inline void bf16_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

// bound_block for bfloat16 bounds read in place: rows of D = NC * 2 * VS channels, q in even/odd order
template <int NC>
Vec bound_block_bf16(const c10::BFloat16* M, const c10::BFloat16* m, const float* qp, const float* qn,
                     int64_t nc_rt) {
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  Vec acc[VS];
  for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
  for (int64_t c = 0; c < nc; ++c) {
    const Vec ae = Vec::loadu(qp + 2 * c * VS), ao = Vec::loadu(qp + (2 * c + 1) * VS);
    const Vec ze = Vec::loadu(qn + 2 * c * VS), zo = Vec::loadu(qn + (2 * c + 1) * VS);
    for (int j = 0; j < VS; ++j) {
      Vec e, o;
      bf16_pairs(M + j * D + c * 2 * VS, e, o);
      acc[j] = at::vec::fmadd(ae, e, acc[j]);
      acc[j] = at::vec::fmadd(ao, o, acc[j]);
      bf16_pairs(m + j * D + c * 2 * VS, e, o);
      acc[j] = at::vec::fmadd(ze, e, acc[j]);
      acc[j] = at::vec::fmadd(zo, o, acc[j]);
    }
  }
  return reduce_rows(acc);
}
// dot_block for bfloat16 rows read in place (VS rows of D = NC * 2 * VS channels, contiguous), q in pair order
template <int NC>
void dot_block_bf16(const c10::BFloat16* rows, int n, const float* q, int64_t G, int64_t nc_rt, float* out,
                    int64_t ld) {
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  for (int64_t g = 0; g < G; ++g) {
    Vec acc[VS];
    for (int j = 0; j < VS; ++j) acc[j] = Vec(0.f);
    const float* qg = q + g * D;
    for (int64_t c = 0; c < nc; ++c) {
      const Vec qe = Vec::loadu(qg + 2 * c * VS), qo = Vec::loadu(qg + (2 * c + 1) * VS);
      for (int j = 0; j < VS; ++j) {
        Vec e, o;
        bf16_pairs(rows + j * D + c * 2 * VS, e, o);
        acc[j] = at::vec::fmadd(qe, e, acc[j]);
        acc[j] = at::vec::fmadd(qo, o, acc[j]);
      }
    }
    reduce_rows(acc).store(out + g * ld, n);
  }
}

// v_accum for n bfloat16 rows read in place; acc[g] in pair order
template <int NC>
void v_accum_bf16(float* acc, const float* p, int64_t ldp, int64_t G, int64_t nc_rt, const c10::BFloat16* rows,
                  int n) {
  const int64_t nc = NC > 0 ? NC : nc_rt, D = nc * 2 * VS;
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * ldp;
    float* ag = acc + g * D;
    if constexpr (NC > 0 && NC <= 4) {
      Vec a[2 * NC];
      for (int i = 0; i < 2 * NC; ++i) a[i] = Vec::loadu(ag + i * VS);
      for (int j = 0; j < n; ++j) {
        const Vec pj(pg[j]);
        for (int cc = 0; cc < NC; ++cc) {
          Vec e, o;
          bf16_pairs(rows + j * D + cc * 2 * VS, e, o);
          a[2 * cc] = at::vec::fmadd(pj, e, a[2 * cc]);
          a[2 * cc + 1] = at::vec::fmadd(pj, o, a[2 * cc + 1]);
        }
      }
      for (int i = 0; i < 2 * NC; ++i) a[i].store(ag + i * VS);
    } else {
      for (int64_t cc = 0; cc < nc; ++cc) {
        Vec ae = Vec::loadu(ag + 2 * cc * VS), ao = Vec::loadu(ag + (2 * cc + 1) * VS);
        for (int j = 0; j < n; ++j) {
          Vec e, o;
          bf16_pairs(rows + j * D + cc * 2 * VS, e, o);
          ae = at::vec::fmadd(Vec(pg[j]), e, ae);
          ao = at::vec::fmadd(Vec(pg[j]), o, ao);
        }
        ae.store(ag + 2 * cc * VS);
        ao.store(ag + (2 * cc + 1) * VS);
      }
    }
  }
}
#else
#define TS_BF16_PAIRS 0
#endif

// even/odd order of D = nc * 2 * VS channels: chunk c holds channels 2*VS*c + {0, 2, ..} then {1, 3, ..}
inline void permute_pairs(float* x, int64_t D) {
  float tmp[2 * VS];
  for (int64_t c = 0; c + 2 * VS <= D; c += 2 * VS) {
    for (int l = 0; l < VS; ++l) {
      tmp[l] = x[c + 2 * l];
      tmp[VS + l] = x[c + 2 * l + 1];
    }
    std::memcpy(x + c, tmp, 2 * VS * sizeof(float));
  }
}

// acc[g, :] += sum_{j < n} p[g * ldp + j] * row_j
template <int NV>
void v_accum(float* acc, const float* p, int64_t ldp, int64_t G, int64_t nv_rt, const float* rows, int n) {
  const int64_t nv = NV > 0 ? NV : nv_rt, st = nv * VS;
  if constexpr (NV > 0 && NV <= 8) {
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * ldp;
      float* ag = acc + g * st;
      Vec a[NV];
      for (int i = 0; i < NV; ++i) a[i] = Vec::loadu(ag + i * VS);
      for (int j = 0; j < n; ++j) {
        const Vec pj(pg[j]);
        for (int i = 0; i < NV; ++i) a[i] = at::vec::fmadd(pj, Vec::loadu(rows + j * st + i * VS), a[i]);
      }
      for (int i = 0; i < NV; ++i) a[i].store(ag + i * VS);
    }
  } else {
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * ldp;
      float* ag = acc + g * st;
      for (int64_t i = 0; i < nv; ++i) {
        Vec a = Vec::loadu(ag + i * VS);
        for (int j = 0; j < n; ++j) a = at::vec::fmadd(Vec(pg[j]), Vec::loadu(rows + j * st + i * VS), a);
        a.store(ag + i * VS);
      }
    }
  }
}

struct Kern {
  decltype(&dot_block<0>) dot;
  decltype(&bound_block<0>) bound;
  decltype(&v_accum<0>) vacc;
#if TS_BF16_PAIRS
  // bfloat16 pair kernels, set when D is a multiple of 2 * VS
  decltype(&bound_block_bf16<0>) bound16 = nullptr;
  decltype(&dot_block_bf16<0>) dot16 = nullptr;
  decltype(&v_accum_bf16<0>) vacc16 = nullptr;
#endif
  static Kern pick(int64_t nv) {
    Kern k;
    switch (nv) {
      case 1: k = {&dot_block<1>, &bound_block<1>, &v_accum<1>}; break;
      case 2: k = {&dot_block<2>, &bound_block<2>, &v_accum<2>}; break;
      case 4: k = {&dot_block<4>, &bound_block<4>, &v_accum<4>}; break;
      case 8: k = {&dot_block<8>, &bound_block<8>, &v_accum<8>}; break;
      case 16: k = {&dot_block<16>, &bound_block<16>, &v_accum<16>}; break;
      default: k = {&dot_block<0>, &bound_block<0>, &v_accum<0>}; break;
    }
#if TS_BF16_PAIRS
    switch (nv) {
      case 2: k.bound16 = &bound_block_bf16<1>; k.dot16 = &dot_block_bf16<1>; k.vacc16 = &v_accum_bf16<1>; break;
      case 4: k.bound16 = &bound_block_bf16<2>; k.dot16 = &dot_block_bf16<2>; k.vacc16 = &v_accum_bf16<2>; break;
      case 8: k.bound16 = &bound_block_bf16<4>; k.dot16 = &dot_block_bf16<4>; k.vacc16 = &v_accum_bf16<4>; break;
      case 16: k.bound16 = &bound_block_bf16<8>; k.dot16 = &dot_block_bf16<8>; k.vacc16 = &v_accum_bf16<8>; break;
      default:
        if (nv % 2 == 0) {
          k.bound16 = &bound_block_bf16<0>;
          k.dot16 = &dot_block_bf16<0>;
          k.vacc16 = &v_accum_bf16<0>;
        }
        break;
    }
#endif
    return k;
  }
};

// whether bf16 keys and values are read in place as even/odd pairs (then q*scale and the value accumulators are
// in that order)
template <typename T>
inline bool kv_pairs_used(int64_t D) {
  return TS_BF16_PAIRS && std::is_same_v<T, c10::BFloat16> && D % (2 * VS) == 0;
}


// whether bf16 bounds are read in place as even/odd pairs (then qp/qn are stored in that order)
template <typename BT>
inline bool bf16_pairs_used(int64_t D) {
  return TS_BF16_PAIRS && std::is_same_v<BT, c10::BFloat16> && D % (2 * VS) == 0;
}

// A block of n <= VS bfloat16 token rows as VS contiguous rows of D: in place when the tokens are consecutive and
// the rows contiguous, else copied raw into scr (zero rows after n when pad)
inline const c10::BFloat16* token_block_raw(const c10::BFloat16* base, int64_t stride, const int64_t* tok, int n,
                                            int64_t D, c10::BFloat16* scr, bool pad) {
  if (n == VS && stride == D && tok[VS - 1] == tok[0] + VS - 1) {
    bool run = true;
    for (int j = 1; j < VS - 1; ++j) run &= tok[j] == tok[0] + j;
    if (run) return base + tok[0] * stride;
  }
  for (int j = 0; j < n; ++j) std::memcpy(scr + j * D, base + tok[j] * stride, D * sizeof(c10::BFloat16));
  if (pad) std::memset(static_cast<void*>(scr + n * D), 0, (VS - n) * D * sizeof(c10::BFloat16));
  return scr;
}

// A block of n <= VS token rows (tokens tok[0..n), row t at base + t * stride) as VS contiguous fp32 rows of Dp:
// the cache itself when that is already the layout (fp32, Dp == D == stride, consecutive tokens, full block),
// else a copy in scr (zero rows after n when pad).
template <typename T>
inline const float* token_block(const T* base, int64_t stride, const int64_t* tok, int n, int64_t D, int64_t Dp,
                                float* scr, bool pad) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == VS && Dp == D && stride == D && tok[VS - 1] == tok[0] + VS - 1) {
      bool run = true;
      for (int j = 1; j < VS - 1; ++j) run &= tok[j] == tok[0] + j;
      if (run) return base + tok[0] * stride;
    }
  }
  const T* src[VS];
  for (int j = 0; j < n; ++j) src[j] = base + tok[j] * stride;
  rows_to_f32<T>(src, n, D, Dp, scr);
  if (pad) std::fill(scr + n * Dp, scr + VS * Dp, 0.f);
  return scr;
}

// Logits of a block of n <= VS tokens (rows at base + tok[j] * stride) for G heads: out[g * ld + j].
// bf16 rows are read in place as even/odd pairs when `pairs` (q in pair order), else through fp32 rows.
template <typename T>
inline void key_dots(const Kern& kern, const T* base, int64_t stride, const int64_t* tok, int n, int64_t D,
                     int64_t Dp, float* scr, const float* q, int64_t G, float* out, int64_t ld, bool pairs) {
#if TS_BF16_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pairs) {
      const c10::BFloat16* rows = token_block_raw(base, stride, tok, n, D, reinterpret_cast<c10::BFloat16*>(scr), true);
      kern.dot16(rows, n, q, G, Dp / (2 * VS), out, ld);
      return;
    }
  }
#endif
  const float* rows = token_block<T>(base, stride, tok, n, D, Dp, scr, true);
  kern.dot(rows, n, q, G, Dp / VS, out, ld);
}

// acc[g] += sum_j p[g * ldp + j] * v_j over a block of n <= VS tokens (acc in pair order when `pairs`)
template <typename T>
inline void value_accum(const Kern& kern, const T* base, int64_t stride, const int64_t* tok, int n, int64_t D,
                        int64_t Dp, float* scr, float* acc, const float* p, int64_t ldp, int64_t G, bool pairs) {
#if TS_BF16_PAIRS
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (pairs) {
      const c10::BFloat16* rows = token_block_raw(base, stride, tok, n, D, reinterpret_cast<c10::BFloat16*>(scr), false);
      kern.vacc16(acc, p, ldp, G, Dp / (2 * VS), rows, n);
      return;
    }
  }
#endif
  const float* rows = token_block<T>(base, stride, tok, n, D, Dp, scr, false);
  kern.vacc(acc, p, ldp, G, Dp / VS, rows, n);
}

// ------------------------------------------------------------------------------------------------------------
// stage 1: page scores (bound scan) for pages [p0, p1) of one (batch, KV head)
// ------------------------------------------------------------------------------------------------------------

template <typename T, typename BT>
void score_pages(const Ctx<T, BT>& c, const Kern& kern, int64_t bh, int64_t p0, int64_t p1, float* out) {
  const int64_t b = bh / c.Hkv, h = bh % c.Hkv, D = c.D, Dp = c.Dp, G = c.G, S = c.S;
  const BT* M = c.kmax + bh * c.P * D;
  const BT* m = c.kmin + bh * c.P * D;
  const float* kab = c.kabs + bh * c.P;
  const float* qp = c.qp + bh * G * Dp;
  const float* qn = c.qn + bh * G * Dp;
  const float* qa = c.qabs + bh * G;
  float* scr = scratch_f<0>(2 * VS * Dp);
  alignas(64) float mm[VS];
  alignas(64) float kb[VS];
  // scores of the n pages of the block at p, from bound_of(g) = r of every page for query head g
  auto store_block = [&](int64_t p, int n, const auto& bound_of) {
    for (int j = 0; j < VS; ++j) kb[j] = j < n ? kab[p + j] : 0.f;
    const Vec kbv = Vec::loadu(kb);
    Vec best(NEG_INF);
    for (int64_t g = 0; g < G; ++g) {
      const Vec r = bound_of(g);
      // ---- rounding slack, scale (as reference.page_scores), then the page max of the mask
      const Vec slack = at::vec::fmadd(Vec(qa[g]), kbv, Vec(c.base));
      Vec sc = at::vec::fmadd(Vec(c.factor), slack, r) * Vec(c.scale);
      if (c.mask.kind != 0) {
        if (g == 0 || c.mask.per_head) {
          const int64_t hq = h * G + g;
          for (int j = 0; j < VS; ++j) {
            const int64_t pj = p + std::min(j, n - 1);
            mm[j] = c.mask.range_max(b, hq, pj * S, std::min((pj + 1) * S, c.L));
          }
        }
        sc = sc + Vec::loadu(mm);
      }
      best = at::vec::maximum(best, sc);
    }
    best.store(out + p, n);
  };
  for (int64_t p = p0; p < p1; p += VS) {
    const int n = static_cast<int>(std::min<int64_t>(VS, p1 - p));
    if (bf16_pairs_used<BT>(D)) {
#if TS_BF16_PAIRS
      // ---- bf16 bounds in place (a partial block is copied, zero padded)
      const c10::BFloat16* Mh = reinterpret_cast<const c10::BFloat16*>(M + p * D);
      const c10::BFloat16* mh = reinterpret_cast<const c10::BFloat16*>(m + p * D);
      if (n < VS) {
        c10::BFloat16* h16 = reinterpret_cast<c10::BFloat16*>(scr);
        std::memset(h16, 0, 2 * VS * D * sizeof(c10::BFloat16));
        std::memcpy(h16, Mh, n * D * sizeof(c10::BFloat16));
        std::memcpy(h16 + VS * D, mh, n * D * sizeof(c10::BFloat16));
        Mh = h16;
        mh = h16 + VS * D;
      }
      store_block(p, n, [&](int64_t g) { return kern.bound16(Mh, mh, qp + g * Dp, qn + g * Dp, c.nv / 2); });
#endif
      continue;
    }
    // ---- the block's bounds as contiguous fp32 rows (in place for fp32 bounds and full blocks)
    const float* Mb;
    const float* mb;
    if (std::is_same_v<BT, float> && Dp == D && n == VS) {
      Mb = reinterpret_cast<const float*>(M + p * D);
      mb = reinterpret_cast<const float*>(m + p * D);
    } else {
      if constexpr (std::is_same_v<BT, int8_t>) {
        // ---- int8 codes decoded to fp32 (code * step, the step from the page's kabs), zero padded
        int8_rows_to_f32(M + p * D, kab + p, n, D, Dp, scr);
        int8_rows_to_f32(m + p * D, kab + p, n, D, Dp, scr + VS * Dp);
      } else {
        const BT* src[VS];
        for (int j = 0; j < n; ++j) src[j] = M + (p + j) * D;
        rows_to_f32<BT>(src, n, D, Dp, scr);
        for (int j = 0; j < n; ++j) src[j] = m + (p + j) * D;
        rows_to_f32<BT>(src, n, D, Dp, scr + VS * Dp);
      }
      std::fill(scr + n * Dp, scr + VS * Dp, 0.f);
      std::fill(scr + (VS + n) * Dp, scr + 2 * VS * Dp, 0.f);
      Mb = scr;
      mb = scr + VS * Dp;
    }
    // ---- r = sum_d max(q_d M_d, q_d m_d), VS pages at once
    store_block(p, n, [&](int64_t g) { return kern.bound(Mb, mb, qp + g * Dp, qn + g * Dp, c.nv); });
  }
}

// ------------------------------------------------------------------------------------------------------------
// partial selection: the n_keep largest of w[0, n), forced pages at +inf, -inf never kept; ascending
// ------------------------------------------------------------------------------------------------------------

// order-preserving map of a float to uint32 (NaN above +inf, as topk treats it as largest)
inline uint32_t fkey(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t k = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return x != x ? 0xFFFFFFFFu : k;
}

// Histogram of digit (k >> sh) & (nb - 1) over the keys with (k & pmask) == prefix; four interleaved
// sub-histograms so that runs of equal digits (scores are concentrated) do not serialise on one counter.
inline void digit_hist(const uint32_t* keys, int64_t n, int sh, uint32_t nb, uint32_t pmask, uint32_t prefix,
                       uint32_t (*hist)[2048]) {
  for (int u = 0; u < 4; ++u) std::memset(hist[u], 0, nb * sizeof(uint32_t));
  int64_t i = 0;
  if (pmask == 0) {
    for (; i + 4 <= n; i += 4)
      for (int u = 0; u < 4; ++u) ++hist[u][(keys[i + u] >> sh) & (nb - 1)];
    for (; i < n; ++i) ++hist[0][(keys[i] >> sh) & (nb - 1)];
  } else {
    for (; i + 4 <= n; i += 4)
      for (int u = 0; u < 4; ++u) hist[u][(keys[i + u] >> sh) & (nb - 1)] += (keys[i + u] & pmask) == prefix;
    for (; i < n; ++i) hist[0][(keys[i] >> sh) & (nb - 1)] += (keys[i] & pmask) == prefix;
  }
  for (uint32_t d = 0; d < nb; ++d) hist[0][d] += hist[1][d] + hist[2][d] + hist[3][d];
}

// Writes the indices of the n_keep largest of w[0, n) to out, ascending, leaving out -inf; ties at the threshold
// go to the lowest indices. Radix select on the float keys (digits of 11/11/10 bits; after the first digit only
// the keys sharing it are scanned), no sort. keys: scratch of 2n. Returns the count.
inline int64_t select_top(const float* w, int64_t n, int64_t n_keep, uint32_t* keys, int32_t* out) {
  constexpr uint32_t NEG_INF_KEY = 0x007FFFFFu;  // fkey(-inf)
  if (n_keep >= n) {
    int64_t cnt = 0;
    for (int64_t p = 0; p < n; ++p)
      if (fkey(w[p]) > NEG_INF_KEY) out[cnt++] = static_cast<int32_t>(p);
    return cnt;
  }
  uint32_t hist[4][2048];
  for (int64_t p = 0; p < n; ++p) keys[p] = fkey(w[p]);
  // ---- first digit over every key
  digit_hist(keys, n, 21, 2048, 0, 0, hist);
  int64_t need = n_keep;
  uint32_t d = 2047;
  for (;; --d) {
    if (hist[0][d] >= need) break;
    need -= hist[0][d];
  }
  uint32_t prefix = d << 21, pmask = 0xFFE00000u;
  // ---- the keys in that bucket, then the lower digits among them
  uint32_t* sub = keys + n;
  int64_t m = 0;
  for (int64_t p = 0; p < n; ++p) {
    sub[m] = keys[p];
    m += (keys[p] >> 21) == d;
  }
  const int shifts[2] = {10, 0};
  const uint32_t widths[2] = {2048, 1024};
  for (int lvl = 0; lvl < 2; ++lvl) {
    const int sh = shifts[lvl];
    const uint32_t nb = widths[lvl];
    digit_hist(sub, m, sh, nb, pmask, prefix, hist);
    uint32_t e = nb - 1;
    for (;; --e) {
      if (hist[0][e] >= need) break;
      need -= hist[0][e];
    }
    prefix |= e << sh;
    pmask |= (nb - 1) << sh;
  }
  const uint32_t thr = prefix;
  // ---- ascending output: every key above the threshold, the first `need` equal to it
  int64_t cnt = 0;
  for (int64_t p = 0; p < n; ++p) {
    const uint32_t k = keys[p];
    if (k > thr || (k == thr && need-- > 0)) {
      if (k > NEG_INF_KEY) out[cnt++] = static_cast<int32_t>(p);
    }
  }
  return cnt;
}

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
// TINYSERVE_NATIVE_SCHED=omp (read at each call) runs the same claiming inside at::parallel_for instead.
// ------------------------------------------------------------------------------------------------------------

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

class Pool {
 public:
  using Fn = void (*)(const void*, int64_t);

  static Pool& current() {
    static std::atomic<Pool*> cur{nullptr};
    Pool* p = cur.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {  // first use, or a forked child: the parent's helpers are not here
      Pool* q = new Pool();                       // never freed: detached helpers may outlive static destructors
      if (cur.compare_exchange_strong(p, q)) p = q;
      else delete q;
    }
    return *p;
  }

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
  void work(uint64_t g) {
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

  void helper(int64_t id) {
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

inline bool omp_scheduling() {
  const char* s = std::getenv("TINYSERVE_NATIVE_SCHED");
  return s != nullptr && std::strcmp(s, "omp") == 0;
}

// f(i) for i in [0, n), items claimed one at a time by at most at::get_num_threads() threads
template <typename F>
inline void run_items(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  if (!omp_scheduling()) return Pool::current().run(n, nt, f);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
  });
}

// ------------------------------------------------------------------------------------------------------------
// stage 3: exact attention over a token list of one (batch, KV head), logits given or computed from K
// ------------------------------------------------------------------------------------------------------------

// tok[T]: token indices (all valid). If lg_given, lg[g * ldl + t] hold the logits (mask included); else they
// are computed here from the keys, q*scale and the mask. Writes part[g * (Dp + 2) + {0: max, 1: sum, 2..}].
template <typename T, typename BT>
void attend_tokens(const Ctx<T, BT>& c, const Kern& kern, int64_t bh, const int64_t* tok, int64_t T_, bool lg_given,
                   float* lg, int64_t ldl, float* part) {
  const int64_t G = c.G, Dp = c.Dp, nv = c.nv, D = c.D;
  const int64_t b = bh / c.Hkv, h = bh % c.Hkv;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  float* scr = scratch_f<1>(VS * Dp);
  const T* kb = c.kbase(bh);
  const T* vb = c.vbase(bh);
  const int64_t ksl = c.ksl, vsl = c.vsl;
  const bool pairs = kv_pairs_used<T>(D);
  // ---- logits from the keys, VS tokens at a time; prefetch keys ahead and this block's values into L2
  if (!lg_given) {
    const float* qs = c.qs + bh * G * Dp;
    for (int64_t t0 = 0; t0 < T_; t0 += VS) {
      const int n = static_cast<int>(std::min<int64_t>(VS, T_ - t0));
      const int64_t tp = t0 + PF_BLOCKS * VS;
      for (int64_t t = tp; t < std::min(T_, tp + VS); ++t) prefetch_row(kb + tok[t] * ksl, row_bytes, 3);
      for (int j = 0; j < n; ++j) prefetch_row(vb + tok[t0 + j] * vsl, row_bytes, 1);
      key_dots<T>(kern, kb, ksl, tok + t0, n, D, Dp, scr, qs, G, lg + t0, ldl, pairs);
    }
    if (c.mask.kind != 0) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + (c.mask.per_head ? g : 0);
        for (int64_t t = 0; t < T_; ++t) lg[g * ldl + t] += c.mask.at(b, hq, tok[t]);
      }
    }
  }
  // ---- softmax per head over the chunk (weights in place)
  for (int64_t g = 0; g < G; ++g) {
    float* pg = part + g * (Dp + 2);
    float* x = lg + g * ldl;
    const float mx = hmax(x, T_);
    pg[0] = mx;
    pg[1] = 0.f;
    if (mx == NEG_INF || std::isnan(mx)) {
      std::fill(x, x + T_, 0.f);
      pg[0] = NEG_INF;
      continue;
    }
    pg[1] = exp_sub_to(x, x, T_, mx);
  }
  // ---- weighted values, VS tokens at a time
  float* acc = scratch_f<2>(G * Dp);
  std::fill(acc, acc + G * Dp, 0.f);
  for (int64_t t0 = 0; t0 < T_; t0 += VS) {
    const int n = static_cast<int>(std::min<int64_t>(VS, T_ - t0));
    const int64_t tp = t0 + PF_BLOCKS * VS;
    for (int64_t t = tp; t < std::min(T_, tp + VS); ++t) prefetch_row(vb + tok[t] * vsl, row_bytes, 3);
    value_accum<T>(kern, vb, vsl, tok + t0, n, D, Dp, scr, acc, lg + t0, ldl, G, pairs);
  }
  for (int64_t g = 0; g < G; ++g) std::memcpy(part + g * (Dp + 2) + 2, acc + g * Dp, Dp * sizeof(float));
}

// ------------------------------------------------------------------------------------------------------------
// the op
// ------------------------------------------------------------------------------------------------------------

enum TaskKind : int { T_SCORE = 0, T_SELECT, T_CAND, T_RANK, T_ATTEND, T_COMBINE, T_KINDS };

struct Task {
  int kind;
  int64_t bh, begin, end, aux;  // aux: ATTEND: its partial-result slot; COMBINE: first slot of the row
};

struct Plan {
  // selection outputs, per (batch, KV head)
  std::vector<int32_t> sel;      // [BH, N1] first-stage pages (ascending)
  std::vector<int64_t> selcnt;   // [BH]
  std::vector<int32_t> kept;     // [BH, K] kept pages (one stage) or candidate slots (two stage), ascending;
                                 // with keep_tokens [BH, K * S] kept candidate token slots (page slot * S + u)
  std::vector<int64_t> keptcnt;  // [BH]
  // work buffers, grow-only (one Plan per calling thread)
  std::vector<float> qbuf, scores, lgc, plse, parts;
  std::vector<struct Task> tasks;
  std::unique_ptr<std::atomic<int64_t>[]> sync;  // 5 counters per (batch, KV head)
  int64_t sync_size = 0;
};

inline Plan& thread_plan() {
  thread_local Plan plan;
  return plan;
}

template <typename T, typename BT>
void build_ctx(Ctx<T, BT>& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kmax,
               const at::Tensor& kmin, const at::Tensor& kabs, const at::Tensor& valid_len,
               const c10::optional<at::Tensor>& attn_mask, double scale, int64_t S, int64_t budget, int64_t sinks,
               int64_t cf, int64_t extra, bool keep_tokens, bool force_dense, std::vector<float>& qbuf) {
  c.B = q.size(0);
  c.Hq = q.size(1);
  c.D = q.size(3);
  c.Hkv = k.size(1);
  c.L = k.size(2);
  c.G = c.Hq / c.Hkv;
  c.S = S;
  c.P = (c.L + S - 1) / S;
  c.K = budget / S;
  c.cf = cf;
  c.n1 = cf * c.K + extra / S;  // reference.candidate_pages
  c.keep_tokens = keep_tokens;
  c.sinks = sinks;
  c.nv = (c.D + VS - 1) / VS;
  c.Dp = c.nv * VS;
  c.scale = static_cast<float>(scale);
  const double factor = 4.0 * (c.D + 2) * std::ldexp(1.0, -24);
  c.factor = static_cast<float>(factor);
  c.base = static_cast<float>((c.D + 2) * std::ldexp(1.0, -126) / (scale * factor));
  c.k = k.data_ptr<T>();
  c.ksb = k.stride(0);
  c.ksh = k.stride(1);
  c.ksl = k.stride(2);
  c.v = v.data_ptr<T>();
  c.vsb = v.stride(0);
  c.vsh = v.stride(1);
  c.vsl = v.stride(2);
  c.kmax = kmax.data_ptr<BT>();
  c.kmin = kmin.data_ptr<BT>();
  c.kabs = kabs.data_ptr<float>();
  c.mask = make_mask(attn_mask, c.B, c.Hq, c.L);
  // ---- q as fp32: scaled, sign split, |q|_1
  const int64_t BH = c.B * c.Hkv, G = c.G, Dp = c.Dp, D = c.D;
  qbuf.assign(BH * G * Dp * 3 + BH * G, 0.f);
  float* qs = qbuf.data();
  float* qp = qs + BH * G * Dp;
  float* qn = qp + BH * G * Dp;
  float* qa = qn + BH * G * Dp;
  const T* qd = q.data_ptr<T>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qsd = q.stride(3);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t hq = 0; hq < c.Hq; ++hq) {
      const int64_t o = (b * c.Hq + hq) * Dp;  // == ((b*Hkv + hq/G)*G + hq%G) * Dp
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float x = static_cast<float>(qd[b * qsb + hq * qsh + d * qsd]);
        qs[o + d] = x * c.scale;
        qp[o + d] = x > 0.f ? x : 0.f;
        qn[o + d] = x < 0.f ? x : 0.f;
        s += std::fabs(x);
      }
      qa[b * c.Hq + hq] = s;
    }
  if (kv_pairs_used<T>(D))
    for (int64_t r = 0; r < BH * G; ++r) permute_pairs(qs + r * Dp, D);
  if (bf16_pairs_used<BT>(D)) {
    for (int64_t r = 0; r < BH * G; ++r) {
      permute_pairs(qp + r * Dp, D);
      permute_pairs(qn + r * Dp, D);
    }
  }
  c.qs = qs;
  c.qp = qp;
  c.qn = qn;
  c.qabs = qa;
  // ---- per-row plan
  TORCH_CHECK(valid_len.numel() == 1 || valid_len.numel() == c.B, "tinyserve (native): valid_len must have 1 or B ",
              "elements");
  at::Tensor vl = valid_len.scalar_type() == at::kLong ? valid_len.contiguous() : valid_len.to(at::kLong).contiguous();
  const int64_t* vlp = vl.data_ptr<int64_t>();
  c.rows.resize(c.B);
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t n = vlp[vl.numel() == 1 ? 0 : b];
    Row r;
    r.ntok = std::max<int64_t>(0, std::min(n, c.L));
    r.nvalid = n > 0 ? std::min((n + S - 1) / S, c.P) : 0;
    r.newest = n > 0 && (n - 1) / S < c.P ? (n - 1) / S : -1;
    if (r.nvalid == 0 || r.ntok == 0)
      r.mode = EMPTY;
    else if (force_dense || r.nvalid <= c.K)
      r.mode = DENSE;
    else if (c.n1 <= c.K)
      r.mode = ONE_STAGE;
    else if (r.nvalid <= c.n1)
      r.mode = TWO_ALL;
    else
      r.mode = TWO_TOPK;
    c.rows[b] = r;
  }
}

// ------------------------------------------------------------------------------------------------------------
// one call = one parallel region over a task list in dependency order, dispatched dynamically:
//   SCORE chunks -> SELECT per (batch, KV head) -> CAND chunks -> RANK -> ATTEND chunks -> COMBINE
// A thread that takes a task whose inputs are still being produced by another thread waits for them; tasks are
// taken in list order, so what it waits for is already running (no deadlock, also with one thread).
// ------------------------------------------------------------------------------------------------------------

#ifdef TS_PROFILE
const char* const kTaskNames[T_KINDS] = {"scores", "select", "cand_logits", "rank", "attend", "combine"};
#endif

inline void spin_wait(const std::atomic<int64_t>& x, int64_t want) {
  int spins = 0;
  while (x.load(std::memory_order_acquire) != want) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#endif
    if (++spins > 2000) {  // the producer may be descheduled (busy machine): give the core away
      std::this_thread::yield();
      spins = 0;
    }
  }
}

// log-sum-exp of n page log-sum-exps (one head's total over the candidates); -inf when none is above -inf or
// their max is NaN
inline float lse_total(const float* lse, int64_t n) {
  const float mx = hmax(lse, n);
  if (!(mx > NEG_INF)) return NEG_INF;
  float* e = scratch_f<6>(n + VS);
  return mx + std::log(exp_sub_to(lse, e, n, mx));
}

template <typename T, typename BT>
struct Pipeline {
  const Ctx<T, BT>& c;
  Plan& pl;
  Kern kern;
  int64_t BH, G, S, K, N1, Dp, ld_lgc = 0;
  int64_t KT;  // kept entries per (batch, KV head) of a two-stage row: K pages, or K * S tokens (keep_tokens)
  float* scores = nullptr;
  float* lgc = nullptr;
  float* plse = nullptr;
  float* parts = nullptr;
  T* out = nullptr;
  std::vector<Task>& tasks;
  // per (batch, KV head): chunks still running, and stage flags (0/1)
  std::atomic<int64_t>* score_left = nullptr;
  std::atomic<int64_t>* cand_left = nullptr;
  std::atomic<int64_t>* attend_left = nullptr;
  std::atomic<int64_t>* selected = nullptr;
  std::atomic<int64_t>* ranked = nullptr;

  Pipeline(const Ctx<T, BT>& c_, Plan& pl_) : c(c_), pl(pl_), kern(Kern::pick(c_.nv)), tasks(pl_.tasks) {
    BH = c.B * c.Hkv;
    G = c.G;
    S = c.S;
    K = c.K;
    N1 = c.n1 > c.K ? std::min(c.n1, c.P) : c.K;
    KT = c.keep_tokens ? c.K * c.S : c.K;
    Dp = c.Dp;
  }

  int mode(int64_t bh) const { return c.rows[bh / c.Hkv].mode; }
  static bool scored(int m) { return m == ONE_STAGE || m == TWO_TOPK; }
  static bool two(int m) { return m == TWO_ALL || m == TWO_TOPK; }

  // ---- the task list and buffers; with_attend = false stops after the selection (kept_pages)
  void plan(bool with_attend) {
    pl.sel.assign(BH * std::max<int64_t>(N1, 1), 0);
    pl.selcnt.assign(BH, 0);
    pl.kept.assign(BH * std::max<int64_t>(KT, 1), 0);
    pl.keptcnt.assign(BH, 0);
    if (pl.sync_size < 5 * BH) {
      pl.sync.reset(new std::atomic<int64_t>[5 * BH]);
      pl.sync_size = 5 * BH;
    }
    score_left = pl.sync.get();
    cand_left = score_left + BH;
    attend_left = cand_left + BH;
    selected = attend_left + BH;
    ranked = selected + BH;
    for (int64_t i = 0; i < 5 * BH; ++i) score_left[i].store(0, std::memory_order_relaxed);
    tasks.clear();
    auto chunks = [&](int kind, int64_t bh, int64_t n, int64_t ch, std::atomic<int64_t>* left) {
      for (int64_t s0 = 0; s0 < n; s0 += ch) {
        tasks.push_back({kind, bh, s0, std::min(n, s0 + ch), 0});
        if (left) left[bh].fetch_add(1, std::memory_order_relaxed);
      }
    };
    // ---- stage 1: bound scan of the valid pages; stage 2: top-K (one stage) or top-cK candidates
    int64_t total = 0;
    bool any_scores = false, any_two = false;
    for (int64_t bh = 0; bh < BH; ++bh) {
      const int m = mode(bh);
      any_scores |= scored(m);
      any_two |= two(m);
      if (scored(m)) total += c.rows[bh / c.Hkv].nvalid;
    }
    if (any_scores) {
      scores = grow(pl.scores, BH * c.P);
      const int64_t ch = chunk_size(total, 64, VS);
      for (int64_t bh = 0; bh < BH; ++bh)
        if (scored(mode(bh))) chunks(T_SCORE, bh, c.rows[bh / c.Hkv].nvalid, ch, score_left);
      for (int64_t bh = 0; bh < BH; ++bh)
        if (scored(mode(bh))) tasks.push_back({T_SELECT, bh, 0, 0, 0});
    }
    // ---- stage 3: candidates' logits and page log-sum-exp, then the ranking by softmax mass
    if (any_two) {
      ld_lgc = N1 * S;
      lgc = grow(pl.lgc, BH * G * ld_lgc);
      plse = grow(pl.plse, BH * G * N1);
      total = 0;
      for (int64_t bh = 0; bh < BH; ++bh) {
        const Row& r = c.rows[bh / c.Hkv];
        if (r.mode == TWO_ALL) {  // every valid page is a candidate: no bound scan
          for (int64_t p = 0; p < r.nvalid; ++p) pl.sel[bh * N1 + p] = static_cast<int32_t>(p);
          pl.selcnt[bh] = r.nvalid;
          total += r.nvalid;
        } else if (r.mode == TWO_TOPK) {
          total += N1;
        }
      }
      const int64_t ch = chunk_size(total, 16, VS);
      for (int64_t bh = 0; bh < BH; ++bh) {
        const Row& r = c.rows[bh / c.Hkv];
        if (two(r.mode)) chunks(T_CAND, bh, r.mode == TWO_ALL ? r.nvalid : N1, ch, cand_left);
      }
      for (int64_t bh = 0; bh < BH; ++bh)
        if (two(mode(bh))) tasks.push_back({T_RANK, bh, 0, 0, 0});
    }
    if (!with_attend) return;
    // ---- stage 4: attention over chunks of the kept pages (every valid page of a dense row) or, two-stage with
    // keep_tokens, of the kept tokens (a chunk of ch pages = ch * S tokens), then combine
    total = 0;
    for (int64_t bh = 0; bh < BH; ++bh) {
      const Row& r = c.rows[bh / c.Hkv];
      if (r.mode == DENSE) total += r.nvalid;
      else if (r.mode != EMPTY) total += K;
    }
    const int64_t ch = chunk_size(total, std::max<int64_t>(1, 64 / S), 1);
    std::vector<int64_t> first(BH, 0), count(BH, 0);
    int64_t slot = 0;
    for (int64_t bh = 0; bh < BH; ++bh) {
      const Row& r = c.rows[bh / c.Hkv];
      first[bh] = slot;
      if (r.mode == EMPTY) continue;
      const bool tokens = two(r.mode) && c.keep_tokens;
      const int64_t n = r.mode == DENSE ? r.nvalid : (tokens ? KT : K), chr = tokens ? ch * S : ch;
      for (int64_t s0 = 0; s0 < n; s0 += chr, ++slot) {
        tasks.push_back({T_ATTEND, bh, s0, std::min(n, s0 + chr), slot});
        attend_left[bh].fetch_add(1, std::memory_order_relaxed);
      }
      count[bh] = slot - first[bh];
    }
    parts = grow(pl.parts, std::max<int64_t>(slot, 1) * G * (Dp + 2));
    for (int64_t bh = 0; bh < BH; ++bh) tasks.push_back({T_COMBINE, bh, first[bh], first[bh] + count[bh], 0});
  }

  // ---- run: one parallel region, tasks pulled in order
  void run() {
    const int64_t n = static_cast<int64_t>(tasks.size());
    if (n == 0) return;
    run_items(n, [&](int64_t i) {
      const Task& t = tasks[i];
#ifdef TS_PROFILE
      const double t0 = Prof::now();
#endif
      execute(t);
#ifdef TS_PROFILE
      prof().add(t.kind, kTaskNames[t.kind], Prof::now() - t0);
#endif
    });
  }

  void execute(const Task& t) {
    const int64_t bh = t.bh;
    const int m = mode(bh);
    switch (t.kind) {
      case T_SCORE:
        score_pages(c, kern, bh, t.begin, t.end, scores + bh * c.P);
        score_left[bh].fetch_sub(1, std::memory_order_acq_rel);
        break;
      case T_SELECT:
        spin_wait(score_left[bh], 0);
        select(bh);
        selected[bh].store(1, std::memory_order_release);
        break;
      case T_CAND:
        if (m == TWO_TOPK) spin_wait(selected[bh], 1);
        cand(bh, t.begin, std::min(t.end, pl.selcnt[bh]));
        cand_left[bh].fetch_sub(1, std::memory_order_acq_rel);
        break;
      case T_RANK:
        spin_wait(cand_left[bh], 0);
        if (c.keep_tokens)
          rank_tokens(bh);
        else
          rank(bh);
        ranked[bh].store(1, std::memory_order_release);
        break;
      case T_ATTEND:
        if (m == ONE_STAGE) spin_wait(selected[bh], 1);
        if (two(m)) spin_wait(ranked[bh], 1);
        attend(bh, t.begin, m == DENSE ? t.end : std::min(t.end, pl.keptcnt[bh]), parts + t.aux * G * (Dp + 2));
        attend_left[bh].fetch_sub(1, std::memory_order_acq_rel);
        break;
      case T_COMBINE:
        spin_wait(attend_left[bh], 0);
        combine(bh, t.begin, t.end);
        break;
    }
  }

  // stage 2: forced pages at +inf, partial top-N (ascending, -inf dropped)
  void select(int64_t bh) {
    const Row& r = c.rows[bh / c.Hkv];
    float* w = scores + bh * c.P;
    for (int64_t p = 0; p < std::min(c.sinks, r.nvalid); ++p) w[p] = POS_INF;
    if (r.newest >= 0) w[r.newest] = POS_INF;
    const int64_t n_keep = r.mode == ONE_STAGE ? K : N1;
    uint32_t* tmp = reinterpret_cast<uint32_t*>(scratch_f<3>(2 * r.nvalid));
    int32_t* o = r.mode == ONE_STAGE ? pl.kept.data() + bh * KT : pl.sel.data() + bh * N1;
    const int64_t cnt = select_top(w, r.nvalid, n_keep, tmp, o);
    (r.mode == ONE_STAGE ? pl.keptcnt : pl.selcnt)[bh] = cnt;
  }

  // stage 3a: exact logits of candidates [j0, j1) (mask included, -inf past the valid tokens), page lse per head
  void cand(int64_t bh, int64_t j0, int64_t j1) {
    if (j1 <= j0) return;
    const int64_t b = bh / c.Hkv, h = bh % c.Hkv, D = c.D, nv = c.nv;
    const Row& r = c.rows[b];
    const int32_t* cd = pl.sel.data() + bh * N1;
    const int64_t s0 = j0 * S, ns = (j1 - j0) * S;  // the chunk's candidate slots
    float* scr = scratch_f<1>(VS * Dp);
    const float* qs = c.qs + bh * G * Dp;
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    const T* kb = c.kbase(bh);
    const bool pairs = kv_pairs_used<T>(D);
    // token of every slot of the chunk (-1 past the valid tokens)
    int64_t* tok = reinterpret_cast<int64_t*>(scratch_f<4>(2 * ns + 2));
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t t0 = static_cast<int64_t>(cd[j]) * S;
      int64_t* tj = tok + (j - j0) * S;
      for (int64_t u = 0; u < S; ++u) tj[u] = t0 + u < r.ntok ? t0 + u : -1;
    }
    // logits straight into the slots, VS slots at a time (a slot past the valid tokens reads a zero row)
    float* xb = lgc + bh * G * ld_lgc + s0;
    int64_t tk[VS];
    for (int64_t s1 = 0; s1 < ns; s1 += VS) {
      const int n = static_cast<int>(std::min<int64_t>(VS, ns - s1));
      const int64_t sp = s1 + PF_BLOCKS * VS;
      for (int64_t sl = sp; sl < std::min(ns, sp + VS); ++sl)
        if (tok[sl] >= 0) prefetch_row(kb + tok[sl] * c.ksl, row_bytes, 3);
      int nvld = 0;
      while (nvld < n && tok[s1 + nvld] >= 0) ++nvld;  // invalid slots only at the end (newest page)
      if (nvld == n) {
        key_dots<T>(kern, kb, c.ksl, tok + s1, n, D, Dp, scr, qs, G, xb + s1, ld_lgc, pairs);
      } else {
        for (int j = 0; j < nvld; ++j) tk[j] = tok[s1 + j];
        // rows past nvld are zero (padding): their logits are set to -inf below
        key_dots<T>(kern, kb, c.ksl, tk, nvld, D, Dp, scr, qs, G, xb + s1, ld_lgc, pairs);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* x = lgc + (bh * G + g) * ld_lgc;
      const int64_t hq = h * G + (c.mask.per_head ? g : 0);
      if (c.mask.kind != 0) {
        for (int64_t sl = 0; sl < ns; ++sl)
          x[s0 + sl] = tok[sl] < 0 ? NEG_INF : x[s0 + sl] + c.mask.at(b, hq, tok[sl]);
      } else if (r.ntok < (static_cast<int64_t>(cd[j1 - 1]) + 1) * S) {  // only the newest page is partial
        for (int64_t sl = ns - S; sl < ns; ++sl)
          if (tok[sl] < 0) x[s0 + sl] = NEG_INF;
      }
      // page log-sum-exp: exp against the chunk max, page sums, vectorised log
      float* lse = plse + (bh * G + g) * N1;
      const float mc = hmax(x + s0, ns);
      if (mc == NEG_INF || std::isnan(mc)) {
        std::fill(lse + j0, lse + j1, NEG_INF);
        continue;
      }
      float* e = scratch_f<6>(ns + VS);
      exp_sub_to(x + s0, e, ns, mc);
      float* sums = lse + j0;
      const int64_t np = j1 - j0;
      int64_t j = 0;
      if (S == VS) {
        for (; j + VS <= np; j += VS) {
          Vec pv[VS];
          for (int u = 0; u < VS; ++u) pv[u] = Vec::loadu(e + (j + u) * S);
          reduce_rows(pv).store(sums + j);
        }
      }
      for (; j < np; ++j) sums[j] = hsum(e + j * S, S);
      for (j = 0; j + VS <= np; j += VS) (Vec::loadu(sums + j).log() + Vec(mc)).store(sums + j);
      if (j < np) {
        const int rem = static_cast<int>(np - j);
        (Vec::loadu(sums + j, rem).log() + Vec(mc)).store(sums + j, rem);
      }
      for (j = 0; j < np; ++j) {
        if (sums[j] > NEG_INF) continue;
        // zero sum: the page is -inf throughout, or it underflowed against the chunk max (exact value then)
        const float* xj = x + (j0 + j) * S;
        float pm = NEG_INF;
        for (int64_t u = 0; u < S; ++u) pm = std::max(pm, xj[u]);
        if (pm == NEG_INF) continue;
        float s2 = 0.f;
        for (int64_t u = 0; u < S; ++u) s2 += std::exp(xj[u] - pm);
        sums[j] = pm + std::log(s2);
      }
    }
  }

  // stage 3b: share of softmax mass per candidate page (max over the group), forced pages, top K
  void rank(int64_t bh) {
    const Row& r = c.rows[bh / c.Hkv];
    const int64_t kc = pl.selcnt[bh];
    const int32_t* cd = pl.sel.data() + bh * N1;
    float* share = scratch_f<7>(3 * kc + 1);
    uint32_t* tmp = reinterpret_cast<uint32_t*>(share + kc);
    std::fill(share, share + kc, NEG_INF);
    for (int64_t g = 0; g < G; ++g) {
      const float* lse = plse + (bh * G + g) * N1;
      const float total = lse_total(lse, kc);
      for (int64_t j = 0; j < kc; ++j) {
        const float x = lse[j] - total;
        if (!std::isnan(x)) share[j] = std::max(share[j], x);
      }
    }
    for (int64_t j = 0; j < kc; ++j) {
      const int64_t p = cd[j];
      if (p == r.newest || p < c.sinks) share[j] = POS_INF;
    }
    pl.keptcnt[bh] = select_top(share, kc, K, tmp, pl.kept.data() + bh * KT);
  }

  // stage 3b, keep_tokens: share of every candidate token (logit - lse over all candidate tokens, max over the
  // group; NaN -> -inf), the tokens of the newest page and of the sinks forced, invalid ones -inf; top K * S slots
  void rank_tokens(int64_t bh) {
    const Row& r = c.rows[bh / c.Hkv];
    const int64_t kc = pl.selcnt[bh], nt = kc * S;
    const int32_t* cd = pl.sel.data() + bh * N1;
    float* share = scratch_f<7>(3 * nt + 1);
    uint32_t* tmp = reinterpret_cast<uint32_t*>(share + nt);
    std::fill(share, share + nt, NEG_INF);
    for (int64_t g = 0; g < G; ++g) {
      // ---- lse over every candidate token of head g, from the page lse
      const float* lse = plse + (bh * G + g) * N1;
      const float total = lse_total(lse, kc);
      if (!(total > NEG_INF)) continue;  // no finite logit (or NaN): every share is -inf or NaN
      // ---- share per slot, max over the group
      const float* x = lgc + (bh * G + g) * ld_lgc;
      int64_t i = 0;
      const Vec tv(total);
      for (; i + VS <= nt; i += VS) {
        const Vec sh = Vec::loadu(x + i) - tv;
        const Vec ok = sh == sh;  // not NaN
        at::vec::maximum(Vec::loadu(share + i), Vec::blendv(Vec(NEG_INF), sh, ok)).store(share + i);
      }
      for (; i < nt; ++i) {
        const float sh = x[i] - total;
        if (!std::isnan(sh)) share[i] = std::max(share[i], sh);
      }
    }
    // ---- forced and invalid tokens
    for (int64_t j = 0; j < kc; ++j) {
      const int64_t p = cd[j];
      const bool forced = p == r.newest || p < c.sinks;
      float* sj = share + j * S;
      for (int64_t u = 0; u < S; ++u) {
        if (p * S + u >= r.ntok)
          sj[u] = NEG_INF;
        else if (forced)
          sj[u] = POS_INF;
      }
    }
    pl.keptcnt[bh] = select_top(share, nt, KT, tmp, pl.kept.data() + bh * KT);
  }

  // stage 4: exact attention over kept entries [j0, j1) of a row (pages of a dense row)
  void attend(int64_t bh, int64_t j0, int64_t j1, float* part) {
    if (j1 <= j0) {
      for (int64_t g = 0; g < G; ++g) {
        part[g * (Dp + 2)] = NEG_INF;
        part[g * (Dp + 2) + 1] = 0.f;
      }
      return;
    }
    const Row& r = c.rows[bh / c.Hkv];
    const bool is_two = two(r.mode);
    const bool tokens = is_two && c.keep_tokens;  // entries are kept candidate token slots
    const int64_t cap = tokens ? j1 - j0 : (j1 - j0) * S;
    int64_t* tok = reinterpret_cast<int64_t*>(scratch_f<4>(2 * cap + 2));
    const int64_t ldl = cap + VS;
    float* lg = scratch_f<5>(G * ldl);
    int64_t nt = 0;
    if (tokens) {
      // ---- kept slots (ascending): token cd[slot / S] * S + slot % S, logits reused from the candidates
      const int32_t* ks = pl.kept.data() + bh * KT;
      const int32_t* cd = pl.sel.data() + bh * N1;
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t sl = ks[j];
        tok[nt] = static_cast<int64_t>(cd[sl / S]) * S + sl % S;
        for (int64_t g = 0; g < G; ++g) lg[g * ldl + nt] = lgc[(bh * G + g) * ld_lgc + sl];
        ++nt;
      }
      attend_tokens(c, kern, bh, tok, nt, true, lg, ldl, part);
      return;
    }
    for (int64_t j = j0; j < j1; ++j) {
      int64_t page;
      if (r.mode == DENSE)
        page = j;
      else if (is_two)
        page = pl.sel[bh * N1 + pl.kept[bh * KT + j]];
      else
        page = pl.kept[bh * KT + j];
      const int64_t t0 = page * S, t1 = std::min(t0 + S, r.ntok);
      if (is_two) {  // reuse the candidates' logits
        const int64_t sl = pl.kept[bh * KT + j];
        for (int64_t g = 0; g < G; ++g) {
          const float* src = lgc + (bh * G + g) * ld_lgc + sl * S;
          std::memcpy(lg + g * ldl + nt, src, std::max<int64_t>(0, t1 - t0) * sizeof(float));
        }
      }
      for (int64_t t = t0; t < t1; ++t) tok[nt++] = t;
    }
    attend_tokens(c, kern, bh, tok, nt, is_two, lg, ldl, part);
  }

  // log-sum-exp merge of a row's chunks [i0, i1), normalised, cast to the output dtype
  void combine(int64_t bh, int64_t i0, int64_t i1) {
    float* acc = scratch_f<8>(Dp);
    for (int64_t g = 0; g < G; ++g) {
      float M = NEG_INF;
      for (int64_t i = i0; i < i1; ++i) M = std::max(M, parts[(i * G + g) * (Dp + 2)]);
      std::fill(acc, acc + Dp, 0.f);
      float l = 0.f;
      if (M > NEG_INF) {
        for (int64_t i = i0; i < i1; ++i) {
          const float* pg = parts + (i * G + g) * (Dp + 2);
          if (pg[0] == NEG_INF) continue;
          const float w = std::exp(pg[0] - M);
          l += w * pg[1];
          for (int64_t d = 0; d < Dp; ++d) acc[d] += w * pg[2 + d];
        }
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* od = out + (bh * G + g) * c.D;  // [B, Hq, 1, D] with hq = h*G + g
      if (kv_pairs_used<T>(c.D)) {  // accumulators in pair order: channel 2*VS*cc + 2l (+1) at 2*VS*cc + l (+VS)
        for (int64_t cc = 0; cc < c.D; cc += 2 * VS)
          for (int l2 = 0; l2 < VS; ++l2) {
            od[cc + 2 * l2] = static_cast<T>(acc[cc + l2] * inv);
            od[cc + 2 * l2 + 1] = static_cast<T>(acc[cc + VS + l2] * inv);
          }
      } else {
        for (int64_t d = 0; d < c.D; ++d) od[d] = static_cast<T>(acc[d] * inv);
      }
    }
  }
};

template <typename T, typename BT>
at::Tensor sparse_decode_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kmax,
                               const at::Tensor& kmin, const at::Tensor& kabs, const at::Tensor& valid_len,
                               const c10::optional<at::Tensor>& attn_mask, double scale, int64_t S, int64_t budget,
                               int64_t sinks, int64_t cf, int64_t extra, bool keep_tokens, bool force_dense) {
  TS_START();
  Ctx<T, BT> c;
  Plan& pl = thread_plan();
  build_ctx(c, q, k, v, kmax, kmin, kabs, valid_len, attn_mask, scale, S, budget, sinks, cf, extra, keep_tokens,
            force_dense, pl.qbuf);
  at::Tensor out = at::empty({c.B, c.Hq, 1, c.D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  Pipeline<T, BT> pipe(c, pl);
  pipe.out = out.data_ptr<T>();
  pipe.plan(true);
  TS_MARK(0, "setup");
  pipe.run();
  TS_MARK(1, "run");
  TS_DONE();
  return out;
}

template <typename T, typename BT>
at::Tensor kept_pages_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kmax, const at::Tensor& kmin,
                            const at::Tensor& kabs, const at::Tensor& valid_len,
                            const c10::optional<at::Tensor>& attn_mask, double scale, int64_t S, int64_t budget,
                            int64_t sinks, int64_t cf, int64_t extra, bool keep_tokens, bool force_dense) {
  Ctx<T, BT> c;
  Plan& pl = thread_plan();
  build_ctx(c, q, k, k, kmax, kmin, kabs, valid_len, attn_mask, scale, S, budget, sinks, cf, extra, keep_tokens,
            force_dense, pl.qbuf);
  Pipeline<T, BT> pipe(c, pl);
  pipe.plan(false);
  pipe.run();
  const int64_t BH = c.B * c.Hkv, KT = pipe.KT, N1 = pipe.N1;
  at::Tensor out = at::zeros({c.B, c.Hkv, c.P}, q.options().dtype(at::kBool));
  bool* o = out.data_ptr<bool>();
  for (int64_t bh = 0; bh < BH; ++bh) {
    const Row& r = c.rows[bh / c.Hkv];
    bool* ob = o + bh * c.P;
    const int32_t* kp = pl.kept.data() + bh * KT;
    const int32_t* cd = pl.sel.data() + bh * N1;
    if (r.mode == DENSE) {
      for (int64_t p = 0; p < r.nvalid; ++p) ob[p] = true;
    } else if (r.mode == ONE_STAGE) {
      for (int64_t j = 0; j < pl.keptcnt[bh]; ++j) ob[kp[j]] = true;
    } else if (r.mode == TWO_ALL || r.mode == TWO_TOPK) {
      // a kept candidate slot, or with keep_tokens the page of a kept token slot
      for (int64_t j = 0; j < pl.keptcnt[bh]; ++j) ob[cd[keep_tokens ? kp[j] / S : kp[j]]] = true;
    }
  }
  return out;
}

void check_decode_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kmax,
                       const at::Tensor& kmin, const at::Tensor& kabs, int64_t S, int64_t budget, int64_t sinks,
                       int64_t cf, int64_t extra, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "tinyserve.sparse_decode (native): q must be [B, Hq, 1, D]");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "tinyserve.sparse_decode (native): k_cache and v_cache must be ",
              "[B, Hkv, L, D] of one shape");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "tinyserve.sparse_decode (native): k_cache shape does not match q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "tinyserve.sparse_decode (native): k_cache and v_cache must have q's dtype");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "tinyserve.sparse_decode (native): CPU tensors only");
  TORCH_CHECK(k.size(3) == 0 || (k.stride(3) == 1 && v.stride(3) == 1),
              "tinyserve.sparse_decode (native): k_cache and v_cache need a unit stride on D");
  TORCH_CHECK(S > 0 && budget >= S && sinks >= 0 && cf >= 1 && scale > 0,
              "tinyserve.sparse_decode (native): bad selection arguments");
  TORCH_CHECK_VALUE(extra >= 0, "tinyserve.sparse_decode (native): argument 'candidate_extra' must be >= 0 (tokens), ",
                    "got ", extra);
  const int64_t P = (k.size(2) + S - 1) / S;
  TORCH_CHECK(kmax.dim() == 4 && kmax.size(0) == k.size(0) && kmax.size(1) == k.size(1) && kmax.size(2) == P &&
                  kmax.size(3) == k.size(3) && kmin.sizes() == kmax.sizes(),
              "tinyserve.sparse_decode (native): kmax/kmin must be [B, Hkv, P, D]");
  TORCH_CHECK(kmax.scalar_type() == kmin.scalar_type() &&
                  (kmax.scalar_type() == at::kFloat || kmax.scalar_type() == at::kBFloat16 ||
                   kmax.scalar_type() == at::kChar),
              "tinyserve.sparse_decode (native): kmax/kmin must be float32, bfloat16 or int8");
  TORCH_CHECK(kabs.dim() == 3 && kabs.size(0) == k.size(0) && kabs.size(1) == k.size(1) && kabs.size(2) == P &&
                  kabs.scalar_type() == at::kFloat,
              "tinyserve.sparse_decode (native): kabs must be float32 [B, Hkv, P]");
}

// ctrl[1] != 0: a dense layer; ctrl[0] != 0: the bounds are stale (never read them): attend densely either way
bool dense_flag(const c10::optional<at::Tensor>& ctrl) {
  if (!ctrl.has_value() || !ctrl->defined()) return false;
  TORCH_CHECK(ctrl->device().is_cpu() && ctrl->scalar_type() == at::kInt && ctrl->numel() >= 2,
              "tinyserve (native): ctrl must be an int32 CPU tensor of 2 elements");
  const int32_t* f = ctrl->contiguous().data_ptr<int32_t>();
  return f[0] != 0 || f[1] != 0;
}

at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                         const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask, double scale,
                         int64_t page_size, int64_t token_budget, int64_t sink_pages, int64_t candidate_factor,
                         const c10::optional<at::Tensor>& ctrl, int64_t candidate_extra, bool keep_tokens) {
  check_decode_args(q, k_cache, v_cache, kmax, kmin, kabs, page_size, token_budget, sink_pages, candidate_factor,
                    candidate_extra, scale);
  const bool dense = dense_flag(ctrl);
  const at::Tensor M = kmax.contiguous(), m = kmin.contiguous(), a = kabs.contiguous();
  at::Tensor out;
  dispatch_kv(q.scalar_type(), "tinyserve.sparse_decode (native)", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bt(M.scalar_type(), "tinyserve.sparse_decode (native)", [&](auto btag) {
      using BT = decltype(btag);
      out = sparse_decode_typed<T, BT>(q, k_cache, v_cache, M, m, a, valid_len, attn_mask, scale, page_size,
                                       token_budget, sink_pages, candidate_factor, candidate_extra, keep_tokens,
                                       dense);
    });
  });
  return out;
}

at::Tensor kept_pages(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin,
                      const at::Tensor& kabs, const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask,
                      double scale, int64_t page_size, int64_t token_budget, int64_t sink_pages,
                      int64_t candidate_factor, const c10::optional<at::Tensor>& ctrl, int64_t candidate_extra,
                      bool keep_tokens) {
  check_decode_args(q, k_cache, k_cache, kmax, kmin, kabs, page_size, token_budget, sink_pages, candidate_factor,
                    candidate_extra, scale);
  const bool dense = dense_flag(ctrl);
  const at::Tensor M = kmax.contiguous(), m = kmin.contiguous(), a = kabs.contiguous();
  at::Tensor out;
  dispatch_kv(q.scalar_type(), "tinyserve.kept_pages (native)", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bt(M.scalar_type(), "tinyserve.kept_pages (native)", [&](auto btag) {
      using BT = decltype(btag);
      out = kept_pages_typed<T, BT>(q, k_cache, M, m, a, valid_len, attn_mask, scale, page_size, token_budget,
                                    sink_pages, candidate_factor, candidate_extra, keep_tokens, dense);
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------------------
// page bounds
// ------------------------------------------------------------------------------------------------------------

// bfloat16 rounded outward: up for the max, down for the min (the score stays an upper bound)
inline float round_up_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0xFFFFu) == 0) return x;
  if (x > 0.f)
    bits = (bits + 0x10000u) & 0xFFFF0000u;
  else
    bits &= 0xFFFF0000u;
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
}
inline float round_down_bf16(float x) { return -round_up_bf16(-x); }

// int8 code c in [-127, 127]: the smallest c with c * step >= x (up) or the largest with c * step <= x
// (reference._int8_codes). The division is rounded once, so ceil/floor is off by at most one either way: one
// check of each neighbour corrects it. fp32 throughout; NaN gives 0 (as torch's clamp then cast on x86), +-inf
// saturate.
inline int8_t int8_code(float x, float step, bool up) {
  float c = up ? std::ceil(x / step) : std::floor(x / step);
  if (up) {
    if ((c - 1.f) * step >= x) c -= 1.f;
    if (c * step < x) c += 1.f;
  } else {
    if ((c + 1.f) * step <= x) c += 1.f;
    if (c * step > x) c -= 1.f;
  }
  if (std::isnan(c)) return 0;
  return static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
}

// bounds of pages [p0, p1) of one (batch, KV head), every slot of a page inside the cache
template <typename T, typename BT>
void bound_pages(const T* kb, int64_t ksl, int64_t L, int64_t D, int64_t S, int64_t p0, int64_t p1, BT* M, BT* m,
                 float* kab) {
  float* hi = scratch_f<8>(2 * D);
  float* lo = hi + D;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t t0 = p * S, t1 = std::min(t0 + S, L);
    // ---- channel-wise max and min (NaN propagates, as amax/amin)
    {
      const T* r = kb + t0 * ksl;
      int64_t i = 0;
      for (; i + VS <= D; i += VS) loadf(r + i).store(hi + i);
      for (; i < D; ++i) hi[i] = static_cast<float>(r[i]);
      std::memcpy(lo, hi, D * sizeof(float));
    }
    for (int64_t t = t0 + 1; t < t1; ++t) {
      const T* r = kb + t * ksl;
      int64_t i = 0;
      for (; i + VS <= D; i += VS) {
        const Vec x = loadf(r + i);
        at::vec::maximum(Vec::loadu(hi + i), x).store(hi + i);
        at::vec::minimum(Vec::loadu(lo + i), x).store(lo + i);
      }
      for (; i < D; ++i) {
        const float x = static_cast<float>(r[i]);
        hi[i] = (std::isnan(x) || x > hi[i]) ? x : hi[i];
        lo[i] = (std::isnan(x) || x < lo[i]) ? x : lo[i];
      }
    }
    if constexpr (std::is_same_v<BT, int8_t>) {
      // ---- int8: kabs = the exact max |k| of the page, then the codes on its grid (reference.store_bounds)
      float a = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < D; ++i) {
        const float ab = std::max(std::fabs(hi[i]), std::fabs(lo[i]));
        nan |= std::isnan(ab);
        a = std::max(a, ab);
      }
      if (nan) a = std::numeric_limits<float>::quiet_NaN();
      const float step = int8_step(a);
      for (int64_t i = 0; i < D; ++i) {
        M[p * D + i] = int8_code(hi[i], step, true);
        m[p * D + i] = int8_code(lo[i], step, false);
      }
      kab[p] = a;
      continue;
    }
    // ---- stored format, then kabs from the stored values
    float a = 0.f;
    bool nan = false;
    for (int64_t i = 0; i < D; ++i) {
      float x = hi[i], y = lo[i];
      if constexpr (std::is_same_v<BT, c10::BFloat16>) {
        x = round_up_bf16(x);
        y = round_down_bf16(y);
        M[p * D + i] = c10::BFloat16(x);  // exact: low 16 bits are zero
        m[p * D + i] = c10::BFloat16(y);
      } else if constexpr (std::is_same_v<BT, float>) {
        M[p * D + i] = x;
        m[p * D + i] = y;
      }
      const float ab = std::max(std::fabs(x), std::fabs(y));
      nan |= std::isnan(ab);
      a = std::max(a, ab);
    }
    kab[p] = nan ? std::numeric_limits<float>::quiet_NaN() : a;
  }
}

void check_bounds_args(const at::Tensor& k, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                       int64_t S) {
  TORCH_CHECK(S > 0, "tinyserve (native): page_size must be positive");
  TORCH_CHECK(k.dim() == 4 && k.device().is_cpu(), "tinyserve (native): k_cache must be a CPU [B, Hkv, L, D] tensor");
  TORCH_CHECK(k.size(3) == 0 || k.stride(3) == 1, "tinyserve (native): k_cache needs a unit stride on D");
  const int64_t P = (k.size(2) + S - 1) / S;
  TORCH_CHECK(kmax.dim() == 4 && kmax.size(0) == k.size(0) && kmax.size(1) == k.size(1) && kmax.size(2) == P &&
                  kmax.size(3) == k.size(3) && kmin.sizes() == kmax.sizes() && kmax.is_contiguous() &&
                  kmin.is_contiguous(),
              "tinyserve (native): kmax/kmin must be contiguous [B, Hkv, P, D]");
  TORCH_CHECK(kmax.scalar_type() == kmin.scalar_type() &&
                  (kmax.scalar_type() == at::kFloat || kmax.scalar_type() == at::kBFloat16 ||
                   kmax.scalar_type() == at::kChar),
              "tinyserve (native): kmax/kmin must be float32, bfloat16 or int8");
  TORCH_CHECK(kabs.dim() == 3 && kabs.size(0) == k.size(0) && kabs.size(1) == k.size(1) && kabs.size(2) == P &&
                  kabs.scalar_type() == at::kFloat && kabs.is_contiguous(),
              "tinyserve (native): kabs must be contiguous float32 [B, Hkv, P]");
}

// pages: ascending page list, or nullptr for every page
void bounds_for_pages(const at::Tensor& k, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                      int64_t S, const std::vector<int64_t>* pages) {
  const int64_t B = k.size(0), H = k.size(1), L = k.size(2), D = k.size(3), P = (L + S - 1) / S;
  if (B * H == 0 || P == 0) return;
  dispatch_kv(k.scalar_type(), "tinyserve.bounds (native)", [&](auto tag) {
    using T = decltype(tag);
    auto body = [&](auto* Mp, auto* mp) {
      using BT = std::remove_pointer_t<decltype(Mp)>;
      const T* kd = k.data_ptr<T>();
      float* ka = kabs.data_ptr<float>();
      const int64_t sb = k.stride(0), sh = k.stride(1), sl = k.stride(2);
      if (pages == nullptr) {
        const int64_t ch = std::max<int64_t>(16, (P + 3) / 4);
        const int64_t nch = (P + ch - 1) / ch;
        run_items(B * H * nch, [&](int64_t i) {
          const int64_t bh = i / nch, c0 = (i % nch) * ch;
          const T* kb = kd + (bh / H) * sb + (bh % H) * sh;
          bound_pages<T, BT>(kb, sl, L, D, S, c0, std::min(P, c0 + ch), Mp + bh * P * D, mp + bh * P * D,
                             ka + bh * P);
        });
      } else {
        const int64_t np = static_cast<int64_t>(pages->size());
        if (np == 0) return;
        auto one = [&](int64_t i) {
          const int64_t bh = i / np, p = (*pages)[i % np];
          const T* kb = kd + (bh / H) * sb + (bh % H) * sh;
          bound_pages<T, BT>(kb, sl, L, D, S, p, p + 1, Mp + bh * P * D, mp + bh * P * D, ka + bh * P);
        };
        if (B * H * np * S * D < (1 << 16)) {
          for (int64_t i = 0; i < B * H * np; ++i) one(i);  // a decode step: too little work to fork
        } else {
          run_items(B * H * np, one);
        }
      }
    };
    dispatch_bt(kmax.scalar_type(), "tinyserve.bounds (native)", [&](auto btag) {
      using BT = decltype(btag);
      body(kmax.data_ptr<BT>(), kmin.data_ptr<BT>());
    });
  });
}

void rebuild_bounds(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                    int64_t page_size) {
  check_bounds_args(k_cache, kmax, kmin, kabs, page_size);
  bounds_for_pages(k_cache, kmax, kmin, kabs, page_size, nullptr);
}

void cache_write(const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                 const at::Tensor& ctrl, const at::Tensor& positions, const at::Tensor& src, int64_t page_size) {
  check_bounds_args(k_cache, kmax, kmin, kabs, page_size);
  TORCH_CHECK(ctrl.device().is_cpu() && ctrl.scalar_type() == at::kInt && ctrl.numel() >= 1 && ctrl.is_contiguous(),
              "tinyserve.cache_write (native): ctrl must be a contiguous int32 CPU tensor");
  TORCH_CHECK_VALUE(at::isIntegralType(positions.scalar_type(), /*includeBool=*/false),
                    "tinyserve.cache_write: argument 'positions' must be an integer tensor, got ",
                    positions.scalar_type());
  // ---- the write itself (positions: 0-d, [1] or [n], any integer dtype)
  at::Tensor pos = positions.reshape({-1}).to(at::kLong);
  at::Tensor kc = k_cache;
  kc.index_copy_(2, pos, src);
  // ---- bounds: everything when flagged stale, else the touched pages
  int32_t* flag = ctrl.data_ptr<int32_t>();
  if (flag[0] != 0) {
    bounds_for_pages(k_cache, kmax, kmin, kabs, page_size, nullptr);
    flag[0] = 0;
    return;
  }
  const int64_t P = kmax.size(2);
  at::Tensor pc = pos.contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  std::vector<int64_t> pages;
  pages.reserve(pc.numel());
  for (int64_t i = 0; i < pc.numel(); ++i) {
    const int64_t p = pp[i] >= 0 ? pp[i] / page_size : -1;
    if (p >= 0 && p < P) pages.push_back(p);
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  bounds_for_pages(k_cache, kmax, kmin, kabs, page_size, &pages);
}

}  // namespace
}  // namespace tinyserve_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_decode", &tinyserve_native::sparse_decode, "query-aware paged sparse decode attention");
  m.def("kept_pages", &tinyserve_native::kept_pages, "the pages sparse_decode attends, bool [B, Hkv, P]");
  m.def("cache_write", &tinyserve_native::cache_write, "key write plus the bounds of the touched pages");
  m.def("rebuild_bounds", &tinyserve_native::rebuild_bounds, "every page's bounds");
}
