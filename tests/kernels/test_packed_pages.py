"""PackedPages: vLLM CPU_ATTN's packed KV pages (vec: K transposed per page; amx: K and V in VNNI
pairs) read as the logical cache.

- the packing itself, as PackedPages understands it, and as vLLM's own write op produces it (the
  contract the CPU build relies on before it uses the format);
- every paged_reference primitive reads and writes the same entries through PackedPages as through
  the logical tensor;
- the CPU twins the SFI / CritiPrefill paths run give bit-identical results on both formats.
"""

import math

import pytest
import torch

from kernel_testlib import (FP8, blocks_needed, fp8_rows, fp8_scales, make_block_table, make_kv_cache,
                            make_sfi_rows)
from vllm_ext.kernels.kv_quant import as_bytes
from vllm_ext.kernels import paged_reference as pr
from vllm_ext.kernels.packed_pages import PackedPages, index_blocks, layout_matches

CASES = [(16, 64, torch.bfloat16), (32, 64, torch.float32), (16, 32, torch.float16)]
ISAS = ["vec", "amx"]


def pack(kv: torch.Tensor, isa: str = "vec") -> PackedPages:
    """A PackedPages holding the entries of a logical cache (any strides); an fp8 cache packed into
    a ``uint8`` allocation (vLLM's) read through its fp8 view."""
    nb, h, bs, c = kv.shape
    d = c // 2
    if kv.element_size() == 1:
        pages = PackedPages(torch.empty(nb, h, bs, c, dtype=torch.uint8).view(kv.dtype), isa)
    else:
        pages = PackedPages(torch.empty(nb, h, bs, c, dtype=kv.dtype), isa)
    pages.k.copy_(kv[..., :d])
    pages.v.copy_(kv[..., d:])
    return pages


def logical(view) -> torch.Tensor:
    """Every block of a K or V view (a tensor or a PageView), in the logical layout."""
    return view.index_select(0, torch.arange(view.shape[0]))


def _cache(bs, d, dtype, seed=0, nb=9, h=2):
    gen = torch.Generator().manual_seed(seed)
    return make_kv_cache("LBHNC", nb, h, bs, d, dtype, device="cpu", gen=gen), gen


@pytest.mark.parametrize("bs,d,dtype", CASES)
def test_page_is_k_transposed_then_v(bs, d, dtype):
    kv, _ = _cache(bs, d, dtype)
    pages = pack(kv)
    for b, h in ((0, 0), (4, 1), (8, 1)):
        flat = pages.raw[b, h].reshape(-1)
        torch.testing.assert_close(flat[:bs * d].view(d, bs), kv[b, h, :, :d].T, rtol=0, atol=0)
        torch.testing.assert_close(flat[bs * d:].view(bs, d), kv[b, h, :, d:], rtol=0, atol=0)
    # CPU_ATTN's own arguments: K pages then V pages, [blocks, Hkv, block_size, D] each
    assert pages.key_cache.shape == pages.value_cache.shape == (kv.shape[0], kv.shape[1], bs, d)
    assert pages.value_cache.data_ptr() - pages.key_cache.data_ptr() == bs * d * kv.element_size()


@pytest.mark.parametrize("bs,d", [(32, 64), (16, 32), (64, 128)])
def test_amx_page_is_vnni_pairs(bs, d):
    """The amx packing element by element, from its definition: K as [bs/16][D/2][16 tokens][2 dims],
    then V as [D/16][bs/2][16 dims][2 tokens]."""
    kv, _ = _cache(bs, d, torch.float32)
    pages = pack(kv, "amx")
    t = torch.arange(bs)[:, None]
    i = torch.arange(d)[None, :]
    k_off = (t // 16) * 16 * d + (i // 2) * 32 + (t % 16) * 2 + i % 2
    v_off = bs * d + (i // 16) * 16 * bs + (t // 2) * 32 + (i % 16) * 2 + t % 2
    assert torch.equal(torch.sort(torch.cat([k_off.flatten(), v_off.flatten()])).values,
                       torch.arange(2 * bs * d))                    # a permutation of the page
    for b, h in ((0, 0), (4, 1), (8, 1)):
        flat = pages.raw[b, h].reshape(-1)
        assert torch.equal(flat[k_off], kv[b, h, :, :d]) and torch.equal(flat[v_off], kv[b, h, :, d:])


def test_amx_packing_refuses_sizes_it_cannot_hold():
    with pytest.raises(ValueError, match="multiples of 16"):
        PackedPages(torch.zeros(2, 1, 24, 128), "amx")
    with pytest.raises(ValueError, match="packings"):
        PackedPages(torch.zeros(2, 1, 32, 128), "neon")


def test_page_view_refuses_what_it_cannot_read():
    pages = pack(_cache(16, 64, torch.float32)[0], "amx")
    with pytest.raises(IndexError):
        pages.k[0, :, 1:3]                          # tokens by slice
    with pytest.raises(IndexError):
        pages.k[..., 0]
    with pytest.raises(AttributeError):
        pages.k.stride(0)                           # not a strided tensor: nothing reads raw strides


def _vllm_cpu_ops():
    try:
        from vllm import _custom_ops as ops
        return ops if hasattr(torch.ops._C, "cpu_attn_reshape_and_cache") else None
    except Exception:                                   # noqa: BLE001 - no vLLM CPU build here
        return None


@pytest.mark.parametrize("isa,bs", [("vec", 32), ("vec16", 16), ("vec16", 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_vllm_cpu_attn_writes_what_packed_pages_reads(isa, bs, dtype):
    """The contract with vLLM's CPU build: its write op stores K/V where PackedPages reads them
    (the backend checks the same at its first forward before it uses the format)."""
    ops = _vllm_cpu_ops()
    if ops is None:
        pytest.skip("needs vLLM's CPU build (cpu_attn ops)")

    def write(k, v, kc, vc, slots):
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")

    assert layout_matches(write, bs, 64, dtype)


@pytest.mark.parametrize("spelling,fmt", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                          ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllm_cpu_attn_fp8_writes_what_packed_pages_reads(spelling, fmt, dtype):
    """The contract on an fp8 cache (x86 with AVX-512 or AMX, where vLLM's CPU build takes one): the
    vec packing a byte an element. vLLM's CPU write rounds toward zero (torch's conversion to
    nearest), so the check writes fp8 values; a write that moved them would still fail it."""
    ops = _vllm_cpu_ops()
    if ops is None:
        pytest.skip("needs vLLM's CPU build (cpu_attn ops)")
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("FP8 KV cache on CPU requires x86 with AVX-512 or AMX (vLLM's condition)")

    def write(k, v, kc, vc, slots):
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=spelling)

    assert layout_matches(write, 32, 64, dtype, cache_dtype=fmt)

    def shifted(k, v, kc, vc, slots):                        # one token further into the page
        write(k, v, kc, vc, slots + 1)

    assert not layout_matches(shifted, 32, 64, dtype, cache_dtype=fmt)


@pytest.mark.parametrize("bs", [32, 64, 128])
@pytest.mark.parametrize("d", [64, 128])
def test_vllm_cpu_attn_amx_writes_what_packed_pages_reads(bs, d):
    """The same contract for the amx packing (bf16, block sizes that are multiples of 32: where
    vLLM picks it), on a CPU with AMX tiles."""
    ops = _vllm_cpu_ops()
    if ops is None:
        pytest.skip("needs vLLM's CPU build (cpu_attn ops)")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("needs a CPU with AMX tiles (vLLM's amx ISA)")

    def write(k, v, kc, vc, slots):
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "amx", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")

    assert layout_matches(write, bs, d, torch.bfloat16, "amx")
    assert not layout_matches(write, bs, d, torch.bfloat16, "vec")     # the check tells them apart


def test_layout_check_rejects_another_packing():
    """The start-up check fails on a write that stores the logical layout (K not transposed)."""
    def logical_write(k, v, kc, vc, slots):
        nb, h, bs, d = kc.shape
        raw = kc.as_strided((nb, h, bs, 2 * d), (h * 2 * bs * d, 2 * bs * d, 2 * d, 1),
                            kc.storage_offset())
        pr.write_kv(raw, k, v, slots)

    assert not layout_matches(logical_write, 16, 64, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bs,d,dtype", CASES)
def test_primitives_read_the_same_entries(bs, d, dtype, isa):
    kv, gen = _cache(bs, d, dtype)
    pages = pack(kv, isa)
    nb, h = kv.shape[:2]
    ks, vs = pr.split_kv(pages)
    assert torch.equal(logical(ks), kv[..., :d]) and torch.equal(logical(vs), kv[..., d:])
    blocks = torch.randint(0, nb, (7,), generator=gen)
    heads = torch.randint(0, h, (7,), generator=gen)
    offs = torch.randint(0, bs, (7,), generator=gen)
    assert torch.equal(pages[blocks, :, offs], kv[blocks, :, offs])
    assert torch.equal(pages[blocks, heads, offs], kv[blocks, heads, offs])
    assert torch.equal(pages[3], kv[3])
    assert torch.equal(pages.index_select(0, blocks), kv.index_select(0, blocks))
    for width, start in ((None, 0), (d, 0), (d, d), (d // 2, d // 4), (d, d // 2)):
        assert torch.equal(pr.gather_entries(pages, blocks[:, None], heads[None, :2], offs[:, None],
                                             width, start),
                           pr.gather_entries(kv, blocks[:, None], heads[None, :2], offs[:, None],
                                             width, start)), (width, start)
    row = torch.randperm(nb, generator=gen).to(torch.int32)
    pos = torch.tensor([0, 3, bs, 2 * bs + 1, 5 * bs - 1])
    for a, b in zip(pr.gather_kv(pages, row, pos), pr.gather_kv(kv, row, pos)):
        assert torch.equal(a, b)
    length = 4 * bs - 3
    for a, b in zip(pr.gather_prefix(pages, row, length), pr.gather_prefix(kv, row, length)):
        assert torch.equal(a, b)
    # runs of consecutive blocks, and scattered blocks (one index_select)
    for table in (torch.arange(nb, dtype=torch.int32), row):
        got = [t.clone() for t in pr.gather_prefix_into(pages, table, length, torch.float32)]
        want = pr.gather_prefix_into(kv, table, length, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bs,d,dtype", CASES)
def test_write_kv_stores_the_same_entries(bs, d, dtype, isa):
    kv, gen = _cache(bs, d, dtype)
    pages = pack(kv, isa)
    n = 2 * bs + 3
    key = torch.randn(n + 2, kv.shape[1], d, generator=gen).to(dtype)
    value = torch.randn(n + 2, kv.shape[1], d, generator=gen).to(dtype)
    slots = torch.randperm(kv.shape[0] * bs, generator=gen)[:n]
    slots[4] = -1                                       # vLLM's padding slot: skipped
    pr.write_kv(kv, key, value, slots)
    pr.write_kv(pages, key, value, slots)
    assert torch.equal(logical(pages.k), kv[..., :d]) and torch.equal(logical(pages.v), kv[..., d:])


@pytest.mark.parametrize("isa", ISAS)
def test_dense_paged_attention_is_the_same_on_both_formats(isa):
    bs, d, g = 16, 64, 3
    kv, gen = _cache(bs, d, torch.float32, nb=20)
    pages = pack(kv, isa)
    lens = [37, 70, 1]
    bt = make_block_table(lens, bs, 6, kv.shape[0], gen)
    q_lens = [1, 9, 1]                                   # decode, a chunk after a prefix, decode
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    query = torch.randn(qsl[-1], g * kv.shape[1], d, generator=gen)
    outs = []
    for cache in (kv, pages):
        out = torch.zeros_like(query)
        pr.dense_paged_attention(query, cache, bt, qsl, lens, 1 / math.sqrt(d), out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sfi_cpu_twins_are_the_same_on_both_formats(dtype, isa):
    from vllm_ext.kernels.dense_decode_evidence import dense_decode_with_evidence_cpu
    from vllm_ext.kernels.gather_compact import gather_compact_cpu
    from vllm_ext.kernels.two_segment_decode import two_segment_decode_cpu

    rows = make_sfi_rows(seq_lens=[70, 33, 120, 0], active=[True, True, False, True], g=3, hkv=2,
                         d=64, bs=16, dtype=dtype, layout="LBHNC", n_recent=20, k=12, seed=3)
    pages = pack(rows.kv_cache, isa)
    results = []
    for cache in (rows.kv_cache, pages):
        out = torch.zeros_like(rows.query)
        two_segment_decode_cpu(rows.query, cache, rows.block_table, rows.seq_lens, rows.recent_start,
                               rows.compact_kv, rows.compact_len, rows.slot_idx, rows.scale, out,
                               rows.row_mask, max_recent=20)        # the twin (the compiled pass: its own test)
        ckv = torch.zeros_like(rows.compact_kv)
        clen = torch.zeros_like(rows.compact_len)
        gather_compact_cpu(cache, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel, rows.n_sink,
                           ckv, clen, rows.row_mask, seq_lens=rows.seq_lens)
        dense = torch.zeros_like(rows.query)
        ev = torch.full((4, 2, 128), 7.0)
        kn = torch.full((4, 2, 128), 7.0)
        lo = torch.full((4,), 4, dtype=torch.int32)
        dense_decode_with_evidence_cpu(rows.query, cache, rows.block_table, rows.seq_lens, lo,
                                       rows.recent_start, rows.scale, dense, ev, rows.row_mask,
                                       evidence_rows=torch.tensor([2, 0, -1, 1], dtype=torch.int32),
                                       key_norms=kn)
        results.append((out, ckv, clen, dense, ev, kn))
    for a, b, what in zip(*results, ("two-segment", "compact", "compact_len", "dense", "evidence",
                                     "key norms")):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_cpu_twins_are_the_same_on_both_formats(fmt, isa):
    """fp8 pages in CPU_ATTN's packings (a uint8 allocation read as fp8) with the layer's scales:
    the SFI CPU twins, the dense reference and the reference's write give the same bytes and values
    as on the logical fp8 cache."""
    from vllm_ext.kernels.dense_decode_evidence import dense_decode_with_evidence_cpu
    from vllm_ext.kernels.gather_compact import gather_compact_cpu
    from vllm_ext.kernels.two_segment_decode import two_segment_decode_cpu

    base = make_sfi_rows(seq_lens=[70, 33, 120, 0], active=[True, True, False, True], g=3, hkv=2,
                         d=64, bs=16, dtype=torch.float32, layout="LBHNC", n_recent=20, k=12, seed=4)
    rows, _ = fp8_rows(base, FP8[fmt], 0.5, 3.0, torch.bfloat16)
    ks, vs = fp8_scales(0.5, 3.0, "cpu")
    pages = pack(rows.kv_cache, isa)
    results = []
    for cache in (rows.kv_cache, pages):
        out = torch.zeros_like(rows.query)
        two_segment_decode_cpu(rows.query, cache, rows.block_table, rows.seq_lens, rows.recent_start,
                               rows.compact_kv, rows.compact_len, rows.slot_idx, rows.scale, out,
                               rows.row_mask, max_recent=20, k_scale=ks, v_scale=vs)
        ckv = torch.zeros_like(rows.compact_kv)
        clen = torch.zeros_like(rows.compact_len)
        gather_compact_cpu(cache, rows.block_table, rows.slot_idx, rows.selected, rows.n_sel, rows.n_sink,
                           ckv, clen, rows.row_mask, seq_lens=rows.seq_lens)
        dense = torch.zeros_like(rows.query)
        ev = torch.full((4, 2, 128), 7.0)
        kn = torch.full((4, 2, 128), 7.0)
        lo = torch.full((4,), 4, dtype=torch.int32)
        dense_decode_with_evidence_cpu(rows.query, cache, rows.block_table, rows.seq_lens, lo,
                                       rows.recent_start, rows.scale, dense, ev, rows.row_mask,
                                       evidence_rows=torch.tensor([2, 0, -1, 1], dtype=torch.int32),
                                       key_norms=kn, k_scale=ks, v_scale=vs)
        ref = torch.zeros_like(rows.query)
        pr.dense_paged_attention(rows.query, cache, rows.block_table, list(range(5)), [70, 33, 120, 0],
                                 rows.scale, ref, k_scale=ks, v_scale=vs)
        key = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(1)) * 3
        pr.write_kv(cache, key, -key, torch.tensor([5, 17, 40]), k_scale=ks, v_scale=vs)
        written = cache[torch.tensor([0, 1, 2]), :, torch.tensor([5, 1, 8])]
        results.append((out, as_bytes(ckv), clen, dense, ev, kn, ref, as_bytes(written)))
    for a, b, what in zip(*results, ("two-segment", "compact", "compact_len", "dense", "evidence",
                                     "key norms", "reference", "write")):
        assert torch.equal(a, b), what


def test_layout_check_reads_an_fp8_cache_through_its_view():
    """The start-up check on an fp8 cache: the write gets vLLM's uint8 allocation and stores the
    quantised values; the check reads them through the fp8 view (a write in the logical layout
    still fails it)."""
    def packed_write(k, v, kc, vc, slots):       # the vec packing, K transposed per page, as bytes
        nb, h, bs, d = kc.shape
        raw = kc.as_strided((nb, h, bs, 2 * d), (h * 2 * bs * d, 2 * bs * d, 2 * d, 1), kc.storage_offset())
        pages = PackedPages(raw.view(torch.float8_e4m3fn))
        pr.write_kv(pages, k, v, slots, k_scale=1.0, v_scale=1.0)

    def logical_write(k, v, kc, vc, slots):
        nb, h, bs, d = kc.shape
        raw = kc.as_strided((nb, h, bs, 2 * d), (h * 2 * bs * d, 2 * bs * d, 2 * d, 1), kc.storage_offset())
        pr.write_kv(raw.view(torch.float8_e4m3fn), k, v, slots)

    assert layout_matches(packed_write, 16, 64, torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    assert not layout_matches(logical_write, 16, 64, torch.bfloat16, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("isa", ISAS)
def test_block_representatives_are_the_same_on_both_formats(isa):
    from vllm_ext.kernels.block_representatives import (block_representatives_torch,
                                                        update_block_representatives_from_torch)

    bs = 16
    kv, gen = _cache(bs, 64, torch.bfloat16, nb=24)
    pages = pack(kv, isa)
    lens = [100, 33]
    bt = make_block_table(lens, bs, 8, kv.shape[0], gen)
    seq = torch.tensor(lens, dtype=torch.int32)
    a = block_representatives_torch(kv, bt, seq, 32, 4)
    b = block_representatives_torch(pages, bt, seq, 32, 4)
    assert torch.equal(a, b)
    first = torch.tensor([1, 0], dtype=torch.int32)
    slot = torch.tensor([1, 0], dtype=torch.int32)
    reps = [torch.zeros(3, 2, 4, 2, 64) for _ in range(2)]
    for cache, r in zip((kv, pages), reps):
        update_block_representatives_from_torch(cache, bt, seq, first, 32, r, slot)
    assert torch.equal(reps[0], reps[1])
    assert blocks_needed(lens, bs) <= kv.shape[0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bs,d,dtype", CASES)
def test_gather_prefix_kt_is_the_prefix_transposed(bs, d, dtype, isa):
    """The slow step's gather (K transposed + V, fp32) equals gather_prefix on both formats, for a
    table of consecutive blocks and for a fragmented one (more runs than one copy each is worth)."""
    kv, gen = _cache(bs, d, dtype, nb=48)
    pages = pack(kv, isa)
    length = 40 * bs - 5
    for table in (torch.arange(48, dtype=torch.int32), torch.randperm(48, generator=gen).to(torch.int32)):
        k, v = pr.gather_prefix(kv, table, length)
        for cache in (kv, pages):
            kt, vv = pr.gather_prefix_kt_into(cache, table, length, torch.float32)
            assert torch.equal(kt, k.float().transpose(1, 2)) and torch.equal(vv, v.float())
            kt, vv = pr.gather_prefix_kt_into(cache, table, length, torch.float32, values=False)
            assert torch.equal(kt, k.float().transpose(1, 2)) and vv is None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bs,d,dtype", CASES)
def test_index_blocks_is_index_select(bs, d, dtype, isa):
    """Whole-page gathers of K (transposed per page, gathered on the transposed view), V and the
    logical cache equal ``index_select``, and so does ``PackedPages.index_select``."""
    kv, gen = _cache(bs, d, dtype, nb=20)
    pages = pack(kv, isa)
    idx = torch.randperm(20, generator=gen)[:13]
    for view in (pages.k, pages.v, kv):
        got = index_blocks(view, idx)
        assert got.shape == view.index_select(0, idx).shape and torch.equal(got, view.index_select(0, idx))
    assert torch.equal(pages.index_select(0, idx), kv.index_select(0, idx))
