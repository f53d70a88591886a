"""The SFI Selector in Triton (ALGORITHMS.md §1 steps 1-5), twin of :func:`vllm_ext.kernels.sfi_selector_torch.select`.

Parallel over positions: every stage runs many programs per (row, KV head), each on one chunk of the
row's own allowed set ``A = [lo, hi)`` (chunks are aligned to absolute positions; a program whose
chunk misses ``A`` exits at once, so the work follows ``|A|``, not ``L``, and an inactive row
(``lo = hi``) costs one load per program). No host sync, no allocation with a
:class:`SelectorWorkspace`, fixed grids: CUDA-graph capturable.

With ``count`` (a one-element device tensor; the decode path's compacted slow list, whose rows
``[0, count)`` are live and the rest have ``lo = hi = 0``) every launch runs a fixed grid of at most
``2 x SMs`` programs, each looping over the items (row, chunk) of the live rows only: a call with
``count = 0`` costs one small wave per launch, one live row at 128K keeps its chunk parallelism. Each
kernel is written as that loop (``item`` from ``program_id`` to ``n_live x items per row`` by
``num_programs``); without ``count`` the grid has one program per item of every row, so the loop
runs once. Launches, in order:

0. (4-D evidence only) ``_pool_kernel``, one program per (row, KV head): per evidence row the
   log-sum-exp over ``A``, then the power-mean pooling -> an unnormalised pooled ``log f`` in the
   workspace; from there on the 3-D path runs on it. Serial per (row, head): correct, not fast.
1. ``_stats_kernel``, (row, chunk of ``T1`` positions), all KV heads of the row in one tile: per head
   the chunk's partial fusion statistics (maxima of ``log f`` and ``log r`` and the five rescaled
   sums that give ``Z_f``, ``Z_r``, ``|f|^2``, ``|r|^2``, ``<f, r>``). Reads evidence + key norms.
2. ``_merge_kernel``, one program per (row, KV head): merges the partials -> the clipped ``lam``,
   the two log-space coefficients of the fusion and an upper bound of the scores; zeroes the
   top-K histogram and candidate counter.
3. ``_score_kernel``, (row, chunk), all KV heads: recomputes ``log f`` / ``log r`` from evidence and
   key norms (no workspace round trip), the fused ``log s``, Soft-NMS (window max over
   ``+-nms_radius``), cross-head exclusivity and (``sfi.select_span`` / ``select_span_back``) the span
   dilation, on a tile with halos, and writes the final score (fp32) once. Window maxima are van Herk / Gil-Werman
   (two shifted copies from ``tl.gather`` and two block scans) when the window fits a power-of-two
   block, else a doubling sparse table (``log2(window)`` gathers).
   With ``exclude`` (``sfi.keep_prefill``), ``_exclude_kernel`` (one program per row and KV head)
   then writes ``-inf`` at the row's kept positions (a list per row, or a table row per slot).
4. ``_hist_kernel``, (row x head, chunk): a 256-bucket histogram of the score's distance below the
   upper bound (log-spaced: 16 octaves x 16 sub-buckets, monotone in the score), merged with
   atomics (non-empty buckets only).
5. ``_compact_kernel``, (row x head, chunk): the bucket ``b*`` that holds the ``n_sel``-th best
   score; counts per chunk the scores above ``b*`` (all selected) and appends the positions in
   ``b*`` (the candidates) to a per-(row, head) list (atomic slot allocation, capacity ``cap``).
6. ``_finish_kernel``, one program per (row, KV head): exact radix select (4 x 8-bit digits of an
   order-preserving key) over the candidates -> the threshold key ``T``; among the candidates equal
   to ``T``, a radix select over positions keeps the lowest ones (ties to the lower position, as
   the twin); per-chunk output offsets; the ``-1`` padding. When the candidate list overflowed it
   scans the whole row instead (same result, slower).
7. ``_write_kernel``, (row x head, chunk): writes the selected positions (``key > T``, or
   ``key == T`` and position ``<= P_tie``) in position order: sorted output without a sort.

Rows with ``min(k_eff, |A|) == |A|`` take all of ``A`` (steps 1-6 skip them). The scores equal the
twin's up to fp32 rounding; the selection is exactly the twin's top-K rule applied to them.

Traffic per position and KV head of ``A``: 8 B (evidence + key norms) in step 1, 8 B (+ the halo)
read and 4 B written in step 3, 4 B read in each of steps 4, 5 and 7: about 32 B, against 512 B for
the dense attention that produced the evidence (bf16 K + V, head 128). Step 6 touches only the
candidates (typically a few hundred per head at 128K). The 4-D path allocates ``pooled`` in the
workspace on first use (call it once before a CUDA-graph capture).

Modules: this one is the public API (:func:`select` and its dispatch); the kernels are in
:mod:`vllm_ext.kernels.sfi_selector_kernels`, their launches in :mod:`vllm_ext.kernels.sfi_selector_launch`,
the tile geometry and the persistent workspace in :mod:`vllm_ext.kernels.sfi_selector_workspace`.

Dispatch: :func:`select` follows :func:`vllm_ext.kernels.triton_utils.use_triton` (Triton for CUDA
tensors or under ``TRITON_INTERPRET=1``, the twin with ``SPEEDSFI_FORCE_TORCH_KERNELS=1``).
The constants come as :class:`vllm_ext.kernels.selector_params.SelectorParams`. Importable without
Triton (then always the twin) and without vLLM.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import sfi_selector_torch as _ref
from vllm_ext.kernels import sfi_selector_workspace as _ws
from vllm_ext.kernels.selector_params import SelectorParams, output_width
from vllm_ext.kernels.sfi_selector_cpu import select_rows as select_rows_cpu
from vllm_ext.kernels.sfi_selector_launch import select_triton, selector_scores_triton
from vllm_ext.kernels.sfi_selector_workspace import (NUM_BUCKETS, TILES, SelectorWorkspace, Tiles, check_workspace,
                                                     selector_workspace)
from vllm_ext.kernels.sfi_selector_workspace import _halos, _tile_t2  # noqa: F401 - the benchmark's traffic model
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton

select_torch = _ref.select
selector_scores_torch = _ref.selector_scores

__all__ = [
    "HAS_TRITON", "NUM_BUCKETS", "TILES", "SelectorParams", "SelectorWorkspace", "Tiles", "output_width", "select",
    "select_torch", "select_triton", "selector_scores_torch", "selector_scores_triton", "selector_workspace",
    "set_tiles", "use_triton",
]


def set_tiles(tiles: Tiles) -> None:
    """Launch with ``tiles`` from now on (a workspace allocated under other tiles is refused)."""
    global TILES
    TILES = _ws.TILES = tiles


def select(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           params: SelectorParams, k: int | torch.Tensor, *, k_cap: int | None = None,
           workspace: SelectorWorkspace | None = None,
           count: torch.Tensor | None = None,
           exclude: torch.Tensor | None = None,
           exclude_slot: torch.Tensor | None = None,
           exclude_count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`vllm_ext.kernels.sfi_selector_torch.select`; Triton on CUDA / under the interpreter.

    With ``workspace`` (:func:`selector_workspace`) nothing is allocated and the results are views
    into it (same values as without). ``count``: see :func:`select_triton`; rows past it select nothing
    (their allowed set is empty on the decode path); on the CPU the twin computes only the rows before
    it (elsewhere it computes every row, without a host sync). The table form of
    ``exclude`` (``exclude_slot``) is the decode path's: the Triton path reads the kept positions in
    place (no gather on the hot path); ``exclude_count`` leaves out what a slot's table row holds past
    its kept count (a previous request's positions)."""
    if use_triton(key_norms):
        return select_triton(evidence, key_norms, lo, hi, params, k, k_cap=k_cap, workspace=workspace,
                             count=count, exclude=exclude, exclude_slot=exclude_slot,
                             exclude_count=exclude_count)
    if key_norms.device.type == "cpu" and evidence.dim() == 3:
        if workspace is not None:
            return _select_rows_into(workspace, evidence, key_norms, lo, hi, params, k, k_cap, count, exclude,
                                     exclude_slot, exclude_count)
        sel, n_sel = select_rows_cpu(evidence, key_norms, lo, hi, params, k, k_cap, count, exclude,
                                     exclude_slot, exclude_count, native=True)
    else:
        sel, n_sel = _select_twin(evidence, key_norms, lo, hi, params, k, k_cap, count, exclude, exclude_slot,
                                  exclude_count)
    if workspace is None:
        return sel, n_sel
    rows, heads = sel.shape[:2]
    check_workspace(workspace, rows, heads, key_norms.shape[-1], sel.shape[-1], sel.device, False)
    out_sel, out_n = workspace.selected[:rows], workspace.n_sel[:rows]
    out_sel.copy_(sel)
    out_n.copy_(n_sel)
    if workspace.n_prev is not None:           # keep the Triton path's padding bookkeeping right
        workspace.n_prev[:rows].copy_(n_sel[:, None].expand(rows, heads))
    return out_sel, out_n


def _select_rows_into(ws: SelectorWorkspace, evidence, key_norms, lo, hi, params, k, k_cap, count, exclude,
                      exclude_slot, exclude_count) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU's selection into the workspace, its live rows only: the rows past ``count`` must read
    as nothing selected, and only those an earlier call wrote are reset (the scratch has rows for
    every slow row a step may hold, about 1,800 at 8K on the real model, where a step's slow rows are
    a few: writing all of them cost more than selecting)."""
    rows, heads = key_norms.shape[:2]
    sel, n_sel = select_rows_cpu(evidence, key_norms, lo, hi, params, k, k_cap, count, exclude,
                                 exclude_slot, exclude_count, native=True, live_only=True)
    check_workspace(ws, rows, heads, key_norms.shape[-1], sel.shape[-1], sel.device, False)
    live = sel.shape[0]
    written = ws.rows if ws.cpu_rows_written < 0 else ws.cpu_rows_written
    dirty = min(rows, written)
    ws.selected[:live].copy_(sel)
    ws.n_sel[:live].copy_(n_sel)
    if dirty > live:
        ws.selected[live:dirty].fill_(-1)
        ws.n_sel[live:dirty].zero_()
    if ws.n_prev is not None:
        ws.n_prev[:max(live, dirty)].copy_(ws.n_sel[:max(live, dirty), None].expand(-1, heads))
    ws.cpu_rows_written = live if written <= rows else written
    return ws.selected[:rows], ws.n_sel[:rows]


def _select_twin(evidence, key_norms, lo, hi, params, k, k_cap, count, exclude, exclude_slot, exclude_count):
    rows = key_norms.shape[0]
    live = rows
    length = key_norms.shape[-1]
    span = length
    if key_norms.device.type == "cpu":
        # the CPU reads the plan for free: the twin computes the live rows (``count``) over the
        # positions before the end of their allowed sets only (nothing past ``max(hi)`` can be chosen)
        if count is not None:
            live = max(0, min(rows, int(count.reshape(-1)[0])))
        if live:
            span = max(1, min(length, int(hi.reshape(-1)[:live].max())))
    if live < rows or span < length:
        # rows past ``count`` have an empty allowed set: nothing selected (-1 padding, n_sel 0)
        def cut(t):
            return t[:live] if isinstance(t, torch.Tensor) and t.dim() > 0 else t

        def cut_pos(t):
            return t[:live, ..., :span]
        sel_l, n_l = select_torch(cut_pos(evidence), cut_pos(key_norms), cut(lo), cut(hi), params, cut(k),
                                  k_cap=k_cap,
                                  exclude=exclude if exclude_slot is not None else cut(exclude),
                                  exclude_slot=cut(exclude_slot), exclude_count=cut(exclude_count))
        sel = torch.full((rows, *sel_l.shape[1:]), -1, dtype=sel_l.dtype, device=sel_l.device)
        n_sel = torch.zeros(rows, dtype=n_l.dtype, device=n_l.device)
        sel[:live], n_sel[:live] = sel_l, n_l
    else:
        sel, n_sel = select_torch(evidence, key_norms, lo, hi, params, k, k_cap=k_cap, exclude=exclude,
                                  exclude_slot=exclude_slot, exclude_count=exclude_count)
    return sel, n_sel
