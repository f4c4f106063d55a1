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
//
// Files: simd.h (vector helpers, grow-only scratch), profile.h (-DTS_PROFILE stage timing), dtypes.h (dtype
// dispatch), context.h (mask view, per-call context), microkernels.h (blocked dots, bound scores, value sums),
// radix_select.h (partial top-K), pool.h/pool.cpp (work lists, thread pool), pipeline.h and this file (the
// sparse decode pipeline: score, select, rank, attend, combine), bounds.h/bounds.cpp (page bounds), module.cpp
// (Python bindings). Each .cpp is its own translation unit; the headers define templates and inline functions
// in namespace tinyserve_native, so the pool and the per-thread scratch buffers are shared by all of them.

#include "context.h"
#include "dtypes.h"
#include "microkernels.h"
#include "pipeline.h"
#include "pool.h"
#include "profile.h"
#include "radix_select.h"
#include "simd.h"

namespace tinyserve_native {
namespace {

// ------------------------------------------------------------------------------------------------------------
// stage 1: page scores (bound scan) for pages [p0, p1) of one (batch, KV head)
// ------------------------------------------------------------------------------------------------------------

template <typename T, typename BT>
void score_pages(const Ctx<T, BT>& c, const Kern& kern, int64_t bh, int64_t p0, int64_t p1, float* out) {
  const int64_t b = bh / c.Hkv, h = bh % c.Hkv, D = c.D, Dp = c.Dp, G = c.G, S = c.S;
  const BT* M = c.kmax + bh * c.P * D;  // page p's bounds at M + p * D
  const BT* m = c.kmin + bh * c.P * D;
  const float* kab = c.kabs + bh * c.P;
  if (c.pid) {
    // ---- a page table: the bounds of pages [p0, p1) gathered by physical page id to rows p0..p1 of a scratch
    BT* gM = reinterpret_cast<BT*>(scratch_f<20>((2 * p1 * D * sizeof(BT) + sizeof(float) - 1) / sizeof(float)));
    float* gk = scratch_f<21>(p1);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t row = c.bound_row(bh, p);
      std::memcpy(gM + p * D, c.kmax + row * D, D * sizeof(BT));
      std::memcpy(gM + (p1 + p) * D, c.kmin + row * D, D * sizeof(BT));
      gk[p] = c.kabs[row];
    }
    M = gM;
    m = gM + p1 * D;
    kab = gk;
  }
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
    if constexpr (std::is_same_v<BT, int8_t>) {
      if (kern.bound8 != nullptr && Dp == D) {
        // ---- int8 codes read in place and decoded in registers, every head of the group at once
        float* rb = scratch_f<9>(G * VS * (VS + 1));
        kern.bound8(M + p * D, m + p * D, kab + p, n, qp, qn, G, rb + G * VS, rb);
        store_block(p, n, [&](int64_t g) { return Vec::loadu(rb + g * VS); });
        continue;
      }
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
      for (int64_t t = tp; t < std::min(T_, tp + VS); ++t) prefetch_row(kb + tok[t] * ksl, row_bytes, PF_LOCALITY);
      for (int j = 0; j < n; ++j) prefetch_row(vb + tok[t0 + j] * vsl, row_bytes, 1);
      key_dots<T>(kern, kb, ksl, tok + t0, n, D, Dp, scr, qs, G, lg + t0, ldl, pairs, c.q16_of(bh));
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
    for (int64_t t = tp; t < std::min(T_, tp + VS); ++t) prefetch_row(vb + tok[t] * vsl, row_bytes, PF_LOCALITY);
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
               const c10::optional<at::Tensor>& attn_mask, double scale, const Spec& full_spec, bool force_dense,
               std::vector<float>& qbuf, const PageTable* pt = nullptr) {
  const int64_t S = full_spec.page_size;
  // sizes bounded by the cache (kept pages, candidates and their buffers), selecting the same
  const Spec spec = full_spec.for_cache(((pt ? pt->pages * S : k.size(2)) + S - 1) / S);
  c.B = q.size(0);
  c.Hq = q.size(1);
  c.D = q.size(3);
  c.Hkv = k.size(1);
  c.L = pt ? pt->pages * S : k.size(2);  // a page table: pt->pages pages per row of a paged buffer [N, Hkv, D]
  c.G = c.Hq / c.Hkv;
  c.S = S;
  c.P = (c.L + S - 1) / S;
  c.K = spec.n_pages();
  c.cf = spec.candidate_factor;
  c.n1 = spec.n_candidates();
  c.keep_tokens = spec.keep_tokens;
  c.sinks = spec.sink_pages;
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
  if (pt) {  // rows of the paged buffer: no batch offset, buffer row r of KV head h at r * stride(0) + h * stride(1)
    c.ksb = c.vsb = 0;
    c.ksl = k.stride(0);
    c.vsl = v.stride(0);
    c.prow = pt->rows;
    c.pid = pt->ids;
    c.pstride = pt->stride;
  }
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
#if TS_DPBF16
  // ---- q * scale in bf16 for the dot-product logits, where every value is exact (else the pair kernel)
  c.qs16 = nullptr;
  if (kv_pairs_used<T>(D)) {
    thread_local std::vector<c10::BFloat16> qbuf16;  // read during this call only
    qbuf16.resize(BH * G * D);
    bool exact = true;
    for (int64_t r = 0; r < BH * G && exact; ++r)
      for (int64_t d = 0; d < D; ++d) {
        const c10::BFloat16 h(qs[r * Dp + d]);
        exact = exact && static_cast<float>(h) == qs[r * Dp + d];
        qbuf16[r * D + d] = h;
      }
    if (exact) c.qs16 = qbuf16.data();
  }
#endif
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
  // a row whose valid pages all fit in the budget or are all candidates attends densely (SelectionSpec.n_dense_pages)
  const int64_t n_dense = spec.n_dense_pages();
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t n = vlp[vl.numel() == 1 ? 0 : b];
    Row r;
    r.ntok = std::max<int64_t>(0, std::min(n, c.L));
    r.nvalid = n > 0 ? std::min((n + S - 1) / S, c.P) : 0;
    r.newest = n > 0 && (n - 1) / S < c.P ? (n - 1) / S : -1;
    if (r.nvalid == 0 || r.ntok == 0)
      r.mode = EMPTY;
    else if (force_dense || r.nvalid <= n_dense)
      r.mode = DENSE;
    else if (c.n1 <= c.K)
      r.mode = ONE_STAGE;
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
  static bool two(int m) { return m == TWO_TOPK; }

  // ---- the task list and buffers; with_attend = false stops after the selection (kept_pages)
  void plan(bool with_attend) {
    // entries past a row's selcnt / keptcnt are never read: no clearing (196 KB a call at batch 8)
    pl.sel.resize(BH * std::max<int64_t>(N1, 1));
    pl.selcnt.assign(BH, 0);
    pl.kept.resize(BH * std::max<int64_t>(KT, 1));
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
      for (int64_t bh = 0; bh < BH; ++bh)
        if (two(mode(bh))) total += N1;  // a row with at most N1 valid pages is dense
      const int64_t ch = chunk_size(total, 16, VS);
      for (int64_t bh = 0; bh < BH; ++bh)
        if (two(mode(bh))) chunks(T_CAND, bh, N1, ch, cand_left);
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
      const int64_t t0 = static_cast<int64_t>(cd[j]) * S, r0 = c.page_row(b, cd[j]);  // r0 == t0 without a page table
      int64_t* tj = tok + (j - j0) * S;
      for (int64_t u = 0; u < S; ++u) tj[u] = t0 + u < r.ntok ? r0 + u : -1;
    }
    // logits straight into the slots, VS slots at a time (a slot past the valid tokens reads a zero row)
    float* xb = lgc + bh * G * ld_lgc + s0;
    int64_t tk[VS];
    for (int64_t s1 = 0; s1 < ns; s1 += VS) {
      const int n = static_cast<int>(std::min<int64_t>(VS, ns - s1));
      const int64_t sp = s1 + PF_BLOCKS * VS;
      for (int64_t sl = sp; sl < std::min(ns, sp + VS); ++sl)
        if (tok[sl] >= 0) prefetch_row(kb + tok[sl] * c.ksl, row_bytes, PF_LOCALITY);
      int nvld = 0;
      while (nvld < n && tok[s1 + nvld] >= 0) ++nvld;  // invalid slots only at the end (newest page)
      if (nvld == n) {
        key_dots<T>(kern, kb, c.ksl, tok + s1, n, D, Dp, scr, qs, G, xb + s1, ld_lgc, pairs, c.q16_of(bh));
      } else {
        for (int j = 0; j < nvld; ++j) tk[j] = tok[s1 + j];
        // rows past nvld are zero (padding): their logits are set to -inf below
        key_dots<T>(kern, kb, c.ksl, tk, nvld, D, Dp, scr, qs, G, xb + s1, ld_lgc, pairs, c.q16_of(bh));
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
      if (!forced && (p + 1) * S <= r.ntok) continue;  // a whole page, not forced: nothing to set
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
      const int64_t b = bh / c.Hkv;
      // slot sl is token sl - base of candidate page ci (base = ci * S); the slots ascend, so ci only moves forward
      // (no division per token)
      int64_t ci = ks[j0] / S, base = ci * S, row = c.page_row(b, cd[ci]);
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t sl = ks[j];
        if (sl >= base + S) {
          ci = sl / S;
          base = ci * S;
          row = c.page_row(b, cd[ci]);
        }
        tok[nt] = row + (sl - base);
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
      const int64_t shift = c.page_row(bh / c.Hkv, page) - t0;  // cache row - token: 0 without a page table
      if (is_two) {  // reuse the candidates' logits
        const int64_t sl = pl.kept[bh * KT + j];
        for (int64_t g = 0; g < G; ++g) {
          const float* src = lgc + (bh * G + g) * ld_lgc + sl * S;
          std::memcpy(lg + g * ldl + nt, src, std::max<int64_t>(0, t1 - t0) * sizeof(float));
        }
      }
      for (int64_t t = t0; t < t1; ++t) tok[nt++] = t + shift;
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
                               const c10::optional<at::Tensor>& attn_mask, double scale, const Spec& spec,
                               bool force_dense, const PageTable* pt = nullptr) {
  TS_START();
  Ctx<T, BT> c;
  Plan& pl = thread_plan();
  build_ctx(c, q, k, v, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, force_dense, pl.qbuf, pt);
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
                            const c10::optional<at::Tensor>& attn_mask, double scale, const Spec& spec,
                            bool force_dense) {
  const int64_t S = spec.page_size;
  Ctx<T, BT> c;
  Plan& pl = thread_plan();
  build_ctx(c, q, k, k, kmax, kmin, kabs, valid_len, attn_mask, scale, spec, force_dense, pl.qbuf);
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
    } else if (r.mode == TWO_TOPK) {
      // a kept candidate slot, or with keep_tokens the page of a kept token slot
      for (int64_t j = 0; j < pl.keptcnt[bh]; ++j) ob[cd[spec.keep_tokens ? kp[j] / S : kp[j]]] = true;
    }
  }
  return out;
}

void check_decode_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kmax,
                       const at::Tensor& kmin, const at::Tensor& kabs, const Spec& spec, double scale) {
  const int64_t S = spec.page_size, extra = spec.candidate_extra;
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
  TORCH_CHECK(S > 0 && spec.token_budget >= S && spec.sink_pages >= 0 && spec.candidate_factor >= 1 && scale > 0,
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

}  // namespace

at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                         const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask, double scale,
                         const Spec& spec, const c10::optional<at::Tensor>& ctrl) {
  check_decode_args(q, k_cache, v_cache, kmax, kmin, kabs, spec, scale);
  const bool dense = dense_flag(ctrl);
  const at::Tensor M = kmax.contiguous(), m = kmin.contiguous(), a = kabs.contiguous();
  at::Tensor out;
  dispatch_kv(q.scalar_type(), "tinyserve.sparse_decode (native)", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bt(M.scalar_type(), "tinyserve.sparse_decode (native)", [&](auto btag) {
      using BT = decltype(btag);
      out = sparse_decode_typed<T, BT>(q, k_cache, v_cache, M, m, a, valid_len, attn_mask, scale, spec, dense);
    });
  });
  return out;
}

at::Tensor kept_pages(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& kmax, const at::Tensor& kmin,
                      const at::Tensor& kabs, const at::Tensor& valid_len, const c10::optional<at::Tensor>& attn_mask,
                      double scale, const Spec& spec, const c10::optional<at::Tensor>& ctrl) {
  check_decode_args(q, k_cache, k_cache, kmax, kmin, kabs, spec, scale);
  const bool dense = dense_flag(ctrl);
  const at::Tensor M = kmax.contiguous(), m = kmin.contiguous(), a = kabs.contiguous();
  at::Tensor out;
  dispatch_kv(q.scalar_type(), "tinyserve.kept_pages (native)", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bt(M.scalar_type(), "tinyserve.kept_pages (native)", [&](auto btag) {
      using BT = decltype(btag);
      out = kept_pages_typed<T, BT>(q, k_cache, M, m, a, valid_len, attn_mask, scale, spec, dense);
    });
  });
  return out;
}

at::Tensor sparse_decode_table(const at::Tensor& q, const at::Tensor& k_tokens, const at::Tensor& v_tokens,
                               const at::Tensor& kmax, const at::Tensor& kmin, const at::Tensor& kabs,
                               const at::Tensor& seq_lens, const PageTable& pt, double scale, const Spec& spec) {
  at::Tensor out;
  dispatch_kv(q.scalar_type(), "tinyserve.paged_sparse_decode (native)", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bt(kmax.scalar_type(), "tinyserve.paged_sparse_decode (native)", [&](auto btag) {
      using BT = decltype(btag);
      out = sparse_decode_typed<T, BT>(q, k_tokens, v_tokens, kmax, kmin, kabs, seq_lens, c10::nullopt, scale, spec,
                                       false, &pt);
    });
  });
  return out;
}

}  // namespace tinyserve_native
