// vLLM's KV-cache pages as the CPU build's passes read them in place, from the K and V views the
// Python wrappers hand over (vllm_ext/kernels/cpu_native.py): the logical layout ([blocks, Hkv, bs, D]
// views of [..., 2D] rows, K and V with unit stride in D), CPU_ATTN's vec packing (K^T per page:
// strides [.., .., 1, bs]; V [.., .., D, 1]) or its amx packing (the 6-d VNNI views
// [blocks, Hkv, bs / 16, 16, D / 2, 2] of K and [blocks, Hkv, bs / 2, 2, D / 16, 16] of V).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace {

// LAYOUT_ROWS: token t, dim i of K at t * k_ts + i; LAYOUT_VEC: at i * bs + t; LAYOUT_AMX: CPU_ATTN's
// VNNI pairs (unpack_amx_k / unpack_amx_v). V is row-major (t * v_ts + i) except in LAYOUT_AMX.
enum Layout { LAYOUT_ROWS = 0, LAYOUT_VEC = 1, LAYOUT_AMX = 2 };

struct PageViews {
  int64_t s_block, s_head;                  // a page's offset: block * s_block + head * s_head
  int64_t k_ts, v_ts;                       // token strides of row-major K (LAYOUT_ROWS) and V
  int64_t blocks, heads, bs, d;
  Layout layout;
};

// The layout of k_pages / v_pages (6-d views when amx), checked: op names the caller in errors.
inline PageViews page_views(const at::Tensor& k_pages, const at::Tensor& v_pages, bool amx, const char* op) {
  TORCH_CHECK(k_pages.device().is_cpu() && v_pages.device().is_cpu() &&
                  v_pages.scalar_type() == k_pages.scalar_type() && k_pages.dim() == (amx ? 6 : 4) &&
                  v_pages.dim() == k_pages.dim(),
              op, ": K and V page views of one dtype on the CPU, ", amx ? 6 : 4, "-d, expected, got ",
              k_pages.sizes(), " / ", v_pages.sizes());
  const auto ks = k_pages.strides(), vs = v_pages.strides();
  PageViews p{ks[0], ks[1], 0, 0, k_pages.size(0), k_pages.size(1),
              amx ? k_pages.size(2) * k_pages.size(3) : k_pages.size(2),
              amx ? k_pages.size(4) * k_pages.size(5) : k_pages.size(3), LAYOUT_ROWS};
  const int64_t bs = p.bs, d = p.d;
  bool ok = ks[0] == vs[0] && ks[1] == vs[1] && v_pages.size(0) == p.blocks && v_pages.size(1) == p.heads;
  if (amx) {
    p.layout = LAYOUT_AMX;
    ok = ok && k_pages.size(3) == 16 && k_pages.size(5) == 2 && v_pages.size(3) == 2 && v_pages.size(5) == 16 &&
         ks[2] == 16 * d && ks[3] == 2 && ks[4] == 32 && ks[5] == 1 && vs[2] == 32 && vs[3] == 1 &&
         vs[4] == 16 * bs && vs[5] == 2;
  } else if (ks[3] == 1) {
    p.k_ts = ks[2];
    p.v_ts = vs[2];
    ok = ok && vs[3] == 1 && v_pages.size(2) == bs && v_pages.size(3) == d;
  } else {
    p.layout = LAYOUT_VEC;
    p.v_ts = vs[2];
    ok = ok && ks[2] == 1 && ks[3] == bs && vs[3] == 1 && vs[2] == d && v_pages.size(2) == bs;
  }
  TORCH_CHECK(ok, op, ": K / V pages in no layout it reads (sizes ", k_pages.sizes(), " / ", v_pages.sizes(),
              ", strides ", ks, " / ", vs, ")");
  return p;
}

}  // namespace
