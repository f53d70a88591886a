// SFI's slow-step work on the CPU build, one request at a time: the dense pass with evidence over
// CPU_ATTN's packed pages (attention output, evidence and key norms from one set of scores) and the
// closed-form selector over the request's allowed set (ALGORITHMS.md §1).
// Twins: vllm_ext.kernels.dense_decode_evidence.dense_decode_with_evidence_cpu and
// vllm_ext.kernels.sfi_selector_cpu.select_rows; tests/kernels/test_cpu_native.py compares them.
//
// Registered as the torch operators torch.ops.speedsfi.sfi_evidence and
// torch.ops.speedsfi.sfi_select_row (CPU kernels at the end of this file; their fake
// implementations for torch.compile are registered in Python). Built once per machine by
// vllm_ext/kernels/cpu_native.py (g++ -O3 -march=native against torch's headers, cached) and loaded
// with torch.ops.load_library. Every loop over positions is written so that the compiler vectorises
// it: exp and log are branch-free polynomials (Cephes' single-precision coefficients, about 1 ulp)
// instead of libm calls, and conditions are selects.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"

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
  std::vector<float> y(n + w - 1, kNegInf);          // y[k] = x[k - left]
  std::memcpy(y.data() + left, x, n * sizeof(float));
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


// The slow step's evidence and key norms of one request (ALGORITHMS.md §1, "Slow step"; the twin
// writes the same), and with attn_out its dense attention, called by the operator at the end of
// the file. amx 0: K pages: element (d, t) of block b, KV head h at k_base + b * s_block
// + h * s_head + d * bs + t (CPU_ATTN's vec packing); V pages (when attn_out is given): element (t, d)
// at v_base + b * s_block + h * s_head + t * D + d. amx 1: the pages at the same bases hold CPU_ATTN's
// amx packing (unpack_amx_k / unpack_amx_v; bs and D multiples of 16). q: [Hkv, G, D] fp32. ev / kn:
// [Hkv, >= lim] rows with strides ev_hs / kn_hs (kn may be null); positions [0, lim) are written:
// -inf outside [lo, hi), lim = min(seq, max_len). attn_out: [Hkv * G, D] fp32 or null. scratch:
// G * seq + (G + 2) * bs floats, and G * seq + G * D more with attn_out.
template <typename T>
void evidence_pass(const T* k_base, int64_t s_block, int64_t s_head, int bs, int d, int hkv, int g,
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
  for (int h = 0; h < hkv; ++h) {
    const float* qh = q + static_cast<int64_t>(h) * g * d;
    for (int64_t j = 0; j < nb; ++j) {
      const T* page = k_base + static_cast<int64_t>(blocks[j]) * s_block + static_cast<int64_t>(h) * s_head;
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
  std::vector<std::pair<int64_t, int64_t>> keys(n);
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
    for (int64_t i = 0; i < n; ++i) {
      const int32_t bits = to_bits(x[i]);
      const int64_t key32 = bits >= 0 ? bits : (bits ^ 0x7FFFFFFF);
      keys[i] = {key32 * 4294967296LL + (2147483647LL - (lo + i)), lo + i};
    }
    auto desc = [](const std::pair<int64_t, int64_t>& a, const std::pair<int64_t, int64_t>& b) {
      return a.first > b.first;
    };
    if (n_sel < n) std::nth_element(keys.begin(), keys.begin() + n_sel, keys.end(), desc);
    std::vector<int64_t> pos(n_sel);
    for (int64_t i = 0; i < n_sel; ++i) pos[i] = keys[i].second;
    std::sort(pos.begin(), pos.end());
    for (int64_t i = 0; i < n_sel; ++i) sel[h * sel_hs + i] = static_cast<int32_t>(pos[i]);
  }
}

// The operators' own scratch (per thread, grown as needed): apart from scratch_floats and
// scratch_of, which the passes above use while it is live.
float* op_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

void check_row(const at::Tensor& t, const char* what, int64_t rows, int64_t len, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, what, ": ", dtype, " on the CPU expected, got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) >= len && t.stride(1) == 1, what, ": [", rows,
              ", >= ", len, "] rows of unit stride expected, got ", t.sizes(), " strides ", t.strides());
}

// torch.ops.speedsfi.sfi_evidence: evidence_pass on tensors. k_pages / v_pages:
// the KV cache's K and V views over the same storage, [blocks, Hkv, bs, D] with K transposed per page
// (strides [s_block, s_head, 1, bs]; V: [s_block, s_head, D, 1]), or with amx the 6-d VNNI views
// [blocks, Hkv, bs / 16, 16, D / 2, 2] (K) and [blocks, Hkv, bs / 2, 2, D / 16, 16] (V); bf16, fp32 or
// fp8 (e4m3, e5m2; k_scale / v_scale: the layer's per-tensor scales, 1 otherwise).
// blocks: the request's block ids, int32, >= ceil(seq / bs). query: [Hq, D] fp32 contiguous.
// evidence / key_norms: [Hkv, >= lim] fp32 rows (key_norms may be None); out: [Hq, D] fp32 contiguous
// or None (then V is not read).
void evidence_op(const at::Tensor& evidence, const std::optional<at::Tensor>& key_norms,
                 const std::optional<at::Tensor>& out, const at::Tensor& query, const at::Tensor& k_pages,
                 const at::Tensor& v_pages, const at::Tensor& blocks, int64_t seq, int64_t lo, int64_t hi,
                 int64_t lim, double scale, double alpha, bool amx, double k_scale, double v_scale) {
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
                  query.dim() == 2 && query.size(1) == d && query.size(0) > 0 && query.size(0) % hkv == 0,
              "sfi_evidence: query [Hq, ", d, "] fp32 contiguous with Hq a multiple of ", hkv, " expected, got ",
              query.sizes());
  const int64_t hq = query.size(0), g = hq / hkv;
  TORCH_CHECK(0 < lim && lim <= seq, "sfi_evidence: 0 < lim <= seq expected, got lim ", lim, ", seq ", seq);
  TORCH_CHECK(hi <= lo || (0 <= lo && hi <= lim), "sfi_evidence: 0 <= lo < hi <= lim expected, got ", lo, ", ",
              hi, ", ", lim);
  const int64_t nb = (seq + bs - 1) / bs;
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kInt && blocks.is_contiguous() &&
                  blocks.numel() >= nb,
              "sfi_evidence: >= ", nb, " int32 block ids expected, got ", blocks.numel(), " ", blocks.scalar_type());
  const int32_t* bp = blocks.data_ptr<int32_t>();
  for (int64_t j = 0; j < nb; ++j)
    TORCH_CHECK(bp[j] >= 0 && bp[j] < nb_all, "sfi_evidence: block id ", bp[j], " outside [0, ", nb_all, ")");
  check_row(evidence, "sfi_evidence: evidence", hkv, lim, at::kFloat);
  if (key_norms.has_value()) check_row(*key_norms, "sfi_evidence: key_norms", hkv, lim, at::kFloat);
  if (out.has_value())
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == at::kFloat && out->is_contiguous() &&
                    out->dim() == 2 && out->size(0) == hq && out->size(1) == d,
                "sfi_evidence: out [", hq, ", ", d, "] fp32 contiguous expected, got ", out->sizes());
  float* scratch = op_scratch(g * seq + (g + 2) * bs + (out.has_value() ? g * seq + g * d : 0));
  float* kn = key_norms.has_value() ? key_norms->data_ptr<float>() : nullptr;
  const int64_t kn_hs = key_norms.has_value() ? key_norms->stride(0) : 0;
  float* attn = out.has_value() ? out->data_ptr<float>() : nullptr;
#define SFI_EVIDENCE(T)                                                                                     \
  evidence_pass<T>(static_cast<const T*>(k_pages.data_ptr()), ks[0], ks[1], static_cast<int>(bs),                \
                   static_cast<int>(d), static_cast<int>(hkv), static_cast<int>(g), bp, seq, lo, hi, lim,          \
                   query.data_ptr<float>(), static_cast<float>(scale), static_cast<float>(alpha),                  \
                   evidence.data_ptr<float>(), evidence.stride(0), kn, kn_hs, scratch,                            \
                   out.has_value() ? static_cast<const T*>(v_pages.data_ptr()) : nullptr, attn, amx ? 1 : 0,       \
                   static_cast<float>(k_scale), static_cast<float>(v_scale))
  if (dt == at::kBFloat16) SFI_EVIDENCE(uint16_t);
  else if (dt == at::kFloat) SFI_EVIDENCE(float);
  else if (dt == at::kFloat8_e4m3fn) SFI_EVIDENCE(fp8e4m3);
  else SFI_EVIDENCE(fp8e5m2);
#undef SFI_EVIDENCE
}

// torch.ops.speedsfi.sfi_select_row: sfi_select_row on tensors. sel: [H, >= n_sel] int32 rows of unit
// stride; evidence / key_norms: [H, >= hi] fp32 rows of unit stride; cfg: the 12 constants in
// sfi_select_row's order; exclude: [H, E] int64 contiguous or None.
void select_row_op(const at::Tensor& sel, const at::Tensor& evidence, const at::Tensor& key_norms, int64_t lo,
                   int64_t hi, at::ArrayRef<double> cfg, int64_t nms_radius, int64_t span, int64_t span_back,
                   int64_t n_sel, const std::optional<at::Tensor>& exclude) {
  const int64_t heads = evidence.dim() == 2 ? evidence.size(0) : -1;
  TORCH_CHECK(0 <= lo && lo < hi && 0 < n_sel && n_sel <= hi - lo,
              "sfi_select_row: 0 <= lo < hi and 0 < n_sel <= hi - lo expected, got ", lo, ", ", hi, ", ", n_sel);
  TORCH_CHECK(cfg.size() == 12, "sfi_select_row: 12 constants expected, got ", cfg.size());
  check_row(evidence, "sfi_select_row: evidence", heads, hi, at::kFloat);
  check_row(key_norms, "sfi_select_row: key_norms", heads, hi, at::kFloat);
  check_row(sel, "sfi_select_row: sel", heads, n_sel, at::kInt);
  const int64_t* ex = nullptr;
  int64_t n_ex = 0;
  if (exclude.has_value()) {
    TORCH_CHECK(exclude->device().is_cpu() && exclude->scalar_type() == at::kLong && exclude->is_contiguous() &&
                    exclude->dim() == 2 && exclude->size(0) == heads,
                "sfi_select_row: exclude [", heads, ", E] int64 contiguous expected, got ", exclude->sizes());
    ex = exclude->data_ptr<int64_t>();
    n_ex = exclude->size(1);
  }
  float consts[12];
  for (int i = 0; i < 12; ++i) consts[i] = static_cast<float>(cfg[i]);
  float* scratch = op_scratch((2 * heads + 2) * (hi - lo));
  sfi_select_row(evidence.data_ptr<float>(), evidence.stride(0), key_norms.data_ptr<float>(), key_norms.stride(0),
                 static_cast<int>(heads), lo, hi, consts, static_cast<int>(nms_radius), static_cast<int>(span),
                 static_cast<int>(span_back), n_sel, ex, n_ex, sel.data_ptr<int32_t>(), sel.stride(0), scratch);
}

}  // namespace

TORCH_LIBRARY(speedsfi, m) {
  m.set_python_module("vllm_ext.kernels.cpu_native");
  m.def("sfi_evidence(Tensor(a!) evidence, Tensor(b!)? key_norms, Tensor(c!)? out, Tensor query, Tensor k_pages, "
        "Tensor v_pages, Tensor blocks, int seq, int lo, int hi, int lim, float scale, float alpha, bool amx, "
        "float k_scale=1., float v_scale=1.) -> ()");
  m.def("sfi_select_row(Tensor(a!) sel, Tensor evidence, Tensor key_norms, int lo, int hi, float[] cfg, "
        "int nms_radius, int span, int span_back, int n_sel, Tensor? exclude) -> ()");
}

TORCH_LIBRARY_IMPL(speedsfi, CPU, m) {
  m.impl("sfi_evidence", &evidence_op);
  m.impl("sfi_select_row", &select_row_op);
}
