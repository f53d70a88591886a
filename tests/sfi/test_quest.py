"""SFI with the Quest-style page selector (``sfi.selector = "quest"``).

A brute-force Quest written out here (per page max/min of K over the keys that exist, the bound
``scale * sum_d max(q_d kmax_d, q_d kmin_d)`` per query head, max over the GQA group, pages in
descending bound order (ties: lower page first) filling ``k`` tokens of the allowed set, then
softmax attention over sink + selected + recent) is the reference for:
- the page-evidence twin + the PyTorch selector (selected sets and whole pages);
- the Triton page-evidence kernel (under ``TRITON_INTERPRET=1`` on CPU) against its twin;
- the SFI layer path (``sfi_decode``) in quest mode over two steps: selection rows read their
  selection in the same step, the decode step updates the newest page's max/min, fast rows read the
  previous selection.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.kernel_choice import torch_kernels
from vllm_ext.methods.sfi.path import quest_page_update, quest_prefill_pages, sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.block_representatives import block_representatives_torch
from vllm_ext.kernels.paged_reference import attention_over, gather_kv
from vllm_ext.kernels.quest_pages import (quest_page_evidence_torch, quest_page_evidence_triton,
                                          quest_selector_params, read_page_bounds)
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton
from vllm_ext.kernels import sfi_selector_torch as torch_selector
from vllm_ext.methods.sfi.selector_params import selector_params
from vllm_ext.methods.sfi.slot_tables import QuestPrefillPages
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers, write_plan

HKV, D, BS = 2, 16, 16          # BS: the paged cache's block size (independent of the Quest page)


def make_cache(lens, gen, extra=2):
    max_blocks = -(-(max(lens) + extra) // BS) + 1
    nb = len(lens) * max_blocks + 2
    kv = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)      # [nb, H, BS, 2D]
    bt = torch.randperm(nb, generator=gen)[: len(lens) * max_blocks].reshape(len(lens), max_blocks)
    return kv, bt.to(torch.int32)


def brute_quest(q, kv, bt_row, t, cfg, scale, k, sel_from=None, kept=None):
    """Brute-force Quest for one decode query ``q [Hq, D]`` at length ``t``: returns the output
    ``[Hq, D]`` and the selected positions per KV head. ``sel_from``: attend with a given selection
    (a fast row reading an older one) instead of selecting now. ``kept`` (per KV head): positions
    attended besides the pages (``keep_prefill``), which the pages skip."""
    page = cfg.page_size
    keys, vals = gather_kv(kv, bt_row, torch.arange(t))                      # [H, t, D]
    hq = q.shape[0]
    g = hq // HKV
    lo, hi = cfg.n_sink, t - cfg.n_recent
    sels = []
    for h in range(HKV):
        if sel_from is not None:
            sels.append(sel_from[h])
            continue
        bounds = []
        for p in range(-(-t // page)):
            kp = keys[h, p * page:min((p + 1) * page, t)].double()
            kmax, kmin = kp.max(0).values, kp.min(0).values
            bounds.append(max(float(torch.maximum(q[i].double() * kmax, q[i].double() * kmin).sum() * scale)
                              for i in range(h * g, (h + 1) * g)))
        chosen = []
        for p in sorted(range(len(bounds)), key=lambda p: (-bounds[p], p)):
            for j in range(p * page, min((p + 1) * page, t)):
                if lo <= j < hi and len(chosen) < k and (kept is None or j not in kept[h]):
                    chosen.append(j)
        sels.append(sorted(chosen))
    out = torch.empty(hq, D)
    for h in range(HKV):
        idx = sorted(set(range(min(cfg.n_sink, t))) | set(sels[h]) | set(range(max(t - cfg.n_recent, 0), t))
                     | set(kept[h] if kept is not None else ()))
        o, _ = attention_over(q[h * g:(h + 1) * g][None], keys[h:h + 1, idx], vals[h:h + 1, idx], scale)
        out[h * g:(h + 1) * g] = o[0]
    return out, sels


def page_reps(kv, bt, lens, page, slots, n_slots, nb):
    reps = torch.zeros(n_slots, 2, nb, HKV, D)
    full = block_representatives_torch(kv, bt, torch.tensor(lens, dtype=torch.int32), page, nb)
    for i, s in enumerate(slots):
        reps[s] = full[i]
    return reps


def bound_pages(reps, bs=None, gen=None):
    """``reps [slots, 2, NB, Hkv, D]`` as bound pages (``vllm_ext.kernels.quest_pages``): with ``bs``
    None one block per slot and the trivial table; else blocks of ``bs`` entries at shuffled block
    ids (spare blocks hold NaN) and the table that finds them."""
    n_slots, _, nb, hkv, d = reps.shape
    flat = torch.cat([reps[:, 0], reps[:, 1]], dim=-1).transpose(1, 2)          # [slots, Hkv, NB, 2D]
    if bs is None:
        return flat.contiguous(), torch.arange(n_slots, dtype=torch.int32)[:, None]
    per = -(-nb // bs)
    flat = torch.nn.functional.pad(flat, (0, 0, 0, per * bs - nb))
    blocks = flat.reshape(n_slots, hkv, per, bs, 2 * d).transpose(1, 2).reshape(n_slots * per, hkv, bs, 2 * d)
    total = n_slots * per + 3
    ids = torch.randperm(total, generator=gen)[:n_slots * per]
    pages = torch.full((total, hkv, bs, 2 * d), float("nan"))
    pages[ids] = blocks
    return pages, ids.view(n_slots, per).to(torch.int32)


def layer_bounds(layer, slots, num_pages=None):
    """The layer's page bounds of ``slots``: ``[S, 2, NB, Hkv, D]``."""
    nb = num_pages if num_pages is not None else layer.quest_table.shape[1] * layer.quest_pages.shape[2]
    return read_page_bounds(layer.quest_pages, layer.quest_table, slots, nb)


GRID = [
    # (g, page_size, k, n_sink, n_recent, lens): partial last pages, allowed sets cut inside a page
    (1, 8, 16, 4, 8, [61, 100]),
    (4, 16, 32, 4, 16, [97, 130]),
    (2, 32, 32, 0, 32, [160, 147]),         # page-aligned allowed set for the first row
    (4, 8, 8, 2, 5, [45, 33]),
]


@pytest.mark.parametrize("case", range(len(GRID)))
def test_twin_selection_equals_brute_force(case):
    g, page, k, n_sink, n_recent, lens = GRID[case]
    cfg = SfiConfig(enabled=True, selector="quest", page_size=page, k=k, k_min=min(4, k),
                    n_sink=n_sink, n_recent=n_recent)
    gen = torch.Generator().manual_seed(case)
    kv, bt = make_cache(lens, gen)
    scale = D ** -0.5
    q = torch.randn(len(lens), HKV * g, D, generator=gen)
    length = max(lens) + 3
    nb = -(-length // page)
    reps = page_reps(kv, bt, lens, page, [1, 0], 3, nb)
    rows = torch.tensor([0, 1, -1], dtype=torch.int32)
    t = torch.tensor(lens, dtype=torch.int32)
    lo = torch.tensor([n_sink, n_sink, 0], dtype=torch.int32)
    hi = torch.tensor([lens[0] - n_recent, lens[1] - n_recent, 0], dtype=torch.int32)
    ev = torch.full((3, HKV, length), 5.0)
    quest_page_evidence_torch(q, *bound_pages(reps), scale, rows, torch.tensor([1, 0, 2], dtype=torch.int32),
                              lo, hi, page, ev)
    assert torch.all(ev[2] == 5.0), "an unused entry was written"
    sel, n_sel = torch_selector.select(ev[:2], torch.ones(2, HKV, length), lo[:2], hi[:2],
                                       quest_selector_params(selector_params(cfg)), k)
    for r in range(2):
        _, ref = brute_quest(q[r], kv, bt[r], lens[r], cfg, scale, k)
        for h in range(HKV):
            got = sel[r, h, :int(n_sel[r])].tolist()
            assert got == ref[h], f"row {r} head {h}"
            pages = {j // page for j in got}
            if n_sink % page == 0 and (lens[r] - n_recent) % page == 0:
                # an allowed set made of whole pages and k a multiple of the page: whole pages
                assert len(got) == len(pages) * page


@pytest.mark.skipif(not (HAS_TRITON and use_triton(torch.device("cpu"))),
                    reason="needs the Triton interpreter (CPU) or CUDA")
@pytest.mark.parametrize("g, page, d", [(1, 8, 16), (4, 16, 16), (3, 4, 24)])
def test_triton_page_evidence_equals_twin(g, page, d):
    gen = torch.Generator().manual_seed(g * 10 + page)
    s_entries, n_slots, nb, length = 4, 5, 9, 9 * page + 5
    hkv = 2
    q = torch.randn(3, hkv * g, d, generator=gen)
    reps = torch.randn(n_slots, 2, nb, hkv, d, generator=gen)
    rows = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    slot = torch.tensor([4, 0, 1, 3], dtype=torch.int32)
    lo = torch.tensor([3, 0, 0, page], dtype=torch.int32)
    hi = torch.tensor([5 * page + 3, 0, length, 7 * page], dtype=torch.int32)
    count = torch.tensor([3], dtype=torch.int32)          # entry 3 is past the count: untouched
    outs = []
    for fn in (quest_page_evidence_torch, quest_page_evidence_triton):
        out = torch.full((s_entries, hkv, length), 7.0)
        fn(q, *bound_pages(reps, 4, gen), 0.3, rows, slot, lo, hi, page, out, count=count)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.all(outs[0][1] == 7.0) and torch.all(outs[0][3] == 7.0)
    assert torch.all(outs[0][0, :, 5 * page + 3:] == 7.0)          # positions >= hi untouched
    assert torch.all(outs[0][0, :, :3] == float("-inf"))           # [0, lo) masked


# ------------------------------------------------------------------------ the layer path
DENSE, SLOW, FAST, PAD = "dense", "slow", "fast", "pad"


def quest_plan(buffers, cfg, modes, lens, slots, bt):
    dev = bt.device
    t = torch.tensor([0 if m == PAD else n for m, n in zip(modes, lens)], dtype=torch.int32, device=dev)
    slow = torch.tensor([m == SLOW for m in modes], device=dev)
    sparse = torch.tensor([m in (SLOW, FAST) for m in modes], device=dev)
    s = torch.tensor(slots, dtype=torch.int32, device=dev)
    on = torch.tensor([m != PAD for m in modes], device=dev)
    return write_plan(buffers, len(modes), slow=slow, fast=sparse, sparse=sparse,
                      row_sfi_slot=torch.where(sparse, s, 0), k=torch.full_like(t, cfg.k),
                      recent_start=torch.clamp(t - cfg.n_recent, min=0),
                      lo=torch.full_like(t, cfg.n_sink), hi=torch.clamp(t - cfg.n_recent, min=cfg.n_sink),
                      t=t, block_table=bt, page_slot=torch.where(on, s, -1)), t


# the Triton path on one case: the interpreter is slow, and the kernels' own grids are in the tests above
@pytest.mark.parametrize("g, n_recent, kernels", [(1, 12, "twins"), (4, 3, "twins"), (2, 3, "twins"),
                                                  (4, 3, "triton")])
def test_layer_path_equals_brute_force(g, n_recent, kernels):
    if kernels == "triton" and not (HAS_TRITON and use_triton(torch.device("cpu"))):
        pytest.skip("needs the Triton interpreter")
    # n_recent 3 < page 8: the newest token's page reaches into the allowed set, so the decode
    # step's update of that page's max/min decides the selection
    cfg = SfiConfig(enabled=True, selector="quest", page_size=8, k=24, k_min=4, n_sink=4,
                    n_recent=n_recent)
    lens = [30, 100, 124, 50, 79]         # row 0 dense; partial last pages
    slots = [3, 0, 2, 1, 4]
    gen = torch.Generator().manual_seed(g)
    kv, bt = make_cache(lens, gen, extra=4)
    scale = D ** -0.5
    hq = HKV * g
    max_len = max(lens) + 8
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    with ctx:
        layer = SfiLayerBuffers(5, HKV, cfg, D, torch.float32, torch.device("cpu"), num_heads=hq,
                                max_len=max_len)
        rt = SfiRuntime(cfg, capacity=5, max_rows=5, num_heads=hq, num_kv_heads=HKV, head_size=D,
                        max_len=max_len, device=torch.device("cpu"))
        buffers = SfiPlanBuffers(5, 5, torch.device("cpu"))
        # prefill wrote positions [0, t - 1) (two chunks for row 1: the second starts inside a page)
        pre = [n - 1 for n in lens]
        quest_prefill_pages(kv, bt, QuestPrefillPages(
            rows=torch.tensor([0, 1, 2, 3, 4]), seq_lens=torch.tensor([p if i != 1 else 50 for i, p in enumerate(pre)],
                                                                      dtype=torch.int32),
            first_page=torch.zeros(5, dtype=torch.int32), sfi_slot=torch.tensor(slots, dtype=torch.int32),
            max_pages=-(-max(pre) // 8)), cfg, layer)
        quest_prefill_pages(kv, bt, QuestPrefillPages(
            rows=torch.tensor([1]), seq_lens=torch.tensor([pre[1]], dtype=torch.int32),
            first_page=torch.tensor([50 // 8], dtype=torch.int32), sfi_slot=torch.tensor([0], dtype=torch.int32),
            max_pages=-(-pre[1] // 8) - 50 // 8), cfg, layer)
        steps = [([DENSE, SLOW, SLOW, PAD, SLOW], lens),
                 ([DENSE, FAST, SLOW, PAD, FAST], [n + 1 for n in lens])]
        prev_sel = {}
        for modes, cur in steps:
            plan, t = quest_plan(buffers, cfg, modes, cur, slots, bt)
            q = torch.randn(5, hq, D, generator=gen)
            out = torch.full_like(q, 7.0)
            sfi_decode(q, kv, bt, t, plan, cfg, layer, rt, 0, scale, out, dense_done=False)
            # every SFI row's page table (the exactly-dense row's too) covers its keys [0, t)
            live = [r for r, m in enumerate(modes) if m != PAD]
            nb = layer.quest_pages.shape[2]
            full = block_representatives_torch(kv, bt[live], t[live], cfg.page_size, nb)
            got = layer_bounds(layer, [slots[r] for r in live])
            for i, r in enumerate(live):
                torch.testing.assert_close(got[i], full[i], msg=f"row {r} pages")
            for r, m in enumerate(modes):
                if m == PAD:
                    assert torch.all(out[r] == 7.0)
                    continue
                if m == DENSE:
                    keys, vals = gather_kv(kv, bt[r], torch.arange(cur[r]))
                    ref = attention_over(q[r][None], keys, vals, scale)[0][0]
                else:
                    ref, sel = brute_quest(q[r], kv, bt[r], cur[r], cfg, scale, cfg.k,
                                           sel_from=prev_sel.get(r) if m == FAST else None)
                    if m == SLOW:
                        prev_sel[r] = sel
                torch.testing.assert_close(out[r], ref, atol=2e-4, rtol=2e-4, msg=f"row {r} ({m})")
    assert set(prev_sel) == {1, 2, 4}


def test_resumed_request_recomputing_generated_tokens_writes_its_pages():
    """A request resumed after preemption whose prompt is a prefix hit recomputes only generated
    tokens: one row of several tokens, all 'decode'. SFI runs it densely, but its pages must be
    written (from page 0, it is the slot's first own chunk) before its first decode selects."""
    import numpy as np

    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "selector": "quest", "page_size": 8, "k": 32,
                                            "k_min": 4, "n_recent": 8}})
    tables = SfiSlotTables(4, 4, 4, cfg, None, torch.device("cpu"), max_model_len=1024)
    for slot in (0, 1, 2):
        tables.assign(slot, None)
    row_slots = np.array([0, 1, 2])
    # row 0: resumed, 40 tokens cached, recomputes 6 generated tokens; row 1: one-token decode;
    # row 2: a prompt chunk
    qsl, computed = np.array([0, 6, 7, 27]), np.array([40, 90, 16])
    plan = tables.plan_quest_pages(num_reqs=3, row_slots=row_slots, row_is_decode=np.array([1, 1, 0]),
                                   host_geometry=(qsl, computed))
    assert plan.rows.tolist() == [0, 2]
    assert plan.seq_lens.tolist() == [46, 36]
    assert plan.first_page.tolist() == [0, 0]            # both are their slot's first own chunk
    assert plan.sfi_slot.tolist() == [tables.slot_host[0], tables.slot_host[2]]
    # one-token decode rows alone plan nothing on the host
    assert tables.plan_quest_pages(num_reqs=3, row_slots=row_slots, row_is_decode=np.array([1, 1, 1]),
                                   host_geometry=(np.array([0, 1, 2, 3]), np.array([46, 91, 36]))) is None


@pytest.mark.parametrize("kernels", ["twins", "triton"])
def test_fresh_slot_over_a_cached_context_writes_every_page(kernels):
    """A request that takes a fresh compact slot while its context is already in the cache (resumed
    after preemption, the prefix hit leaving one token to compute) decodes at once: its first decode
    row writes every page of the context; later rows write their newest page only; a slot whose
    prefill chunks wrote its pages continues from there."""
    import numpy as np

    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

    if kernels == "triton" and not (HAS_TRITON and use_triton(torch.device("cpu"))):
        pytest.skip("the Triton form runs on CPU tensors under the interpreter (CI); on a GPU machine the "
                    "CUDA range kernel is checked by tests/critiprefill/test_incremental_reps.py")
    page = 8
    full = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "selector": "quest", "page_size": page, "k": 16,
                                             "k_min": 4, "n_recent": 8}})
    cfg = full.sfi
    lens = [61, 100]
    kv, bt = make_cache(lens, torch.Generator().manual_seed(3), extra=2)
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    with ctx:
        tables = SfiSlotTables(2, 2, 2, full, None, torch.device("cpu"), max_model_len=1024)
        sfi_slot = torch.tensor([tables.assign(s, None)[0] for s in (0, 1)], dtype=torch.int32)
        tables.apply_resets(torch.tensor([0, 1]), sfi_slot, torch.full((2,), 16, dtype=torch.int32),
                            torch.ones(2, dtype=torch.bool))
        layer = SfiLayerBuffers(2, HKV, cfg, D, torch.float32, torch.device("cpu"), num_heads=HKV,
                                max_len=max(lens) + 8)
        layer.quest_pages.fill_(float("nan"))
        # request 1's prefill chunk wrote positions [0, 99): its pages are written (host plan)
        pre = tables.plan_quest_pages(num_reqs=2, row_slots=np.array([0, 1]), row_is_decode=np.array([1, 0]),
                                      host_geometry=(np.array([0, 1, 100]), np.array([60, 0])))
        assert pre.rows.tolist() == [1]
        assert pre.seq_lens.tolist() == [99]
        quest_prefill_pages(kv, bt, pre, cfg, layer)
        for step_lens in (lens, [n + 1 for n in lens]):
            seq = torch.tensor(step_lens, dtype=torch.int32)
            step = tables.plan(row_slot=torch.tensor([0, 1], dtype=torch.int32),
                               row_last_token=torch.zeros(2, dtype=torch.int64),
                               row_is_decode=torch.ones(2, dtype=torch.int32), seq_lens=seq, block_table=bt)
            if step_lens is lens:
                assert step.row_page_first.tolist() == [0, 99 // page]
            else:
                assert step.row_page_first.tolist() == [lens[0] // page, lens[1] // page]
            quest_page_update(kv, bt, seq, step.row_page_slot, step.row_page_first, cfg, layer)
        nb = layer.quest_pages.shape[2]
        want = page_reps(kv, bt, [n + 1 for n in lens], page, sfi_slot.tolist(), 3, nb)
        got = layer_bounds(layer, list(range(3)))
        for i, n in enumerate(lens):
            s = int(sfi_slot[i])
            live = -(-(n + 1) // page)
            torch.testing.assert_close(got[s, :, :live], want[s, :, :live], atol=0, rtol=0)


@pytest.mark.parametrize("kernels", ["twins", "triton"])
def test_kept_prefill_tokens_stay_and_pages_fill_the_rest(kernels):
    """``keep_prefill`` with the quest selector: the prefill end makes SFI's selection (spans
    applied) and keeps its best P tokens; a decode selection row keeps them in place and the pages
    fill the other ``k - P`` tokens among the positions not kept, in the same step."""
    import dataclasses

    from vllm_ext.methods.sfi.path import _prefill_end_select

    if kernels == "triton" and not (HAS_TRITON and use_triton(torch.device("cpu"))):
        pytest.skip("needs the Triton interpreter")
    g, page, keep = 2, 8, 10
    cfg = SfiConfig(enabled=True, selector="quest", page_size=page, k=32, k_min=4, n_sink=4, n_recent=12,
                    keep_prefill=keep, select_span=2, select_span_back=1)
    lens = [101, 140]
    slots = [1, 0]
    gen = torch.Generator().manual_seed(11)
    kv, bt = make_cache(lens, gen, extra=4)
    scale = D ** -0.5
    hq = HKV * g
    max_len = max(lens) + 8
    plen = torch.tensor([n - 6 for n in lens], dtype=torch.int32)
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    with ctx:
        layer = SfiLayerBuffers(2, HKV, cfg, D, torch.float32, torch.device("cpu"), num_heads=hq,
                                max_len=max_len)
        assert layer.prompt_tail is not None, "the prefill-end selection needs the prompt's last queries"
        rt = SfiRuntime(cfg, capacity=2, max_rows=2, num_heads=hq, num_kv_heads=HKV, head_size=D,
                        max_len=max_len, device=torch.device("cpu"))
        # the decode step writes the pages of the tokens after the prompt
        quest_prefill_pages(kv, bt, QuestPrefillPages(
            rows=torch.tensor([0, 1]), seq_lens=plen, first_page=torch.zeros(2, dtype=torch.int32),
            sfi_slot=torch.tensor(slots, dtype=torch.int32), max_pages=-(-int(plen.max()) // page)), cfg, layer)
        length = max_len
        ev = torch.randn(2, HKV, length, generator=gen) * 3
        norms = torch.rand(2, HKV, length, generator=gen) + 0.1
        lo = torch.full((2,), cfg.n_sink, dtype=torch.int32)
        hi = plen - cfg.n_recent
        k = torch.full((2,), cfg.k, dtype=torch.int32)
        _prefill_end_select(rt, cfg, layer, kv, bt, torch.tensor(slots, dtype=torch.int32), plen, ev, norms,
                            lo, hi, k)
        kept_ref, _ = torch_selector.select(ev, norms, lo, hi, dataclasses.replace(selector_params(cfg), k_min=0),
                                            keep)
        kept = [[sorted(layer.kept_pos[slots[r], h].tolist()) for h in range(HKV)] for r in range(2)]
        for r in range(2):
            for h in range(HKV):
                assert kept[r][h] == sorted(kept_ref[r, h, :keep].tolist()), f"row {r} head {h}: kept"
        kept_entries = layer.compact_kv[:, :, cfg.n_sink:cfg.n_sink + keep].clone()
        # one decode step, both rows select (as SfiSlotTables.plan sets them with keep_prefill)
        buffers = SfiPlanBuffers(2, 2, torch.device("cpu"))
        plan, t = quest_plan(buffers, cfg, [SLOW, SLOW], lens, slots, bt)
        plan.slow_kept[:2].fill_(keep)
        plan.slow_k[:2].sub_(keep)
        q = torch.randn(2, hq, D, generator=gen)
        out = torch.zeros_like(q)
        sfi_decode(q, kv, bt, t, plan, cfg, layer, rt, 0, scale, out, dense_done=False)
    assert torch.equal(layer.compact_kv[:, :, cfg.n_sink:cfg.n_sink + keep], kept_entries)
    assert layer.compact_len[slots].tolist() == [cfg.n_sink + cfg.k] * 2
    for r in range(2):
        ref, sel = brute_quest(q[r], kv, bt[r], lens[r], cfg, scale, cfg.k - keep, kept=kept[r])
        for h in range(HKV):
            assert not set(sel[h]) & set(kept[r][h]) and len(sel[h]) == cfg.k - keep
        torch.testing.assert_close(out[r], ref, atol=2e-4, rtol=2e-4, msg=f"row {r}")


def _quest_sequence(device: str, *, keep: int, capture: bool, twins: bool, rerank: int = 0):
    """Quest (``keep`` > 0: with ``keep_prefill``; ``rerank`` > 0: with ``quest_rerank``) over a
    sequence of steps whose rows flip between selection, dense and padding: the outputs of every
    step. ``capture``: the step is captured once in a CUDA graph and replayed with each plan (the
    plan buffers rewritten in place)."""
    cfg = SfiConfig(enabled=True, selector="quest", page_size=8, k=24, k_min=4, n_sink=4, n_recent=12,
                    keep_prefill=keep, select_span=2 if keep else 0, select_span_back=1 if keep else 0,
                    quest_rerank=rerank)
    g = 2
    lens = [100, 130, 77]
    slots = [1, 0, 2]
    gen = torch.Generator().manual_seed(21)
    kv, bt = make_cache([n + 4 for n in lens], gen, extra=4)
    kv, bt = kv.to(device), bt.to(device)
    scale = D ** -0.5
    hq = HKV * g
    max_len = max(lens) + 12
    sequence = [[SLOW, SLOW, DENSE], [SLOW, PAD, SLOW], [DENSE, SLOW, SLOW], [SLOW, SLOW, SLOW]]
    qs = [torch.randn(3, hq, D, generator=gen).to(device) for _ in sequence]
    dev = torch.device(device)
    ctx = torch_kernels() if twins else contextlib.nullcontext()
    with ctx:
        layer = SfiLayerBuffers(3, HKV, cfg, D, torch.float32, dev, num_heads=hq, max_len=max_len)
        rt = SfiRuntime(cfg, capacity=3, max_rows=3, num_heads=hq, num_kv_heads=HKV, head_size=D,
                        max_len=max_len, device=dev)
        buffers = SfiPlanBuffers(3, 3, dev)
        quest_prefill_pages(kv, bt, QuestPrefillPages(
            rows=torch.arange(3, device=dev), seq_lens=torch.tensor([n - 1 for n in lens], dtype=torch.int32,
                                                                    device=dev),
            first_page=torch.zeros(3, dtype=torch.int32, device=dev),
            sfi_slot=torch.tensor(slots, dtype=torch.int32, device=dev),
            max_pages=-(-max(lens) // 8)), cfg, layer)
        if keep:
            # a prefill end kept `keep` positions per slot (their entries after the sink)
            pos = torch.arange(cfg.n_sink, cfg.n_sink + 3 * keep, 3, dtype=torch.int32, device=dev)
            layer.kept_pos.copy_(pos.expand_as(layer.kept_pos))
            layer.compact_kv[:, :, cfg.n_sink:cfg.n_sink + keep] = 0.5

        def plan(i):
            modes = sequence[i]
            p, t = quest_plan(buffers, cfg, modes, [n + i for n in lens], slots, bt)
            if keep:                                  # what SfiSlotTables.plan adds
                live = p.slow_sfi_slot >= 0
                p.slow_kept.copy_(torch.where(live, keep, 0))
                p.slow_k.sub_(p.slow_kept)
            return p, t

        outs = []
        q_in = torch.empty_like(qs[0])
        out = torch.empty_like(qs[0])
        t_in = torch.zeros(3, dtype=torch.int32, device=dev)
        p0, t0 = plan(0)

        def step():
            sfi_decode(q_in, kv, bt, t_in, p0, cfg, layer, rt, 0, scale, out, dense_done=False)

        graph = None
        if capture:
            t_in.copy_(t0)
            q_in.copy_(qs[0])
            step()                                    # warm-up (compiles) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        for i, q in enumerate(qs):
            _, t = plan(i)                            # rewrites the same plan buffers
            t_in.copy_(t)
            q_in.copy_(q)
            out.fill_(7.0)
            if graph is not None:
                graph.replay()
                torch.cuda.synchronize()
            else:
                step()
            outs.append([None if m == PAD else out[r].clone().cpu() for r, m in enumerate(sequence[i])])
    return outs


def _same_outputs(got, want, atol):
    for i, (a, b) in enumerate(zip(got, want)):
        for r, (x, y) in enumerate(zip(a, b)):
            if y is not None:
                torch.testing.assert_close(x, y, atol=atol, rtol=atol, msg=lambda s: f"step {i} row {r}: {s}")


SEQUENCE_CASES = [(0, 0), (8, 0), (0, 2), (8, 2)]        # (keep_prefill, quest_rerank)


@pytest.mark.parametrize("keep, rerank", SEQUENCE_CASES)
def test_quest_steps_with_rows_flipping_modes_kernels_equal_twins(keep, rerank):
    if not (HAS_TRITON and use_triton(torch.device("cpu"))):
        pytest.skip("needs the Triton interpreter")
    _same_outputs(_quest_sequence("cpu", keep=keep, capture=False, twins=False, rerank=rerank),
                  _quest_sequence("cpu", keep=keep, capture=False, twins=True, rerank=rerank), 2e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("keep, rerank", SEQUENCE_CASES)
def test_quest_step_replays_from_a_cuda_graph(keep, rerank):
    """One capture of the quest path (page update, page scores, with ``quest_rerank`` the candidates'
    top-K and exact logits, selector with the kept positions excluded, gather after them, two-segment
    pass), replayed with plans whose rows flip modes: each replay equals the eager twins on the same
    sequence."""
    _same_outputs(_quest_sequence("cuda", keep=keep, capture=True, twins=False, rerank=rerank),
                  _quest_sequence("cuda", keep=keep, capture=False, twins=True, rerank=rerank), 2e-3)
