"""The CPU build's compiled fast step (``csrc/cpu/two_segment_cpu.cpp``:
``torch.ops.speedsfi.two_segment_decode``, every fast row and KV head of a layer in one pass) against
its PyTorch twin (``two_segment_decode_cpu``) and against a dense-mask reference that knows nothing
of either.

The grid: the page layouts it reads in place (the logical cache, ``CPU_ATTN``'s vec packing, its amx
packing), KV and query dtypes, block sizes (multiples of 16 take the register-blocked scores of K^T,
others the plain loops), GQA groups (past the blocked path's 8), head sizes (multiples of 16 up to 256
blocked, others plain), the compact segment paged or contiguous; rows with an empty compact segment,
an empty recent window, both empty (zeros), masked out (untouched) and of length 0 (untouched), and
windows that start and end inside a page."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_testlib import SENTINEL
from vllm_ext.kernels import cpu_native
from vllm_ext.kernels.packed_pages import PackedPages
from vllm_ext.kernels.two_segment_decode import two_segment_decode_cpu

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler here")

# (layout, KV dtype, block size, group, head size); amx exists for bf16 with block and head sizes that
# are multiples of 16 only
CASES = [("logical", torch.bfloat16, 32, 3, 64), ("vec", torch.bfloat16, 32, 3, 64), ("amx", torch.bfloat16, 32, 3, 64),
         ("vec", torch.bfloat16, 16, 1, 128), ("vec", torch.float32, 64, 4, 128), ("logical", torch.float32, 24, 8, 80),
         ("vec", torch.bfloat16, 48, 2, 32), ("vec", torch.bfloat16, 32, 9, 64), ("amx", torch.bfloat16, 16, 5, 48),
         ("vec", torch.bfloat16, 24, 5, 48), ("logical", torch.bfloat16, 16, 2, 256), ("amx", torch.bfloat16, 64, 8, 256)]


def _problem(layout, dtype, bs, g, d, paged_compact, gen, qdtype=None):
    hkv, nb = 2, 48
    raw = torch.randn(nb, hkv, bs, 2 * d, generator=gen).to(dtype)
    pages = raw if layout == "logical" else PackedPages(raw, layout)
    lens = [7 * bs + 5, 40, bs, 5 * bs + 3, 9, 3 * bs, 0]
    max_blocks = max(-(-n // bs) for n in lens) + 1
    bt = torch.stack([torch.randperm(nb, generator=gen)[:max_blocks] for _ in lens]).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    window = 2 * bs - 3
    recent = torch.clamp(seq - window, min=0)
    recent[4] = seq[4]                                     # an empty recent window
    slots, cap, cbs = 5, 3 * 16 + 5, 16
    if paged_compact:
        n_blocks = -(-cap // cbs)
        compact = torch.randn((slots + 1) * n_blocks + 3, hkv, cbs, 2 * d, generator=gen).to(dtype)
        # one row more than there are lengths: vLLM's paged table ends with a scratch slot
        table = torch.randperm(compact.shape[0], generator=gen)[:(slots + 1) * n_blocks].view(slots + 1, n_blocks)
        table = table.to(torch.int32)
    else:
        compact = torch.randn(slots, hkv, cap, 2 * d, generator=gen).to(dtype)
        table = None
    clen = torch.tensor([cap, 0, 17, 1, 30], dtype=torch.int32)
    # row 5: no compact segment (no slot; paged: the scratch slot, a table row without a length)
    slot = torch.tensor([0, 1, 2, 3, 1, slots if paged_compact else -1, 4], dtype=torch.int32)
    q = (torch.randn(len(lens), hkv * g, d, generator=gen) * 2).to(qdtype or dtype)
    return dict(query=q, kv_cache=pages, block_table=bt, seq_lens=seq, recent_start=recent, compact_kv=compact,
                compact_len=clen, slot_idx=slot, compact_table=table, max_recent=window)


def _run(p, native, row_mask=None):
    out = torch.full(p["query"].shape, SENTINEL).to(p["query"].dtype)
    two_segment_decode_cpu(p["query"], p["kv_cache"], p["block_table"], p["seq_lens"], p["recent_start"],
                           p["compact_kv"], p["compact_len"], p["slot_idx"], p["query"].shape[-1] ** -0.5, out,
                           row_mask, max_recent=p["max_recent"], compact_table=p["compact_table"], native=native)
    return out


@needs_native
@pytest.mark.parametrize("paged_compact", [True, False])
@pytest.mark.parametrize("layout,dtype,bs,g,d", CASES, ids=lambda c: str(c))
def test_matches_the_twin(layout, dtype, bs, g, d, paged_compact):
    p = _problem(layout, dtype, bs, g, d, paged_compact, torch.Generator().manual_seed(bs + 7 * g + d))
    ref, got = _run(p, False), _run(p, True)
    assert torch.equal(got == SENTINEL, ref == SENTINEL)
    tol = 1e-5 if dtype == torch.float32 else 8e-3         # bf16 out: one rounding of the same fp32 value
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    assert (got[6] == SENTINEL).all()                      # length 0: untouched


@needs_native
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float32])
def test_query_dtype_and_row_mask(qdtype):
    """fp32 queries over bf16 pages (and bf16 over bf16); masked rows are left as they were."""
    p = _problem("vec", torch.bfloat16, 32, 3, 64, True, torch.Generator().manual_seed(3), qdtype=qdtype)
    mask = torch.tensor([True, False, True, True, False, True, True])
    ref, got = _run(p, False, mask), _run(p, True, mask)
    assert (got[1] == SENTINEL).all() and (got[4] == SENTINEL).all()
    torch.testing.assert_close(got.float(), ref.float(), atol=8e-3, rtol=8e-3)


def _dense_reference(p):
    """Attention of each active row over exactly its compact entries and its recent window, from a
    dense ``[positions]`` mask over the logical cache (fp64)."""
    kv, q = p["kv_cache"], p["query"].double()
    bs, d = kv.shape[2], q.shape[-1]
    hkv = kv.shape[1]
    g = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    cap = p["compact_kv"].shape[2]
    for r in range(q.shape[0]):
        seq = int(p["seq_lens"][r])
        if seq == 0:
            continue
        pos = torch.arange(seq)
        ent = kv[p["block_table"][r, pos // bs].long(), :, pos % bs].double()        # [seq, H, 2D]
        recent = (pos >= p["recent_start"][r]) & (pos < p["recent_start"][r] + p["max_recent"])
        slot = int(p["slot_idx"][r])
        n_c = int(p["compact_len"][slot]) if slot >= 0 else 0
        cent = p["compact_kv"][slot, :, :min(n_c, cap)].double().transpose(0, 1) if n_c else ent[:0]
        keys = torch.cat([cent, ent[recent]], 0)                                      # [n, H, 2D]
        if keys.shape[0] == 0:
            continue
        for h in range(hkv):
            s = q[r, h * g:(h + 1) * g] @ keys[:, h, :d].T / d ** 0.5                  # [G, n]
            out[r, h * g:(h + 1) * g] = torch.softmax(s, -1) @ keys[:, h, d:]
    return out


@needs_native
def test_matches_a_dense_mask_reference():
    p = _problem("logical", torch.float32, 16, 3, 64, False, torch.Generator().manual_seed(5))
    got = _run(p, True)
    ref = _dense_reference(p)
    torch.testing.assert_close(got[:6].double(), ref[:6], atol=2e-5, rtol=2e-5)


@needs_native
def test_threads_do_not_change_the_result():
    """Each (row, KV head) is computed by one thread in one order: the same bits with 1 or 2 threads."""
    p = _problem("vec", torch.bfloat16, 32, 3, 64, True, torch.Generator().manual_seed(9))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(p, True)
        torch.set_num_threads(2)
        two = _run(p, True)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@needs_native
def test_what_it_does_not_read_goes_to_the_twin():
    """fp16 pages (no kernel): the wrapper declines, the twin's values come out."""
    p = _problem("logical", torch.float16, 16, 2, 64, True, torch.Generator().manual_seed(4))
    out = torch.full(p["query"].shape, SENTINEL).to(torch.float16)
    assert not cpu_native.two_segment(p["query"], p["kv_cache"], p["block_table"], p["seq_lens"], p["recent_start"],
                                      p["compact_kv"], p["compact_table"], p["compact_kv"].shape[2] * 4,
                                      p["compact_len"], p["slot_idx"], 0.125, out, None, p["max_recent"])
    assert (out == SENTINEL).all()
    torch.testing.assert_close(_run(p, True).float(), _run(p, False).float())


@needs_native
def test_a_bad_block_id_is_an_error_not_a_read():
    p = _problem("vec", torch.bfloat16, 32, 3, 64, True, torch.Generator().manual_seed(6))
    p["block_table"][0, -2] = 10_000                      # inside row 0's recent window
    with pytest.raises(RuntimeError, match="block id"):
        _run(p, True)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("layout,qdtype", [("vec", torch.float32), ("logical", torch.bfloat16), ("amx", torch.float32)])
def test_fp8_pages_match_the_twin(layout, qdtype, fp8):
    """fp8 pages and compact segment (CPU_ATTN packs them as it packs bf16, a byte an element) with
    per-tensor scales != 1: the compiled pass (it must take them: it returns True) against the twin's
    loop, which dequantises."""
    p = _problem(layout, fp8, 32, 3, 64, True, torch.Generator().manual_seed(11), qdtype=qdtype)
    ks, vs = torch.tensor([0.5]), torch.tensor([3.0])
    ref = torch.full(p["query"].shape, SENTINEL).to(qdtype)
    two_segment_decode_cpu(p["query"], p["kv_cache"], p["block_table"], p["seq_lens"], p["recent_start"],
                           p["compact_kv"], p["compact_len"], p["slot_idx"], 64 ** -0.5, ref, None,
                           max_recent=p["max_recent"], compact_table=p["compact_table"], native=False,
                           k_scale=ks, v_scale=vs)
    got = torch.full(p["query"].shape, SENTINEL).to(qdtype)
    assert cpu_native.two_segment(p["query"], p["kv_cache"], p["block_table"], p["seq_lens"], p["recent_start"],
                                  p["compact_kv"], p["compact_table"], p["compact_kv"].shape[2] * p["compact_table"].shape[1],
                                  p["compact_len"], p["slot_idx"], 64 ** -0.5, got, None, p["max_recent"],
                                  k_scale=0.5, v_scale=3.0)
    assert torch.equal(got == SENTINEL, ref == SENTINEL)
    tol = 1e-5 if qdtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * 3, rtol=tol)


@needs_native
@pytest.mark.parametrize("fp8", FP8, ids=str)
def test_fp8_widening_is_exact(fp8):
    """Every one of the 256 codes (NaN codes aside) through the compiled pass equals torch's own
    widening: one key whose V row holds the codes, attention weight 1."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    ref = codes.float()
    keep = ~ref.isnan()
    d = 256
    kv = torch.zeros(1, 1, 16, 2 * d, dtype=fp8)
    kv[0, 0, 0, d:] = codes
    q = torch.zeros(1, 1, d)
    out = torch.zeros(1, 1, d)
    compact = torch.zeros(1, 1, 16, 2 * d, dtype=fp8)
    assert cpu_native.two_segment(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                  torch.tensor([0], dtype=torch.int32), compact, torch.zeros(1, 1, dtype=torch.int32),
                                  16, torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                  1.0, out, None, 16)
    assert torch.equal(out[0, 0][keep], ref[keep])


def _has_byte_permutes() -> bool:
    try:
        return "avx512vbmi" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@needs_native
@pytest.mark.skipif(not _has_byte_permutes(), reason="the default build widens fp8 through fp16 here already")
def test_fp8_widening_through_fp16_is_exact():
    """The route CPUs without byte permutes take (the library built again with -mno-avx512vbmi, in a
    process of its own): every code as torch widens it."""
    env = {**os.environ, cpu_native.FLAGS_ENV: "-mno-avx512vbmi"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "test_fp8_widening_is_exact"], env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"{len(FP8)} passed" in res.stdout, res.stdout[-2000:]
