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

Dispatch: :func:`select` follows :func:`vllm_ext.kernels.triton_utils.use_triton` (Triton for CUDA
tensors or under ``TRITON_INTERPRET=1``, the twin with ``SPEEDSFI_FORCE_TORCH_KERNELS=1``).
Importable without Triton (then always the twin) and without vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from vllm_ext.config import SfiConfig
from vllm_ext.kernels import triton_utils
from vllm_ext.kernels import sfi_selector_torch as _ref
from vllm_ext.kernels.sfi_selector_cpu import select_rows as select_rows_cpu
from vllm_ext.kernels.paged_rows import PagedRows

try:                                              # the CPU image may lack triton; the twin still works
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:                               # pragma: no cover
    HAS_TRITON = False

select_torch = _ref.select
selector_scores_torch = _ref.selector_scores

use_triton = triton_utils.use_triton           # the package's one dispatch rule

NUM_BUCKETS = 256                               # histogram buckets of the top-K (16 octaves x 16)
_BUCKET_BASE = (127 - 6) * 16                   # bucket 0: distance below the bound < 2^-6


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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tile_t1(heads: int, tiles: Tiles) -> int:
    return max(16, tiles.elems_stats // max(2, _next_pow2(heads)))


def _halos(cfg: SfiConfig, span: int, back: int = 0) -> tuple[int, int, bool]:
    """Left / right halo of step 3's tile: Soft-NMS's radius, then the span window ``[j - span, j + back]``."""
    do_nms = cfg.nms_radius > 0 and cfg.mu != 0.0
    r = int(cfg.nms_radius) if do_nms else 0
    return r + int(span), r + int(back), do_nms


def _tile_t2(heads: int, halo_l: int, halo_r: int, tiles: Tiles) -> int:
    return max(16, tiles.elems_score // max(2, _next_pow2(heads)), 2 * _next_pow2(max(1, halo_l + halo_r)))


def _gw(a: int, b: int) -> bool:
    """Window ``[i - a, i + b]`` by van Herk / Gil-Werman: the block ``a + b`` must be a power of two >= 2."""
    bs = a + b
    return bs >= 2 and (bs & (bs - 1)) == 0


def _cap(length: int, width: int, tiles: Tiles) -> int:
    want = tiles.cap if tiles.cap > 0 else max(int(tiles.cap_min), 2 * int(width))
    return max(1, min(int(length), int(want)))


# ---------------------------------------------------------------------------------------- workspace
@dataclasses.dataclass
class SelectorWorkspace:
    """Persistent buffers of :func:`select` for at most ``rows`` x ``heads`` x ``length`` inputs and an
    output width ``width`` (allocated once by :func:`selector_workspace`).

    ``selected [rows, heads, width]`` / ``n_sel [rows]`` are what :func:`select` returns (views, valid
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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def selector_workspace(rows: int, heads: int, length: int, width: int | None, device: torch.device | str,
                       cfg: SfiConfig, *, triton_buffers: bool | None = None) -> SelectorWorkspace:
    """Allocate the persistent workspace of :func:`select` (once, outside any CUDA-graph capture).

    ``width`` is the output width (``max(k_cap or cfg.k, k_min)`` for a tensor ``k``, ``max(k, k_min)``
    for an int ``k``; ``None``: from ``cfg``). The Triton scratch is allocated when
    :func:`use_triton` holds for ``device`` (or ``triton_buffers``)."""
    device = torch.device(device)
    width = max(int(width if width is not None else cfg.k), int(cfg.k_min))
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
        halo_l, halo_r, _ = _halos(cfg, int(cfg.select_span), int(cfg.select_span_back))
        t2 = _tile_t2(heads, halo_l, halo_r, tiles)
        c2 = -(-max(length, 1) // (t2 - halo_l - halo_r))
        ws.scratch = torch.empty(rows * c2 * max(2, _next_pow2(heads)) * t2, **f32)
    return ws


def _check_workspace(ws: SelectorWorkspace, rows: int, heads: int, length: int, width: int,
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


def _width(k: int | torch.Tensor, cfg: SfiConfig, k_cap: int | None) -> int:
    if isinstance(k, torch.Tensor):
        return max(int(k_cap if k_cap is not None else cfg.k), int(cfg.k_min))
    return max(int(k), int(cfg.k_min))


def select(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           cfg: SfiConfig, k: int | torch.Tensor, *, k_cap: int | None = None,
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
        return select_triton(evidence, key_norms, lo, hi, cfg, k, k_cap=k_cap, workspace=workspace,
                             count=count, exclude=exclude, exclude_slot=exclude_slot,
                             exclude_count=exclude_count)
    if key_norms.device.type == "cpu" and evidence.dim() == 3:
        sel, n_sel = select_rows_cpu(evidence, key_norms, lo, hi, cfg, k, k_cap, count, exclude,
                                     exclude_slot, exclude_count, native=True)
    else:
        sel, n_sel = _select_twin(evidence, key_norms, lo, hi, cfg, k, k_cap, count, exclude, exclude_slot,
                                  exclude_count)
    if workspace is None:
        return sel, n_sel
    rows, heads = sel.shape[:2]
    _check_workspace(workspace, rows, heads, key_norms.shape[-1], sel.shape[-1], sel.device, False)
    out_sel, out_n = workspace.selected[:rows], workspace.n_sel[:rows]
    out_sel.copy_(sel)
    out_n.copy_(n_sel)
    if workspace.n_prev is not None:           # keep the Triton path's padding bookkeeping right
        workspace.n_prev[:rows].copy_(n_sel[:, None].expand(rows, heads))
    return out_sel, out_n


def _select_twin(evidence, key_norms, lo, hi, cfg, k, k_cap, count, exclude, exclude_slot, exclude_count):
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
        sel_l, n_l = select_torch(cut_pos(evidence), cut_pos(key_norms), cut(lo), cut(hi), cfg, cut(k),
                                  k_cap=k_cap,
                                  exclude=exclude if exclude_slot is not None else cut(exclude),
                                  exclude_slot=cut(exclude_slot), exclude_count=cut(exclude_count))
        sel = torch.full((rows, *sel_l.shape[1:]), -1, dtype=sel_l.dtype, device=sel_l.device)
        n_sel = torch.zeros(rows, dtype=n_l.dtype, device=n_l.device)
        sel[:live], n_sel[:live] = sel_l, n_l
    else:
        sel, n_sel = select_torch(evidence, key_norms, lo, hi, cfg, k, k_cap=k_cap, exclude=exclude,
                                  exclude_slot=exclude_slot, exclude_count=exclude_count)
    return sel, n_sel


if HAS_TRITON:

    # ------------------------------------------------------------------------------------ helpers
    @triton.jit
    def _n_live(COUNT, ROWS, HAS_COUNT: tl.constexpr):
        """Rows whose work a launch walks: ``clamp(COUNT[0], 0, ROWS)`` (a live prefix; read on the
        device) with ``HAS_COUNT``, else all ``ROWS``. Every kernel loops ``item`` over
        ``[program_id, n_live * per_row)`` with stride ``num_programs``: one item per program on the
        full grid (``count=None``), a persistent walk on the fixed grid of ``_Args.grid``."""
        if HAS_COUNT:
            n = tl.minimum(tl.maximum(tl.load(COUNT).to(tl.int32), 0), ROWS)
        else:
            n = ROWS
        return n

    @triton.jit
    def _i32(it):
        """A loop index as an int32 tensor (the interpreter's ``range`` yields Python ints)."""
        return it + tl.zeros([], dtype=tl.int32)

    @triton.jit
    def _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L):
        """A = [lo, hi) of a row clamped to [0, L) with hi >= lo (int32)."""
        lo = tl.load(lo_ptr + row * s_lo)
        hi = tl.load(hi_ptr + row * s_hi)
        lo = tl.minimum(tl.maximum(lo, 0), L).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, 0), L).to(tl.int32)
        return lo, tl.maximum(hi, lo)

    @triton.jit
    def _keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR: tl.constexpr):
        """Effective budget of a row: clamp(k[row], k_min, width) for a tensor k, else k_val."""
        if K_TENSOR:
            k = tl.load(k_ptr + row * s_k).to(tl.int64)
            k = tl.minimum(tl.maximum(k, k_min), width).to(tl.int32)
        else:
            k = tl.full([], 0, tl.int32) + k_val
        return k

    @triton.jit
    def _pos_prior(offs, lo, den, w_pos, pos_power, pos_eta, pos_beta, eps):
        # w_pos * log delta(j), u and 1 - u from integers, as in the twin: 1 - u is exactly 0 at the
        # last position of A (GPU division is approximate; 1 - (1 - ulp) would dodge the eps floor).
        rel = tl.minimum(tl.maximum(offs - lo, 0), den)
        denf = den.to(tl.float32)
        u = rel.to(tl.float32) / denf
        one_minus_u = (den - rel).to(tl.float32) / denf
        up = tl.where(u > 0, tl.exp(pos_power * tl.log(tl.maximum(u, 1e-30))), 0.0)
        return w_pos * (-pos_beta * up + pos_eta * tl.log(tl.maximum(one_minus_u, eps)))

    @triton.jit
    def _key(s):
        """Order-preserving uint32 key of fp32 scores (NaN -> the key of -inf)."""
        s = tl.where(s != s, float("-inf"), s)
        bits = s.to(tl.int32, bitcast=True)
        return (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) ^ (-2147483648)).to(tl.uint32, bitcast=True)

    @triton.jit
    def _bucket(s, m_up):
        """Histogram bucket of a score: its distance below the upper bound ``m_up``, log-spaced
        (bucket 0: < 2^-6; then 16 sub-buckets per octave; 255: >= 2^10, -inf, NaN). Non-increasing
        in the score, so a better score never falls in a later bucket."""
        d = m_up - s
        d = tl.where(d == d, tl.maximum(d, 0.0), float("inf"))
        b = (d.to(tl.int32, bitcast=True) >> 19) - 1936         # 1936 = _BUCKET_BASE
        return tl.minimum(tl.maximum(b, 0), 255)

    @triton.jit
    def _threshold_bucket(hist_base, n_sel, NB: tl.constexpr):
        """The bucket b* holding the n_sel-th best score; scores in buckets < b* (n_above of them)
        are all selected."""
        bins = tl.arange(0, NB)
        hist = tl.load(hist_base + bins)
        cum = tl.cumsum(hist, 0)
        bstar = tl.sum((cum < n_sel).to(tl.int32), axis=0)
        n_above = tl.sum(tl.where(bins < bstar, hist, 0), axis=0)
        return bstar, n_above

    @triton.jit
    def _mx(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _shift(x, d: tl.constexpr, T: tl.constexpr, H_PAD: tl.constexpr, GATHER: tl.constexpr, scr):
        """y[:, i] = x[:, clamp(i + d, 0, T - 1)]: an on-chip ``tl.gather``, or (``GATHER`` off) through
        this program's region of a global scratch (``scr``, ``H_PAD x T`` floats)."""
        i = tl.arange(0, T)
        idx = tl.minimum(tl.maximum(i + d, 0), T - 1)
        if GATHER:
            y = tl.gather(x, tl.broadcast_to(idx[None, :], (H_PAD, T)), 1)
        else:
            rows = tl.arange(0, H_PAD)[:, None] * T
            tl.debug_barrier()                     # the previous shift's readers are done
            tl.store(scr + rows + i[None, :], x)
            tl.debug_barrier()
            y = tl.load(scr + rows + idx[None, :])
        return y

    @triton.jit
    def _window_max(x, A: tl.constexpr, B: tl.constexpr, T: tl.constexpr, H_PAD: tl.constexpr,
                    GW: tl.constexpr, BS: tl.constexpr, KL: tl.constexpr, GATHER: tl.constexpr, scr):
        """m[:, i] = max x[:, i - A .. i + B], valid for A <= i < T - B (elsewhere garbage).
        ``BS = A + B``; ``KL = floor(log2(A + B + 1))`` (the sparse table's levels)."""
        if GW:
            # van Herk / Gil-Werman with blocks of BS = A + B: [i - A, i + B] (BS + 1 long) spans two
            # consecutive blocks: the suffix max of x[i - A] and the prefix max of x[i + B].
            t1 = _shift(x, -A, T, H_PAD, GATHER, scr)
            suf = tl.reshape(tl.associative_scan(tl.reshape(t1, (H_PAD, T // BS, BS)), 2, _mx, reverse=True),
                             (H_PAD, T))
            if B > 0:
                t2 = _shift(x, B, T, H_PAD, GATHER, scr)
            else:
                t2 = x
            pre = tl.reshape(tl.associative_scan(tl.reshape(t2, (H_PAD, T // BS, BS)), 2, _mx), (H_PAD, T))
            res = tl.maximum(suf, pre)
        else:
            # sparse table: W_k = max over [i, i + 2^k), then two overlapping windows of 2^KL
            w = x
            for kk in tl.static_range(KL):
                w = tl.maximum(w, _shift(w, 1 << kk, T, H_PAD, GATHER, scr))
            res = tl.maximum(_shift(w, -A, T, H_PAD, GATHER, scr),
                             _shift(w, B + 1 - (1 << KL), T, H_PAD, GATHER, scr))
        return res

    # ----------------------------------------------------------------------- 0. 4-D evidence pooling
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _pool_kernel(COUNT, ROWS, ev_ptr, s_ev_b, s_ev_h, s_ev_r, s_ev_l, out_ptr, s_out_b, s_out_h,
                     lo_ptr, s_lo, hi_ptr, s_hi, H, L, R, log_R, alpha, inv_alpha,
                     R_PAD: tl.constexpr, BLOCK_L: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * H, tl.num_programs(0)):
            pid = _i32(it)
            row = pid // H
            h = pid % H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            ev_base = ev_ptr + row.to(tl.int64) * s_ev_b + h.to(tl.int64) * s_ev_h
            out_base = out_ptr + row.to(tl.int64) * s_out_b + h.to(tl.int64) * s_out_h
            ar = tl.arange(0, BLOCK_L)
            offs_r = tl.arange(0, R_PAD)
            rmask = offs_r < R
            ninf = float("-inf")
            m_row = tl.full([R_PAD], ninf, tl.float32)
            s_row = tl.zeros([R_PAD], dtype=tl.float32)
            for j0 in range(lo, hi, BLOCK_L):                     # per evidence row: logsumexp over A
                offs = j0 + ar
                lm = offs < hi
                x = tl.load(ev_base + offs_r[:, None] * s_ev_r + offs[None, :] * s_ev_l,
                            mask=rmask[:, None] & lm[None, :], other=ninf).to(tl.float32)
                nm = tl.maximum(m_row, tl.max(x, axis=1))
                safe = tl.where(nm == ninf, 0.0, nm)
                s_row = s_row * tl.exp(m_row - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
                m_row = nm
            lse_r = tl.where(s_row > 0, m_row + tl.log(tl.maximum(s_row, 1e-30)), ninf)
            for j0 in range(lo, hi, BLOCK_L):                     # power mean -> unnormalised log f
                offs = j0 + ar
                lm = offs < hi
                x = tl.load(ev_base + offs_r[:, None] * s_ev_r + offs[None, :] * s_ev_l,
                            mask=rmask[:, None] & lm[None, :], other=ninf).to(tl.float32)
                ok = (lse_r > ninf)[:, None] & (x > ninf)
                y = tl.where(ok, alpha * (x - lse_r[:, None]), ninf)
                ym = tl.max(y, axis=0)
                ys = tl.where(ym == ninf, 0.0, ym)
                ps = tl.sum(tl.exp(y - ys[None, :]), axis=0)
                lf = tl.where(ps > 0, (ys + tl.log(tl.maximum(ps, 1e-30)) - log_R) * inv_alpha, ninf)
                tl.store(out_base + offs, lf, mask=lm)

    # ---------------------------------------------------------------------- 1. partial statistics
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _stats_kernel(COUNT, ROWS, NC, ev_ptr, s_ev_b, s_ev_h, s_ev_l, kn_ptr, s_kn_b, s_kn_h, s_kn_l,
                      lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, st_ptr, C1_WS,
                      H, L, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps,
                      T: tl.constexpr, H_PAD: tl.constexpr, K_TENSOR: tl.constexpr, SKIP_ALL: tl.constexpr,
                      HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * NC, tl.num_programs(0)):
            row = _i32(it) // NC
            c = _i32(it) % NC
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            p0 = c * T
            active = (p0 < hi) & (p0 + T > lo)
            if SKIP_ALL:                                   # rows that take all of A (or nothing) need no scores
                k_eff = _keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR)
                active = active & (k_eff > 0) & (k_eff < hi - lo)
            if active:
                ninf = float("-inf")
                den = tl.maximum(hi - lo - 1, 1)
                offs = p0 + tl.arange(0, T)
                hs = tl.arange(0, H_PAD)
                hm = hs < H
                in_a = (offs >= lo) & (offs < hi)
                m2 = hm[:, None] & in_a[None, :]
                rb = row.to(tl.int64)
                hb = hs.to(tl.int64)[:, None]
                lf = tl.load(ev_ptr + rb * s_ev_b + hb * s_ev_h + offs[None, :] * s_ev_l, mask=m2,
                             other=ninf).to(tl.float32)
                kn = tl.load(kn_ptr + rb * s_kn_b + hb * s_kn_h + offs[None, :] * s_kn_l, mask=m2,
                             other=1.0).to(tl.float32)
                lp = _pos_prior(offs, lo, den, w_pos, pos_power, pos_eta, pos_beta, eps)
                lr = tl.where(m2, w_k * (-gamma_k * tl.log(tl.maximum(kn, eps))) + lp[None, :], ninf)
                lf = tl.where(m2, lf, ninf)
                m_f = tl.max(lf, axis=1)
                m_r = tl.max(lr, axis=1)
                e_f = tl.exp(lf - tl.where(m_f == ninf, 0.0, m_f)[:, None])
                e_r = tl.exp(lr - tl.where(m_r == ninf, 0.0, m_r)[:, None])
                base = st_ptr + ((rb * H + hs) * C1_WS + c) * 8
                tl.store(base + 0, m_f, mask=hm)
                tl.store(base + 1, m_r, mask=hm)
                tl.store(base + 2, tl.sum(e_f, axis=1), mask=hm)
                tl.store(base + 3, tl.sum(e_r, axis=1), mask=hm)
                tl.store(base + 4, tl.sum(e_f * e_f, axis=1), mask=hm)
                tl.store(base + 5, tl.sum(e_r * e_r, axis=1), mask=hm)
                tl.store(base + 6, tl.sum(e_f * e_r, axis=1), mask=hm)

    # -------------------------------------------------------------------- 2. merge -> lam, coefs
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _merge_kernel(COUNT, ROWS, st_ptr, C1_WS, consts_ptr, hist_ptr, cnt_ptr, lo_ptr, s_lo, hi_ptr,
                      s_hi,
                      k_ptr, s_k, k_val, k_min, width, H, L, lambda_max, eps,
                      T1: tl.constexpr, C1_PAD: tl.constexpr, NB: tl.constexpr, K_TENSOR: tl.constexpr,
                      SKIP_ALL: tl.constexpr, PREP_TOPK: tl.constexpr, WRITE_LAM: tl.constexpr,
                      HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * H, tl.num_programs(0)):
            pid = _i32(it)
            row = pid // H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            ninf = float("-inf")
            active = hi > lo
            if SKIP_ALL:                                   # rows that take all of A (or nothing) need no scores
                k_eff = _keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR)
                active = active & (k_eff > 0) & (k_eff < hi - lo)
            if active:
                cs = tl.arange(0, C1_PAD)
                cm = (cs >= lo // T1) & (cs < (hi + T1 - 1) // T1)
                base = st_ptr + (pid.to(tl.int64) * C1_WS + cs) * 8
                m_f = tl.load(base + 0, mask=cm, other=ninf)
                m_r = tl.load(base + 1, mask=cm, other=ninf)
                mf = tl.max(m_f, axis=0)
                mr = tl.max(m_r, axis=0)
                w_f = tl.exp(m_f - tl.where(mf == ninf, 0.0, mf))
                w_r = tl.exp(m_r - tl.where(mr == ninf, 0.0, mr))
                s_f = tl.sum(tl.load(base + 2, mask=cm, other=0.0) * w_f, axis=0)
                s_r = tl.sum(tl.load(base + 3, mask=cm, other=0.0) * w_r, axis=0)
                s_ff = tl.sum(tl.load(base + 4, mask=cm, other=0.0) * (w_f * w_f), axis=0)
                s_rr = tl.sum(tl.load(base + 5, mask=cm, other=0.0) * (w_r * w_r), axis=0)
                s_fr = tl.sum(tl.load(base + 6, mask=cm, other=0.0) * (w_f * w_r), axis=0)
                has_f = s_f > 0
                has_r = s_r > 0
                z_f = tl.where(has_f, mf + tl.log(tl.maximum(s_f, 1e-30)), ninf)
                z_r = tl.where(has_r, mr + tl.log(tl.maximum(s_r, 1e-30)), ninf)
                ff = tl.where(has_f, s_ff / tl.maximum(s_f * s_f, 1e-30), 0.0)
                rr = tl.where(has_r, s_rr / tl.maximum(s_r * s_r, 1e-30), 0.0)
                fr = tl.where(has_f & has_r, s_fr / tl.maximum(s_f * s_r, 1e-30), 0.0)
                lam = (ff - fr) / tl.maximum(ff - 2.0 * fr + rr, eps)
                lam = tl.minimum(tl.maximum(lam, 0.0), lambda_max)
                coef_f = tl.where(has_f & (lam < 1.0), tl.log(tl.maximum(1.0 - lam, 1e-30)) - z_f, ninf)
                coef_r = tl.where(has_r & (lam > 0.0), tl.log(tl.maximum(lam, 1e-30)) - z_r, ninf)
                # an upper bound of every score of the head: Soft-NMS and exclusivity only lower the fused one
                u1 = coef_f + mf
                u2 = coef_r + mr
                mx = tl.maximum(u1, u2)
                mn = tl.minimum(u1, u2)
                m_up = tl.where(mx == ninf, ninf, mx + tl.log(1.0 + tl.exp(mn - mx)))
                cb = consts_ptr + pid.to(tl.int64) * 4
                tl.store(cb + 0, coef_f)
                tl.store(cb + 1, coef_r)
                tl.store(cb + 2, m_up)
                tl.store(cb + 3, lam)
                if PREP_TOPK:
                    tl.store(hist_ptr + pid.to(tl.int64) * NB + tl.arange(0, NB), tl.zeros([NB], dtype=tl.int32))
                    tl.store(cnt_ptr + pid, 0)
            else:
                if WRITE_LAM:
                    tl.store(consts_ptr + pid.to(tl.int64) * 4 + 3, 0.0)   # lam of an empty set (the twin's 0)

    # ------------------------------------------------------------------------------ 3. scores
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _score_kernel(COUNT, ROWS, NC, ev_ptr, s_ev_b, s_ev_h, s_ev_l, kn_ptr, s_kn_b, s_kn_h, s_kn_l,
                      lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width,
                      consts_ptr, out_ptr, s_out_b, s_out_h, scr_ptr,
                      H, L, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps,
                      mu, inv_temp, lam_x, log_eps,
                      T: tl.constexpr, H_PAD: tl.constexpr, RADIUS: tl.constexpr, SPAN: tl.constexpr,
                      SPAN_BACK: tl.constexpr, HALO_L: tl.constexpr, HALO_R: tl.constexpr, OUT: tl.constexpr, DO_NMS: tl.constexpr, DO_X: tl.constexpr,
                      NMS_GW: tl.constexpr, SPAN_GW: tl.constexpr, NMS_KL: tl.constexpr, SPAN_KL: tl.constexpr,
                      K_TENSOR: tl.constexpr, SKIP_ALL: tl.constexpr, GATHER: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * NC, tl.num_programs(0)):
            row = _i32(it) // NC
            c = _i32(it) % NC
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            q0 = c * OUT                                   # this program writes positions [q0, q0 + OUT)
            active = (q0 < hi) & (q0 + OUT > lo)
            if SKIP_ALL:                                   # rows that take all of A (or nothing) need no scores
                k_eff = _keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR)
                active = active & (k_eff > 0) & (k_eff < hi - lo)
            if active:
                ninf = float("-inf")
                den = tl.maximum(hi - lo - 1, 1)
                i = tl.arange(0, T)
                offs = q0 - HALO_L + i
                hs = tl.arange(0, H_PAD)
                hm = hs < H
                in_a = (offs >= lo) & (offs < hi)
                m2 = hm[:, None] & in_a[None, :]
                rb = row.to(tl.int64)
                hb = hs.to(tl.int64)[:, None]
                lf = tl.load(ev_ptr + rb * s_ev_b + hb * s_ev_h + offs[None, :] * s_ev_l, mask=m2,
                             other=ninf).to(tl.float32)
                kn = tl.load(kn_ptr + rb * s_kn_b + hb * s_kn_h + offs[None, :] * s_kn_l, mask=m2,
                             other=1.0).to(tl.float32)
                cb = consts_ptr + (rb * H + hs) * 4
                coef_f = tl.load(cb + 0, mask=hm, other=ninf)
                coef_r = tl.load(cb + 1, mask=hm, other=ninf)
                lp = _pos_prior(offs, lo, den, w_pos, pos_power, pos_eta, pos_beta, eps)
                lr = w_k * (-gamma_k * tl.log(tl.maximum(kn, eps))) + lp[None, :]
                # fused log s = logaddexp(log(1 - lam) + log f, log(lam) + log r), normalisations folded in
                u1 = coef_f[:, None] + lf
                u2 = coef_r[:, None] + lr
                mx = tl.maximum(u1, u2)
                mn = tl.minimum(u1, u2)
                l = tl.where(m2 & (mx > ninf), mx + tl.log(1.0 + tl.exp(mn - mx)), ninf)
                scr = scr_ptr + (rb * NC + c) * (H_PAD * T)     # unused with GATHER
                if DO_NMS:
                    m = _window_max(l, RADIUS, RADIUS, T, H_PAD, NMS_GW, 2 * RADIUS, NMS_KL, GATHER, scr)
                    fin = l > ninf
                    l = tl.where(fin, l - mu * tl.maximum(m - l, 0.0), ninf)
                if DO_X:
                    z = l * inv_temp
                    zm = tl.max(z, axis=0)
                    zs = tl.where(zm == ninf, 0.0, zm)
                    lse = zs + tl.log(tl.sum(tl.exp(z - zs[None, :]), axis=0))
                    fin = l > ninf
                    log_rho = tl.where(fin, z - lse[None, :], 0.0)
                    l = tl.where(fin, l + lam_x * tl.maximum(log_rho, log_eps), ninf)
                l = tl.where(l != l, ninf, l)
                if SPAN + SPAN_BACK > 0:                   # sfi.select_span(_back): max over [j - span, j + back] in A
                    l = tl.where(m2, _window_max(l, SPAN, SPAN_BACK, T, H_PAD, SPAN_GW, SPAN + SPAN_BACK, SPAN_KL,
                                                 GATHER, scr), ninf)
                om = m2 & ((i >= HALO_L) & (i < HALO_L + OUT))[None, :]
                tl.store(out_ptr + rb * s_out_b + hb * s_out_h + offs[None, :], l, mask=om)

    # ----------------------------------------------------------------- 3b. excluded positions
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _exclude_kernel(COUNT, ROWS, score_ptr, s_sc_b, s_sc_h, ex_ptr, s_ex_b, s_ex_h, s_ex_e, E, slot_ptr,
                        n_ex_ptr, lo_ptr, s_lo, hi_ptr, s_hi, H, L, tab_ptr, s_tab, tab_first, s_ex_c,
                        PAGE_ELEMS, PAGE_TOKENS, PAGE_C, BLOCK: tl.constexpr,
                        HAS_COUNT: tl.constexpr, HAS_SLOT: tl.constexpr, HAS_N: tl.constexpr,
                        PAGED: tl.constexpr):
        # sfi.keep_prefill: the kept positions of a (row, head) score -inf before the top-K (the twin's
        # exclude_positions); padding (< 0) and positions outside A are ignored. PAGED: the table is
        # kept in KV-cache pages (``vllm_ext.kernels.paged_rows``): element h * E + e of a slot's
        # [H, E] rows lives in block tab[slot, tab_first + f // PAGE_ELEMS] of the page memory
        # ``ex_ptr [blocks, heads, PAGE_TOKENS, PAGE_C]``
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * H, tl.num_programs(0)):
            pid = _i32(it)
            row = pid // H
            h = pid % H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            sc = score_ptr + row.to(tl.int64) * s_sc_b + h.to(tl.int64) * s_sc_h
            entry = row
            if HAS_SLOT:                                   # a table indexed by the row's slot
                entry = tl.load(slot_ptr + row)
                hi = tl.where(entry >= 0, hi, lo)
                entry = tl.maximum(entry, 0)
            ex = ex_ptr + entry.to(tl.int64) * s_ex_b + h.to(tl.int64) * s_ex_h
            n_e = E
            if HAS_N:                                      # only the row's first n entries count
                n_e = tl.minimum(tl.maximum(tl.load(n_ex_ptr + row), 0), E)
            ar = tl.arange(0, BLOCK)
            for e0 in range(0, E, BLOCK):
                e = e0 + ar
                if PAGED:
                    f = h * E + e
                    r = f % PAGE_ELEMS
                    blk = tl.load(tab_ptr + entry.to(tl.int64) * s_tab + tab_first + f // PAGE_ELEMS,
                                  mask=e < n_e, other=0)
                    addr = (ex_ptr + blk.to(tl.int64) * s_ex_b + (r // (PAGE_TOKENS * PAGE_C)) * s_ex_h
                            + ((r // PAGE_C) % PAGE_TOKENS) * s_ex_e + (r % PAGE_C) * s_ex_c)
                    pos = tl.load(addr, mask=e < n_e, other=-1)
                else:
                    pos = tl.load(ex + e * s_ex_e, mask=e < n_e, other=-1)
                ok = (e < n_e) & (pos >= lo) & (pos < hi)
                tl.store(sc + pos, tl.full([BLOCK], float("-inf"), tl.float32), mask=ok)

    # ------------------------------------------------------------------------- 4. histogram
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _hist_kernel(COUNT, ROWS, NC, score_ptr, s_sc_b, s_sc_h, consts_ptr, hist_ptr, lo_ptr, s_lo, hi_ptr,
                     s_hi,
                     k_ptr, s_k, k_val, k_min, width, H, L, CHUNK,
                     NB: tl.constexpr, BLOCK: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * (H * NC), tl.num_programs(0)):
            pid = _i32(it) // NC
            c = _i32(it) % NC
            row = pid // H
            h = pid % H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            n_sel = tl.minimum(_keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR), hi - lo)
            c0 = tl.maximum(c * CHUNK, lo)
            c1 = tl.minimum(c * CHUNK + CHUNK, hi)
            if (c0 < c1) & (n_sel > 0) & (n_sel < hi - lo):
                sc = score_ptr + row.to(tl.int64) * s_sc_b + h.to(tl.int64) * s_sc_h
                m_up = tl.load(consts_ptr + pid.to(tl.int64) * 4 + 2)
                ar = tl.arange(0, BLOCK)
                acc = tl.zeros([NB], dtype=tl.int32)
                for j0 in range(c * CHUNK, c1, BLOCK):          # blocks aligned to absolute positions
                    offs = j0 + ar
                    lm = (offs >= c0) & (offs < c1)
                    s = tl.load(sc + offs, mask=lm, other=0.0)
                    acc += tl.histogram(_bucket(s, m_up), NB, mask=lm)
                bins = tl.arange(0, NB)
                tl.atomic_add(hist_ptr + pid.to(tl.int64) * NB + bins, acc, mask=acc > 0)

    # --------------------------------------------------------------------------- 5. compaction
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _compact_kernel(COUNT, ROWS, NC, score_ptr, s_sc_b, s_sc_h, consts_ptr, hist_ptr, cnt_ptr, cand_ptr,
                        above_ptr,
                        lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK, CW_WS,
                        CAP, NB: tl.constexpr, BLOCK: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * (H * NC), tl.num_programs(0)):
            pid = _i32(it) // NC
            c = _i32(it) % NC
            row = pid // H
            h = pid % H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            n_sel = tl.minimum(_keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR), hi - lo)
            c0 = tl.maximum(c * CHUNK, lo)
            c1 = tl.minimum(c * CHUNK + CHUNK, hi)
            if (c0 < c1) & (n_sel > 0) & (n_sel < hi - lo):
                sc = score_ptr + row.to(tl.int64) * s_sc_b + h.to(tl.int64) * s_sc_h
                m_up = tl.load(consts_ptr + pid.to(tl.int64) * 4 + 2)
                bstar, n_above = _threshold_bucket(hist_ptr + pid.to(tl.int64) * NB, n_sel, NB)
                cand_base = cand_ptr + pid.to(tl.int64) * CAP
                ar = tl.arange(0, BLOCK)
                above = tl.zeros([], dtype=tl.int32)
                for j0 in range(c * CHUNK, c1, BLOCK):
                    offs = j0 + ar
                    lm = (offs >= c0) & (offs < c1)
                    b = _bucket(tl.load(sc + offs, mask=lm, other=0.0), m_up)
                    above += tl.sum((lm & (b < bstar)).to(tl.int32), axis=0)
                    cand = lm & (b == bstar)
                    ci = cand.to(tl.int32)
                    nc = tl.sum(ci, axis=0)
                    if nc > 0:
                        slot = tl.atomic_add(cnt_ptr + pid, nc) + tl.cumsum(ci, 0) - ci
                        tl.store(cand_base + slot, offs, mask=cand & (slot < CAP))
                tl.store(above_ptr + pid.to(tl.int64) * CW_WS + c, above)

    # ---------------------------------------------------------------- 6. exact select + offsets
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _finish_kernel(COUNT, ROWS, score_ptr, s_sc_b, s_sc_h, consts_ptr, hist_ptr, cnt_ptr, cand_ptr,
                       above_ptr,
                       prefix_ptr, thresh_ptr, sel_ptr, nsel_ptr, nprev_ptr,
                       lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK, CW_WS,
                       CAP, NB: tl.constexpr, BLOCK: tl.constexpr, CW_PAD: tl.constexpr,
                       POS_LEVELS: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        n_live = _n_live(COUNT, ROWS, HAS_COUNT)
        for it in range(tl.program_id(0), ROWS * H, tl.num_programs(0)):   # every row: n_sel, padding
            pid = _i32(it)
            row = pid // H
            h = pid % H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            if HAS_COUNT:                               # rows past the live prefix: empty
                hi = tl.where(row < n_live, hi, lo)
            n = hi - lo
            n_sel = tl.minimum(_keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR), n)
            n_sel = tl.maximum(n_sel, 0)
            if h == 0:
                tl.store(nsel_ptr + row, n_sel)
            # -1 padding: only what the previous call wrote past n_sel (entries >= n_prev are -1 already)
            n_prev = tl.load(nprev_ptr + pid)
            if n_prev != n_sel:
                ob = sel_ptr + pid.to(tl.int64) * width
                arb = tl.arange(0, BLOCK)
                for w0 in range(n_sel, n_prev, BLOCK):
                    idx = w0 + arb
                    tl.store(ob + idx, tl.full([BLOCK], -1, tl.int32), mask=idx < n_prev)
                tl.store(nprev_ptr + pid, n_sel)
            if (n_sel > 0) & (n_sel < n):
                sc = score_ptr + row.to(tl.int64) * s_sc_b + h.to(tl.int64) * s_sc_h
                m_up = tl.load(consts_ptr + pid.to(tl.int64) * 4 + 2)
                bstar, n_above = _threshold_bucket(hist_ptr + pid.to(tl.int64) * NB, n_sel, NB)
                cnt = tl.load(cnt_ptr + pid)
                list_mode = cnt <= CAP                      # else the list overflowed: scan all of A
                n_items = tl.where(list_mode, cnt, n)
                cand_base = cand_ptr + pid.to(tl.int64) * CAP
                ar = tl.arange(0, BLOCK)
                bins = tl.arange(0, NB)

                # radix select over the candidates' keys: the (n_sel - n_above)-th largest, 8 bits a pass
                prefix = tl.zeros([], dtype=tl.uint32)
                remaining = n_sel - n_above
                eq_total = tl.zeros([], dtype=tl.int32)
                for p in tl.static_range(4):
                    shift = 24 - 8 * p
                    acc = tl.zeros([NB], dtype=tl.int32)
                    for t0 in range(0, n_items, BLOCK):
                        idx = t0 + ar
                        im = idx < n_items
                        pos = tl.load(cand_base + idx, mask=im & list_mode, other=0)
                        pos = tl.where(list_mode, pos, lo + idx)
                        s = tl.load(sc + pos, mask=im, other=0.0)
                        key = _key(s)
                        match = im & (_bucket(s, m_up) == bstar)
                        if p > 0:
                            match = match & ((key >> (shift + 8)) == prefix)
                        acc += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), NB, mask=match)
                    cge = tl.cumsum(acc, 0, reverse=True)     # candidates with digit >= d
                    dsel = tl.max(tl.where(cge >= remaining, bins, 0), axis=0)
                    remaining = remaining - tl.sum(tl.where(bins == dsel, cge - acc, 0), axis=0)
                    eq_total = tl.sum(tl.where(bins == dsel, acc, 0), axis=0)
                    prefix = (prefix << 8) | dsel.to(tl.uint32)
                t_key = prefix

                # ties at T: the `remaining` lowest positions among them (radix select over positions)
                p_tie = tl.full([], 2147483647, tl.int32)
                if remaining < eq_total:
                    pprefix = tl.zeros([], dtype=tl.int32)
                    r = remaining
                    for p in tl.static_range(POS_LEVELS):
                        pshift = 8 * (POS_LEVELS - 1 - p)
                        acc = tl.zeros([NB], dtype=tl.int32)
                        for t0 in range(0, n_items, BLOCK):
                            idx = t0 + ar
                            im = idx < n_items
                            pos = tl.load(cand_base + idx, mask=im & list_mode, other=0)
                            pos = tl.where(list_mode, pos, lo + idx)
                            s = tl.load(sc + pos, mask=im, other=0.0)
                            match = im & (_key(s) == t_key)
                            if p > 0:
                                match = match & ((pos >> (pshift + 8)) == pprefix)
                            acc += tl.histogram((pos >> pshift) & 0xFF, NB, mask=match)
                        cle = tl.cumsum(acc, 0)                 # ties with digit <= d
                        dsel = tl.min(tl.where(cle >= r, bins, NB - 1), axis=0)
                        r = r - tl.sum(tl.where(bins == dsel, cle - acc, 0), axis=0)
                        pprefix = (pprefix << 8) | dsel
                    p_tie = pprefix
                tb = thresh_ptr + pid.to(tl.int64) * 2
                tl.store(tb + 0, t_key.to(tl.int32, bitcast=True))
                tl.store(tb + 1, p_tie)

                # output offset of every chunk: selected scores in the chunks before it
                cs = tl.arange(0, CW_PAD)
                chist = tl.zeros([CW_PAD], dtype=tl.int32)
                for t0 in range(0, n_items, BLOCK):
                    idx = t0 + ar
                    im = idx < n_items
                    pos = tl.load(cand_base + idx, mask=im & list_mode, other=0)
                    pos = tl.where(list_mode, pos, lo + idx)
                    s = tl.load(sc + pos, mask=im, other=0.0)
                    key = _key(s)
                    sel = im & (_bucket(s, m_up) == bstar) & ((key > t_key) | ((key == t_key) & (pos <= p_tie)))
                    chist += tl.histogram(pos // CHUNK, CW_PAD, mask=sel)
                cm = (cs >= lo // CHUNK) & (cs < (hi + CHUNK - 1) // CHUNK)
                above = tl.load(above_ptr + pid.to(tl.int64) * CW_WS + cs, mask=cm, other=0)
                tot = tl.where(cm, above + chist, 0)
                tl.store(prefix_ptr + pid.to(tl.int64) * CW_WS + cs, tl.cumsum(tot, 0) - tot, mask=cm)

    # ---------------------------------------------------------------------------------- 7. write
    @triton.jit(do_not_specialize=["ROWS"])  # ROWS varies per step: one compile
    def _write_kernel(COUNT, ROWS, NC, score_ptr, s_sc_b, s_sc_h, thresh_ptr, prefix_ptr, sel_ptr,
                      lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK, CW_WS,
                      BLOCK: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * (H * NC), tl.num_programs(0)):
            pid = _i32(it) // NC
            c = _i32(it) % NC
            row = pid // H
            h = pid % H
            lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
            n = hi - lo
            n_sel = tl.minimum(_keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR), n)
            c0 = tl.maximum(c * CHUNK, lo)
            c1 = tl.minimum(c * CHUNK + CHUNK, hi)
            if (c0 < c1) & (n_sel > 0):
                ob = sel_ptr + pid.to(tl.int64) * width
                ar = tl.arange(0, BLOCK)
                if n_sel >= n:                                  # all of A
                    for j0 in range(c0, c1, BLOCK):
                        offs = j0 + ar
                        tl.store(ob + (offs - lo), offs, mask=offs < c1)
                else:
                    sc = score_ptr + row.to(tl.int64) * s_sc_b + h.to(tl.int64) * s_sc_h
                    t_key = tl.load(thresh_ptr + pid.to(tl.int64) * 2).to(tl.uint32, bitcast=True)
                    p_tie = tl.load(thresh_ptr + pid.to(tl.int64) * 2 + 1)
                    dst0 = tl.load(prefix_ptr + pid.to(tl.int64) * CW_WS + c)
                    for j0 in range(c * CHUNK, c1, BLOCK):
                        offs = j0 + ar
                        lm = (offs >= c0) & (offs < c1)
                        key = _key(tl.load(sc + offs, mask=lm, other=0.0))
                        sel = lm & ((key > t_key) | ((key == t_key) & (offs <= p_tie)))
                        si = sel.to(tl.int32)
                        tl.store(ob + dst0 + tl.cumsum(si, 0) - si, offs, mask=sel)
                        dst0 += tl.sum(si, axis=0)


# ------------------------------------------------------------------------------------- host side
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

    def __init__(self, lo, hi, k, k_val, k_min, width, k_tensor, rows, heads, length, cfg, ws, span,
                 skip_all, count=None, span_back=0):
        self.lo, self.hi, self.k = lo, hi, k
        self.s_lo = _row_stride(lo, rows, "lo")
        self.s_hi = _row_stride(hi, rows, "hi")
        self.s_k = _row_stride(k, rows, "k") if k_tensor else 0
        self.k_val, self.k_min, self.width, self.k_tensor = k_val, k_min, width, k_tensor
        self.rows, self.heads, self.length, self.cfg, self.ws = rows, heads, length, cfg, ws
        self.h_pad = max(2, _next_pow2(heads))
        self.span, self.span_back = span, span_back
        self.skip_all = skip_all
        self.count = count
        self.progs = 2 * triton_utils.num_sms(ws.device)

    def grid(self, per_row: int) -> tuple[int]:
        """1-D grid of a launch whose work is ``per_row`` items per row: one program per item of every
        row without ``count``; with it a fixed grid (at most ``2 x SMs`` programs) that walks only the
        items of the live rows ``[0, count)`` (read on the device)."""
        total = max(1, self.rows * int(per_row))
        return (total,) if self.count is None else (min(total, self.progs),)

    def live(self) -> tuple:
        """The kernels' leading ``COUNT, ROWS`` (``COUNT`` is never read without ``count``)."""
        return (self.count if self.count is not None else self.lo, self.rows)

    def bounds(self):
        return (self.lo, self.s_lo, self.hi, self.s_hi)

    def kargs(self):
        return (self.k, self.s_k, self.k_val, self.k_min, self.width)


def _pool(evidence: torch.Tensor, a: _Args) -> torch.Tensor:
    """4-D evidence -> pooled unnormalised log f ``[rows, heads, L_ws]`` (the workspace's, allocated
    on first use)."""
    ws = a.ws
    if ws.pooled is None:
        ws.pooled = torch.empty((ws.rows, ws.heads, max(ws.length, 1)), dtype=torch.float32, device=ws.device)
    out = ws.pooled
    n_rows = evidence.shape[2]
    r_pad = max(2, _next_pow2(n_rows))
    _pool_kernel[a.grid(a.heads)](
        *a.live(), evidence, *evidence.stride(), out, out.stride(0), out.stride(1), *a.bounds(),
        a.heads, a.length, n_rows, math.log(max(n_rows, 1)), float(a.cfg.alpha), 1.0 / float(a.cfg.alpha),
        R_PAD=r_pad, BLOCK_L=max(16, min(1024, 4096 // r_pad)), HAS_COUNT=a.count is not None)
    return out[:a.rows, :, :a.length]


def _scores(evidence: torch.Tensor, key_norms: torch.Tensor, a: _Args, prep_topk: bool) -> None:
    """Steps 0-3: the final scores into ``ws.score`` (positions of A only), ``lam`` into ``ws.consts``."""
    ws, cfg, tiles = a.ws, a.cfg, ws_tiles(a.ws)
    if evidence.dim() == 4:
        evidence = _pool(evidence, a)
    s_ev = evidence.stride()
    s_kn = key_norms.stride()
    prior = (float(cfg.gamma_k), float(cfg.w_k), float(cfg.w_pos), float(cfg.pos_power), float(cfg.pos_eta),
             float(cfg.pos_beta), float(cfg.eps))
    # steps 1-3 have no inner loop: their item loop is the innermost one, and num_stages=1 keeps the
    # compiler from software-pipelining it (prefetching the next item's tiles), as before the loop
    t1 = _tile_t1(a.heads, tiles)
    c1 = -(-a.length // t1)
    c1_ws = ws.stats.shape[2]
    _stats_kernel[a.grid(c1)](
        *a.live(), c1,
        evidence, s_ev[0], s_ev[1], s_ev[2], key_norms, s_kn[0], s_kn[1], s_kn[2], *a.bounds(), *a.kargs(),
        ws.stats, c1_ws, a.heads, a.length, *prior,
        T=t1, H_PAD=a.h_pad, K_TENSOR=a.k_tensor, SKIP_ALL=a.skip_all, HAS_COUNT=a.count is not None,
        num_warps=tiles.warps_stats, num_stages=1)
    _merge_kernel[a.grid(a.heads)](
        *a.live(), ws.stats, c1_ws, ws.consts, ws.hist, ws.cand_cnt, *a.bounds(), *a.kargs(), a.heads, a.length,
        float(cfg.lambda_max), float(cfg.eps),
        T1=t1, C1_PAD=max(2, _next_pow2(c1_ws)), NB=NUM_BUCKETS, K_TENSOR=a.k_tensor, SKIP_ALL=a.skip_all,
        PREP_TOPK=prep_topk, WRITE_LAM=not prep_topk, HAS_COUNT=a.count is not None, num_warps=tiles.warps_row,
        num_stages=1)
    halo_l, halo_r, do_nms = _halos(cfg, a.span, a.span_back)
    t2 = _tile_t2(a.heads, halo_l, halo_r, tiles)
    out_per = t2 - halo_l - halo_r
    c2 = -(-a.length // out_per)
    radius = int(cfg.nms_radius) if do_nms else 0
    do_x = a.heads > 2 and cfg.lam_x != 0.0
    sc = ws.score
    if tiles.gather:
        scr = sc                                   # not read
    else:
        need = a.rows * c2 * a.h_pad * t2
        if ws.scratch is None or ws.scratch.numel() < need:
            ws.scratch = torch.empty(need, dtype=torch.float32, device=ws.device)
        scr = ws.scratch
    _score_kernel[a.grid(c2)](
        *a.live(), c2,
        evidence, s_ev[0], s_ev[1], s_ev[2], key_norms, s_kn[0], s_kn[1], s_kn[2], *a.bounds(), *a.kargs(),
        ws.consts, sc, sc.stride(0), sc.stride(1), scr, a.heads, a.length, *prior,
        float(cfg.mu), 1.0 / float(cfg.cross_head_temperature), float(cfg.lam_x), math.log(cfg.eps),
        T=t2, H_PAD=a.h_pad, RADIUS=radius, SPAN=a.span, SPAN_BACK=a.span_back, HALO_L=halo_l, HALO_R=halo_r,
        OUT=out_per, DO_NMS=do_nms, DO_X=do_x, NMS_GW=_gw(radius, radius), SPAN_GW=_gw(a.span, a.span_back),
        NMS_KL=(2 * radius + 1).bit_length() - 1, SPAN_KL=(a.span + a.span_back + 1).bit_length() - 1,
        K_TENSOR=a.k_tensor,
        SKIP_ALL=a.skip_all, GATHER=tiles.gather, HAS_COUNT=a.count is not None, num_warps=tiles.warps_score,
        num_stages=1)


def ws_tiles(ws: SelectorWorkspace) -> Tiles:
    return ws.tiles if ws.tiles is not None else TILES


def _topk(a: _Args) -> None:
    """Steps 4-7: top-K of ``ws.score`` into ``ws.selected`` / ``ws.n_sel``."""
    ws, tiles = a.ws, ws_tiles(a.ws)
    sc = ws.score
    cw = -(-a.length // tiles.chunk)
    cw_ws = ws.above.shape[2]
    common = (a.heads, a.length, tiles.chunk)
    grid = a.grid(a.heads * cw)
    live = (*a.live(), cw)
    has_count = a.count is not None
    _hist_kernel[grid](*live, sc, sc.stride(0), sc.stride(1), ws.consts, ws.hist, *a.bounds(), *a.kargs(), *common,
                       NB=NUM_BUCKETS, BLOCK=tiles.block, K_TENSOR=a.k_tensor, HAS_COUNT=has_count,
                       num_warps=tiles.warps_row)
    _compact_kernel[grid](*live, sc, sc.stride(0), sc.stride(1), ws.consts, ws.hist, ws.cand_cnt, ws.cand,
                          ws.above, *a.bounds(), *a.kargs(), *common, cw_ws, ws.cap,
                          NB=NUM_BUCKETS, BLOCK=tiles.block, K_TENSOR=a.k_tensor, HAS_COUNT=has_count,
                          num_warps=tiles.warps_row)
    pos_levels = max(1, -(-max(1, (a.length - 1).bit_length()) // 8))
    # every row (not only the live ones): n_sel and the -1 padding of the rows past count are kept
    # right (n_sel = 0; what a previous call wrote is reset), as for any inactive row
    fgrid = (a.rows * a.heads,) if a.count is None else (min(a.rows * a.heads, a.progs),)
    _finish_kernel[fgrid](
        *a.live(), sc, sc.stride(0), sc.stride(1), ws.consts, ws.hist, ws.cand_cnt, ws.cand, ws.above, ws.prefix,
        ws.thresh, ws.selected, ws.n_sel, ws.n_prev, *a.bounds(), *a.kargs(), *common, cw_ws, ws.cap,
        NB=NUM_BUCKETS, BLOCK=tiles.block_finish, CW_PAD=max(32, _next_pow2(cw_ws)), POS_LEVELS=pos_levels,
        K_TENSOR=a.k_tensor, HAS_COUNT=has_count, num_warps=tiles.warps_finish)
    _write_kernel[grid](*live, sc, sc.stride(0), sc.stride(1), ws.thresh, ws.prefix, ws.selected,
                        *a.bounds(), *a.kargs(), *common, cw_ws,
                        BLOCK=tiles.block, K_TENSOR=a.k_tensor, HAS_COUNT=has_count, num_warps=tiles.warps_row)


def selector_scores_triton(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor,
                           hi: torch.Tensor, cfg: SfiConfig, *, fill_outside: bool = True,
                           workspace: SelectorWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 in Triton: refined scores ``[rows, Hkv, L]`` fp32 and ``lam [rows, Hkv]``.

    Outside ``A`` the scores are ``-inf`` with ``fill_outside`` (as the twin), else unspecified."""
    rows, heads, length = _prepare(evidence, key_norms)
    device = key_norms.device
    ws = workspace if workspace is not None else selector_workspace(rows, heads, length, cfg.k_min, device, cfg,
                                                                       triton_buffers=True)
    _check_workspace(ws, rows, heads, length, ws.width, device, True)
    if fill_outside:
        ws.score[:rows, :, :length].fill_(float("-inf"))
    if rows == 0 or heads == 0 or length == 0:
        return ws.score[:rows, :, :length], ws.consts[:rows, :, 3].zero_()
    lo = _int_arg(lo, device, "lo")
    hi = _int_arg(hi, device, "hi")
    a = _Args(lo, hi, lo, 0, 0, 1, False, rows, heads, length, cfg, ws, 0, False)
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
    sc = a.ws.score
    if paged:
        pages = exclude.pages
        mem, strides = pages, pages.stride()
        tab, s_tab, first = exclude.table, exclude.table.stride(0), exclude.first
        _, p_tokens, p_c = exclude.page_dims
        p_elems = exclude.page_elems
    else:
        mem, strides = exclude, (*exclude.stride(), 0)
        tab, s_tab, first, p_elems, p_tokens, p_c = a.lo, 0, 0, 1, 1, 1
    _exclude_kernel[a.grid(a.heads)](
        *a.live(), sc, sc.stride(0), sc.stride(1), mem, *strides[:3], n_e,
        slot if slot is not None else a.lo, n_ex if n_ex is not None else a.lo, *a.bounds(), a.heads, a.length,
        tab, s_tab, first, strides[3], p_elems, p_tokens, p_c,
        BLOCK=min(1024, max(16, _next_pow2(n_e))), HAS_COUNT=a.count is not None, HAS_SLOT=slot is not None,
        HAS_N=n_ex is not None, PAGED=paged)


def select_triton(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  cfg: SfiConfig, k: int | torch.Tensor, *, k_cap: int | None = None,
                  workspace: SelectorWorkspace | None = None,
                  count: torch.Tensor | None = None,
                  exclude: torch.Tensor | None = None,
                  exclude_slot: torch.Tensor | None = None,
                  exclude_count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`vllm_ext.kernels.sfi_selector_torch.select` (same arguments and results).

    ``workspace``: see :func:`selector_workspace`; without one the buffers are allocated here.

    ``count`` (an int32 / int64 tensor of one element, read on the device only): the rows are a
    compacted list whose rows ``[0, count)`` are live and the rest inactive (``lo = hi``). Every
    launch then runs a fixed grid (at most ``2 x SMs`` programs) that walks only the live rows'
    chunks, so a call with ``count = 0`` costs one small wave per launch instead of grids that grow
    with ``L``. The results are those of ``count=None`` for such rows: the rows past ``count`` get
    ``n_sel = 0`` (their output is written only to reset what an earlier call left there), whatever
    their ``lo`` / ``hi``."""
    rows, heads, length = _prepare(evidence, key_norms)
    device = key_norms.device
    width = _width(k, cfg, k_cap)
    ws = workspace if workspace is not None else selector_workspace(rows, heads, length, width, device, cfg,
                                                                       triton_buffers=True)
    _check_workspace(ws, rows, heads, length, width, device, True)
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
    if isinstance(k, torch.Tensor):
        kt = _int_arg(k, device, "k")
        a = _Args(lo, hi, kt, 0, int(cfg.k_min), width, True, rows, heads, length, cfg, ws,
                  int(cfg.select_span), True, count, int(cfg.select_span_back))
    else:
        a = _Args(lo, hi, lo, width, int(cfg.k_min), width, False, rows, heads, length, cfg, ws,
                  int(cfg.select_span), True, count, int(cfg.select_span_back))
    _scores(evidence, key_norms, a, prep_topk=True)
    if exclude is not None:
        _exclude(exclude if isinstance(exclude, PagedRows) else exclude.to(device=device, dtype=torch.int32),
                 None if exclude_slot is None else _int_arg(exclude_slot, device, "exclude_slot"),
                 None if exclude_count is None else _int_arg(exclude_count, device, "exclude_count"), a)
    _topk(a)
    return selected, n_sel
