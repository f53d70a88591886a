"""The chunk-parallel Triton selector against its PyTorch twin with small tiles, so that a few hundred
positions already span many chunks of every stage (interpreted on CPU, compiled on CUDA).

Exact equality of the selections is asserted (equal tensors: same positions, ascending, -1 padding):
at these sizes the fp32 rounding differences between the kernels and the twin stay far below the
gaps between neighbouring scores (tests/sfi/test_sfi_selector_cuda.py states what holds at serving
sizes). Covered: GQA head counts 1-8, odd lengths, allowed sets that start / end on chunk borders,
empty (inactive) rows, |A| <= k, ties (flat and quantised scores), select_span with both window-max
algorithms, per-row tensor budgets, the candidate-list overflow path, the global-scratch fallback of
tl.gather, the persistent workspace (reuse, views, no writes for inactive rows), and that nothing
outside [lo, hi) is ever read.
"""

import dataclasses

import pytest
import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import sfi_selector as K
from vllm_ext.kernels import sfi_selector_kernels as SK
from vllm_ext.kernels import sfi_selector_workspace as W
from vllm_ext.kernels import sfi_selector_torch as S
from vllm_ext.methods.sfi.selector_params import selector_params

pytestmark = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")

SMALL = K.Tiles(elems_stats=256, elems_score=128, chunk=48, block=32, block_finish=64)
CFG = dataclasses.replace(selector_params(SfiConfig()), k=24, k_min=4)


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(W, "TILES", SMALL)
    return SMALL


def make(rows, heads, n_rows, length, device, *, seed=0, pooled=False):
    g = torch.Generator().manual_seed(seed)
    ev = torch.randn(rows, heads, n_rows, length, generator=g) * 2.5
    norms = torch.rand(rows, heads, length, generator=g) * 4.0 + 0.05
    ev = ev[:, :, 0] if pooled else ev
    return ev.to(device), norms.to(device)


def check(ev, norms, lo, hi, cfg, k, *, k_cap=None, workspace=None):
    ref = S.select(ev, norms, lo, hi, cfg, k, k_cap=k_cap)
    got = K.select_triton(ev, norms, lo, hi, cfg, k, k_cap=k_cap, workspace=workspace)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[1], ref[1]), (got[1], ref[1])
    assert torch.equal(got[0], ref[0]), (got[0], ref[0])
    return got


def bounds(length, device):
    """Rows: all of [0, L); a sink-to-recent range; one position; inactive (lo = hi = 0); a range
    from one chunk border (of SMALL.chunk) to just past another; fewer positions than k."""
    c = SMALL.chunk
    rows = [(0, length), (4, length - 16), (length // 2, length // 2 + 1), (0, 0),
            (c, min(length, 3 * c + 1)), (7, 7 + 13)]
    lo = torch.tensor([min(a, length) for a, _ in rows], device=device)
    hi = torch.tensor([min(b, length) for _, b in rows], device=device)
    return lo, hi


@pytest.mark.parametrize("heads,length", [(1, 37), (3, 150), (4, 211), (8, 97)])
def test_grid_matches_twin(heads, length, small, device):
    ev, norms = make(6, heads, 2, length, device, seed=heads * 100 + length)
    lo, hi = bounds(length, device)
    check(ev, norms, lo, hi, CFG, 24)                                          # 4-D evidence
    check(ev[:, :, 1], norms, lo, hi, CFG, 9)                                  # pooled 3-D evidence
    check(ev[:, :, 1], norms, lo, hi, CFG, torch.tensor([24, 3, 30, 24, 11, 24], device=device), k_cap=24)


@pytest.mark.parametrize("span,radius", [(1, 16), (3, 16), (4, 16), (4, 3), (0, 3), (0, 4), (32, 16)])
def test_window_max_paths(span, radius, small, device):
    """Soft-NMS / select_span windows: van Herk (power-of-two windows) and the sparse table (others)."""
    ev, norms = make(6, 4, 1, 180, device, seed=span * 10 + radius, pooled=True)
    lo, hi = bounds(180, device)
    check(ev, norms, lo, hi, dataclasses.replace(CFG, select_span=span, nms_radius=radius, mu=1.0), 24)


def test_gather_fallback_scratch(small, monkeypatch, device):
    """Tiles.gather off: shifted tiles through the global scratch give the same selection."""
    monkeypatch.setattr(W, "TILES", dataclasses.replace(SMALL, gather=False))
    ev, norms = make(6, 4, 1, 160, device, seed=3, pooled=True)
    lo, hi = bounds(160, device)
    check(ev, norms, lo, hi, dataclasses.replace(CFG, select_span=3, nms_radius=5), 24)
    check(ev, norms, lo, hi, CFG, 24)


@pytest.mark.parametrize("cap", [1, 3])
def test_candidate_overflow_scans_the_row(cap, small, monkeypatch, device):
    """A candidate list too small for the threshold bucket: the finish step scans all of A."""
    monkeypatch.setattr(W, "TILES", dataclasses.replace(SMALL, cap=cap))
    ev, norms = make(6, 3, 2, 140, device, seed=cap)
    lo, hi = bounds(140, device)
    check(ev, norms, lo, hi, CFG, 24)
    check(ev, norms, lo, hi, dataclasses.replace(CFG, select_span=2), 17)


@pytest.mark.parametrize("cap", [0, 2])
def test_ties_lower_position_wins(cap, small, monkeypatch, device):
    monkeypatch.setattr(W, "TILES", dataclasses.replace(SMALL, cap=cap))
    length = 100
    ev = torch.zeros(3, 4, 2, length, device=device)
    norms = torch.ones(3, 4, length, device=device)
    lo, hi = torch.tensor([4, 0, 33], device=device), torch.tensor([90, 100, 64], device=device)
    flat = dataclasses.replace(CFG, w_k=0.0, w_pos=0.0, mu=0.0, lam_x=0.0)    # every score equal
    sel, _ = check(ev, norms, lo, hi, flat, 10)
    assert sel[0, :, :10].tolist() == [list(range(4, 14))] * 4
    quant = (torch.randn(3, 4, 2, length, generator=torch.Generator().manual_seed(1)) * 2).round().to(device)
    check(quant, norms, lo, hi, dataclasses.replace(flat, lambda_max=0.0), 17)   # many ties at the K-th
    check(quant, norms, lo, hi, dataclasses.replace(flat, lambda_max=0.0, select_span=3), 17)


def test_never_reads_outside_allowed_set(small, device):
    """Evidence and key norms outside [lo, hi) are garbage in the decode path: NaN, +-inf, huge
    values there change nothing."""
    length = 150
    ev, norms = make(6, 4, 1, length, device, seed=11, pooled=True)
    lo, hi = bounds(length, device)
    inside = S.allowed_mask(lo, hi, length).expand_as(ev)
    ev_bad, norms_bad = ev.clone(), norms.clone()
    pattern = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38, -3e38], device=device)
    junk = pattern[torch.arange(ev.numel(), device=device) % 5].reshape(ev.shape)
    ev_bad[~inside] = junk[~inside]
    norms_bad[~inside] = junk[~inside]
    for cfg in (CFG, dataclasses.replace(CFG, select_span=4)):
        want = check(ev, norms, lo, hi, cfg, 24)
        got = K.select_triton(ev_bad, norms_bad, lo, hi, cfg, 24)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_workspace_reuse_views_and_inactive_rows(small, device):
    rows, heads, length = 4, 4, 130
    ws = K.selector_workspace(rows, heads, length, 24, device, CFG)
    g = torch.Generator().manual_seed(5)
    calls = [([4, 0, 10, 0], [120, 130, 60, 0], [24, 9, 30, 24]),
             ([0, 0, 10, 0], [0, 130, 12, 0], [5, 24, 24, 24]),      # row 0 goes inactive: padding rewritten
             ([0, 3, 0, 0], [0, 100, 0, 0], [24, 4, 2, 24]),
             ([4, 4, 4, 0], [128, 50, 90, 0], [3, 24, 24, 24])]
    ws.selected[3].fill_(12345)                 # row 3 stays inactive: its output is never written
    for lo, hi, k in calls:
        ev = (torch.randn(rows, heads, length, generator=g) * 3).to(device)
        norms = (torch.rand(rows, heads, length, generator=g) * 4 + 0.05).to(device)
        lo, hi = torch.tensor(lo, device=device), torch.tensor(hi, device=device)
        k = torch.tensor(k, dtype=torch.int64, device=device)
        ref = S.select(ev, norms, lo, hi, CFG, k, k_cap=24)
        sel, n = K.select(ev, norms, lo, hi, CFG, k, k_cap=24, workspace=ws)
        assert sel.data_ptr() == ws.selected.data_ptr() and n.data_ptr() == ws.n_sel.data_ptr()
        assert torch.equal(n, ref[1]) and torch.equal(sel[:3], ref[0][:3])
        assert (sel[3] == 12345).all() and n[3].item() == 0
    # a workspace with more rows than the call: the first rows are used
    sel, n = K.select(ev[:2], norms[:2], lo[:2], hi[:2], CFG, k[:2], k_cap=24, workspace=ws)
    ref = S.select(ev[:2], norms[:2], lo[:2], hi[:2], CFG, k[:2], k_cap=24)
    assert sel.shape == (2, heads, 24) and torch.equal(sel, ref[0]) and torch.equal(n, ref[1])
    with pytest.raises(ValueError, match="width"):
        K.select(ev, norms, lo, hi, CFG, 7, workspace=ws)


def test_budget_forms(small, device):
    """k: an int, an int32 / int64 tensor [rows], a one-element tensor (broadcast); k_eff clamped to
    [k_min, width]."""
    ev, norms = make(6, 2, 1, 120, device, seed=8, pooled=True)
    lo, hi = bounds(120, device)
    cfg = dataclasses.replace(CFG, k=40, k_min=6)
    for k in (torch.tensor([1, 100, 7, 40, 30, 2], device=device, dtype=torch.int32),
              torch.tensor([13], device=device), torch.tensor(50, device=device)):
        check(ev, norms, lo, hi, cfg, k, k_cap=32)
    check(ev, norms, lo, hi, cfg, 200)                      # wider than L: all of A


def test_scores_match_twin(small, device):
    ev, norms = make(6, 8, 3, 170, device, seed=2)
    lo, hi = bounds(170, device)
    s_ref, lam_ref = S.selector_scores(ev, norms, lo, hi, CFG)
    s_tri, lam_tri = K.selector_scores_triton(ev, norms, lo, hi, CFG)
    assert torch.equal(torch.isneginf(s_ref), torch.isneginf(s_tri))
    fin = torch.isfinite(s_ref)
    torch.testing.assert_close(s_tri[fin], s_ref[fin], atol=2e-4, rtol=2e-5)
    torch.testing.assert_close(lam_tri, lam_ref, atol=1e-6, rtol=1e-4)


def test_twin_path_fills_the_workspace(monkeypatch, device):
    """SPEEDSFI_FORCE_TORCH_KERNELS: select() runs the twin and still returns the workspace's views."""
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    ev, norms = make(3, 2, 1, 60, device, seed=4, pooled=True)
    lo, hi = torch.tensor([4, 0, 0], device=device), torch.tensor([50, 60, 0], device=device)
    ws = K.selector_workspace(3, 2, 60, 24, device, CFG)
    assert ws.score is None                                 # no Triton scratch for the twin
    sel, n = K.select(ev, norms, lo, hi, CFG, 24, workspace=ws)
    ref = S.select(ev, norms, lo, hi, CFG, 24)
    assert sel.data_ptr() == ws.selected.data_ptr()
    assert torch.equal(sel, ref[0]) and torch.equal(n, ref[1])


def test_bucket_is_monotone_in_the_score(device):
    """The top-K's correctness rests on the bucket being non-increasing in the score (a better
    score never lands in a later bucket) and on -inf / NaN sharing the last bucket."""
    import triton
    import triton.language as tl

    @triton.jit
    def buckets(s_ptr, out_ptr, m_up, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, SK._bucket(tl.load(s_ptr + i), m_up))

    finite = torch.cat([torch.tensor([3e38, 1e4, 100.0, 1.0, 1e-30, 0.0, -0.0, -1e-30, -1e-3]),
                        -torch.logspace(-8, 4, 200), torch.tensor([-3e38])])
    scores = torch.cat([finite.sort(descending=True).values, torch.tensor([float("-inf"), float("nan")])])
    n = 256
    s = torch.full((n,), float("-inf"))
    s[:scores.numel()] = scores
    for m_up in (0.0, 5.0, -20.0, float("-inf")):
        out = torch.empty(n, dtype=torch.int32, device=device)
        buckets[(1,)](s.to(device), out, m_up, N=n)
        b = out.cpu()
        assert ((b >= 0) & (b < K.NUM_BUCKETS)).all()
        assert (b[1:] >= b[:-1]).all(), (m_up, b)                    # non-increasing in the score
        assert (b[scores.numel() - 2:] == K.NUM_BUCKETS - 1).all()   # -inf and NaN: the last bucket


# ------------------------------------------------------------------ count: a live prefix of rows
def live_prefix(length, device, dead=3):
    """The rows of :func:`bounds` (one of them inactive inside the prefix) followed by ``dead`` rows
    with lo = hi = 0: the compacted slow list of the decode path, live rows [0, 6)."""
    lo, hi = bounds(length, device)
    z = torch.zeros(dead, dtype=lo.dtype, device=device)
    return torch.cat([lo, z]), torch.cat([hi, z])


def check_count(ev, norms, lo, hi, cfg, k, count, *, k_cap=None):
    """select_triton with ``count`` equals it without (and the twin) on the rows with those past
    ``count`` emptied (lo = hi = 0), in a fresh workspace."""
    live = torch.arange(lo.shape[0], device=lo.device) < count
    # the twin is the reference (test_grid_matches_twin holds the kernel without count to it)
    want = S.select(ev, norms, torch.where(live, lo, 0), torch.where(live, hi, 0), cfg, k, k_cap=k_cap)
    cnt = torch.tensor([count], dtype=torch.int32, device=ev.device)
    got = K.select_triton(ev, norms, lo, hi, cfg, k, k_cap=k_cap, count=cnt)
    assert torch.equal(got[1], want[1]), (got[1], want[1])
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    return got


COUNT_SHAPES = [(1, 37), (3, 150), (4, 211), (8, 97)]


@pytest.mark.parametrize("case", range(len(COUNT_SHAPES)))
def test_count_live_prefix_matches_full_grid(case, small, device):
    """Every launch shape of test_grid_matches_twin, with ``count`` (fixed grids walking only the
    live rows' chunks: under the interpreter 8 programs, so each loops over many items), for 4-D
    (pooling) and pooled evidence, per-row budgets and select_span. Compiled: every form on every
    shape; interpreted (minutes): two forms per shape, each form on two shapes."""
    heads, length = COUNT_SHAPES[case]
    ev, norms = make(9, heads, 2, length, device, seed=heads * 100 + length + 1)
    lo, hi = live_prefix(length, device)
    kt = torch.tensor([24, 3, 30, 24, 11, 24, 24, 5, 24], device=device)
    forms = [
        lambda: check_count(ev, norms, lo, hi, CFG, 24, 6),                      # 4-D evidence (pooling)
        lambda: check_count(ev[:, :, 1], norms, lo, hi, CFG, 9, 6),              # pooled 3-D evidence
        lambda: check_count(ev[:, :, 1], norms, lo, hi, CFG, kt, 6, k_cap=24),
        lambda: check_count(ev[:, :, 1], norms, lo, hi, dataclasses.replace(CFG, select_span=3, nms_radius=5),
                            24, 6),
    ]
    if device.type == "cpu":
        forms = [forms[case], forms[(case + 1) % len(forms)]]
    for form in forms:
        form()


def test_count_edges(small, device):
    """count = 1 and 4 (live rows past it are ignored), count = rows, count > rows (clamped), an
    int64 / 0-d count."""
    ev, norms = make(9, 4, 1, 150, device, seed=21, pooled=True)
    lo, hi = live_prefix(150, device)
    check_count(ev, norms, lo, hi, CFG, 24, 1)
    check_count(ev, norms, lo, hi, CFG, 24, 4)
    check_count(ev, norms, lo, hi, CFG, 24, 9)
    check_count(ev, norms, lo, hi, CFG, 24, 40)
    want = S.select(ev, norms, lo, hi, CFG, 24)
    for cnt in (torch.tensor(6, device=device), torch.tensor([6], dtype=torch.int64, device=device)):
        got = K.select(ev, norms, lo, hi, CFG, 24, count=cnt)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_count_rows_past_it_are_empty(small, device):
    """The rows past ``count`` select nothing whatever their lo / hi (as in the decode path, where
    only the live prefix is meaningful): the result is the twin's with those rows emptied."""
    ev, norms = make(9, 3, 1, 120, device, seed=22, pooled=True)
    lo, hi = live_prefix(120, device)
    lo_bad, hi_bad = lo.clone(), hi.clone()
    lo_bad[6:], hi_bad[6:] = torch.tensor([0, 5, 30], device=device), torch.tensor([120, 90, 31], device=device)
    want = S.select(ev, norms, lo, hi, CFG, 24)
    got = K.select_triton(ev, norms, lo_bad, hi_bad, CFG, 24, count=torch.tensor([6], device=device))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_count_zero_writes_nothing_but_n_sel(small, device):
    """count = 0: n_sel = 0 for every row; ``selected`` is not written (the contract of inactive
    rows: only what an earlier call wrote is reset to -1), with the workspace the decode path uses."""
    rows, heads, length = 9, 4, 130
    ev, norms = make(rows, heads, 1, length, device, seed=23, pooled=True)
    lo, hi = live_prefix(length, device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    k = torch.full((rows,), 24, dtype=torch.int64, device=device)
    ws = K.selector_workspace(rows, heads, length, 24, device, CFG)
    ws.selected.fill_(12345)                  # never written by a call that selects nothing
    ws.n_sel.fill_(77)
    sel, n = K.select(ev, norms, lo, hi, CFG, k, k_cap=24, workspace=ws, count=zero)
    assert (n == 0).all() and (sel == 12345).all()
    ws.selected.fill_(-1)
    # a live call, then count = 0: what it wrote is reset, exactly as count=None with every row empty
    ref = S.select(ev, norms, lo, hi, CFG, k, k_cap=24)
    sel, n = K.select(ev, norms, lo, hi, CFG, k, k_cap=24, workspace=ws, count=torch.tensor([6], device=device))
    assert torch.equal(sel, ref[0]) and torch.equal(n, ref[1]) and (n[:6] > 0).sum() >= 4
    sel, n = K.select(ev, norms, lo, hi, CFG, k, k_cap=24, workspace=ws, count=zero)
    assert (n == 0).all() and (sel == -1).all()
    # and the workspace goes on giving the twin's results afterwards
    sel, n = K.select(ev, norms, lo, hi, CFG, k, k_cap=24, workspace=ws, count=torch.tensor([6], device=device))
    assert torch.equal(sel, ref[0]) and torch.equal(n, ref[1])



def test_count_on_the_twin_path(monkeypatch, device):
    """SPEEDSFI_FORCE_TORCH_KERNELS: select() accepts count; rows [0, count) are selected as without it
    (the CPU twin computes only those), rows past it select nothing, as on the Triton path."""
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    ev, norms = make(5, 2, 1, 60, device, seed=24, pooled=True)
    lo = torch.tensor([4, 0, 9, 0, 0], device=device)
    hi = torch.tensor([50, 60, 40, 0, 0], device=device)
    ref = S.select(ev, norms, lo, hi, CFG, 24)
    assert int(ref[1][:3].min()) > 0
    sel, n = K.select(ev, norms, lo, hi, CFG, 24, count=torch.tensor([3], device=device))
    assert torch.equal(sel, ref[0]) and torch.equal(n, ref[1])
    sel, n = K.select(ev, norms, lo, hi, CFG, 24, count=torch.tensor([0], device=device))
    empty = S.select(ev, norms, lo, lo, CFG, 24)
    assert torch.equal(sel, empty[0]) and torch.equal(n, empty[1])
