"""``sfi.copy_ngram``'s device ops on a paged token history (``vllm_ext.kernels.token_history``: the
history in KV-cache pages through a per-slot block table, as vLLM's history group holds it): the
same histories at other block ids, on either page layout and cache dtype, give the flags of the
contiguous history; recording writes each token at its page address and nothing else; the Triton
kernels (the interpreter on the CPU) equal the twins; ``row_from`` never lets unrecorded positions
match."""

import random

import pytest
import torch

from vllm_ext.kernels.copy_match import copy_match, copy_match_torch, record_tokens, record_tokens_torch
from vllm_ext.kernels.token_history import TokenHistory, history_pages
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton

from test_copy_match import _history, _step, reference_copy

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
needs_triton = pytest.mark.skipif(not (HAS_TRITON and use_triton(DEVICE)),
                                  reason="needs CUDA or the Triton interpreter")
H, BS, D = 2, 16, 4               # fp32 page: 2 x 16 x 8 -> E = 256 int32 positions; bf16: 128


def page_memory(layout: str, dtype, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A layer's page memory ``[blocks, H, block_size, 2D]`` full of other bytes (another request's
    KV): head-major contiguous (the CPU build) or token-major transposed (CUDA's layout)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "head_major":
        return torch.randn(num_blocks, H, BS, 2 * D, generator=g).to(dtype)
    return torch.randn(num_blocks, BS, H, 2 * D, generator=g).to(dtype).transpose(1, 2)


def paged_copy(contiguous: torch.Tensor, layout: str, dtype, seed: int = 1) -> TokenHistory:
    """The histories of ``contiguous [slots, max_len]`` at scattered, distinct blocks of a page memory
    (block 0 and the unused blocks keep their bytes)."""
    slots, max_len = contiguous.shape
    e = H * BS * 2 * D * torch.empty((), dtype=dtype).element_size() // 4
    width = history_pages(max_len, e)
    num_blocks = slots * width + 7
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    table = perm[:slots * width].view(slots, width).to(torch.int32)
    hist = TokenHistory(page_memory(layout, dtype, num_blocks), table, max_len)
    assert hist.page_elems == e
    s = torch.arange(slots)[:, None].expand(slots, max_len)
    p = torch.arange(max_len)[None, :].expand(slots, max_len)
    hist.pages[hist.locate(s, p)] = contiguous
    return hist


LAYOUTS = [("head_major", torch.float32), ("token_major", torch.float32), ("token_major", torch.bfloat16)]


@pytest.mark.parametrize("layout, dtype", LAYOUTS)
def test_read_returns_what_was_placed(layout, dtype):
    hist, _ = _history(random.Random(3), 4, 700, [700, 300, 5, 0], vocab=50)
    paged = paged_copy(hist, layout, dtype)
    assert paged.table.shape[1] > 1                  # several pages per slot
    assert torch.equal(paged.read(torch.arange(5)), hist)
    assert torch.equal(paged.read(2), hist[2])


@pytest.mark.parametrize("layout, dtype", LAYOUTS)
@pytest.mark.parametrize("m, n_sink, n_recent, max_matches", [(2, 4, 8, 0), (3, 4, 8, 1), (5, 0, 0, 2)])
def test_paged_flags_equal_contiguous_flags(layout, dtype, m, n_sink, n_recent, max_matches):
    rng = random.Random(m + n_recent)
    lens = [600, 37, 300, 5, 2, 599, 257]
    hist, streams = _history(rng, len(lens), 600, lens, vocab=4)
    paged = paged_copy(hist, layout, dtype)
    slot = torch.tensor(list(range(len(lens))) + [-1], dtype=torch.int32)
    seq = torch.tensor(lens + [40], dtype=torch.int32)
    active = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.int32)
    kw = dict(n_sink=n_sink, n_recent=n_recent, ngram=m, max_matches=max_matches)
    want = copy_match_torch(hist, seq, slot, active, torch.zeros(8, dtype=torch.int32), **kw)
    got = copy_match_torch(paged, seq, slot, active, torch.full((8,), 7, dtype=torch.int32), **kw)
    assert got.tolist() == want.tolist()
    ref = [int(bool(active[r]) and int(slot[r]) >= 0 and
               reference_copy(streams[int(slot[r])], int(seq[r]), n_sink, n_recent, m, max_matches))
           for r in range(8)]
    assert want.tolist() == ref


@pytest.mark.parametrize("layout, dtype", LAYOUTS)
def test_paged_record_writes_each_token_at_its_address_and_nothing_else(layout, dtype):
    rng = random.Random(11)
    q_lens, computed = [300, 1, 3, 1, 0], [0, 255, 254, 511, 4]   # across page boundaries
    ids, qsl, seq = _step(rng, q_lens, computed)
    slot = torch.tensor([2, 0, 1, 3, -1], dtype=torch.int32)
    contiguous = torch.full((5, 520), -1, dtype=torch.int32)
    paged = paged_copy(contiguous.clone(), layout, dtype)
    before = paged.pages.clone()
    record_tokens_torch(contiguous, ids, qsl, seq, slot, 300)
    record_tokens_torch(paged, ids, qsl, seq, slot, 300)
    assert torch.equal(paged.read(torch.arange(5)), contiguous)
    used = torch.zeros(paged.pages.shape[0], dtype=torch.bool)
    used[paged.table.long().flatten()] = True
    assert torch.equal(paged.pages[~used], before[~used])          # other blocks untouched


@needs_triton
@pytest.mark.parametrize("layout, dtype", LAYOUTS)
@pytest.mark.parametrize("q_lens, computed, max_q_len", [
    ([300, 1, 3, 1, 0], [0, 255, 254, 511, 4], 300),
    ([1, 1, 1, 1, 1], [10, 0, 255, 62, 7], 1)])
def test_paged_record_kernel_equals_twin(layout, dtype, q_lens, computed, max_q_len):
    rng = random.Random(sum(q_lens))
    ids, qsl, seq = _step(rng, q_lens, computed)
    slot = torch.tensor([2, 0, 1, 3, -1], dtype=torch.int32)
    twin = paged_copy(torch.full((5, 520), -1, dtype=torch.int32), layout, dtype)
    kern = TokenHistory(twin.pages.clone().to(DEVICE), twin.table.to(DEVICE), twin.max_len)
    record_tokens_torch(twin, ids, qsl, seq, slot, max_q_len)
    record_tokens(kern, ids.to(DEVICE), qsl.to(DEVICE), seq.to(DEVICE), slot.to(DEVICE), max_q_len)
    assert torch.equal(kern.pages.cpu().view(torch.int32), twin.pages.view(torch.int32))


@needs_triton
@pytest.mark.parametrize("layout, dtype", LAYOUTS)
@pytest.mark.parametrize("m, n_sink, n_recent, max_matches", [(2, 4, 8, 0), (3, 4, 8, 1), (8, 2, 16, 3)])
@pytest.mark.parametrize("with_from", [False, True])
def test_paged_match_kernel_equals_twin(layout, dtype, m, n_sink, n_recent, max_matches, with_from):
    rng = random.Random(m * 7 + n_recent)
    lens = [600, 37, 300, 5, 2, 599, 257]
    hist, _ = _history(rng, len(lens), 600, lens, vocab=3)
    paged = paged_copy(hist, layout, dtype)
    dev = TokenHistory(paged.pages.to(DEVICE), paged.table.to(DEVICE), paged.max_len)
    slot = torch.tensor(list(range(len(lens))) + [-1], dtype=torch.int32)
    seq = torch.tensor(lens + [40], dtype=torch.int32)
    active = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.int32)
    row_from = torch.tensor([0, 3, 260, 0, 0, 0, 250, 0], dtype=torch.int32) if with_from else None
    prev = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.int32)
    kw = dict(n_sink=n_sink, n_recent=n_recent, ngram=m, max_matches=max_matches)
    twin_prev = prev.clone()
    twin = copy_match_torch(paged, seq, slot, active, torch.zeros(8, dtype=torch.int32), prev=twin_prev,
                            row_from=row_from, **kw)
    kern_prev = prev.clone().to(DEVICE)
    kern = copy_match(dev, seq.to(DEVICE), slot.to(DEVICE), active.to(DEVICE),
                      torch.full((8,), 7, dtype=torch.int32, device=DEVICE), prev=kern_prev,
                      row_from=None if row_from is None else row_from.to(DEVICE), **kw)
    assert kern.cpu().tolist() == twin.tolist()
    assert kern_prev.cpu()[:7].tolist() == twin_prev[:7].tolist()


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_triton)])
def test_positions_before_row_from_never_match(use_kernel):
    """A span that occurs only before the row's first recorded position does not count (those
    positions hold another request's bytes in a reused page), and a tail reaching before it is not
    active; from 0 the same row fires."""
    toks = list(range(1000, 1200))
    toks[10:13] = [5, 6, 7]
    toks[197:200] = [5, 6, 7]                                    # the tail copies positions 10-12
    hist = torch.full((2, 256), -1, dtype=torch.int32)
    hist[0, :200] = torch.tensor(toks, dtype=torch.int32)
    paged = paged_copy(hist, "token_major", torch.float32)
    if use_kernel:
        paged = TokenHistory(paged.pages.to(DEVICE), paged.table.to(DEVICE), paged.max_len)
    op = copy_match if use_kernel else copy_match_torch

    def flag(first: int) -> int:
        out = torch.zeros(1, dtype=torch.int32, device=paged.pages.device)
        t = torch.tensor([200], dtype=torch.int32, device=out.device)
        op(paged, t, torch.tensor([0], dtype=torch.int32, device=out.device),
           torch.ones(1, dtype=torch.int32, device=out.device), out, n_sink=4, n_recent=8, ngram=3,
           row_from=torch.tensor([first], dtype=torch.int32, device=out.device))
        return int(out[0])

    assert flag(0) == 1 and flag(10) == 1
    assert flag(11) == 0                                         # the span starts before it
    assert flag(197) == 0 and flag(198) == 0         # nothing recorded before the tail; a tail before it
