"""The CPU build's compiled block-sparse prefill (``csrc/cpu/block_sparse_prefill_cpu.cpp``:
``torch.ops.speedsfi.block_sparse_prefill``) against its PyTorch twin (``block_sparse_prefill_torch``)
and against a dense-mask reference built from python sets (``tests/critiprefill/helpers.py``).

The grid: page layouts it reads in place (the logical cache in both strides, ``CPU_ATTN``'s vec and amx
packings), KV dtypes, GQA groups, head sizes (multiples of 16 and not), page sizes against
criticality block sizes (blocks of several pages, pages of several blocks), segment sizes; requests
whose last segment is partial, chunks that start inside a segment, on its boundary and one token
long; dense and sparse segments mixed (``min_len``), budgets below and above the candidates. Then:
the same output whatever the thread count, and ids that would read outside the cache or past the
segment's start raise."""

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "critiprefill"))

from helpers import cfg, fp8_batch, make_batch, reference_output  # noqa: E402
from vllm_ext.kernels import cpu_native  # noqa: E402
from vllm_ext.kernels.block_sparse_prefill import block_sparse_prefill_cpu, block_sparse_prefill_torch  # noqa: E402
from vllm_ext.kernels.packed_pages import PackedPages  # noqa: E402
from vllm_ext.methods.critiprefill.plan import build_plan, dense_plan  # noqa: E402

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler here")
SENTINEL = 7.0
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}     # bf16: the output's own rounding

# seq lens / chunk lengths: a partial last segment; chunks starting inside a segment and a block, on
# a segment boundary, one token long; a request with no queries this step
SCENARIOS = {
    "single": ([257, 63, 193], [257, 63, 193]),
    "chunked": ([300, 256, 161, 90], [100, 128, 1, 0]),
}


def _pages(b, layout: str):
    """The batch's cache in ``layout``: the logical view itself, or a packed copy of it."""
    if layout in ("NHD", "HND"):
        return b.kv_cache
    nb, hkv, bs, d2 = b.kv_cache.shape
    pages = PackedPages(torch.zeros(nb, hkv, bs, d2, dtype=b.kv_cache.dtype), layout)
    pages.k.copy_(b.kv_cache[..., :d2 // 2])
    pages.v.copy_(b.kv_cache[..., d2 // 2:])
    return pages


def _problem(scenario, g, d, page, layout, dtype, bk, sq, budget, min_len, seed=0):
    seqs, qls = SCENARIOS[scenario]
    hkv = 2
    b = make_batch(seqs, qls, hq=g * hkv, hkv=hkv, d=d, page=page, dtype=dtype,
                   layout="NHD" if layout != "HND" else "HND", seed=seed, pad_tokens=3)
    c = cfg(segment_size=sq, block_size=bk, budget=budget, min_len=min_len)
    plan = build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c, layer_idx=1)
    return b, plan, _pages(b, layout)


def _native(b, pages, plan, scale):
    out = torch.full_like(b.query, SENTINEL)
    assert cpu_native.block_sparse_prefill(b.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan,
                                           scale, out)
    return out


def _twin(b, pages, plan, scale):
    return block_sparse_prefill_torch(b.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan, scale,
                                      output=torch.full_like(b.query, SENTINEL))


def _kinds(plan) -> set[str]:
    """Which kinds of segment the plan holds: "dense", "sparse" (fewer blocks than precede it),
    "all" (sparse in name, every earlier block selected)."""
    kinds = set()
    for i in range(plan.dense.shape[0]):
        for s in range(int(plan.num_segments[i])):
            if plan.dense[i, s]:
                kinds.add("dense")
                continue
            before = (int(plan.first_segment[i]) + s) * (plan.segment_size // plan.block_size)
            kinds.add("sparse" if bool((plan.num_sel[i, s] < before).any()) else "all")
    return kinds


# (scenario, G, D, page, layout, dtype, criticality block, segment, budget, min_len): pairwise coverage
CASES = [
    ("single", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 64),
    ("chunked", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 64),
    ("single", 1, 128, 16, "vec", torch.bfloat16, 32, 64, 32, 0),
    ("chunked", 8, 32, 32, "NHD", torch.float32, 16, 64, 48, 128),
    ("single", 2, 80, 16, "HND", torch.float32, 64, 128, 64, 0),
    ("chunked", 4, 48, 16, "amx", torch.bfloat16, 16, 64, 32, 0),
    ("single", 5, 64, 64, "vec", torch.float32, 16, 64, 96, 64),
    ("chunked", 2, 64, 16, "NHD", torch.bfloat16, 32, 128, 512, 0),      # budget above every candidate
    ("single", 3, 256, 32, "amx", torch.bfloat16, 32, 64, 64, 0),
    ("chunked", 6, 16, 32, "vec", torch.bfloat16, 64, 128, 64, 0),
]


@needs_native
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_matches_twin_and_reference(case):
    scenario, g, d, page, layout, dtype, bk, sq, budget, min_len = case
    b, plan, pages = _problem(scenario, g, d, page, layout, dtype, bk, sq, budget, min_len,
                              seed=g + d + page)
    kinds = _kinds(plan)
    assert "sparse" in kinds or budget >= 512, kinds
    scale = 1.0 / math.sqrt(d)
    got = _native(b, pages, plan, scale)
    twin = _twin(b, pages, plan, scale)
    n = int(b.query_start_loc[-1])
    assert (got[n:] == SENTINEL).all(), "rows past the batch are left alone"
    tol = TOL[dtype]
    torch.testing.assert_close(got[:n].float(), twin[:n].float(), atol=tol, rtol=tol)
    ref = reference_output(plan, b, scale)
    torch.testing.assert_close(got[:n].float(), ref[:n], atol=tol, rtol=tol)


# fp8 pages (vLLM's e4m3 and e5m2 caches; CPU_ATTN packs them as it packs bf16, one byte an element)
# in each layout the pass reads, the layer's scales below and above 1, bf16 and fp32 queries
FP8_CASES = [
    ("chunked", 3, 64, 32, "vec", torch.float8_e4m3fn, 0.5, 3.0, torch.bfloat16),
    ("single", 2, 64, 16, "amx", torch.float8_e5m2, 3.0, 0.5, torch.float32),
    ("chunked", 4, 48, 16, "NHD", torch.float8_e5m2, 0.25, 2.0, torch.bfloat16),
    ("single", 1, 128, 32, "HND", torch.float8_e4m3fn, 2.0, 0.25, torch.float32),
]


@needs_native
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_fp8_pages_match_twin_and_reference(case):
    """The pass on fp8 pages with the layer's scales (K folded into the score scale, V into the
    output) equals the twin on the same pages and the reference over the dequantised pages."""
    scenario, g, d, page, layout, fp8, ks, vs, qdtype = case
    b, _, _ = _problem(scenario, g, d, page, layout, torch.float32, 32, 64, 64, 0, seed=g + d)
    b8, ref_b = fp8_batch(b, fp8, ks, vs, qdtype)
    c = cfg(segment_size=64, block_size=32, budget=64, min_len=0)
    plan = build_plan(ref_b.query.float(), ref_b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c,
                      layer_idx=1)
    assert "sparse" in _kinds(plan)
    pages = _pages(b8, layout)
    scale = 1.0 / math.sqrt(d)
    n = int(b.query_start_loc[-1])
    got = torch.full_like(b8.query, SENTINEL)
    assert cpu_native.block_sparse_prefill(b8.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan,
                                           scale, got, k_scale=ks, v_scale=vs)
    assert (got[n:] == SENTINEL).all()
    twin = block_sparse_prefill_torch(b8.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan, scale,
                                      output=torch.full_like(b8.query, SENTINEL), k_scale=torch.tensor([ks]),
                                      v_scale=torch.tensor(vs))
    tol = TOL[qdtype] if qdtype != torch.float32 else 5e-5
    torch.testing.assert_close(got[:n].float(), twin[:n].float(), atol=tol, rtol=tol)
    ref = reference_output(plan, dataclasses.replace(ref_b, query=ref_b.query.float()), scale)
    torch.testing.assert_close(got[:n].float(), ref[:n], atol=tol, rtol=tol)
    # the dispatcher hands the layer's scales (CPU tensors) to the pass
    out = torch.full_like(b8.query, SENTINEL)
    assert block_sparse_prefill_cpu(b8.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan, scale,
                                    output=out, k_scale=torch.tensor([ks]), v_scale=torch.tensor(vs))
    assert torch.equal(out, got)


@needs_native
def test_dense_and_sparse_segments_mixed():
    """min_len makes the first segments dense, the final segment is dense: both kinds in one chunk."""
    b, plan, pages = _problem("single", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 128)
    assert {"dense", "sparse"} <= _kinds(plan)
    scale = 0.125
    torch.testing.assert_close(_native(b, pages, plan, scale)[:int(b.query_start_loc[-1])],
                               reference_output(plan, b, scale)[:int(b.query_start_loc[-1])], atol=2e-5, rtol=2e-5)


@needs_native
def test_all_dense_plan_is_causal_attention():
    b, _, pages = _problem("chunked", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 0)
    c = cfg(segment_size=64, block_size=32, budget=64)
    plan = dense_plan(b.query_start_loc, b.seq_lens, 2, c, num_tokens=b.query.shape[0])
    scale = 0.125
    n = int(b.query_start_loc[-1])
    torch.testing.assert_close(_native(b, pages, plan, scale)[:n], reference_output(plan, b, scale)[:n],
                               atol=2e-5, rtol=2e-5)


@needs_native
def test_thread_count_does_not_change_the_output():
    b, plan, pages = _problem("single", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 64)
    before = torch.get_num_threads()
    try:
        torch._C.set_num_threads(1)
        one = _native(b, pages, plan, 0.125)
        torch._C.set_num_threads(3)
        three = _native(b, pages, plan, 0.125)
    finally:
        torch._C.set_num_threads(before)
    assert torch.equal(one, three)


@needs_native
@pytest.mark.parametrize("bad", ["past_segment_start", "negative", "num_sel_too_large", "block_table"])
def test_bad_ids_raise(bad):
    b, plan, pages = _problem("single", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 64)
    i, s = 0, int(plan.num_segments[0]) - 2                  # a sparse segment of the first request
    assert not plan.dense[i, s]
    if bad == "past_segment_start":
        plan.sel_blocks[i, s, 0, 0] = (int(plan.first_segment[i]) + s) * (plan.segment_size // plan.block_size)
    elif bad == "negative":
        plan.sel_blocks[i, s, 1, 0] = -1
    elif bad == "num_sel_too_large":
        plan.num_sel[i, s, 0] = plan.sel_blocks.shape[-1] + 1
    else:
        b.block_table[1, 0] = pages.shape[0]
    with pytest.raises(RuntimeError, match="block_sparse_prefill"):
        _native(b, pages, plan, 0.125)


@needs_native
def test_dispatch_runs_the_compiled_pass():
    b, plan, pages = _problem("single", 3, 64, 32, "vec", torch.float32, 32, 64, 64, 64)
    out = torch.full_like(b.query, SENTINEL)
    assert block_sparse_prefill_cpu(b.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan, 0.125,
                                    output=out)
    assert torch.equal(out, _native(b, pages, plan, 0.125))
