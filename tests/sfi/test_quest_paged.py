"""Quest's page bounds read and written through a block table (``vllm_ext.kernels.quest_pages``,
``vllm_ext.kernels.paged_state``): the layout vLLM pages (blocks of ``bs`` bound entries at any block
ids, the per-slot table) gives exactly what the contiguous layout (one block per slot) gives.

- the paged evidence: Triton (interpreter) against its twin over a small grid of GQA groups, Quest
  pages, head sizes and block sizes; the same bounds at other block ids give identical evidence and
  selections;
- the paged update (prefill chunks with a host bound, decode rows looping in the kernel, rows
  writing through a per-slot table row): Triton against the twin against the whole-context reference;
  rows without pages write nothing;
- the quest layer path (``sfi_decode`` over steps whose rows flip modes): a layer whose bounds live in
  scattered blocks gives the outputs and compact segments of the contiguous layer, bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.kernel_choice import torch_kernels
from tests.sfi.test_quest import (D, DENSE, FAST, HKV, PAD, SLOW, bound_pages, make_cache, page_reps,
                                  quest_plan)
from vllm_ext.methods.sfi.path import quest_page_update, quest_prefill_pages, sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import sfi_selector_torch as torch_selector
from vllm_ext.kernels.block_representatives import block_representatives_torch
from vllm_ext.kernels.paged_state import (update_block_representatives_paged_from_torch,
                                          update_block_representatives_paged_from_triton,
                                          update_block_representatives_paged_torch,
                                          update_block_representatives_paged_triton)
from vllm_ext.kernels.quest_pages import (quest_page_evidence_torch, quest_page_evidence_triton,
                                          quest_selector_params, read_page_bounds)
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton
from vllm_ext.methods.sfi.quest_tables import QuestPrefillPages, quest_blocks
from vllm_ext.methods.sfi.selector_params import selector_params
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

TRITON = HAS_TRITON and use_triton(torch.device("cpu"))
needs_triton = pytest.mark.skipif(not TRITON, reason="needs the Triton interpreter (CPU) or CUDA")


def _evidence_case(g, page, d, bs, seed):
    gen = torch.Generator().manual_seed(seed)
    n_slots, nb, hkv = 5, 9, 2
    length = nb * page + 5
    q = torch.randn(3, hkv * g, d, generator=gen)
    reps = torch.randn(n_slots, 2, nb, hkv, d, generator=gen)
    rows = torch.tensor([2, -1, 0, 1, 0], dtype=torch.int32)
    slot = torch.tensor([4, 0, 1, 3, 2], dtype=torch.int32)
    lo = torch.tensor([3, 0, 0, page, 1], dtype=torch.int32)
    hi = torch.tensor([5 * page + 3, 0, length, 7 * page, page - 1], dtype=torch.int32)
    return gen, q, reps, rows, slot, lo, hi, length


@needs_triton
@pytest.mark.parametrize("g, page, d, bs", [(1, 8, 16, 16), (4, 16, 16, 4), (3, 4, 24, 5), (2, 2, 32, 16)])
def test_paged_evidence_triton_equals_twin(g, page, d, bs):
    gen, q, reps, rows, slot, lo, hi, length = _evidence_case(g, page, d, bs, seed=g * 100 + page + bs)
    pages, table = bound_pages(reps, bs, gen)
    count = torch.tensor([4], dtype=torch.int32)         # entry 4 is past the count: untouched
    outs = []
    for fn in (quest_page_evidence_torch, quest_page_evidence_triton):
        out = torch.full((5, 2, length), 7.0)
        fn(q, pages, table, 0.3, rows, slot, lo, hi, page, out, count=count)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.all(outs[0][1] == 7.0) and torch.all(outs[0][4] == 7.0)
    # NaN in the spare blocks and in the pages after hi: never read
    assert not outs[0].isnan().any() and not outs[1].isnan().any()


@pytest.mark.parametrize("kernel", ["twin", "triton"])
@pytest.mark.parametrize("g, page, bs", [(2, 8, 16), (4, 4, 3)])
def test_paged_evidence_and_selection_equal_the_contiguous_layout(kernel, g, page, bs):
    """The same bounds, once in one block per slot (the trivial table) and once in blocks of ``bs``
    at shuffled ids: identical evidence, identical selections."""
    if kernel == "triton" and not TRITON:
        pytest.skip("needs the Triton interpreter")
    fn = quest_page_evidence_torch if kernel == "twin" else quest_page_evidence_triton
    gen, q, reps, rows, slot, lo, hi, length = _evidence_case(g, page, 16, bs, seed=7 * g + page)
    # allowed sets inside the pages a request holds (the layouts differ past them: one block of 9
    # pages against whole blocks of bs)
    rows, slot, lo, hi = rows[:4], slot[:4], lo[:4], hi[:4].clamp(max=reps.shape[2] * page)
    evs = []
    for pages, table in (bound_pages(reps), bound_pages(reps, bs, gen)):
        ev = torch.full((4, 2, length), 3.0)
        fn(q, pages, table, 0.5, rows, slot, lo, hi, page, ev)
        evs.append(ev)
    assert torch.equal(evs[0], evs[1])
    cfg = quest_selector_params(selector_params(SfiConfig(enabled=True, selector="quest", page_size=page,
                                                          k=4 * page, k_min=4)))
    live = torch.tensor([0, 2, 3])
    sels = [torch_selector.select(ev[live], torch.ones(3, 2, length), lo[live], hi[live], cfg, 4 * page)
            for ev in evs]
    assert torch.equal(sels[0][0], sels[1][0]) and torch.equal(sels[0][1], sels[1][1])


UPDATE_IMPLS = ["twin", "triton"]


@pytest.mark.parametrize("impl", UPDATE_IMPLS)
@pytest.mark.parametrize("page, bs", [(8, 16), (4, 3), (16, 4)])
def test_paged_page_updates_equal_the_whole_context(impl, page, bs):
    """Prefill chunks (host bound) then decode rows (looping in the kernel) write the bounds of two
    requests through a per-slot table (``state_slot``); a third row has no slot's pages (length 0)
    and writes nothing; the result equals the whole context's page bounds."""
    if impl == "triton" and not TRITON:
        pytest.skip("needs the Triton interpreter")
    chunk = {"twin": update_block_representatives_paged_torch, "triton": update_block_representatives_paged_triton}[impl]
    loop = {"twin": update_block_representatives_paged_from_torch,
            "triton": update_block_representatives_paged_from_triton}[impl]
    lens = [70, 101, 40]
    gen = torch.Generator().manual_seed(page * 10 + bs)
    kv, bt = make_cache(lens, gen, extra=6)
    per = quest_blocks(max(lens) + 4, page, bs)
    n_slots = 4
    total = n_slots * per + 3
    pages = torch.full((total, HKV, bs, 2 * D), float("nan"))
    table = torch.randperm(total, generator=gen)[:n_slots * per].view(n_slots, per).to(torch.int32)
    slot = torch.tensor([2, 0, 3], dtype=torch.int32)           # row 2 -> the scratch slot 3
    i32 = dict(dtype=torch.int32)
    # chunk 1 of rows 0 and 1: [0, 30) and [0, 50); row 2 nothing
    chunk(kv, bt, torch.tensor([30, 50, 0], **i32), torch.zeros(3, **i32), page, -(-50 // page), pages, table, 0,
          state_slot=slot)
    # chunk 2 continues inside a page: [30, 69) and [50, 100)
    first = torch.tensor([30 // page, 50 // page, 0], **i32)
    chunk(kv, bt, torch.tensor([69, 100, 0], **i32), first, page, -(-100 // page) - 50 // page, pages, table, 0,
          state_slot=slot)
    # two decode steps: the newest token's page
    for cur in ([70, 101, 0], [71, 102, 0]):
        seq = torch.tensor(cur, **i32)
        loop(kv, bt, seq, torch.tensor([max(c - 1, 0) // page for c in cur], **i32), page, pages, table, 0,
             state_slot=slot)
    assert pages[table[3].long()].isnan().all(), "the scratch slot's row (length 0) was written"
    want = page_reps(kv, bt[:2], [71, 102], page, [0, 1], 2, -(-102 // page))
    for r, s in enumerate([2, 0]):
        n = -(-[71, 102][r] // page)
        got = read_page_bounds(pages, table, [s], n)[0]
        assert torch.equal(got, want[r, :, :n]), f"row {r}"
    # a row whose slot starts over (its first decode row over a written context) writes every page
    pages.fill_(float("nan"))
    loop(kv, bt, torch.tensor([71, 0, 0], **i32), torch.zeros(3, **i32), page, pages, table, 0, state_slot=slot)
    n = -(-71 // page)
    assert torch.equal(read_page_bounds(pages, table, [2], n)[0], want[0, :, :n])


def _layer(cfg, hq, max_len, paged_bs=None, gen=None):
    """A quest layer; ``paged_bs``: its bounds in blocks of ``paged_bs`` entries at shuffled ids
    (NaN elsewhere), bound through a per-slot table as inside vLLM."""
    layer = SfiLayerBuffers(3, HKV, cfg, D, torch.float32, torch.device("cpu"), num_heads=hq, max_len=max_len)
    if paged_bs is not None:
        per = quest_blocks(max_len, cfg.page_size, paged_bs)
        total = 4 * per + 5
        pages = torch.full((total, HKV, paged_bs, 2 * D), float("nan"))
        table = torch.randperm(total, generator=gen)[:4 * per].view(4, per).to(torch.int32)
        layer.bind_quest_pages(pages, table)
    return layer


def _sequence(kernels: str, paged_bs, rerank: int):
    cfg = SfiConfig(enabled=True, selector="quest", page_size=8, k=24, k_min=4, n_sink=4, n_recent=12,
                    quest_rerank=rerank)
    g, lens, slots = 2, [100, 130, 77], [1, 0, 2]
    gen = torch.Generator().manual_seed(21)
    kv, bt = make_cache([n + 4 for n in lens], gen, extra=4)
    hq, max_len = HKV * g, max(lens) + 12
    sequence = [[SLOW, SLOW, DENSE], [SLOW, PAD, FAST], [DENSE, SLOW, SLOW]]
    qs = [torch.randn(3, hq, D, generator=gen) for _ in sequence]
    ctx = torch_kernels() if kernels == "twins" else contextlib.nullcontext()
    outs = []
    with ctx:
        layer = _layer(cfg, hq, max_len, paged_bs, torch.Generator().manual_seed(5))
        rt = SfiRuntime(cfg, capacity=3, max_rows=3, num_heads=hq, num_kv_heads=HKV, head_size=D,
                        max_len=max_len, device=torch.device("cpu"))
        buffers = SfiPlanBuffers(3, 3, torch.device("cpu"))
        quest_prefill_pages(kv, bt, QuestPrefillPages(
            rows=torch.arange(3), seq_lens=torch.tensor([n - 1 for n in lens], dtype=torch.int32),
            first_page=torch.zeros(3, dtype=torch.int32), sfi_slot=torch.tensor(slots, dtype=torch.int32),
            max_pages=-(-max(lens) // 8)), cfg, layer)
        for i, modes in enumerate(sequence):
            plan, t = quest_plan(buffers, cfg, modes, [n + i for n in lens], slots, bt)
            # page_first as SfiSlotTables plans it: the newest token's page (the prefill wrote the rest)
            plan.row_page_first[:3].copy_(torch.tensor([(n + i - 1) // 8 for n in lens], dtype=torch.int32))
            out = torch.full_like(qs[i], 7.0)
            sfi_decode(qs[i], kv, bt, t, plan, cfg, layer, rt, 0, D ** -0.5, out, dense_done=False)
            outs.append((out.clone(), layer.compact_kv.clone(), layer.compact_len.clone()))
        bounds = torch.cat([read_page_bounds(layer.quest_pages, layer.quest_table, [s], -(-(n + 2) // 8))[0]
                            for s, n in zip(slots, lens)], dim=1)
    return outs, bounds


@pytest.mark.parametrize("kernels, rerank", [("twins", 0), ("twins", 2), ("triton", 2)])
def test_quest_layer_over_scattered_bound_pages_equals_the_contiguous_layer(kernels, rerank):
    if kernels == "triton" and not TRITON:
        pytest.skip("needs the Triton interpreter")
    contiguous, b0 = _sequence(kernels, None, rerank)
    for bs in (16, 3):
        paged, b1 = _sequence(kernels, bs, rerank)
        assert torch.equal(b0, b1), f"bs {bs}: page bounds"
        for i, (a, b) in enumerate(zip(contiguous, paged)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"bs {bs}, step {i}"


def test_decode_update_of_a_row_without_a_slot_touches_nothing():
    """``quest_page_update``: rows with page slot -1 read as length 0 and write through the scratch
    slot's row, which they leave alone."""
    cfg = SfiConfig(enabled=True, selector="quest", page_size=8, k=24, k_min=4, n_sink=4, n_recent=12)
    gen = torch.Generator().manual_seed(3)
    kv, bt = make_cache([60, 60], gen)
    layer = _layer(cfg, HKV, 72, paged_bs=16, gen=gen)
    before = layer.quest_pages.clone()
    with torch_kernels():
        quest_page_update(kv, bt, torch.tensor([60, 60], dtype=torch.int32), torch.tensor([-1, -1], dtype=torch.int32),
                          torch.zeros(2, dtype=torch.int32), cfg, layer)
    assert torch.equal(before.isnan(), layer.quest_pages.isnan())
