"""CritiPrefill's block-sparse prefill on the CPU build, attended by ``CPU_ATTN``'s own prefill kernel.

Each segment of one layer's sub-batch becomes a request of one of two calls of the kernel
(:mod:`vllm_ext.kernels.cpu_attn_ops`):

- **dense**: each run of consecutive dense segments of a row (the prompt's head before ``min_len``, its
  last segment, a row without state pages) is a cut of that row: its queries over the row's own
  pages, up to the run's last position;
- **sparse**: each sparse segment is a request over a page list of its own, in a scratch copy (same
  packing and dtype; :func:`scratch_layout`): the selected blocks of each KV head, then the segment's
  own keys from its start, copied in runs of the criticality block or the cache page, the smaller. With the segment's queries at the end of that list the kernel's causal rule is the
  segment's exact mask (every selected key, its own keys up to each query). The heads share the page
  list, not its content: head ``h``'s copy holds head ``h``'s selection.

A segment whose selection holds every earlier block is dense (the same keys). The selected blocks'
order does not matter (RoPE is in the cached keys). So every attention FLOP runs in the kernel the
dense prefill runs, and the sparse segments cost a copy of the keys they read (their budget and
their own keys: about ``2 * (budget + segment) * Hkv * D`` elements, against ``segment * (budget +
segment) * Hq * D`` multiply-adds).

:func:`attend_segments` returns ``False`` where it does not apply (pages not in ``CPU_ATTN``'s
packing, a page size and block size of which neither divides the other, heads of one segment
selecting different numbers of blocks); the caller then runs the compiled pass. Host reads of the plan are free on the
CPU build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.kernels import cpu_attn_ops, kv_quant
from vllm_ext.kernels.packed_pages import PACKED_ISAS, PackedPages
from vllm_ext.kernels.page_copy import copy_runs

_SCRATCH: dict[tuple, torch.Tensor] = {}
SCRATCH_BYTES = 64 << 20          # one call's scratch pages at most (unless one segment needs more)


def scratch_layout(page_size: int, block_size: int, isa: str) -> tuple[int, int] | None:
    """``(run, scratch page)``: the copy's unit, the smaller of the criticality block and the cache
    page when one divides the other, and the scratch pages' size, the smallest multiple of it that
    ``CPU_ATTN`` takes (32 tokens, or 16 in the vec16 packing; the amx packing moves tokens in groups
    of 16). ``None``: no such layout."""
    run = min(page_size, block_size)
    if max(page_size, block_size) % run or (isa == "amx" and run % 16):
        return None
    least = 16 if isa == "vec16" else 32
    if run % least == 0:
        return run, run
    return (run, least) if least % run == 0 else None


@dataclass
class SegmentCalls:
    """One layer's two calls, on the host: ``dense`` runs ``(row, first token, end token, key end)``
    and ``sparse`` segments ``(row, segment row, first token, end token, segment start, key end,
    selected blocks)`` (tokens relative to the sub-batch's query)."""

    dense: list
    sparse: list


def split_segments(plan, query_start_loc: list[int], seq_lens: list[int]) -> SegmentCalls | None:
    """The sub-batch's segments as dense runs and sparse segments (``None``: a sparse segment whose
    KV heads selected different numbers of blocks)."""
    sq, bk = plan.segment_size, plan.block_size
    dense_flags = plan.dense.tolist()
    first, count = plan.first_segment.tolist(), plan.num_segments.tolist()
    nmin, nmax = plan.num_sel.amin(-1).tolist(), plan.num_sel.amax(-1).tolist()
    dense, sparse = [], []
    for i, seq in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        if qe <= qs:
            continue
        ctx = seq - (qe - qs)
        for s in range(count[i]):
            s0 = (first[i] + s) * sq
            p_lo, p_hi = max(ctx, s0), min(seq, s0 + sq)
            if p_hi <= p_lo:
                continue
            lo, hi = qs + p_lo - ctx, qs + p_hi - ctx
            if dense_flags[i][s] or nmin[i][s] >= s0 // bk:
                if dense and dense[-1][0] == i and dense[-1][2] == lo:
                    dense[-1][2:] = [hi, p_hi]
                else:
                    dense.append([i, lo, hi, p_hi])
            elif nmin[i][s] != nmax[i][s]:
                return None
            else:
                sparse.append((i, s, lo, hi, s0, p_hi, nmax[i][s]))
    return SegmentCalls(dense, sparse)


def _scratch(pages: PackedPages, unit: int, num_pages: int) -> PackedPages:
    """The scratch pages (kept between calls, grown when a step needs more)."""
    raw = pages.raw
    key = (raw.dtype, raw.shape[1], unit, raw.shape[3], pages.isa, raw.device)
    have = _SCRATCH.get(key)
    if have is None or have.shape[0] < num_pages:
        have = torch.empty((max(num_pages, 2 * (0 if have is None else have.shape[0])),
                            raw.shape[1], unit, raw.shape[3]), dtype=raw.dtype, device=raw.device)
        _SCRATCH[key] = have
    return PackedPages(have, pages.isa)


def _requests(runs: list, tokens_of) -> tuple[torch.Tensor | slice, torch.Tensor]:
    """The query rows (a slice when they are one run, else token indices) and ``query_start_loc``
    (int32) of requests whose token ranges are ``tokens_of(r)``."""
    spans = [tokens_of(r) for r in runs]
    qsl = torch.zeros(len(spans) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor([hi - lo for lo, hi in spans], dtype=torch.int32), 0, out=qsl[1:])
    if all(spans[i][0] == spans[i - 1][1] for i in range(1, len(spans))):
        return slice(spans[0][0], spans[-1][1]), qsl
    return torch.cat([torch.arange(lo, hi) for lo, hi in spans]), qsl


def _call(query, output, tok, qsl, seq, table, pages, scale, kv_dtype, ks, vs) -> None:
    hq, d = query.shape[1], query.shape[2]
    sched = cpu_attn_ops.scheduler_metadata(num_heads=hq, num_kv_heads=pages.shape[1], head_size=d,
                                            seq_lens=seq, query_start_loc=qsl, dtype=query.dtype,
                                            isa=pages.isa, kv_cache_dtype=kv_dtype)
    k_cache, v_cache = cpu_attn_ops.vllm_caches(pages)
    whole = isinstance(tok, slice)
    q = query[tok] if whole else query.index_select(0, tok)
    out = output[tok] if whole else torch.empty_like(q)
    cpu_attn_ops.attend(q, k_cache, v_cache, out, qsl, seq, table, scale, scheduler=sched,
                        kv_cache_dtype=kv_dtype, k_scale=ks, v_scale=vs)
    if not whole:
        output.index_copy_(0, tok, out)


def attend_segments(query: torch.Tensor, pages, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, plan, scale: float, *, output: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> bool:
    """The sub-batch's block-sparse prefill of one layer (``block_sparse_prefill``'s contract: rows
    ``query_start_loc[0]:query_start_loc[R]`` of ``output``) through ``CPU_ATTN``'s kernel; ``False``
    (nothing written) where it does not apply."""
    if not isinstance(pages, PackedPages) or pages.isa not in PACKED_ISAS or not cpu_attn_ops.available():
        return False
    layout = scratch_layout(pages.shape[2], plan.block_size, pages.isa)
    if layout is None:
        return False
    qsl_h, seq_h = query_start_loc.tolist(), seq_lens.tolist()
    calls = split_segments(plan, qsl_h, seq_h)
    if calls is None:
        return False
    kv_dtype = cpu_attn_ops.kv_cache_dtype_of(pages.dtype)
    ks, vs = kv_quant.host_scale(pages.dtype, k_scale), kv_quant.host_scale(pages.dtype, v_scale)
    if calls.dense:
        tok, qsl = _requests(calls.dense, lambda r: (r[1], r[2]))
        rows = torch.tensor([r[0] for r in calls.dense], dtype=torch.long)
        seq = torch.tensor([r[3] for r in calls.dense], dtype=torch.int32)
        _call(query, output, tok, qsl, seq, block_table.index_select(0, rows), pages, scale, kv_dtype, ks, vs)
    for group in _groups(calls.sparse, pages, plan, layout):
        _attend_sparse(query, pages, block_table, plan, group, layout, scale, output, kv_dtype, ks, vs)
    return True


def _groups(segs: list, pages: PackedPages, plan, layout: tuple[int, int]):
    """The sparse segments in calls whose scratch stays under :data:`SCRATCH_BYTES` (a long prompt's
    chunk holds dozens of segments; the bound keeps the copy out of the cache sizes vLLM planned)."""
    run, scratch_page = layout
    page_bytes = pages.raw[:1].numel() * pages.raw.element_size() * scratch_page // pages.shape[2]
    group, used = [], 0
    for seg in segs:
        s0, p_hi, n = seg[4], seg[5], seg[6]
        need = -(-(n * plan.block_size + p_hi - s0 + run) // scratch_page) * page_bytes
        if group and used + need > SCRATCH_BYTES:
            yield group
            group, used = [], 0
        group.append(seg)
        used += need
    if group:
        yield group


def _attend_sparse(query, pages: PackedPages, block_table, plan, segs: list, layout: tuple[int, int],
                   scale: float, output, kv_dtype: str, ks: float, vs: float) -> None:
    """The sparse segments: each one's keys copied, run by run, into scratch pages of its own, then
    one call."""
    run, scratch_page = layout
    bk, page = plan.block_size, pages.shape[2]
    per_block, per_page = bk // run, scratch_page // run
    hkv = pages.shape[1]
    rows_t = torch.tensor([s[0] for s in segs], dtype=torch.long)
    seg_t = torch.tensor([s[1] for s in segs], dtype=torch.long)
    n_max = max(s[6] for s in segs)
    sel = plan.sel_blocks[rows_t, seg_t, :, :n_max].long()                       # [M, Hkv, n]
    sub = torch.arange(per_block)
    runs, owners, slots, tables, tails = [], [], [], [], []
    base = 0
    for m, (row, _, _, _, s0, p_hi, n) in enumerate(segs):
        chosen = (sel[m, :, :n, None] * per_block + sub).reshape(hkv, n * per_block).T     # [n*r, Hkv]
        own = torch.arange(s0 // run, -(-p_hi // run))[:, None].expand(-1, hkv)
        runs.append(torch.cat([chosen, own]))
        count = runs[-1].shape[0]
        owners.append(torch.full((count,), row, dtype=torch.long))
        slots.append(torch.arange(base, base + count))
        n_pages = -(-count // per_page)
        tables.append(torch.arange(base // per_page, base // per_page + n_pages))
        if count % per_page:
            tails.append(base // per_page + n_pages - 1)
        base += n_pages * per_page
    runs_t, owner_t = torch.cat(runs), torch.cat(owners)                         # [N, Hkv], [N]
    start_tok = runs_t * run
    src_pages = block_table.long()[owner_t[:, None], start_tok // page]
    scratch = _scratch(pages, scratch_page, base // per_page)
    if tails:
        # the kernel reads a request's last page whole (it masks the scores past its length): the slots
        # this call leaves empty must hold finite values, whatever an earlier call left there
        scratch.raw.view(torch.uint8)[torch.tensor(tails)] = 0
    copy_runs(pages, scratch, src_pages, (start_tok % page) // run, torch.cat(slots), run)
    width = max(t.shape[0] for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for m, t in enumerate(tables):
        table[m, :t.shape[0]] = t
    seq = torch.tensor([n * bk + (p_hi - s0) for (_, _, _, _, s0, p_hi, n) in segs], dtype=torch.int32)
    tok, qsl = _requests(segs, lambda s: (s[2], s[3]))
    _call(query, output, tok, qsl, seq, table, scratch, scale, kv_dtype, ks, vs)
