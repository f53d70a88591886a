"""CUDA only: the compiled selector at serving sizes, and inside a CUDA graph (skipped on CPU machines)."""

import dataclasses

import pytest
import torch

from vllm_ext.config import SfiConfig
from vllm_ext.kernels import sfi_selector as K
from vllm_ext.sfi import selector as S

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or not K.HAS_TRITON, reason="needs CUDA and triton")]


def inputs(rows, heads, n_rows, length, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ev = (torch.randn(rows, heads, n_rows, length, generator=g, device="cuda") * 3.0).to(dtype)
    norms = (torch.rand(rows, heads, length, generator=g, device="cuda") * 4.0 + 0.05).to(dtype)
    return ev, norms


@pytest.mark.parametrize("rows,heads,n_rows,length,k,span", [
    (4, 8, 4, 32768, 2048, 0), (2, 4, 32, 20000, 1536, 0), (3, 2, 8, 70000, 4096, 0), (16, 8, 1, 8192, 2048, 0),
    (4, 8, 4, 32768, 2048, 8)])
def test_serving_sizes_match_twin(rows, heads, n_rows, length, k, span):
    ev, norms = inputs(rows, heads, n_rows, length, seed=length)
    seq = torch.randint(length // 2, length + 1, (rows,), device="cuda")
    lo = torch.full((rows,), 4, device="cuda")
    hi = (seq - 256).clamp_min(4)
    cfg = dataclasses.replace(SfiConfig(), k=k, select_span=span)
    s_ref, lam_ref = S.selector_scores(ev, norms, lo, hi, cfg)
    s_tri, lam_tri = K.selector_scores_triton(ev, norms, lo, hi, cfg)
    fin = torch.isfinite(s_ref)
    assert torch.equal(fin, torch.isfinite(s_tri))
    torch.testing.assert_close(s_tri[fin], s_ref[fin], atol=5e-4, rtol=5e-5)
    torch.testing.assert_close(lam_tri, lam_ref, atol=1e-5, rtol=1e-3)
    sel_ref, n_ref = S.select(ev, norms, lo, hi, cfg, k)
    sel_tri, n_tri = K.select_triton(ev, norms, lo, hi, cfg, k)
    assert torch.equal(n_ref, n_tri)
    # Sets may differ only through near-ties at the K-th score (fp32 summation order differs).
    s_ref = S.span_dilate(s_ref, lo, hi, span)
    for b in range(rows):
        for h in range(heads):
            a = set(sel_ref[b, h, : n_ref[b]].tolist())
            t = set(sel_tri[b, h, : n_tri[b]].tolist())
            if a != t:
                diff = torch.tensor(sorted(a ^ t), device="cuda", dtype=torch.long)
                kth = s_ref[b, h][sel_ref[b, h, : n_ref[b]].long()].min()
                assert (s_ref[b, h][diff] - kth).abs().max() < 1e-4, (b, h, len(a ^ t))
    # and on these inputs, exactly equal
    mismatch = (sel_ref != sel_tri).any(-1).sum().item()
    assert mismatch <= max(1, rows * heads // 16)


def test_cuda_graph_capture_and_replay():
    rows, heads, n_rows, length, k = 4, 8, 4, 8192, 1024
    ev, norms = inputs(rows, heads, n_rows, length, seed=1)
    lo = torch.full((rows,), 4, device="cuda")
    hi = torch.tensor([8000, 100, 5000, 4], device="cuda")
    cfg = dataclasses.replace(SfiConfig(), k=k)
    want = K.select_triton(ev, norms, lo, hi, cfg, k)                  # also compiles the kernels
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        K.select_triton(ev, norms, lo, hi, cfg, k)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_sel, out_n = K.select_triton(ev, norms, lo, hi, cfg, k)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_sel, want[0]) and torch.equal(out_n, want[1])
    # new inputs in the same buffers, replayed without re-capture
    ev2, norms2 = inputs(rows, heads, n_rows, length, seed=2)
    ev.copy_(ev2)
    norms.copy_(norms2)
    hi.copy_(torch.tensor([6000, 7000, 10, 8192], device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    ref = K.select_triton(ev, norms, lo, hi, cfg, k)
    assert torch.equal(out_sel, ref[0]) and torch.equal(out_n, ref[1])
