"""prefill_evidence (W queries per request, own causal limits, one G*W power mean) vs a float64
reference, and its consistency with the decode-step evidence when W = 1."""

import math

import pytest
import torch

from kernel_testlib import (DEVICE, DTYPES, FP8, FP8_CASES, SENTINEL, assert_evidence_close,
                            blocks_needed, dequantize_pages, fp8_case_id, fp8_scales,
                            make_block_table, make_kv_cache, quantize_pages, reference_evidence)
from vllm_ext.kernels.paged_reference import gather_kv
from vllm_ext.kernels.dense_decode_evidence import dense_decode_with_evidence, prefill_evidence
from vllm_ext.kernels.triton_utils import use_triton


def _problem(lens, w, g=4, hkv=2, d=64, bs=16, dtype=torch.float32, layout="LBNHC", seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens) + 1
    nb = blocks_needed(lens, bs) + 2
    kv = make_kv_cache(layout, nb, hkv, bs, d, dtype, gen=gen)
    bt = make_block_table(lens, bs, max_blocks, nb, gen).to(DEVICE)
    q = (torch.randn(len(lens), w, g * hkv, d, generator=gen) * 2).to(dtype).to(DEVICE)
    # the last W prompt queries; requests shorter than W have padding queries (position -1)
    qpos = torch.tensor([[n - w + i if n - w + i >= 0 else -1 for i in range(w)] for n in lens],
                        dtype=torch.int32, device=DEVICE)
    return kv, bt, q, qpos, max_blocks * bs


@pytest.mark.parametrize("alpha", [0.5, 0.0])
@pytest.mark.parametrize("layout,dtype", [("LBNHC", torch.float32), ("LBHNC", torch.bfloat16)])
def test_prefill_evidence_vs_reference(alpha, layout, dtype):
    lens = [90, 5, 40, 0, 66]
    act = [True, True, True, True, False]
    w = 6
    kv, bt, q, qpos, max_len = _problem(lens, w, dtype=dtype, layout=layout, seed=1)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.full((len(lens),), 4, dtype=torch.int32, device=DEVICE)
    hi = (seq - 10).clamp_min(0)
    ev = torch.full((len(lens), 2, max_len), SENTINEL, device=DEVICE)
    scale = 1 / math.sqrt(64)
    prefill_evidence(q, kv, bt, seq, lo, hi, scale, ev, qpos,
                     torch.tensor(act, device=DEVICE), alpha, chunk=32)
    for i, n in enumerate(lens):
        if not act[i] or n <= 0:
            assert torch.all(ev[i] == SENTINEL)
            continue
        l, h = 4, min(int(hi[i]), n)
        ref = reference_evidence(q[i], kv, bt[i], l, h, max_len, scale, alpha, qpos[i].tolist())
        assert_evidence_close(ev[i], ref, what=f"row {i}")
    assert torch.isfinite(ev[0, :, 4:80]).all()


def test_prefill_causal_limits_matter():
    """A query that sits inside A only sees the part of A before it: moving the queries' positions
    must change the evidence (the causal limit is honoured)."""
    lens = [80]
    kv, bt, q, qpos, max_len = _problem(lens, 4, seed=2)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([80], dtype=torch.int32, device=DEVICE)     # queries 76..79 inside A
    a = torch.zeros(1, 2, max_len, device=DEVICE)
    b = torch.zeros(1, 2, max_len, device=DEVICE)
    prefill_evidence(q, kv, bt, seq, lo, hi, 0.125, a, qpos)
    prefill_evidence(q, kv, bt, seq, lo, hi, 0.125, b, torch.full_like(qpos, 79))
    assert (a[0, :, 4:76] - b[0, :, 4:76]).abs().max() > 1e-3
    ref = reference_evidence(q[0], kv, bt[0], 4, 80, max_len, 0.125, 0.5, qpos[0].tolist())
    assert_evidence_close(a[0], ref)


def test_prefill_w1_matches_decode_evidence():
    lens = [70, 33]
    kv, bt, q, qpos, max_len = _problem(lens, 1, g=8, seed=3)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([4, 4], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([60, 20], dtype=torch.int32, device=DEVICE)
    a = torch.zeros(2, 2, max_len, device=DEVICE)
    b = torch.zeros(2, 2, max_len, device=DEVICE)
    prefill_evidence(q, kv, bt, seq, lo, hi, 0.125, a, qpos)
    out = torch.zeros(2, 16, 64, device=DEVICE)
    dense_decode_with_evidence(q[:, 0], kv, bt, seq, lo, hi, 0.125, out, b, num_splits=2)
    for i, n in enumerate(lens):                 # decode evidence covers each row's own length
        assert_evidence_close(a[i, :, :n], b[i, :, :n])


@pytest.mark.parametrize("span", [None, 90, 97, "max_len"])
def test_prefill_span_covers_the_prompt_only_and_changes_nothing(span):
    """The prefill end passes its prompts' length (host) as ``span`` so the chunks stop there
    instead of covering the whole ``max_len`` (the model's length): any span from the longest
    active row up gives the same evidence (a shorter last chunk reduces in another order: float
    noise only) and key norms, and ``-inf`` evidence past it."""
    lens = [90, 5, 40]
    kv, bt, q, qpos, max_len = _problem(lens, 4, seed=4)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.full((3,), 4, dtype=torch.int32, device=DEVICE)
    hi = (seq - 3).clamp_min(0)
    ref = torch.full((3, 2, max_len), SENTINEL, device=DEVICE)
    ref_norms = torch.zeros(3, 2, max_len, device=DEVICE)
    prefill_evidence(q, kv, bt, seq, lo, hi, 0.125, ref, qpos, chunk=16, key_norms=ref_norms,
                     span=max_len)
    ev = torch.full_like(ref, SENTINEL)
    norms = torch.zeros_like(ref_norms)
    prefill_evidence(q, kv, bt, seq, lo, hi, 0.125, ev, qpos, chunk=16, key_norms=norms,
                     span=max_len if span == "max_len" else span)
    torch.testing.assert_close(ev, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=0, atol=0)
    assert max_len > 97 and torch.all(ev[:, :, 97:] == float("-inf"))


@pytest.mark.parametrize("alpha", [0.5, 0.0])
@pytest.mark.parametrize("w,g,d", [(16, 4, 64), (6, 3, 32), (1, 8, 64)])
@pytest.mark.parametrize("layout,dtype", [("LBNHC", torch.float32), ("LBHNC", torch.bfloat16)])
def test_triton_kernels_match_the_twin(alpha, w, g, d, layout, dtype):
    """The two Triton launches against ``prefill_evidence_torch`` over a grid: padding queries
    (prompts shorter than W), a masked row, an empty row, A ending before the window, key norms, and
    a span shorter than ``max_len``."""
    from vllm_ext.kernels.dense_decode_evidence import prefill_evidence_torch
    from vllm_ext.kernels.prefill_evidence import prefill_evidence_triton

    if not use_triton(DEVICE):
        pytest.skip("needs Triton (CUDA or the interpreter)")
    lens = [150, 5, 70, 0, 66]
    kv, bt, q, qpos, max_len = _problem(lens, w, g=g, d=d, dtype=dtype, layout=layout, seed=7)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.full((len(lens),), 4, dtype=torch.int32, device=DEVICE)
    hi = (seq - 12).clamp_min(0)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32, device=DEVICE)
    span = max(lens) + 3
    out = {}
    for name, fn in (("twin", prefill_evidence_torch), ("triton", prefill_evidence_triton)):
        ev = torch.full((len(lens), 2, max_len), SENTINEL, device=DEVICE)
        kn = torch.full((len(lens), 2, max_len), SENTINEL, device=DEVICE)
        fn(q, kv, bt, seq, lo, hi, 0.125, ev, qpos, mask, alpha, key_norms=kn, span=span)
        out[name] = (ev, kn)
    torch.testing.assert_close(out["triton"][0], out["twin"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["triton"][1], out["twin"][1], rtol=1e-5, atol=1e-5)
    ev = out["triton"][0]
    assert torch.all(ev[4] == SENTINEL) and torch.all(ev[3] == SENTINEL)   # masked, empty rows
    # every query sees A up to the first window position (150 - w); past A's end (138) -inf
    assert torch.isfinite(ev[0, :, 4:min(150 - w + 1, 138)]).all()
    assert torch.all(ev[0, :, 138:] == float("-inf"))


def test_the_dispatch_runs_the_kernels_where_triton_runs(monkeypatch):
    import vllm_ext.kernels.dense_decode_evidence as dde

    if not use_triton(DEVICE):
        pytest.skip("needs Triton (CUDA or the interpreter)")

    def twin(*a, **k):
        raise AssertionError("the PyTorch twin ran")

    monkeypatch.setattr(dde, "prefill_evidence_torch", twin)
    kv, bt, q, qpos, max_len = _problem([40], 4, seed=8)
    seq = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    ev = torch.zeros(1, 2, max_len, device=DEVICE)
    dde.prefill_evidence(q, kv, bt, seq, torch.tensor([4], dtype=torch.int32, device=DEVICE),
                         torch.tensor([30], dtype=torch.int32, device=DEVICE), 0.125, ev, qpos)
    assert torch.isfinite(ev[0, :, 4:30]).all()


@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_prefill_evidence_fp8_pages(case):
    """fp8 pages with the layer's k_scale: the Triton launches and the twin against the float64
    reference over the dequantised pages; key norms are those of the dequantised keys."""
    from vllm_ext.kernels.dense_decode_evidence import prefill_evidence_torch

    fmt, ks, vs, qdt = case
    lens = [90, 5, 40, 0]
    kv, bt, q, qpos, max_len = _problem(lens, 4, seed=9)
    kv8 = quantize_pages(kv, FP8[fmt], ks, vs)
    kv_ref = dequantize_pages(kv8, ks, vs)
    q = q.to(DTYPES[qdt])
    k_scale, _ = fp8_scales(ks, vs)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.full((len(lens),), 4, dtype=torch.int32, device=DEVICE)
    hi = (seq - 10).clamp_min(0)
    for fn in (prefill_evidence, prefill_evidence_torch):
        ev = torch.full((len(lens), 2, max_len), SENTINEL, device=DEVICE)
        kn = torch.full((len(lens), 2, max_len), SENTINEL, device=DEVICE)
        fn(q, kv8, bt, seq, lo, hi, 0.125, ev, qpos, None, 0.5, key_norms=kn, span=max(lens),
           k_scale=k_scale)
        for i, n in enumerate(lens):
            if n <= 0:
                assert torch.all(ev[i] == SENTINEL)
                continue
            ref = reference_evidence(q[i], kv_ref, bt[i], 4, min(int(hi[i]), n), max_len, 0.125, 0.5,
                                     qpos[i].tolist())
            assert_evidence_close(ev[i], ref, what=f"{fn.__name__} row {i}")
            k, _ = gather_kv(kv_ref, bt[i], torch.arange(n, device=DEVICE))
            torch.testing.assert_close(kn[i, :, :n], k.norm(dim=-1), atol=1e-4, rtol=1e-4)
