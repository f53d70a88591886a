"""SFI's compiled CPU kernels (``csrc/cpu/sfi_cpu.cpp``: the torch operators ``torch.ops.speedsfi``,
built and loaded by ``cpu_native``) against the PyTorch twins they stand for, the operators' fake
implementations, the build's cache and its fallbacks.

The evidence pass: the twin's evidence and key norms over a grid (KV dtype, fp8 with the layer's
scales included; block size: multiples of 16 take the register-blocked path, others the generic
one; GQA group sizes past the blocked path's 8; alpha, allowed sets that are empty, one position or
the whole history; a shorter ``max_len`` than the history; fragmented block tables), the same
entries written and the rest untouched. The selector: tests/sfi/test_sfi_selector_cpu.py runs its grid on both paths."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_testlib import SENTINEL
from vllm_ext import metrics
from vllm_ext.kernels import cpu_native
from vllm_ext.kernels.dense_decode_evidence import dense_decode_with_evidence_cpu
from vllm_ext.kernels.packed_pages import PackedPages

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler here")


def _pages(nb, hkv, bs, d, dtype, gen, isa="vec"):
    return PackedPages(torch.randn(nb, hkv, bs, 2 * d, generator=gen).to(dtype), isa)


def _run(native, q, pages, bt, seq, lo, hi, rows, max_len, alpha, norms, with_out=False, scales=(None, None)):
    e = rows.shape[0]
    hkv = pages.shape[1]
    ev = torch.full((e, hkv, max_len), SENTINEL)
    kn = torch.full((e, hkv, max_len), SENTINEL) if norms else None
    out = torch.full(q.shape, SENTINEL, dtype=torch.float32) if with_out else None
    calls = []
    took = cpu_native.evidence
    cpu_native.evidence = lambda *a, **k: calls.append(took(*a, **k)) or calls[-1]
    try:
        dense_decode_with_evidence_cpu(q, pages, bt, seq, lo, hi, q.shape[-1] ** -0.5, out, ev, None, alpha,
                                       evidence_rows=rows, key_norms=kn, native=native, k_scale=scales[0],
                                       v_scale=scales[1])
    finally:
        cpu_native.evidence = took
    assert calls == ([True] if native else []), "the compiled pass did not take the rows"
    return ev, kn, out


# (KV dtype, block size, GQA group, head size): multiples of 16 take the register-blocked paths (scores:
# block size; output: head size), the others and groups past 8 the generic loops
CASES = [(torch.bfloat16, 32, 3, 64), (torch.bfloat16, 16, 1, 64), (torch.float32, 64, 4, 128),
         (torch.bfloat16, 48, 2, 32), (torch.bfloat16, 32, 9, 64), (torch.float32, 24, 8, 80),
         (torch.bfloat16, 16, 5, 48)]


# the amx packing exists for block and head sizes that are multiples of 16 only
ISA_CASES = [(isa, *c) for c in CASES for isa in ("vec", "amx") if isa == "vec" or not (c[1] % 16 or c[3] % 16)]


FP8_CASES = [("vec", torch.float8_e4m3fn, 32, 3, 64, (0.5, 3.0)), ("amx", torch.float8_e5m2, 32, 2, 64, (2.0, 0.25)),
             ("vec", torch.float8_e5m2, 48, 9, 32, (1.0, 1.0)), ("amx", torch.float8_e4m3fn, 16, 4, 128, (0.75, 1.5))]


@needs_native
@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0])
@pytest.mark.parametrize("isa,dtype,bs,g,d", ISA_CASES, ids=lambda c: str(c))
def test_evidence_matches_the_twin(dtype, bs, g, d, alpha, isa):
    """``amx``: CPU_ATTN's VNNI-paired pages, which the C++ unpacks a page at a time and the twin reads
    through 6-d views."""
    _check_evidence(isa, dtype, bs, g, d, alpha)


@needs_native
@pytest.mark.parametrize("alpha", [0.5, 1.0])
@pytest.mark.parametrize("isa,dtype,bs,g,d,scales", FP8_CASES, ids=lambda c: str(c))
def test_evidence_reads_fp8_pages_with_the_layers_scales(isa, dtype, bs, g, d, scales, alpha):
    """fp8 pages (CPU_ATTN packs them as bf16, a byte an element) with per-tensor scales, 1 or not:
    the compiled pass (it must take them) against the twin, which dequantises: K * k_scale in the
    scores and the key norms, V * v_scale in the output."""
    _check_evidence(isa, dtype, bs, g, d, alpha, scales=tuple(torch.tensor([x]) for x in scales))


def _check_evidence(isa, dtype, bs, g, d, alpha, scales=(None, None)):
    gen = torch.Generator().manual_seed(bs * 10 + g)
    hkv, nb = 2, 40
    pages = _pages(nb, hkv, bs, d, dtype, gen, isa)
    lens = [5 * bs + 7, 3, bs, 9 * bs - 1]
    max_blocks = max(-(-n // bs) for n in lens)
    bt = torch.stack([torch.randperm(nb, generator=gen)[:max_blocks] for _ in lens]).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    # allowed sets: sink-to-recent, empty, one position, the whole history
    lo = torch.tensor([4, 2, bs // 2, 0], dtype=torch.int32)
    hi = torch.tensor([lens[0] - 8, 2, bs // 2 + 1, lens[3]], dtype=torch.int32)
    q = (torch.randn(len(lens), hkv * g, d, generator=gen) * 2).to(torch.bfloat16 if scales[0] is not None else dtype)
    rows = torch.tensor([2, 0, -1, 3, 1], dtype=torch.int32)
    for max_len, norms, with_out in ((max_blocks * bs, True, False), (max_blocks * bs, False, True),
                                     (6 * bs, True, True)):   # 6 blocks: shorter than rows 0 and 3
        ref = _run(False, q, pages, bt, seq, lo, hi, rows, max_len, alpha, norms, with_out, scales)
        if scales[0] is not None:                               # the compiled pass must take fp8 pages
            ev = torch.full((1, hkv, max_len), SENTINEL)
            assert cpu_native.evidence(q, pages, bt, seq, lo, hi, torch.tensor([0]), 0.1, alpha, ev, None,
                                       k_scale=float(scales[0]), v_scale=float(scales[1]))
        got = _run(True, q, pages, bt, seq, lo, hi, rows, max_len, alpha, norms, with_out, scales)
        for a, b, what in zip(got, ref, ("evidence", "key norms", "attention output")):
            if b is None:
                assert a is None
                continue
            assert torch.equal(a == SENTINEL, b == SENTINEL), f"{what}: other entries written"
            assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{what}: other -inf entries"
            fin = torch.isfinite(b) & (b != SENTINEL)
            assert fin.any()
            torch.testing.assert_close(a[fin], b[fin], atol=2e-5, rtol=2e-5, msg=what)
        if with_out:                                          # every row is some entry's: all written
            assert not (got[2] == SENTINEL).any()


@needs_native
def test_evidence_is_a_distribution_over_the_allowed_set():
    """Independent of the twin: with one query head per KV head and alpha 1 the evidence is the
    softmax of the scores over [lo, hi), so it sums to 1 there; the norms are ||k||."""
    gen = torch.Generator().manual_seed(1)
    pages = _pages(12, 2, 32, 64, torch.bfloat16, gen)
    bt = torch.randperm(12, generator=gen)[:10].to(torch.int32)[None]
    seq = torch.tensor([300], dtype=torch.int32)
    q = torch.randn(1, 2, 64, generator=gen).to(torch.bfloat16)
    ev, kn, out = _run(True, q, pages, bt, seq, torch.tensor([5], dtype=torch.int32),
                       torch.tensor([290], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 320, 1.0, True,
                       with_out=True)
    total = torch.logsumexp(ev[0, :, 5:290], dim=-1)
    torch.testing.assert_close(total, torch.zeros(2), atol=1e-5, rtol=0)
    k = pages.k.index_select(0, bt[0].long()).transpose(0, 1).reshape(2, -1, 64)[:, :300].float()
    torch.testing.assert_close(kn[0, :, :300], k.norm(dim=-1), atol=1e-4, rtol=1e-5)
    assert torch.isneginf(ev[0, :, :5]).all() and torch.isneginf(ev[0, :, 290:300]).all()
    assert (ev[0, :, 300:] == SENTINEL).all()
    v = pages.v.index_select(0, bt[0].long()).transpose(0, 1).reshape(2, -1, 64)[:, :300].double()
    p = torch.softmax((q[0].double()[:, None, :] * k.double()).sum(-1) / 8.0, dim=-1)     # [2, 300]
    torch.testing.assert_close(out[0].double(), (p[..., None] * v).sum(1), atol=1e-5, rtol=1e-5)


@needs_native
def test_a_bf16_output_gets_the_entries_rows_only():
    """The model's dtype for the output (bf16): the entries' rows written as the fp32 pass rounds them,
    a row that is no entry's (or masked off) untouched."""
    gen = torch.Generator().manual_seed(5)
    pages = _pages(12, 2, 32, 64, torch.bfloat16, gen)
    bt = torch.randperm(12, generator=gen)[:9].to(torch.int32).view(3, 3)
    seq = torch.tensor([70, 90, 40], dtype=torch.int32)
    lo, hi = torch.tensor([0, 4, 0], dtype=torch.int32), torch.tensor([70, 80, 40], dtype=torch.int32)
    q = torch.randn(3, 4, 64, generator=gen).to(torch.bfloat16)
    rows = torch.tensor([2, 0], dtype=torch.int32)
    ref = torch.full((3, 4, 64), SENTINEL)
    ev = torch.empty(2, 2, 96)
    dense_decode_with_evidence_cpu(q, pages, bt, seq, lo, hi, 0.125, ref, ev, None, 0.5, evidence_rows=rows)
    out = torch.full((3, 4, 64), 7.0, dtype=torch.bfloat16)
    mask = torch.tensor([True, True, False])
    dense_decode_with_evidence_cpu(q, pages, bt, seq, lo, hi, 0.125, out, ev, mask, 0.5, evidence_rows=rows,
                                   native=True)
    torch.testing.assert_close(out[0], ref[0].to(torch.bfloat16), atol=0, rtol=0.01)
    assert (out[1:] == 7.0).all()                           # row 1: no entry; row 2: masked off


@needs_native
def test_threads_do_not_change_the_values():
    """The (entry, KV head) pairs shared among threads: each computed whole by one thread, so one
    thread and two give the same bits."""
    gen = torch.Generator().manual_seed(6)
    pages = _pages(40, 2, 32, 64, torch.bfloat16, gen)
    bt = torch.randperm(40, generator=gen)[:36].to(torch.int32).view(4, 9)
    seq = torch.tensor([270, 200, 33, 288], dtype=torch.int32)
    lo, hi = torch.tensor([4, 0, 2, 10], dtype=torch.int32), torch.tensor([260, 200, 30, 280], dtype=torch.int32)
    q = torch.randn(4, 6, 64, generator=gen).to(torch.bfloat16)
    rows = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    got = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(_run(True, q, pages, bt, seq, lo, hi, rows, 288, 0.5, True, with_out=True))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*got):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_native
def test_layouts_it_does_not_read_go_to_the_twin():
    """A cache that is not CPU_ATTN's packed pages, or a KV dtype without a kernel: the wrapper
    declines (nothing written) and the twin's values come out."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(2)
    pages = _pages(6, 2, 16, 64, torch.float16, gen)
    ev = torch.full((1, 2, 64), SENTINEL)
    args = (torch.arange(4, dtype=torch.int32)[None], torch.tensor([60]), torch.tensor([0]), torch.tensor([50]),
            torch.tensor([0]), 0.125, 0.5, ev, None)
    assert not cpu_native.evidence(torch.randn(1, 4, 64), pages, *args)
    assert (ev == SENTINEL).all()
    kv = torch.randn(6, 2, 16, 128).to(torch.bfloat16)                       # a logical cache: K then V
    logical = SimpleNamespace(k=kv[..., :64], v=kv[..., 64:])
    assert not cpu_native.evidence(torch.randn(1, 4, 64), logical, *args)
    assert (ev == SENTINEL).all()


def _failing_build(monkeypatch, tmp_path):
    """A fresh process's first library() call, with a compiler that fails."""
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_reason", None)
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.delenv(cpu_native.ENV, raising=False)
    monkeypatch.setattr(cpu_native, "SOURCES", (tmp_path / "src.cpp",))
    monkeypatch.setattr(cpu_native, "HEADERS", ())
    (tmp_path / "src.cpp").write_text("int x;\n")


def test_no_compiler_falls_back(monkeypatch, tmp_path):
    """The kernels say why they are not there and decline (nothing written): the twins run."""
    _failing_build(monkeypatch, tmp_path)
    assert cpu_native.library() is None
    assert "/bin/false failed" in cpu_native.unavailable_reason()
    ev = torch.full((1, 1, 8), SENTINEL)
    sel = torch.full((1, 1, 2), -7, dtype=torch.int32)
    one = torch.tensor([0])
    assert not cpu_native.select_rows(ev, ev, one, torch.tensor([8]), torch.tensor([2]), None, None, sel)
    assert (sel == -7).all() and (ev == SENTINEL).all()
    pages = _pages(2, 1, 16, 64, torch.bfloat16, torch.Generator().manual_seed(0))
    assert not cpu_native.evidence(torch.randn(1, 1, 64), pages, torch.arange(2, dtype=torch.int32)[None],
                                   torch.tensor([20]), one, torch.tensor([8]), one, 0.125, 0.5, ev, None)
    assert (ev == SENTINEL).all()
    assert not list(tmp_path.glob("*.so*"))                 # no partial library left behind


def test_the_engine_start_logs_and_counts_the_fallback(monkeypatch, tmp_path, caplog):
    """The kernels import no metrics: the engine's start-up (SFI's method, once per engine) counts
    ``fallback.cpu_native`` and logs it once per process, with the reason."""
    from vllm_ext.methods.sfi.method import SfiMethod

    _failing_build(monkeypatch, tmp_path)
    monkeypatch.setattr(metrics, "_logged_once", set())
    before = metrics.snapshot().get("fallback.cpu_native", 0)
    with caplog.at_level(logging.INFO, logger="vllm_ext"):
        for _ in range(2):                                  # two engines in one process
            method = SfiMethod(None, None)
            method.load_cpu_kernels()
            method.load_cpu_kernels()                       # every layer asks; the engine counts once
    assert metrics.snapshot().get("fallback.cpu_native", 0) == before + 2
    logged = [r.getMessage() for r in caplog.records      # not the periodic counter summary
              if r.getMessage().startswith("vllm_ext fallback [cpu_native]")]
    assert len(logged) == 1 and "/bin/false failed" in logged[0], logged


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV, "0")
    assert cpu_native.library() is None
    assert cpu_native.ENV in cpu_native.unavailable_reason()


@needs_native
def test_the_operators_trace():
    """Schemas (what each operator writes), fake implementations and ahead-of-time tracing, as
    ``torch.compile`` needs them (``torch.library.opcheck``)."""
    gen = torch.Generator().manual_seed(3)
    ev, kn = torch.randn(2, 2, 40, generator=gen), torch.rand(2, 2, 40, generator=gen) + 0.1
    sel = torch.zeros(2, 2, 5, dtype=torch.int32)
    cfg = [float(v) for v in range(1, 13)]
    torch.library.opcheck(torch.ops.speedsfi.sfi_select_rows.default,
                          (sel, ev, kn, torch.tensor([3, 0]), torch.tensor([40, 20]), torch.tensor([5, 3]), cfg, 2, 1,
                           0, None))
    pages = _pages(8, 2, 16, 32, torch.bfloat16, gen)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    args = (torch.zeros(2, 2, 60), torch.zeros(2, 2, 60), torch.zeros(2, 4, 32), torch.randn(2, 4, 32, generator=gen),
            pages.k, pages.v, table, torch.tensor([60, 33], dtype=torch.int32), torch.tensor([2, 0]),
            torch.tensor([50, 33]), torch.tensor([1, 0]), 0.2, 0.5, False)
    torch.library.opcheck(torch.ops.speedsfi.sfi_evidence.default, args)
    bad = table.clone()
    bad[1, 2] = 8
    with pytest.raises(RuntimeError, match="block id"):     # the operator checks what the C++ reads
        torch.ops.speedsfi.sfi_evidence(*args[:6], bad, *args[7:])
    with pytest.raises(RuntimeError, match="needs 4 blocks"):
        torch.ops.speedsfi.sfi_evidence(*args[:6], table[:, :3], *args[7:])


_BUILD = """
import json, os, time
from pathlib import Path
from vllm_ext.kernels import cpu_native
cpu_native.SOURCES, cpu_native.HEADERS = (Path(os.environ["SPEEDSFI_TEST_SOURCE"]),), ()
compile_ = cpu_native._compile
def held(cxx, tmp):
    time.sleep(5.0)
    compile_(cxx, tmp)
cpu_native._compile = held
path = cpu_native._build()
print(json.dumps({"path": str(path), "built": cpu_native._build_info["built"]}))
"""


@needs_native
def test_the_library_is_built_once_per_source_and_machine(monkeypatch, tmp_path):
    """Two processes starting at once into an empty cache: one builds, the other waits for it and
    gets the same library; a later start (here: this process) reuses it. The cache's rules, on a
    one-line source whose compile is held for 5 s, so that the second process arrives while the first
    builds (the kernels' own sources build from an empty cache in every fresh run of the suite: the
    first test that needs them)."""
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text("int speedsfi_cache_probe() { return 1; }\n")
    cache = tmp_path / "cache"
    root = str(Path(cpu_native.__file__).resolve().parents[2])
    env = {**os.environ, cpu_native.CACHE_ENV: str(cache), "SPEEDSFI_TEST_SOURCE": str(source),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    got = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(g["built"] for g in got) == [False, True], got           # one compiled, one waited
    built = list(cache.glob("sfi_cpu_*.so"))
    assert len(built) == 1 and got[0]["path"] == got[1]["path"] == str(built[0])
    assert not list(cache.glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_native, "SOURCES", (source,))
    monkeypatch.setattr(cpu_native, "HEADERS", ())
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(cache))
    assert cpu_native._build() == built[0] and not cpu_native._build_info["built"]
    assert built[0].stat().st_mtime_ns == stamp                                       # reused
    source.write_text("int speedsfi_cache_probe() { return 2; }\n")                # another source:
    assert cpu_native._build() != built[0] and cpu_native._build_info["built"]        # another library
