"""CritiPrefill's segments through ``CPU_ATTN``'s own kernel (``methods/critiprefill/cpu_attn_prefill``):
dense runs as cuts of their rows, each sparse segment as a request over a scratch copy of its selected
blocks and its own keys. Against the dense-mask reference built from python sets
(``tests/critiprefill/helpers.py``) and the PyTorch twin, over a grid of page sizes against
criticality block sizes, GQA groups, head sizes (the ``vec`` and ``vec16`` packings; ``amx`` where
the CPU has tiles), dtypes, fp8 pages with scales, chunks starting inside a segment, mixed dense
and sparse segments; and where it does not apply it writes nothing and says so."""

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "critiprefill"))

from helpers import cfg, fp8_batch, make_batch, reference_output  # noqa: E402
from vllm_ext.kernels import cpu_attn_ops  # noqa: E402
from vllm_ext.kernels.block_sparse_prefill import block_sparse_prefill_torch  # noqa: E402
from vllm_ext.kernels.packed_pages import PackedPages  # noqa: E402
from vllm_ext.kernels.page_copy import copy_runs  # noqa: E402
from vllm_ext.methods.critiprefill.cpu_attn_prefill import (attend_segments, scratch_layout,  # noqa: E402
                                                            split_segments)
from vllm_ext.methods.critiprefill.plan import build_plan, dense_plan  # noqa: E402

needs_ops = pytest.mark.skipif(not cpu_attn_ops.available(), reason="vLLM's CPU attention ops are not loaded")
HAS_AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
SENTINEL = 7.0
TOL = {torch.float32: 3e-5, torch.bfloat16: 1.6e-2}

SCENARIOS = {
    "single": ([257, 95, 193], [257, 95, 193]),
    # chunks starting inside a segment and a block, on a segment boundary, one token long; a request
    # with no queries this step
    "chunked": ([300, 256, 161, 90], [100, 128, 1, 0]),
}


def _packed(b, isa: str) -> PackedPages:
    nb, hkv, bs, d2 = b.kv_cache.shape
    pages = PackedPages(torch.zeros(nb, hkv, bs, d2, dtype=b.kv_cache.dtype), isa)
    pages.k.copy_(b.kv_cache[..., :d2 // 2])
    pages.v.copy_(b.kv_cache[..., d2 // 2:])
    return pages


def _problem(scenario, g, d, page, dtype, bk, sq, budget, min_len, seed=0, hkv=2):
    seqs, qls = SCENARIOS[scenario]
    b = make_batch(seqs, qls, hq=g * hkv, hkv=hkv, d=d, page=page, dtype=dtype, seed=seed, pad_tokens=3)
    c = cfg(segment_size=sq, block_size=bk, budget=budget, min_len=min_len)
    plan = build_plan(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c, layer_idx=1)
    return b, plan


def _isa(d: int) -> str:
    return "vec16" if d % 32 else "vec"


def _run(b, pages, plan, scale, **scales):
    out = torch.full_like(b.query, SENTINEL)
    assert attend_segments(b.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan, scale, output=out,
                           **scales)
    return out


# (scenario, G, D, page, dtype, criticality block, segment, budget, min_len)
CASES = [
    ("single", 3, 64, 32, torch.float32, 32, 64, 64, 64),
    ("chunked", 3, 64, 32, torch.float32, 32, 64, 64, 0),
    ("single", 1, 128, 64, torch.bfloat16, 32, 64, 32, 0),          # pages of two blocks
    ("chunked", 4, 64, 128, torch.bfloat16, 32, 128, 64, 0),        # pages of four blocks
    ("chunked", 2, 64, 32, torch.float32, 64, 128, 64, 0),          # blocks of two pages
    ("chunked", 3, 64, 32, torch.float32, 16, 64, 32, 0),           # blocks of 16: two to a scratch page
    ("single", 2, 64, 64, torch.bfloat16, 16, 64, 48, 0),           # three selected blocks of 16
    ("single", 2, 80, 32, torch.float32, 32, 64, 96, 0),            # vec16 (head size not a multiple of 32)
    ("chunked", 5, 32, 32, torch.bfloat16, 32, 64, 512, 0),         # budget above every candidate: all dense
    ("single", 6, 256, 64, torch.bfloat16, 64, 128, 64, 128),
]


@needs_ops
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_matches_reference_and_twin(case):
    scenario, g, d, page, dtype, bk, sq, budget, min_len = case
    b, plan = _problem(scenario, g, d, page, dtype, bk, sq, budget, min_len, seed=g + d + page)
    calls = split_segments(plan, b.query_start_loc.tolist(), b.seq_lens.tolist())
    assert calls is not None and calls.dense
    assert bool(calls.sparse) == (budget < 512)
    pages = _packed(b, _isa(d))
    scale = 1.0 / math.sqrt(d)
    got = _run(b, pages, plan, scale)
    n = int(b.query_start_loc[-1])
    assert (got[n:] == SENTINEL).all(), "rows past the batch are left alone"
    tol = TOL[dtype]
    torch.testing.assert_close(got[:n].float(), reference_output(plan, b, scale)[:n], atol=tol, rtol=tol)
    twin = block_sparse_prefill_torch(b.query, pages, b.block_table, b.query_start_loc, b.seq_lens, plan, scale,
                                      output=torch.full_like(b.query, SENTINEL))
    torch.testing.assert_close(got[:n].float(), twin[:n].float(), atol=tol, rtol=tol)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_scratch_never_reaches_the_output(dtype):
    """Scratch pages a segment fills only partly (blocks of 16 in 32-token pages) are read whole by
    the kernel, which masks the scores past the request's length: whatever an earlier call left in
    the empty slots (NaN here) must not reach the output."""
    from vllm_ext.methods.critiprefill import cpu_attn_prefill as route

    b, plan = _problem("single", 2, 64, 64, dtype, 16, 64, 48, 0, seed=130)
    pages = _packed(b, "vec")
    route._SCRATCH.clear()
    route._scratch(pages, 32, 4096).raw.fill_(float("nan"))
    try:
        got = _run(b, pages, plan, 0.125)
    finally:
        route._SCRATCH.clear()
    n = int(b.query_start_loc[-1])
    assert torch.isfinite(got[:n]).all()
    torch.testing.assert_close(got[:n].float(), reference_output(plan, b, 0.125)[:n], atol=TOL[dtype],
                               rtol=TOL[dtype])


@needs_ops
@pytest.mark.skipif(not HAS_AMX, reason="CPU_ATTN's amx kernel needs AMX tiles")
def test_amx_pages():
    b, plan = _problem("chunked", 3, 64, 32, torch.bfloat16, 32, 64, 64, 0, seed=3)
    pages = _packed(b, "amx")
    n = int(b.query_start_loc[-1])
    torch.testing.assert_close(_run(b, pages, plan, 0.125)[:n].float(), reference_output(plan, b, 0.125)[:n],
                               atol=1.6e-2, rtol=1.6e-2)


@needs_ops
@pytest.mark.parametrize("fp8,ks,vs,qdtype", [(torch.float8_e4m3fn, 0.5, 3.0, torch.bfloat16),
                                              (torch.float8_e5m2, 3.0, 0.5, torch.float32)])
def test_fp8_pages_with_scales(fp8, ks, vs, qdtype):
    b, _ = _problem("chunked", 3, 64, 32, torch.float32, 32, 64, 64, 0, seed=11)
    b8, ref_b = fp8_batch(b, fp8, ks, vs, qdtype)
    c = cfg(segment_size=64, block_size=32, budget=64, min_len=0)
    plan = build_plan(ref_b.query.float(), ref_b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, c,
                      layer_idx=1)
    assert split_segments(plan, b.query_start_loc.tolist(), b.seq_lens.tolist()).sparse
    pages = _packed(b8, "vec")
    scale = 0.125
    n = int(b.query_start_loc[-1])
    got = _run(b8, pages, plan, scale, k_scale=torch.tensor([ks]), v_scale=torch.tensor(vs))
    tol = TOL[qdtype] if qdtype != torch.float32 else 5e-5
    ref = reference_output(plan, dataclasses.replace(ref_b, query=ref_b.query.float()), scale)
    torch.testing.assert_close(got[:n].float(), ref[:n], atol=tol, rtol=tol)


@needs_ops
def test_all_dense_plan_is_cpu_attn_itself():
    """A plan without a sparse segment is one call of the kernel on the step's own arguments: the
    same bits as CPU_ATTN's prefill."""
    b, _ = _problem("chunked", 3, 64, 32, torch.float32, 32, 64, 64, 0)
    c = cfg(segment_size=64, block_size=32, budget=64)
    plan = dense_plan(b.query_start_loc, b.seq_lens, 2, c, num_tokens=b.query.shape[0])
    pages = _packed(b, "vec")
    got = _run(b, pages, plan, 0.125)
    qsl, seq = b.query_start_loc, b.seq_lens
    sched = cpu_attn_ops.scheduler_metadata(num_heads=6, num_kv_heads=2, head_size=64, seq_lens=seq,
                                            query_start_loc=qsl, dtype=torch.float32, isa="vec",
                                            kv_cache_dtype="auto")
    want = torch.full_like(b.query, SENTINEL)
    cpu_attn_ops.attend(b.query, *cpu_attn_ops.vllm_caches(pages), want, qsl, seq, b.block_table, 0.125,
                        scheduler=sched, kv_cache_dtype="auto")
    n = int(qsl[-1])
    assert torch.equal(got[:n], want[:n])


@pytest.mark.parametrize("isa,dtype,compiled,run", [("vec", torch.float32, True, 32), ("vec", torch.float32, False, 32),
                                                    ("vec", torch.float32, True, 16), ("vec", torch.float32, False, 16),
                                                    ("vec16", torch.bfloat16, True, 16),
                                                    ("vec", torch.float8_e5m2, True, 32),
                                                    ("vec", torch.float8_e4m3fn, False, 16),
                                                    ("amx", torch.bfloat16, False, 16)])
def test_copy_runs_moves_runs_of_tokens_per_head(monkeypatch, isa, dtype, compiled, run):
    """Each head's run of tokens lands in its slot of the scratch pages, whichever copy runs (the
    compiled row copy, its index_select twin, the strided views of the amx packing), fp8 bytes
    included; slots not named are left alone."""
    from vllm_ext.kernels import cpu_native, page_copy

    if compiled and cpu_native.library() is None:
        pytest.skip("no C++ compiler here")
    if not compiled:
        monkeypatch.setattr(page_copy, "compiled_copy_rows", lambda *a: False)
    src = PackedPages(torch.randn(5, 2, 64, 2 * 32).to(dtype), isa)
    dst = PackedPages(torch.zeros(8, 2, 32, 2 * 32, dtype=dtype), isa)
    per_src, per_dst = 64 // run, 32 // run
    gen = torch.Generator().manual_seed(run)
    n = 5
    pages = torch.randint(0, 5, (n, 2), generator=gen)
    runs = torch.randint(0, per_src, (n, 2), generator=gen)
    slots = torch.randperm(8 * per_dst - 1, generator=gen)[:n]           # the last slot stays empty
    copy_runs(src, dst, pages, runs, slots, run)
    b = lambda t: t.view(torch.uint8)                                    # noqa: E731  (fp8 has no ==)
    for i in range(n):
        dp, dr = int(slots[i]) // per_dst, int(slots[i]) % per_dst
        for h in range(2):
            r = int(runs[i, h]) * run
            assert torch.equal(b(dst[dp, h][dr * run:(dr + 1) * run]), b(src[int(pages[i, h]), h][r:r + run]))
    last = 8 * per_dst - 1
    assert (b(dst[last // per_dst, :][:, (last % per_dst) * run:]) == 0).all()
    with pytest.raises(ValueError, match="divides"):
        copy_runs(src, dst, pages, runs, slots, 24)


def test_where_it_does_not_apply_nothing_is_written():
    b, plan = _problem("single", 3, 64, 96, torch.float32, 64, 64, 64, 0)
    assert scratch_layout(32, 16, "vec") == (16, 32) and scratch_layout(16, 16, "vec16") == (16, 16)
    assert scratch_layout(128, 32, "vec") == (32, 32) and scratch_layout(32, 64, "vec") == (32, 32)
    assert scratch_layout(96, 64, "vec") is None and scratch_layout(32, 24, "vec") is None
    assert scratch_layout(32, 8, "amx") is None and scratch_layout(32, 8, "vec") == (8, 32)
    out = torch.full_like(b.query, SENTINEL)
    # a page size and a block size of which neither divides the other; the logical cache
    assert not attend_segments(b.query, _packed(b, "vec"), b.block_table, b.query_start_loc, b.seq_lens, plan,
                               0.125, output=out)
    assert not attend_segments(b.query, b.kv_cache, b.block_table, b.query_start_loc, b.seq_lens, plan, 0.125,
                               output=out)
    # heads of one sparse segment selecting different numbers of blocks
    b, plan = _problem("single", 3, 64, 32, torch.float32, 32, 64, 64, 0)
    i, s = next((i, s) for i in range(plan.dense.shape[0]) for s in range(int(plan.num_segments[i]))
                if not plan.dense[i, s] and int(plan.num_sel[i, s, 0]) > 1
                and int(plan.num_sel[i, s, 0]) < (int(plan.first_segment[i]) + s) * 2)
    plan.num_sel[i, s, 0] -= 1
    assert split_segments(plan, b.query_start_loc.tolist(), b.seq_lens.tolist()) is None
    assert not attend_segments(b.query, _packed(b, "vec"), b.block_table, b.query_start_loc, b.seq_lens, plan,
                               0.125, output=out)
    assert (out == SENTINEL).all()
