// SFI's fast step on the CPU build: every fast row of a layer in one pass, each (row, KV head) over
// its compact segment (sink + selected, SFI's own pages) and its recent window (vLLM's pages, read
// in place: CPU_ATTN's vec or amx packing, or the logical layout), one softmax over both segments
// in fp32 (ALGORITHMS.md §1, "Fast step"). The (row, KV head) pairs are shared among the threads the
// way CPU_ATTN shares its work (at::parallel_for over torch's intra-op threads).
// Twin: vllm_ext.kernels.two_segment_decode.two_segment_decode_cpu; tests/kernels/test_cpu_native.py
// compares them over a grid (layouts, dtypes, group sizes, head sizes, block sizes, empty segments).
//
// Registered as torch.ops.speedsfi.two_segment_decode (the library is defined in sfi_cpu.cpp; built
// and loaded with it by vllm_ext/kernels/cpu_native.py).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "page_views.h"

namespace {

constexpr int kMaxDim = 256;

inline float tree_sum(v16f v) {
  typedef float v8f __attribute__((vector_size(32)));
  typedef float v4f __attribute__((vector_size(16)));
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// s[g * ss + t] = scale * q_g . k_t for n keys stored as rows (key t at k + t * ts)
template <typename T, int G, int NV>
void score_rows_g(const T* k, int64_t ts, int64_t n, const float* q, float scale, float* s, int64_t ss) {
  constexpr int D = NV * kLanes;
  v16f qv[G][NV];
  for (int gg = 0; gg < G; ++gg)
    for (int j = 0; j < NV; ++j) qv[gg][j] = load16(q + gg * D + j * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const T* kt = k + t * ts;
    v16f kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = load16(kt + j * kLanes);
    for (int gg = 0; gg < G; ++gg) {
      v16f a = qv[gg][0] * kv[0];
      for (int j = 1; j < NV; ++j) a += qv[gg][j] * kv[j];
      s[gg * ss + t] = tree_sum(a) * scale;
    }
  }
}

template <typename T>
void score_rows_any(const T* k, int64_t ts, int64_t n, int g, int d, const float* q, float scale, float* s,
                    int64_t ss) {
  for (int64_t t = 0; t < n; ++t)
    for (int gg = 0; gg < g; ++gg) {
      float a = 0.0f;
      for (int i = 0; i < d; ++i) a += q[gg * d + i] * load(k + t * ts + i);
      s[gg * ss + t] = a * scale;
    }
}

// s[g * ss + t] = scale * q_g . k_t, t in [0, n), from one page of K^T (dim i, token t at kt + i * bs + t)
template <typename T, int G>
void score_cols_g(const T* kt, int bs, int d, int64_t n, const float* q, float scale, float* s, int64_t ss) {
  float sc[G * 16];
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    score_cols16<T, G, false>(kt, bs, d, t0, q, sc, nullptr);
    const int64_t m = std::min<int64_t>(16, n - t0);
    for (int gg = 0; gg < G; ++gg)
      for (int64_t t = 0; t < m; ++t) s[gg * ss + t0 + t] = sc[gg * 16 + t] * scale;
  }
}

template <typename T>
void score_cols_any(const T* kt, int bs, int d, int64_t n, int g, const float* q, float scale, float* s,
                    int64_t ss) {
  for (int64_t t = 0; t < n; ++t)
    for (int gg = 0; gg < g; ++gg) {
      float a = 0.0f;
      for (int i = 0; i < d; ++i) a += q[gg * d + i] * load(kt + static_cast<int64_t>(i) * bs + t);
      s[gg * ss + t] = a * scale;
    }
}

// acc[g, :] += sum_t w[g * ws + t] v_t for n values stored as rows (value t at v + t * ts)
template <typename T, int G, int NV>
void accumulate_rows_g(const T* v, int64_t ts, int64_t n, const float* w, int64_t ws, float* acc) {
  accumulate_weighted<T, G, NV * kLanes>(v, ts, n, w, ws, acc);
}

template <typename T>
void accumulate_rows_any(const T* v, int64_t ts, int64_t n, int g, int d, const float* w, int64_t ws,
                         float* acc) {
  for (int64_t t = 0; t < n; ++t)
    for (int gg = 0; gg < g; ++gg) {
      const float wt = w[gg * ws + t];
      for (int i = 0; i < d; ++i) acc[gg * d + i] += wt * load(v + t * ts + i);
    }
}

// The kernels a (group, head size) pair runs: the register-blocked ones for head sizes that are
// multiples of 16 up to kMaxDim, else the plain loops.
template <typename T>
struct Kernels {
  void (*rows)(const T*, int64_t, int64_t, const float*, float, float*, int64_t) = nullptr;
  void (*cols)(const T*, int, int, int64_t, const float*, float, float*, int64_t) = nullptr;
  void (*acc)(const T*, int64_t, int64_t, const float*, int64_t, float*) = nullptr;
};

template <typename T, int G, int NV>
void set_fixed(Kernels<T>& k) {
  k.rows = &score_rows_g<T, G, NV>;
  k.cols = &score_cols_g<T, G>;
  k.acc = &accumulate_rows_g<T, G, NV>;
}

template <typename T, int G>
void set_for_dim(Kernels<T>& k, int d) {
  switch (d) {
    case 16: set_fixed<T, G, 1>(k); break;
    case 32: set_fixed<T, G, 2>(k); break;
    case 64: set_fixed<T, G, 4>(k); break;
    case 128: set_fixed<T, G, 8>(k); break;
    case 256: set_fixed<T, G, 16>(k); break;
    default: break;                                   // 48, 80, 96, ...: the plain loops
  }
}

template <typename T>
Kernels<T> kernels_for(int g, int d) {
  Kernels<T> k;
  switch (g) {
    case 1: set_for_dim<T, 1>(k, d); break;
    case 2: set_for_dim<T, 2>(k, d); break;
    case 3: set_for_dim<T, 3>(k, d); break;
    case 4: set_for_dim<T, 4>(k, d); break;
    case 5: set_for_dim<T, 5>(k, d); break;
    case 6: set_for_dim<T, 6>(k, d); break;
    case 7: set_for_dim<T, 7>(k, d); break;
    case 8: set_for_dim<T, 8>(k, d); break;
    default: break;
  }
  return k;
}

inline void store(uint16_t* p, float f) { *p = to_bf16(f); }
inline void store(float* p, float f) { *p = f; }
inline float load_q(const uint16_t* p) { return load(p); }
inline float load_q(const float* p) { return *p; }

struct Compact {                                      // the compact segments: [blocks, Hkv, cbs, 2D]
  int64_t s_block, s_head, ts;
  int cbs;
  const int32_t* table;                               // [slots, >= cap / cbs] with row stride t_rs
  int64_t t_rs;
  int64_t slots, cap;
};

// One (row, KV head): out[g, :] (fp32, [G, D]) = softmax over the compact entries [0, clen) and the
// recent positions [rs, re) of q_g . k, times V. scratch: G * (clen + re - rs + bs + 1) floats; the
// amx pages unpack into a per-thread copy.
template <typename T>
void attend_head(const Kernels<T>& kn, const T* kb, const T* vb, const PageViews& pg, const int32_t* blocks,
                 int64_t rs, int64_t re, const T* cb, const Compact& cp, const int32_t* ctab, int64_t clen,
                 int h, int g, int d, const float* q, float scale, float* out) {
  const int64_t n = clen + std::max<int64_t>(re - rs, 0);
  const int bs = static_cast<int>(pg.bs);
  float* s = scratch_floats(static_cast<int64_t>(g) * (n + bs + 1));
  float* page_s = s + static_cast<int64_t>(g) * n;                // one page's scores [G, bs]
  float* iz = page_s + static_cast<int64_t>(g) * bs;              // 1 / the softmax's sum, per head
  T* unpacked = pg.layout == LAYOUT_AMX ? scratch_of<T>(2 * static_cast<int64_t>(bs) * d) : nullptr;
  // scores of the compact segment: rows of its pages (K and V of a row side by side: the next page is
  // asked for whole, its V read by the second pass below)
  const int64_t c_page_bytes = sizeof(T) * cp.cbs * cp.ts;
  for (int64_t c0 = 0; c0 < clen; c0 += cp.cbs) {
    const int64_t m = std::min<int64_t>(cp.cbs, clen - c0);
    const T* page = cb + static_cast<int64_t>(ctab[c0 / cp.cbs]) * cp.s_block + h * cp.s_head;
    if (c0 + cp.cbs < clen)
      prefetch_bytes(cb + static_cast<int64_t>(ctab[c0 / cp.cbs + 1]) * cp.s_block + h * cp.s_head, c_page_bytes);
    if (kn.rows) kn.rows(page, cp.ts, m, q, scale, s + c0, n);
    else score_rows_any(page, cp.ts, m, g, d, q, scale, s + c0, n);
  }
  // scores of the recent window, a page at a time
  const int64_t k_page_bytes = sizeof(T) * bs * d;
  for (int64_t p = rs; p < re;) {
    const int64_t j = p / bs, p0 = j * bs, a = p - p0, b = std::min<int64_t>(re - p0, bs);
    const T* page = kb + static_cast<int64_t>(blocks[j]) * pg.s_block + h * pg.s_head;
    if (p0 + bs < re) prefetch_bytes(kb + static_cast<int64_t>(blocks[j + 1]) * pg.s_block + h * pg.s_head, k_page_bytes);
    float* dst = s + clen + (p - rs);
    if (pg.layout == LAYOUT_ROWS) {
      if (kn.rows) kn.rows(page + a * pg.k_ts, pg.k_ts, b - a, q, scale, dst, n);
      else score_rows_any(page + a * pg.k_ts, pg.k_ts, b - a, g, d, q, scale, dst, n);
    } else {
      if (pg.layout == LAYOUT_AMX) {
        unpack_amx_k(page, bs, d, unpacked);
        page = unpacked;
      }
      if (kn.cols && bs % kLanes == 0) kn.cols(page, bs, d, b, q, scale, page_s, bs);
      else score_cols_any(page, bs, d, b, g, q, scale, page_s, bs);
      for (int gg = 0; gg < g; ++gg) std::memcpy(dst + gg * n, page_s + gg * bs + a, (b - a) * sizeof(float));
    }
    p = p0 + b;
  }
  // one softmax over both segments
  std::fill(out, out + static_cast<int64_t>(g) * d, 0.0f);
  for (int gg = 0; gg < g; ++gg) {
    float* sg = s + gg * n;
    const float mx = max_v(sg, n);
    exp_shifted(sg, mx, sg, n);
    iz[gg] = 1.0f / sum_v(sg, n);
  }
  for (int64_t c0 = 0; c0 < clen; c0 += cp.cbs) {
    const int64_t m = std::min<int64_t>(cp.cbs, clen - c0);
    const T* page = cb + static_cast<int64_t>(ctab[c0 / cp.cbs]) * cp.s_block + h * cp.s_head + d;
    if (kn.acc) kn.acc(page, cp.ts, m, s + c0, n, out);
    else accumulate_rows_any(page, cp.ts, m, g, d, s + c0, n, out);
  }
  for (int64_t p = rs; p < re;) {
    const int64_t j = p / bs, p0 = j * bs, a = p - p0, b = std::min<int64_t>(re - p0, bs);
    const T* page = vb + static_cast<int64_t>(blocks[j]) * pg.s_block + h * pg.s_head;
    if (p0 + bs < re) prefetch_bytes(vb + static_cast<int64_t>(blocks[j + 1]) * pg.s_block + h * pg.s_head, k_page_bytes);
    int64_t ts = pg.v_ts;
    if (pg.layout == LAYOUT_AMX) {
      unpack_amx_v(page, bs, d, unpacked + static_cast<int64_t>(bs) * d);
      page = unpacked + static_cast<int64_t>(bs) * d;
      ts = d;
    }
    const float* w = s + clen + (p - rs);
    if (kn.acc) kn.acc(page + a * ts, ts, b - a, w, n, out);
    else accumulate_rows_any(page + a * ts, ts, b - a, g, d, w, n, out);
    p = p0 + b;
  }
  for (int gg = 0; gg < g; ++gg)
    for (int i = 0; i < d; ++i) out[gg * d + i] *= iz[gg];
}

template <typename T, typename Q>
void two_segment_rows(Q* out, const Q* query, int64_t q_rs, int64_t q_hs, int64_t o_rs, int64_t o_hs, const T* kb,
                      const T* vb, const PageViews& pg, const int32_t* table, int64_t t_rs, const int32_t* seq_lens,
                      const int32_t* recent_start, const T* cb, const Compact& cp, const int32_t* compact_len,
                      const int32_t* slot_idx, const bool* row_mask, int64_t rows, int hkv, int g, int d,
                      int64_t window, float scale, float k_scale, float v_scale) {
  const Kernels<T> kn = kernels_for<T>(g, d);
  at::parallel_for(0, rows * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(static_cast<size_t>(g) * d), of(static_cast<size_t>(g) * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / hkv;
      const int h = static_cast<int>(item % hkv);
      const int64_t seq = seq_lens[r];
      if (seq <= 0 || (row_mask != nullptr && !row_mask[r])) continue;
      const int64_t slot = slot_idx[r];
      const int64_t clen = (slot < 0 || slot >= cp.slots) ? 0 : std::clamp<int64_t>(compact_len[slot], 0, cp.cap);
      const int64_t rs = std::clamp<int64_t>(recent_start[r], 0, seq);
      const int64_t re = std::min<int64_t>(seq, rs + window);
      Q* o = out + r * o_rs + static_cast<int64_t>(h) * g * o_hs;
      if (clen + std::max<int64_t>(re - rs, 0) == 0) {
        for (int gg = 0; gg < g; ++gg)
          for (int i = 0; i < d; ++i) store(o + gg * o_hs + i, 0.0f);
        continue;
      }
      const Q* qr = query + r * q_rs + static_cast<int64_t>(h) * g * q_hs;
      for (int gg = 0; gg < g; ++gg)
        for (int i = 0; i < d; ++i) qf[gg * d + i] = load_q(qr + gg * q_hs + i);
      const int32_t* ctab = clen ? cp.table + slot * cp.t_rs : nullptr;
      attend_head(kn, kb, vb, pg, table + r * t_rs, rs, re, cb, cp, ctab, clen, h, g, d, qf.data(),
                  scale * k_scale, of.data());
      for (int gg = 0; gg < g; ++gg)
        for (int i = 0; i < d; ++i) store(o + gg * o_hs + i, of[gg * d + i] * v_scale);
    }
  });
}

void check_cpu(const at::Tensor& t, const char* what, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim, "two_segment_decode: ", what,
              ": a ", dim, "-d ", dtype, " tensor on the CPU expected, got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
}

// torch.ops.speedsfi.two_segment_decode. out / query: [R, Hq, D] bf16 or fp32 (one dtype), unit stride in
// D. k_pages / v_pages: K and V of vLLM's pages over one storage: the logical layout ([blocks, Hkv, bs,
// D] views of [..., 2D] rows: K and V with unit stride in D), CPU_ATTN's vec packing (K^T per page:
// strides [.., .., 1, bs]; V [.., .., D, 1]) or with amx its 6-d VNNI views (sfi_evidence's); one dtype,
// the compact segment's. block_table: [R, >= ceil(seq / bs)] int32; seq_lens, recent_start, slot_idx:
// [R] int32; compact_kv: [blocks, Hkv, cbs, 2D] (K in [..., :D], V in [..., D:], unit stride in the last
// axis); compact_table: [>= slots, >= cap / cbs] int32 (cap: the entries a slot holds); compact_len:
// [>= slots] int32 (a row's slot outside both: no compact segment); row_mask: [R] bool or None.
// window: the recent window's length. k_scale / v_scale: the layer's per-tensor scales of fp8 pages
// (K = stored K * k_scale, folded into the score scale; V likewise, into the output); 1 otherwise.
void two_segment_decode_op(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_pages,
                           const at::Tensor& v_pages, const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const at::Tensor& recent_start, const at::Tensor& compact_kv,
                           const at::Tensor& compact_table, int64_t cap, const at::Tensor& compact_len,
                           const at::Tensor& slot_idx, const std::optional<at::Tensor>& row_mask, int64_t window,
                           double scale, bool amx, double k_scale, double v_scale) {
  const at::ScalarType qt = query.scalar_type(), dt = k_pages.scalar_type();
  TORCH_CHECK(qt == at::kBFloat16 || qt == at::kFloat, "two_segment_decode: bf16 or fp32 query expected, got ", qt);
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2,
              "two_segment_decode: bf16, fp32, float8_e4m3fn or float8_e5m2 pages expected, got ", dt);
  TORCH_CHECK(k_scale > 0.0 && v_scale > 0.0, "two_segment_decode: positive k_scale and v_scale expected, got ",
              k_scale, ", ", v_scale);
  check_cpu(query, "query", qt, 3);
  check_cpu(out, "out", qt, 3);
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2);
  TORCH_CHECK(out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1,
              "two_segment_decode: out and query [R, Hq, D] with unit stride in D expected, got ", out.sizes(),
              " / ", query.sizes());
  const PageViews pg = page_views(k_pages, v_pages, amx, "two_segment_decode");
  const int64_t hkv = pg.heads, bs = pg.bs;
  TORCH_CHECK(pg.d == d && hkv > 0 && hq % hkv == 0 && d <= kMaxDim,
              "two_segment_decode: pages of head size ", pg.d, " and ", hkv, " KV heads for a query ", query.sizes());
  check_cpu(block_table, "block_table", at::kInt, 2);
  TORCH_CHECK(block_table.size(0) >= rows && block_table.stride(1) == 1, "two_segment_decode: block_table [R, W]");
  for (const at::Tensor* t : {&seq_lens, &recent_start, &slot_idx}) {
    check_cpu(*t, "seq_lens / recent_start / slot_idx", at::kInt, 1);
    TORCH_CHECK(t->size(0) >= rows && t->is_contiguous(), "two_segment_decode: [R] int32 rows expected");
  }
  check_cpu(compact_kv, "compact_kv", dt, 4);
  TORCH_CHECK(compact_kv.size(1) == hkv && compact_kv.size(3) == 2 * d && compact_kv.stride(3) == 1,
              "two_segment_decode: compact_kv [blocks, ", hkv, ", cbs, ", 2 * d, "] expected, got ", compact_kv.sizes());
  check_cpu(compact_table, "compact_table", at::kInt, 2);
  check_cpu(compact_len, "compact_len", at::kInt, 1);
  const int64_t cbs = compact_kv.size(2);
  TORCH_CHECK(compact_table.stride(1) == 1 && compact_table.size(1) * cbs >= cap && compact_len.is_contiguous(),
              "two_segment_decode: compact_table [slots, >= ", cap, " / ", cbs, "] with unit stride and a "
              "contiguous compact_len expected, got ", compact_table.sizes(), " / ", compact_len.sizes());
  if (row_mask.has_value()) {
    check_cpu(*row_mask, "row_mask", at::kBool, 1);
    TORCH_CHECK(row_mask->size(0) >= rows && row_mask->is_contiguous(), "two_segment_decode: row_mask [R]");
  }
  TORCH_CHECK(window >= 0 && cap >= 0, "two_segment_decode: window and cap >= 0 expected");
  // every block id a row can read, checked here (the pass itself trusts them)
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* rst = recent_start.data_ptr<int32_t>();
  const int32_t* sid = slot_idx.data_ptr<int32_t>();
  const int32_t* cl = compact_len.data_ptr<int32_t>();
  const int32_t* ct = compact_table.data_ptr<int32_t>();
  const bool* mask = row_mask.has_value() ? row_mask->data_ptr<bool>() : nullptr;
  // a slot has a table row and a length (vLLM's paged table has one row more: a scratch slot)
  const int64_t nb_all = pg.blocks, cb_all = compact_kv.size(0),
                slots = std::min(compact_table.size(0), compact_len.size(0));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seq = sl[r];
    if (seq <= 0 || (mask != nullptr && !mask[r])) continue;
    const int64_t rs = std::clamp<int64_t>(rst[r], 0, seq), re = std::min<int64_t>(seq, rs + window);
    if (re > rs) {
      TORCH_CHECK((re - 1) / bs < block_table.size(1), "two_segment_decode: row ", r, " reads past its block table");
      for (int64_t j = rs / bs; j <= (re - 1) / bs; ++j) {
        const int32_t b = bt[r * block_table.stride(0) + j];
        TORCH_CHECK(b >= 0 && b < nb_all, "two_segment_decode: block id ", b, " outside [0, ", nb_all, ")");
      }
    }
    const int64_t slot = sid[r];
    if (slot < 0 || slot >= slots) continue;
    const int64_t clen = std::clamp<int64_t>(cl[slot], 0, cap);
    for (int64_t j = 0; j * cbs < clen; ++j) {
      const int32_t b = ct[slot * compact_table.stride(0) + j];
      TORCH_CHECK(b >= 0 && b < cb_all, "two_segment_decode: compact block id ", b, " outside [0, ", cb_all, ")");
    }
  }
  const auto cks = compact_kv.strides();
  Compact cp{cks[0], cks[1], cks[2], static_cast<int>(cbs), ct, compact_table.stride(0), slots, cap};
  const int g = static_cast<int>(hq / hkv);
  const float sc = static_cast<float>(scale);
#define SFI_TWO_SEGMENT(T, Q)                                                                                    \
  two_segment_rows<T, Q>(static_cast<Q*>(out.data_ptr()), static_cast<const Q*>(query.data_ptr()), query.stride(0), \
                         query.stride(1), out.stride(0), out.stride(1), static_cast<const T*>(k_pages.data_ptr()),  \
                         static_cast<const T*>(v_pages.data_ptr()), pg, bt, block_table.stride(0), sl, rst,         \
                         static_cast<const T*>(compact_kv.data_ptr()), cp, cl, sid, mask, rows,                    \
                         static_cast<int>(hkv), g, static_cast<int>(d), window, sc, ksc, vsc)
#define SFI_TWO_SEGMENT_Q(T) \
  if (qt == at::kBFloat16) SFI_TWO_SEGMENT(T, uint16_t); else SFI_TWO_SEGMENT(T, float)
  const float ksc = static_cast<float>(k_scale), vsc = static_cast<float>(v_scale);
  if (dt == at::kBFloat16) SFI_TWO_SEGMENT_Q(uint16_t);
  else if (dt == at::kFloat) SFI_TWO_SEGMENT_Q(float);
  else if (dt == at::kFloat8_e4m3fn) SFI_TWO_SEGMENT_Q(fp8e4m3);
  else SFI_TWO_SEGMENT_Q(fp8e5m2);
#undef SFI_TWO_SEGMENT_Q
#undef SFI_TWO_SEGMENT
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedsfi, m) {
  m.def("two_segment_decode(Tensor(a!) out, Tensor query, Tensor k_pages, Tensor v_pages, Tensor block_table, "
        "Tensor seq_lens, Tensor recent_start, Tensor compact_kv, Tensor compact_table, int cap, "
        "Tensor compact_len, Tensor slot_idx, Tensor? row_mask, int window, float scale, bool amx, "
        "float k_scale=1., float v_scale=1.) -> ()");
}

TORCH_LIBRARY_IMPL(speedsfi, CPU, m) {
  m.impl("two_segment_decode", &two_segment_decode_op);
}
