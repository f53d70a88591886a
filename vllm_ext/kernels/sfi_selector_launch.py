"""The SFI Selector's Triton path on the host: argument checks and the launches of
:mod:`vllm_ext.kernels.sfi_selector_kernels` (steps and grids: :mod:`vllm_ext.kernels.sfi_selector`)."""

from __future__ import annotations

import math

import torch

from vllm_ext.kernels import sfi_selector_kernels as _k
from vllm_ext.kernels.paged_rows import PagedRows
from vllm_ext.kernels.selector_params import SelectorParams, output_width
from vllm_ext.kernels.sfi_selector_workspace import (NUM_BUCKETS, SelectorWorkspace, _gw, _halos, _tile_t1,
                                                     _tile_t2, check_workspace, heads_pad, selector_workspace,
                                                     ws_tiles)
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, num_sms, with_strides


def _int_arg(t: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    if t.device != device:                         # a copy (allocation) only when on another device
        t = t.to(device)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {t.dtype}")
    return t


def _row_stride(t: torch.Tensor, rows: int, name: str) -> int:
    if t.dim() == 0 or t.numel() == 1:
        return 0
    if t.dim() != 1 or t.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}], got {tuple(t.shape)}")
    return t.stride(0)


def _prepare(evidence: torch.Tensor, key_norms: torch.Tensor):
    if not HAS_TRITON:                                       # pragma: no cover
        raise RuntimeError("triton is not installed")
    if key_norms.dim() != 3:
        raise ValueError(f"key_norms must be [rows, Hkv, L], got {tuple(key_norms.shape)}")
    rows, heads, length = key_norms.shape
    if evidence.dim() not in (3, 4):
        raise ValueError(f"evidence must be [rows, Hkv, R, L] or [rows, Hkv, L], got {tuple(evidence.shape)}")
    if evidence.shape[:2] != (rows, heads) or evidence.shape[-1] != length:
        raise ValueError(f"evidence {tuple(evidence.shape)} does not match key_norms {tuple(key_norms.shape)}")
    return rows, heads, length


class _Args:
    """Per-call scalars shared by the launches."""

    def __init__(self, lo, hi, k, k_val, k_min, width, k_tensor, rows, heads, length, params, ws, span,
                 skip_all, count=None, span_back=0):
        self.lo, self.hi, self.k = lo, hi, k
        self.s_lo = _row_stride(lo, rows, "lo")
        self.s_hi = _row_stride(hi, rows, "hi")
        self.s_k = _row_stride(k, rows, "k") if k_tensor else 0
        self.k_val, self.k_min, self.width, self.k_tensor = k_val, k_min, width, k_tensor
        self.rows, self.heads, self.length, self.params, self.ws = rows, heads, length, params, ws
        self.h_pad = heads_pad(heads)
        self.span, self.span_back = span, span_back
        self.skip_all = skip_all
        self.count = count
        self.has_count = count is not None
        self.progs = 2 * num_sms(ws.device)

    def grid(self, per_row: int) -> tuple[int]:
        """1-D grid of a launch whose work is ``per_row`` items per row: one program per item of every
        row without ``count``; with it a fixed grid (at most ``2 x SMs`` programs) that walks only the
        items of the live rows ``[0, count)`` (read on the device)."""
        total = max(1, self.rows * int(per_row))
        return (total,) if self.count is None else (min(total, self.progs),)

    def live(self) -> tuple:
        """The kernels' leading ``COUNT, ROWS`` (``COUNT`` is never read without ``count``)."""
        return (self.count if self.count is not None else self.lo, self.rows)

    def bounds(self) -> tuple:
        return (self.lo, self.s_lo, self.hi, self.s_hi)

    def per_row(self) -> tuple:
        """The bounds and the budget: ``lo, s_lo, hi, s_hi, k, s_k, k_val, k_min, width``."""
        return (*self.bounds(), self.k, self.s_k, self.k_val, self.k_min, self.width)


def _pool(evidence: torch.Tensor, a: _Args) -> torch.Tensor:
    """4-D evidence -> pooled unnormalised log f ``[rows, heads, L_ws]`` (the workspace's, allocated
    on first use)."""
    ws = a.ws
    if ws.pooled is None:
        ws.pooled = torch.empty((ws.rows, ws.heads, max(ws.length, 1)), dtype=torch.float32, device=ws.device)
    out = ws.pooled
    n_rows = evidence.shape[2]
    r_pad = max(2, next_pow2(n_rows))
    alpha = float(a.params.alpha)
    _k._pool_kernel[a.grid(a.heads)](
        *a.live(), *with_strides(evidence), *with_strides(out, 2), *a.bounds(),
        a.heads, a.length, n_rows, math.log(max(n_rows, 1)), alpha, 1.0 / alpha,
        R_PAD=r_pad, BLOCK_L=max(16, min(1024, 4096 // r_pad)), HAS_COUNT=a.has_count)
    return out[:a.rows, :, :a.length]


def _scores(evidence: torch.Tensor, key_norms: torch.Tensor, a: _Args, prep_topk: bool) -> None:
    """Steps 0-3: the final scores into ``ws.score`` (positions of A only), ``lam`` into ``ws.consts``."""
    ws, p, tiles = a.ws, a.params, ws_tiles(a.ws)
    if evidence.dim() == 4:
        evidence = _pool(evidence, a)
    inputs = (*with_strides(evidence), *with_strides(key_norms), *a.per_row())
    prior = (float(p.gamma_k), float(p.w_k), float(p.w_pos), float(p.pos_power), float(p.pos_eta),
             float(p.pos_beta), float(p.eps))
    # steps 1-3 have no inner loop: their item loop is the innermost one, and num_stages=1 keeps the
    # compiler from software-pipelining it (prefetching the next item's tiles)
    t1 = _tile_t1(a.heads, tiles)
    c1 = -(-a.length // t1)
    c1_ws = ws.stats.shape[2]
    _k._stats_kernel[a.grid(c1)](
        *a.live(), c1, *inputs, ws.stats, c1_ws, a.heads, a.length, *prior,
        T=t1, H_PAD=a.h_pad, K_TENSOR=a.k_tensor, SKIP_ALL=a.skip_all, HAS_COUNT=a.has_count,
        num_warps=tiles.warps_stats, num_stages=1)
    _k._merge_kernel[a.grid(a.heads)](
        *a.live(), ws.stats, c1_ws, ws.consts, ws.hist, ws.cand_cnt, *a.per_row(), a.heads, a.length,
        float(p.lambda_max), float(p.eps),
        T1=t1, C1_PAD=max(2, next_pow2(c1_ws)), NB=NUM_BUCKETS, K_TENSOR=a.k_tensor, SKIP_ALL=a.skip_all,
        PREP_TOPK=prep_topk, WRITE_LAM=not prep_topk, HAS_COUNT=a.has_count, num_warps=tiles.warps_row,
        num_stages=1)
    halo_l, halo_r, do_nms = _halos(p, a.span, a.span_back)
    t2 = _tile_t2(a.heads, halo_l, halo_r, tiles)
    out_per = t2 - halo_l - halo_r
    c2 = -(-a.length // out_per)
    radius = int(p.nms_radius) if do_nms else 0
    do_x = a.heads > 2 and p.lam_x != 0.0
    sc = ws.score
    if tiles.gather:
        scr = sc                                   # not read
    else:
        need = a.rows * c2 * a.h_pad * t2
        if ws.scratch is None or ws.scratch.numel() < need:
            ws.scratch = torch.empty(need, dtype=torch.float32, device=ws.device)
        scr = ws.scratch
    _k._score_kernel[a.grid(c2)](
        *a.live(), c2, *inputs, ws.consts, *with_strides(sc, 2), scr, a.heads, a.length, *prior,
        float(p.mu), 1.0 / float(p.cross_head_temperature), float(p.lam_x), math.log(p.eps),
        T=t2, H_PAD=a.h_pad, RADIUS=radius, SPAN=a.span, SPAN_BACK=a.span_back, HALO_L=halo_l, HALO_R=halo_r,
        OUT=out_per, DO_NMS=do_nms, DO_X=do_x, NMS_GW=_gw(radius, radius), SPAN_GW=_gw(a.span, a.span_back),
        NMS_KL=(2 * radius + 1).bit_length() - 1, SPAN_KL=(a.span + a.span_back + 1).bit_length() - 1,
        K_TENSOR=a.k_tensor, SKIP_ALL=a.skip_all, GATHER=tiles.gather, HAS_COUNT=a.has_count,
        num_warps=tiles.warps_score, num_stages=1)


def _topk(a: _Args) -> None:
    """Steps 4-7: top-K of ``ws.score`` into ``ws.selected`` / ``ws.n_sel``."""
    ws, tiles = a.ws, ws_tiles(a.ws)
    score = with_strides(ws.score, 2)
    cw = -(-a.length // tiles.chunk)
    cw_ws = ws.above.shape[2]
    common = (*a.per_row(), a.heads, a.length, tiles.chunk)
    grid = a.grid(a.heads * cw)
    live = (*a.live(), cw)
    meta = dict(K_TENSOR=a.k_tensor, HAS_COUNT=a.has_count)
    _k._hist_kernel[grid](*live, *score, ws.consts, ws.hist, *common,
                          NB=NUM_BUCKETS, BLOCK=tiles.block, num_warps=tiles.warps_row, **meta)
    _k._compact_kernel[grid](*live, *score, ws.consts, ws.hist, ws.cand_cnt, ws.cand, ws.above, *common, cw_ws,
                             ws.cap, NB=NUM_BUCKETS, BLOCK=tiles.block, num_warps=tiles.warps_row, **meta)
    pos_levels = max(1, -(-max(1, (a.length - 1).bit_length()) // 8))
    # every row (not only the live ones): n_sel and the -1 padding of the rows past count are kept
    # right (n_sel = 0; what a previous call wrote is reset), as for any inactive row
    fgrid = (a.rows * a.heads,) if a.count is None else (min(a.rows * a.heads, a.progs),)
    _k._finish_kernel[fgrid](
        *a.live(), *score, ws.consts, ws.hist, ws.cand_cnt, ws.cand, ws.above, ws.prefix,
        ws.thresh, ws.selected, ws.n_sel, ws.n_prev, *common, cw_ws, ws.cap,
        NB=NUM_BUCKETS, BLOCK=tiles.block_finish, CW_PAD=max(32, next_pow2(cw_ws)), POS_LEVELS=pos_levels,
        num_warps=tiles.warps_finish, **meta)
    _k._write_kernel[grid](*live, *score, ws.thresh, ws.prefix, ws.selected, *common, cw_ws,
                           BLOCK=tiles.block, num_warps=tiles.warps_row, **meta)


def selector_scores_triton(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor,
                           hi: torch.Tensor, params: SelectorParams, *, fill_outside: bool = True,
                           workspace: SelectorWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 in Triton: refined scores ``[rows, Hkv, L]`` fp32 and ``lam [rows, Hkv]``.

    Outside ``A`` the scores are ``-inf`` with ``fill_outside`` (as the twin), else unspecified."""
    rows, heads, length = _prepare(evidence, key_norms)
    device = key_norms.device
    ws = workspace if workspace is not None else selector_workspace(rows, heads, length, params.k_min, device,
                                                                       params, triton_buffers=True)
    check_workspace(ws, rows, heads, length, ws.width, device, True)
    if fill_outside:
        ws.score[:rows, :, :length].fill_(float("-inf"))
    if rows == 0 or heads == 0 or length == 0:
        return ws.score[:rows, :, :length], ws.consts[:rows, :, 3].zero_()
    lo = _int_arg(lo, device, "lo")
    hi = _int_arg(hi, device, "hi")
    a = _Args(lo, hi, lo, 0, 0, 1, False, rows, heads, length, params, ws, 0, False)
    _scores(evidence, key_norms, a, prep_topk=False)
    return ws.score[:rows, :, :length], ws.consts[:rows, :, 3]


def _exclude(exclude, slot: torch.Tensor | None, n_ex: torch.Tensor | None, a: _Args) -> None:
    """``-inf`` into ``ws.score`` at the excluded positions (between the scores and the top-K).
    ``exclude``: a tensor ``[rows (or slots with slot), Hkv, E]`` or a :class:`PagedRows` of ``[Hkv,
    E]`` int32 per slot (with ``slot``)."""
    paged = isinstance(exclude, PagedRows)
    if paged and (slot is None or exclude.dtype != torch.int32):
        raise ValueError("exclude as PagedRows needs exclude_slot and int32 rows")
    if exclude.dim() != 3 or exclude.shape[1] != a.heads or (slot is None and exclude.shape[0] != a.rows):
        raise ValueError(f"exclude must be [rows {a.rows} (or a table with exclude_slot), Hkv {a.heads}, E], "
                         f"got {tuple(exclude.shape)}")
    n_e = exclude.shape[2]
    if n_e == 0:
        return
    if paged:
        pages = exclude.pages
        mem, strides = pages, pages.stride()
        tab, s_tab, first = exclude.table, exclude.table.stride(0), exclude.first
        _, p_tokens, p_c = exclude.page_dims
        p_elems = exclude.page_elems
    else:
        mem, strides = exclude, (*exclude.stride(), 0)
        tab, s_tab, first, p_elems, p_tokens, p_c = a.lo, 0, 0, 1, 1, 1
    _k._exclude_kernel[a.grid(a.heads)](
        *a.live(), *with_strides(a.ws.score, 2), mem, *strides[:3], n_e,
        slot if slot is not None else a.lo, n_ex if n_ex is not None else a.lo, *a.bounds(), a.heads, a.length,
        tab, s_tab, first, strides[3], p_elems, p_tokens, p_c,
        BLOCK=min(1024, max(16, next_pow2(n_e))), HAS_COUNT=a.has_count, HAS_SLOT=slot is not None,
        HAS_N=n_ex is not None, PAGED=paged)


def select_triton(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  params: SelectorParams, k: int | torch.Tensor, *, k_cap: int | None = None,
                  workspace: SelectorWorkspace | None = None,
                  count: torch.Tensor | None = None,
                  exclude: torch.Tensor | None = None,
                  exclude_slot: torch.Tensor | None = None,
                  exclude_count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`vllm_ext.kernels.sfi_selector_torch.select` (same arguments and results).

    ``workspace``: see :func:`vllm_ext.kernels.sfi_selector_workspace.selector_workspace`; without
    one the buffers are allocated here.

    ``count`` (an int32 / int64 tensor of one element, read on the device only): the rows are a
    compacted list whose rows ``[0, count)`` are live and the rest inactive (``lo = hi``). Every
    launch then runs a fixed grid (at most ``2 x SMs`` programs) that walks only the live rows'
    chunks, so a call with ``count = 0`` costs one small wave per launch instead of grids that grow
    with ``L``. The results are those of ``count=None`` for such rows: the rows past ``count`` get
    ``n_sel = 0`` (their output is written only to reset what an earlier call left there), whatever
    their ``lo`` / ``hi``."""
    rows, heads, length = _prepare(evidence, key_norms)
    device = key_norms.device
    width = output_width(k, params, k_cap)
    ws = workspace if workspace is not None else selector_workspace(rows, heads, length, width, device, params,
                                                                       triton_buffers=True)
    check_workspace(ws, rows, heads, length, width, device, True)
    selected, n_sel = ws.selected[:rows], ws.n_sel[:rows]
    if rows == 0 or heads == 0:
        return selected, n_sel
    if length == 0:
        selected.fill_(-1)
        ws.n_prev[:rows].zero_()
        return selected, n_sel.zero_()
    lo = _int_arg(lo, device, "lo")
    hi = _int_arg(hi, device, "hi")
    if count is not None:
        count = _int_arg(count, device, "count")
        if count.numel() != 1:
            raise ValueError(f"count must hold one element, got shape {tuple(count.shape)}")
    k_tensor = isinstance(k, torch.Tensor)
    a = _Args(lo, hi, _int_arg(k, device, "k") if k_tensor else lo, 0 if k_tensor else width, int(params.k_min),
              width, k_tensor, rows, heads, length, params, ws, int(params.select_span), True, count,
              int(params.select_span_back))
    _scores(evidence, key_norms, a, prep_topk=True)
    if exclude is not None:
        _exclude(exclude if isinstance(exclude, PagedRows) else exclude.to(device=device, dtype=torch.int32),
                 None if exclude_slot is None else _int_arg(exclude_slot, device, "exclude_slot"),
                 None if exclude_count is None else _int_arg(exclude_count, device, "exclude_count"), a)
    _topk(a)
    return selected, n_sel
