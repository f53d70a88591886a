"""The SFI decode path as the backend runs it (``vllm_ext.methods.sfi.path``) over a grid of mixed
dense / slow / fast / padded rows: the kernels (Triton on CUDA, under the interpreter on CPU) against
the PyTorch twins, dense rows against an independent reference; on CUDA with no host
synchronisation, and captured in a CUDA graph that is replayed while rows flip between modes.
Also: the plan's compacted slow list, and the runtime's memory sized by ``sfi.max_requests``."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from tests.kernel_choice import torch_kernels
from vllm_ext.methods.sfi.path import sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.paged_reference import attention_over, gather_kv
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers, write_plan

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16)
HKV, D, BS = 2, 32, 16
DENSE, SLOW, FAST, PAD = "dense", "slow", "fast", "pad"


class Problem:
    def __init__(self, lens, g, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.lens = lens
        self.hq = HKV * g
        cap = max(lens) + 8
        self.max_blocks = -(-cap // BS) + 1
        nb = len(lens) * self.max_blocks + 2
        self.kv = torch.randn(nb, BS, HKV, 2 * D, generator=gen).to(device).transpose(1, 2)
        self.bt = torch.randperm(nb, generator=gen)[: len(lens) * self.max_blocks] \
            .reshape(len(lens), self.max_blocks).to(torch.int32).to(device)
        self.scale = D ** -0.5
        self.gen = gen

    def query(self):
        return torch.randn(len(self.lens), self.hq, D, generator=self.gen).to(self.device)


def plan_for(buffers, modes, lens, slots, bt, device):
    rows = len(modes)
    t = torch.tensor([0 if m == PAD else n for m, n in zip(modes, lens)], dtype=torch.int32,
                     device=device)
    slow = torch.tensor([m == SLOW for m in modes], device=device)
    fast = torch.tensor([m == FAST for m in modes], device=device)
    sparse = slow | fast
    lo = torch.full_like(t, CFG.n_sink)
    hi = torch.clamp(t - CFG.n_recent, min=CFG.n_sink)
    return write_plan(buffers, rows, slow=slow, fast=fast, sparse=sparse,
                      row_sfi_slot=torch.where(sparse, torch.tensor(slots, dtype=torch.int32,
                                                                    device=device), 0),
                      k=torch.full_like(t, CFG.k), recent_start=torch.clamp(t - CFG.n_recent, min=0),
                      lo=lo, hi=hi, t=t, block_table=bt), t


def run_path(p, modes, slots, layer, rt, buffers, q, out, *, no_sync=False):
    """The builder's part (the plan: host-to-device copies allowed), then the layer's part, which
    must not synchronise with the host (checked on CUDA with ``no_sync``)."""
    plan, t = plan_for(buffers, modes, p.lens, slots, p.bt, p.device)
    if no_sync:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        sfi_decode(q, p.kv, p.bt, t, plan, CFG, layer, rt, 0, p.scale, out, dense_done=False)
        rt.ring.join()
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode(0)
    return t


def make_state(p, capacity, device):
    layer = SfiLayerBuffers(capacity, HKV, CFG, D, torch.float32, device)
    rt = SfiRuntime(CFG, capacity=capacity, max_rows=len(p.lens), num_heads=p.hq, num_kv_heads=HKV,
                    head_size=D, max_len=max(p.lens) + 8, device=torch.device(device))
    return layer, rt, SfiPlanBuffers(len(p.lens), capacity, torch.device(device))


GRIDS = [
    # two steps per case: the first makes selections (slow rows), the second reads them (fast)
    ([DENSE, SLOW, SLOW, PAD, SLOW], [DENSE, FAST, SLOW, PAD, FAST]),
    ([SLOW, PAD, SLOW, DENSE, SLOW], [FAST, PAD, FAST, SLOW, FAST]),
    ([PAD, DENSE, DENSE, DENSE, DENSE], [PAD, DENSE, DENSE, DENSE, DENSE]),
]
LENS = [40, 130, 97, 61, 161]          # row 0 is short enough to be dense; odd and block+1 lengths
SLOTS = [3, 0, 2, 1, 4]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("grid", range(len(GRIDS)))
def test_orchestration_kernels_equal_twins(device, g, grid):
    p = Problem(LENS, g, device, seed=grid)
    results = []
    for use_twins in (False, True):
        layer, rt, buffers = make_state(p, 5, device)
        gen_state = p.gen.get_state()
        outs = []
        ctx = torch_kernels() if use_twins else contextlib.nullcontext()
        with ctx:
            for modes in GRIDS[grid]:
                q = p.query()
                out = torch.full_like(q, 7.0)
                run_path(p, modes, SLOTS, layer, rt, buffers, q, out,
                         no_sync=device == "cuda" and not use_twins)
                outs.append((q, out.clone()))
        p.gen.set_state(gen_state)
        results.append((outs, layer.compact_kv.clone(), layer.compact_len.clone()))
    (k_outs, k_ckv, k_clen), (t_outs, t_ckv, t_clen) = results
    modes_seen = GRIDS[grid][-1]
    for (q, ko), (_, to) in zip(k_outs, t_outs):
        for r, m in enumerate(modes_seen):
            if m == PAD:
                assert torch.all(ko[r] == 7.0), "a padded row was written"
                continue
            torch.testing.assert_close(ko[r], to[r], atol=2e-4, rtol=2e-4)
    assert torch.equal(k_clen, t_clen)
    for s in range(5):
        n = int(k_clen[s])
        torch.testing.assert_close(k_ckv[s, :, :n], t_ckv[s, :, :n])
    # dense rows of the last step are exactly dense attention
    q, out = k_outs[-1]
    for r, m in enumerate(modes_seen):
        if m == DENSE:
            k, v = gather_kv(p.kv, p.bt[r], torch.arange(LENS[r], device=p.device))
            ref, _ = attention_over(q[r:r + 1], k, v, p.scale)
            torch.testing.assert_close(out[r:r + 1], ref, atol=2e-4, rtol=2e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dual, keep, chunk", [(True, 0, 16), (False, 0, 16), (True, 8, 16), (True, 0, 2),
                                               (True, 8, 1)])
def test_captured_step_replays_with_rows_flipping_modes(dual, keep, chunk):
    """One capture, replays whose plans differ (slow <-> fast <-> dense, padded rows): each replay
    equals the eager twin path run on the same sequence of plans. ``keep``: ``sfi.keep_prefill``
    with 8 kept positions per slot (excluded by the selector, gathered after by the offset).
    ``chunk``: ``sfi.maintenance_rows`` (below the 5 rows: the slow list in 3 or 5 chunks, each in
    its own ring slot on the side stream)."""
    cfg = dataclasses.replace(CFG, dual_stream=dual, keep_prefill=keep, select_span_back=2 if keep else 0,
                              maintenance_rows=chunk)
    p = Problem(LENS, 4, "cuda", seed=5)
    sequence = [GRIDS[0][0], GRIDS[0][1], GRIDS[1][1], [SLOW, DENSE, FAST, PAD, SLOW],
                [FAST, DENSE, SLOW, PAD, FAST]]
    qs = [p.query() for _ in sequence]

    def state():
        layer = SfiLayerBuffers(5, HKV, cfg, D, torch.float32, torch.device("cuda"))
        rt = SfiRuntime(cfg, capacity=5, max_rows=5, num_heads=p.hq, num_kv_heads=HKV,
                        head_size=D, max_len=max(LENS) + 8, device=torch.device("cuda"))
        if keep:
            layer.kept_pos.copy_(torch.arange(CFG.n_sink, CFG.n_sink + keep, dtype=torch.int32,
                                              device="cuda").expand_as(layer.kept_pos))
        return layer, rt, SfiPlanBuffers(5, 5, torch.device("cuda"), chunk_rows=rt.maintenance_rows)

    def plan_with_keep(buf, modes):
        plan, t = plan_for(buf, modes, LENS, SLOTS, p.bt, p.device)
        if keep:                                      # what SfiSlotTables.plan adds
            live = plan.slow_sfi_slot >= 0
            plan.slow_kept.copy_(torch.where(live, keep, 0))
            plan.slow_k.sub_(plan.slow_kept)
        return plan, t

    # eager twins
    layer_t, rt_t, buf_t = state()
    expected = []
    with torch_kernels():
        for modes, q in zip(sequence, qs):
            out = torch.full_like(q, 7.0)
            plan, t = plan_with_keep(buf_t, modes)
            sfi_decode(q, p.kv, p.bt, t, plan, cfg, layer_t, rt_t, 0, p.scale, out, dense_done=False)
            rt_t.ring.join()
            expected.append(out.clone())
    # captured kernels
    layer, rt, buf = state()
    q_in = torch.empty_like(qs[0])
    out = torch.empty_like(qs[0])
    t_in = torch.zeros(5, dtype=torch.int32, device="cuda")
    plan, t = plan_with_keep(buf, sequence[0])
    q_in.copy_(qs[0])

    def step():
        sfi_decode(q_in, p.kv, p.bt, t_in, plan, cfg, layer, rt, 0, p.scale, out, dense_done=False)
        rt.ring.join()

    t_in.copy_(t)
    step()                                            # warm-up (compiles) outside the capture
    torch.cuda.synchronize()
    layer.compact_len.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i, (modes, q) in enumerate(zip(sequence, qs)):
        _, t = plan_with_keep(buf, modes)                             # rewrites the same buffers
        t_in.copy_(t)
        q_in.copy_(q)
        out.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        for r, m in enumerate(modes):
            if m == PAD:
                continue
            torch.testing.assert_close(out[r], expected[i][r], atol=2e-3, rtol=2e-3,
                                       msg=lambda s: f"replay {i} row {r} ({m}): {s}")


def test_plan_compacts_slow_rows_in_row_order():
    dev = torch.device("cpu")
    buffers = SfiPlanBuffers(8, 4, dev)
    modes = [FAST, SLOW, DENSE, SLOW, PAD, SLOW, FAST, DENSE]
    lens = [300, 301, 20, 302, 0, 303, 304, 21]
    slots = [0, 1, 0, 2, 0, 3, 0, 0]
    bt = torch.arange(8 * 3, dtype=torch.int32).reshape(8, 3)
    plan, _ = plan_for(buffers, modes, lens, slots, bt, dev)
    assert plan.slow_rows.tolist() == [1, 3, 5, -1]
    assert plan.row_scratch.tolist() == [-1, 0, -1, 1, -1, 2, -1, -1]
    assert plan.slow_sfi_slot.tolist() == [1, 2, 3, -1]
    assert plan.slow_seq.tolist() == [301, 302, 303, 0]
    assert plan.slow_hi.tolist()[:3] == [301 - 16, 302 - 16, 303 - 16]
    assert plan.slow_lo[3] == plan.slow_hi[3]                       # unused entry: empty set
    assert torch.equal(plan.slow_block_table[:3], bt[[1, 3, 5]])
    assert plan.row_dense.tolist() == [m not in (FAST, SLOW) for m in modes]


def test_runtime_memory_follows_the_maintenance_chunk_not_the_request_capacity():
    """The slow-step scratch (ring, evidence scores, selector) holds ``B = sfi.maintenance_rows`` slow
    rows, whatever SFI's request capacity ``S`` (``--max-num-seqs``): 8, 64 and 256 requests
    allocate the same bytes but the split-K scratch (rows, bounded by the split heuristic); ``B``
    scales it; a capacity below ``B`` caps it."""
    dev = torch.device("cpu")
    cfg = SfiConfig(enabled=True, k=64, n_recent=32, maintenance_rows=8)
    shape = dict(num_heads=8, num_kv_heads=2, head_size=32, max_len=4096, device=dev)
    small = SfiRuntime(cfg, capacity=8, max_rows=8, **shape)
    big = SfiRuntime(cfg, capacity=256, max_rows=256, **shape)
    assert big.maintenance_rows == 8 and big.chunks(256) == 32 and big.chunks(5) == 1
    ring = sum(e.log_evidence.numel() * 4 + e.key_norms.numel() * 4 for e in big.ring.entries)
    n_slots = cfg.side_stream_slots if big.ring.dual else 1
    assert ring == n_slots * 2 * 8 * 2 * 4096 * 4                  # N x 2 x B x Hkv x L x 4 B
    assert big.dense_workspace.scores.shape == (8, 8, 4096)        # B x Hq x L
    assert big.selector_workspace.rows == 8
    # rows (and the capacity) only size the split-K scratch: R * splits(R) is bounded by the split
    # heuristic
    grow = big.nbytes - small.nbytes
    assert 0 <= grow <= 256 * 8 * 33 * 4 * 2, grow
    assert SfiRuntime(cfg, capacity=64, max_rows=256, **shape).nbytes == big.nbytes
    twice = SfiRuntime(dataclasses.replace(cfg, maintenance_rows=16), capacity=256, max_rows=256, **shape)
    assert twice.nbytes - big.nbytes >= ring                        # B does scale it
    capped = SfiRuntime(cfg, capacity=4, max_rows=256, **shape)
    assert capped.maintenance_rows == 4 and capped.dense_workspace.scores.shape[0] == 4
    assert "B 8" in big.describe() and "maintenance_rows" in big.describe()
