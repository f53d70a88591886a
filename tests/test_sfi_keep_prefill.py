"""``sfi.keep_prefill`` on the SFI path (``vllm_ext.methods.sfi.path``): the prefill-end selection's
best tokens stay in the compact segment for the whole decode, decode-time selections choose the rest
of the budget among the other positions, and the two together hold ``min(k, |A|)`` tokens. Kernels
(Triton, interpreted on CPU) against the twins, and both against the reference selector."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from tests.kernel_choice import torch_kernels
from tests.test_sfi_path import BS, D, HKV, Problem
from vllm_ext.methods.sfi.path import _prefill_end_select, sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.config import ConfigError
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.paged_reference import gather_kv
from vllm_ext.kernels import sfi_selector_torch as S
from vllm_ext.methods.sfi.selector_params import selector_params
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers, write_plan

CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, keep_prefill=10,
                select_span=2, select_span_back=1)
LENS = [130, 97, 161]
SLOTS = [2, 0, 1]


def positions_of(p, row, compact, n):
    """Map compact entries back to positions (random K/V: every entry is unique)."""
    k, v = gather_kv(p.kv, p.bt[row], torch.arange(p.lens[row], device=p.device))
    full = torch.cat([k, v], dim=-1)                                   # [H, L, 2D]
    out = []
    for h in range(HKV):
        eq = (compact[h, :n, None, :] == full[h][None]).all(-1)        # [n, L]
        assert torch.all(eq.sum(-1) == 1), "a compact entry is no position of the row"
        out.append(eq.float().argmax(-1).tolist())
    return out


def paged_layer(cfg, p, capacity=4, seed=9):
    """A layer whose per-request state (compact segment, kept positions, prompt-tail queries) lives
    in KV-cache pages, as inside vLLM: a token-major page memory full of another request's leftovers
    and a per-slot block table (``capacity + 1`` rows) of scattered blocks."""
    layer = SfiLayerBuffers(capacity, HKV, cfg, D, torch.float32, p.device, num_heads=p.hq, paged=True)
    gen = torch.Generator().manual_seed(seed)
    pages = layer.state_pages(torch.empty(1, HKV, BS, 2 * D))
    nb = (capacity + 1) * pages.total + 3
    cache = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2).to(p.device)
    table = (torch.randperm(nb - 1, generator=gen)[:(capacity + 1) * pages.total] + 1)
    table = table.view(capacity + 1, pages.total).to(torch.int32).to(p.device)
    layer.bind_pages(cache, table)
    return layer


def dense_state(layer, capacity=4):
    """``(compact segments [C, Hkv, n_sink + k, 2D], kept positions [C, Hkv, keep])`` of a layer,
    whatever its layout."""
    from vllm_ext.kernels.two_segment_decode import compact_entries

    n = layer.cfg.n_sink + layer.cfg.k
    ckv = torch.stack([compact_entries(layer.compact_kv, layer.compact_table, s, n) for s in range(capacity)])
    kept = None if layer.kept_pos is None else layer.kept_pos[torch.arange(capacity, device=ckv.device)]
    return ckv, kept


def run(p, use_twins, kept_counts=None, cfg=CFG, paged=False):
    """Prefill-end selections, then one decode step with every row slow. ``kept_counts``: the kept
    count each row's decode uses (default ``keep_prefill``; 0 = a slot whose prefill kept nothing,
    its table row still holding positions). ``paged``: the layer's state in KV-cache pages."""
    device = p.device
    rows = len(LENS)
    layer = paged_layer(cfg, p) if paged else SfiLayerBuffers(4, HKV, cfg, D, torch.float32, device)
    rt = SfiRuntime(cfg, capacity=4, max_rows=rows, num_heads=p.hq, num_kv_heads=HKV, head_size=D,
                    max_len=max(LENS) + 8, device=device)
    gen = torch.Generator().manual_seed(1)
    # prefill end: prompts of LENS - 20 tokens, pooled evidence over them
    plen = torch.tensor([n - 20 for n in LENS], dtype=torch.int32)
    L = max(LENS) + 8
    ev = torch.randn(rows, HKV, L, generator=gen) * 3
    norms = torch.rand(rows, HKV, L, generator=gen) + 0.1
    lo = torch.full((rows,), CFG.n_sink, dtype=torch.int32)
    hi = plen - CFG.n_recent
    k = torch.full((rows,), CFG.k, dtype=torch.int32)
    slot = torch.tensor(SLOTS, dtype=torch.int32)
    dev = lambda t: t.to(device)                                        # noqa: E731
    ctx = torch_kernels() if use_twins else contextlib.nullcontext()
    with ctx:
        _prefill_end_select(rt, cfg, layer, p.kv, p.bt, dev(slot), dev(plen), dev(ev), dev(norms), dev(lo),
                            dev(hi), dev(k))
        ckv, kept = dense_state(layer)
        after_prefill = (ckv.clone(), layer.compact_len.clone(), None if kept is None else kept.clone())
        # one decode step, every row slow: a dense pass writes the evidence, the selector excludes the
        # kept positions and the gather writes after them
        buffers = SfiPlanBuffers(rows, 4, device)
        t = dev(torch.tensor(LENS, dtype=torch.int32))
        slow = dev(torch.ones(rows, dtype=torch.bool))
        plan = write_plan(buffers, rows, slow=slow, fast=~slow, sparse=slow, row_sfi_slot=dev(slot),
                          k=dev(k), recent_start=t - CFG.n_recent, lo=dev(lo), hi=t - CFG.n_recent, t=t,
                          block_table=p.bt)
        # what SfiSlotTables.plan adds with keep_prefill: the kept count, and the budget besides it
        kept_n = kept_counts if kept_counts is not None else [cfg.keep_prefill] * rows
        plan.slow_kept[:rows].copy_(dev(torch.tensor(kept_n, dtype=torch.int32)))
        plan.slow_k[:rows].sub_(plan.slow_kept[:rows])
        q = (torch.randn(rows, p.hq, D, generator=gen) * 2).to(device)
        out = torch.zeros_like(q)
        sfi_decode(q, p.kv, p.bt, t, plan, cfg, layer, rt, 0, p.scale, out, dense_done=False)
        rt.ring.join()
    return after_prefill, (dense_state(layer)[0].clone(), layer.compact_len.clone()), (ev, norms, lo, hi)


@pytest.mark.parametrize("use_twins", [False, True])
def test_a_slot_without_kept_tokens_selects_the_whole_budget(use_twins):
    """Row 1 decodes with 0 kept tokens while its slot's table row holds positions (a previous
    request's): nothing is excluded, its selection is the one made without keep_prefill."""
    p = Problem(LENS, 2, "cpu", seed=6)
    _, (ckv, clen), _ = run(p, use_twins, kept_counts=[CFG.keep_prefill, 0, CFG.keep_prefill])
    no_keep = dataclasses.replace(CFG, keep_prefill=0)
    _, (ref_ckv, ref_clen), _ = run(p, use_twins, cfg=no_keep)
    s = SLOTS[1]
    assert int(clen[s]) == int(ref_clen[s]) == CFG.n_sink + CFG.k
    got = positions_of(p, 1, ckv[s], CFG.n_sink + CFG.k)
    want = positions_of(p, 1, ref_ckv[s], CFG.n_sink + CFG.k)
    assert [sorted(h) for h in got] == [sorted(h) for h in want]


@pytest.mark.parametrize("use_twins", [False, True])
def test_paged_state_matches_the_dense_tables(use_twins):
    """The kept positions and compact segments in KV-cache pages (read and written through
    the per-slot block table, pages holding another request's leftovers) give exactly the dense
    tables' selections, kept positions and compact entries."""
    p = Problem(LENS, 2, "cpu", seed=4)
    for counts in (None, [CFG.keep_prefill, 0, CFG.keep_prefill]):
        (ckv0, clen0, kept0), (ckv1, clen1), _ = run(p, use_twins, kept_counts=counts)
        (pckv0, pclen0, pkept0), (pckv1, pclen1), _ = run(p, use_twins, kept_counts=counts, paged=True)
        assert torch.equal(clen0, pclen0) and torch.equal(clen1, pclen1)
        for s in SLOTS:
            assert torch.equal(kept0[s], pkept0[s])
            n = int(clen1[s])
            assert torch.equal(ckv0[s, :, :n], pckv0[s, :, :n]) and torch.equal(ckv1[s, :, :n], pckv1[s, :, :n])


def test_bind_pages_checks_the_row_width_and_reuses_its_views():
    p = Problem(LENS, 2, "cpu", seed=4)
    layer = paged_layer(CFG, p)
    pages = layer.state_pages(layer.compact_kv)
    assert (pages.segment, pages.kept, pages.tail) == (2, 1, 1)   # n_sink + k = 28 entries in blocks of 16
    kept, table = layer.kept_pos, layer.compact_table
    layer.bind_pages(layer.compact_kv, layer._bound[1])
    assert layer.kept_pos is kept and layer.compact_table is table
    wide = torch.zeros(5, pages.total + 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="blocks per request"):
        layer.bind_pages(layer.compact_kv, wide)


def test_config_bounds():
    SfiConfig(enabled=True, k=64, k_min=32, keep_prefill=32).validate()
    with pytest.raises(ConfigError, match="keep_prefill"):
        SfiConfig(enabled=True, k=64, k_min=32, keep_prefill=33).validate()
    # quest: the pages fill the budget besides the kept tokens, and the spans shape the kept part
    SfiConfig(enabled=True, k=64, selector="quest", keep_prefill=16, select_span=6,
              select_span_back=6).validate()
    with pytest.raises(ConfigError, match="keep_prefill"):
        SfiConfig(enabled=True, k=64, k_min=32, selector="quest", keep_prefill=48).validate()
    with pytest.raises(ConfigError, match="select_span_back"):
        SfiConfig(enabled=True, k=64, select_span=20, select_span_back=13).validate()


def test_kept_tokens_stay_and_decode_selects_the_rest():
    p = Problem(LENS, 2, "cpu", seed=4)
    (ckv0, clen0, kept), (ckv1, clen1), (ev, norms, lo, hi) = run(p, use_twins=False)
    (tckv0, tclen0, tkept), (tckv1, tclen1), _ = run(p, use_twins=True)
    assert torch.equal(kept, tkept) and torch.equal(clen0, tclen0) and torch.equal(clen1, tclen1)
    ns, P = CFG.n_sink, CFG.keep_prefill
    for r, s in enumerate(SLOTS):
        assert int(clen0[s]) == ns + CFG.k and int(clen1[s]) == ns + CFG.k
        torch.testing.assert_close(ckv0[s, :, :ns + CFG.k], tckv0[s, :, :ns + CFG.k])
        torch.testing.assert_close(ckv1[s, :, :ns + CFG.k], tckv1[s, :, :ns + CFG.k])
        # prefill end: the kept tokens are the reference's top-P, kept + rest its top-k
        cfg0 = dataclasses.replace(CFG, k_min=0)
        top_p, _ = S.select(ev[r:r + 1], norms[r:r + 1], lo[r:r + 1], hi[r:r + 1], selector_params(cfg0), P)
        top_k, _ = S.select(ev[r:r + 1], norms[r:r + 1], lo[r:r + 1], hi[r:r + 1], selector_params(cfg0), CFG.k)
        pos0 = positions_of(p, r, ckv0[s], ns + CFG.k)
        pos1 = positions_of(p, r, ckv1[s], ns + CFG.k)
        for h in range(HKV):
            assert kept[s, h].tolist() == top_p[0, h].tolist()
            assert pos0[h][:ns] == list(range(ns)) and pos0[h][ns:ns + P] == kept[s, h].tolist()
            assert sorted(pos0[h][ns:]) == top_k[0, h].tolist()
            # decode: the kept entries are untouched, the new selection is disjoint from them
            assert pos1[h][:ns + P] == pos0[h][:ns + P]
            new = pos1[h][ns + P:]
            assert len(set(new)) == CFG.k - P and not set(new) & set(kept[s, h].tolist())
            assert all(ns <= x < LENS[r] - CFG.n_recent for x in new)
