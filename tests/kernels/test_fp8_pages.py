"""fp8 KV pages (``vllm_ext.kernels.kv_quant``) in the kernels that the other grids do not cover:
the spellings and the quantisation, the gather into the compact segment (bytes copied), the
reference's write and dense attention, K representatives and Quest's page bounds (stored units,
``k_scale`` applied by the reader), Quest's candidate rerank, and per-request state in fp8 pages.
References dequantise explicitly."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_testlib import (DEVICE, FP8, FP8_CASES, dequantize_pages, fp8_case_id, fp8_scales,
                            make_block_table, make_kv_cache, make_sfi_rows, page_compact,
                            quantize_pages, row_lengths, unpage_compact)
from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.block_representatives import (block_representatives,
                                                    block_representatives_torch)
from vllm_ext.kernels.gather_compact import gather_compact, gather_compact_cpu, gather_compact_torch
from vllm_ext.kernels.paged_reference import dense_paged_attention, gather_kv, write_kv
from vllm_ext.kernels.paged_rows import PagedRows
from vllm_ext.kernels.paged_state import (read_state_entries, update_block_representatives_paged_torch,
                                          update_block_representatives_paged_triton)
from vllm_ext.kernels.quest_pages import (contiguous_bound_pages, quest_page_evidence_torch,
                                          quest_page_evidence_triton)
from vllm_ext.kernels.quest_rerank import quest_candidate_evidence_torch, quest_candidate_evidence_triton
from vllm_ext.kernels.triton_utils import use_triton

TRITON = use_triton(DEVICE)
needs_triton = pytest.mark.skipif(not TRITON, reason="needs Triton (CUDA or the interpreter)")


# --------------------------------------------------------------------------------- the convention
def test_spellings_views_and_element_sizes():
    assert kv_quant.fp8_dtype("fp8") == kv_quant.fp8_dtype("fp8_e4m3")
    assert kv_quant.fp8_dtype("fp8_e4m3") in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    assert kv_quant.fp8_dtype("fp8_e5m2") == torch.float8_e5m2
    assert kv_quant.fp8_dtype("auto") is None and kv_quant.fp8_dtype("bfloat16") is None
    raw = torch.zeros(3, 2, 4, 16, dtype=torch.uint8)           # vLLM's allocation
    view = kv_quant.page_view(raw, torch.float8_e5m2)
    assert view.dtype == torch.float8_e5m2 and view.data_ptr() == raw.data_ptr()
    assert kv_quant.page_view(raw, None) is raw
    with pytest.raises(ValueError):
        kv_quant.page_view(torch.zeros(2, dtype=torch.bfloat16), torch.float8_e4m3fn)
    assert kv_quant.cache_element_size("fp8", torch.bfloat16) == 1
    assert kv_quant.cache_element_size("fp8_e5m2", torch.float32) == 1
    assert kv_quant.cache_element_size("auto", torch.bfloat16) == 2
    assert kv_quant.cache_element_size("auto", torch.float32) == 4
    assert kv_quant.cache_element_size("bfloat16", torch.float32) == 2


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_quantize_saturates_and_rounds_to_nearest(fmt):
    """vLLM's write: ``x / scale`` saturated to the finite range, then the nearest stored value."""
    dtype = FP8[fmt]
    fmax = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.0, 1e9, -1e9, 0.3, -7.77, 100.1])
    q = kv_quant.quantize(x, torch.tensor([0.5]), dtype)
    assert q.dtype == dtype
    back = kv_quant.dequantize(q, torch.tensor(0.5))
    assert back[3] == fmax * 0.5 and back[4] == -fmax * 0.5            # saturated, finite
    assert back[:3].tolist() == [0.0, 1.0, -3.0]
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[torch.isfinite(every)]
    for xi, qi in zip((x[5:] / 0.5).tolist(), (back[5:] / 0.5).tolist()):
        assert abs(qi - xi) == float((every - xi).abs().min()), (xi, qi)
    # a non-fp8 dtype ignores the scale
    assert kv_quant.quantize(x[:3], 0.5, torch.float32).tolist() == x[:3].tolist()
    assert kv_quant.dequantize(x[:3], 0.5).tolist() == x[:3].tolist()


def test_launch_scales_only_for_scaled_fp8_pages():
    dummy = torch.zeros(1)
    ks, vs = fp8_scales(0.5, 3.0, "cpu")
    assert kv_quant.launch_scales(torch.bfloat16, ks, vs, dummy) == (dummy, dummy, False)
    assert kv_quant.launch_scales(torch.float8_e4m3fn, None, None, dummy) == (dummy, dummy, False)
    a, b, on = kv_quant.launch_scales(torch.float8_e4m3fn, ks, vs, dummy)
    assert on and a is ks and b is vs
    with pytest.raises(ValueError, match="k_scale"):
        kv_quant.launch_scales(torch.float8_e4m3fn, torch.tensor([0.5], dtype=torch.float64), vs, dummy)


# ------------------------------------------------------------------------------ compact segment
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_gather_compact_copies_stored_bytes(fmt, paged):
    """Every form (Triton, the batched twin, the CPU loop) copies the selected entries' stored fp8
    bytes unchanged into an fp8 compact segment; a segment of another dtype is refused."""
    lens, act = row_lengths(16)
    rows = make_sfi_rows(seq_lens=lens, active=act, g=2, hkv=2, d=32, bs=16, dtype=torch.float32,
                         layout="LBNHC", k=12, n_recent=20, seed=5, build_compact=False)
    kv8 = quantize_pages(rows.kv_cache, FP8[fmt], 0.5, 3.0)
    for fn in (gather_compact, gather_compact_torch, gather_compact_cpu):
        ckv = torch.zeros(rows.compact_kv.shape, dtype=kv8.dtype, device=DEVICE)
        clen = torch.zeros_like(rows.compact_len)
        table = None
        if paged:
            ckv, table = page_compact(ckv, 8, seed=1, garbage=0.0)
        fn(kv8, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel, rows.n_sink, ckv, clen,
           rows.row_mask, seq_lens=rows.seq_lens, compact_table=table)
        dense = unpage_compact(ckv, table) if paged else ckv
        for i, L in enumerate(lens):
            if not act[i] or L <= 0:
                continue
            s, n = int(rows.slot_idx[i]), int(clen[int(rows.slot_idx[i])])
            for h in range(2):
                pos = list(range(min(rows.n_sink, L))) + rows.selected[i, h, :int(rows.n_sel[i])].tolist()
                assert n == len(pos)
                k, v = gather_kv(kv8, rows.block_table[i], torch.tensor(pos, device=DEVICE))
                want = torch.cat([k[h], v[h]], dim=-1)
                assert torch.equal(kv_quant.as_bytes(dense[s, h, :n]), kv_quant.as_bytes(want)), \
                    f"{fn.__name__} row {i} head {h}"
    with pytest.raises(ValueError, match="compact segment"):
        gather_compact(kv8, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel, rows.n_sink,
                       torch.zeros(rows.compact_kv.shape, dtype=torch.bfloat16, device=DEVICE),
                       torch.zeros_like(rows.compact_len), rows.row_mask, seq_lens=rows.seq_lens)


# -------------------------------------------------------------------- the reference's write and read
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_reference_write_quantises_and_dense_attention_scales(case, layout):
    fmt, ks, vs, _ = case
    dtype = FP8[fmt]
    gen = torch.Generator().manual_seed(3)
    bs, hkv, hq, d = 16, 2, 4, 32
    lens = [1, 20, 37]
    nb = sum(-(-n // bs) for n in lens) + 2
    kv8 = quantize_pages(make_kv_cache(layout, nb, hkv, bs, d, torch.float32, gen=gen), dtype, 1.0, 1.0)
    kv8_bytes = kv_quant.as_bytes(kv8)
    kv8_bytes.zero_()
    bt = make_block_table(lens, bs, 3, nb, gen).to(DEVICE)
    key = torch.randn(sum(lens), hkv, d, generator=gen).to(DEVICE) * 4
    value = torch.randn(sum(lens), hkv, d, generator=gen).to(DEVICE) * 4
    slots = torch.cat([bt[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)]).to(DEVICE)
    k_scale, v_scale = fp8_scales(ks, vs, "cpu")
    pad = torch.full((1, hkv, d), 1e6, device=DEVICE)          # a padded token (slot -1): not written
    write_kv(kv8, torch.cat([key, pad]), torch.cat([value, pad]),
             torch.cat([slots, torch.tensor([-1], device=DEVICE)]), k_scale=k_scale, v_scale=v_scale)
    got_k = kv8[slots // bs, :, slots % bs, :d]
    got_v = kv8[slots // bs, :, slots % bs, d:]
    assert torch.equal(kv_quant.as_bytes(got_k), kv_quant.as_bytes(kv_quant.quantize(key, ks, dtype)))
    assert torch.equal(kv_quant.as_bytes(got_v), kv_quant.as_bytes(kv_quant.quantize(value, vs, dtype)))
    # dense attention over the written pages against the dequantised pages
    q = torch.randn(sum(lens), hq, d, generator=gen).to(DEVICE)
    qsl = [0, 1, 21, 31]                 # a decode row, a whole prompt, a chunk after a cached prefix
    out = torch.zeros_like(q)
    dense_paged_attention(q, kv8, bt, qsl, lens, 0.2, out, k_scale=k_scale, v_scale=v_scale)
    ref = torch.zeros_like(q)
    dense_paged_attention(q, dequantize_pages(kv8, ks, vs), bt, qsl, lens, 0.2, ref)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------- K representatives
@needs_triton
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_representatives_are_stored_units_exactly(fmt):
    """Block max / min of fp8 K are the stored values' (exact); written into fp8 state pages they
    keep their bytes."""
    gen = torch.Generator().manual_seed(4)
    bs, hkv, d, bk = 16, 2, 32, 8
    lens = [40, 9, 0]
    nb = sum(-(-n // bs) for n in lens) + 2
    kv8 = quantize_pages(make_kv_cache("LBNHC", nb, hkv, bs, d, torch.float32, gen=gen), FP8[fmt], 0.5, 3.0)
    bt = make_block_table(lens, bs, 4, nb, gen).to(DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    n_blocks = 6
    want = block_representatives_torch(kv8.float(), bt, seq, bk, n_blocks)
    for fn in (block_representatives, block_representatives_torch):
        assert torch.equal(fn(kv8, bt, seq, bk, n_blocks), want), fn.__name__
    # paged state of the same fp8 format
    state = torch.zeros(8, hkv, 4, 2 * d, dtype=kv8.dtype, device=DEVICE)
    table = torch.arange(6, dtype=torch.int32, device=DEVICE).view(3, 2)
    first = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    reads = []
    for fn in (update_block_representatives_paged_torch, update_block_representatives_paged_triton):
        kv_quant.as_bytes(state).zero_()
        fn(kv8, bt, seq, first, bk, n_blocks, state, table, 0)
        reads.append(read_state_entries(state, table, 0, n_blocks))           # [R, NB, Hkv, 2D]
    assert torch.equal(kv_quant.as_bytes(reads[0]), kv_quant.as_bytes(reads[1]))
    got = reads[0].float()
    for r, n in enumerate(lens):
        live = -(-n // bk)
        assert torch.equal(got[r, :live, :, :d], want[r, 0, :live]), f"max, row {r}"
        assert torch.equal(got[r, :live, :, d:], want[r, 1, :live]), f"min, row {r}"


@pytest.mark.parametrize("kernel", ["twin", "triton"])
@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_quest_bounds_on_fp8_pages_take_k_scale(case, kernel):
    """Quest's page bound over fp8 bound pages (stored units) with the layer's ``k_scale`` equals the
    bound over the dequantised bounds."""
    if kernel == "triton" and not TRITON:
        pytest.skip("needs Triton")
    fmt, ks, _, qdt = case
    fn = quest_page_evidence_triton if kernel == "triton" else quest_page_evidence_torch
    gen = torch.Generator().manual_seed(6)
    page, hkv, g, d, n_pages = 8, 2, 4, 32, 10
    pages, table = contiguous_bound_pages(3, n_pages, hkv, d, torch.float32, DEVICE)
    pages.copy_(torch.randn(pages.shape, generator=gen))
    pages8 = quantize_pages(pages, FP8[fmt], ks, ks)
    q = torch.randn(2, hkv * g, d, generator=gen).to(DEVICE)
    rows = torch.tensor([1, 0, -1], dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([3, 0, 0], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([70, 33, 10], dtype=torch.int32, device=DEVICE)
    length = n_pages * page
    k_scale, _ = fp8_scales(ks, 1.0)
    out = torch.full((3, hkv, length), 7.0, device=DEVICE)
    fn(q, pages8, table, 0.3, rows, slot, lo, hi, page, out, k_scale=k_scale)
    ref = torch.full_like(out, 7.0)
    quest_page_evidence_torch(q, dequantize_pages(pages8, ks, ks), table, 0.3, rows, slot, lo, hi, page, ref)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    assert torch.all(out[2] == 7.0)


@pytest.mark.parametrize("kernel", ["twin", "triton"])
@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_quest_rerank_on_fp8_pages(case, kernel):
    if kernel == "triton" and not TRITON:
        pytest.skip("needs Triton")
    fmt, ks, vs, _ = case
    fn = quest_candidate_evidence_triton if kernel == "triton" else quest_candidate_evidence_torch
    gen = torch.Generator().manual_seed(8)
    hkv, g, d, bs, per_row, width = 2, 4, 16, 8, 12, 40
    nblocks = 2 * per_row + 3
    kv = torch.randn(nblocks, bs, hkv, 2 * d, generator=gen).transpose(1, 2).to(DEVICE)
    kv8 = quantize_pages(kv, FP8[fmt], ks, vs)
    bt = torch.randperm(nblocks, generator=gen)[:2 * per_row].reshape(2, per_row).to(torch.int32).to(DEVICE)
    q = (torch.randn(2, hkv * g, d, generator=gen) * 2).to(DEVICE)
    rows = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([90, 80], dtype=torch.int32, device=DEVICE)
    cand = torch.stack([torch.stack([torch.randperm(80, generator=gen)[:width] for _ in range(hkv)])
                        for _ in range(2)]).to(torch.int32).to(DEVICE)
    n_cand = torch.tensor([width, 25], dtype=torch.int32, device=DEVICE)
    length = per_row * bs
    k_scale, _ = fp8_scales(ks, vs)
    out = torch.full((2, hkv, length), 7.0, device=DEVICE)
    fn(q, kv8, bt, rows, cand, n_cand, hi, 0.25, out, k_scale=k_scale)
    ref = torch.full_like(out, 7.0)
    quest_candidate_evidence_torch(q, dequantize_pages(kv8, ks, vs), bt, rows, cand, n_cand, hi, 0.25, ref)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------- per-request state in fp8 pages
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_paged_rows_in_fp8_pages(fmt):
    """State of another dtype (int32 positions, bf16 queries) kept in fp8 pages: a page holds
    ``C x 1 / element size`` of it, and it round-trips bit for bit."""
    cache = torch.zeros(6, 2, 4, 32, dtype=FP8[fmt], device=DEVICE)       # 256 bytes a page
    table = torch.tensor([[5, 2], [1, 4]], dtype=torch.int32, device=DEVICE)
    pos = PagedRows(cache, table, 0, (2, 30), torch.int32, fill=-1)
    assert pos.page_elems == 2 * 4 * 8 and pos.num_pages == 1
    vals = torch.arange(120, dtype=torch.int32, device=DEVICE).view(2, 2, 30)
    pos.index_copy_(0, torch.tensor([0, 1], device=DEVICE), vals)
    assert torch.equal(pos[torch.tensor([1, 0, -1], device=DEVICE)],
                       torch.cat([vals[1:], vals[:1], torch.full_like(vals[:1], -1)]))
    qs = PagedRows(cache, table, 1, (3, 16), torch.bfloat16)
    q = torch.randn(2, 3, 16).to(torch.bfloat16).to(DEVICE)
    qs.index_copy_(0, torch.tensor([1, 0], device=DEVICE), q)
    assert torch.equal(qs[torch.tensor([0, 1], device=DEVICE)], q.flip(0))
    assert torch.equal(pos[torch.tensor([0, 1], device=DEVICE)], vals)          # untouched
