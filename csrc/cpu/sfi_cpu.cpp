// SFI's slow-step work on the CPU build, every slow row of a layer in one call: the dense pass with
// evidence over CPU_ATTN's packed pages (attention output, evidence and key norms from one set of
// scores) and the closed-form selector over each request's allowed set (ALGORITHMS.md §1).
// Twins: vllm_ext.kernels.dense_decode_evidence.dense_decode_with_evidence_cpu and
// vllm_ext.kernels.sfi_selector_cpu.select_rows; tests/kernels/test_cpu_native.py compares them.
//
// Registered as the torch operators torch.ops.speedsfi.sfi_evidence and
// torch.ops.speedsfi.sfi_select_rows (CPU kernels at the end of this file; their fake
// implementations for torch.compile are registered in Python). Built once per machine by
// vllm_ext/kernels/cpu_native.py (g++ -O3 -march=native against torch's headers, cached) and loaded
// with torch.ops.load_library. Every loop over positions is written so that the compiler vectorises
// it: exp and log are branch-free polynomials (Cephes' single-precision coefficients, about 1 ulp)
// instead of libm calls, and conditions are selects.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "gather_rows.h"
#include "page_views.h"

namespace {

// log-sum-exp of x[0, n): -inf when every term is -inf (or n == 0)
float lse(const float* x, int64_t n) {
  const float m = max_v(x, n);
  if (!(m > kNegInf)) return kNegInf;
  float* e = scratch_floats(n);
  exp_shifted(x, m, e, n);
  return m + std::log(sum_v(e, n));
}

// x - lse(x) over [0, n) in place (-inf everywhere when lse is -inf)
void normalize(float* x, int64_t n) {
  float z = lse(x, n);
  if (!(z > kNegInf)) {
    for (int64_t i = 0; i < n; ++i) x[i] = kNegInf;
    return;
  }
  for (int64_t i = 0; i < n; ++i) x[i] -= z;
}

// f[i] <- logaddexp(ca + f[i], cb + r[i]) (the fusion in log space; -inf + -inf = -inf). Three loops:
// GCC vectorises exp and log in separate loops, not one loop holding both.
void fuse(float* __restrict f, const float* __restrict r, float ca, float cb, int64_t n,
          float* __restrict e) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = ca + f[i], b = cb + r[i];
    const float mx = a > b ? a : b, mn = a > b ? b : a;
    e[i] = mn - mx;                                               // NaN when both are -inf: not used
    f[i] = mx;
  }
  for (int64_t i = 0; i < n; ++i) e[i] = vexp(e[i]);
  for (int64_t i = 0; i < n; ++i) {
    const float t = f[i] + vlog(1.0f + e[i]);
    f[i] = f[i] > kNegInf ? t : kNegInf;
  }
}

// out[i] = max x[i - left .. i + right] within [0, n), by doubling: log2(window) passes of
// y[k] = max(y[k], y[k + span]) over a -inf padded copy, each a vectorised loop
void window_max(const float* x, float* out, int64_t n, int left, int right) {
  const int64_t w = static_cast<int64_t>(left) + right + 1;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n + w - 1) buf.resize(n + w - 1);
  float* y = buf.data();                              // y[k] = x[k - left]
  std::fill(y, y + left, kNegInf);
  std::fill(y + left + n, y + n + w - 1, kNegInf);
  std::memcpy(y + left, x, n * sizeof(float));
  int64_t len = n + w - 1, span = 1;                  // y[k] = max of y0[k .. k + span - 1]
  while (span * 2 <= w) {
    len -= span;
    for (int64_t k = 0; k < len; ++k) y[k] = std::max(y[k], y[k + span]);
    span *= 2;
  }
  const int64_t rest = w - span;                      // 0 <= rest < span: one more overlapping pass
  for (int64_t i = 0; i < n; ++i) out[i] = std::max(y[i], y[i + rest]);
}

constexpr int kMaxG = 8;

// One page's scores s[g * seq + t] = scale * q_g . k_t and norms kn[t] = ||k_t|| (t < nt; norms t < nk).
// Any block size and group: runtime loops over a converted row of K^T.
template <typename T>
void score_block(const T* page, int bs, int d, int g, const float* qh, float scale, float* s, int64_t seq,
                 int64_t nt, float* kn, int64_t nk, float* acc, float* nrm, float* krow) {
  std::fill(acc, acc + static_cast<int64_t>(g) * bs, 0.0f);
  std::fill(nrm, nrm + bs, 0.0f);
  for (int dd = 0; dd < d; ++dd) {                        // K^T: row dd holds bs positions
    const T* kr = page + static_cast<int64_t>(dd) * bs;
    for (int t = 0; t < bs; ++t) krow[t] = load(kr + t);
    for (int t = 0; t < bs; ++t) nrm[t] += krow[t] * krow[t];
    for (int gg = 0; gg < g; ++gg) {
      const float qv = qh[static_cast<int64_t>(gg) * d + dd];
      float* a = acc + static_cast<int64_t>(gg) * bs;
      for (int t = 0; t < bs; ++t) a[t] += qv * krow[t];
    }
  }
  for (int gg = 0; gg < g; ++gg)
    for (int64_t t = 0; t < nt; ++t) s[gg * seq + t] = acc[gg * bs + t] * scale;
  if (kn != nullptr)
    for (int64_t t = 0; t < nk; ++t) kn[t] = std::sqrt(nrm[t]);
}

// The same for block sizes that are multiples of 16 and groups up to 8: 16 positions at a time in
// registers (score_cols16), the group's accumulators held over the whole head dimension; 4x faster
// than the loops above, which the compiler vectorises per row of K^T and spills between rows.
template <typename T, int G>
void score_block_g(const T* page, int bs, int d, const float* qh, float scale, float* s, int64_t seq,
                   int64_t nt, float* kn, int64_t nk) {
  float sc[G * 16], nr[16];
  for (int64_t t0 = 0; t0 < nt; t0 += 16) {
    if (kn != nullptr) score_cols16<T, G, true>(page, bs, d, t0, qh, sc, nr);
    else score_cols16<T, G, false>(page, bs, d, t0, qh, sc, nr);
    const int64_t m = std::min<int64_t>(16, nt - t0);
    for (int gg = 0; gg < G; ++gg)
      for (int64_t t = 0; t < m; ++t) s[gg * seq + t0 + t] = sc[gg * 16 + t] * scale;
    if (kn != nullptr)
      for (int64_t t = 0; t < std::min<int64_t>(16, nk - t0); ++t) kn[t0 + t] = std::sqrt(nr[t]);
  }
}

template <typename T>
void score_block_fixed(const T* page, int bs, int d, int g, const float* qh, float scale, float* s,
                       int64_t seq, int64_t nt, float* kn, int64_t nk) {
  switch (g) {
    case 1: score_block_g<T, 1>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    case 2: score_block_g<T, 2>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    case 3: score_block_g<T, 3>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    case 4: score_block_g<T, 4>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    case 5: score_block_g<T, 5>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    case 6: score_block_g<T, 6>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    case 7: score_block_g<T, 7>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
    default: score_block_g<T, 8>(page, bs, d, qh, scale, s, seq, nt, kn, nk); break;
  }
}

// acc[g, :] += sum_t w[g, t] v_t over the request's V pages, head dimensions that are multiples of 16
// up to kMaxD and groups up to kMaxG, a page at a time with the accumulators in registers
// (accumulate_weighted; 4x faster than attend_rows() below).
constexpr int kMaxD = 128;

template <typename T, int G, int NV>
void attend_rows_g(const T* v_base, int64_t s_block, int64_t h_off, int bs, const int32_t* blocks, int64_t nb,
                   int64_t seq, const float* w, float* acc) {
  constexpr int D = NV * kLanes;
  for (int64_t j = 0; j < nb; ++j) {
    const T* page = v_base + static_cast<int64_t>(blocks[j]) * s_block + h_off;
    if (j + 1 < nb) prefetch_bytes(v_base + static_cast<int64_t>(blocks[j + 1]) * s_block + h_off, sizeof(T) * bs * D);
    const int64_t p0 = j * bs;
    accumulate_weighted<T, G, D>(page, D, std::min<int64_t>(bs, seq - p0), w + p0, seq, acc);
  }
}

// The same for any head size and group: runtime loops (acc [G, D] accumulated in memory).
template <typename T>
void attend_rows(const T* v_base, int64_t s_block, int64_t h_off, int bs, int d, int g, const int32_t* blocks,
                 int64_t nb, int64_t seq, const float* w, float* acc) {
  for (int64_t j = 0; j < nb; ++j) {
    const T* page = v_base + static_cast<int64_t>(blocks[j]) * s_block + h_off;
    const int64_t p0 = j * bs;
    const int64_t nt = std::min<int64_t>(bs, seq - p0);
    for (int64_t t = 0; t < nt; ++t)
      for (int gg = 0; gg < g; ++gg) {
        const float wt = w[gg * seq + p0 + t];
        float* a = acc + static_cast<int64_t>(gg) * d;
        for (int dd = 0; dd < d; ++dd) a[dd] += wt * load(page + t * d + dd);
      }
  }
}

template <typename T, int G>
void attend_rows_d(const T* v_base, int64_t s_block, int64_t h_off, int bs, int d, const int32_t* blocks,
                   int64_t nb, int64_t seq, const float* w, float* acc) {
  switch (d / kLanes) {
    case 1: attend_rows_g<T, G, 1>(v_base, s_block, h_off, bs, blocks, nb, seq, w, acc); break;
    case 2: attend_rows_g<T, G, 2>(v_base, s_block, h_off, bs, blocks, nb, seq, w, acc); break;
    case 4: attend_rows_g<T, G, 4>(v_base, s_block, h_off, bs, blocks, nb, seq, w, acc); break;
    case 8: attend_rows_g<T, G, 8>(v_base, s_block, h_off, bs, blocks, nb, seq, w, acc); break;
    default: attend_rows(v_base, s_block, h_off, bs, d, G, blocks, nb, seq, w, acc);   // 48, 80, 96, 112
  }
}

template <typename T>
void attend_rows_fixed(const T* v_base, int64_t s_block, int64_t h_off, int bs, int d, int g,
                       const int32_t* blocks, int64_t nb, int64_t seq, const float* w, float* acc) {
  switch (g) {
    case 1: attend_rows_d<T, 1>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    case 2: attend_rows_d<T, 2>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    case 3: attend_rows_d<T, 3>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    case 4: attend_rows_d<T, 4>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    case 5: attend_rows_d<T, 5>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    case 6: attend_rows_d<T, 6>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    case 7: attend_rows_d<T, 7>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
    default: attend_rows_d<T, 8>(v_base, s_block, h_off, bs, d, blocks, nb, seq, w, acc); break;
  }
}

// out[i] = (log sum_g exp(x[g * stride + i]) - log G) / alpha over [0, n): the power mean of the
// group's alpha * log p (x), as a log. Separate loops over restrict-qualified buffers, so that each
// vectorises (m: the running maximum, e: the sum).
void power_mean(const float* x, int64_t stride, int g, int64_t n, float alpha, float log_g,
                float* __restrict out, float* __restrict tmp) {
  float* __restrict m = tmp;
  float* __restrict e = tmp + n;
  for (int64_t i = 0; i < n; ++i) m[i] = kNegInf;
  for (int gg = 0; gg < g; ++gg) {
    const float* __restrict xg = x + gg * stride;
    for (int64_t i = 0; i < n; ++i) m[i] = xg[i] > m[i] ? xg[i] : m[i];
  }
  for (int64_t i = 0; i < n; ++i) e[i] = 0.0f;
  for (int gg = 0; gg < g; ++gg) {
    const float* __restrict xg = x + gg * stride;
    int64_t i = 0;
    for (; i + kRegLanes <= n; i += kRegLanes) store_r(e + i, load_r(e + i) + vexp_r(load_r(xg + i) - load_r(m + i)));
    for (; i < n; ++i) e[i] += vexp(xg[i] - m[i]);
  }
  for (int64_t i = 0; i < n; ++i) out[i] = (vlog(e[i]) + m[i] - log_g) / alpha;
}

// The group's dense attention of one KV head over positions [0, seq) from its scores s [G, seq]:
// out[g, :] = sum_t softmax(s[g])_t v_t, fp32, V pages [bs, D] row-major at v_base + block * s_block
// + h_off. w: G * seq floats of scratch; acc: G * D floats.
template <typename T>
void attend(const T* v_base, int64_t s_block, int64_t h_off, int bs, int d, int g, const int32_t* blocks,
            int64_t seq, const float* s, float* w, float* acc, float* out) {
  std::fill(acc, acc + static_cast<int64_t>(g) * d, 0.0f);
  std::vector<float> inv_z(g);
  for (int gg = 0; gg < g; ++gg) {
    const float* sg = s + gg * seq;
    float* wg = w + gg * seq;
    const float m = max_v(sg, seq);
    exp_shifted(sg, m, wg, seq);
    inv_z[gg] = 1.0f / sum_v(wg, seq);
  }
  const int64_t nb = (seq + bs - 1) / bs;
  if (d % kLanes == 0 && d <= kMaxD && g <= kMaxG)
    attend_rows_fixed(v_base, s_block, h_off, bs, d, g, blocks, nb, seq, w, acc);
  else
    attend_rows(v_base, s_block, h_off, bs, d, g, blocks, nb, seq, w, acc);
  for (int gg = 0; gg < g; ++gg)
    for (int dd = 0; dd < d; ++dd) out[gg * d + dd] = acc[gg * d + dd] * inv_z[gg];
}


// The slow step's evidence and key norms of one request's KV heads [h0, h1) (ALGORITHMS.md §1, "Slow
// step"; the twin writes the same), and with attn_out their dense attention, called by the operator at
// the end of the file. amx 0: K pages: element (d, t) of block b, KV head h at k_base + b * s_block
// + h * s_head + d * bs + t (CPU_ATTN's vec packing); V pages (when attn_out is given): element (t, d)
// at v_base + b * s_block + h * s_head + t * D + d. amx 1: the pages at the same bases hold CPU_ATTN's
// amx packing (unpack_amx_k / unpack_amx_v; bs and D multiples of 16). q: [Hkv, G, D] fp32. ev / kn:
// [Hkv, >= lim] rows with strides ev_hs / kn_hs (kn may be null); positions [0, lim) are written:
// -inf outside [lo, hi), lim = min(seq, max_len). attn_out: [Hkv * G, D] fp32 or null. scratch:
// G * seq + (G + 2) * bs floats, and G * seq + G * D more with attn_out.
template <typename T>
void evidence_pass(const T* k_base, int64_t s_block, int64_t s_head, int bs, int d, int h0, int h1, int g,
                   const int32_t* blocks, int64_t seq, int64_t lo, int64_t hi, int64_t lim, const float* q,
                   float scale, float alpha, float* ev, int64_t ev_hs, float* kn, int64_t kn_hs, float* scratch,
                   const T* v_base, float* attn_out, int amx, float k_scale, float v_scale) {
  // k_scale / v_scale: fp8 pages hold K / k_scale and V / v_scale; k_scale folds into the score
  // scale and the key norms, v_scale into the output (1 for other dtypes).
  scale *= k_scale;
  // scratch: scores [G, seq], per-block accumulators [G + 1, bs] and one converted row [bs]; with
  // attn_out also softmax weights [G, seq] and accumulators [G, D]
  float* s = scratch;
  float* acc = scratch + static_cast<int64_t>(g) * seq;
  float* nrm = acc + static_cast<int64_t>(g) * bs;
  float* krow = nrm + bs;
  float* w = krow + bs;
  float* oacc = w + static_cast<int64_t>(g) * seq;
  const int64_t nb = (seq + bs - 1) / bs;
  const float log_g = std::log(static_cast<float>(g));
  // amx: one K page at a time unpacked; the head's V pages unpacked into consecutive pages [nb, bs, D]
  // read through the identity block table
  const int64_t page_elems = static_cast<int64_t>(bs) * d;
  T* kpage = amx ? scratch_of<T>(page_elems + (attn_out != nullptr ? nb * page_elems : 0)) : nullptr;
  T* vpages = amx && attn_out != nullptr ? kpage + page_elems : nullptr;
  int32_t* ident = amx && attn_out != nullptr ? scratch_of<int32_t>(nb) : nullptr;
  for (int64_t j = 0; ident != nullptr && j < nb; ++j) ident[j] = static_cast<int32_t>(j);
  for (int h = h0; h < h1; ++h) {
    const float* qh = q + static_cast<int64_t>(h) * g * d;
    for (int64_t j = 0; j < nb; ++j) {
      const T* page = k_base + static_cast<int64_t>(blocks[j]) * s_block + static_cast<int64_t>(h) * s_head;
      if (j + 1 < nb)
        prefetch_bytes(k_base + static_cast<int64_t>(blocks[j + 1]) * s_block + static_cast<int64_t>(h) * s_head,
                       sizeof(T) * page_elems);
      if (amx) {
        unpack_amx_k(page, bs, d, kpage);
        page = kpage;
      }
      const int64_t p0 = j * bs;
      const int64_t nt = std::min<int64_t>(bs, seq - p0);
      float* knh = kn == nullptr ? nullptr : kn + h * kn_hs;
      const int64_t nk = std::min<int64_t>(nt, lim - p0);
      if (bs % kLanes == 0 && g <= kMaxG) {
        score_block_fixed(page, bs, d, g, qh, scale, s + p0, seq, nt, knh == nullptr ? nullptr : knh + p0, nk);
      } else {
        score_block(page, bs, d, g, qh, scale, s + p0, seq, nt, knh == nullptr ? nullptr : knh + p0, nk, acc,
                    nrm, krow);
      }
    }
    if (kn != nullptr && k_scale != 1.0f)
      for (int64_t i = 0, n = std::min(seq, lim); i < n; ++i) kn[h * kn_hs + i] *= k_scale;
    if (attn_out != nullptr && amx) {                             // before the evidence rewrites s
      for (int64_t j = 0; j < nb; ++j)
        unpack_amx_v(v_base + static_cast<int64_t>(blocks[j]) * s_block + static_cast<int64_t>(h) * s_head, bs,
                     d, vpages + j * page_elems);
      attend(static_cast<const T*>(vpages), page_elems, 0, bs, d, g, ident, seq, s, w, oacc,
             attn_out + static_cast<int64_t>(h) * g * d);
    } else if (attn_out != nullptr) {
      attend(v_base, s_block, static_cast<int64_t>(h) * s_head, bs, d, g, blocks, seq, s, w, oacc,
             attn_out + static_cast<int64_t>(h) * g * d);
    }
    if (attn_out != nullptr && v_scale != 1.0f)
      for (int64_t i = 0; i < static_cast<int64_t>(g) * d; ++i) attn_out[static_cast<int64_t>(h) * g * d + i] *= v_scale;
    float* evh = ev + h * ev_hs;
    if (hi <= lo) {
      for (int64_t i = 0; i < lim; ++i) evh[i] = kNegInf;
      continue;
    }
    for (int64_t i = 0; i < lo; ++i) evh[i] = kNegInf;
    for (int64_t i = hi; i < lim; ++i) evh[i] = kNegInf;
    const int64_t n = hi - lo;
    float* out = evh + lo;
    // per query row: log p over A (scores are finite), then the power mean over the group
    for (int gg = 0; gg < g; ++gg) {
      float* sg = s + gg * seq + lo;
      const float z = lse(sg, n);
      const float a = alpha == 0.0f ? 1.0f : alpha;
      for (int64_t i = 0; i < n; ++i) sg[i] = (sg[i] - z) * a;
    }
    if (alpha == 0.0f) {
      for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
      for (int gg = 0; gg < g; ++gg) {
        const float* sg = s + gg * seq + lo;
        for (int64_t i = 0; i < n; ++i) out[i] += sg[i];
      }
      for (int64_t i = 0; i < n; ++i) out[i] /= static_cast<float>(g);
      continue;
    }
    power_mean(s + lo, seq, g, n, alpha, log_g, out, scratch_floats(2 * n));
  }
}

// The keys of u[0, n) whose bits from shift up equal b, in order, into c; returns their count.
template <int Shift>
int64_t keys_in_bucket(const uint32_t* u, int64_t n, uint32_t b, uint32_t* c) {
  int64_t nc = 0, j = 0;
#if defined(__AVX512F__)
  const __m512i top = _mm512_set1_epi32(static_cast<int>(~0u << Shift));
  const __m512i vb = _mm512_set1_epi32(static_cast<int>(b << Shift));
  for (; j + 16 <= n; j += 16) {
    const __m512i k = _mm512_loadu_si512(u + j);
    const __mmask16 m = _mm512_cmpeq_epi32_mask(_mm512_and_si512(k, top), vb);
    const int pc = __builtin_popcount(m);
    _mm512_mask_storeu_epi32(c + nc, static_cast<__mmask16>((1u << pc) - 1), _mm512_maskz_compress_epi32(m, k));
    nc += pc;
  }
#endif
  for (; j < n; ++j)
    if ((u[j] >> Shift) == b) c[nc++] = u[j];
  return nc;
}

// lo + j, ascending, for every key u[j] above t and the first want keys equal to t, into out.
void take_positions(const uint32_t* u, int64_t n, uint32_t t, int64_t want, int64_t lo, int32_t* out) {
  int64_t m = 0, j = 0;
#if defined(__AVX512F__) && defined(__BMI2__)
  const __m512i vt = _mm512_set1_epi32(static_cast<int>(t));
  __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i step = _mm512_set1_epi32(16);
  for (; j + 16 <= n; j += 16, pos = _mm512_add_epi32(pos, step)) {
    const __m512i k = _mm512_loadu_si512(u + j);
    uint32_t eq = _mm512_cmpeq_epu32_mask(k, vt);
    if (eq != 0) {                                  // the first want of them (lowest lanes first)
      if (__builtin_popcount(eq) > want) eq = _pdep_u32((1u << want) - 1, eq);
      want -= __builtin_popcount(eq);
    }
    const __mmask16 take = static_cast<__mmask16>(_mm512_cmpgt_epu32_mask(k, vt) | eq);
    const int pc = __builtin_popcount(take);
    _mm512_mask_storeu_epi32(out + m, static_cast<__mmask16>((1u << pc) - 1), _mm512_maskz_compress_epi32(take, pos));
    m += pc;
  }
#endif
  for (; j < n; ++j) {
    if (u[j] > t || (u[j] == t && want > 0)) {
      want -= u[j] == t;
      out[m++] = static_cast<int32_t>(lo + j);
    }
  }
}

// The n_sel positions lo + i (i < n) of the largest scores x[i], ties to the smaller position, in
// ascending order into out. The key of the n_sel-th largest (scores mapped to order-preserving
// unsigned images) is found in two steps: a histogram of the keys' top 12 bits (sign, exponent and
// three mantissa bits) over all positions, kept as four interleaved copies so that runs of equal
// keys (the span dilation writes runs) do not wait on one counter; then only the keys of the bucket
// that holds it, compacted, by nth_element. One ascending scan takes every larger key and the first
// equal ones. The twin's topk over score_key32 * 2^32 + (2^31 - 1 - position) orders the candidates
// the same way.
void top_positions(const float* x, int64_t n, int64_t n_sel, int64_t lo, int32_t* out) {
  if (n_sel >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(lo + i);
    return;
  }
  constexpr int kBits = 12, kShift = 32 - kBits, kBins = 1 << kBits;
  thread_local std::vector<uint32_t> keys, cand;
  thread_local std::vector<int32_t> hist;
  if (static_cast<int64_t>(keys.size()) < n) keys.resize(n);
  hist.assign(4 * kBins, 0);
  uint32_t* u = keys.data();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t bits = to_bits(x[i]);
    u[i] = static_cast<uint32_t>(bits >= 0 ? bits : (bits ^ 0x7FFFFFFF)) ^ 0x80000000u;
  }
  int32_t* h = hist.data();
  const int64_t n4 = n - n % 4;
  for (int64_t i = 0; i < n4; i += 4) {
    ++h[u[i] >> kShift];
    ++h[kBins + (u[i + 1] >> kShift)];
    ++h[2 * kBins + (u[i + 2] >> kShift)];
    ++h[3 * kBins + (u[i + 3] >> kShift)];
  }
  for (int64_t i = n4; i < n; ++i) ++h[u[i] >> kShift];
  int64_t want = n_sel;                     // the want-th largest among the keys of bucket b
  int b = kBins - 1;
  for (;; --b) {
    const int64_t c = h[b] + h[kBins + b] + h[2 * kBins + b] + h[3 * kBins + b];
    if (c >= want || b == 0) break;
    want -= c;
  }
  if (static_cast<int64_t>(cand.size()) < n) cand.resize(n);
  uint32_t* c = cand.data();
  const int64_t nc = keys_in_bucket<kShift>(u, n, static_cast<uint32_t>(b), c);
  // the want-th largest of the bucket: descending order's element want - 1
  std::nth_element(c, c + (want - 1), c + nc, std::greater<uint32_t>());
  const uint32_t t = c[want - 1];
  for (int64_t j = 0; j < nc; ++j) want -= c[j] > t;   // of the keys equal to t, want are taken
  take_positions(u, n, t, want, lo, out);
}

// The selector of one request over its allowed set [lo, hi) (the twin: sfi_selector_cpu.select_rows):
// pooled log evidence ev and key norms kn, rows [H, >= hi] with strides ev_hs / kn_hs; cfg: alpha
// (unused: the evidence is pooled), gamma_k, pos_power, pos_eta, pos_beta, w_k, w_pos, lambda_max,
// mu, cross_head_temperature, lam_x, eps; nms_radius, span, back; n_sel positions per head (<= hi -
// lo) into sel [H, >= n_sel] (stride sel_hs), ascending. exclude: [H, n_ex] absolute positions
// (any value; those in [lo, hi) get -inf) or null. scratch: (2 * H + 2) * (hi - lo) floats.
void sfi_select_row(const float* ev, int64_t ev_hs, const float* kn, int64_t kn_hs, int heads, int64_t lo,
                    int64_t hi, const float* cfg, int nms_radius, int span, int back, int64_t n_sel,
                    const int64_t* exclude, int64_t n_ex, int32_t* sel, int64_t sel_hs, float* scratch) {
  const float gamma_k = cfg[1], pos_power = cfg[2], pos_eta = cfg[3], pos_beta = cfg[4], w_k = cfg[5],
              w_pos = cfg[6], lambda_max = cfg[7], mu = cfg[8], temp = cfg[9], lam_x = cfg[10],
              eps = cfg[11];
  const int64_t n = hi - lo;
  if (n <= 0 || n_sel <= 0) return;
  float* ls = scratch;                        // [H, n] the score
  float* lr = scratch + heads * n;            // [H, n] the prior, then window maxima
  float* ld = scratch + 2 * heads * n;        // [n] the position factor
  float* tmp = scratch + 2 * heads * n + n;   // [n]
  for (int h = 0; h < heads; ++h) {
    std::memcpy(ls + h * n, ev + h * ev_hs + lo, n * sizeof(float));
    normalize(ls + h * n, n);
  }
  if (lambda_max != 0.0f) {
    const float den = static_cast<float>(std::max<int64_t>(n - 1, 1));
    for (int64_t i = 0; i < n; ++i) {
      const float rel = static_cast<float>(i);
      const float u = rel / den, omu = (den - rel) / den;
      const float upow = vexp(pos_power * vlog(u));          // vexp(-inf) = 0 at u = 0
      const float lomu = vlog(std::max(omu, eps));
      ld[i] = -pos_beta * upow + pos_eta * lomu;
    }
    for (int h = 0; h < heads; ++h) {
      const float* k = kn + h * kn_hs + lo;
      float* r = lr + h * n;
      for (int64_t i = 0; i < n; ++i) {
        const float kc = k[i] > eps ? k[i] : eps;
        r[i] = -gamma_k * w_k * vlog(kc) + w_pos * ld[i];
      }
      normalize(r, n);
      float* f = ls + h * n;
      float* fe = tmp;                                            // exp(log f), exp(log r)
      float* re = scratch_floats(n);
      for (int64_t i = 0; i < n; ++i) fe[i] = vexp(f[i]);
      for (int64_t i = 0; i < n; ++i) re[i] = vexp(r[i]);
      const float ff = dot_v(fe, fe, n), rr = dot_v(re, re, n), fr = dot_v(fe, re, n);
      float lam = (ff - fr) / std::max(ff - 2.0f * fr + rr, eps);
      lam = std::min(std::max(lam, 0.0f), lambda_max);
      const float ca = std::log1p(-lam), cb = std::log(lam);      // cb = -inf when lam == 0
      fuse(f, r, ca, cb, n, tmp);
    }
  }
  if (nms_radius > 0 && mu != 0.0f) {
    for (int h = 0; h < heads; ++h) {
      float* x = ls + h * n;
      window_max(x, tmp, n, nms_radius, nms_radius);
      for (int64_t i = 0; i < n; ++i) {
        const bool keep = x[i] > kNegInf;
        const float gap = keep ? std::max(tmp[i] - x[i], 0.0f) : 0.0f;
        x[i] = keep ? x[i] - mu * gap : kNegInf;
      }
    }
  }
  if (heads > 2 && lam_x != 0.0f) {
    const float log_eps = std::log(eps);
    for (int64_t i = 0; i < n; ++i) tmp[i] = kNegInf;            // per position max over heads of l/T
    for (int h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i) tmp[i] = std::max(tmp[i], ls[h * n + i] / temp);
    float* sum = lr;                                              // [n] (the prior is no longer needed)
    for (int64_t i = 0; i < n; ++i) sum[i] = 0.0f;
    for (int h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i) sum[i] += vexp(ls[h * n + i] / temp - tmp[i]);
    for (int64_t i = 0; i < n; ++i) {
      const float l = tmp[i] + vlog(sum[i]);                     // NaN where every head is -inf: not used
      sum[i] = tmp[i] > kNegInf ? l : kNegInf;
    }
    for (int h = 0; h < heads; ++h) {
      float* x = ls + h * n;
      for (int64_t i = 0; i < n; ++i) {
        const bool keep = x[i] > kNegInf;
        const float lrho = keep ? std::max(x[i] / temp - sum[i], log_eps) : 0.0f;
        x[i] = keep ? x[i] + lam_x * lrho : kNegInf;
      }
    }
  }
  for (int h = 0; h < heads; ++h) {
    float* x = ls + h * n;
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] != x[i] ? kNegInf : x[i];
    if (span > 0 || back > 0) {                                   // j takes the best of j - span .. j + back
      window_max(x, tmp, n, span, back);
      std::memcpy(x, tmp, n * sizeof(float));
    }
    if (exclude != nullptr)
      for (int64_t e = 0; e < n_ex; ++e) {
        const int64_t p = exclude[h * n_ex + e];
        if (p >= lo && p < hi) x[p - lo] = kNegInf;
      }
    top_positions(x, n, n_sel, lo, sel + h * sel_hs);
  }
}

// The operators' own scratch (per thread, grown as needed): apart from scratch_floats and
// scratch_of, which the passes above use while it is live.
float* op_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// A [n] int32 (or int64 with wide) contiguous CPU vector, read as int64.
struct IntVec {
  const int32_t* i32 = nullptr;
  const int64_t* i64 = nullptr;
  int64_t operator[](int64_t i) const { return i32 != nullptr ? i32[i] : i64[i]; }
};

IntVec int_vec(const at::Tensor& t, const char* what, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) &&
                  t.dim() == 1 && t.size(0) >= n && t.is_contiguous(),
              what, ": [>= ", n, "] int32 or int64 contiguous on the CPU expected, got ", t.sizes(), " ",
              t.scalar_type());
  IntVec v;
  if (t.scalar_type() == at::kInt) v.i32 = t.data_ptr<int32_t>();
  else v.i64 = t.data_ptr<int64_t>();
  return v;
}

void check_rows3(const at::Tensor& t, const char* what, int64_t n, int64_t heads, int64_t len, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, what, ": ", dtype, " on the CPU expected, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 3 && t.size(0) == n && t.size(1) == heads && t.size(2) >= len && t.stride(2) == 1, what,
              ": [", n, ", ", heads, ", >= ", len, "] rows of unit stride expected, got ", t.sizes(), " strides ",
              t.strides());
}

// Row r's block table (blocks) covers its seq positions in blocks of bs and every id it reads lies in
// [0, nb_all): checked before any pass reads the pages (op names the caller in errors).
void check_row_blocks(const int32_t* blocks, int64_t r, int64_t seq, int64_t bs, int64_t width, int64_t nb_all,
                      const char* op) {
  const int64_t nb = (seq + bs - 1) / bs;
  TORCH_CHECK(nb <= width, op, ": row ", r, " of length ", seq, " needs ", nb, " blocks, the table has ", width);
  for (int64_t j = 0; j < nb; ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < nb_all, op, ": block id ", blocks[j], " outside [0, ", nb_all, ")");
}

// torch.ops.speedsfi.sfi_evidence: evidence_pass over a step's slow rows at once, the (entry, KV head)
// pairs shared among torch's intra-op threads (each pair's result is computed by one thread, the same
// on any number of threads). k_pages / v_pages: the KV cache's K and V views over the same storage,
// [blocks, Hkv, bs, D] with K transposed per page (strides [s_block, s_head, 1, bs]; V: [s_block,
// s_head, D, 1]), or with amx the 6-d VNNI views [blocks, Hkv, bs / 16, 16, D / 2, 2] (K) and
// [blocks, Hkv, bs / 2, 2, D / 16, 16] (V); bf16, fp32 or fp8 (e4m3, e5m2; k_scale / v_scale: the
// layer's per-tensor scales, 1 otherwise). query: [R, Hq, D] fp32 contiguous; block_table [R, W] int32
// rows of unit stride; seq_lens, lo, hi: [R] int32 / int64. rows: [E] int32 / int64, the row of each
// entry (one outside [0, R), or a row of length <= 0: the entry is skipped, nothing written).
// evidence / key_norms: [E, Hkv, >= L] fp32 (key_norms may be None): entry e's positions [0, lim)
// are written, lim = min(seq, L), -inf outside [max(lo, 0), min(hi, lim)). out: [R, Hq, D] fp32
// contiguous or None (then V is not read): the entries' rows are written.
void evidence_op(const at::Tensor& evidence, const std::optional<at::Tensor>& key_norms,
                 const std::optional<at::Tensor>& out, const at::Tensor& query, const at::Tensor& k_pages,
                 const at::Tensor& v_pages, const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const at::Tensor& lo_t, const at::Tensor& hi_t, const at::Tensor& rows_t, double scale,
                 double alpha, bool amx, double k_scale, double v_scale) {
  const at::ScalarType dt = k_pages.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2,
              "sfi_evidence: bf16, fp32, float8_e4m3fn or float8_e5m2 pages expected, got ", dt);
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "sfi_evidence: positive k_scale and v_scale expected, got ", k_scale,
              ", ", v_scale);
  TORCH_CHECK(k_pages.device().is_cpu() && v_pages.device().is_cpu() && v_pages.scalar_type() == dt,
              "sfi_evidence: K and V pages of one dtype on the CPU expected");
  TORCH_CHECK(k_pages.dim() == (amx ? 6 : 4) && v_pages.dim() == k_pages.dim(),
              "sfi_evidence: ", amx ? "6" : "4", "-d page views expected, got ", k_pages.sizes());
  const int64_t nb_all = k_pages.size(0), hkv = k_pages.size(1);
  const int64_t bs = amx ? k_pages.size(2) * k_pages.size(3) : k_pages.size(2);
  const int64_t d = amx ? k_pages.size(4) * k_pages.size(5) : k_pages.size(3);
  const auto ks = k_pages.strides(), vs = v_pages.strides();
  bool layout = ks[0] == vs[0] && ks[1] == vs[1] && v_pages.size(0) == nb_all && v_pages.size(1) == hkv;
  if (amx) {
    layout = layout && k_pages.size(3) == 16 && k_pages.size(5) == 2 && v_pages.size(3) == 2 &&
             v_pages.size(5) == 16 && v_pages.size(2) * 2 == bs && v_pages.size(4) * 16 == d &&
             ks[2] == 16 * d && ks[3] == 2 && ks[4] == 32 && ks[5] == 1 && vs[2] == 32 && vs[3] == 1 &&
             vs[4] == 16 * bs && vs[5] == 2;
  } else {
    layout = layout && v_pages.size(2) == bs && v_pages.size(3) == d && ks[2] == 1 && ks[3] == bs &&
             vs[2] == d && vs[3] == 1;
  }
  TORCH_CHECK(layout, "sfi_evidence: pages not in CPU_ATTN's ", amx ? "amx" : "vec", " packing (sizes ",
              k_pages.sizes(), " / ", v_pages.sizes(), ", strides ", ks, " / ", vs, ")");
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.is_contiguous() &&
                  query.dim() == 3 && query.size(2) == d && query.size(1) > 0 && query.size(1) % hkv == 0,
              "sfi_evidence: query [R, Hq, ", d, "] fp32 contiguous with Hq a multiple of ", hkv,
              " expected, got ", query.sizes());
  const int64_t n_rows = query.size(0), hq = query.size(1), g = hq / hkv;
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == n_rows && block_table.stride(1) == 1,
              "sfi_evidence: block_table [", n_rows, ", W] int32 rows of unit stride expected, got ",
              block_table.sizes(), " ", block_table.scalar_type());
  const IntVec seqs = int_vec(seq_lens, "sfi_evidence: seq_lens", n_rows);
  const IntVec los = int_vec(lo_t, "sfi_evidence: lo", n_rows), his = int_vec(hi_t, "sfi_evidence: hi", n_rows);
  TORCH_CHECK(rows_t.dim() == 1, "sfi_evidence: rows [E] expected, got ", rows_t.sizes());
  const int64_t n_ent = rows_t.size(0);
  const IntVec rows = int_vec(rows_t, "sfi_evidence: rows", n_ent);
  TORCH_CHECK(evidence.dim() == 3, "sfi_evidence: evidence [E, Hkv, L] expected, got ", evidence.sizes());
  const int64_t max_len = evidence.size(2);
  check_rows3(evidence, "sfi_evidence: evidence", n_ent, hkv, max_len, at::kFloat);
  if (key_norms.has_value()) check_rows3(*key_norms, "sfi_evidence: key_norms", n_ent, hkv, max_len, at::kFloat);
  if (out.has_value())
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == at::kFloat && out->is_contiguous() &&
                    out->dim() == 3 && out->size(0) == n_rows && out->size(1) == hq && out->size(2) == d,
                "sfi_evidence: out [", n_rows, ", ", hq, ", ", d, "] fp32 contiguous expected, got ", out->sizes());
  const int64_t width = block_table.size(1), t_rs = block_table.stride(0);
  const int32_t* table = block_table.data_ptr<int32_t>();
  int64_t longest = 0;
  // the (entry, KV head) items with work: the entries are a step's slow list padded to the plan's
  // chunk (-1), so splitting every entry's range among the threads would leave all live ones to one
  std::vector<int64_t> items;
  for (int64_t e = 0; e < n_ent; ++e) {                 // what the C++ reads, checked before any thread starts
    const int64_t r = rows[e];
    if (r < 0 || r >= n_rows || seqs[r] <= 0) continue;
    for (int64_t h = 0; h < hkv; ++h) items.push_back(e * hkv + h);
    const int64_t seq = seqs[r];
    check_row_blocks(table + r * t_rs, r, seq, bs, width, nb_all, "sfi_evidence");
    longest = std::max(longest, seq);
  }
  if (longest == 0 || max_len == 0) return;
  const int64_t scratch_n = g * longest + (g + 2) * bs + (out.has_value() ? g * longest + g * d : 0);
  float* ev_base = evidence.data_ptr<float>();
  float* kn_base = key_norms.has_value() ? key_norms->data_ptr<float>() : nullptr;
  const int64_t ev_es = evidence.stride(0), ev_hs = evidence.stride(1);
  const int64_t kn_es = key_norms.has_value() ? key_norms->stride(0) : 0;
  const int64_t kn_hs = key_norms.has_value() ? key_norms->stride(1) : 0;
  float* attn = out.has_value() ? out->data_ptr<float>() : nullptr;
  const float* q_base = query.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    float* scratch = op_scratch(scratch_n);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t item = items[i];
      const int64_t e = item / hkv;
      const int h = static_cast<int>(item % hkv);
      const int64_t r = rows[e];
      if (r < 0 || r >= n_rows || seqs[r] <= 0) continue;
      const int64_t seq = seqs[r], lim = std::min(seq, max_len);
      const int64_t lo = std::max<int64_t>(los[r], 0), hi = std::min<int64_t>(his[r], lim);
      float* kn = kn_base == nullptr ? nullptr : kn_base + e * kn_es;
      float* ao = attn == nullptr ? nullptr : attn + r * hq * d;
#define SFI_EVIDENCE(T)                                                                                             \
  evidence_pass<T>(static_cast<const T*>(k_pages.data_ptr()), ks[0], ks[1], static_cast<int>(bs), static_cast<int>(d), \
                   h, h + 1, static_cast<int>(g), table + r * t_rs, seq, lo, hi, lim, q_base + r * hq * d,             \
                   static_cast<float>(scale), static_cast<float>(alpha), ev_base + e * ev_es, ev_hs, kn, kn_hs,        \
                   scratch, out.has_value() ? static_cast<const T*>(v_pages.data_ptr()) : nullptr, ao, amx ? 1 : 0,   \
                   static_cast<float>(k_scale), static_cast<float>(v_scale))
      if (dt == at::kBFloat16) SFI_EVIDENCE(uint16_t);
      else if (dt == at::kFloat) SFI_EVIDENCE(float);
      else if (dt == at::kFloat8_e4m3fn) SFI_EVIDENCE(fp8e4m3);
      else SFI_EVIDENCE(fp8e5m2);
#undef SFI_EVIDENCE
    }
  });
}

// torch.ops.speedsfi.sfi_select_rows: sfi_select_row for every row of a step's slow list at once, the
// rows shared among torch's intra-op threads. sel: [N, H, >= max n_sel] int32 (unit stride);
// evidence / key_norms: [N, H, >= max hi] fp32 (unit stride); lo, hi, n_sel: [N] int32 / int64, a row
// with n_sel <= 0 skipped (nothing written), otherwise 0 <= lo < hi, n_sel <= hi - lo; cfg: the 12
// constants in sfi_select_row's order; exclude: [N, H, E] int64 contiguous or None.
void select_rows_op(const at::Tensor& sel, const at::Tensor& evidence, const at::Tensor& key_norms,
                    const at::Tensor& lo_t, const at::Tensor& hi_t, const at::Tensor& n_sel_t,
                    at::ArrayRef<double> cfg, int64_t nms_radius, int64_t span, int64_t span_back,
                    const std::optional<at::Tensor>& exclude) {
  TORCH_CHECK(evidence.dim() == 3, "sfi_select_rows: evidence [N, H, L] expected, got ", evidence.sizes());
  const int64_t n = evidence.size(0), heads = evidence.size(1);
  TORCH_CHECK(cfg.size() == 12, "sfi_select_rows: 12 constants expected, got ", cfg.size());
  const IntVec los = int_vec(lo_t, "sfi_select_rows: lo", n), his = int_vec(hi_t, "sfi_select_rows: hi", n);
  const IntVec ns = int_vec(n_sel_t, "sfi_select_rows: n_sel", n);
  int64_t max_hi = 0, max_sel = 0, max_n = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (ns[r] <= 0) continue;
    TORCH_CHECK(0 <= los[r] && los[r] < his[r] && ns[r] <= his[r] - los[r], "sfi_select_rows: row ", r,
                ": 0 <= lo < hi and n_sel <= hi - lo expected, got ", los[r], ", ", his[r], ", ", ns[r]);
    max_hi = std::max(max_hi, his[r]);
    max_sel = std::max(max_sel, ns[r]);
    max_n = std::max(max_n, his[r] - los[r]);
  }
  check_rows3(evidence, "sfi_select_rows: evidence", n, heads, max_hi, at::kFloat);
  check_rows3(key_norms, "sfi_select_rows: key_norms", n, heads, max_hi, at::kFloat);
  check_rows3(sel, "sfi_select_rows: sel", n, heads, max_sel, at::kInt);
  const int64_t* ex = nullptr;
  int64_t n_ex = 0;
  if (exclude.has_value()) {
    TORCH_CHECK(exclude->device().is_cpu() && exclude->scalar_type() == at::kLong && exclude->is_contiguous() &&
                    exclude->dim() == 3 && exclude->size(0) == n && exclude->size(1) == heads,
                "sfi_select_rows: exclude [", n, ", ", heads, ", E] int64 contiguous expected, got ", exclude->sizes());
    ex = exclude->data_ptr<int64_t>();
    n_ex = exclude->size(2);
  }
  if (max_sel == 0) return;
  float consts[12];
  for (int i = 0; i < 12; ++i) consts[i] = static_cast<float>(cfg[i]);
  const float* ev = evidence.data_ptr<float>();
  const float* kn = key_norms.data_ptr<float>();
  int32_t* sp = sel.data_ptr<int32_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    float* scratch = op_scratch((2 * heads + 2) * max_n);
    for (int64_t r = begin; r < end; ++r) {
      if (ns[r] <= 0) continue;
      sfi_select_row(ev + r * evidence.stride(0), evidence.stride(1), kn + r * key_norms.stride(0),
                     key_norms.stride(1), static_cast<int>(heads), los[r], his[r], consts,
                     static_cast<int>(nms_radius), static_cast<int>(span), static_cast<int>(span_back), ns[r],
                     ex == nullptr ? nullptr : ex + r * heads * n_ex, n_ex, sp + r * sel.stride(0), sel.stride(1),
                     scratch);
    }
  });
}


// One evidence pass (sfi_evidence's evidence_pass) of entry e's KV head h in the pages' dtype.
void evidence_item(at::ScalarType dt, const at::Tensor& k_pages, const at::Tensor& v_pages, int64_t s_block,
                   int64_t s_head, int bs, int d, int h, int g, const int32_t* blocks, int64_t seq, int64_t lo,
                   int64_t hi, int64_t lim, const float* q, float scale, float alpha, float* ev, int64_t ev_hs,
                   float* kn, int64_t kn_hs, float* scratch, float* attn_out, bool amx, float k_scale,
                   float v_scale) {
#define SFI_EVIDENCE_ITEM(T)                                                                                      \
  evidence_pass<T>(static_cast<const T*>(k_pages.data_ptr()), s_block, s_head, bs, d, h, h + 1, g, blocks, seq, lo, \
                   hi, lim, q, scale, alpha, ev, ev_hs, kn, kn_hs, scratch,                                        \
                   attn_out != nullptr ? static_cast<const T*>(v_pages.data_ptr()) : nullptr, attn_out, amx ? 1 : 0, \
                   k_scale, v_scale)
  if (dt == at::kBFloat16) SFI_EVIDENCE_ITEM(uint16_t);
  else if (dt == at::kFloat) SFI_EVIDENCE_ITEM(float);
  else if (dt == at::kFloat8_e4m3fn) SFI_EVIDENCE_ITEM(fp8e4m3);
  else SFI_EVIDENCE_ITEM(fp8e5m2);
#undef SFI_EVIDENCE_ITEM
}

// A calling thread's buffers of a fused slow step (grown as needed, kept between calls).
template <typename T>
T* call_buffer(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// torch.ops.speedsfi.sfi_slow_rows: a layer's whole slow step on the CPU build in one call, what
// sfi_evidence, sfi_select_rows and gather_compact do one after the other over the step's slow list
// (vllm_ext.methods.sfi.path: the dense pass with evidence, then the selector and the gather of each
// entry), the same functions on the same arguments, so the results are theirs bit for bit.
//
// Entries e < live of the slow list: row r = slow_rows[e] of query [R, Hq, D] (bf16 or fp32), its
// pages through block_table [R, W] int32, its evidence over [0, min(seq_lens[r], max_len)) with the
// allowed set [allowed_lo[r], allowed_hi[r]) (phase 1; out [R, Hq, D] bf16 / fp32 gets row r's dense
// attention unless None); then its selection over [slow_lo[e], slow_hi[e]) of min(clamp(slow_k[e],
// k_min, width), hi - lo) positions per KV head (phase 2), leaving out the first slow_kept[e] positions
// of its compact slot's kept row (kept_pages [NB, H', bs', C'] int32 read through kept_table [slots, n]
// int32 from column kept_first: element h * kept_width + j of a slot, as
// vllm_ext.kernels.paged_rows.PagedRows lays it out); then its gather (phase 3): sink and selection
// copied into compact slot slow_slot[e] (compact_kv through compact_table, capacity cap) after its
// slow_kept[e] kept entries, its length set. cfg: sfi_select_row's 12 constants. Entries with a row
// outside [0, R), a length <= 0 or a negative slot are skipped. The threads take whole entries when
// there are enough of them, else the (entry, KV head) pairs of phase 1 (see the end of the function).
void slow_rows_op(const std::optional<at::Tensor>& out, const at::Tensor& compact_kv, const at::Tensor& compact_len,
                  const at::Tensor& query, const at::Tensor& k_pages, const at::Tensor& v_pages,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& allowed_lo,
                  const at::Tensor& allowed_hi, const at::Tensor& slow_rows_t, const at::Tensor& slow_seq_t,
                  const at::Tensor& slow_lo_t, const at::Tensor& slow_hi_t, const at::Tensor& slow_k_t,
                  const at::Tensor& slow_slot_t, const std::optional<at::Tensor>& slow_kept_t,
                  const std::optional<at::Tensor>& kept_pages, const std::optional<at::Tensor>& kept_table,
                  int64_t kept_first, int64_t kept_width, const at::Tensor& compact_table, int64_t cap, int64_t live,
                  int64_t max_len, int64_t k_min, int64_t width, double scale, double alpha, at::ArrayRef<double> cfg,
                  int64_t nms_radius, int64_t span, int64_t span_back, int64_t n_sink, bool amx, double k_scale,
                  double v_scale) {
  const at::ScalarType dt = k_pages.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2,
              "sfi_slow_rows: bf16, fp32, float8_e4m3fn or float8_e5m2 pages expected, got ", dt);
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "sfi_slow_rows: positive k_scale and v_scale expected");
  TORCH_CHECK(cfg.size() == 12, "sfi_slow_rows: 12 selector constants expected, got ", cfg.size());
  const PageViews src = page_views(k_pages, v_pages, amx, "sfi_slow_rows");
  TORCH_CHECK(src.layout != LAYOUT_ROWS, "sfi_slow_rows: pages in CPU_ATTN's vec or amx packing expected");
  const int64_t nb_all = src.blocks, hkv = src.heads, bs = src.bs, d = src.d;
  TORCH_CHECK(query.device().is_cpu() && (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  query.is_contiguous() && query.dim() == 3 && query.size(2) == d && query.size(1) > 0 &&
                  query.size(1) % hkv == 0,
              "sfi_slow_rows: query [R, Hq, ", d, "] bf16 / fp32 contiguous with Hq a multiple of ", hkv,
              " expected, got ", query.sizes(), " ", query.scalar_type());
  const int64_t n_rows = query.size(0), hq = query.size(1), g = hq / hkv;
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) >= n_rows && block_table.stride(1) == 1,
              "sfi_slow_rows: block_table [>= ", n_rows, ", W] int32 rows of unit stride expected, got ",
              block_table.sizes(), " ", block_table.scalar_type());
  if (out.has_value())
    TORCH_CHECK(out->device().is_cpu() && (out->scalar_type() == at::kFloat || out->scalar_type() == at::kBFloat16) &&
                    out->is_contiguous() && out->dim() == 3 && out->size(0) == n_rows && out->size(1) == hq &&
                    out->size(2) == d,
                "sfi_slow_rows: out [", n_rows, ", ", hq, ", ", d, "] bf16 / fp32 contiguous expected, got ",
                out->sizes());
  TORCH_CHECK(compact_kv.scalar_type() == dt && compact_kv.dim() == 4 && compact_kv.size(1) == hkv &&
                  compact_kv.size(3) == 2 * d && compact_kv.stride(3) == 1,
              "sfi_slow_rows: compact_kv [blocks, ", hkv, ", cbs, ", 2 * d, "] of the pages' dtype expected, got ",
              compact_kv.sizes(), " ", compact_kv.scalar_type());
  TORCH_CHECK(compact_table.scalar_type() == at::kInt && compact_table.dim() == 2 && compact_table.stride(1) == 1 &&
                  compact_len.scalar_type() == at::kInt && compact_len.dim() == 1 && compact_len.is_contiguous() &&
                  compact_table.size(1) * compact_kv.size(2) >= cap,
              "sfi_slow_rows: compact_table [slots, >= cap / cbs] int32 and compact_len [slots] int32 expected");
  TORCH_CHECK(max_len > 0 && width > 0 && cap > 0 && k_min >= 0, "sfi_slow_rows: positive lengths expected");
  const IntVec seqs = int_vec(seq_lens, "sfi_slow_rows: seq_lens", n_rows);
  const IntVec alo = int_vec(allowed_lo, "sfi_slow_rows: allowed_lo", n_rows);
  const IntVec ahi = int_vec(allowed_hi, "sfi_slow_rows: allowed_hi", n_rows);
  const IntVec rows = int_vec(slow_rows_t, "sfi_slow_rows: slow_rows", live);
  const IntVec sseq = int_vec(slow_seq_t, "sfi_slow_rows: slow_seq", live);
  const IntVec slo = int_vec(slow_lo_t, "sfi_slow_rows: slow_lo", live);
  const IntVec shi = int_vec(slow_hi_t, "sfi_slow_rows: slow_hi", live);
  const IntVec sk = int_vec(slow_k_t, "sfi_slow_rows: slow_k", live);
  TORCH_CHECK(slow_slot_t.scalar_type() == at::kInt && slow_slot_t.is_contiguous() && slow_slot_t.size(0) >= live,
              "sfi_slow_rows: slow_slot [>= live] int32 expected");
  const int32_t* sslot = slow_slot_t.data_ptr<int32_t>();
  std::vector<int32_t> kept_n(live, 0);
  if (slow_kept_t.has_value()) {
    const IntVec sk2 = int_vec(*slow_kept_t, "sfi_slow_rows: slow_kept", live);
    for (int64_t e = 0; e < live; ++e) kept_n[e] = static_cast<int32_t>(sk2[e]);
  }
  const bool excluding = kept_pages.has_value() && kept_table.has_value() && kept_width > 0;
  int64_t kp_s[3] = {0, 0, 0}, kp_bs = 0, kp_c = 0, kp_page = 0, kp_blocks = 0, kt_rs = 0, kt_w = 0;
  const int32_t* kp = nullptr;
  const int32_t* kt = nullptr;
  if (excluding) {
    TORCH_CHECK(kept_pages->scalar_type() == at::kInt && kept_pages->dim() == 4 && kept_pages->stride(3) == 1 &&
                    kept_table->scalar_type() == at::kInt && kept_table->dim() == 2 && kept_table->stride(1) == 1,
                "sfi_slow_rows: kept_pages [NB, H, bs, C] int32 (unit stride in C) and kept_table [slots, n] int32 "
                "expected");
    kp = kept_pages->data_ptr<int32_t>();
    kp_s[0] = kept_pages->stride(0), kp_s[1] = kept_pages->stride(1), kp_s[2] = kept_pages->stride(2);
    kp_bs = kept_pages->size(2), kp_c = kept_pages->size(3), kp_blocks = kept_pages->size(0);
    kp_page = kept_pages->size(1) * kp_bs * kp_c;
    kt = kept_table->data_ptr<int32_t>();
    kt_rs = kept_table->stride(0), kt_w = kept_table->size(1);
    TORCH_CHECK(kept_first >= 0 && kept_first + (hkv * kept_width + kp_page - 1) / kp_page <= kt_w,
                "sfi_slow_rows: the kept rows run past kept_table's columns");
  }
  const int64_t slots = std::min(compact_table.size(0), compact_len.size(0));
  const int64_t cbs = compact_kv.size(2), t_rs = block_table.stride(0), width_bt = block_table.size(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* ct = compact_table.data_ptr<int32_t>();
  // the live entries, and everything the passes read or write checked before any is written
  std::vector<int64_t> ents, items;
  int64_t longest = 0;
  for (int64_t e = 0; e < live; ++e) {
    const int64_t r = rows[e];
    if (r < 0 || r >= n_rows || seqs[r] <= 0) continue;
    const int64_t seq = seqs[r];
    check_row_blocks(table + r * t_rs, r, seq, bs, width_bt, nb_all, "sfi_slow_rows");
    TORCH_CHECK(sseq[e] <= seq, "sfi_slow_rows: entry ", e, "'s length ", sseq[e], " past its row's ", seq);
    const int64_t slot = sslot[e];
    if (slot >= 0 && slot < slots) {
      for (int64_t j = 0; j * cbs < cap; ++j) {
        const int32_t b = ct[slot * compact_table.stride(0) + j];
        TORCH_CHECK(b >= 0 && b < compact_kv.size(0), "sfi_slow_rows: compact block id ", b, " out of range");
      }
      if (excluding && kept_n[e] > 0) {
        for (int64_t j = 0; j < (hkv * kept_width + kp_page - 1) / kp_page; ++j) {
          const int32_t b = kt[slot * kt_rs + kept_first + j];
          TORCH_CHECK(b >= 0 && b < kp_blocks, "sfi_slow_rows: kept block id ", b, " out of range");
        }
      }
    }
    ents.push_back(e);
    for (int64_t h = 0; h < hkv; ++h) items.push_back(e * hkv + h);
    longest = std::max(longest, seq);
  }
  if (ents.empty()) return;
  const int64_t L = max_len;
  static thread_local std::vector<float> ev_buf, kn_buf, attn_buf;
  static thread_local std::vector<int32_t> sel_buf, nsel_buf;
  float* ev_all = call_buffer(ev_buf, live * hkv * L);
  float* kn_all = call_buffer(kn_buf, live * hkv * L);
  float* attn_all = out.has_value() ? call_buffer(attn_buf, live * hq * d) : nullptr;
  int32_t* sel_all = call_buffer(sel_buf, live * hkv * width);
  int32_t* nsel_all = call_buffer(nsel_buf, live);
  const float* qf = query.scalar_type() == at::kFloat ? query.data_ptr<float>() : nullptr;
  const uint16_t* qb = qf == nullptr ? static_cast<const uint16_t*>(query.data_ptr()) : nullptr;
  float consts[12];
  for (int i = 0; i < 12; ++i) consts[i] = static_cast<float>(cfg[i]);
  int32_t* clen = compact_len.data_ptr<int32_t>();
  const int64_t scratch_n = g * longest + (g + 2) * bs + (out.has_value() ? g * longest + g * d : 0) + g * d;
  // phase 1 of entry e, KV head h: its evidence, key norms and dense attention
  auto evidence_of = [&](int64_t e, int h) {
    float* scratch = op_scratch(scratch_n);
    float* q = scratch + scratch_n - g * d;
    const int64_t r = rows[e], seq = seqs[r], lim = std::min(seq, L);
    const int64_t lo = std::max<int64_t>(alo[r], 0), hi = std::min<int64_t>(ahi[r], lim);
    const int64_t q0 = (r * hq + static_cast<int64_t>(h) * g) * d;
    for (int64_t j = 0; j < g * d; ++j) q[j] = qf != nullptr ? qf[q0 + j] : load(qb + q0 + j);
    // evidence_pass reads the query of KV head h at q + h * g * d and writes its output there too
    evidence_item(dt, k_pages, v_pages, src.s_block, src.s_head, static_cast<int>(bs), static_cast<int>(d), h,
                  static_cast<int>(g), table + r * t_rs, seq, lo, hi, lim, q - static_cast<int64_t>(h) * g * d,
                  static_cast<float>(scale), static_cast<float>(alpha), ev_all + e * hkv * L, L, kn_all + e * hkv * L,
                  L, scratch, attn_all == nullptr ? nullptr : attn_all + e * hq * d, amx, static_cast<float>(k_scale),
                  static_cast<float>(v_scale));
  };
  // phase 2 of entry e: its selection over its allowed set, its kept positions left out
  auto select_of = [&](int64_t e, std::vector<int64_t>& ex) {
    const int64_t r = rows[e];
    const int64_t lim = std::min<int64_t>(seqs[r], L);
    const int64_t a = std::clamp<int64_t>(slo[e], 0, L);
    const int64_t b = std::max<int64_t>(std::min<int64_t>(std::min<int64_t>(shi[e], L), lim), a);
    const int64_t n = std::min<int64_t>(std::clamp<int64_t>(sk[e], k_min, width), b - a);
    nsel_all[e] = static_cast<int32_t>(std::max<int64_t>(n, 0));
    if (n <= 0) return;
    const int64_t slot = sslot[e];
    const int64_t n_ex = excluding && slot >= 0 && slot < slots ? kept_width : 0;
    ex.assign(hkv * n_ex, -1);
    const int64_t count = std::min<int64_t>(kept_n[e], n_ex);
    for (int64_t h = 0; h < hkv && n_ex > 0; ++h)
      for (int64_t j = 0; j < count; ++j) {
        const int64_t f = h * kept_width + j, rr = f % kp_page;
        const int64_t blk = kt[slot * kt_rs + kept_first + f / kp_page];
        ex[h * n_ex + j] = kp[blk * kp_s[0] + (rr / (kp_bs * kp_c)) * kp_s[1] + ((rr / kp_c) % kp_bs) * kp_s[2] +
                              rr % kp_c];
      }
    sfi_select_row(ev_all + e * hkv * L, L, kn_all + e * hkv * L, L, static_cast<int>(hkv), a, b, consts,
                   static_cast<int>(nms_radius), static_cast<int>(span), static_cast<int>(span_back), n,
                   n_ex > 0 ? ex.data() : nullptr, n_ex, sel_all + e * hkv * width, width,
                   op_scratch((2 * hkv + 2) * (b - a)));
  };
  // phase 3 of entry e: sink and selection copied into its compact slot
  auto gather_of = [&](int64_t e) {
    const int32_t slot = sslot[e], seq_e = static_cast<int32_t>(sseq[e]);
    if (slot < 0 || slot >= slots) return;
    const int32_t nsel = nsel_all[e], off = kept_n[e];
    const int64_t r = rows[e];
#define SFI_SLOW_GATHER(T)                                                                                       \
  gather_rows<T>(static_cast<const T*>(k_pages.data_ptr()), static_cast<const T*>(v_pages.data_ptr()), src,         \
                 table + r * t_rs, t_rs, static_cast<T*>(compact_kv.data_ptr()), compact_kv.stride(0),              \
                 compact_kv.stride(1), compact_kv.stride(2), cbs, ct, compact_table.stride(0), clen, slots, cap,    \
                 &slot, sel_all + e * hkv * width, hkv * width, width, width, &nsel, &seq_e,                        \
                 slow_kept_t.has_value() ? &off : nullptr, nullptr, 1, hkv, n_sink)
    if (dt == at::kFloat) SFI_SLOW_GATHER(float);
    else if (k_pages.element_size() == 2) SFI_SLOW_GATHER(uint16_t);
    else SFI_SLOW_GATHER(uint8_t);
#undef SFI_SLOW_GATHER
  };
  // Entry by entry when there are at least as many entries as threads and no two share a compact
  // slot: a thread takes the next entry and runs its three phases, so the gather finds the entry's
  // pages still in cache from its evidence pass. Otherwise (an entry's KV heads spread over the
  // threads) phase by phase, the gathers last in entry order. The same functions on the same
  // arguments either way: the results do not depend on the order.
  std::vector<int32_t> used;
  for (const int64_t e : ents)
    if (sslot[e] >= 0 && sslot[e] < slots) used.push_back(sslot[e]);
  std::sort(used.begin(), used.end());
  const bool distinct = std::adjacent_find(used.begin(), used.end()) == used.end();
  const int64_t n_ent = static_cast<int64_t>(ents.size()), threads = at::get_num_threads();
  if (distinct && n_ent >= threads) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<int64_t> ex;
      for (int64_t i = next++; i < n_ent; i = next++) {
        const int64_t e = ents[i];
        for (int h = 0; h < hkv; ++h) evidence_of(e, h);
        select_of(e, ex);
        gather_of(e);
      }
    });
  } else {
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) evidence_of(items[i] / hkv, static_cast<int>(items[i] % hkv));
    });
    at::parallel_for(0, n_ent, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> ex;
      for (int64_t i = begin; i < end; ++i) select_of(ents[i], ex);
    });
    for (const int64_t e : ents) gather_of(e);
  }
  if (out.has_value()) {
    for (const int64_t e : ents) {
      const int64_t r = rows[e];
      const float* a = attn_all + e * hq * d;
      if (out->scalar_type() == at::kFloat) std::memcpy(out->data_ptr<float>() + r * hq * d, a, hq * d * sizeof(float));
      else {
        uint16_t* o = static_cast<uint16_t*>(out->data_ptr()) + r * hq * d;
        for (int64_t j = 0; j < hq * d; ++j) o[j] = to_bf16(a[j]);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(speedsfi, m) {
  m.set_python_module("vllm_ext.kernels.cpu_native");
  m.def("sfi_evidence(Tensor(a!) evidence, Tensor(b!)? key_norms, Tensor(c!)? out, Tensor query, Tensor k_pages, "
        "Tensor v_pages, Tensor block_table, Tensor seq_lens, Tensor lo, Tensor hi, Tensor rows, float scale, "
        "float alpha, bool amx, float k_scale=1., float v_scale=1.) -> ()");
  m.def("sfi_select_rows(Tensor(a!) sel, Tensor evidence, Tensor key_norms, Tensor lo, Tensor hi, Tensor n_sel, "
        "float[] cfg, int nms_radius, int span, int span_back, Tensor? exclude) -> ()");
  m.def("sfi_slow_rows(Tensor(a!)? out, Tensor(b!) compact_kv, Tensor(c!) compact_len, Tensor query, "
        "Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seq_lens, Tensor allowed_lo, Tensor allowed_hi, "
        "Tensor slow_rows, Tensor slow_seq, Tensor slow_lo, Tensor slow_hi, Tensor slow_k, Tensor slow_slot, "
        "Tensor? slow_kept, Tensor? kept_pages, Tensor? kept_table, int kept_first, int kept_width, "
        "Tensor compact_table, int cap, int live, int max_len, int k_min, int width, float scale, float alpha, "
        "float[] cfg, int nms_radius, int span, int span_back, int n_sink, bool amx, float k_scale=1., "
        "float v_scale=1.) -> ()");
}

TORCH_LIBRARY_IMPL(speedsfi, CPU, m) {
  m.impl("sfi_evidence", &evidence_op);
  m.impl("sfi_select_rows", &select_rows_op);
  m.impl("sfi_slow_rows", &slow_rows_op);
}
