"""The PyTorch Selector: each stage against hand computations, then properties of select()."""

import dataclasses
import math

import pytest
import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import sfi_selector_torch as S
from vllm_ext.methods.sfi.selector_params import selector_params

NEG = float("-inf")
CFG = selector_params(SfiConfig())


def mask_of(lo, hi, length):
    return S.allowed_mask(torch.tensor(lo), torch.tensor(hi), length)


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), (a, b)
    assert torch.allclose(a[fin], b[fin], atol=tol, rtol=tol), (a, b)


# ------------------------------------------------------------------------------------ evidence
def test_evidence_one_row_is_softmax_over_A():
    logits = torch.tensor([[[[5.0, 1.0, 2.0, 3.0, 9.0]]]])            # [1, 1, 1, 5]
    m = mask_of([1], [4], 5)
    p = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    want = torch.tensor([NEG, *p.log().tolist(), NEG])
    close(S.pool_evidence(logits, m, 0.5)[0, 0], want)
    close(S.pool_evidence(logits + 7.0, m, 0.5)[0, 0], want)           # any per-row shift
    close(S.pool_evidence(logits, m, 1.0)[0, 0], want)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.25])
def test_evidence_power_mean(alpha):
    x1, x2 = [0.0, 1.0, 2.0], [2.0, 0.5, -1.0]
    logits = torch.tensor([[[x1, x2]]])                                 # [1, 1, 2, 3]
    p1, p2 = torch.softmax(torch.tensor(x1), 0), torch.softmax(torch.tensor(x2), 0)
    f = ((p1 ** alpha + p2 ** alpha) / 2) ** (1 / alpha)
    close(S.pool_evidence(logits, mask_of([0], [3], 3), alpha)[0, 0], (f / f.sum()).log())


def test_evidence_rows_that_see_nothing_add_zero():
    logits = torch.tensor([[[[0.0, 1.0, 2.0], [NEG, NEG, NEG]]]])
    p1 = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    close(S.pool_evidence(logits, mask_of([0], [3], 3), 0.5)[0, 0], p1.log())
    # a causally masked entry inside A: p = 0 for that row only
    logits = torch.tensor([[[[0.0, 1.0, NEG], [0.0, 0.0, 0.0]]]])
    pa = torch.softmax(torch.tensor([0.0, 1.0, NEG]), 0)
    f = ((pa.sqrt() + torch.full((3,), 1 / 3).sqrt()) / 2) ** 2
    close(S.pool_evidence(logits, mask_of([0], [3], 3), 0.5)[0, 0], (f / f.sum()).log())


def test_evidence_pooled_3d_is_normalised():
    ev = torch.tensor([[[3.0, 1.0, 2.0, 0.0]]])
    close(S.pool_evidence(ev, mask_of([1], [3], 4), 0.5)[0, 0],
          [NEG, *torch.log_softmax(torch.tensor([1.0, 2.0]), 0).tolist(), NEG])


# ----------------------------------------------------------------------------------------- prior
def test_prior_hand_computed():
    cfg = CFG
    norms = torch.tensor([[[9.0, 9.0, 1.0, 4.0, 0.25, 2.0, 9.0, 9.0]]])
    got = S.log_prior(norms, torch.tensor([2]), torch.tensor([6]), mask_of([2], [6], 8), cfg)[0, 0]
    want = []
    for j in range(2, 6):
        u = (j - 2) / 3
        log_pi = -cfg.gamma_k * math.log(norms[0, 0, j].item())
        log_delta = -cfg.pos_beta * u ** cfg.pos_power + cfg.pos_eta * math.log(max(1 - u, cfg.eps))
        want.append(cfg.w_k * log_pi + cfg.w_pos * log_delta)
    want = torch.tensor(want, dtype=torch.float64)
    want = want - torch.logsumexp(want, 0)
    close(got, [NEG, NEG, *want.tolist(), NEG, NEG])
    assert abs(cfg.pos_beta - 0.5676) < 1e-4


def test_prior_degenerate_sets():
    norms = torch.ones(2, 1, 5)
    got = S.log_prior(norms, torch.tensor([3, 2]), torch.tensor([4, 2]), mask_of([3, 2], [4, 2], 5), CFG)
    close(got[0, 0], [NEG, NEG, NEG, 0.0, NEG])                       # |A| = 1: u = 0, r = 1
    assert torch.isneginf(got[1]).all()                               # |A| = 0
    zero = S.log_prior(torch.zeros(1, 1, 3), torch.tensor([0]), torch.tensor([3]), mask_of([0], [3], 3), CFG)
    assert torch.isfinite(zero).all()                                 # ||k|| = 0 is clamped at eps


# ---------------------------------------------------------------------------------------- fusion
def test_fusion_closed_form():
    f = torch.tensor([0.7, 0.2, 0.1])
    r = torch.tensor([0.2, 0.3, 0.5])
    ff, fr, rr = (f * f).sum(), (f * r).sum(), (r * r).sum()
    lam_star = ((ff - fr) / ((f - r) ** 2).sum()).item()
    assert 0 < lam_star < 1
    m = mask_of([0], [3], 3)
    for lam_max in (1.0, 0.02, 0.0):
        log_s, lam = S.fuse(f.log()[None, None], r.log()[None, None], m, lam_max, 1e-12)
        want_lam = min(lam_star, lam_max)
        assert lam.item() == pytest.approx(want_lam, rel=1e-5, abs=1e-7)
        close(log_s[0, 0], ((1 - want_lam) * f + want_lam * r).log())
    # lam* < 0 (|f|^2 < <f, r>: a flat evidence aligned with a sharper prior) clips to 0: exactly f
    f = torch.tensor([0.4, 0.35, 0.25])
    r = torch.tensor([0.8, 0.15, 0.05])
    assert (f * f).sum() < (f * r).sum()
    log_s, lam = S.fuse(f.log()[None, None], r.log()[None, None], m, 1.0, 1e-12)
    assert lam.item() == 0.0 and torch.equal(log_s[0, 0], f.log())


# ------------------------------------------------------------------------------------ refinement
def test_soft_nms_hand_computed():
    l = torch.tensor([[[0.0, -1.0, -3.0, -0.5, -2.0]]])
    close(S.soft_nms(l, mask_of([0], [5], 5), 1, 0.5)[0, 0], [0.0, -1.5, -4.25, -0.5, -2.75])
    # positions outside A neither count nor change
    close(S.soft_nms(l, mask_of([0], [3], 5), 1, 0.5)[0, 0], [0.0, -1.5, -4.0, NEG, NEG])
    # radius 2: position 4 sees position 2 (-3 < -2) and 3 (-0.5)
    close(S.soft_nms(l, mask_of([0], [5], 5), 2, 1.0)[0, 0], [0.0, -2.0, -6.0, -0.5, -3.5])
    assert torch.equal(S.soft_nms(l, mask_of([0], [5], 5), 0, 0.5), l)


def test_cross_head_exclusivity_hand_computed():
    l = torch.tensor([[[0.0, -1.0], [-2.0, -1.0], [-1.0, NEG]]])       # [1, H=3, L=2]
    T, lam_x, eps = 2.0, 0.35, 1e-12
    got = S.cross_head_exclusivity(l, mask_of([0], [2], 2), T, lam_x, eps)[0]
    col0 = torch.tensor([0.0, -2.0, -1.0])
    rho0 = torch.softmax(col0 / T, 0)
    col1 = torch.tensor([-1.0, -1.0])
    rho1 = torch.softmax(col1 / T, 0)
    close(got[:, 0], col0 + lam_x * rho0.log())
    close(got[:, 1], [*(col1 + lam_x * rho1.log()).tolist(), NEG])
    assert torch.equal(S.cross_head_exclusivity(l[:, :2], mask_of([0], [2], 2), T, lam_x, eps), l[:, :2])
    # the eps floor
    far = torch.tensor([[[0.0], [-1e4], [-1e4]]])
    got = S.cross_head_exclusivity(far, mask_of([0], [1], 1), T, lam_x, eps)[0, :, 0]
    assert got[1].item() == pytest.approx(-1e4 + lam_x * math.log(eps))


# ----------------------------------------------------------------------------------------- top-K
def test_span_dilate_hand_computed():
    score = torch.tensor([[[0.0, 5.0, 1.0, 2.0, 3.0, -1.0, float("nan"), -3.0]]])
    out = S.span_dilate(score, torch.tensor([1]), torch.tensor([7]), 2)
    assert out.tolist() == [[[NEG, 5.0, 5.0, 5.0, 3.0, 3.0, 3.0, NEG]]]   # position 0 (outside A) never leaks
    assert S.span_dilate(score, torch.tensor([1]), torch.tensor([7]), 0) is score
    empty = S.span_dilate(score, torch.tensor([5]), torch.tensor([5]), 3)
    assert torch.isneginf(empty).all()


def test_select_span_brings_the_tokens_after_a_peak():
    # the evidence points at one token; with select_span the budget goes to it and what follows it
    length, peak = 200, 120
    ev = torch.full((1, 2, 1, length), -10.0)
    ev[..., peak] = 5.0
    ev[..., 30] = 4.0
    norms = torch.ones(1, 2, length)
    lo, hi = torch.tensor([4]), torch.tensor([180])
    cfg = dataclasses.replace(selector_params(SfiConfig()), k=5, k_min=1, w_k=0.0, w_pos=0.0, mu=0.0, lam_x=0.0)
    sel, _ = S.select(ev, norms, lo, hi, cfg, 5)
    assert sel[0, 0].tolist() == [4, 5, 6, 30, peak]                  # the rest: ties, lowest first
    sel, _ = S.select(ev, norms, lo, hi, dataclasses.replace(cfg, select_span=4), 5)
    assert sel[0, 0].tolist() == list(range(peak, peak + 5))
    sel, _ = S.select(ev, norms, lo, hi, dataclasses.replace(cfg, select_span=2), 6)
    assert sel[0, 1].tolist() == [30, 31, 32, peak, peak + 1, peak + 2]


def test_span_dilate_back_hand_computed():
    score = torch.tensor([[[0.0, 5.0, 1.0, 2.0, 3.0, -1.0, float("nan"), 9.0]]])
    out = S.span_dilate(score, torch.tensor([1]), torch.tensor([7]), 0, back=2)
    assert out.tolist() == [[[NEG, 5.0, 3.0, 3.0, 3.0, -1.0, NEG, NEG]]]   # position 7 (outside A) never leaks
    out = S.span_dilate(score, torch.tensor([1]), torch.tensor([7]), 1, back=1)
    assert out.tolist() == [[[NEG, 5.0, 5.0, 3.0, 3.0, 3.0, -1.0, NEG]]]


def test_select_span_back_brings_the_tokens_before_a_peak():
    length, peak = 200, 120
    ev = torch.full((1, 2, 1, length), -10.0)
    ev[..., peak] = 5.0
    norms = torch.ones(1, 2, length)
    lo, hi = torch.tensor([4]), torch.tensor([180])
    cfg = dataclasses.replace(selector_params(SfiConfig()), k=7, k_min=1, w_k=0.0, w_pos=0.0, mu=0.0, lam_x=0.0,
                              select_span=2, select_span_back=4)
    sel, _ = S.select(ev, norms, lo, hi, cfg, 7)
    assert sel[0, 0].tolist() == list(range(peak - 4, peak + 3))


def test_exclude_positions_are_not_selected_again():
    g = torch.Generator().manual_seed(3)
    ev = torch.randn(2, 2, 3, 300, generator=g) * 2
    norms = torch.rand(2, 2, 300, generator=g) + 0.1
    lo, hi = torch.tensor([4, 4]), torch.tensor([236, 120])
    cfg = dataclasses.replace(selector_params(SfiConfig()), k=40, k_min=0, select_span=3)
    top, n_top = S.select(ev, norms, lo, hi, cfg, 40)
    kept, n_kept = S.select(ev, norms, lo, hi, cfg, 16, k_cap=40)
    kept = kept[:, :, :16]
    rest, n_rest = S.select(ev, norms, lo, hi, cfg, torch.tensor(40) - n_kept, k_cap=40, exclude=kept)
    assert n_kept.tolist() == [16, 16] and n_rest.tolist() == [24, 24]
    for r in range(2):
        for h in range(2):
            a, b = set(kept[r, h].tolist()), set(rest[r, h, :24].tolist())
            assert not a & b                                   # disjoint
            assert a | b == set(top[r, h].tolist())            # together: the top-k of the same scores
    # padding (-1) and positions outside A exclude nothing
    pad = torch.full((2, 2, 5), -1, dtype=torch.int32)
    pad[0, 0, 0] = 299
    same, _ = S.select(ev, norms, lo, hi, cfg, 40, exclude=pad)
    assert torch.equal(same, top)


def test_topk_ties_go_to_lower_positions():
    score = torch.tensor([[[1.0, 2.0, 2.0, 0.0, 2.0, 2.0, -0.0, 0.0]]])
    sel, n = S.topk_positions(score, torch.tensor([0]), torch.tensor([8]), torch.tensor([3]), 4)
    assert sel.tolist() == [[[1, 2, 4, -1]]] and n.tolist() == [3]
    sel, _ = S.topk_positions(score, torch.tensor([0]), torch.tensor([8]), torch.tensor([6]), 6)
    assert sel.tolist() == [[[0, 1, 2, 3, 4, 5]]]                    # +0.0 (3) ranks above -0.0 (6)
    sel, _ = S.topk_positions(score, torch.tensor([2]), torch.tensor([5]), torch.tensor([2]), 2)
    assert sel.tolist() == [[[2, 4]]]
    nan = torch.tensor([[[float("nan"), NEG, -5.0]]])
    sel, _ = S.topk_positions(nan, torch.tensor([0]), torch.tensor([3]), torch.tensor([2]), 2)
    assert sel.tolist() == [[[0, 2]]]                                 # NaN ranks as -inf, ties to lower


# ------------------------------------------------------------------------------------ properties
def rand_inputs(rows, heads, n_rows, length, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ev = (torch.randn(rows, heads, n_rows, length, generator=g) * 2.0).to(dtype)
    norms = (torch.rand(rows, heads, length, generator=g) * 4.0 + 0.05).to(dtype)
    return ev.to(device), norms.to(device)


def check_valid(sel, n_sel, lo, hi, k_eff):
    rows, heads, _ = sel.shape
    for b in range(rows):
        size = max(0, int(hi[b]) - max(int(lo[b]), 0))
        assert int(n_sel[b]) == min(int(k_eff), size)
        for h in range(heads):
            row = sel[b, h].tolist()
            got = row[: int(n_sel[b])]
            assert all(x == -1 for x in row[int(n_sel[b]):])
            assert got == sorted(got) and len(set(got)) == len(got)
            assert all(int(lo[b]) <= x < int(hi[b]) for x in got)


def test_select_properties():
    rows, heads, length = 5, 4, 200
    ev, norms = rand_inputs(rows, heads, 6, length)
    lo = torch.tensor([4, 4, 0, 50, 10])
    hi = torch.tensor([150, 40, 200, 51, 10])
    cfg = dataclasses.replace(CFG, k=64)
    sel, n = S.select(ev, norms, lo, hi, cfg, 64)
    assert sel.dtype == torch.int32 and n.dtype == torch.int32 and sel.shape == (rows, heads, 64)
    check_valid(sel, n, lo, hi, 64)
    assert n.tolist() == [64, 36, 64, 1, 0]
    assert sel[1, :, :36].tolist() == [list(range(4, 40))] * heads     # |A| <= K: all of A
    assert sel[3, :, 0].tolist() == [50] * heads and (sel[4] == -1).all()
    sel2, n2 = S.select(ev, norms, lo, hi, cfg, 64)                    # deterministic
    assert torch.equal(sel, sel2) and torch.equal(n, n2)


def test_batched_equals_per_row():
    rows, heads, length = 4, 8, 130
    ev, norms = rand_inputs(rows, heads, 2, length, seed=3)
    lo = torch.tensor([4, 0, 30, 4])
    hi = torch.tensor([126, 130, 60, 5])
    cfg = dataclasses.replace(CFG, k=40, k_min=8)
    sel, n = S.select(ev, norms, lo, hi, cfg, 40)
    for b in range(rows):
        sb, nb = S.select(ev[b:b + 1], norms[b:b + 1], lo[b:b + 1], hi[b:b + 1], cfg, 40)
        assert torch.equal(sb[0], sel[b]) and nb.item() == n[b].item()


@pytest.mark.parametrize("variant", ["lambda_max", "weights"])
def test_no_prior_no_refinement_is_topk_of_evidence(variant):
    rows, heads, length, k = 3, 4, 300, 37
    ev, norms = rand_inputs(rows, heads, 4, length, seed=5)
    lo, hi = torch.tensor([4, 0, 100]), torch.tensor([280, 300, 120])
    over = {"lambda_max": 0.0} if variant == "lambda_max" else {"w_k": 0.0, "w_pos": 0.0}
    cfg = dataclasses.replace(CFG, k=k, mu=0.0, lam_x=0.0, **over)
    sel, n = S.select(ev, norms, lo, hi, cfg, k)
    m = S.allowed_mask(lo, hi, length)
    log_f = S.pool_evidence(ev, m, cfg.alpha)
    for b in range(rows):
        for h in range(heads):
            want = sorted(torch.topk(log_f[b, h], min(k, int(hi[b] - lo[b]))).indices.tolist())
            assert sel[b, h, : n[b]].tolist() == want


def test_refinement_changes_selection():
    """Soft-NMS spreads the selection: a peaked cluster loses members to other neighbourhoods."""
    length = 100
    logits = torch.full((1, 1, 1, length), 0.0)
    for j in range(40, 51):
        logits[0, 0, 0, j] = 10.0 - 0.6 * abs(j - 45)                  # a cluster peaked at 45
    logits[0, 0, 0, [10, 70, 90]] = 7.0                                 # isolated peaks
    norms = torch.ones(1, 1, length)
    lo, hi = torch.tensor([0]), torch.tensor([length])
    base = dataclasses.replace(CFG, k=8, k_min=1, lambda_max=0.0, lam_x=0.0)
    plain, _ = S.select(logits, norms, lo, hi, dataclasses.replace(base, mu=0.0), 8)
    nms, _ = S.select(logits, norms, lo, hi, dataclasses.replace(base, mu=1.0, nms_radius=4), 8)
    assert plain[0, 0].tolist() == list(range(41, 49))
    assert nms[0, 0].tolist() == [10, 43, 44, 45, 46, 47, 70, 90]


def test_k_min_and_per_row_k():
    ev, norms = rand_inputs(3, 2, 1, 120, seed=7)
    lo, hi = torch.tensor([0, 0, 0]), torch.tensor([120, 120, 10])
    cfg = dataclasses.replace(CFG, k=50, k_min=20)
    sel, n = S.select(ev, norms, lo, hi, cfg, 5)                        # k < k_min -> k_min
    assert sel.shape[-1] == 20 and n.tolist() == [20, 20, 10]
    sel, n = S.select(ev, norms, lo, hi, cfg, torch.tensor([30, 5, 100]))
    assert sel.shape[-1] == 50 and n.tolist() == [30, 20, 10]
    full, _ = S.select(ev, norms, lo, hi, cfg, 30)
    assert torch.equal(sel[0, :, :30], full[0])                         # same ranking, any width
    sel, n = S.select(ev, norms, lo, hi, cfg, torch.tensor([30, 5, 100]), k_cap=64)
    assert sel.shape[-1] == 64 and n.tolist() == [30, 20, 10]


@pytest.mark.parametrize("length", [1, 2, 17])
def test_tiny_and_degenerate(length):
    ev, norms = rand_inputs(3, 3, 2, length, seed=length)
    lo = torch.tensor([0, length - 1, length])
    hi = torch.tensor([length, length, length + 5])
    sel, n = S.select(ev, norms, lo, hi, dataclasses.replace(CFG, k=4, k_min=1), 4)
    assert n.tolist() == [min(4, length), 1, 0]
    check_valid(sel, n, lo.clamp(max=length), hi.clamp(max=length), 4)
    assert sel[1, :, 0].tolist() == [length - 1] * 3
    sel, n = S.select(ev[:0], norms[:0], lo[:0], hi[:0], CFG, 4)
    assert sel.shape == (0, 3, CFG.k_min) and n.shape == (0,)


def test_input_dtypes_and_no_nan():
    ev, norms = rand_inputs(2, 4, 4, 64, seed=11, dtype=torch.bfloat16)
    ev[0, :, :, :10] = NEG                                              # rows see nothing of a prefix
    norms[1, :, 5] = 0.0
    lo, hi = torch.tensor([4, 4]), torch.tensor([60, 60])
    score, lam = S.selector_scores(ev, norms, lo, hi, CFG)
    m = S.allowed_mask(lo, hi, 64).expand_as(score)
    assert not torch.isnan(score).any() and not torch.isnan(lam).any()
    assert torch.isneginf(score[~m]).all()
    assert torch.isfinite(score[m.reshape(score.shape)]).all()       # unseen positions keep lam * r
    assert (score[0, :, 4:10].amax(-1) < score[0, :, 10:60].amax(-1)).all()
    sel, n = S.select(ev, norms, lo, hi, CFG, 40)
    assert n.tolist() == [40, 40]
