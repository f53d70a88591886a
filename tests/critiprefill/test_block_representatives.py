"""Block representatives (per criticality block max / min of K) vs the twin and a gather_kv reference."""

import itertools

import pytest
import torch

from helpers import make_batch
from vllm_ext.kernels.block_representatives import (
    block_representatives,
    block_representatives_torch,
    block_representatives_triton,
)
from vllm_ext.kernels.paged_reference import gather_kv
from vllm_ext.kernels.triton_utils import HAS_TRITON

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")   # numpy, inside triton's interpreter


def reference(b, bk, nb):
    r = len(b.seq_list)
    hkv, d = b.kv_cache.shape[1], b.kv_cache.shape[-1] // 2
    out = torch.zeros(r, 2, nb, hkv, d)
    kv, bt = b.kv_cache.cpu(), b.block_table.cpu()
    for i, s in enumerate(b.seq_list):
        k, _ = gather_kv(kv, bt[i], torch.arange(s))          # [H, s, D]
        for blk in range(nb):
            a, e = blk * bk, min(s, (blk + 1) * bk)
            if a < e:
                out[i, 0, blk] = k[:, a:e].float().amax(1)
                out[i, 1, blk] = k[:, a:e].float().amin(1)
    return out


SEQS = [1, 32, 33, 95]


def _run(page, bk, layout, dtype, seqs=SEQS, hkv=2, d=64):
    b = make_batch(seqs, [1] * len(seqs), hq=hkv, hkv=hkv, d=d, page=page, dtype=dtype, layout=layout, seed=page + bk)
    nb = -(-max(seqs) // bk) + 1                                      # one block past the longest request
    ref = reference(b, bk, nb)
    twin = block_representatives_torch(b.kv_cache, b.block_table, b.seq_lens, bk, nb)
    torch.testing.assert_close(twin, ref, rtol=0, atol=0)             # max / min are exact
    if HAS_TRITON:
        bd = make_batch(seqs, [1] * len(seqs), hq=hkv, hkv=hkv, d=d, page=page, dtype=dtype, layout=layout,
                        seed=page + bk, device=DEV)
        tri = block_representatives_triton(bd.kv_cache, bd.block_table, bd.seq_lens, bk, nb)
        torch.testing.assert_close(tri.cpu(), ref, rtol=0, atol=0)
        assert torch.equal(block_representatives(bd.kv_cache, bd.block_table, bd.seq_lens, bk, nb).cpu(), ref)
    return ref


@needs_triton
@pytest.mark.parametrize("page,bk", [(16, 16), (16, 32), (32, 32), (64, 32), (32, 64), (64, 16)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_block_representatives_grid(page, bk, layout):
    dtype = torch.bfloat16 if layout == "NHD" else torch.float32
    ref = _run(page, bk, layout, dtype)
    # blocks past the end are 0; a partial last block covers only the keys that exist
    assert torch.all(ref[0, :, 1:] == 0)
    assert torch.all(ref[:, 0] >= ref[:, 1])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_block_representatives_dtypes_head128(dtype):
    _run(32, 32, "NHD", dtype, seqs=[65, 7], hkv=1, d=128)


def test_twin_dispatch_without_triton(monkeypatch):
    monkeypatch.setenv("SPEEDSFI_FORCE_TORCH_KERNELS", "1")
    b = make_batch([40, 9], [1, 1], hq=1, hkv=1, d=16, page=16)
    got = block_representatives(b.kv_cache, b.block_table, b.seq_lens, 32, 2)
    torch.testing.assert_close(got, reference(b, 32, 2), rtol=0, atol=0)


@pytest.mark.parametrize("page,bk,layout,dtype", [
    (p, k, l, t) for p, k, l, t in itertools.product((16, 32, 64), (16, 32, 64), ("NHD", "HND"),
                                                       (torch.float16, torch.bfloat16, torch.float32))])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_representatives_cuda_grid(page, bk, layout, dtype):
    _run(page, bk, layout, dtype, seqs=[1, 511, 512, 513, 4097, 3000], hkv=4, d=128)


# ------------------------------------------------------------------------------- query side
from vllm_ext.kernels.block_representatives import (  # noqa: E402
    query_segment_representatives,
    query_segment_representatives_torch,
    query_segment_representatives_triton,
)


def query_reference(b, sq, s_max):
    r = len(b.seq_list)
    hq, d = b.query.shape[1:]
    out = torch.zeros(2, r, s_max, hq, d)
    qsl = b.query_start_loc.cpu().tolist()
    for i, seq in enumerate(b.seq_list):
        ctx = seq - b.q_lens[i]
        q = b.query[qsl[i]:qsl[i + 1]].cpu().float()
        for s in range(s_max):
            j = ctx // sq + s
            lo, hi = max(ctx, j * sq), min(seq, (j + 1) * sq)
            if lo < hi:
                out[0, i, s] = q[lo - ctx:hi - ctx].amax(0)
                out[1, i, s] = q[lo - ctx:hi - ctx].amin(0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_segment_representatives(dtype):
    # mid-segment chunk start, single-token chunk, segment boundaries +-1, padding rows with garbage
    seqs, qls = [300, 97, 129, 64], [100, 1, 129, 63]
    b = make_batch(seqs, qls, hq=4, hkv=2, d=64, page=16, dtype=dtype, pad_tokens=5)
    b.query[-5:] = 1e4
    ref = query_reference(b, 64, 4)
    twin = query_segment_representatives_torch(b.query, b.query_start_loc, b.seq_lens, 64, 4)
    assert torch.equal(twin, ref)
    if HAS_TRITON:
        bd = make_batch(seqs, qls, hq=4, hkv=2, d=64, page=16, dtype=dtype, pad_tokens=5, device=DEV)
        bd.query[-5:] = 1e4
        tri = query_segment_representatives_triton(bd.query, bd.query_start_loc, bd.seq_lens, 64, 4)
        assert torch.equal(tri.cpu(), ref)
        assert torch.equal(query_segment_representatives(bd.query, bd.query_start_loc, bd.seq_lens, 64, 4).cpu(),
                           ref)
