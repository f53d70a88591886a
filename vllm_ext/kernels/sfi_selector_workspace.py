"""The SFI Selector's tile geometry and persistent workspace (:mod:`vllm_ext.kernels.sfi_selector`)."""

from __future__ import annotations

import dataclasses
import os

import torch

from vllm_ext.kernels.selector_params import SelectorParams, output_width
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

NUM_BUCKETS = 256                               # histogram buckets of the top-K (16 octaves x 16)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile geometry (fixed launch configurations; no autotuning, so nothing runs at capture time).

    ``elems_stats`` / ``elems_score``: elements of the all-heads tiles of steps 1 and 3
    (``next_pow2(Hkv) x T``); ``chunk``: positions per program of steps 4, 5 and 7; ``block``: their
    inner block; ``block_finish``: candidates per step of step 6; ``cap_min``: the candidate list
    holds ``max(cap_min, 2 * width)`` positions per (row, head) (at most ``L``); ``cap`` > 0 sets it
    exactly (tests: forces the overflow path). ``gather``: shifted copies of a tile by ``tl.gather``
    (on chip); ``False`` (env ``SPEEDSFI_SELECTOR_GATHER=0``) goes through a global scratch instead
    (store, barrier, shifted load), a fallback for a Triton build whose ``tl.gather`` fails."""

    elems_stats: int = 8192
    elems_score: int = 4096
    chunk: int = 4096
    block: int = 1024
    block_finish: int = 4096
    cap_min: int = 8192
    cap: int = 0
    gather: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("SPEEDSFI_SELECTOR_GATHER", "1") not in ("0", "false", "False"))
    warps_stats: int = 8
    warps_score: int = 8
    warps_row: int = 4
    warps_finish: int = 8


TILES = Tiles()


def heads_pad(heads: int) -> int:
    """The heads of an all-heads tile: a power of two, at least 2."""
    return max(2, next_pow2(heads))


def _tile_t1(heads: int, tiles: Tiles) -> int:
    return max(16, tiles.elems_stats // heads_pad(heads))


def _halos(params: SelectorParams, span: int, back: int = 0) -> tuple[int, int, bool]:
    """Left / right halo of step 3's tile: Soft-NMS's radius, then the span window ``[j - span, j + back]``."""
    do_nms = params.nms_radius > 0 and params.mu != 0.0
    r = int(params.nms_radius) if do_nms else 0
    return r + int(span), r + int(back), do_nms


def _tile_t2(heads: int, halo_l: int, halo_r: int, tiles: Tiles) -> int:
    return max(16, tiles.elems_score // heads_pad(heads), 2 * next_pow2(max(1, halo_l + halo_r)))


def _gw(a: int, b: int) -> bool:
    """Window ``[i - a, i + b]`` by van Herk / Gil-Werman: the block ``a + b`` must be a power of two >= 2."""
    bs = a + b
    return bs >= 2 and (bs & (bs - 1)) == 0


def _cap(length: int, width: int, tiles: Tiles) -> int:
    want = tiles.cap if tiles.cap > 0 else max(int(tiles.cap_min), 2 * int(width))
    return max(1, min(int(length), int(want)))


@dataclasses.dataclass
class SelectorWorkspace:
    """Persistent buffers of :func:`vllm_ext.kernels.sfi_selector.select` for at most ``rows`` x
    ``heads`` x ``length`` inputs and an output width ``width`` (allocated once by
    :func:`selector_workspace`).

    ``selected [rows, heads, width]`` / ``n_sel [rows]`` are what ``select`` returns (views, valid
    until the next call with this workspace; entries past ``n_sel`` are kept at -1 by writing only
    the range that changed since the previous call, so an inactive row writes nothing). The rest is
    scratch of the Triton path (``None`` on the twin path). Bytes (:attr:`nbytes`):
    ``4 * rows * heads * (length + cap + width + 8 * ceil(length / T1) + 2 * ceil(length / chunk) + 264)
    + 4 * rows`` with ``cap = min(length, max(8192, 2 * width))`` and ``T1 = 8192 / next_pow2(heads)``
    (e.g. 32 rows x 8 heads x 128K, width 2048: 146 MB). ``pooled`` (4-D evidence) and ``scratch``
    (``Tiles.gather`` off) add ``4 * rows * heads * length`` each when used.
    """

    rows: int
    heads: int
    length: int
    width: int
    device: torch.device
    selected: torch.Tensor
    n_sel: torch.Tensor
    tiles: Tiles | None = None
    cap: int = 0
    score: torch.Tensor | None = None       # [rows, heads, length] f32: final scores (inside A only)
    consts: torch.Tensor | None = None      # [rows, heads, 4] f32: coef_f, coef_r, upper bound, lam
    stats: torch.Tensor | None = None       # [rows, heads, C1, 8] f32: partial fusion statistics
    hist: torch.Tensor | None = None        # [rows, heads, 256] i32
    cand_cnt: torch.Tensor | None = None    # [rows, heads] i32
    cand: torch.Tensor | None = None        # [rows, heads, cap] i32
    above: torch.Tensor | None = None       # [rows, heads, CW] i32
    prefix: torch.Tensor | None = None      # [rows, heads, CW] i32
    thresh: torch.Tensor | None = None      # [rows, heads, 2] i32: key T (bits), P_tie
    n_prev: torch.Tensor | None = None      # [rows, heads] i32: n_sel of the previous call
    pooled: torch.Tensor | None = None      # [rows, heads, length] f32, 4-D evidence only (lazy)
    scratch: torch.Tensor | None = None     # step 3's shift scratch when Tiles.gather is off
    cpu_rows_written: int = -1              # the CPU path: rows of ``selected`` written so far (-1: any)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def selector_workspace(rows: int, heads: int, length: int, width: int | None, device: torch.device | str,
                       params: SelectorParams, *, triton_buffers: bool | None = None) -> SelectorWorkspace:
    """Allocate the persistent workspace of ``select`` (once, outside any CUDA-graph capture).

    ``width`` is the output width (:func:`vllm_ext.kernels.selector_params.output_width`;
    ``None``: ``params.k``). The Triton scratch
    is allocated when :func:`use_triton` holds for ``device`` (or ``triton_buffers``)."""
    device = torch.device(device)
    width = output_width(width if width is not None else params.k, params)
    rows, heads, length = int(rows), int(heads), int(length)
    ws = SelectorWorkspace(rows=rows, heads=heads, length=length, width=width, device=device,
                           selected=torch.full((rows, heads, width), -1, dtype=torch.int32, device=device),
                           n_sel=torch.zeros((rows,), dtype=torch.int32, device=device))
    if triton_buffers is None:
        triton_buffers = HAS_TRITON and use_triton(device)
    if not triton_buffers:
        return ws
    tiles = TILES
    c1 = max(1, -(-length // _tile_t1(heads, tiles)))
    cw = max(1, -(-length // tiles.chunk))
    cap = _cap(length, width, tiles)
    i32 = dict(dtype=torch.int32, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    ws.tiles, ws.cap = tiles, cap
    ws.score = torch.empty((rows, heads, max(length, 1)), **f32)
    ws.consts = torch.zeros((rows, heads, 4), **f32)
    ws.stats = torch.empty((rows, heads, c1, 8), **f32)
    ws.hist = torch.zeros((rows, heads, NUM_BUCKETS), **i32)
    ws.cand_cnt = torch.zeros((rows, heads), **i32)
    ws.cand = torch.empty((rows, heads, cap), **i32)
    ws.above = torch.zeros((rows, heads, cw), **i32)
    ws.prefix = torch.zeros((rows, heads, cw), **i32)
    ws.thresh = torch.zeros((rows, heads, 2), **i32)
    ws.n_prev = torch.zeros((rows, heads), **i32)
    if not tiles.gather:                       # the global shift scratch of step 3 (fallback only)
        halo_l, halo_r, _ = _halos(params, int(params.select_span), int(params.select_span_back))
        t2 = _tile_t2(heads, halo_l, halo_r, tiles)
        c2 = -(-max(length, 1) // (t2 - halo_l - halo_r))
        ws.scratch = torch.empty(rows * c2 * heads_pad(heads) * t2, **f32)
    return ws


def check_workspace(ws: SelectorWorkspace, rows: int, heads: int, length: int, width: int,
                    device: torch.device, need_triton: bool) -> None:
    if rows > ws.rows or heads != ws.heads or length > ws.length:
        raise ValueError(f"selector workspace is for rows <= {ws.rows}, heads {ws.heads}, length <= {ws.length}; "
                         f"got rows {rows}, heads {heads}, length {length}")
    if width != ws.width:
        raise ValueError(f"selector workspace width {ws.width} != output width {width} (k / k_cap / k_min)")
    if ws.selected.device != device:
        raise ValueError(f"selector workspace is on {ws.selected.device}, inputs on {device}")
    if need_triton and ws.score is None:
        raise ValueError("selector workspace has no Triton buffers (allocated for the PyTorch twin)")
    if need_triton and ws.tiles != TILES:
        raise ValueError("selector workspace was allocated under other Tiles; allocate it again")


def ws_tiles(ws: SelectorWorkspace) -> Tiles:
    return ws.tiles if ws.tiles is not None else TILES
