"""CritiPrefill as the backend runs it, against an independent reference of the authors' algorithm.

The reference below is written from the formulas of the authors' published code (docs/ALGORITHMS.md
§3, "authors' code"), in plain float64 PyTorch over whole contiguous tensors; it shares nothing with
the project's kernels or helpers. Per layer, for a prompt of ``n`` tokens, segments of ``Sq``
queries and blocks of ``Bk`` keys:

1. segment ``j`` holds queries ``[j*Sq, min(n, (j+1)*Sq))``; it attends densely when it starts before
   ``min_len`` (the authors' ``threshold_len``) or is the prompt's last segment (partial or full);
2. ``Qmax, Qmin`` = element-wise max / min over the segment's queries, ``Kmax, Kmin`` over each
   block's keys; for each query head and block ``b`` before the segment's start
   ``A = max((Qmax·Kmax + Qmin·Kmax)/2, (Qmax·Kmin + Qmin·Kmin)/2)`` (raw dot products);
3. ``A`` averaged over the query heads of each KV head, one softmax over the blocks ``b < j*Sq/Bk``;
4. layer fusion: the first sparse layer keeps its scores, each later one
   ``S = 0.75·S + 0.25·S_prev``;
5. a sparse segment attends, per KV head, to the keys of its top ``budget/Bk`` blocks (all of them
   when there are fewer) and to its own keys up to each query; no block is forced.

Ties: the authors take ``torch.topk`` of bf16 scores, whose order among equal values is
unspecified. The project and this reference both break ties towards the lower block index (a
stable sort of ``(-score, block)``); ``test_exact_ties_go_to_the_lower_block`` makes ties on
purpose. Elsewhere the data are checked to have no near-tie at the top-k boundary (the project
scores in fp32, the reference in fp64), so that the selections must be equal, not just close.

The project runs the engine's per-layer path (``vllm_ext.methods.critiprefill.path``) with its
host plan (``slots``), paged KV and state caches, chunk by chunk; every plan the path builds is
recorded and compared with the reference segment by segment, and each layer's output with dense
attention under the reference's mask.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ext.methods.critiprefill import path as path_module
from vllm_ext.methods.critiprefill.chunking import aligned_chunk, sparse_range
from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.critiprefill.slots import CritiPrefillSlots
from vllm_ext.methods.critiprefill.state_layout import STATE_SUFFIX, state_pages

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SQ, BK, D, PAGE = 64, 16, 16, 16
SPARSE_LAYERS = (1, 2, 3)                # layer 0 is dense (the authors' layer_skip = 1)
GID = 5                                  # the state group's id (as vLLM numbers it)
FUSION_PREV = 0.25                       # the authors' weight of the previous layer's scores
NEAR_TIE = 1e-6                          # smallest gap at the top-k boundary the comparison trusts


# ----------------------------------------------------------------------------------- the reference
@dataclasses.dataclass
class ReferenceLayer:
    dense: list[bool]                    # per segment
    sel: list[list[list[int]]]           # per segment, per KV head: selected blocks, ascending
    margin: float                        # smallest score gap at the top-k boundary of a sparse segment


def reference_selection(layers: list[tuple[torch.Tensor, torch.Tensor]], *, n: int, budget: int,
                        min_len: int, fusion: bool = True) -> list[ReferenceLayer]:
    """The authors' selection in each sparse layer (``layers``: ``(q [n, Hq, D], k [n, Hkv, D])``)."""
    n_seg = -(-n // SQ)
    last = (n - 1) // SQ
    topk = budget // BK
    out, prev = [], None
    for q, k in layers:
        q, k = q.double(), k.double()
        hq, hkv = q.shape[1], k.shape[1]
        group = hq // hkv
        kv_of_head = torch.arange(hq) // group
        nb = last * SQ // BK
        scores = torch.zeros(n_seg, hkv, nb, dtype=torch.float64)
        for j in range(1, n_seg):
            sb = j * SQ // BK
            seg = q[j * SQ:min(n, (j + 1) * SQ)]
            qmax, qmin = seg.amax(0), seg.amin(0)                       # [Hq, D]
            blocks = k[:sb * BK].reshape(sb, BK, hkv, -1)
            kmax, kmin = blocks.amax(1)[:, kv_of_head], blocks.amin(1)[:, kv_of_head]   # [sb, Hq, D]
            a_max = ((qmax * kmax).sum(-1) + (qmin * kmax).sum(-1)) / 2                  # [sb, Hq]
            a_min = ((qmax * kmin).sum(-1) + (qmin * kmin).sum(-1)) / 2
            a = torch.maximum(a_max, a_min).reshape(sb, hkv, group).mean(-1)            # [sb, Hkv]
            scores[j, :, :sb] = torch.softmax(a, dim=0).T
        if fusion and prev is not None:
            scores = (1 - FUSION_PREV) * scores + FUSION_PREV * prev
        prev = scores
        dense, sel, margin = [], [], float("inf")
        for j in range(n_seg):
            sb = j * SQ // BK
            dense.append(j * SQ < min_len or j >= last)
            row = []
            for h in range(hkv):
                s = scores[j, h, :sb].tolist() if j < last else []
                order = sorted(range(len(s)), key=lambda b: (-s[b], b))
                row.append(sorted(order[:topk]))
                if not dense[-1] and len(s) > topk:
                    margin = min(margin, s[order[topk - 1]] - s[order[topk]])
            sel.append(row)
        out.append(ReferenceLayer(dense, sel, margin))
    return out


def reference_mask(ref: ReferenceLayer, n: int, hq: int, hkv: int) -> torch.Tensor:
    """``[Hq, n, n]`` bool: the keys each query sees under the reference's selection."""
    group = hq // hkv
    mask = torch.zeros(hq, n, n, dtype=torch.bool)
    for p in range(n):
        j = p // SQ
        if ref.dense[j]:
            mask[:, p, :p + 1] = True
            continue
        for h in range(hkv):
            for b in ref.sel[j][h]:
                mask[h * group:(h + 1) * group, p, b * BK:(b + 1) * BK] = True
        mask[:, p, j * SQ:p + 1] = True
    return mask


def masked_attention(q, k, v, mask, scale) -> torch.Tensor:
    """float64 softmax attention of ``q [n, Hq, D]`` over ``k, v [n, Hkv, D]`` under ``mask``."""
    group = q.shape[1] // k.shape[1]
    kh = k.double().repeat_interleave(group, dim=1)
    vh = v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("phd,khd->hpk", q.double(), kh) * scale
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hpk,khd->phd", probs, vh)


# --------------------------------------------------------------------------- the project's engine path
def _paged(k: torch.Tensor, v: torch.Tensor, seed: int, device):
    """``k``/``v`` in a shuffled paged cache (junk in the other slots) and the block-table row."""
    n, hkv, d = k.shape
    pages = -(-n // PAGE)
    perm = torch.randperm(pages + 2, generator=torch.Generator().manual_seed(seed))
    cache = (torch.randn(pages + 2, PAGE, hkv, 2 * d) * 9.0).to(k.dtype).transpose(1, 2)   # NHD
    for i in range(pages):
        a, e = i * PAGE, min(n, (i + 1) * PAGE)
        cache[perm[i], :, :e - a, :d] = k[a:e].transpose(0, 1)
        cache[perm[i], :, :e - a, d:] = v[a:e].transpose(0, 1)
    return cache.to(device), perm[:pages].to(torch.int32).to(device)


def run_engine_path(cfg: CritiPrefillConfig, data: dict, chunks: list[int], monkeypatch, device="cpu"):
    """The prompt prefilled in ``chunks`` through the backend's per-layer path. Returns
    ``({layer: output [n, Hq, D]}, [(ctx, layer, plan)])``: every plan the path attended with."""
    q1, k1, _ = data[SPARSE_LAYERS[0]]
    n, hq, hkv = q1.shape[0], q1.shape[1], k1.shape[1]
    group = hq // hkv
    slots = CritiPrefillSlots(2, max_rows=2, cfg=cfg, device=torch.device(device))
    spec = SimpleNamespace(carry_entries=group, block_size=PAGE)
    slots.bind_kv_groups({GID: (99, [f"layer{l}" + STATE_SUFFIX for l in SPARSE_LAYERS], spec)})
    n_state = state_pages(n, group, BK, PAGE)
    state_row = torch.randperm(n_state + 2, generator=torch.Generator().manual_seed(11))[:n_state]
    state = {l: torch.full((n_state + 2, PAGE, hkv, 2 * D), float("nan"), dtype=q1.dtype).transpose(1, 2)
             .to(device) for l in SPARSE_LAYERS}
    caches = {l: _paged(k, v, seed=l, device=device) for l, (_, k, v) in data.items()}

    plans = []
    attend = path_module.block_sparse_prefill

    def recording(query, kv_cache, block_table, qsl, seq, plan, scale, *, output=None, **scales):
        plans.append((ctx, layer, plan.to("cpu")))          # the chunk and layer the loop below is at
        return attend(query, kv_cache, block_table, qsl, seq, plan, scale, output=output, **scales)

    attend_cpu = path_module.block_sparse_prefill_cpu

    def recording_cpu(query, kv_cache, block_table, qsl, seq, plan, scale, *, output, **scales):
        done = attend_cpu(query, kv_cache, block_table, qsl, seq, plan, scale, output=output, **scales)
        if done:                                              # else the path calls block_sparse_prefill
            plans.append((ctx, layer, plan.to("cpu")))
        return done

    monkeypatch.setattr(path_module, "block_sparse_prefill", recording)
    monkeypatch.setattr(path_module, "block_sparse_prefill_cpu", recording_cpu)
    outs = {l: torch.zeros(n, hq, D, dtype=q1.dtype) for l in SPARSE_LAYERS}
    ctx = 0
    for step_id, ql in enumerate(chunks):
        seq = ctx + ql
        held = state_pages(seq, group, BK, PAGE)
        counts = np.array([held])
        tables = {GID: (state_row[None, :].to(torch.int32).to(device), counts > 0, counts)}
        step = slots.plan(num_reqs=1, row_slots=np.array([0]), row_is_decode=np.array([0]),
                          prompt_len=np.array([n]), host_geometry=(np.array([0, ql]), np.array([ctx])),
                          step_id=step_id, group_tables=tables)
        assert step is not None, "every chunk of a prompt with a sparse range runs CritiPrefill's path"
        for layer in SPARSE_LAYERS:
            q = data[layer][0][ctx:seq].to(device)
            cache, bt = caches[layer]
            out = torch.full_like(q, float("nan"))
            path_module.critiprefill_prefill(q, cache, bt[None], step, cfg, state[layer],
                                             step.state_table(f"layer{layer}"), layer, D ** -0.5, out)
            outs[layer][ctx:seq] = out.cpu()
        ctx = seq
    return outs, plans


# ----------------------------------------------------------------------------------------- the data
def make_data(n: int, hq: int, hkv: int, seed: int, dtype=torch.float32) -> dict:
    """Random q/k/v per sparse layer; keys get a per-block offset (blocks then differ in criticality,
    as a real model's do) and queries a per-layer direction shared by the segments."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in SPARSE_LAYERS:
        k = torch.randn(n, hkv, D, generator=g)
        k = k + 1.5 * torch.randn(-(-n // BK), hkv, D, generator=g).repeat_interleave(BK, 0)[:n]
        q = torch.randn(n, hq, D, generator=g) + torch.randn(1, hq, D, generator=g)
        v = torch.randn(n, hkv, D, generator=g)
        out[layer] = (q.to(dtype), k.to(dtype), v.to(dtype))
    return out


def config(budget: int, min_len: int) -> CritiPrefillConfig:
    """The defaults (the authors' score, fusion and no sink) at this test's sizes."""
    return CritiPrefillConfig(enabled=True, segment_size=SQ, block_size=BK, budget=budget, min_len=min_len)


def scheduled_chunks(cfg: CritiPrefillConfig, n: int, wanted: list[int]) -> list[int]:
    """The chunks the scheduler's rule (``chunking.aligned_chunk``) makes of the wanted lengths."""
    chunks, done, i = [], 0, 0
    while done < n:
        got = aligned_chunk(cfg, n, done, min(n - done, wanted[i % len(wanted)]))
        assert got > 0
        chunks.append(got)
        done += got
        i += 1
    return chunks


# ---------------------------------------------------------------------------------------- checking
def compare_plans(plans, refs: list[ReferenceLayer], n: int, chunks: list[int], *,
                  cut_ok: bool = False) -> dict:
    """Every segment row the path attended with against the reference; returns counts of what was
    compared. A segment that prunes must lie whole in its chunk, unless ``cut_ok``: then a chunk's
    part before a cut is skipped and the part after it (all the segment's queries represented,
    through the carry) is compared. One that selects every candidate may be cut anywhere."""
    ends = np.cumsum(chunks).tolist()
    counts = {"sparse": 0, "pruned": 0, "covering": 0, "dense": 0, "cut": 0}
    for ctx, layer, plan in plans:
        ref = refs[SPARSE_LAYERS.index(layer)]
        chunk_end = min(e for e in ends if e > ctx)
        first, num = int(plan.first_segment[0]), int(plan.num_segments[0])
        for s in range(num):
            j = first + s
            assert bool(plan.dense[0, s]) == ref.dense[j], (layer, j)
            if ref.dense[j]:
                counts["dense"] += 1
                continue
            seg_start, seg_end = j * SQ, min(n, (j + 1) * SQ)
            pruned = len(ref.sel[j][0]) < j * SQ // BK      # else it selects every candidate
            if pruned and (seg_start < ctx or seg_end > chunk_end):
                assert cut_ok, f"sparse segment {j} is cut by a chunk boundary"
                counts["cut"] += 1
                if seg_end > chunk_end:
                    continue                          # the part before the cut: its own queries only
            for h, want in enumerate(ref.sel[j]):
                got = plan.sel_blocks[0, s, h, :int(plan.num_sel[0, s, h])].tolist()
                assert got == want, (layer, j, h, got, want)
            counts["sparse"] += 1
            counts["pruned" if pruned else "covering"] += 1
    return counts


def compare_outputs(outs: dict, data: dict, refs: list[ReferenceLayer], n: int, dtype) -> None:
    tol = dict(rtol=1e-5, atol=3e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for layer, ref in zip(SPARSE_LAYERS, refs):
        q, k, v = data[layer]
        mask = reference_mask(ref, n, q.shape[1], k.shape[1])
        want = masked_attention(q, k, v, mask, D ** -0.5)
        torch.testing.assert_close(outs[layer].double(), want, **tol, msg=lambda m: f"layer {layer}: {m}")


# -------------------------------------------------------------------------------------------- tests
#   n = 333: the last segment (5) is partial; n = 384: it is full. min_len 128 (a segment start) and
#   100 (inside segment 1): sparse from segment 2 on. Budget 32 keys = 2 blocks (below every
#   segment's candidates); 160 = 10 blocks (above segment 2's 8 candidates, below segment 3's 12).
GRID = [
    # hq, hkv, n, budget, min_len
    (2, 2, 333, 32, 128),
    (8, 2, 333, 32, 100),
    (8, 2, 384, 160, 128),
    (4, 1, 333, 160, 0),
]
SCHEDULES = {
    "one chunk": None,
    "at segment boundaries": [128, 64, 192],
    # wanted cuts at 100, 170, 260, ... inside segments; the scheduler moves the ones inside sparse
    # segments to the segment's start and keeps those in dense ones (before min_len, the last segment)
    "inside segments, scheduled": [100, 70, 90, 67],
}


@pytest.fixture(autouse=True)
def _twins(monkeypatch):
    """The CPU build's kernels (the compiled prefill where it applies, the PyTorch twins elsewhere);
    the Triton kernels: the slow test below."""
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("hq,hkv,n,budget,min_len", GRID)
def test_selections_and_outputs_equal_the_authors_reference(monkeypatch, hq, hkv, n, budget, min_len, schedule):
    cfg = config(budget, min_len)
    data = make_data(n, hq, hkv, seed=hq + n + budget + min_len)
    refs = reference_selection([(q, k) for q, k, _ in data.values()], n=n, budget=budget, min_len=min_len)
    assert min(r.margin for r in refs) > NEAR_TIE, "near-tie at a top-k boundary: pick another seed"
    wanted = SCHEDULES[schedule]
    chunks = [n] if wanted is None else scheduled_chunks(cfg, n, wanted)
    if schedule == "inside segments, scheduled":
        assert any(e % SQ for e in np.cumsum(chunks)[:-1]), "no boundary left inside a (dense) segment"
    outs, plans = run_engine_path(cfg, data, chunks, monkeypatch)
    assert len(plans) == len(chunks) * len(SPARSE_LAYERS)
    counts = compare_plans(plans, refs, n, chunks)
    assert counts["pruned"] > 0 and counts["dense"] > 0
    if budget > 2 * BK and min_len <= 2 * SQ:
        assert counts["covering"] > 0              # a segment whose candidates all fit the budget
    compare_outputs(outs, data, refs, n, torch.float32)


def test_the_sparse_range_is_the_references_pruned_segments():
    """What the scheduler treats as sparse (``sparse_range``: where chunks must not cut) is exactly
    where the reference prunes: segments past ``min_len``, before the last, with more candidates
    than the budget."""
    for budget in (32, 64, 160, 512):
        for min_len in (0, 64, 100, 128, 200, 4096):
            for n in (64, 65, 200, 321, 333, 384, 1000):
                cfg = config(budget, min_len)
                lo, hi = sparse_range(cfg, n)
                last = (n - 1) // SQ
                pruned = [j for j in range(last) if j * SQ >= min_len and j * SQ // BK > budget // BK]
                got = list(range(lo // SQ, hi // SQ)) if lo < hi else []
                assert got == pruned, (budget, min_len, n)


def test_a_cut_inside_a_sparse_segment_changes_only_its_earlier_part(monkeypatch):
    """Chunk ends the scheduler would not make (a prefix hit it cannot cut): the later part of the
    cut segment is represented by all its queries (carried across the chunks) and equals the
    reference; only the queries before the cut choose from their own part."""
    hq, hkv, n, budget, min_len = 8, 2, 333, 32, 64
    cfg = config(budget, min_len)
    data = make_data(n, hq, hkv, seed=21)
    refs = reference_selection([(q, k) for q, k, _ in data.values()], n=n, budget=budget, min_len=min_len)
    assert min(r.margin for r in refs) > NEAR_TIE
    chunks = [150, 120, 63]                      # cuts inside segment 2 (128..191) and 4 (256..319)
    outs, plans = run_engine_path(cfg, data, chunks, monkeypatch)
    assert compare_plans(plans, refs, n, chunks, cut_ok=True)["cut"] == 2 * 2 * len(SPARSE_LAYERS)
    earlier = torch.zeros(n, dtype=torch.bool)
    earlier[128:150] = earlier[256:270] = True
    for layer, ref in zip(SPARSE_LAYERS, refs):
        q, k, v = data[layer]
        want = masked_attention(q, k, v, reference_mask(ref, n, hq, hkv), D ** -0.5)
        torch.testing.assert_close(outs[layer][~earlier].double(), want[~earlier], rtol=1e-5, atol=3e-6)


def test_exact_ties_go_to_the_lower_block(monkeypatch):
    """Integer q/k make every score exact in fp32 and fp64; blocks with identical keys tie exactly,
    and both the project and the reference take the lower ones."""
    hq, hkv, n, budget, min_len = 4, 2, 333, 64, 128
    g = torch.Generator().manual_seed(5)
    data = {}
    for layer in SPARSE_LAYERS:
        base = torch.randint(-2, 3, (BK, hkv, D), generator=g).float()
        k = base.repeat(-(-n // BK), 1, 1)[:n].clone()          # every block the same ...
        for b in (3, 7, 12):                                      # ... but three hot ones per layer
            k[b * BK:(b + 1) * BK] += 1.0
        q = torch.randint(-2, 3, (n, hq, D), generator=g).float().abs()
        data[layer] = (q, k, torch.randn(n, hkv, D, generator=g))
    cfg = config(budget, min_len)
    refs = reference_selection([(q, k) for q, k, _ in data.values()], n=n, budget=budget, min_len=min_len)
    assert refs[-1].sel[4][0] == [0, 3, 7, 12]                   # 3 hot blocks, then the lowest tie
    outs, plans = run_engine_path(cfg, data, [n], monkeypatch)
    compare_plans(plans, refs, n, [n])
    compare_outputs(outs, data, refs, n, torch.float32)


def test_bf16_inputs(monkeypatch):
    """bf16 q/k/v (a bf16 model's cache): the selection is made from the same bf16 values and
    equals the reference's; the output equals the reference's at bf16's resolution."""
    hq, hkv, n, budget, min_len = 8, 2, 333, 32, 128
    cfg = config(budget, min_len)
    data = make_data(n, hq, hkv, seed=3, dtype=torch.bfloat16)
    refs = reference_selection([(q, k) for q, k, _ in data.values()], n=n, budget=budget, min_len=min_len)
    assert min(r.margin for r in refs) > NEAR_TIE
    outs, plans = run_engine_path(cfg, data, [128, 205], monkeypatch)
    assert compare_plans(plans, refs, n, [128, 205])["pruned"] > 0
    compare_outputs(outs, data, refs, n, torch.bfloat16)


def test_fusion_matters_in_this_data():
    """The reference without layer fusion selects differently somewhere in the grid's data (else the
    comparisons above would not check the fusion)."""
    changed = 0
    for hq, hkv, n, budget, min_len in GRID:
        data = make_data(n, hq, hkv, seed=hq + n + budget + min_len)
        layers = [(q, k) for q, k, _ in data.values()]
        fused = reference_selection(layers, n=n, budget=budget, min_len=min_len)
        plain = reference_selection(layers, n=n, budget=budget, min_len=min_len, fusion=False)
        changed += sum(f.sel != p.sel for f, p in zip(fused[1:], plain[1:]))
    assert changed > 0


@pytest.mark.slow
def test_triton_kernels_equal_the_reference(monkeypatch):
    """The Triton kernels (on a GPU, or the interpreter): same selections, same outputs."""
    from vllm_ext.kernels.triton_utils import HAS_TRITON, interpret_mode

    if not HAS_TRITON or not (torch.cuda.is_available() or interpret_mode()):
        pytest.skip("Triton is not installed, or neither a GPU nor TRITON_INTERPRET=1 (the suite sets it) is here")
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "0")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, n, budget, min_len = 8, 2, 333, 32, 100
    cfg = config(budget, min_len)
    data = make_data(n, hq, hkv, seed=hq + n + budget + min_len)
    refs = reference_selection([(q, k) for q, k, _ in data.values()], n=n, budget=budget, min_len=min_len)
    chunks = scheduled_chunks(cfg, n, [100, 70, 90, 67])
    outs, plans = run_engine_path(cfg, data, chunks, monkeypatch, device=device)
    assert compare_plans(plans, refs, n, chunks)["pruned"] > 0
    for layer, ref in zip(SPARSE_LAYERS, refs):
        q, k, v = data[layer]
        want = masked_attention(q, k, v, reference_mask(ref, n, hq, hkv), D ** -0.5)
        torch.testing.assert_close(outs[layer].double(), want, rtol=1e-4, atol=1e-4)
