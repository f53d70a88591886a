"""The CPU build's fused slow step (``torch.ops.speedsfi.sfi_slow_rows``, ``csrc/cpu/sfi_cpu.cpp``):
``sfi_decode`` over ``CPU_ATTN``'s packed pages with it equals, bit for bit, the same steps through the
separate compiled kernels it replaces (the evidence pass, the selector, the gather: the chunk loop of
``vllm_ext.methods.sfi.path``) — every decode row's output, every compact segment and length — over
vec and amx packings, bf16 / fp32 / fp8 pages (with the layer's scales), bf16 and fp32 activations,
kept prefill positions (in a tensor and in KV-cache pages) and without, compact segments contiguous
and paged, slow lists with padding entries. The wrapper refuses what the kernel does not read."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernel_choice import torch_kernels
from tests.sfi_forced_steps import forced_step
from vllm_ext import metrics
from vllm_ext.kernels import cpu_native
from vllm_ext.kernels.packed_pages import PackedPages
from vllm_ext.methods.sfi import path as sfi_path
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.sfi.path import sfi_decode
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.step_plan import SfiPlanBuffers

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler here")

DEV = torch.device("cpu")
HKV, G, D, BS = 2, 3, 32, 32
HQ = HKV * G
CAP = 5
LENS = [150, 97, 61, 130, 120]
CFG = SfiConfig(enabled=True, k=24, k_min=4, n_sink=4, n_recent=16, w_prefill=8, dual_stream=False,
                maintenance_rows=2)
KEEP = dataclasses.replace(CFG, keep_prefill=8, select_span=2, select_span_back=1)
# two decode steps: slow rows first, then some rows read their selections while others refresh
STEPS = [["slow", "slow", "dense", "slow", "slow"], ["fast", "slow", "slow", "fast", "slow"]]
CASES = [("vec", torch.bfloat16, torch.bfloat16, None), ("vec", torch.float32, torch.float32, None),
         ("amx", torch.bfloat16, torch.bfloat16, None), ("vec", torch.float8_e4m3fn, torch.bfloat16, (0.5, 2.0)),
         ("amx", torch.float8_e5m2, torch.float32, (1.5, 0.75))]


def _pages(isa, dtype, gen):
    width = -(-max(LENS) // BS) + 1
    nb = CAP * width + 2
    raw = torch.randn(nb, HKV, BS, 2 * D, generator=gen)
    pages = PackedPages((raw * 0.5).to(dtype), isa)
    bt = torch.randperm(nb, generator=gen)[:CAP * width].reshape(CAP, width).to(torch.int32)
    return pages, bt


def _layer(cfg, kv_dtype, paged, gen):
    layer = SfiLayerBuffers(CAP, HKV, cfg, D, kv_dtype, DEV, num_heads=HQ, max_len=256, paged=paged)
    if paged:
        pages = layer.state_pages(torch.empty(1, HKV, 16, 2 * D, dtype=kv_dtype))
        blocks = (CAP + 1) * pages.total + 3
        cache = torch.zeros(blocks, HKV, 16, 2 * D, dtype=kv_dtype)
        table = torch.randperm(blocks, generator=gen)[:(CAP + 1) * pages.total].view(CAP + 1, -1).to(torch.int32)
        layer.bind_pages(cache, table)
    if cfg.keep_prefill:                      # slots keep positions [n_sink, n_sink + keep), one head shifted
        kept = torch.arange(cfg.n_sink, cfg.n_sink + cfg.keep_prefill, dtype=torch.int32).repeat(CAP, HKV, 1)
        kept[:, 1] += 3
        layer.kept_pos.index_copy_(0, torch.arange(CAP), kept)
    return layer


def _run(cfg, isa, kv_dtype, act_dtype, scales, paged):
    with torch_kernels():                     # the CPU build's dispatch (no Triton there)
        return _steps(cfg, isa, kv_dtype, act_dtype, scales, paged)


def _steps(cfg, isa, kv_dtype, act_dtype, scales, paged):
    gen = torch.Generator().manual_seed(0)
    pages, bt = _pages(isa, kv_dtype, gen)
    layer = _layer(cfg, kv_dtype, paged, gen)
    rt = SfiRuntime(cfg, capacity=CAP, max_rows=CAP, num_heads=HQ, num_kv_heads=HKV, head_size=D, max_len=256,
                    device=DEV)
    buffers = SfiPlanBuffers(CAP, CAP, DEV, chunk_rows=rt.maintenance_rows)
    k_scale, v_scale = (None, None) if scales is None else (torch.tensor([scales[0]]), torch.tensor([scales[1]]))
    outs = []
    for modes in STEPS:
        step, t = forced_step(buffers, cfg, modes, LENS, bt)
        q = torch.randn(CAP, HQ, D, generator=gen).to(act_dtype)
        out = torch.full_like(q, 7.0)
        sfi_decode(q, pages, bt, t, step, cfg, layer, rt, 0, D ** -0.5, out, dense_done=False,
                   fixed_launches=False, k_scale=k_scale, v_scale=v_scale)
        outs.append(out)
    compact = layer.compact_kv if not paged else layer._bound[0]
    return outs, compact.clone(), layer.compact_len.clone()


@needs_native
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("cfg", [CFG, KEEP], ids=["sfi", "keep_prefill"])
@pytest.mark.parametrize("isa,kv_dtype,act_dtype,scales", CASES, ids=lambda c: str(c))
def test_fused_slow_step_equals_the_separate_kernels(monkeypatch, isa, kv_dtype, act_dtype, scales, cfg, paged):
    calls = []
    took = cpu_native.slow_rows
    monkeypatch.setattr(cpu_native, "slow_rows", lambda *a, **k: calls.append(took(*a, **k)) or calls[-1])
    fused = _run(cfg, isa, kv_dtype, act_dtype, scales, paged)
    assert calls and all(calls), "the fused slow step did not run"
    monkeypatch.setattr(sfi_path, "_slow_rows_compiled", lambda *a, **k: False)
    separate = _run(cfg, isa, kv_dtype, act_dtype, scales, paged)
    for i, (a, b) in enumerate(zip(fused[0], separate[0])):
        assert torch.equal(a, b), f"step {i}'s output differs"
    assert torch.equal(fused[1].view(torch.uint8), separate[1].view(torch.uint8)), "compact segments differ"
    assert torch.equal(fused[2], separate[2]), "compact lengths differ"
    assert bool((fused[2] > 0).all()), "every slot selected"


@needs_native
@pytest.mark.parametrize("threads", [1, 8])
def test_either_schedule_gives_the_same_bits(monkeypatch, threads):
    """Whole entries per thread (as many entries as threads or more: one thread here) and the entries'
    KV heads spread over the threads (more threads than entries) write what the separate kernels do."""
    calls = []
    took = cpu_native.slow_rows
    monkeypatch.setattr(cpu_native, "slow_rows", lambda *a, **k: calls.append(took(*a, **k)) or calls[-1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _run(KEEP, "vec", torch.bfloat16, torch.bfloat16, None, True)
        assert calls and all(calls), "the fused slow step did not run"
        monkeypatch.setattr(sfi_path, "_slow_rows_compiled", lambda *a, **k: False)
        separate = _run(KEEP, "vec", torch.bfloat16, torch.bfloat16, None, True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(fused[0], separate[0]):
        assert torch.equal(a, b)
    assert torch.equal(fused[1].view(torch.uint8), separate[1].view(torch.uint8))
    assert torch.equal(fused[2], separate[2])


@needs_native
def test_the_wrapper_refuses_what_the_kernel_does_not_read():
    gen = torch.Generator().manual_seed(1)
    pages, bt = _pages("vec", torch.bfloat16, gen)
    layer = _layer(CFG, torch.bfloat16, False, gen)
    buffers = SfiPlanBuffers(CAP, CAP, DEV, chunk_rows=2)
    q = torch.randn(CAP, HQ, D).to(torch.float16)
    args = dict(out=torch.zeros_like(q), max_len=256, cfg=SfiRuntime(CFG, capacity=CAP, max_rows=CAP, num_heads=HQ,
                num_kv_heads=HKV, head_size=D, max_len=256, device=DEV).select_cfg, k_min=4, width=24, scale=0.1,
                alpha=0.5, n_sink=4, compact_kv=layer.compact_kv, compact_table=None, compact_len=layer.compact_len)
    t = torch.tensor(LENS, dtype=torch.int32)
    before = layer.compact_len.clone()
    assert not cpu_native.slow_rows(q, pages, bt, t, t * 0, t, buffers, 1, **args), "an fp16 query"
    assert not cpu_native.slow_rows(q.float(), pages.raw, bt, t, t * 0, t, buffers, 1,
                                    **{**args, "out": None}), "the logical layout"
    assert torch.equal(layer.compact_len, before)


@needs_native
def test_a_refusal_on_packed_pages_is_logged_and_counted(monkeypatch):
    monkeypatch.setattr(cpu_native, "slow_rows", lambda *a, **k: False)
    metrics.reset()
    _run(CFG, "vec", torch.bfloat16, torch.bfloat16, None, False)
    assert metrics.snapshot().get("fallback.sfi_slow_rows_cpu", 0) > 0
