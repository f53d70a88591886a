"""gather_compact vs its twin and vs explicit per-(row, head) gathers through paged_reference."""

import pytest
import torch

from kernel_testlib import (DEVICE, DTYPES, FAST_CASES, FULL_GRID, case_id, cuda_only,
                            make_sfi_rows, page_compact, row_lengths, unpage_compact)
from vllm_ext.kernels.gather_compact import gather_compact, gather_compact_torch
from vllm_ext.kernels.paged_reference import gather_kv

GARBAGE = 77.0


def _expected(rows, i, h, use_seq):
    L = int(rows.seq_lens[i])
    ns = min(rows.n_sink, L) if use_seq else rows.n_sink
    m = int(rows.n_sel[i])
    pos = list(range(ns)) + rows.selected[i, h, :m].tolist()
    k, v = gather_kv(rows.kv_cache, rows.block_table[i], torch.tensor(pos, device=DEVICE))
    return torch.cat([k[h], v[h]], dim=-1), ns + m


def _run(case, seed, use_seq=True, compact_block=None):
    """``compact_block``: write the compact segments paged (SFI's KV-cache group) in blocks of that
    many entries through a per-slot block table, compared after unpaging; spare pool blocks must
    stay untouched."""
    g, d, bs, layout, dtn = case
    lens, act = row_lengths(bs)
    if not use_seq:   # without seq_lens every row is taken as at least n_sink long
        lens = [max(n, 4) for n in lens]
    rows = make_sfi_rows(seq_lens=lens, active=act, g=g, hkv=2, d=d, bs=bs, dtype=DTYPES[dtn],
                         layout=layout, k=12, n_recent=20, seed=seed, build_compact=False)
    results = []
    for fn in (gather_compact, gather_compact_torch):
        ckv = torch.full_like(rows.compact_kv, GARBAGE)
        clen = torch.full_like(rows.compact_len, -5)
        if compact_block is None:
            fn(rows.kv_cache, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel, rows.n_sink,
               ckv, clen, rows.row_mask, seq_lens=rows.seq_lens if use_seq else None)
        else:
            pages, table = page_compact(ckv, compact_block, seed=seed, garbage=GARBAGE)
            fn(rows.kv_cache, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel, rows.n_sink,
               pages, clen, rows.row_mask, seq_lens=rows.seq_lens if use_seq else None,
               compact_table=table)
            spare = torch.ones(pages.shape[0], dtype=torch.bool)
            spare[table.long().flatten().cpu()] = False
            assert torch.all(pages[spare.to(pages.device)] == GARBAGE), f"{fn.__name__} wrote a spare block"
            ckv = unpage_compact(pages, table)[:, :, :ckv.shape[2]]
        touched = set()
        for i in range(len(lens)):
            s = int(rows.slot_idx[i])
            if not act[i] or (use_seq and lens[i] <= 0):
                continue
            touched.add(s)
            for h in range(rows.kv_cache.shape[1]):
                exp, n = _expected(rows, i, h, use_seq)
                assert int(clen[s]) == n, f"{fn.__name__} row {i}: compact_len {int(clen[s])} != {n}"
                assert torch.equal(ckv[s, h, :n].cpu(), exp.cpu()), f"{fn.__name__} row {i} head {h}"
                assert torch.all(ckv[s, h, n:] == GARBAGE), f"{fn.__name__} wrote past compact_len"
        for s in range(ckv.shape[0]):
            if s not in touched:
                assert torch.all(ckv[s] == GARBAGE) and int(clen[s]) == -5, f"slot {s} touched"
        results.append((ckv, clen))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("case", FAST_CASES, ids=case_id)
def test_gather_compact_fast_grid(case):
    _run(case, seed=FAST_CASES.index(case))


@pytest.mark.parametrize("case", FAST_CASES, ids=case_id)
def test_gather_compact_fast_grid_paged_compact(case):
    idx = FAST_CASES.index(case)
    _run(case, seed=idx, compact_block=(case[2], 8)[idx % 2])


def test_gather_compact_without_seq_lens():
    _run((4, 64, 16, "LBNHC", "fp16"), seed=3, use_seq=False)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("case", FULL_GRID, ids=case_id)
def test_gather_compact_full_grid(case):
    _run(case, seed=5)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("case", FULL_GRID, ids=case_id)
def test_gather_compact_full_grid_paged_compact(case):
    _run(case, seed=5, compact_block=case[2])


def test_gather_compact_clamps_and_shared_padded_slot():
    """n_sel larger than the capacity allows is clamped; a padded row (slot -1 / masked) sharing a
    slot index with an active row never clobbers it; short requests clamp the sink."""
    d, bs = 64, 16
    rows = make_sfi_rows(seq_lens=[2, 60, 60], active=[True, True, False], g=1, hkv=2, d=d, bs=bs,
                         dtype=torch.float32, layout="LBHNC", k=12, n_recent=4, seed=4,
                         build_compact=False)
    slot_idx = torch.tensor([1, 0, 0], dtype=torch.int32, device=DEVICE)   # row 2 (masked) shares 0
    cap = 10                                                                 # < 4 + 12
    for fn in (gather_compact, gather_compact_torch):
        ckv = torch.full((3, 2, cap, 2 * d), GARBAGE, device=DEVICE)
        clen = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        n_sel = torch.tensor([0, 12, 12], dtype=torch.int32, device=DEVICE)
        fn(rows.kv_cache, rows.block_table, slot_idx, rows.selected, n_sel, 4, ckv, clen,
           rows.row_mask, seq_lens=rows.seq_lens)
        assert clen.tolist() == [10, 2, 0], fn.__name__
        for h in range(2):
            pos = list(range(4)) + rows.selected[1, h, :6].tolist()
            k, v = gather_kv(rows.kv_cache, rows.block_table[1], torch.tensor(pos, device=DEVICE))
            assert torch.equal(ckv[0, h], torch.cat([k[h], v[h]], -1)), fn.__name__
            k, v = gather_kv(rows.kv_cache, rows.block_table[0], torch.arange(2, device=DEVICE))
            assert torch.equal(ckv[1, h, :2], torch.cat([k[h], v[h]], -1)), fn.__name__
            assert torch.all(ckv[1, h, 2:] == GARBAGE)


def test_count_driven_launch_equals_the_per_row_grid():
    """A compacted row list with its live count on the device (the SFI path's form): the fixed
    grid writes exactly what the per-row grid writes, and a count of 0 writes nothing."""
    from kernel_testlib import DEVICE, make_block_table, make_kv_cache
    from vllm_ext.kernels.gather_compact import gather_compact

    gen = torch.Generator().manual_seed(5)
    lens, bs, hkv, d, n_sink, k = [90, 57, 0, 0], 16, 2, 32, 4, 24
    kv = make_kv_cache("LBNHC", 16, hkv, bs, d, torch.float32, gen=gen)
    bt = make_block_table(lens, bs, 7, 16, gen).to(DEVICE)
    sel = torch.full((4, hkv, k), -1, dtype=torch.int32)
    for r, n in enumerate(lens[:2]):
        for h in range(hkv):
            sel[r, h, :20] = (torch.randperm(n - n_sink, generator=gen)[:20] + n_sink).sort().values
    sel = sel.to(DEVICE)
    n_sel = torch.tensor([20, 20, 0, 0], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 0, -1, -1], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    outs = []
    for count in (None, 2, 0):
        ckv = torch.full((3, hkv, n_sink + k, 2 * d), 9.0, device=DEVICE)
        clen = torch.full((3,), 99, dtype=torch.int32, device=DEVICE)
        cnt = None if count is None else torch.tensor([count], dtype=torch.int32, device=DEVICE)
        gather_compact(kv, bt, slots if count != 0 else torch.full_like(slots, -1), sel, n_sel,
                       n_sink, ckv, clen, seq_lens=seq, count=cnt)
        outs.append((ckv, clen))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][1].tolist() == [24, 99, 24]
    assert torch.all(outs[2][0] == 9.0) and outs[2][1].tolist() == [99, 99, 99]


@pytest.mark.parametrize("count", [None, 2])
def test_offset_writes_after_the_kept_entries(count):
    """sfi.keep_prefill: a first gather writes sink + kept entries; a second one with ``offset`` (the
    kept count per row) writes its selection after them and leaves them as they are; the capacity
    clamps the second selection. Kernel and twin write the same."""
    from kernel_testlib import make_block_table, make_kv_cache

    gen = torch.Generator().manual_seed(8)
    lens, bs, hkv, d, n_sink, k, cap = [120, 75, 2], 16, 2, 32, 4, 20, 4 + 24
    kv = make_kv_cache("LBNHC", 24, hkv, bs, d, torch.float32, gen=gen)
    bt = make_block_table(lens, bs, 9, 24, gen).to(DEVICE)
    perm = [[(torch.randperm(n - n_sink, generator=gen)[:2 * k] + n_sink) if n > n_sink + 2 * k else None
             for _ in range(hkv)] for n in lens]
    kept_n, rest_n = [10, 16, 0], [14, 20, 0]                 # row 1: 16 + 20 > 24 -> 8 of its 20 fit
    kept = torch.full((3, hkv, k), -1, dtype=torch.int32)
    rest = torch.full((3, hkv, k), -1, dtype=torch.int32)
    for r in range(2):
        for h in range(hkv):
            kept[r, h, :kept_n[r]] = perm[r][h][:kept_n[r]].sort().values
            rest[r, h, :rest_n[r]] = perm[r][h][k:k + rest_n[r]].sort().values
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    n_kept = torch.tensor(kept_n, dtype=torch.int32, device=DEVICE)
    n_rest = torch.tensor(rest_n, dtype=torch.int32, device=DEVICE)
    cnt = None if count is None else torch.tensor([count], dtype=torch.int32, device=DEVICE)
    outs = []
    for fn in (gather_compact, gather_compact_torch):
        ckv = torch.full((3, hkv, cap, 2 * d), GARBAGE, device=DEVICE)
        clen = torch.full((3,), -5, dtype=torch.int32, device=DEVICE)
        kw = dict(seq_lens=seq) if fn is gather_compact_torch else dict(seq_lens=seq, count=cnt)
        fn(kv, bt, slots, kept.to(DEVICE), n_kept, n_sink, ckv, clen, **kw)
        fn(kv, bt, slots, rest.to(DEVICE), n_rest, n_sink, ckv, clen, offset=n_kept, **kw)
        for r, s in ((0, 2), (1, 0)):
            fit = min(rest_n[r], cap - n_sink - kept_n[r])
            n = n_sink + kept_n[r] + fit
            assert int(clen[s]) == n
            for h in range(hkv):
                pos = list(range(n_sink)) + kept[r, h, :kept_n[r]].tolist() + rest[r, h, :fit].tolist()
                kk, vv = gather_kv(kv, bt[r], torch.tensor(pos, device=DEVICE))
                assert torch.equal(ckv[s, h, :n], torch.cat([kk[h], vv[h]], dim=-1))
                assert torch.all(ckv[s, h, n:] == GARBAGE)
        if fn is gather_compact and count is not None:        # row 2 is past the live count: untouched
            assert int(clen[1]) == -5 and torch.all(ckv[1] == GARBAGE)
        else:                                                 # a 2-token row: its sink only
            assert int(clen[1]) == 2 and torch.all(ckv[1, :, 2:] == GARBAGE)
        outs.append((ckv, clen))
    if count is not None:
        return
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("compact_block", [16, 5])
def test_paged_layout_equals_contiguous_with_offset_and_count(compact_block):
    """The paged compact layout (SFI's KV-cache group: a per-slot block table) holds, entry for
    entry, what the contiguous layout holds after a kept-entries gather and an ``offset`` gather
    with a count-driven launch, for the Triton kernel and both twins; other pool blocks untouched."""
    from kernel_testlib import make_block_table, make_kv_cache
    from vllm_ext.kernels.gather_compact import gather_compact_cpu

    gen = torch.Generator().manual_seed(11)
    lens, bs, hkv, d, n_sink, k, cap = [120, 75, 2], 16, 2, 32, 4, 20, 4 + 24
    kv = make_kv_cache("LBNHC", 24, hkv, bs, d, torch.float32, gen=gen)
    bt = make_block_table(lens, bs, 9, 24, gen).to(DEVICE)
    kept = torch.full((3, hkv, k), -1, dtype=torch.int32)
    rest = torch.full((3, hkv, k), -1, dtype=torch.int32)
    for r in range(2):
        for h in range(hkv):
            p = torch.randperm(lens[r] - n_sink, generator=gen)[:2 * k] + n_sink
            kept[r, h, :8] = p[:8].sort().values
            rest[r, h, :12] = p[k:k + 12].sort().values
    kept, rest = kept.to(DEVICE), rest.to(DEVICE)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    n_kept = torch.tensor([8, 8, 0], dtype=torch.int32, device=DEVICE)
    n_rest = torch.tensor([12, 12, 0], dtype=torch.int32, device=DEVICE)
    count = torch.tensor([2], dtype=torch.int32, device=DEVICE)

    def run(fn, paged):
        ckv = torch.full((3, hkv, cap, 2 * d), GARBAGE, device=DEVICE)
        clen = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        table = None
        if paged:
            ckv, table = page_compact(ckv, compact_block, seed=3, garbage=GARBAGE)
        fn(kv, bt, slots, kept, n_kept, n_sink, ckv, clen, seq_lens=seq, compact_table=table)
        fn(kv, bt, slots, rest, n_rest, n_sink, ckv, clen, seq_lens=seq, offset=n_kept,
           compact_table=table, **({"count": count} if fn is gather_compact else {}))
        if paged:
            spare = torch.ones(ckv.shape[0], dtype=torch.bool)
            spare[table.long().flatten().cpu()] = False
            assert torch.all(ckv[spare.to(ckv.device)] == GARBAGE), f"{fn.__name__} wrote a spare block"
            ckv = unpage_compact(ckv, table)[:, :, :cap]
        return ckv, clen

    reference = run(gather_compact_torch, paged=False)
    assert reference[1].tolist() == [4 + 8 + 12, 2, 4 + 8 + 12]
    for fn in (gather_compact, gather_compact_torch, gather_compact_cpu):
        got = run(fn, paged=True)
        assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1]), fn.__name__
