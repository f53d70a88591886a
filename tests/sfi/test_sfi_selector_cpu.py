"""The CPU build's selector (per live row over its allowed set, no masks:
``vllm_ext.kernels.sfi_selector_cpu``, in PyTorch and as the compiled kernel of
``vllm_ext.kernels.cpu_native``) against the masked full-length twin it stands for.

Exact equality of the selections (same positions, ascending, -1 padding): the two compute the same
formulas in a different order of summation, and random scores are far apart compared with that.
Covered: GQA head counts 1-8 (cross-head exclusivity on and off), odd lengths, empty sets, one
position, ``|A| <= k``, evidence that is ``-inf`` over part of ``A`` or a whole head, zero key norms,
every refinement switched off in turn, the span dilation, per-row budgets, ``count``, ties, and the
three forms of ``exclude``; then the window maximum against ``max_pool1d``."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import cpu_native
from vllm_ext.kernels import sfi_selector as K
from vllm_ext.kernels import sfi_selector_cpu as C
from vllm_ext.kernels import sfi_selector_torch as S
from vllm_ext.kernels.paged_rows import PagedRows
from vllm_ext.methods.sfi.selector_params import selector_params

CFG = dataclasses.replace(selector_params(SfiConfig()), k=24, k_min=4)


def make(rows, heads, length, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    ev = torch.randn(rows, heads, length, generator=g) * 2.5
    norms = torch.rand(rows, heads, length, generator=g) * 4.0 + 0.05
    return ev, norms


def bounds(length):
    """Rows: all of [0, L); a sink-to-recent range; one position; empty; fewer positions than k."""
    rows = [(0, length), (4, length - 16), (length // 2, length // 2 + 1), (3, 3), (7, 7 + 13)]
    lo = torch.tensor([min(a, length) for a, _ in rows], dtype=torch.int32)
    hi = torch.tensor([max(min(b, length), 0) for _, b in rows], dtype=torch.int32)
    return lo, hi


def check(ev, norms, lo, hi, cfg, k, **kw):
    k_cap = kw.pop("k_cap", None)
    count = kw.pop("count", None)
    ref = S.select(ev, norms, lo, hi, cfg, k, k_cap=k_cap, **kw)
    if count is not None:                       # rows past count select nothing
        n = int(count[0])
        empty = S.select(ev, norms, lo, lo, cfg, k, k_cap=k_cap)
        ref = (torch.cat([ref[0][:n], empty[0][n:]]), torch.cat([ref[1][:n], empty[1][n:]]))
    for native in (False, True):            # the PyTorch form, then the compiled kernel (where built)
        calls = []
        took = cpu_native.select_rows
        cpu_native.select_rows = lambda *a: calls.append(took(*a)) or calls[-1]
        try:
            got = C.select_rows(ev, norms, lo, hi, cfg, k, k_cap, count, kw.get("exclude"), kw.get("exclude_slot"),
                                kw.get("exclude_count"), native=native)
        finally:
            cpu_native.select_rows = took
        if native and cpu_native.library() is not None and int(ref[1].max()) > 0:
            assert calls == [True], "the compiled selector did not take the rows"
        assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
        assert torch.equal(got[1], ref[1]), (native, got[1], ref[1])
        assert torch.equal(got[0], ref[0]), (native, got[0], ref[0])
    return got


@pytest.mark.parametrize("heads, length", [(h, n) for h in (1, 2, 3, 4, 8) for n in (1, 23, 24, 25, 301)])
def test_matches_twin(heads, length):
    ev, norms = make(5, heads, length, seed=heads * 1000 + length)
    lo, hi = bounds(length)
    check(ev, norms, lo, hi, CFG, 24)


@pytest.mark.parametrize("over", [dict(mu=0.0), dict(lam_x=0.0), dict(lambda_max=0.0), dict(lambda_max=1.0),
                                  dict(nms_radius=0), dict(nms_radius=3, mu=1.0),
                                  dict(alpha=1.0, cross_head_temperature=0.5, lam_x=0.9),
                                  dict(select_span=12, select_span_back=2), dict(select_span=5),
                                  dict(select_span_back=3),
                                  # the neutral configuration (selector "quest")
                                  dict(lambda_max=0.0, mu=0.0, lam_x=0.0)])
def test_config_variants(over):
    ev, norms = make(3, 4, 260, seed=len(over) + 17 * sum(map(len, over)))
    lo, hi = torch.tensor([4, 0, 100], dtype=torch.int32), torch.tensor([240, 260, 101], dtype=torch.int32)
    check(ev, norms, lo, hi, dataclasses.replace(CFG, **over), 24)


@pytest.mark.parametrize("lambda_max", [0.0, 0.02])
def test_minus_inf_evidence_and_zero_norms(lambda_max):
    """Scores that are -inf (no evidence, and no prior mixed in) take the masked form's paths."""
    ev, norms = make(3, 4, 120, seed=9)
    ev[0, :, :30] = float("-inf")
    ev[1, 2] = float("-inf")                                # a head with no evidence at all
    ev[2, :, 40:] = float("-inf")                           # fewer finite scores than k
    norms[0, :, 50:55] = 0.0
    lo, hi = torch.tensor([4, 4, 0], dtype=torch.int32), torch.tensor([100, 110, 120], dtype=torch.int32)
    cfg = dataclasses.replace(CFG, lambda_max=lambda_max, select_span=3, select_span_back=1)
    check(ev, norms, lo, hi, cfg, 24)


def test_budgets_count_and_ties():
    ev, norms = make(4, 3, 300, seed=2)
    lo = torch.tensor([4, 4, 4, 10], dtype=torch.int32)
    hi = torch.tensor([290, 290, 40, 200], dtype=torch.int32)
    cfg = dataclasses.replace(CFG, k=100, k_min=20)
    check(ev, norms, lo, hi, cfg, torch.tensor([100, 5, 70, 30], dtype=torch.int32))
    check(ev, norms, lo, hi, cfg, torch.tensor([1, 250, 33, 8], dtype=torch.int32), k_cap=128)
    check(ev, norms, lo, hi, cfg, 2000)                      # wider than L: all of A
    check(ev, norms, lo, hi, cfg, 50, count=torch.tensor([2], dtype=torch.int32))
    check(ev, norms, lo, hi, cfg, 50, count=torch.tensor([0], dtype=torch.int32))
    flat = dataclasses.replace(CFG, w_k=0.0, w_pos=0.0, mu=0.0, lam_x=0.0)   # every score equal
    sel, _ = check(torch.zeros_like(ev), torch.ones_like(norms), lo, hi, flat, 10)
    assert sel[0, :, :10].tolist() == [list(range(4, 14))] * 3
    quant = (torch.randn(4, 3, 300, generator=torch.Generator().manual_seed(1)) * 2).round()
    check(quant, norms, lo, hi, dataclasses.replace(flat, lambda_max=0.0), 17)    # many ties


@pytest.mark.parametrize("span", [(0, 0), (12, 2)])
def test_long_rows_with_runs_and_ties(span):
    # rows of thousands of positions, a selection of hundreds: the compiled selector's threshold
    # search (a histogram of the keys' top bits, then the bucket that holds the threshold) meets
    # the span dilation's runs of equal scores, rounded scores (ties across the threshold) and -inf
    g = torch.Generator().manual_seed(5)
    length = 9001
    ev, norms = make(3, 3, length, seed=7)
    ev[1] = (torch.randn(3, length, generator=g) * 3).round()
    ev[2, :, ::3] = float("-inf")
    lo = torch.tensor([4, 4, 100], dtype=torch.int32)
    hi = torch.tensor([length - 128, length - 128, 6000], dtype=torch.int32)
    cfg = dataclasses.replace(CFG, k=1024, k_min=16, select_span=span[0], select_span_back=span[1])
    check(ev, norms, lo, hi, cfg, 512)
    check(ev, norms, lo, hi, cfg, torch.tensor([1, 700, 4000], dtype=torch.int32))


def test_exclude_forms():
    ev, norms = make(4, 4, 300, seed=11)
    lo, hi = torch.tensor([0, 4, 150, 7], dtype=torch.int32), torch.tensor([300, 284, 151, 20], dtype=torch.int32)
    cfg = dataclasses.replace(CFG, k_min=0, select_span=2, select_span_back=2)
    kept, n_kept = S.select(ev, norms, lo, hi, cfg, 24, k_cap=24)
    k_rest = (torch.minimum(torch.tensor(24), (hi - lo).clamp_min(0)) - n_kept).clamp_min(0).to(torch.int32)
    check(ev, norms, lo, hi, cfg, k_rest, k_cap=24, exclude=kept)
    table = torch.full((5, 4, 24), -1, dtype=torch.int32)
    slot = torch.tensor([3, -1, 0, 1], dtype=torch.int32)
    for r, s_ in enumerate(slot.tolist()):
        if s_ >= 0:
            table[s_] = kept[r]
    check(ev, norms, lo, hi, cfg, k_rest, k_cap=24, exclude=table, exclude_slot=slot)
    n_ex = torch.tensor([5, 0, 0, 24], dtype=torch.int32)
    dense = check(ev, norms, lo, hi, cfg, k_rest, k_cap=24, exclude=table, exclude_slot=slot, exclude_count=n_ex)
    # the table in KV-cache pages, read through a block table
    kv = torch.randn(30, 3, 16, 8, generator=torch.Generator().manual_seed(5))
    bt = torch.tensor([[0, 7], [0, 3], [0, 12], [0, 9], [0, 21]], dtype=torch.int32)
    paged = PagedRows(kv, bt, 1, (4, 24), torch.int32)
    paged.index_copy_(0, torch.arange(5), table)
    got = check(ev, norms, lo, hi, cfg, k_rest, k_cap=24, exclude=paged, exclude_slot=slot, exclude_count=n_ex)
    assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1])


def test_dispatch_on_the_cpu_uses_it_for_pooled_evidence(monkeypatch):
    """``select`` on the CPU with 3-D (pooled) evidence: this module's result, the workspace filled."""
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")        # the CPU build (no interpreter)
    calls = []
    real = C.select_rows
    monkeypatch.setattr(K, "select_rows_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    ev, norms = make(2, 3, 90, seed=4)
    lo, hi = torch.tensor([4, 0], dtype=torch.int32), torch.tensor([80, 90], dtype=torch.int32)
    ws = K.selector_workspace(2, 3, 90, 24, "cpu", CFG, triton_buffers=False)
    got = K.select(ev, norms, lo, hi, CFG, 24, workspace=ws)
    ref = S.select(ev, norms, lo, hi, CFG, 24)
    assert calls and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[0].data_ptr() == ws.selected.data_ptr()


def test_workspace_rows_past_count_read_empty_after_a_larger_call(monkeypatch):
    """The CPU writes a workspace's live rows only: a call with fewer live rows than the previous one
    still returns every row past its count as nothing selected, and rows a call never wrote are
    never trusted (the first call resets them)."""
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    ev, norms = make(6, 3, 90, seed=5)
    lo = torch.tensor([4, 0, 10, 2, 0, 5], dtype=torch.int32)
    hi = torch.tensor([80, 90, 70, 88, 90, 60], dtype=torch.int32)
    ws = K.selector_workspace(6, 3, 90, 24, "cpu", CFG, triton_buffers=False)
    ws.selected.fill_(123)                                            # what an earlier use left there
    ws.n_sel.fill_(9)
    for n in (5, 2, 0, 3, 6, 1):
        count = torch.tensor([n], dtype=torch.int32)
        got = K.select(ev, norms, lo, hi, CFG, 24, workspace=ws, count=count)
        ref = K.select(ev, norms, lo, hi, CFG, 24, count=count)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), n
        assert (got[0][n:] == -1).all() and (got[1][n:] == 0).all()


@pytest.mark.parametrize("left, right", [(0, 0), (1, 0), (0, 1), (16, 16), (12, 2), (2, 12), (5, 0), (40, 40)])
def test_window_max_is_max_pool(left, right):
    x = torch.randn(3, 97, generator=torch.Generator().manual_seed(left * 100 + right))
    x[1, 10:30] = float("-inf")
    ref = F.max_pool1d(F.pad(x[:, None, :], (left, right), value=float("-inf")),
                       kernel_size=left + right + 1, stride=1)[:, 0]
    assert torch.equal(C._window_max(x, left, right), ref)
