"""Per-request state kept in KV-cache pages (``vllm_ext.kernels.paged_rows``): reads and writes
through a block table equal a dense ``[slots, *shape]`` table, on either page layout and with a
state dtype other than the cache's."""

from __future__ import annotations

import pytest
import torch

from vllm_ext.kernels.paged_rows import PagedRows, state_pages

H, BS, D = 3, 16, 8


def cache(layout: str, dtype, num_blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "head_major":                     # [blocks, H, tokens, 2D] contiguous (CPU build)
        return torch.randn(num_blocks, H, BS, 2 * D, generator=g).to(dtype)
    return torch.randn(num_blocks, BS, H, 2 * D, generator=g).to(dtype).transpose(1, 2)   # CUDA's


def table_of(slots, width, first, pages, num_blocks=40, seed=1):
    """Distinct blocks per slot in columns ``[first, first + pages)``; the other columns point at
    blocks no slot owns."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    table = torch.zeros(slots, width, dtype=torch.int32)
    table[:, first:first + pages] = perm[:slots * pages].view(slots, pages).to(torch.int32)
    return table


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("cache_dtype, dtype, shape", [
    (torch.bfloat16, torch.int32, (H, 50)),            # kept positions in a bf16 cache
    (torch.float32, torch.int32, (H, 7)),
    (torch.bfloat16, torch.bfloat16, (5, 2 * H, D)),   # prompt-tail queries
    (torch.float32, torch.float32, (9, 2 * H, D))])
def test_matches_dense_table(layout, cache_dtype, dtype, shape):
    kv = cache(layout, cache_dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    n = state_pages(int(torch.tensor(shape).prod()), dtype, (H, BS, 2 * D), cache_dtype)
    pages = kv.shape[1] * BS * 2 * D * kv.element_size()
    assert (n - 1) * pages < int(torch.tensor(shape).prod()) * esize <= n * pages
    slots, first = 4, 2
    table = table_of(slots, first + n + 1, first, n)
    rows = PagedRows(kv, table, first, shape, dtype, fill=-1)
    assert rows.num_pages == n and rows.shape == (slots, *shape)
    g = torch.Generator().manual_seed(3)
    dense = (torch.randint(-5, 1000, (slots, *shape), generator=g) if dtype == torch.int32 else
             torch.randn(slots, *shape, generator=g)).to(dtype)
    before = kv.clone()
    rows.index_copy_(0, torch.tensor([2, 0, 3, 1]), dense[[2, 0, 3, 1]])
    got = rows[torch.tensor([0, 1, 2, 3, -1])]
    assert torch.equal(got[:4], dense) and bool((got[4] == -1).all())
    assert torch.equal(rows[2], dense[2])
    # only the slots' own pages changed
    owned = table[:, first:first + n].flatten().long()
    other = torch.ones(kv.shape[0], dtype=torch.bool)
    other[owned] = False
    assert torch.equal(kv[other], before[other])
    # index_put_ along the leading axis (a prompt-tail window entry per write)
    slot = torch.tensor([1, 1, 3])
    lead = torch.tensor([0, shape[0] - 1, 1])
    vals = (torch.randint(0, 9, (3, *shape[1:]), generator=g) if dtype == torch.int32 else
            torch.randn(3, *shape[1:], generator=g)).to(dtype)
    rows.index_put_((slot, lead), vals)
    dense.index_put_((slot, lead), vals)
    assert torch.equal(rows[torch.arange(slots)], dense)


def test_refuses_a_table_too_narrow():
    kv = cache("head_major", torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        PagedRows(kv, torch.zeros(2, 3, dtype=torch.int32), 2, (H, 2 * BS * 2 * D), torch.float32)
