"""Quest-style page scores for the SFI selector (``sfi.selector = "quest"``; Tang et al. 2024).

Per KV page of ``page_size`` tokens the backend keeps the element-wise max and min of K
(:func:`vllm_ext.kernels.paged_state.update_block_representatives_paged` with ``Bk = page_size`` and
entry offset 0) in *bound pages*: the attention layer's page format ``[blocks, Hkv, bs, 2D]``, one
Quest page's bounds per token entry (max in ``[..., :D]``, min in ``[..., D:]``), addressed through a
per-slot table: Quest page ``j`` of slot ``s`` and KV head ``h`` is ``pages[table[s, j // bs], h, j % bs]``.
Inside vLLM the pages are blocks of SFI's Quest group (``vllm_ext.methods.sfi.quest_kv_spec``); outside it
(benchmarks, tests) :func:`contiguous_bound_pages` gives one block per slot and a trivial table. At a selection step the upper bound of a query's logit on any key of
page ``p`` is ``ub_g(p) = scale * sum_d max(q_gd * kmax_pd, q_gd * kmin_pd)``; the KV head's pages are
ranked by the max of that bound over the query heads of its GQA group (the tightest bound on the
group's largest logit on the page: a page that could hold the maximum of any head is kept).

Public function (Triton on CUDA / under ``TRITON_INTERPRET=1``, else the ``*_torch`` twin of the same
signature):

``quest_page_evidence(query, pages, table, scale, rows, rep_slot, lo, hi, page_size, out, *, count=None)``
    ``query``: ``[R, Hq, D]`` (one decode query per row); ``pages``: ``[blocks, Hkv, bs, 2D]`` (any
    float dtype, any strides), ``table``: int32 ``[slots, blocks per slot]`` (the bound pages, above:
    ``NB = blocks per slot x bs`` Quest pages per slot); ``rows``, ``rep_slot``, ``lo``, ``hi``: int32
    ``[S]`` per entry ``e``: the query row (``-1`` = unused entry), its table row and its allowed set
    ``[lo, hi)``; only pages before ``ceil(hi / page_size)`` are read (a request holds those);
    ``out``: fp32 ``[>= S, Hkv, L]``, the selector's 3-dim pooled log evidence. For every live entry
    writes ``out[e, h, j] = max_g ub_g(j // page_size)`` for ``j`` in ``[lo, hi)`` (each page's bound
    expanded to every token of the page, so the selector's top-K with ties to the lower position keeps
    whole pages) and ``-inf`` for ``j`` in ``[0, lo)``; positions ``>= hi`` (and past the page table) are left as
    they are (the selector masks them). Unused entries (``rows < 0``, or ``e >= count[0]`` with ``count``) touch
    nothing. Fixed grid (``S x Hkv x cdiv(L, pages per program * page_size)``), no host sync, no
    allocation: a CUDA graph can capture it.

fp8 pages (``kernels.kv_quant``): the bounds are kept in the pages' stored units (a max or min of
stored values is exact in the pages' dtype) and ``k_scale`` (the layer's, positive) multiplies the
bound here.

:func:`quest_selector_params` gives the constants the selector runs with in this mode (prior,
fusion, Soft-NMS, cross-head exclusivity and span made neutral); :func:`read_page_bounds` reads a
slot's bounds back (tests, CPU checks). Imports neither vLLM nor CUDA.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.selector_params import SelectorParams
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _quest_kernel(Q, PAGES, TABLE, ROWS, SLOT, LO, HI, COUNT, OUT, KS,
                      s_q_r, s_q_h, s_q_d,
                      s_c_p, s_c_h, s_c_n, s_c_d, s_t_s, s_t_b,
                      s_o_e, s_o_h, s_o_l,
                      scale, L, NB,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      PAGE: tl.constexpr, PAGE_PAD: tl.constexpr, BLOCK_PG: tl.constexpr,
                      SPAGE: tl.constexpr, HAS_COUNT: tl.constexpr, KV_SCALED: tl.constexpr):
        e = tl.program_id(0)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        row = tl.load(ROWS + e)
        live = row >= 0
        if HAS_COUNT:
            live = live & (e < tl.load(COUNT))
        lo = tl.load(LO + e)
        hi = tl.minimum(tl.load(HI + e), L)
        p0 = tile * BLOCK_PG
        if live & (p0 * PAGE < hi):
            slot = tl.load(SLOT + e).to(tl.int64)
            if KV_SCALED:
                scale = scale * tl.load(KS)
            offs_g = tl.arange(0, G_PAD)
            offs_d = tl.arange(0, D_PAD)
            gm = offs_g < G
            dm = offs_d < D
            qh = h * G + offs_g
            q = tl.load(Q + row.to(tl.int64) * s_q_r + qh[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                        mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)         # [G, D]
            pg = p0 + tl.arange(0, BLOCK_PG)
            pm = (pg < NB) & (pg * PAGE < hi)          # the pages the request holds bounds for
            blk = tl.load(TABLE + slot * s_t_s + (pg // SPAGE) * s_t_b, mask=pm, other=0).to(tl.int64)
            rp = PAGES + blk[:, None] * s_c_p + h.to(tl.int64) * s_c_h \
                + (pg % SPAGE).to(tl.int64)[:, None] * s_c_n + offs_d[None, :] * s_c_d
            m2 = pm[:, None] & dm[None, :]
            kmax = tl.load(rp, mask=m2, other=0.0).to(tl.float32)                            # [P, D]
            kmin = tl.load(rp + D * s_c_d, mask=m2, other=0.0).to(tl.float32)
            a = q[:, None, :] * kmax[None, :, :]                                             # [G, P, D]
            b = q[:, None, :] * kmin[None, :, :]
            ub = tl.sum(tl.maximum(a, b), axis=2) * scale                                    # [G, P]
            ub = tl.where(gm[:, None], ub, float("-inf"))
            score = tl.max(ub, axis=0)                                                       # [P]
            offs_i = tl.arange(0, PAGE_PAD)
            pos = pg[:, None] * PAGE + offs_i[None, :]                                       # [P, PAGE]
            wm = (offs_i[None, :] < PAGE) & (pos < hi) & pm[:, None]
            val = tl.where(pos >= lo, score[:, None] + tl.zeros([BLOCK_PG, PAGE_PAD], tl.float32),
                           float("-inf"))
            tl.store(OUT + e.to(tl.int64) * s_o_e + h.to(tl.int64) * s_o_h + pos.to(tl.int64) * s_o_l,
                     val, mask=wm)


def quest_selector_params(params: SelectorParams) -> SelectorParams:
    """The selector's constants in quest mode: the evidence is the page bound, and nothing may
    move a token away from its page's score (no prior, no fusion, no Soft-NMS, no cross-head
    exclusivity, no span), so the top-K keeps pages whole (ties: the lower position first)."""
    return dataclasses.replace(params, w_k=0.0, w_pos=0.0, lambda_max=0.0, mu=0.0, lam_x=0.0,
                               select_span=0, select_span_back=0)


def _check(query, pages, table, rows, out) -> None:
    if pages.dim() != 4 or pages.shape[3] % 2:
        raise ValueError(f"pages must be [blocks, Hkv, bs, 2D], got {tuple(pages.shape)}")
    if table.dim() != 2:
        raise ValueError(f"table must be [slots, blocks per slot], got {tuple(table.shape)}")
    hkv, d = pages.shape[1], pages.shape[3] // 2
    if query.dim() != 3 or query.shape[2] != d or query.shape[1] % hkv:
        raise ValueError(f"query must be [R, Hq, {d}] with Hq a multiple of {hkv}, got {tuple(query.shape)}")
    if out.dim() != 3 or out.dtype != torch.float32 or out.shape[0] < rows.shape[0] or out.shape[1] != hkv:
        raise ValueError(f"out must be fp32 [>= {rows.shape[0]}, {hkv}, L], got {out.dtype} {tuple(out.shape)}")


def _bounds(pages: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, num_pages: int):
    """The max and min of K of Quest pages ``0 .. num_pages - 1`` of each slot: ``[S, Hkv, P, D]``
    fp32 each (a gather through the table)."""
    bs, d = pages.shape[2], pages.shape[3] // 2
    j = torch.arange(num_pages, device=pages.device)
    blk = table.to(pages.device).long()[slots.long()][:, j // bs]                  # [S, P]
    r = pages[blk, :, (j % bs)[None, :].expand_as(blk)].float()                    # [S, P, Hkv, 2D]
    r = r.transpose(1, 2)                                                          # [S, Hkv, P, 2D]
    return r[..., :d], r[..., d:]


def read_page_bounds(pages: torch.Tensor, table: torch.Tensor, slots: torch.Tensor | list[int],
                     num_pages: int) -> torch.Tensor:
    """``[S, 2, num_pages, Hkv, D]`` fp32: the bounds (max, min) of Quest pages ``0 .. num_pages - 1``
    of each slot in ``slots``."""
    slots = torch.as_tensor(slots, device=pages.device)
    kmax, kmin = _bounds(pages, table, slots, num_pages)
    return torch.stack([kmax, kmin], dim=1).transpose(2, 3)


def contiguous_bound_pages(slots: int, num_pages: int, num_kv_heads: int, head_size: int,
                           dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound pages outside vLLM: one block of ``num_pages`` entries per slot, ``[slots, Hkv,
    num_pages, 2D]`` (zeros), and its table ``[slots, 1]`` (slot ``s`` holds block ``s``)."""
    pages = torch.zeros(slots, num_kv_heads, num_pages, 2 * head_size, dtype=dtype, device=device)
    return pages, torch.arange(slots, dtype=torch.int32, device=device)[:, None]


def page_capacity(pages: torch.Tensor, table: torch.Tensor) -> int:
    """The Quest pages a slot's table row addresses."""
    return table.shape[1] * pages.shape[2]


def quest_page_evidence_torch(query: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, scale: float,
                              rows: torch.Tensor, rep_slot: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                              page_size: int, out: torch.Tensor, *,
                              count: torch.Tensor | None = None,
                              k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`quest_page_evidence` (vectorised over the entries, no host sync)."""
    _check(query, pages, table, rows, out)
    s = rows.shape[0]
    if s == 0 or query.shape[0] == 0:
        return out
    dev = out.device
    if dev.type == "cpu":
        return _quest_page_evidence_cpu(query, pages, table, scale * kv_quant.host_scale(pages.dtype, k_scale),
                                        rows, rep_slot, lo, hi, page_size, out, count)
    ks = kv_quant.twin_scale(pages.dtype, k_scale)
    if ks is not None:
        scale = ks * scale
    hkv, d = pages.shape[1], pages.shape[3] // 2
    length = out.shape[2]
    nb = min(page_capacity(pages, table), -(-length // page_size))
    g = query.shape[1] // hkv
    e_idx = torch.arange(s, device=dev)
    live = rows.to(dev).long() >= 0
    if count is not None:
        live = live & (e_idx < count.to(dev).long()[0])
    q = query[rows.to(dev).long().clamp(0, query.shape[0] - 1)].float().reshape(s, hkv, g, d)
    kmax, kmin = _bounds(pages, table, rep_slot.to(dev).long().clamp(0, table.shape[0] - 1), nb)
    a = q[:, :, :, None, :] * kmax[:, :, None, :, :]                               # [S, H, G, NB, D]
    b = q[:, :, :, None, :] * kmin[:, :, None, :, :]
    score = (torch.maximum(a, b).sum(-1) * scale).amax(dim=2)                      # [S, H, NB]
    pos = torch.arange(length, device=dev)
    page = (pos // page_size).clamp_max(nb - 1)
    val = score[:, :, page]                                                        # [S, H, L]
    lo_ = lo.to(dev).long()[:, None, None]
    hi_ = hi.to(dev).long()[:, None, None]
    val = torch.where(pos[None, None, :] >= lo_, val, float("-inf"))
    write = live[:, None, None] & (pos[None, None, :] < hi_) & (pos < nb * page_size)[None, None, :]
    out[:s] = torch.where(write, val, out[:s])
    return out


def _quest_page_evidence_cpu(query, pages, table, scale, rows, rep_slot, lo, hi, page_size, out, count):
    """The twin on the CPU, where reading the plan costs nothing: per live entry, the pages before
    its ``hi`` only. ``max(q a, q b) = relu(q) max(a, b) + min(q, 0) min(a, b)`` term by term, so
    each page's bound is two small matmuls over D (the same terms; only the order of the sum over D
    differs from the elementwise form)."""
    s = rows.shape[0]
    if count is not None:
        s = max(0, min(s, int(count.reshape(-1)[0])))
    hkv, d = pages.shape[1], pages.shape[3] // 2
    nb, length = page_capacity(pages, table), out.shape[2]
    g = query.shape[1] // hkv
    row_l, slot_l, lo_l, hi_l = rows[:s].tolist(), rep_slot[:s].tolist(), lo[:s].tolist(), hi[:s].tolist()
    for e in range(s):
        row = row_l[e]
        if row < 0:
            continue
        end = min(hi_l[e], length, nb * page_size)           # positions [0, end) are written
        if end <= 0:
            continue
        start = max(min(lo_l[e], end), 0)
        n_pg = -(-end // page_size)
        q = query[min(row, query.shape[0] - 1)].float().reshape(hkv, g, d)            # [H, G, D]
        slot = torch.tensor([min(max(slot_l[e], 0), table.shape[0] - 1)])
        kmax, kmin = _bounds(pages, table, slot, n_pg)                                # [1, H, P, D]
        a, b = kmax[0].transpose(1, 2), kmin[0].transpose(1, 2)                       # [H, D, P]
        ub = (torch.matmul(q.clamp_min(0), torch.maximum(a, b))
              + torch.matmul(q.clamp_max(0), torch.minimum(a, b)))                      # [H, G, P]
        score = (ub * scale).amax(dim=1)                                              # [H, P]
        dst = out[e]
        if start:
            dst[:, :start] = float("-inf")
        if end > start:
            dst[:, start:end] = score.repeat_interleave(page_size, dim=1)[:, start:end]
    return out


def quest_page_evidence_triton(query: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, scale: float,
                               rows: torch.Tensor, rep_slot: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                               page_size: int, out: torch.Tensor, *,
                               count: torch.Tensor | None = None,
                               k_scale: torch.Tensor | None = None) -> torch.Tensor:
    _check(query, pages, table, rows, out)
    s = rows.shape[0]
    if s == 0 or query.shape[0] == 0:
        return out
    hkv, d = pages.shape[1], pages.shape[3] // 2
    nb = page_capacity(pages, table)
    g = query.shape[1] // hkv
    length = out.shape[2]
    d_pad, g_pad = max(16, next_pow2(d)), max(1, next_pow2(g))
    # pages per program: keep the [G, P, D] products near 8K elements
    block_pg = max(1, min(64, 8192 // (g_pad * d_pad)))
    block_pg = 1 << (block_pg.bit_length() - 1)
    n_tiles = triton.cdiv(triton.cdiv(length, page_size), block_pg)
    ks, _, kv_scaled = kv_quant.launch_scales(pages.dtype, k_scale, k_scale, out)   # no V read
    _quest_kernel[(s, hkv, n_tiles)](
        query, pages, table, rows, rep_slot, lo, hi, count if count is not None else rows, out, ks,
        *query.stride(), *pages.stride(), *table.stride(), *out.stride(),
        float(scale), length, nb,
        G=g, G_PAD=g_pad, D=d, D_PAD=d_pad, PAGE=page_size, PAGE_PAD=max(2, next_pow2(page_size)),
        BLOCK_PG=block_pg, SPAGE=pages.shape[2], HAS_COUNT=count is not None, KV_SCALED=kv_scaled,
    )
    return out


def quest_page_evidence(query: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, scale: float,
                        rows: torch.Tensor, rep_slot: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                        page_size: int, out: torch.Tensor, *, count: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quest page bounds as the selector's pooled log evidence (see the module docstring); ``k_scale``:
    the layer's, for fp8 pages."""
    fn = quest_page_evidence_triton if use_triton(query) else quest_page_evidence_torch
    return fn(query, pages, table, scale, rows, rep_slot, lo, hi, page_size, out, count=count, k_scale=k_scale)


def page_count(max_len: int, page_size: int) -> int:
    """Pages per request for ``max_len`` tokens."""
    return -(-int(max_len) // int(page_size))
