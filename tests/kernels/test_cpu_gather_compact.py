"""The CPU build's compiled gather into the compact segment (``csrc/cpu/gather_compact_cpu.cpp``:
``torch.ops.speedsfi.gather_compact``) against its twin (``gather_compact_cpu``): the same compact
entries and lengths, bit for bit (a copy), over the page layouts it reads in place (the logical
cache, ``CPU_ATTN``'s vec and amx packings), dtypes (fp8: the stored bytes), the compact segment
paged or contiguous, kept entries (``offset``), rows without a slot or masked out, selections
shorter than ``k``, and positions outside a row's length (left as they were)."""

import pytest
import torch

from vllm_ext.kernels import cpu_native
from vllm_ext.kernels.gather_compact import gather_compact_cpu
from vllm_ext.kernels.packed_pages import PackedPages
from vllm_ext.kernels.two_segment_decode import compact_capacity

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler here")

CASES = [("logical", torch.bfloat16, 32, 64), ("vec", torch.bfloat16, 32, 64), ("amx", torch.bfloat16, 32, 64),
         ("vec", torch.float32, 16, 128), ("logical", torch.float32, 24, 80), ("amx", torch.bfloat16, 16, 48),
         ("vec", torch.float8_e4m3fn, 32, 64), ("amx", torch.float8_e5m2, 32, 64),
         ("logical", torch.float8_e4m3fn, 16, 32)]


def _problem(layout, dtype, bs, d, paged, gen):
    hkv, nb = 2, 40
    raw = torch.randn(nb, hkv, bs, 2 * d, generator=gen).to(dtype)
    pages = raw if layout == "logical" else PackedPages(raw, layout)
    lens = [6 * bs + 3, 2, 4 * bs, 3 * bs + 1, 5 * bs]
    width = max(-(-n // bs) for n in lens)
    table = torch.stack([torch.randperm(nb, generator=gen)[:width] for _ in lens]).to(torch.int32)
    k, n_sink, slots, cbs = 12, 4, 4, 8
    cap = n_sink + k + 4
    sel = torch.stack([torch.stack([torch.sort(torch.randperm(max(n, 1), generator=gen)[:k])[0]
                                    if n >= k else torch.arange(k) for _ in range(hkv)]) for n in lens]).to(torch.int32)
    sel[3, 0, 5] = 10_000                                   # outside its row: that entry is left as it was
    n_sel = torch.tensor([k, 2, 7, k, 0], dtype=torch.int32)
    slot = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    offset = torch.tensor([0, 3, 0, 4, 1], dtype=torch.int32)
    if paged:
        nblk = -(-cap // cbs)
        compact = torch.randn((slots + 1) * nblk + 2, hkv, cbs, 2 * d, generator=gen).to(dtype)
        ctab = torch.randperm(compact.shape[0], generator=gen)[:(slots + 1) * nblk].view(slots + 1, nblk)
        ctab = ctab.to(torch.int32)
    else:
        compact, ctab = torch.randn(slots, hkv, cap, 2 * d, generator=gen).to(dtype), None
    clen = torch.full((slots,), -5, dtype=torch.int32)
    return dict(kv_cache=pages, block_table=table, slot_idx=slot, selected=sel, n_sel=n_sel, n_sink=n_sink,
                compact_kv=compact, compact_len=clen, seq_lens=torch.tensor(lens, dtype=torch.int32),
                offset=offset, compact_table=ctab)


def _run(p, native, **kw):
    ckv, clen = p["compact_kv"].clone(), p["compact_len"].clone()
    gather_compact_cpu(p["kv_cache"], p["block_table"], p["slot_idx"], p["selected"], p["n_sel"], p["n_sink"],
                       ckv, clen, kw.get("row_mask"), seq_lens=kw.get("seq_lens", p["seq_lens"]),
                       offset=kw.get("offset", p["offset"]), compact_table=p["compact_table"], native=native)
    return ckv, clen


@needs_native
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("layout,dtype,bs,d", CASES, ids=lambda c: str(c))
def test_matches_the_twin(layout, dtype, bs, d, paged):
    p = _problem(layout, dtype, bs, d, paged, torch.Generator().manual_seed(bs + d))
    ref = _run(p, False)
    got = (p["compact_kv"].clone(), p["compact_len"].clone())
    cap = compact_capacity(p["compact_kv"], p["compact_table"])
    assert cpu_native.gather_compact(p["kv_cache"], p["block_table"], p["slot_idx"], p["selected"], p["n_sel"],
                                     p["n_sink"], got[0], got[1], p["compact_table"], cap, None, p["seq_lens"],
                                     p["offset"]), "the compiled gather declined"
    assert torch.equal(got[1], ref[1])
    assert torch.equal(got[0], ref[0])
    assert not torch.equal(got[0], p["compact_kv"])          # it wrote something


@needs_native
def test_without_offsets_or_lengths_and_with_a_mask():
    p = _problem("vec", torch.bfloat16, 32, 64, True, torch.Generator().manual_seed(3))
    mask = torch.tensor([True, False, True, True, True])
    for kw in (dict(offset=None), dict(seq_lens=None, offset=None), dict(row_mask=mask)):
        if kw.get("seq_lens", 1) is None:
            p["selected"][3, 0, 5] = 7                        # no lengths: every position must exist
        ref, got = _run(p, False, **kw), _run(p, True, **kw)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), kw


@needs_native
def test_what_it_does_not_read_goes_to_the_twin():
    """A compact segment of another dtype than the pages: the wrapper declines, nothing written."""
    p = _problem("logical", torch.bfloat16, 16, 64, True, torch.Generator().manual_seed(4))
    ckv = p["compact_kv"].float()
    before = ckv.clone()
    assert not cpu_native.gather_compact(p["kv_cache"], p["block_table"], p["slot_idx"], p["selected"], p["n_sel"],
                                         4, ckv, p["compact_len"], p["compact_table"], 20, None, p["seq_lens"],
                                         p["offset"])
    assert torch.equal(ckv, before)
