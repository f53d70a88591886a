"""The CPU dense path's pieces against plain definitions: ``write_kv`` (one ``index_copy_`` over whole
entries where the layout allows, advanced indexing otherwise) and ``dense_paged_attention`` (decode
rows, whole-sequence prefill, and a chunk after a cached prefix as two flash passes merged by
log-sum-exp) vs the masked einsum of ``attention_over``."""

from __future__ import annotations

import pytest
import torch

from vllm_ext.kernels import paged_reference as P

B, H, N, D, HQ = 24, 3, 16, 8, 9


def _cache(layout: str, dtype=torch.float32) -> torch.Tensor:
    if layout == "LBNHC":
        return torch.zeros(B, N, H, 2 * D, dtype=dtype).transpose(1, 2)
    if layout == "LBHNC":
        return torch.zeros(B, H, N, 2 * D, dtype=dtype)
    return torch.zeros(B, H, N, 4 * D, dtype=dtype)[..., :2 * D]          # entries not dense


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_indexing(layout, dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = _cache(layout, dtype), _cache(layout, dtype)
    assert (P._entries_view(a) is None) == (layout == "sparse")
    for n in (1, 5, 40):
        key, value = torch.randn(n + 2, H, D, generator=gen), torch.randn(n + 2, H, D, generator=gen)
        slots = torch.randperm(B * N, generator=gen)[:n]
        if n == 5:
            slots[2] = -1                                                   # PAD_SLOT_ID
        P.write_kv(a, key, value, slots)
        keep = slots >= 0
        blk, off = slots[keep] // N, slots[keep] % N
        b[blk, :, off, :D] = key[:n][keep].to(dtype)
        b[blk, :, off, D:] = value[:n][keep].to(dtype)
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("q_len,seq", [(1, 200), (1, 7), (60, 200), (200, 200), (2, 3), (17, 300)])
def test_dense_paged_attention_matches_masked_einsum(layout, q_len, seq):
    gen = torch.Generator().manual_seed(q_len * 1000 + seq)
    kv = _cache(layout, torch.bfloat16)
    kv.copy_(torch.randn(kv.shape, generator=gen).to(torch.bfloat16))
    bt = torch.randperm(B, generator=gen).int()[None]                     # scattered blocks
    q = torch.randn(q_len, HQ, D, generator=gen).to(torch.bfloat16)
    out = torch.zeros(q_len + 1, HQ, D)                                    # one padded row past the queries
    P.dense_paged_attention(q, kv, bt, [0, q_len], [seq], 0.3, out)
    k, v = P.gather_prefix(kv, bt[0], seq)
    qpos = torch.arange(seq - q_len, seq)
    ref, _ = P.attention_over(q, k, v, 0.3, torch.arange(seq)[None, :] <= qpos[:, None])
    torch.testing.assert_close(out[:q_len], ref, rtol=0, atol=2e-6)
    assert torch.all(out[q_len] == 0)
