"""Block-sparse paged prefill: Triton kernel vs the PyTorch twin vs an explicit visible-set reference.

Tolerances (the reference is fp32 attention over the same, already rounded, low-precision inputs):
fp32 2e-5 (summation order only); fp16 2e-3 and bf16 1.6e-2 absolute (the output's final rounding,
plus on CUDA the rounding of the probabilities to the input dtype before the PV product). Outputs are
O(1) (unit-variance V), so these are a few ulps of the output dtype.
"""

import dataclasses
import itertools
import math

import pytest
import torch

from helpers import cfg, fp8_batch, make_batch, reference_output
from vllm_ext.methods.critiprefill.plan import build_plan, dense_plan
from vllm_ext.kernels.block_sparse_prefill import (
    block_sparse_prefill,
    block_sparse_prefill_torch,
    block_sparse_prefill_triton,
    tile_table,
)
from vllm_ext.kernels.paged_reference import dense_paged_attention
from vllm_ext.kernels.triton_utils import HAS_TRITON

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # numpy, inside triton's interpreter

# seq lens at segment (64) / block (32) boundaries +-1; chunked: prefix cached, chunk starting mid-segment
# and mid-block (ctx 157), on a segment boundary (ctx 64), a single-token chunk (ctx 96)
SCENARIOS = {
    "single": ([129, 63, 193], [129, 63, 193]),
    "chunked": ([257, 160, 97], [100, 96, 1]),
}


def _batches(scenario, hq, hkv, d, page, layout, dtype, seed, pad=3):
    seqs, qls = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    kw = dict(hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, layout=layout, seed=seed, pad_tokens=pad)
    cpu = make_batch(seqs, qls, **kw)
    dev = make_batch(seqs, qls, device=DEV, **kw) if DEV != "cpu" else cpu
    return cpu, dev


def _check(scenario, g, d, page, layout, dtype, bk=32, sq=64, budget=64, score="paper", hkv=2, seed=0):
    hq = g * hkv
    c = cfg(segment_size=sq, block_size=bk, budget=budget, score=score)
    b, bd = _batches(scenario, hq, hkv, d, page, layout, dtype, seed)
    plan = build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c, layer_idx=1)
    assert sparse_somewhere(plan), "the plan must prune somewhere, else this tests dense attention only"
    scale = 1.0 / math.sqrt(d)
    ref = reference_output(plan, b, scale)
    n = int(b.query_start_loc[-1])
    tol = TOL[dtype]

    sentinel = torch.full_like(b.query, 7.0)
    twin = block_sparse_prefill_torch(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens,
                                      plan, scale, output=sentinel.clone())
    torch.testing.assert_close(twin[:n].float(), ref[:n], rtol=0, atol=tol)
    assert torch.all(twin[n:] == 7.0)                               # padding rows untouched
    if HAS_TRITON:
        out = torch.full_like(bd.query, 7.0)
        tri = block_sparse_prefill_triton(bd.query, bd.kv_cache, bd.block_table, bd.query_start_loc,
                                          bd.seq_lens, plan.to(DEV), scale, output=out)
        assert tri is out and tri.dtype == dtype
        torch.testing.assert_close(tri[:n].float().cpu(), ref[:n], rtol=0, atol=tol)
        torch.testing.assert_close(tri[:n].float().cpu(), twin[:n].float(), rtol=0, atol=tol)
        assert torch.all(tri[n:].cpu() == 7.0)
    return plan


def sparse_somewhere(plan) -> bool:
    s = torch.arange(plan.max_segments)
    sb = (plan.first_segment[:, None].long() + s) * (plan.segment_size // plan.block_size)     # [R, S]
    live = (s[None, :] < plan.num_segments[:, None]) & ~plan.dense
    return bool(((plan.num_sel < sb[:, :, None]) & live[:, :, None]).any())


CPU_CASES = [  # (scenario, G, D, page, layout, dtype, criticality block size) - pairwise coverage
    ("single", 1, 64, 16, "NHD", torch.float32, 32),
    ("chunked", 4, 128, 32, "HND", torch.float32, 32),
    ("chunked", 4, 64, 64, "NHD", torch.bfloat16, 32),
    ("chunked", 1, 128, 16, "HND", torch.float16, 32),
    ("single", 1, 64, 32, "NHD", torch.float16, 32),
    ("single", 4, 128, 64, "HND", torch.bfloat16, 32),
    ("chunked", 4, 64, 32, "HND", torch.float32, 16),    # block divides the page
    ("chunked", 1, 64, 16, "NHD", torch.bfloat16, 64),   # block spans four pages
]


@needs_triton
@pytest.mark.parametrize("scenario,g,d,page,layout,dtype,bk", CPU_CASES)
def test_block_sparse_prefill(scenario, g, d, page, layout, dtype, bk):
    _check(scenario, g, d, page, layout, dtype, bk=bk, score="code" if g == 4 else "paper")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_budget_covering_everything_is_dense_causal(dtype):
    c = cfg(segment_size=64, block_size=32, budget=1024)
    b, bd = _batches(([257, 160, 97], [257, 96, 1]), 4, 2, 64, 16, "NHD", dtype, seed=3)
    plan = build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c, layer_idx=1)
    scale = 0.125
    n = int(b.query_start_loc[-1])
    dense_ref = torch.zeros(b.query.shape, dtype=torch.float32)
    dense_paged_attention(b.query, b.kv_cache, b.block_table, b.query_start_loc.tolist(), b.seq_list, scale,
                          dense_ref)
    twin = block_sparse_prefill_torch(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens,
                                      plan, scale)
    torch.testing.assert_close(twin[:n].float(), dense_ref[:n], rtol=0, atol=TOL[dtype])
    args = (bd.query, bd.kv_cache, bd.block_table, bd.query_start_loc, bd.seq_lens)
    tri = block_sparse_prefill_triton(*args, plan.to(DEV), scale)
    torch.testing.assert_close(tri[:n].float().cpu(), dense_ref[:n], rtol=0, atol=TOL[dtype])
    # same keys in the same order as the all-dense plan: bit for bit the same kernel result
    dp = dense_plan(b.query_start_loc, b.seq_lens, 2, c, num_tokens=b.query.shape[0]).to(DEV)
    assert torch.equal(block_sparse_prefill_triton(*args, dp, scale)[:n], tri[:n])


@needs_triton
def test_sparse_differs_from_dense():
    """A budget below the context must change the output (else the tests above could pass vacuously)."""
    c = cfg(segment_size=64, block_size=32, budget=32)
    b, bd = _batches(([300], [300]), 2, 1, 64, 16, "NHD", torch.float32, seed=4, pad=0)
    plan = build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c, layer_idx=1)
    dp = dense_plan(b.query_start_loc, b.seq_lens, 1, c, num_tokens=300)
    args = (bd.query, bd.kv_cache, bd.block_table, bd.query_start_loc, bd.seq_lens)
    sparse = block_sparse_prefill_triton(*args, plan.to(DEV), 0.125).cpu()
    dense = block_sparse_prefill_triton(*args, dp.to(DEV), 0.125).cpu()
    # segment 0 (no block before it) and the final segment are exact; segment 1 reads 1 of 2 blocks
    torch.testing.assert_close(sparse[:64], dense[:64], rtol=0, atol=1e-5)
    torch.testing.assert_close(sparse[256:], dense[256:], rtol=0, atol=1e-5)
    assert (sparse[64:128] - dense[64:128]).abs().max() > 1e-3
    assert (sparse[192:256] - dense[192:256]).abs().max() > 1e-3


# fp8 pages: both formats, scales below and above 1, the query in bf16 and fp32
FP8_CASES = [("chunked", torch.float8_e4m3fn, 0.5, 3.0, torch.bfloat16, 4, "NHD"),
             ("single", torch.float8_e5m2, 3.0, 0.5, torch.float32, 1, "HND")]


@pytest.mark.parametrize("scenario,fp8,k_scale,v_scale,qdtype,g,layout", FP8_CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_fp8_pages_read_as_their_dequantised_values(scenario, fp8, k_scale, v_scale, qdtype, g, layout):
    """The kernel and the twin on fp8 pages with the layer's scales (one-element fp32 tensors, as
    vLLM keeps them) equal fp32 attention over the dequantised pages under the same plan."""
    hkv, d = 2, 64
    b, _ = _batches(scenario, g * hkv, hkv, d, 16, layout, torch.float32, seed=11)
    b8, ref_b = fp8_batch(b, fp8, k_scale, v_scale, qdtype)
    c = cfg(segment_size=64, block_size=32, budget=64, score="code")
    plan = build_plan(ref_b.query.float(), ref_b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c,
                      layer_idx=1)
    assert sparse_somewhere(plan)
    scale = 1.0 / math.sqrt(d)
    ref = reference_output(plan, dataclasses.replace(ref_b, query=ref_b.query.float()), scale)
    n = int(b.query_start_loc[-1])
    tol = TOL[qdtype] if qdtype != torch.float32 else 5e-5
    ks = torch.tensor([k_scale], device=DEV)
    vs = torch.tensor(v_scale, device=DEV)
    twin = block_sparse_prefill_torch(b8.query, b8.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, plan,
                                      scale, output=torch.full_like(b8.query, 7.0), k_scale=ks.cpu(),
                                      v_scale=vs.cpu())
    torch.testing.assert_close(twin[:n].float(), ref[:n], rtol=0, atol=tol)
    assert torch.all(twin[n:] == 7.0)
    # without the scales the pages read as their stored values: a different output
    plain = block_sparse_prefill_torch(b8.query, b8.kv_cache, b.block_table, b.query_start_loc, b.seq_lens,
                                       plan, scale)
    assert (plain[:n].float() - ref[:n]).abs().max() > 0.1
    if HAS_TRITON:
        dev = lambda t: t.to(DEV)                                         # noqa: E731
        out = torch.full_like(dev(b8.query), 7.0)
        tri = block_sparse_prefill_triton(dev(b8.query), dev(b8.kv_cache), dev(b.block_table),
                                          dev(b.query_start_loc), dev(b.seq_lens), plan.to(DEV), scale,
                                          output=out, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(tri[:n].float().cpu(), ref[:n], rtol=0, atol=tol)
        assert torch.all(tri[n:].cpu() == 7.0)


def test_dispatch_uses_the_twin_when_forced(monkeypatch):
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    c = cfg()
    b = make_batch([150], [150], hq=2, hkv=1, d=16, page=16)
    plan = build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c, layer_idx=1)
    out = block_sparse_prefill(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, plan, 0.25)
    torch.testing.assert_close(out.float(), reference_output(plan, b, 0.25), rtol=0, atol=2e-5)


def test_tile_table():
    qsl = torch.tensor([0, 100, 196, 197, 197])
    seq = torch.tensor([257, 160, 97, 50])               # last request has no query in this step
    req, pos = tile_table(qsl, seq, 32, 200)
    assert req.shape[0] == -(-200 // 32) + 4
    got = [(r, p) for r, p in zip(req.tolist(), pos.tolist()) if r >= 0]
    want = [(0, p) for p in range(128, 257, 32)] + [(1, p) for p in range(64, 160, 32)] + [(2, 96)]
    assert got == want


CUDA_GRID = list(itertools.product(["single", "chunked", "long"], [1, 4, 8], [64, 128], [16, 32, 64],
                                   ["NHD", "HND"], [torch.float16, torch.bfloat16, torch.float32]))
SCENARIOS["long"] = ([1025, 2047, 700], [513, 2047, 1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scenario,g,d,page,layout,dtype", CUDA_GRID)
def test_block_sparse_prefill_cuda_grid(scenario, g, d, page, layout, dtype):
    sq, budget = (128, 256) if scenario == "long" else (64, 64)
    _check(scenario, g, d, page, layout, dtype, bk=32, sq=sq, budget=budget,
           score="code" if page == 32 else "paper", hkv=2, seed=g + d + page)
