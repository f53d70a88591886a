// SFI's gather into the compact segment on the CPU build: each slow row's sink and selected tokens
// copied from vLLM's pages (read in place: the logical layout, CPU_ATTN's vec or amx packing) into
// its compact slot (SFI's own pages, [blocks, Hkv, cbs, 2D]: K then V per entry), the length set
// (ALGORITHMS.md §1, "Slow step"). Elements are copied as they are stored (the compact segment has
// the cache's dtype; fp8 pages keep their bytes, the layer's scales apply where they are read). Twin: vllm_ext.kernels.gather_compact.gather_compact_cpu;
// tests/kernels/test_cpu_gather_compact.py compares them.
//
// Registered as torch.ops.speedsfi.gather_compact (the library is defined in sfi_cpu.cpp).

#include <algorithm>
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "gather_rows.h"
#include "page_views.h"

namespace {

void check_i32(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim, "gather_compact: ", what,
              ": a ", dim, "-d int32 tensor on the CPU expected, got ", t.scalar_type(), " ", t.sizes());
}

// torch.ops.speedsfi.gather_compact. k_pages / v_pages: as two_segment_decode reads them (logical,
// vec, or amx 6-d views); compact_kv [blocks, Hkv, cbs, 2D] of the same dtype (unit stride in the last
// axis); compact_table [>= slots, >= cap / cbs] int32; compact_len [>= slots] int32 (written);
// block_table [R, W] int32; slot_idx, n_sel [R] int32; selected [R, Hkv, K] int32 (absolute positions,
// ascending or not); seq_lens, offset [R] int32 or None; row_mask [R] bool or None.
void gather_compact_op(const at::Tensor& compact_kv, const at::Tensor& compact_table, int64_t cap,
                       const at::Tensor& compact_len, const at::Tensor& k_pages, const at::Tensor& v_pages,
                       const at::Tensor& block_table, const at::Tensor& slot_idx, const at::Tensor& selected,
                       const at::Tensor& n_sel, const std::optional<at::Tensor>& seq_lens,
                       const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& row_mask,
                       int64_t n_sink, bool amx) {
  const at::ScalarType dt = k_pages.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kHalf || dt == at::kFloat8_e4m3fn ||
                  dt == at::kFloat8_e5m2,
              "gather_compact: bf16, fp16, fp32 or fp8 (e4m3, e5m2) pages expected, got ", dt);
  TORCH_CHECK(compact_kv.scalar_type() == dt, "gather_compact: a compact segment of the pages' dtype expected");
  const PageViews src = page_views(k_pages, v_pages, amx, "gather_compact");
  const int64_t hkv = src.heads, bs = src.bs, d = src.d;
  TORCH_CHECK(compact_kv.dim() == 4 && compact_kv.size(1) == hkv && compact_kv.size(3) == 2 * d &&
                  compact_kv.stride(3) == 1,
              "gather_compact: compact_kv [blocks, ", hkv, ", cbs, ", 2 * d, "] expected, got ", compact_kv.sizes());
  check_i32(compact_table, "compact_table", 2);
  check_i32(compact_len, "compact_len", 1);
  check_i32(block_table, "block_table", 2);
  check_i32(slot_idx, "slot_idx", 1);
  check_i32(selected, "selected", 3);
  check_i32(n_sel, "n_sel", 1);
  const int64_t rows = slot_idx.size(0), k = selected.size(2), cbs = compact_kv.size(2);
  TORCH_CHECK(slot_idx.is_contiguous() && n_sel.is_contiguous() && n_sel.size(0) >= rows &&
                  block_table.size(0) >= rows && block_table.stride(1) == 1 && selected.size(0) >= rows &&
                  selected.size(1) == hkv && selected.stride(2) == 1 && compact_len.is_contiguous() &&
                  compact_table.stride(1) == 1 && compact_table.size(1) * cbs >= cap,
              "gather_compact: rows, tables or selections of unexpected shapes");
  for (const auto* t : {&seq_lens, &offset}) {
    if (!t->has_value()) continue;
    check_i32(**t, "seq_lens / offset", 1);
    TORCH_CHECK((*t)->size(0) >= rows && (*t)->is_contiguous(), "gather_compact: [R] int32 rows expected");
  }
  if (row_mask.has_value())
    TORCH_CHECK(row_mask->scalar_type() == at::kBool && row_mask->size(0) >= rows && row_mask->is_contiguous(),
                "gather_compact: row_mask [R] bool");
  const int64_t slots = std::min(compact_table.size(0), compact_len.size(0));
  const int32_t* sid = slot_idx.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* ct = compact_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.has_value() ? seq_lens->data_ptr<int32_t>() : nullptr;
  const int32_t* sp = selected.data_ptr<int32_t>();
  const int32_t* nsp = n_sel.data_ptr<int32_t>();
  // every block id the copies can touch, checked before any is written
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = sid[r];
    if (slot < 0 || slot >= slots) continue;
    for (int64_t j = 0; j * cbs < cap; ++j) {
      const int32_t b = ct[slot * compact_table.stride(0) + j];
      TORCH_CHECK(b >= 0 && b < compact_kv.size(0), "gather_compact: compact block id ", b, " out of range");
    }
    const int64_t seq = sl != nullptr ? sl[r] : block_table.size(1) * bs;
    const int64_t nsel = std::clamp<int64_t>(nsp[r], 0, k);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t e = -std::min<int64_t>(n_sink, seq); e < nsel; ++e) {
        const int64_t pos = e < 0 ? e + std::min<int64_t>(n_sink, seq) : sp[r * selected.stride(0) + h * selected.stride(1) + e];
        if (pos < 0 || pos >= seq) continue;
        TORCH_CHECK(pos / bs < block_table.size(1), "gather_compact: position ", pos, " past row ", r, "'s table");
        const int32_t b = bt[r * block_table.stride(0) + pos / bs];
        TORCH_CHECK(b >= 0 && b < src.blocks, "gather_compact: block id ", b, " out of range");
      }
  }
#define SFI_GATHER(T)                                                                                          \
  gather_rows<T>(static_cast<const T*>(k_pages.data_ptr()), static_cast<const T*>(v_pages.data_ptr()), src, bt, \
                 block_table.stride(0), static_cast<T*>(compact_kv.data_ptr()), compact_kv.stride(0),          \
                 compact_kv.stride(1), compact_kv.stride(2), cbs, ct, compact_table.stride(0),                 \
                 compact_len.data_ptr<int32_t>(), slots, cap, sid, sp, selected.stride(0), selected.stride(1), \
                 k, nsp, sl, offset.has_value() ? offset->data_ptr<int32_t>() : nullptr,                       \
                 row_mask.has_value() ? row_mask->data_ptr<bool>() : nullptr, rows, hkv, n_sink)
  if (dt == at::kFloat) SFI_GATHER(float);
  else if (k_pages.element_size() == 2) SFI_GATHER(uint16_t);
  else SFI_GATHER(uint8_t);
#undef SFI_GATHER
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedsfi, m) {
  m.def("gather_compact(Tensor(a!) compact_kv, Tensor compact_table, int cap, Tensor(b!) compact_len, "
        "Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor slot_idx, Tensor selected, Tensor n_sel, "
        "Tensor? seq_lens, Tensor? offset, Tensor? row_mask, int n_sink, bool amx) -> ()");
}

TORCH_LIBRARY_IMPL(speedsfi, CPU, m) {
  m.impl("gather_compact", &gather_compact_op);
}
