"""The Triton selector against its PyTorch twin (interpreted on CPU, compiled on CUDA)."""

import dataclasses

import pytest
import torch

from tests.kernel_choice import torch_kernels
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import sfi_selector as K
from vllm_ext.kernels import sfi_selector_torch as S
from vllm_ext.kernels.paged_rows import PagedRows
from vllm_ext.methods.sfi.selector_params import selector_params

pytestmark = pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")

KSEL = 64
CFG = dataclasses.replace(selector_params(SfiConfig()), k=KSEL)


def make(rows, heads, n_rows, length, device, *, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ev = (torch.randn(rows, heads, n_rows, length, generator=g) * 2.5).to(dtype).to(device)
    norms = (torch.rand(rows, heads, length, generator=g) * 4.0 + 0.05).to(dtype).to(device)
    return ev, norms


def bounds(length, device):
    """Rows: all of [0, L); a sink-to-recent range; a single position; an empty set."""
    lo = [0, min(4, length), length - 1, min(4, length)]
    hi = [length, max(min(4, length), length - min(length // 4, 256)), length, min(4, length)]
    return torch.tensor(lo, device=device), torch.tensor(hi, device=device)


def compare(ev, norms, lo, hi, cfg, k, *, k_cap=None, check_scores=True, check_lam=True):
    if check_scores:
        s_ref, lam_ref = S.selector_scores(ev, norms, lo, hi, cfg)
        s_tri, lam_tri = K.selector_scores_triton(ev, norms, lo, hi, cfg)
        fin = torch.isfinite(s_ref)
        assert torch.equal(fin, torch.isfinite(s_tri))
        assert torch.equal(torch.isneginf(s_ref), torch.isneginf(s_tri))
        torch.testing.assert_close(s_tri[fin], s_ref[fin], atol=2e-4, rtol=2e-5)
        if check_lam:                                       # ill-conditioned (and irrelevant) when f == r
            torch.testing.assert_close(lam_tri, lam_ref, atol=1e-6, rtol=1e-4)
    sel_ref, n_ref = S.select(ev, norms, lo, hi, cfg, k, k_cap=k_cap)
    sel_tri, n_tri = K.select_triton(ev, norms, lo, hi, cfg, k, k_cap=k_cap)
    assert sel_tri.dtype == torch.int32 and n_tri.dtype == torch.int32
    assert torch.equal(n_tri, n_ref)
    # equal as sets; both come sorted ascending and padded with -1, so equal as tensors
    assert torch.equal(sel_tri, sel_ref), (sel_tri, sel_ref)
    return sel_tri, n_tri


# 8 heads at the lengths next to the ones kept add nothing but interpreter time
# every length at the fewest and the most heads; the middle head counts at the lengths past the budget
@pytest.mark.parametrize("heads, length",
                         [(h, n) for h in (1, 2, 4, 8) for n in (1, KSEL - 1, KSEL, KSEL + 1, 300, 1000)
                          if (h in (1, 8) or n in (KSEL + 1, 1000)) and not (h == 8 and n in (KSEL - 1, 300))])
def test_matches_twin(heads, length, device):
    ev, norms = make(4, heads, 4, length, device, seed=heads * 1000 + length)
    lo, hi = bounds(length, device)
    compare(ev, norms, lo, hi, CFG, KSEL)


@pytest.mark.parametrize("n_rows,dtype", [(1, torch.float32), (32, torch.float32), (4, torch.bfloat16),
                                          (3, torch.float16)])
def test_evidence_rows_and_dtypes(n_rows, dtype, device):
    ev, norms = make(2, 4, n_rows, 200, device, seed=n_rows, dtype=dtype)
    lo, hi = torch.tensor([4, 0], device=device), torch.tensor([180, 200], device=device)
    compare(ev, norms, lo, hi, CFG, KSEL)


def test_pooled_and_strided_evidence(device):
    ev, norms = make(2, 4, 3, 150, device, seed=5)
    lo, hi = torch.tensor([4, 10], device=device), torch.tensor([140, 90], device=device)
    pooled = ev[:, :, 0]                                    # 3-D, non-contiguous view
    compare(pooled, norms, lo, hi, CFG, KSEL)
    strided = ev.transpose(2, 3).contiguous().transpose(2, 3)   # last axis not unit-stride
    norms_t = norms.transpose(0, 1).contiguous().transpose(0, 1)
    compare(strided, norms_t, lo, hi, CFG, KSEL)


def test_masked_evidence_and_zero_norms(device):
    ev, norms = make(2, 4, 4, 120, device, seed=9)
    ev[0, :, :, :30] = float("-inf")                        # no row sees the start of A
    ev[1, :, 1:, :] = float("-inf")                         # only one row of four sees anything
    ev[1, 2] = float("-inf")                                # a head with no evidence at all
    norms[0, :, 50:55] = 0.0
    lo, hi = torch.tensor([4, 4], device=device), torch.tensor([100, 110], device=device)
    compare(ev, norms, lo, hi, CFG, KSEL)


@pytest.mark.parametrize("over", [dict(mu=0.0), dict(lam_x=0.0), dict(lambda_max=0.0), dict(lambda_max=1.0),
                                  dict(nms_radius=0), dict(nms_radius=3, mu=1.0),
                                  dict(alpha=1.0, cross_head_temperature=0.5, lam_x=0.9)])
def test_config_variants(over, device):
    ev, norms = make(2, 4, 2, 160, device, seed=len(over))
    lo, hi = torch.tensor([4, 0], device=device), torch.tensor([150, 160], device=device)
    compare(ev, norms, lo, hi, dataclasses.replace(CFG, **over), KSEL)


@pytest.mark.parametrize("span", [1, 4, 32])
def test_select_span(span, device):
    ev, norms = make(4, 4, 2, 300, device, seed=span)
    lo, hi = bounds(300, device)
    compare(ev, norms, lo, hi, dataclasses.replace(CFG, select_span=span), KSEL, check_scores=False)
    # a dilated plateau is a run of ties: the lower positions of it win, in both
    flat = dataclasses.replace(CFG, w_k=0.0, w_pos=0.0, mu=0.0, lam_x=0.0, select_span=span)
    peaks = torch.full((2, 4, 1, 300), -8.0, device=device)
    peaks[:, :, :, 100] = 4.0
    peaks[:, :, :, 7] = 3.0
    lo2, hi2 = torch.tensor([4, 50], device=device), torch.tensor([290, 290], device=device)
    compare(peaks, norms[:2], lo2, hi2, flat, 6, check_scores=False, check_lam=False)


@pytest.mark.parametrize("span, back", [(0, 3), (6, 6), (4, 12)])
def test_select_span_back(span, back, device):
    ev, norms = make(4, 4, 2, 300, device, seed=span + 7 * back)
    lo, hi = bounds(300, device)
    compare(ev, norms, lo, hi, dataclasses.replace(CFG, select_span=span, select_span_back=back), KSEL,
            check_scores=False)


def test_exclude_matches_twin(device):
    ev, norms = make(4, 4, 2, 300, device, seed=11)
    lo, hi = bounds(300, device)
    cfg = dataclasses.replace(CFG, k_min=0, select_span=2, select_span_back=2)
    kept, n_kept = S.select(ev.cpu(), norms.cpu(), lo.cpu(), hi.cpu(), cfg, 24, k_cap=KSEL)
    kept = kept[:, :, :24].contiguous().to(device)
    # the caller's rule: the rest of min(k, |A|), so that only finite scores are chosen
    k_rest = (torch.minimum(torch.tensor(KSEL), (hi - lo).cpu().clamp_min(0)) - n_kept).clamp_min(0).to(device)
    ref, n_ref = S.select(ev, norms, lo, hi, cfg, k_rest, k_cap=KSEL, exclude=kept)
    tri, n_tri = K.select_triton(ev, norms, lo, hi, cfg, k_rest, k_cap=KSEL, exclude=kept)
    assert torch.equal(n_tri, n_ref) and torch.equal(tri, ref)
    # the decode path's form: a table of kept positions indexed by each row's slot (-1: none)
    table = torch.full((5, 4, 24), -1, dtype=torch.int32, device=device)
    slot = torch.tensor([3, -1, 0, 1], dtype=torch.int32, device=device)
    for r, s_ in enumerate(slot.tolist()):
        if s_ >= 0:
            table[s_] = kept[r]
    k_slot = torch.where(slot.cpu() >= 0, k_rest.cpu(), torch.minimum(torch.tensor(KSEL), (hi - lo).cpu())).to(device)
    ref2, n_ref2 = S.select(ev, norms, lo, hi, cfg, k_slot, k_cap=KSEL,
                            exclude=torch.where((slot >= 0)[:, None, None], kept, -1))
    for fn in (K.select, K.select_triton):
        got, n_got = fn(ev, norms, lo, hi, cfg, k_slot, k_cap=KSEL, exclude=table, exclude_slot=slot)
        assert torch.equal(n_got, n_ref2) and torch.equal(got, ref2), fn.__name__
    # exclude_count: only the first n entries of a row's list count (a previous request's positions
    # may follow them in the slot's table row); here row 0 counts 5 of its 24, row 2 none
    stale = table.clone()
    n_ex = torch.tensor([5, 0, 0, 24], dtype=torch.int32, device=device)
    want = torch.where((slot >= 0)[:, None, None], kept, -1)
    want = torch.where(torch.arange(24, device=device) < n_ex.long()[:, None, None], want, -1)
    k_cnt = (torch.minimum(torch.tensor(KSEL), (hi - lo).cpu().clamp_min(0)) - n_ex.cpu()).clamp_min(0).to(device)
    ref3, n_ref3 = S.select(ev, norms, lo, hi, cfg, k_cnt, k_cap=KSEL, exclude=want)
    got, n_got = K.select_triton(ev, norms, lo, hi, cfg, k_cnt, k_cap=KSEL, exclude=stale, exclude_slot=slot,
                                 exclude_count=n_ex)
    assert torch.equal(n_got, n_ref3) and torch.equal(got, ref3)
    with torch_kernels():
        twin, n_twin = K.select(ev, norms, lo, hi, cfg, k_cnt, k_cap=KSEL, exclude=stale, exclude_slot=slot,
                                exclude_count=n_ex)
    assert torch.equal(n_twin, n_ref3) and torch.equal(twin, ref3)
    # the same table kept in KV-cache pages (the kept positions are blocks of the compact group),
    # read through the per-slot block table
    paged = paged_copy(stale, device)
    for fn in (K.select_triton, K.select):
        got, n_got = fn(ev, norms, lo, hi, cfg, k_cnt, k_cap=KSEL, exclude=paged, exclude_slot=slot,
                        exclude_count=n_ex)
        assert torch.equal(n_got, n_ref3) and torch.equal(got, ref3), fn.__name__
    with torch_kernels():
        twin, n_twin = K.select(ev, norms, lo, hi, cfg, k_cnt, k_cap=KSEL, exclude=paged, exclude_slot=slot,
                                exclude_count=n_ex)
    assert torch.equal(n_twin, n_ref3) and torch.equal(twin, ref3)
    live = n_kept > 0
    assert live.any()
    for r in torch.nonzero(live).flatten().tolist():
        for h in range(4):
            assert not set(kept[r, h].tolist()) & set(tri[r, h, :int(n_tri[r])].tolist())


def paged_copy(table: torch.Tensor, device) -> PagedRows:
    """``table [slots, Hkv, E]`` int32 written into scattered pages of a token-major fp16 cache (two
    pages per slot), as ``PagedRows``."""
    slots = table.shape[0]
    kv = torch.randn(60, 16, 2, 4, generator=torch.Generator().manual_seed(2)).half().transpose(1, 2)
    kv = kv.to(device)
    blocks = torch.randperm(59, generator=torch.Generator().manual_seed(3))[:slots * 2] + 1
    bt = torch.zeros(slots, 3, dtype=torch.int32)
    bt[:, 1:3] = blocks.view(slots, 2).to(torch.int32)
    paged = PagedRows(kv, bt.to(device), 1, tuple(table.shape[1:]), torch.int32)
    assert paged.num_pages == 2
    paged.index_copy_(0, torch.arange(slots, device=device), table)
    return paged


def test_ties_lower_position_wins(device):
    length = 100
    ev = torch.zeros(2, 4, 2, length, device=device)       # uniform evidence
    norms = torch.ones(2, 4, length, device=device)
    lo, hi = torch.tensor([4, 0], device=device), torch.tensor([90, 100], device=device)
    flat = dataclasses.replace(CFG, w_k=0.0, w_pos=0.0, mu=0.0, lam_x=0.0)   # every score equal
    sel, n = compare(ev, norms, lo, hi, flat, 10, check_lam=False)
    assert sel[0, :, :10].tolist() == [list(range(4, 14))] * 4
    assert sel[1, :, :10].tolist() == [list(range(0, 10))] * 4
    compare(ev, norms, lo, hi, CFG, 10, check_lam=False)    # the prior breaks the ties (lam* = 0/0-ish)
    quant = (torch.randn(2, 4, 2, length, generator=torch.Generator().manual_seed(1)) * 2).round().to(device)
    compare(quant, norms, lo, hi, dataclasses.replace(flat, lambda_max=0.0), 17, check_lam=False)   # many ties


def test_per_row_k_and_k_min(device):
    ev, norms = make(3, 4, 2, 300, device, seed=2)
    lo = torch.tensor([4, 4, 4], device=device)
    hi = torch.tensor([290, 290, 40], device=device)
    cfg = dataclasses.replace(CFG, k=100, k_min=20)
    compare(ev, norms, lo, hi, cfg, torch.tensor([100, 5, 70], device=device), check_scores=False)
    compare(ev, norms, lo, hi, cfg, torch.tensor([1, 250, 33], device=device), k_cap=128, check_scores=False)
    compare(ev, norms, lo, hi, cfg, 7, check_scores=False)
    sel, n = compare(ev, norms, lo, hi, cfg, 2000, check_scores=False)    # wider than L: all of A
    assert sel.shape[-1] == 2000 and n.tolist() == [286, 286, 36]


def test_dispatch(device):
    ev, norms = make(1, 2, 1, 50, device)
    lo, hi = torch.tensor([0], device=device), torch.tensor([50], device=device)
    assert K.use_triton(norms)
    a = K.select(ev, norms, lo, hi, CFG, 10)
    b = S.select(ev, norms, lo, hi, CFG, 10)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
