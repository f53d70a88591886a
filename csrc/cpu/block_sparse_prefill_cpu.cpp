// CritiPrefill's block-sparse prefill on the CPU build (ALGORITHMS.md §3): each query of segment j
// (absolute positions [j * S, (j + 1) * S)) attends to every earlier key when the plan marks the
// segment dense, else to the plan's selected criticality blocks of its KV head, and to its segment's
// own keys up to itself (exact causal mask). vLLM's pages are read in place (the logical layout,
// CPU_ATTN's vec or amx packing: page_views.h).
//
// Work item: a query tile (consecutive queries of one segment) times the GQA group of one KV head,
// so every key tile is read and converted once per group. A key tile is up to kTileKeys keys,
// copied to fp32 (K^T [D][kTileKeys], V [kTileKeys][D], head size padded to a multiple of 16):
// the scores and the weighted sum then run register-blocked over it whatever the page layout or
// dtype. Online softmax in fp32 (base 2: the query is scaled by scale * log2 e).
// Items are costed, ordered longest first and taken from one atomic counter by torch's intra-op
// threads (at::parallel_for), so threads finish together; an item's result never depends on the
// thread that computes it.
// Twin: vllm_ext.kernels.block_sparse_prefill.block_sparse_prefill_torch;
// tests/kernels/test_cpu_block_sparse_prefill.py compares them.
//
// Registered as torch.ops.speedsfi.block_sparse_prefill (the library is defined in sfi_cpu.cpp).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "page_views.h"

namespace {

constexpr int kTileKeys = 64;                   // keys per key tile
constexpr int kTileRows = 64;                   // query rows (queries x group heads) aimed at per item
constexpr int kMaxDim = 256;
constexpr int kRowBlock = 6;                    // rows per register block: 6 x 16 lanes, 12 AVX2 registers

// 8 lanes, one AVX2 register: the register-blocked loops below keep their accumulators in registers
// (cpu_vec.h's 16-lane type spills them on AVX2)
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int kL = 8;
constexpr int kPad = 16;                        // head sizes and key counts are padded to this

inline v8f splat8(float x) { return v8f{} + x; }
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// 2^x in fp32: 0 below -126 (and for -inf); x <= 0 here (scores minus their running maximum)
inline v8f vexp2(v8f x) {
  const v8f lo = splat8(-126.0f), hi = splat8(126.0f), magic = splat8(12582912.0f);   // 1.5 * 2^23
  v8f xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const v8f t = xc + magic;                     // rounded to an integer in the low mantissa bits
  const v8f f = xc - (t - magic);               // [-0.5, 0.5]
  const v8i k = (v8i)t - (v8i)magic;
  // 2^f = e^(f ln 2), Taylor to degree 7: relative error below 1e-8 on [-0.5, 0.5]
  v8f p = splat8(1.5252733804059841e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const v8f r = (v8f)((v8i)p + (k << 23));
  return x < lo ? v8f{} : r;
}

inline float hmax8(v8f v) {
  float r = v[0];
  for (int i = 1; i < kL; ++i) r = v[i] > r ? v[i] : r;
  return r;
}
inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// s[r][0 : 16 * ng] = q_r . K^T (kt: [dp][kTileKeys]) for RB rows of q ([RB][dp])
template <int RB>
void scores_block(const float* q, int dp, const float* kt, int ng, float* s) {
  for (int j = 0; j < ng; ++j) {
    v8f a0[RB], a1[RB];
    for (int r = 0; r < RB; ++r) a0[r] = a1[r] = v8f{};
    const float* kc = kt + j * kPad;
    for (int i = 0; i < dp; ++i) {
      const v8f k0 = load8(kc + i * kTileKeys), k1 = load8(kc + i * kTileKeys + kL);
      for (int r = 0; r < RB; ++r) {
        const v8f qv = splat8(q[r * dp + i]);
        a0[r] += qv * k0;
        a1[r] += qv * k1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      store8(s + r * kTileKeys + j * kPad, a0[r]);
      store8(s + r * kTileKeys + j * kPad + kL, a1[r]);
    }
  }
}

// acc[r][:] += sum_t p[r][t] v[t][:] for RB rows (vt: [n][dp], p: [RB][kTileKeys])
template <int RB>
void weighted_sum_block(const float* p, const float* vt, int n, int dp, float* acc) {
  for (int d0 = 0; d0 < dp; d0 += kPad) {
    v8f a0[RB], a1[RB];
    for (int r = 0; r < RB; ++r) {
      a0[r] = load8(acc + r * dp + d0);
      a1[r] = load8(acc + r * dp + d0 + kL);
    }
    for (int t = 0; t < n; ++t) {
      const v8f v0 = load8(vt + t * dp + d0), v1 = load8(vt + t * dp + d0 + kL);
      for (int r = 0; r < RB; ++r) {
        const v8f w = splat8(p[r * kTileKeys + t]);
        a0[r] += w * v0;
        a1[r] += w * v1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      store8(acc + r * dp + d0, a0[r]);
      store8(acc + r * dp + d0 + kL, a1[r]);
    }
  }
}

void scores(const float* q, int m, int dp, const float* kt, int ng, float* s) {
  int r = 0;
  for (; r + kRowBlock <= m; r += kRowBlock) scores_block<kRowBlock>(q + r * dp, dp, kt, ng, s + r * kTileKeys);
  switch (m - r) {
    case 5: scores_block<5>(q + r * dp, dp, kt, ng, s + r * kTileKeys); break;
    case 4: scores_block<4>(q + r * dp, dp, kt, ng, s + r * kTileKeys); break;
    case 3: scores_block<3>(q + r * dp, dp, kt, ng, s + r * kTileKeys); break;
    case 2: scores_block<2>(q + r * dp, dp, kt, ng, s + r * kTileKeys); break;
    case 1: scores_block<1>(q + r * dp, dp, kt, ng, s + r * kTileKeys); break;
    default: break;
  }
}

void weighted_sum(const float* p, int m, const float* vt, int n, int dp, float* acc) {
  int r = 0;
  for (; r + kRowBlock <= m; r += kRowBlock)
    weighted_sum_block<kRowBlock>(p + r * kTileKeys, vt, n, dp, acc + r * dp);
  switch (m - r) {
    case 5: weighted_sum_block<5>(p + r * kTileKeys, vt, n, dp, acc + r * dp); break;
    case 4: weighted_sum_block<4>(p + r * kTileKeys, vt, n, dp, acc + r * dp); break;
    case 3: weighted_sum_block<3>(p + r * kTileKeys, vt, n, dp, acc + r * dp); break;
    case 2: weighted_sum_block<2>(p + r * kTileKeys, vt, n, dp, acc + r * dp); break;
    case 1: weighted_sum_block<1>(p + r * kTileKeys, vt, n, dp, acc + r * dp); break;
    default: break;
  }
}

// One KV head's pages and one request's block-table row: key runs copied into a key tile.
template <typename T>
struct PageReader {
  const T* kb;
  const T* vb;
  PageViews pg;
  const int32_t* blocks;                        // the request's block-table row
  int64_t h;
  int d, dp;
  T* unpacked;                                  // amx: one page unpacked (K^T [d][bs], V [bs][d])
  const T* unpacked_from = nullptr;

  // keys [p, p + c) (one page) into tile columns / rows [col, col + c)
  void copy_run(int64_t p, int c, int col, float* kt, float* vt) {
    const int64_t bs = pg.bs, o = p % bs;
    const int64_t page = static_cast<int64_t>(blocks[p / bs]) * pg.s_block + h * pg.s_head;
    const T* kp = kb + page;
    const T* vp = vb + page;
    int64_t v_ts = pg.v_ts;
    if (pg.layout == LAYOUT_AMX) {
      if (unpacked_from != kp) {
        unpack_amx_k(kp, static_cast<int>(bs), d, unpacked);
        unpack_amx_v(vp, static_cast<int>(bs), d, unpacked + bs * d);
        unpacked_from = kp;
      }
      kp = unpacked;
      vp = unpacked + bs * d;
      v_ts = d;
    }
    if (pg.layout == LAYOUT_ROWS) {
      for (int x = 0; x < c; ++x) {
        const T* kr = kp + (o + x) * pg.k_ts;
        for (int i = 0; i < d; ++i) kt[i * kTileKeys + col + x] = load(kr + i);
      }
    } else {
      for (int i = 0; i < d; ++i) {
        const T* kr = kp + i * bs + o;
        float* dst = kt + i * kTileKeys + col;
        for (int x = 0; x < c; ++x) dst[x] = load(kr + x);
      }
    }
    for (int x = 0; x < c; ++x) {
      const T* vr = vp + (o + x) * v_ts;
      float* dst = vt + (col + x) * dp;
      for (int i = 0; i < d; ++i) dst[i] = load(vr + i);
    }
  }

  // keys [a, b) (any pages) into the tile from column col
  void copy_range(int64_t a, int64_t b, int col, float* kt, float* vt) {
    while (a < b) {
      const int c = static_cast<int>(std::min<int64_t>(b, (a / pg.bs + 1) * pg.bs) - a);
      copy_run(a, c, col, kt, vt);
      a += c;
      col += c;
    }
  }
};

// The running softmax of one item: rows [m][dp] of q (scaled), acc, and per row max and sum.
struct Rows {
  int m, dp, g;
  int64_t p0;                                   // the first query's absolute position
  float* q;
  float* acc;
  float* mx;
  float* sum;
  float* s;                                     // scores / weights [m][kTileKeys]

  // one key tile of n keys (kt, vt filled, padding zeroed); causal: key kpos0 + t is masked for
  // queries before it
  void attend(const float* kt, const float* vt, int n, bool causal, int64_t kpos0) {
    const int ng = (n + kPad - 1) / kPad, nl = ng * kPad / kL;
    scores(q, m, dp, kt, ng, s);
    for (int r = 0; r < m; ++r) {
      float* sr = s + r * kTileKeys;
      int valid = n;
      if (causal) valid = static_cast<int>(std::clamp<int64_t>(p0 + r / g - kpos0 + 1, 0, n));
      for (int t = valid; t < ng * kPad; ++t) sr[t] = kNegInf;
      v8f vm = splat8(kNegInf);
      for (int j = 0; j < nl; ++j) {
        const v8f v = load8(sr + j * kL);
        vm = v > vm ? v : vm;
      }
      const float m_new = std::max(mx[r], hmax8(vm));
      if (m_new == kNegInf) {                   // nothing visible yet: weights 0
        std::fill(sr, sr + ng * kPad, 0.0f);
        continue;
      }
      const v8f mv = splat8(m_new);
      v8f sv = v8f{};
      for (int j = 0; j < nl; ++j) {
        const v8f e = vexp2(load8(sr + j * kL) - mv);
        store8(sr + j * kL, e);
        sv += e;
      }
      float alpha = 1.0f;
      if (m_new != mx[r]) {
        alpha = vexp2(splat8(mx[r] - m_new))[0];
        float* ar = acc + r * dp;
        const v8f av = splat8(alpha);
        for (int i = 0; i < dp; i += kL) store8(ar + i, load8(ar + i) * av);
      }
      sum[r] = sum[r] * alpha + hsum8(sv);
      mx[r] = m_new;
    }
    weighted_sum(s, m, vt, n, dp, acc);
  }
};

struct Item {
  int32_t r, s_local, h;
  int64_t q0, q1;                               // absolute query positions [q0, q1)
  double cost;
};

struct Plan {
  const int32_t* sel;
  int64_t sel_r, sel_s, sel_h;
  const int32_t* nsel;
  int64_t ns_r, ns_s, ns_h;
  int64_t seg, bk;
};

inline void store_out(uint16_t* p, float f) { *p = to_bf16(f); }
inline void store_out(float* p, float f) { *p = f; }

template <typename T, typename Q>
void run_item(const Item& it, const Q* query, int64_t q_ts, int64_t q_hs, Q* out, int64_t o_ts, int64_t o_hs,
              const int32_t* qsl, const int32_t* seq_lens, const int32_t* table, int64_t t_rs, bool dense,
              const Plan& pl, PageReader<T>& rd, int g, int d, int dp, float qscale, float vscale, float* buf) {
  const int64_t seq = seq_lens[it.r], qs = qsl[it.r], ctx = seq - (qsl[it.r + 1] - qs);
  const int nq = static_cast<int>(it.q1 - it.q0), m = nq * g;
  // buf: the key tile (K^T [dp][kTileKeys], V [kTileKeys][dp]; rows / columns past d stay 0), then the rows
  float* kt = buf;
  float* vt = kt + dp * kTileKeys;
  float* q = vt + kTileKeys * dp;
  Rows rows{m, dp, g, it.q0, q, q + m * dp, q + 2 * m * dp, q + 2 * m * dp + m, q + 2 * m * dp + 2 * m};
  rd.blocks = table + it.r * t_rs;
  rd.h = it.h;
  // rows: query qi, group head gg -> row qi * g + gg
  std::fill(rows.q, rows.q + 2 * m * dp, 0.0f);
  for (int qi = 0; qi < nq; ++qi)
    for (int gg = 0; gg < g; ++gg) {
      const Q* src = query + (qs + it.q0 + qi - ctx) * q_ts + (it.h * g + gg) * q_hs;
      float* dst = rows.q + (qi * g + gg) * dp;
      for (int i = 0; i < d; ++i) dst[i] = load(src + i) * qscale;
    }
  std::fill(rows.mx, rows.mx + m, kNegInf);
  std::fill(rows.sum, rows.sum + m, 0.0f);
  const int64_t s0 = (it.q0 / pl.seg) * pl.seg;
  // columns / rows past n hold earlier keys: their scores are masked, their values never read
  auto flush = [&](int& n, bool causal, int64_t kpos0) {
    if (n == 0) return;
    rows.attend(kt, vt, n, causal, kpos0);
    n = 0;
  };
  int n = 0;
  // keys before the segment: all of them (dense), or the selected blocks of this KV head
  if (dense) {
    for (int64_t a = 0; a < s0; a += kTileKeys) {
      const int64_t b = std::min<int64_t>(s0, a + kTileKeys);
      rd.copy_range(a, b, 0, kt, vt);
      n = static_cast<int>(b - a);
      flush(n, false, 0);
    }
  } else {
    const int32_t* sel = pl.sel + it.r * pl.sel_r + it.s_local * pl.sel_s + it.h * pl.sel_h;
    const int64_t ns = pl.nsel[it.r * pl.ns_r + it.s_local * pl.ns_s + it.h * pl.ns_h];
    for (int64_t e = 0; e < ns; ++e) {
      int64_t a = static_cast<int64_t>(sel[e]) * pl.bk;
      const int64_t b = a + pl.bk;
      while (a < b) {
        const int64_t c = std::min<int64_t>(b - a, kTileKeys - n);
        rd.copy_range(a, a + c, n, kt, vt);
        n += static_cast<int>(c);
        a += c;
        if (n == kTileKeys) flush(n, false, 0);
      }
    }
    flush(n, false, 0);
  }
  // the segment's own keys up to the tile's last query
  for (int64_t a = s0; a < it.q1; a += kTileKeys) {
    const int64_t b = std::min<int64_t>(it.q1, a + kTileKeys);
    rd.copy_range(a, b, 0, kt, vt);
    n = static_cast<int>(b - a);
    flush(n, b - 1 > it.q0, a);
  }
  for (int qi = 0; qi < nq; ++qi)
    for (int gg = 0; gg < g; ++gg) {
      const int r = qi * g + gg;
      const float inv = rows.sum[r] > 0.0f ? vscale / rows.sum[r] : 0.0f;
      const float* a = rows.acc + r * dp;
      Q* dst = out + (qs + it.q0 + qi - ctx) * o_ts + (it.h * g + gg) * o_hs;
      for (int i = 0; i < d; ++i) store_out(dst + i, a[i] * inv);
    }
}

template <typename T, typename Q>
void run_items(const std::vector<Item>& items, const Q* query, int64_t q_ts, int64_t q_hs, Q* out, int64_t o_ts,
               int64_t o_hs, const T* kb, const T* vb, const PageViews& pg, const int32_t* qsl,
               const int32_t* seq_lens, const int32_t* table, int64_t t_rs, const bool* dense, int64_t dn_r,
               int64_t dn_s, const Plan& pl, int g, int d, float qscale, float vscale) {
  const int dp = (d + kPad - 1) / kPad * kPad;
  int max_rows = 0;
  for (const Item& it : items) max_rows = std::max(max_rows, static_cast<int>(it.q1 - it.q0) * g);
  const int64_t floats = 2 * static_cast<int64_t>(max_rows) * dp + 2 * max_rows +
                         static_cast<int64_t>(max_rows) * kTileKeys + 2 * static_cast<int64_t>(dp) * kTileKeys;
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    float* buf = scratch_floats(floats);
    std::fill(buf, buf + 2 * static_cast<int64_t>(dp) * kTileKeys, 0.0f);
    T* unpacked = pg.layout == LAYOUT_AMX ? scratch_of<T>(2 * pg.bs * d) : nullptr;
    PageReader<T> rd{kb, vb, pg, nullptr, 0, d, dp, unpacked};
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      rd.unpacked_from = nullptr;
      run_item<T, Q>(it, query, q_ts, q_hs, out, o_ts, o_hs, qsl, seq_lens, table, t_rs,
                     dense[it.r * dn_r + it.s_local * dn_s], pl, rd, g, d, dp, qscale, vscale, buf);
    }
  });
}

void check_cpu(const at::Tensor& t, const char* what, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim, "block_sparse_prefill: ", what,
              ": a ", dim, "-d ", dtype, " tensor on the CPU expected, got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
}

// torch.ops.speedsfi.block_sparse_prefill. out / query: [T, Hq, D] bf16 or fp32 (one dtype), unit
// stride in D; rows query_start_loc[0] .. query_start_loc[R] written. k_pages / v_pages: vLLM's pages
// (page_views.h): bf16, fp32 or fp8 (e4m3, e5m2), with k_scale / v_scale the layer's per-tensor scales
// of fp8 pages (1 otherwise): k_scale folds into the score scale, v_scale into the normalised output.
// block_table [R, >= ceil(seq / bs)] int32; query_start_loc [R + 1], seq_lens [R] int32 (the chunk's
// K/V already in the pages). The plan (vllm_ext.methods.critiprefill.plan):
// sel_blocks int32 [R, S, Hkv, W], num_sel int32 [R, S, Hkv], dense bool [R, S], indexed by the
// segment's place in its chunk (segment ctx / segment_size first); block_size: the plan's
// criticality block.
void block_sparse_prefill_op(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_pages,
                             const at::Tensor& v_pages, const at::Tensor& block_table,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& sel_blocks, const at::Tensor& num_sel, const at::Tensor& dense,
                             int64_t segment_size, int64_t block_size, double scale, bool amx, double k_scale,
                             double v_scale) {
  const at::ScalarType qt = query.scalar_type(), dt = k_pages.scalar_type();
  TORCH_CHECK(qt == at::kBFloat16 || qt == at::kFloat, "block_sparse_prefill: bf16 or fp32 query expected, got ", qt);
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2,
              "block_sparse_prefill: bf16, fp32, float8_e4m3fn or float8_e5m2 pages expected, got ", dt);
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "block_sparse_prefill: positive k_scale and v_scale expected, got ",
              k_scale, " / ", v_scale);
  check_cpu(query, "query", qt, 3);
  check_cpu(out, "out", qt, 3);
  TORCH_CHECK(out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1,
              "block_sparse_prefill: out and query [T, Hq, D] with unit stride in D expected, got ", out.sizes(),
              " / ", query.sizes());
  const int64_t t_all = query.size(0), hq = query.size(1), d = query.size(2);
  const PageViews pg = page_views(k_pages, v_pages, amx, "block_sparse_prefill");
  const int64_t hkv = pg.heads, bs = pg.bs;
  TORCH_CHECK(pg.d == d && hkv > 0 && hq % hkv == 0 && d <= kMaxDim, "block_sparse_prefill: pages of head size ",
              pg.d, " and ", hkv, " KV heads for a query ", query.sizes());
  TORCH_CHECK(segment_size > 0 && block_size > 0 && segment_size % block_size == 0,
              "block_sparse_prefill: the segment size (", segment_size, ") must be a multiple of the block size (",
              block_size, ")");
  check_cpu(block_table, "block_table", at::kInt, 2);
  check_cpu(query_start_loc, "query_start_loc", at::kInt, 1);
  check_cpu(seq_lens, "seq_lens", at::kInt, 1);
  const int64_t rows = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == rows + 1 && query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_table.size(0) >= rows && block_table.stride(1) == 1,
              "block_sparse_prefill: query_start_loc [R + 1], seq_lens [R], block_table [R, W] expected");
  check_cpu(sel_blocks, "sel_blocks", at::kInt, 4);
  check_cpu(num_sel, "num_sel", at::kInt, 3);
  check_cpu(dense, "dense", at::kBool, 2);
  const int64_t s_max = dense.size(1), width = sel_blocks.size(3);
  TORCH_CHECK(sel_blocks.size(0) == rows && sel_blocks.size(1) == s_max && sel_blocks.size(2) == hkv &&
                  num_sel.size(0) == rows && num_sel.size(1) == s_max && num_sel.size(2) == hkv &&
                  dense.size(0) == rows,
              "block_sparse_prefill: a plan of ", rows, " rows and ", hkv, " KV heads expected, got sel_blocks ",
              sel_blocks.sizes(), ", num_sel ", num_sel.sizes(), ", dense ", dense.sizes());
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const bool* dn = dense.data_ptr<bool>();
  const Plan pl{sel_blocks.data_ptr<int32_t>(), sel_blocks.stride(0), sel_blocks.stride(1), sel_blocks.stride(2),
                num_sel.data_ptr<int32_t>(), num_sel.stride(0), num_sel.stride(1), num_sel.stride(2),
                segment_size, block_size};
  TORCH_CHECK(sel_blocks.stride(3) == 1, "block_sparse_prefill: sel_blocks with unit stride in its last axis");
  // the items, every index they read checked here (the pass itself trusts them)
  const int g = static_cast<int>(hq / hkv);
  const int64_t bq = std::max<int64_t>(1, kTileRows / g);
  std::vector<Item> items;
  TORCH_CHECK(qsl[0] >= 0 && qsl[rows] <= t_all, "block_sparse_prefill: query_start_loc outside the query's ",
              t_all, " rows");
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qs = qsl[r], ql = qsl[r + 1] - qs, seq = sl[r];
    TORCH_CHECK(ql >= 0 && ql <= seq, "block_sparse_prefill: row ", r, ": ", ql, " queries for ", seq, " tokens");
    if (ql == 0) continue;
    const int64_t ctx = seq - ql, first = ctx / segment_size;
    TORCH_CHECK((seq - 1) / bs < block_table.size(1), "block_sparse_prefill: row ", r, " reads past its block table");
    for (int64_t j = 0; j <= (seq - 1) / bs; ++j) {
      const int32_t b = bt[r * block_table.stride(0) + j];
      TORCH_CHECK(b >= 0 && b < pg.blocks, "block_sparse_prefill: block id ", b, " outside [0, ", pg.blocks, ")");
    }
    for (int64_t j = first; j <= (seq - 1) / segment_size; ++j) {
      const int64_t s_local = j - first, s0 = j * segment_size;
      TORCH_CHECK(s_local < s_max, "block_sparse_prefill: row ", r, " has more segments than the plan's ", s_max);
      const bool is_dense = dn[r * dense.stride(0) + s_local * dense.stride(1)];
      const int64_t lo = std::max(ctx, s0), hi = std::min(seq, s0 + segment_size);
      double before = static_cast<double>(s0);
      for (int64_t h = 0; h < hkv; ++h) {
        if (is_dense) break;
        const int64_t ns = pl.nsel[r * pl.ns_r + s_local * pl.ns_s + h * pl.ns_h];
        TORCH_CHECK(ns >= 0 && ns <= width, "block_sparse_prefill: num_sel ", ns, " outside [0, ", width, "]");
        const int32_t* sel = pl.sel + r * pl.sel_r + s_local * pl.sel_s + h * pl.sel_h;
        for (int64_t e = 0; e < ns; ++e)
          TORCH_CHECK(sel[e] >= 0 && (sel[e] + 1) * block_size <= s0, "block_sparse_prefill: selected block ",
                      sel[e], " of row ", r, ", segment ", j, " is not before the segment's start ", s0);
        if (h == 0) before = 0.0;
        before = std::max(before, static_cast<double>(ns * block_size));
      }
      for (int64_t q0 = lo; q0 < hi; q0 += bq) {
        const int64_t q1 = std::min(hi, q0 + bq);
        const double cost = static_cast<double>(q1 - q0) * (before + static_cast<double>(q1 - s0) + kTileKeys);
        for (int64_t h = 0; h < hkv; ++h)
          items.push_back(Item{static_cast<int32_t>(r), static_cast<int32_t>(s_local), static_cast<int32_t>(h), q0,
                               q1, cost});
      }
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  // scores in base 2; q . (k_scale k) = k_scale (q . k)
  const float qscale = static_cast<float>(scale * k_scale) * 1.4426950408889634f;
  const float vscale = static_cast<float>(v_scale);
#define SPEEDSFI_BSP(T, Q)                                                                                      \
  run_items<T, Q>(items, static_cast<const Q*>(query.data_ptr()), query.stride(0), query.stride(1),             \
                  static_cast<Q*>(out.data_ptr()), out.stride(0), out.stride(1),                                 \
                  static_cast<const T*>(k_pages.data_ptr()), static_cast<const T*>(v_pages.data_ptr()), pg, qsl, \
                  sl, bt, block_table.stride(0), dn, dense.stride(0), dense.stride(1), pl, g, static_cast<int>(d), \
                  qscale, vscale)
#define SPEEDSFI_BSP_Q(T)                                   \
  if (qt == at::kBFloat16) SPEEDSFI_BSP(T, uint16_t);       \
  else SPEEDSFI_BSP(T, float)
  if (dt == at::kBFloat16) SPEEDSFI_BSP_Q(uint16_t);
  else if (dt == at::kFloat) SPEEDSFI_BSP_Q(float);
  else if (dt == at::kFloat8_e4m3fn) SPEEDSFI_BSP_Q(fp8e4m3);
  else SPEEDSFI_BSP_Q(fp8e5m2);
#undef SPEEDSFI_BSP_Q
#undef SPEEDSFI_BSP
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedsfi, m) {
  m.def("block_sparse_prefill(Tensor(a!) out, Tensor query, Tensor k_pages, Tensor v_pages, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor sel_blocks, Tensor num_sel, Tensor dense, "
        "int segment_size, int block_size, float scale, bool amx, float k_scale=1., float v_scale=1.) -> ()");
}

TORCH_LIBRARY_IMPL(speedsfi, CPU, m) {
  m.impl("block_sparse_prefill", &block_sparse_prefill_op);
}
