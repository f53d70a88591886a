"""CritiPrefill's per-request state in pages of vLLM's KV cache (``vllm_ext.kernels.paged_state``):
the Triton kernels and their PyTorch twins against each other and against the whole-prompt reference,
on the grid of ``test_incremental_reps`` (page size, key block size, dtype) and both cache layouts.
A row without pages (its table row is stale, here pointing at another row's pages) writes nothing."""

import pytest
import torch

from helpers import make_batch, make_cache
from vllm_ext.methods.critiprefill.state_layout import state_pages
from vllm_ext.kernels.block_representatives import block_representatives_torch
from vllm_ext.kernels.paged_state import (
    read_state_entries,
    update_block_representatives_paged_torch,
    update_block_representatives_paged_triton,
    write_state_entries_torch,
    write_state_entries_triton,
)
from vllm_ext.kernels.triton_utils import HAS_TRITON

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
IMPLS = ["torch", "triton"]
G = 3                                  # carry entries before the key blocks


def _skip(impl):
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")


def _state(num_rows, pages_per_row, hkv, spage, d, dtype, layout, seed):
    """A state cache full of NaN with disjoint shuffled pages per row; the last row's table is stale
    (row 0's pages): it must never be written through."""
    g = torch.Generator().manual_seed(seed)
    total = num_rows * pages_per_row + 4
    perm = torch.randperm(total, generator=g)
    cache = make_cache(total, hkv, spage, d, dtype, layout, device=DEV)
    cache.fill_(float("nan"))
    table = perm[:num_rows * pages_per_row].view(num_rows, pages_per_row).to(torch.int32)
    table[-1] = table[0]
    return cache, table.to(DEV)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page,bk,dtype", [(16, 32, torch.bfloat16), (32, 16, torch.float32),
                                           (16, 48, torch.float16)])
def test_chunked_paged_updates_equal_the_whole_prompt(impl, layout, page, bk, dtype):
    _skip(impl)
    update = {"torch": update_block_representatives_paged_torch,
              "triton": update_block_representatives_paged_triton}[impl]
    seqs = [301, 130, 77, 200]
    chunks = [[100, 37, 1, 130, 33], [64, 66], [77], [200]]   # mid-block, one-token, aligned cuts
    b = make_batch(seqs, [1] * 4, hq=2, hkv=2, d=32, page=page, dtype=dtype, seed=bk, layout=layout,
                   device=DEV)
    hkv, d = 2, 32
    spage = page
    per_row = state_pages(max(seqs), G, bk, spage)
    state, table = _state(4, per_row, hkv, spage, d, dtype, layout, seed=page + bk)
    stale = table[0].clone()
    done = [0] * 4
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)   # noqa: E731
    for step in range(max(len(c) for c in chunks)):
        seq, first = [], []
        for i in range(4):
            live = step < len(chunks[i]) and i < 3            # row 3 never holds pages
            ctx = done[i]
            if step < len(chunks[i]):
                done[i] += chunks[i][step]
            seq.append(done[i])
            first.append(ctx // bk if live else -(-done[i] // bk))
        blocks = max(-(-s // bk) - f for s, f in zip(seq, first))
        update(b.kv_cache, b.block_table, t(seq), t(first), bk, blocks, state, table, G)
    whole = block_representatives_torch(b.kv_cache.cpu(), b.block_table.cpu(), b.seq_lens.cpu(), bk,
                                        -(-max(seqs) // bk))
    for i in range(3):
        n = -(-seqs[i] // bk)
        got = read_state_entries(state, table[i:i + 1], G, n)[0].float().cpu()      # [n, Hkv, 2D]
        assert torch.equal(got[..., :d], whole[i, 0, :n]) and torch.equal(got[..., d:], whole[i, 1, :n])
        assert torch.isnan(read_state_entries(state, table[i:i + 1], 0, G).float()).all()   # carry untouched
        rest = per_row * spage - G - n
        if rest:
            assert torch.isnan(read_state_entries(state, table[i:i + 1], G + n, rest).float()).all()
    assert torch.equal(table[3], stale)
    used = set(table[:3].flatten().tolist())
    for p in range(state.shape[0]):
        if p not in used:
            assert torch.isnan(state[p].float()).all()      # no page outside the rows' own


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_entries_twin_equals_triton_and_reads_back(layout, dtype):
    _skip("triton")
    hkv, d, spage = 2, 32, 16
    g = torch.Generator().manual_seed(5)
    values = torch.randn(3, G, hkv, 2 * d, generator=g).to(dtype).to(DEV)
    first = torch.tensor([0, 14, 0], dtype=torch.int32, device=DEV)          # row 1 crosses a page
    num = torch.tensor([G, G, 0], dtype=torch.int32, device=DEV)             # row 2: no pages
    out = {}
    for impl, fn in (("torch", write_state_entries_torch), ("triton", write_state_entries_triton)):
        state, table = _state(3, 2, hkv, spage, d, dtype, layout, seed=9)
        fn(state, table, first, num, values)
        out[impl] = state
        for i in range(2):
            got = read_state_entries(state, table[i:i + 1], first[i:i + 1], G)[0]
            assert torch.equal(got, values[i])
        n_written = (~torch.isnan(state.float())).sum().item()
        assert n_written == 2 * G * hkv * 2 * d                # row 2 wrote nothing
    assert torch.equal(out["torch"].nan_to_num(7.0), out["triton"].nan_to_num(7.0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_dtype, query_dtype", [
    (torch.float8_e4m3fn, torch.bfloat16), (torch.uint8, torch.float32), (torch.float8_e5m2, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_the_query_carry_round_trips_exactly_through_pages_of_any_dtype(impl, page_dtype, query_dtype):
    """The carry (a segment's query max and min, in the query's dtype) is stored as its bytes over
    ``state_layout.carry_entries`` entries of the state pages, whatever their dtype (an fp8 page, as
    vLLM allocates it: uint8 or its fp8 view), and reads back bit for bit; the key blocks' entries
    start after it."""
    from vllm_ext.methods.critiprefill.path import _carry_to_entries, _entries_to_carry
    from vllm_ext.methods.critiprefill.state_layout import carry_entries

    _skip(impl)
    write = write_state_entries_torch if impl == "torch" else write_state_entries_triton
    hq, hkv, d, spage, rows = 6, 2, 32, 4, 3
    c = carry_entries(hq, hkv, query_dtype.itemsize, page_dtype.itemsize)
    assert c == (hq // hkv) * -(-query_dtype.itemsize // page_dtype.itemsize)
    g = torch.Generator().manual_seed(11)
    carry = (torch.randn(2, rows, hq, d, generator=g) * 40).to(query_dtype)       # (max, min) per head
    pages_per_row = -(-(c + 2) // spage)
    state = torch.zeros(rows * pages_per_row + 1, hkv, spage, 2 * d, dtype=torch.uint8, device=DEV)
    state = state.view(page_dtype) if page_dtype.itemsize == 1 else \
        torch.zeros(rows * pages_per_row + 1, hkv, spage, 2 * d, dtype=page_dtype, device=DEV)
    table = torch.randperm(rows * pages_per_row, generator=g).view(rows, pages_per_row).to(torch.int32).to(DEV)
    as_bytes = state.view(torch.uint8)
    entries = _carry_to_entries(carry.float().to(DEV), hkv, query_dtype, as_bytes.shape[-1])
    assert entries.shape == (rows, c, hkv, as_bytes.shape[-1]) and entries.dtype == torch.uint8
    zero = torch.zeros(rows, dtype=torch.int32, device=DEV)
    write(as_bytes, table, zero, torch.full((rows,), c, dtype=torch.int32, device=DEV), entries)
    back = _entries_to_carry(read_state_entries(as_bytes, table, 0, c), hq // hkv, query_dtype, d)
    assert torch.equal(back.to(query_dtype).cpu(), carry.permute(1, 0, 2, 3))   # [R, 2, Hq, D], bit for bit
    # the first key block's entry (entry c) is untouched by the carry
    first_key = read_state_entries(as_bytes, table, c, 1)
    assert (first_key == 0).all()
