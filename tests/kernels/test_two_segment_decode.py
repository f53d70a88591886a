"""two_segment_decode (SFI fast step) vs its PyTorch twin and vs a dense-mask reference over the
explicit index set S ∪ M_h ∪ R_t."""

import pytest
import torch

from kernel_testlib import (DEVICE, DTYPES, FAST_CASES, FP8, FP8_CASES, FULL_GRID, SENTINEL,
                            assert_close_out, case_id, cuda_only, fp8_case_id, fp8_rows, fp8_scales,
                            make_sfi_rows, page_compact, reference_dense_attention,
                            reference_sparse_attention, row_lengths)
from vllm_ext.kernels.kv_quant import as_bytes
from vllm_ext.kernels.gather_compact import gather_compact
from vllm_ext.kernels.two_segment_decode import (two_segment_decode, two_segment_decode_torch,
                                                 two_segment_workspace)


def _run_case(case, num_splits, seed=0, k=12, n_recent=20, compact_block=None):
    """``compact_block``: read the compact segments paged in blocks of that many entries through
    a per-slot block table (SFI's KV-cache group); None: the contiguous layout."""
    g, d, bs, layout, dtn = case
    dtype = DTYPES[dtn]
    lens, act = row_lengths(bs)
    rows = make_sfi_rows(seq_lens=lens, active=act, g=g, hkv=2, d=d, bs=bs, dtype=dtype,
                         layout=layout, k=k, n_recent=n_recent, seed=seed)
    ckv, table = rows.compact_kv, None
    if compact_block is not None:
        ckv, table = page_compact(rows.compact_kv, compact_block, seed=seed)
    out = torch.full_like(rows.query, SENTINEL)
    two_segment_decode(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                       rows.recent_start, ckv, rows.compact_len, rows.slot_idx,
                       rows.scale, out, rows.row_mask, num_splits=num_splits, compact_table=table)
    twin = torch.full_like(rows.query, SENTINEL)
    two_segment_decode_torch(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                             rows.recent_start, ckv, rows.compact_len, rows.slot_idx,
                             rows.scale, twin, rows.row_mask, compact_table=table)
    ref = reference_sparse_attention(rows)
    for i, r in enumerate(ref):
        if r is None:   # padded row: untouched by both
            assert torch.all(out[i] == SENTINEL), f"row {i} (padded) was written"
            assert torch.all(twin[i] == SENTINEL), f"row {i} (padded) was written by the twin"
            continue
        assert_close_out(out[i], r, dtype, f"kernel row {i} (len {lens[i]})")
        assert_close_out(twin[i], r, dtype, f"twin row {i} (len {lens[i]})")
        assert_close_out(out[i], twin[i].float(), dtype, f"kernel vs twin row {i}")
    return rows, out


@pytest.mark.parametrize("case", FAST_CASES, ids=case_id)
def test_two_segment_fast_grid(case):
    idx = FAST_CASES.index(case)
    _run_case(case, num_splits=(1, 3, 2)[idx % 3], seed=idx)


@pytest.mark.parametrize("case", FAST_CASES, ids=case_id)
def test_two_segment_fast_grid_paged_compact(case):
    # the compact segment in SFI's KV-cache blocks: the layer's block size and a smaller one (a
    # capacity of 19 entries spans several blocks, the last one partly)
    idx = FAST_CASES.index(case)
    _run_case(case, num_splits=(1, 3, 2)[idx % 3], seed=idx, compact_block=(case[2], 8)[idx % 2])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_two_segment_fp8_pages(case, paged):
    """fp8 pages and an fp8 compact segment with the layer's scales: the kernel (split and direct)
    and the twin against the reference over the explicitly dequantised pages."""
    fmt, ks, vs, qdt = case
    qdtype = DTYPES[qdt]
    lens, act = row_lengths(16)
    rows = make_sfi_rows(seq_lens=lens, active=act, g=4, hkv=2, d=64, bs=16, dtype=torch.float32,
                         layout="LBNHC" if paged else "LBHNC", k=12, n_recent=20, seed=21)
    r8, ref = fp8_rows(rows, FP8[fmt], ks, vs, qdtype)
    k_scale, v_scale = fp8_scales(ks, vs)
    ckv, table = r8.compact_kv, None
    if paged:
        ckv, table = page_compact(r8.compact_kv, 8, seed=3)
    expect = reference_sparse_attention(ref)
    for splits in (1, 3):
        out = torch.full_like(r8.query, SENTINEL)
        two_segment_decode(r8.query, r8.kv_cache, r8.block_table, r8.seq_lens, r8.recent_start, ckv,
                           r8.compact_len, r8.slot_idx, r8.scale, out, r8.row_mask, num_splits=splits,
                           compact_table=table, k_scale=k_scale, v_scale=v_scale)
        twin = torch.full_like(r8.query, SENTINEL)
        two_segment_decode_torch(r8.query, r8.kv_cache, r8.block_table, r8.seq_lens, r8.recent_start,
                                 ckv, r8.compact_len, r8.slot_idx, r8.scale, twin, r8.row_mask,
                                 compact_table=table, k_scale=k_scale, v_scale=v_scale)
        for i, r in enumerate(expect):
            if r is None:
                assert torch.all(out[i] == SENTINEL) and torch.all(twin[i] == SENTINEL)
                continue
            assert_close_out(out[i], r, qdtype, f"kernel row {i} ({splits} splits)")
            assert_close_out(twin[i], r, qdtype, f"twin row {i}")
    # the scales matter: unscaled, the result differs
    plain = torch.zeros_like(r8.query)
    two_segment_decode(r8.query, r8.kv_cache, r8.block_table, r8.seq_lens, r8.recent_start, ckv,
                       r8.compact_len, r8.slot_idx, r8.scale, plain, r8.row_mask, num_splits=1,
                       compact_table=table)
    assert (plain[5].float() - expect[5]).abs().max() > 0.1


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_two_segment_fp8_gathered_compact(fmt):
    """The fast step on fp8 pages end to end: gather_compact copies the selected entries' stored
    bytes into an fp8 compact segment (byte-identical to direct indexing), then the decode with
    the pages' scales matches the reference."""
    lens, act = row_lengths(32)
    rows = make_sfi_rows(seq_lens=lens, active=act, g=8, hkv=2, d=64, bs=32, dtype=torch.float32,
                         layout="LBNHC", k=12, n_recent=20, seed=9)
    r8, ref = fp8_rows(rows, FP8[fmt], 0.5, 3.0, torch.bfloat16)
    k_scale, v_scale = fp8_scales(0.5, 3.0)
    ckv = torch.zeros_like(r8.compact_kv)
    clen = torch.zeros_like(r8.compact_len)
    gather_compact(r8.kv_cache, r8.block_table, r8.slot_idx, r8.selected, r8.n_sel, r8.n_sink, ckv,
                   clen, r8.row_mask, seq_lens=r8.seq_lens)
    assert ckv.dtype == r8.kv_cache.dtype and ckv.element_size() == 1
    for i, sets in enumerate(r8.index_sets):
        if sets is None:
            continue
        s, n = int(r8.slot_idx[i]), int(clen[int(r8.slot_idx[i])])
        assert n == int(r8.compact_len[s])
        assert torch.equal(as_bytes(ckv[s, :, :n]), as_bytes(r8.compact_kv[s, :, :n])), f"row {i}"
    out = torch.full_like(r8.query, SENTINEL)
    two_segment_decode(r8.query, r8.kv_cache, r8.block_table, r8.seq_lens, r8.recent_start, ckv, clen,
                       r8.slot_idx, r8.scale, out, r8.row_mask, num_splits=2, k_scale=k_scale,
                       v_scale=v_scale)
    for i, r in enumerate(reference_sparse_attention(ref)):
        if r is not None:
            assert_close_out(out[i], r, torch.bfloat16, f"row {i}")


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", FULL_GRID, ids=case_id)
def test_two_segment_full_grid(case, num_splits):
    _run_case(case, num_splits=num_splits, seed=7, k=40, n_recent=37)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", FULL_GRID, ids=case_id)
def test_two_segment_full_grid_paged_compact(case, num_splits):
    _run_case(case, num_splits=num_splits, seed=7, k=40, n_recent=37, compact_block=case[2])


@pytest.mark.cuda
@cuda_only
def test_two_segment_default_splits_and_long_rows():
    # long rows, the default split heuristic and autotuned tiles
    case = (4, 128, 16, "LBNHC", "bf16")
    g, d, bs, layout, dtn = case
    lens = [3000, 1777, 257, 1]
    rows = make_sfi_rows(seq_lens=lens, active=[True] * 4, g=g, hkv=8, d=d, bs=bs,
                         dtype=DTYPES[dtn], layout=layout, k=300, n_recent=256, seed=3)
    out = torch.full_like(rows.query, SENTINEL)
    two_segment_decode(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                       rows.recent_start, rows.compact_kv, rows.compact_len, rows.slot_idx,
                       rows.scale, out, rows.row_mask)
    for i, r in enumerate(reference_sparse_attention(rows)):
        assert_close_out(out[i], r, DTYPES[dtn], f"row {i}")


def test_two_segment_sparse_differs_from_dense():
    """The sparse result must not equal dense attention when positions are dropped (guards against
    a kernel that silently reads the whole history)."""
    case = (4, 64, 16, "LBHNC", "fp32")
    rows, out = _run_case(case, num_splits=2, seed=11, k=3, n_recent=8)
    dense = reference_dense_attention(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                                      rows.scale)
    i = 5  # length 101: 4 sink + 3 selected + 8 recent out of 101
    assert (out[i].float() - dense[i]).abs().max() > 1e-2


def test_two_segment_full_compact_equals_dense():
    """Sink + selected covering all of A: the fast step is exactly dense attention."""
    g, d, bs = 4, 64, 16
    lens, act = [1, 15, 16, 17, 53], [True] * 5
    rows = make_sfi_rows(seq_lens=lens, active=act, g=g, hkv=2, d=d, bs=bs, dtype=torch.float32,
                         layout="LBNHC", k=64, n_recent=9, seed=5)
    out = torch.zeros_like(rows.query)
    two_segment_decode(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                       rows.recent_start, rows.compact_kv, rows.compact_len, rows.slot_idx,
                       rows.scale, out, None, num_splits=3)
    dense = reference_dense_attention(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                                      rows.scale)
    for i in range(len(lens)):
        torch.testing.assert_close(out[i].cpu(), dense[i].cpu(), atol=2e-5, rtol=2e-5)


def test_two_segment_with_gather_compact_and_workspace():
    """Fast step end to end: gather_compact builds the compact segment from the selection, then
    two_segment_decode (with a preallocated workspace, int8 row mask) matches the reference."""
    g, d, bs = 8, 64, 32
    lens, act = row_lengths(bs)
    rows = make_sfi_rows(seq_lens=lens, active=act, g=g, hkv=2, d=d, bs=bs, dtype=torch.float16,
                         layout="LBNHC", k=12, n_recent=20, seed=9, build_compact=False)
    ckv = torch.full_like(rows.compact_kv, 50.0)
    clen = torch.zeros_like(rows.compact_len)
    gather_compact(rows.kv_cache, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel,
                   rows.n_sink, ckv, clen, rows.row_mask, seq_lens=rows.seq_lens)
    ws = two_segment_workspace(len(lens) + 2, rows.query.shape[1], d, 4, DEVICE)
    out = torch.full_like(rows.query, SENTINEL)
    mask8 = rows.row_mask.to(torch.int8)
    two_segment_decode(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                       rows.recent_start, ckv, clen, rows.slot_idx, rows.scale, out, mask8,
                       num_splits=3, workspace=ws)
    for i, r in enumerate(reference_sparse_attention(rows)):
        if r is None:
            assert torch.all(out[i] == SENTINEL)
        else:
            assert_close_out(out[i], r, torch.float16, f"row {i}")


def test_two_segment_masked_rows_and_empty_batch_write_nothing():
    """Rows masked out (or of length 0) leave ``out`` untouched, whatever the compact segment holds;
    an empty batch launches nothing."""
    g, d, bs = 4, 64, 16
    lens, act = row_lengths(bs)
    rows = make_sfi_rows(seq_lens=lens, active=act, g=g, hkv=2, d=d, bs=bs, dtype=torch.float32,
                         layout="LBNHC", k=12, n_recent=20, seed=4)
    out = torch.full_like(rows.query, SENTINEL)
    none = torch.zeros_like(rows.row_mask)
    two_segment_decode(rows.query, rows.kv_cache, rows.block_table, rows.seq_lens,
                       rows.recent_start, rows.compact_kv, rows.compact_len, rows.slot_idx,
                       rows.scale, out, none, num_splits=2)
    assert torch.all(out == SENTINEL)
    empty = out[:0]
    i32 = rows.seq_lens[:0]
    two_segment_decode(rows.query[:0], rows.kv_cache, rows.block_table[:0], i32, i32,
                       rows.compact_kv, rows.compact_len, i32, rows.scale, empty)
    assert torch.all(out == SENTINEL)


def test_fast_cases_cover_every_value():
    for pos, values in enumerate([(1, 4, 8), (64, 128), (16, 32), ("LBNHC", "LBHNC"),
                                  ("fp32", "fp16", "bf16")]):
        assert {c[pos] for c in FAST_CASES} == set(values)
