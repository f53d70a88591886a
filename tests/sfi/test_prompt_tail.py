"""The prompt tail (``vllm_ext.methods.sfi.prompt_tail``): the prefill-end evidence window spans prefill chunks.

Whatever the chunking of a prompt (and whatever else shares the steps' batches), the queries of its
last ``w_prefill`` positions reach the per-layer buffer exactly once, the prefill end fires once, in
the chunk that reaches the prompt's end, and the selection it makes (the compact segment) is the one
made from the whole prompt at once. PyTorch twins on CPU (the evidence is PyTorch on every device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ext.methods.sfi.path import sfi_prefill_end
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.dense_decode_evidence import prefill_evidence
from vllm_ext.methods.sfi.prompt_tail import TailRow, plan_prompt_tail, prefix_hit_limit

CFG = SfiConfig(enabled=True, k=16, k_min=4, n_sink=4, n_recent=16, w_prefill=16)
HKV, G, D, BS = 2, 2, 32, 16
HQ = HKV * G
W = CFG.w_prefill


@pytest.fixture(autouse=True)
def _twins(monkeypatch):
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")


def chunks_of(p: int, sizes: list[int]) -> list[tuple[int, int]]:
    """(computed, q_len) per step for chunk sizes ``sizes`` (the last one takes the rest)."""
    out, done = [], 0
    for s in sizes:
        if done >= p:
            break
        q = min(s, p - done)
        out.append((done, q))
        done += q
    if done < p:
        out.append((done, p - done))
    return out


CHUNKINGS = {
    "one chunk": [10_000],
    "last chunk 4": [-4],
    "last chunk 1": [-1],
    "window split in three": [-20, 9, 7],
    "chunks of 7": [7] * 1000,
}


def sizes_for(p: int, name: str) -> list[int]:
    sizes = CHUNKINGS[name]
    return [p + sizes[0]] + sizes[1:] if sizes[0] < 0 else sizes


def row(computed, q_len, p, *, token_start=0, sfi_slot=0, first=0, batch_row=0):
    return TailRow(row=batch_row, token_start=token_start, computed=computed, q_len=q_len,
                   prompt_len=p, k=CFG.k, sfi_slot=sfi_slot, first_computed=first)


@pytest.mark.parametrize("name", list(CHUNKINGS))
@pytest.mark.parametrize("p", [123, 16, 5])
def test_plan_writes_each_window_query_once_and_ends_once(name, p):
    written: dict[int, int] = {}                    # window entry -> position of the query stored
    ends = []
    for step, (done, q) in enumerate(chunks_of(p, sizes_for(p, name))):
        offset = 3 * step                           # other requests' tokens come first in the batch
        plan, incomplete = plan_prompt_tail(CFG, [row(done, q, p, token_start=offset)],
                                            torch.device("cpu"))
        assert incomplete == 0
        if plan is None:
            continue
        for tok, slot, idx in zip(plan.write_token.tolist(), plan.write_slot.tolist(),
                                  plan.write_index.tolist()):
            assert slot == 0 and idx not in written
            written[idx] = done + (tok - offset)    # the position this batch token holds
        if plan.num_ends:
            ends.append((step, plan.positions.tolist(), plan.seq_lens.tolist()))
    first = max(W - p, 0)
    assert written == {j: p - W + j for j in range(first, W)}
    assert len(ends) == 1 and ends[0][0] == len(chunks_of(p, sizes_for(p, name))) - 1
    _, positions, seq = ends[0]
    assert positions == [[p - W + j if j >= first else -1 for j in range(W)]] and seq == [p]


def test_a_window_the_request_did_not_compute_is_padded_and_counted():
    # the request's first computed position is 110 (a prefix hit of 110 tokens): 107..109 are missing
    plan, incomplete = plan_prompt_tail(CFG, [row(110, 13, 123, first=110)], torch.device("cpu"))
    assert incomplete == 1
    assert plan.positions.tolist() == [[-1, -1, -1] + list(range(110, 123))]


class Prompt:
    """One request's prompt: its queries at every position of one layer and its K/V in a paged cache."""

    def __init__(self, p: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.p = p
        self.q = torch.randn(p, HQ, D, generator=gen)
        nb = -(-p // BS) + 1
        self.kv = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)
        self.bt = torch.randperm(nb, generator=gen).to(torch.int32)


def make_layer(capacity=3, max_len=256, paged=False):
    """``paged``: the compact segments and prompt-tail queries in KV-cache pages full of leftovers,
    through a per-slot block table of scattered blocks (as inside vLLM)."""
    layer = SfiLayerBuffers(capacity, HKV, CFG, D, torch.float32, torch.device("cpu"), num_heads=HQ,
                            paged=paged)
    if paged:
        gen = torch.Generator().manual_seed(17)
        pages = layer.state_pages(torch.empty(1, HKV, BS, 2 * D))
        assert pages.tail > 0
        nb = (capacity + 1) * pages.total + 1
        cache = torch.randn(nb, BS, HKV, 2 * D, generator=gen).transpose(1, 2)
        table = torch.randperm(nb, generator=gen)[:(capacity + 1) * pages.total].to(torch.int32)
        layer.bind_pages(cache, table.view(capacity + 1, pages.total))
    rt = SfiRuntime(CFG, capacity=capacity, max_rows=4, num_heads=HQ, num_kv_heads=HKV, head_size=D,
                    max_len=max_len, device=torch.device("cpu"))
    return layer, rt


def run_prefill(prompts: list[Prompt], steps: list[list[tuple[int, int, int]]], layer, rt):
    """``steps``: per step, (prompt index, computed, q_len) rows. Each prompt has its own cache
    (concatenated), compact slot = prompt index. Returns the log-evidence of each prefill end."""
    nb = [pr.kv.shape[0] for pr in prompts]
    kv = torch.cat([pr.kv for pr in prompts])
    width = max(nb)
    tables = torch.zeros(len(prompts), width, dtype=torch.int32)
    base = 0
    for i, pr in enumerate(prompts):
        tables[i, : nb[i]] = pr.bt + base
        base += nb[i]
    evidence = {}
    for step in steps:
        rows, queries, start = [], [], 0
        for r, (i, done, q) in enumerate(step):
            rows.append(TailRow(row=r, token_start=start, computed=done, q_len=q,
                                prompt_len=prompts[i].p, k=CFG.k, sfi_slot=i, first_computed=0))
            queries.append(prompts[i].q[done:done + q])
            start += q
        plan, _ = plan_prompt_tail(CFG, rows, torch.device("cpu"))
        batch_tables = tables[[i for i, _, _ in step]]
        if plan is not None:
            sfi_prefill_end(torch.cat(queries), kv, batch_tables, plan, CFG, layer, rt, 0,
                            D ** -0.5)
            for e, r in enumerate(plan.rows.tolist()):
                i = step[r][0]
                evidence[i] = rt.ring.entries[0].log_evidence[e].clone()
    return kv, tables, evidence


def segment(layer, slot: int) -> torch.Tensor:
    """Slot ``slot``'s compact segment ``[Hkv, n_sink + k, 2D]``, whatever the layout."""
    from vllm_ext.kernels.two_segment_decode import compact_entries

    return compact_entries(layer.compact_kv, layer.compact_table, slot, CFG.n_sink + CFG.k)


def solo_steps(p: int, name: str, index: int = 0):
    return [[(index, done, q)] for done, q in chunks_of(p, sizes_for(p, name))]


def reference_evidence(pr: Prompt, kv, table):
    """Evidence from the prompt's true last ``W`` queries, computed directly."""
    ev = torch.zeros(1, HKV, 256)
    pos = torch.arange(pr.p - W, pr.p)[None]
    prefill_evidence(pr.q[pr.p - W:][None], kv, table[None], torch.tensor([pr.p]),
                     torch.tensor([CFG.n_sink]), torch.tensor([pr.p - CFG.n_recent]), D ** -0.5,
                     ev, pos, alpha=CFG.alpha)
    return ev[0]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", [n for n in CHUNKINGS if n != "one chunk"])
def test_selection_is_the_same_for_every_chunking(name, paged):
    pr = Prompt(150, seed=1)
    layer, rt = make_layer()
    kv, tables, ev_one = run_prefill([pr], solo_steps(pr.p, "one chunk"), layer, rt)
    ref_kv = segment(layer, 0).clone()
    ref_len = layer.compact_len[0].clone()
    assert torch.equal(ev_one[0][:, : pr.p], reference_evidence(pr, kv, tables[0])[:, : pr.p])
    assert int(ref_len) == CFG.n_sink + CFG.k

    layer, rt = make_layer(paged=paged)
    if not paged:
        layer.prompt_tail.queries.normal_()       # whatever an earlier request left there
    _, _, ev = run_prefill([pr], solo_steps(pr.p, name), layer, rt)
    assert torch.equal(ev[0][:, : pr.p], ev_one[0][:, : pr.p])
    assert torch.equal(layer.compact_len[0], ref_len)
    assert torch.equal(segment(layer, 0), ref_kv)


SHARED_STEPS = {
    # one ends while the other is mid-window
    "staggered ends": [[(0, 0, 140), (1, 0, 90)], [(1, 90, 5), (0, 140, 10)], [(1, 95, 6)]],
    # both end in the same step, each with a window split across chunks
    "same-step ends": [[(1, 0, 95), (0, 0, 147)], [(0, 147, 3), (1, 95, 6)]],
}


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", list(SHARED_STEPS))
def test_requests_sharing_steps_keep_their_own_windows(name, paged):
    """Two prompts prefilled in the same steps select what each selects alone."""
    a, b = Prompt(150, seed=2), Prompt(101, seed=3)
    alone = []
    for i, pr in enumerate((a, b)):
        layer, rt = make_layer()
        run_prefill([a, b], solo_steps(pr.p, "one chunk", index=i), layer, rt)
        alone.append(segment(layer, i).clone())
    steps = SHARED_STEPS[name]
    layer, rt = make_layer(paged=paged)
    run_prefill([a, b], steps, layer, rt)
    assert torch.equal(segment(layer, 0), alone[0])
    assert torch.equal(segment(layer, 1), alone[1])
    assert not torch.equal(alone[0], alone[1])


def test_prefix_hit_limit_and_cut():
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.scheduling import SfiSchedulingRule
    from vllm_ext.scheduler_policy import SchedulerPolicy
    from vllm_ext.vllm_patches import limit_prefix_hit

    policy = SchedulerPolicy([SfiSchedulingRule(SpeedSfiConfig(sfi=CFG), 4)])
    assert prefix_hit_limit(CFG, 645, 32) == 608           # (645 - 16) // 32 * 32
    assert prefix_hit_limit(CFG, 10, 32) == 0
    Blocks = type("Blocks", (), {"__init__": lambda self, blocks: setattr(self, "blocks", blocks)})
    sched = SimpleNamespace(block_size=32, kv_cache_config=SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=32))]))
    hit = (Blocks((list(range(20)),)), 640, 0, False)
    cut = limit_prefix_hit(sched, SimpleNamespace(num_prompt_tokens=645), policy, hit)
    assert cut[0].blocks == (list(range(19)),) and cut[1:] == (608, 0, False)
    # a hit that already leaves the tail alone is returned as it is
    assert limit_prefix_hit(sched, SimpleNamespace(num_prompt_tokens=700), policy, hit) is hit
    # SFI's compact group (never prefix-cached: no hit blocks) does not make the hit uncuttable
    from vllm_ext import metrics

    metrics.reset()
    sched.kv_cache_config.kv_cache_groups.append(
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=32, prefix_cacheable=False)))
    hit = (Blocks((list(range(20)), [])), 640, 0, False)
    cut = limit_prefix_hit(sched, SimpleNamespace(num_prompt_tokens=645), policy, hit)
    assert cut[0].blocks == (list(range(19)), []) and cut[1] == 608
    assert "fallback.prefix_hit_uncut" not in metrics.snapshot()


def test_a_chunk_without_its_blocks_writes_no_tail_and_its_end_makes_no_selection():
    """Inside vLLM the tail queries live in the request's compact-group blocks: a prefill chunk whose
    request does not hold them (vLLM's scheduler and SPEEDSFI's rule disagreeing) must write none
    (its table row is stale), and a prefill end whose window lost queries so makes no selection
    (counted); a request holding its blocks throughout is planned as before."""
    import numpy as np

    from vllm_ext import metrics
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 16, "k_min": 4, "n_sink": 4,
                                            "n_recent": 16, "w_prefill": 16}})
    tables = SfiSlotTables(4, 4, 4, cfg, None, torch.device("cpu"), max_model_len=1024)
    for slot in (0, 1):
        tables.assign(slot, None)
    p = 100
    prompt_len = np.array([p, p, 0, 0])
    kw = dict(row_slots=np.array([0, 1]), row_is_decode=np.array([0, 0]), prompt_len=prompt_len,
              row_slot_device=torch.tensor([0, 1], dtype=torch.int32))
    metrics.reset()
    # step 1: both compute [0, 90) (tail positions 84..89); request 0 lacks its blocks
    plan = tables.plan_prefill_end(num_reqs=2, host_geometry=(np.array([0, 90, 180]), np.array([0, 0])),
                                   row_has_blocks=np.array([False, True]), **kw)
    assert plan.num_ends == 0 and plan.num_writes == 6
    assert plan.write_slot.tolist() == [tables.slot_host[1]] * 6
    # step 2: both end, holding their blocks now: only request 1 selects
    plan = tables.plan_prefill_end(num_reqs=2, host_geometry=(np.array([0, 10, 20]), np.array([90, 90])),
                                   row_has_blocks=np.array([True, True]), **kw)
    assert plan.num_ends == 1 and plan.sfi_slot.tolist() == [tables.slot_host[1]]
    assert metrics.snapshot().get("fallback.sfi_prompt_tail_lost") == 1
    # the slot's next request starts clean
    tables.release(0)
    tables.assign(0, None)
    plan = tables.plan_prefill_end(num_reqs=1, host_geometry=(np.array([0, 100]), np.array([0])),
                                   row_has_blocks=np.array([True]), **{**kw, "row_slots": np.array([0]),
                                                                         "row_is_decode": np.array([0])})
    assert plan.num_ends == 1
