// Rows of bytes from one tensor into another at given row indices: dst row dst_rows[i] = src row
// src_rows[i] (both tensors contiguous, seen as rows of row_bytes bytes). The page-list copies of the
// CPU build (whole runs of a page's tokens into scratch pages that CPU_ATTN's kernel reads) are row
// gathers of a few hundred bytes to a few KiB per row; one memcpy per row, the rows shared among
// torch's threads. Twin: vllm_ext.kernels.page_copy.copy_runs (index_select of the same rows);
// tests/kernels/test_cpu_attn_critiprefill.py compares them.
//
// Registered as torch.ops.speedsfi.copy_rows (the library is defined in sfi_cpu.cpp).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace {

void copy_rows_op(at::Tensor& dst, const at::Tensor& dst_rows, const at::Tensor& src, const at::Tensor& src_rows,
                  int64_t row_bytes) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_rows: contiguous tensors");
  TORCH_CHECK(dst_rows.scalar_type() == at::kLong && src_rows.scalar_type() == at::kLong &&
                  dst_rows.is_contiguous() && src_rows.is_contiguous() && dst_rows.numel() == src_rows.numel(),
              "copy_rows: int64 row indices of equal count");
  const int64_t dst_bytes = dst.numel() * dst.element_size(), src_bytes = src.numel() * src.element_size();
  TORCH_CHECK(row_bytes > 0 && dst_bytes % row_bytes == 0 && src_bytes % row_bytes == 0,
              "copy_rows: row_bytes divides both tensors");
  const int64_t n = dst_rows.numel(), dst_n = dst_bytes / row_bytes, src_n = src_bytes / row_bytes;
  const int64_t* di = dst_rows.data_ptr<int64_t>();
  const int64_t* si = src_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(di[i] >= 0 && di[i] < dst_n && si[i] >= 0 && si[i] < src_n, "copy_rows: row ", i,
                " reads or writes outside its tensor");
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / row_bytes);
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) std::memcpy(d + di[i] * row_bytes, s + si[i] * row_bytes, row_bytes);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(speedsfi, m) {
  m.def("copy_rows(Tensor(a!) dst, Tensor dst_rows, Tensor src, Tensor src_rows, int row_bytes) -> ()");
}

TORCH_LIBRARY_IMPL(speedsfi, CPU, m) {
  m.impl("copy_rows", &copy_rows_op);
}
