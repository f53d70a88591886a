"""CUDA only: the compiled selector at serving sizes, with its persistent workspace, inside a CUDA graph
(skipped on CPU machines).

What holds at serving sizes, stated exactly:
1. the kernels' scores equal the twin's within fp32 rounding (max error ``err``);
2. the kernels' selection is *exactly* the twin's top-K rule (``span_dilate`` + ``topk_positions``:
   the ``n_sel`` best, ties to the lower position, ascending, -1 padding) applied to the kernels' own
   scores: equal tensors, no tolerance;
3. hence against the full twin, a position can be selected by one and not the other only if its twin
   score is within ``2 * err`` of the twin's K-th score (a near-tie that fp32 summation order
   decides); every such difference is checked against that bound.
"""

import dataclasses

import pytest
import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels import sfi_selector as K
from vllm_ext.kernels import sfi_selector_torch as S
from vllm_ext.methods.sfi.selector_params import selector_params

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or not K.HAS_TRITON, reason="needs CUDA and triton")]


def inputs(rows, heads, n_rows, length, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (rows, heads, n_rows, length) if n_rows else (rows, heads, length)
    ev = (torch.randn(*shape, generator=g, device="cuda") * 3.0).to(dtype)
    norms = (torch.rand(rows, heads, length, generator=g, device="cuda") * 4.0 + 0.05).to(dtype)
    return ev, norms


def check_against_twin(ev, norms, lo, hi, cfg, k, *, k_cap=None, workspace=None):
    span = cfg.select_span
    s_ref, lam_ref = S.selector_scores(ev, norms, lo, hi, cfg)
    s_tri, lam_tri = K.selector_scores_triton(ev, norms, lo, hi, cfg)
    fin = torch.isfinite(s_ref)
    assert torch.equal(fin, torch.isfinite(s_tri))
    torch.testing.assert_close(s_tri[fin], s_ref[fin], atol=5e-4, rtol=5e-5)             # 1.
    torch.testing.assert_close(lam_tri, lam_ref, atol=1e-5, rtol=1e-3)
    err = (s_tri[fin] - s_ref[fin]).abs().max().item() if fin.any() else 0.0

    sel, n_sel = K.select(ev, norms, lo, hi, cfg, k, k_cap=k_cap, workspace=workspace)
    width, k_eff = S.resolve_k(k, cfg, norms.shape[0], norms.device, k_cap)
    want, n_want = S.topk_positions(S.span_dilate(s_tri, lo, hi, span), lo, hi, k_eff, width)
    assert torch.equal(n_sel, n_want) and torch.equal(sel, want)                       # 2. exact

    sel_ref, n_ref = S.select(ev, norms, lo, hi, cfg, k, k_cap=k_cap)
    assert torch.equal(n_sel, n_ref)
    d_ref = S.span_dilate(s_ref, lo, hi, span)
    differ = (sel != sel_ref).any(-1)
    for b, h in differ.nonzero().tolist():                                             # 3. near-ties only
        n = int(n_ref[b])
        a, t = sel_ref[b, h, :n].long(), sel[b, h, :n].long()
        kth = d_ref[b, h][a].min()
        diff = torch.tensor(sorted(set(a.tolist()) ^ set(t.tolist())), device="cuda", dtype=torch.long)
        gap = (d_ref[b, h][diff] - kth).abs().max().item()
        assert gap <= 2 * err + 1e-6, (b, h, len(diff), gap, err)
    return sel, n_sel


@pytest.mark.parametrize("rows,heads,n_rows,length,k,span", [
    (4, 8, 4, 32768, 2048, 0), (2, 4, 32, 20000, 1536, 0), (3, 2, 8, 70000, 4096, 0), (16, 8, 1, 8192, 2048, 0),
    (4, 8, 4, 32768, 2048, 8), (4, 8, 0, 131072, 2048, 0), (4, 8, 0, 65536, 2048, 4)])
def test_serving_sizes(rows, heads, n_rows, length, k, span):
    ev, norms = inputs(rows, heads, n_rows, length, seed=length + span)
    seq = torch.randint(length // 2, length + 1, (rows,), device="cuda")
    lo = torch.full((rows,), 4, device="cuda")
    hi = (seq - 256).clamp_min(4)
    cfg = dataclasses.replace(selector_params(SfiConfig()), k=k, select_span=span)
    check_against_twin(ev, norms, lo, hi, cfg, k)
    # deterministic although the candidate lists are filled by atomics
    a = K.select_triton(ev, norms, lo, hi, cfg, k)
    b = K.select_triton(ev, norms, lo, hi, cfg, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_decode_call_shape_with_workspace():
    """The decode path's call: a fixed-capacity list of rows (inactive ones lo = hi = 0), pooled fp32
    log-evidence [S, Hkv, L] with garbage outside A, a per-row budget tensor, k_cap = cfg.k."""
    cap_rows, heads, length, k = 8, 8, 40000, 1024
    cfg = dataclasses.replace(selector_params(SfiConfig()), k=k)
    ev, norms = inputs(cap_rows, heads, 0, length, seed=7, dtype=torch.float32)
    lo = torch.tensor([4, 0, 4, 0, 4, 0, 4, 4], device="cuda", dtype=torch.int32)
    hi = torch.tensor([39000, 0, 12000, 0, 900, 0, 25000, 30001], device="cuda", dtype=torch.int32)
    kt = torch.tensor([1024, 1024, 512, 1024, 1024, 64, 1000, 2000], device="cuda", dtype=torch.int32)
    outside = ~S.allowed_mask(lo, hi, length).expand_as(ev)
    ev[outside] = float("nan")
    norms[outside] = float("inf")
    ws = K.selector_workspace(cap_rows, heads, length, k, "cuda", cfg)
    check_against_twin(ev, norms, lo, hi, cfg, kt, k_cap=k, workspace=ws)
    # no host sync and no allocation in a call with a workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sel, n = K.select(ev, norms, lo, hi, cfg, kt, k_cap=k, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert sel.data_ptr() == ws.selected.data_ptr() and (n[1::2][:3] == 0).all()


def test_cuda_graph_capture_and_replay_flips_rows():
    rows, heads, length, k = 4, 8, 8192, 1024
    cfg = dataclasses.replace(selector_params(SfiConfig()), k=k)
    ev, norms = inputs(rows, heads, 0, length, seed=1, dtype=torch.float32)
    lo = torch.full((rows,), 4, device="cuda")
    hi = torch.tensor([8000, 100, 5000, 4], device="cuda")
    kt = torch.full((rows,), k, device="cuda", dtype=torch.int32)
    ws = K.selector_workspace(rows, heads, length, k, "cuda", cfg)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.select(ev, norms, lo, hi, cfg, kt, k_cap=k, workspace=ws)            # compiles the kernels
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_sel, out_n = K.select(ev, norms, lo, hi, cfg, kt, k_cap=k, workspace=ws)
    # new inputs in the same buffers; rows switch between active, inactive and "all of A"
    for trial, (his, ks) in enumerate([([8000, 100, 5000, 4], [k, k, k, k]), ([4, 7000, 8192, 3000], [k, 64, 900, k]),
                                       ([6000, 4, 1000, 8192], [k, k, 2000, 1]), ([4, 4, 4, 4], [k, k, k, k])]):
        ev2, norms2 = inputs(rows, heads, 0, length, seed=10 + trial, dtype=torch.float32)
        ev.copy_(ev2)
        norms.copy_(norms2)
        hi.copy_(torch.tensor(his, device="cuda"))
        kt.copy_(torch.tensor(ks, device="cuda", dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        ref = K.select_triton(ev, norms, lo, hi, cfg, kt, k_cap=k)            # fresh buffers, eager
        assert torch.equal(out_sel, ref[0]) and torch.equal(out_n, ref[1]), trial
        want = S.select(ev, norms, lo, hi, cfg, kt, k_cap=k)
        assert torch.equal(out_n, want[1])
