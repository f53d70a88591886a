"""dense_decode_with_evidence (SFI slow step) and paged_decode (dense baseline) vs their twins and
vs independent references: dense attention from paged_reference, and the evidence formula in
float64 over an explicitly built allowed set."""

import math

import pytest
import torch

from kernel_testlib import (DEVICE, DTYPES, FAST_CASES, FP8, FP8_CASES, FULL_GRID, SENTINEL,
                            assert_close_out, assert_evidence_close, blocks_needed, case_id,
                            cuda_only, dequantize_pages, fp8_case_id, fp8_scales, make_block_table,
                            make_kv_cache, quantize_pages, reference_dense_attention,
                            reference_evidence, row_lengths)
from vllm_ext.kernels.paged_reference import gather_kv
from vllm_ext.kernels.dense_decode_evidence import (dense_decode_with_evidence,
                                                    dense_decode_with_evidence_batched,
                                                    dense_decode_with_evidence_cpu,
                                                    dense_decode_with_evidence_torch,
                                                    dense_decode_workspace, paged_decode,
                                                    paged_decode_torch)


def _problem(case, seed, lens=None, act=None, n_sink=4, n_recent=8, max_len=None):
    g, d, bs, layout, dtn = case
    dtype = DTYPES[dtn]
    if lens is None:
        lens, act = row_lengths(bs)
    gen = torch.Generator().manual_seed(seed)
    hkv = 2
    max_blocks = max(-(-n // bs) for n in lens) + 1
    nb = blocks_needed(lens, bs) + 2
    kv = make_kv_cache(layout, nb, hkv, bs, d, dtype, gen=gen)
    bt = make_block_table(lens, bs, max_blocks, nb, gen).to(DEVICE)
    q = (torch.randn(len(lens), g * hkv, d, generator=gen) * 2).to(dtype).to(DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([min(n_sink, n) for n in lens], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([n - n_recent for n in lens], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor(act, dtype=torch.bool, device=DEVICE)
    if max_len is None:
        max_len = max_blocks * bs
    return dict(q=q, kv=kv, bt=bt, seq=seq, lo=lo, hi=hi, mask=mask, lens=lens, act=act,
                scale=1.0 / math.sqrt(d), dtype=dtype, max_len=max_len, hkv=hkv)


def _check(p, out, ev, alpha, what):
    dense = reference_dense_attention(p["q"], p["kv"], p["bt"], p["seq"], p["scale"])
    for i, L in enumerate(p["lens"]):
        if not p["act"][i] or L <= 0:
            assert torch.all(out[i] == SENTINEL), f"{what}: padded row {i} written"
            if ev is not None:
                assert torch.all(ev[i] == SENTINEL), f"{what}: padded row {i} evidence written"
            continue
        assert_close_out(out[i], dense[i], p["dtype"], f"{what} out row {i} (len {L})")
        if ev is not None:
            lo = max(int(p["lo"][i]), 0)
            hi = min(int(p["hi"][i]), L, p["max_len"])
            ref = reference_evidence(p["q"][i:i + 1], p["kv"], p["bt"][i], lo, hi, p["max_len"],
                                     p["scale"], alpha)
            lim = min(L, p["max_len"])
            assert_evidence_close(ev[i, :, :lim], ref[:, :lim], what=f"{what} evidence row {i} (len {L})")
            assert torch.all(ev[i, :, lim:] == SENTINEL), f"{what}: row {i} written past its length"


def _run(case, num_splits, seed, alpha=0.5, **kw):
    p = _problem(case, seed, **kw)
    r, hq, d = p["q"].shape
    results = {}
    for name, fn in (("kernel", dense_decode_with_evidence), ("twin", dense_decode_with_evidence_torch)):
        out = torch.full_like(p["q"], SENTINEL)
        ev = torch.full((r, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
        fn(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"], p["scale"], out, ev, p["mask"],
           alpha, num_splits=num_splits)
        _check(p, out, ev, alpha, name)
        results[name] = (out, ev)
    (ko, ke), (to, te) = results["kernel"], results["twin"]
    assert_close_out(ko, to.float(), p["dtype"], "kernel vs twin out")
    act = torch.tensor([a and n > 0 for a, n in zip(p["act"], p["lens"])])
    assert_evidence_close(ke[act], te[act], what="kernel vs twin evidence")
    return p, results


@pytest.mark.parametrize("case", FAST_CASES, ids=case_id)
def test_dense_evidence_fast_grid(case):
    idx = FAST_CASES.index(case)
    p, res = _run(case, num_splits=(2, 1, 3)[idx % 3], seed=100 + idx)
    # the allowed set of the longest row is non-trivial: evidence must be finite there
    ev = res["kernel"][1]
    i = p["lens"].index(101)
    assert torch.isfinite(ev[i, :, 4:93]).all() and torch.isinf(ev[i, :, 93:101]).all()
    # work follows the row's own length: columns past it are not written
    assert torch.all(ev[i, :, 101:] == SENTINEL)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("case", FULL_GRID, ids=case_id)
def test_dense_evidence_full_grid(case, num_splits):
    _run(case, num_splits=num_splits, seed=3)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 0.25])
def test_evidence_alpha_variants(alpha):
    _run((4, 64, 16, "LBHNC", "fp32"), num_splits=2, seed=7, alpha=alpha)


def test_evidence_group_of_one_is_a_distribution():
    """G = 1: exp(log f) is exactly the softmax over A, so it sums to 1 over A."""
    p, res = _run((1, 64, 16, "LBNHC", "fp32"), num_splits=3, seed=8)
    ev = res["kernel"][1]
    for i, L in enumerate(p["lens"]):
        lo, hi = int(p["lo"][i]), min(int(p["hi"][i]), L)
        if p["act"][i] and hi > lo:
            tot = torch.exp(ev[i, :, :min(L, p["max_len"])].double()).sum(-1)
            torch.testing.assert_close(tot.cpu(), torch.ones(p["hkv"], dtype=torch.float64),
                                       atol=1e-5, rtol=1e-5)


def test_evidence_shorter_than_history():
    """max_len < seq_len: attention still covers the whole history, evidence only [0, max_len)."""
    lens, act = [70, 40], [True, True]
    _run((4, 64, 16, "LBNHC", "fp32"), num_splits=2, seed=9, lens=lens, act=act, max_len=48)


def test_evidence_workspace_reuse_and_int8_mask():
    case = (8, 64, 32, "LBHNC", "bf16")
    p = _problem(case, 12)
    r, hq, d = p["q"].shape
    ws = dense_decode_workspace(r + 3, hq, d, 4, DEVICE, max_len=p["max_len"] + 16)
    for trial in range(2):  # second call reuses (stale) scratch
        out = torch.full_like(p["q"], SENTINEL)
        ev = torch.full((r, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
        dense_decode_with_evidence(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"],
                                   p["scale"], out, ev, p["mask"].to(torch.int8), 0.5,
                                   num_splits=3, workspace=ws)
        _check(p, out, ev, 0.5, f"trial {trial}")


@pytest.mark.parametrize("case", FAST_CASES[:4], ids=case_id)
def test_paged_decode_dense_baseline(case):
    p = _problem(case, 21)
    for fn, ns in ((paged_decode, 1), (paged_decode, 3), (paged_decode_torch, None)):
        out = torch.full_like(p["q"], SENTINEL)
        fn(p["q"], p["kv"], p["bt"], p["seq"], p["scale"], out, p["mask"], num_splits=ns)
        _check(p, out, None, 0.5, f"{getattr(fn, '__name__', fn)} splits={ns}")


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("case", FULL_GRID, ids=case_id)
def test_paged_decode_full_grid_default_splits(case):
    p = _problem(case, 22, lens=[1, 1000, 4097, 333], act=[True] * 4)
    out = torch.full_like(p["q"], SENTINEL)
    paged_decode(p["q"], p["kv"], p["bt"], p["seq"], p["scale"], out)
    _check(p, out, None, 0.5, "paged_decode default splits")


@pytest.mark.parametrize("case", FAST_CASES[:3], ids=case_id)
def test_evidence_compact_rows_and_key_norms(case):
    """The SFI path's form: the launch covers a compacted list of rows (the slow rows); each entry's
    evidence goes to its own slot and its key norms come from the same pass; rows not listed are
    not written, nor are unused entries' slots."""
    p = _problem(case, 31)
    r, hq, d = p["q"].shape
    # entry 3 -> row 5 (len 101), entry 0 -> row 3 (len bs+1), entry 1 -> row 6 (masked out);
    # entries 2 and 4 unused
    rows = torch.tensor([3, 6, -1, 5, -1], dtype=torch.int32, device=DEVICE)
    for name, fn in (("kernel", dense_decode_with_evidence), ("twin", dense_decode_with_evidence_torch)):
        for ns in (None, 1, 3):
            out = torch.full_like(p["q"], SENTINEL)
            ev = torch.full((5, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
            kn = torch.full((5, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
            fn(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"], p["scale"], out, ev, p["mask"],
               0.5, num_splits=ns, evidence_rows=rows, key_norms=kn)
            what = f"{name} splits={ns}"
            dense = reference_dense_attention(p["q"], p["kv"], p["bt"], p["seq"], p["scale"])
            for row in range(r):
                if row in (3, 5):
                    assert_close_out(out[row], dense[row], p["dtype"], f"{what} row {row}")
                else:
                    assert torch.all(out[row] == SENTINEL), f"{what}: row {row} not listed but written"
            for slot in (1, 2, 4):
                assert torch.all(ev[slot] == SENTINEL) and torch.all(kn[slot] == SENTINEL), what
            for row, slot in ((5, 3), (3, 0)):
                L = p["lens"][row]
                lo, hi = max(int(p["lo"][row]), 0), min(int(p["hi"][row]), L)
                ref = reference_evidence(p["q"][row:row + 1], p["kv"], p["bt"][row], lo, hi,
                                         p["max_len"], p["scale"], 0.5)
                assert_evidence_close(ev[slot, :, :L], ref[:, :L], what=f"{what} slot {slot}")
                assert torch.all(ev[slot, :, L:] == SENTINEL)
                k, _ = gather_kv(p["kv"], p["bt"][row], torch.arange(L, device=DEVICE))
                torch.testing.assert_close(kn[slot, :, :L], k.float().norm(dim=-1), atol=1e-2,
                                           rtol=1e-2)
                assert torch.all(kn[slot, :, L:] == SENTINEL)


@pytest.mark.parametrize("case", FAST_CASES[:3], ids=case_id)
def test_evidence_count_driven_launch_equals_the_masked_grid(case):
    """Compact mode with the live-entry count on the device (a fixed grid walking only the live
    entries' work) writes exactly what the one-program-per-entry launch writes; dead entries and
    rows not listed stay untouched; a count of 0 writes nothing."""
    p = _problem(case, 41)
    rows = torch.tensor([5, 3, 1, -1, -1], dtype=torch.int32, device=DEVICE)
    results = []
    for count in (None, 3, 0):
        out = torch.full_like(p["q"], SENTINEL)
        ev = torch.full((5, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
        kn = torch.full((5, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
        cnt = None if count is None else torch.tensor([count], dtype=torch.int32, device=DEVICE)
        dense_decode_with_evidence(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"], p["scale"],
                                   out, ev, None, 0.5, evidence_rows=rows if count != 0 else
                                   torch.full_like(rows, -1), key_norms=kn, evidence_count=cnt)
        results.append((out, ev, kn))
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.all(t == SENTINEL) for t in results[2])
    assert torch.all(results[1][0][0] == SENTINEL) and not torch.all(results[1][0][5] == SENTINEL)


@pytest.mark.parametrize("alpha", [0.5, 0.0])
@pytest.mark.parametrize("case", FAST_CASES[:4], ids=case_id)
def test_evidence_twin_cpu_form_equals_batched_form(case, alpha):
    """The twin's two forms (per row on the CPU; batched, padded to the longest row, elsewhere)
    write the same output, evidence and key norms, and leave the same entries untouched: batch
    mode with padded / masked rows, and compact mode with unused entries. Without ``out`` each
    writes the same evidence and key norms."""
    p = _problem(case, 51)
    r = p["q"].shape[0]
    for rows in (None, torch.tensor([3, 6, -1, 5, 0], dtype=torch.int32, device=DEVICE)):
        n_ent = r if rows is None else rows.shape[0]
        got = []
        for fn in (dense_decode_with_evidence_cpu, dense_decode_with_evidence_batched):
            out = torch.full_like(p["q"], SENTINEL)
            ev = torch.full((n_ent, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
            kn = torch.full((n_ent, p["hkv"], p["max_len"]), SENTINEL, device=DEVICE)
            fn(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"], p["scale"], out, ev, p["mask"],
               alpha, evidence_rows=rows, key_norms=kn)
            got.append((out, ev, kn))
            # out=None (the CPU build's slow rows, attended by the dense pass): the same evidence
            # and key norms, nothing else
            ev2, kn2 = torch.full_like(ev, SENTINEL), torch.full_like(kn, SENTINEL)
            fn(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"], p["scale"], None, ev2, p["mask"],
               alpha, evidence_rows=rows, key_norms=kn2)
            assert torch.equal(ev2, ev) and torch.equal(kn2, kn)
        for a, b, what in zip(*got, ("out", "evidence", "key norms")):
            assert torch.equal(a == SENTINEL, b == SENTINEL), f"{what}: different entries written"
            assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{what}: different -inf entries"
            fin = torch.isfinite(a) & (a != SENTINEL)
            torch.testing.assert_close(a[fin].float(), b[fin].float(), atol=2e-2, rtol=1e-2,
                                       msg=f"{what} (alpha {alpha}, rows {rows})")


def test_evidence_only_is_the_twins_alone():
    """``out=None`` is the PyTorch twin's evidence-only pass; the Triton kernel refuses it at once."""
    from vllm_ext.kernels.triton_utils import use_triton

    p = _problem(FAST_CASES[0], 52)
    if not use_triton(p["q"]):
        pytest.skip("no Triton here (neither CUDA nor the interpreter)")
    ev = torch.zeros(p["q"].shape[0], p["hkv"], p["max_len"], device=DEVICE)
    with pytest.raises(ValueError, match="out=None"):
        dense_decode_with_evidence(p["q"], p["kv"], p["bt"], p["seq"], p["lo"], p["hi"], p["scale"],
                                   None, ev, p["mask"])


def _fp8_problem(case, seed):
    """A problem on fp8 pages: ``(p8, ref, (k_scale, v_scale))`` where ``ref`` is the same problem
    on the explicitly dequantised pages (fp32), the references' input."""
    fmt, ks, vs, qdt = case
    p = _problem((4, 64, 16, "LBNHC", "fp32"), seed)
    kv8 = quantize_pages(p["kv"], FP8[fmt], ks, vs)
    ref = dict(p, kv=dequantize_pages(kv8, ks, vs), q=p["q"].to(DTYPES[qdt]), dtype=DTYPES[qdt])
    return dict(ref, kv=kv8), ref, fp8_scales(ks, vs)


@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_dense_evidence_fp8_pages(case):
    """fp8 pages with the layer's scales: output and evidence of the kernel (split and direct) and
    of both twin forms against the references over the dequantised pages; paged_decode too."""
    p8, ref, (k_scale, v_scale) = _fp8_problem(case, 61)
    r = p8["q"].shape[0]
    runs = ((dense_decode_with_evidence, 3), (dense_decode_with_evidence, 1),
            (dense_decode_with_evidence_cpu, None), (dense_decode_with_evidence_batched, None))
    for fn, ns in runs:
        out = torch.full_like(p8["q"], SENTINEL)
        ev = torch.full((r, p8["hkv"], p8["max_len"]), SENTINEL, device=DEVICE)
        kw = dict(num_splits=ns) if fn is dense_decode_with_evidence else {}
        fn(p8["q"], p8["kv"], p8["bt"], p8["seq"], p8["lo"], p8["hi"], p8["scale"], out, ev, p8["mask"],
           0.5, k_scale=k_scale, v_scale=v_scale, **kw)
        _check(ref, out, ev, 0.5, f"{fn.__name__} splits={ns}")
    for fn, ns in ((paged_decode, 2), (paged_decode_torch, None)):
        out = torch.full_like(p8["q"], SENTINEL)
        fn(p8["q"], p8["kv"], p8["bt"], p8["seq"], p8["scale"], out, p8["mask"], num_splits=ns,
           k_scale=k_scale, v_scale=v_scale)
        _check(ref, out, None, 0.5, f"{fn.__name__} splits={ns}")


@pytest.mark.parametrize("case", FP8_CASES, ids=fp8_case_id)
def test_evidence_fp8_compact_rows_key_norms(case):
    """The SFI slow pass on fp8 pages (compact list, count-driven launch): key norms are those of
    the dequantised keys, evidence and output as over the dequantised pages."""
    p8, ref, (k_scale, v_scale) = _fp8_problem(case, 62)
    rows = torch.tensor([5, 3, 1, -1, -1], dtype=torch.int32, device=DEVICE)
    cnt = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    dense = reference_dense_attention(ref["q"], ref["kv"], ref["bt"], ref["seq"], ref["scale"])
    for name, fn, count in (("kernel", dense_decode_with_evidence, cnt),
                            ("twin", dense_decode_with_evidence_torch, None)):
        out = torch.full_like(p8["q"], SENTINEL)
        ev = torch.full((5, p8["hkv"], p8["max_len"]), SENTINEL, device=DEVICE)
        kn = torch.full((5, p8["hkv"], p8["max_len"]), SENTINEL, device=DEVICE)
        fn(p8["q"], p8["kv"], p8["bt"], p8["seq"], p8["lo"], p8["hi"], p8["scale"], out, ev, None, 0.5,
           evidence_rows=rows, key_norms=kn, evidence_count=count, k_scale=k_scale, v_scale=v_scale)
        for slot, row in enumerate(rows.tolist()[:3]):
            L = p8["lens"][row]
            assert_close_out(out[row], dense[row], ref["dtype"], f"{name} row {row}")
            lo, hi = max(int(ref["lo"][row]), 0), min(int(ref["hi"][row]), L)
            want = reference_evidence(ref["q"][row:row + 1], ref["kv"], ref["bt"][row], lo, hi,
                                      ref["max_len"], ref["scale"], 0.5)
            assert_evidence_close(ev[slot, :, :L], want[:, :L], what=f"{name} slot {slot}")
            k, _ = gather_kv(ref["kv"], ref["bt"][row], torch.arange(L, device=DEVICE))
            torch.testing.assert_close(kn[slot, :, :L], k.norm(dim=-1), atol=1e-4, rtol=1e-4)
        assert torch.all(ev[3:] == SENTINEL) and torch.all(kn[3:] == SENTINEL)
