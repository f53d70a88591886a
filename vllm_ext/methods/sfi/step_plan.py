"""Per-step SFI plan on the device: which decode rows are dense, slow or fast, the index ranges every
layer's kernels read, and the fixed-capacity compacted list of the slow rows that maintenance
(evidence, key norms, selector, gather) runs over (ALGORITHMS.md §1). Built once per step by the
metadata builder into persistent buffers (plan/run: the layers and a captured CUDA graph read the
same addresses every step); pure tensor code with fixed shapes, no host synchronisation.

Row modes (decode rows of requests with SFI on and a compact slot; every other row is ``dense``):
- dense: ``t <= n_sink + n_recent + k`` (the sparse set is the whole history) — exactly dense —
  or ``t <= min_len`` (``sfi.min_len``: too short for sparse steps to pay);
- slow: the schedule says so (sentence boundary, refresh budget, no selection yet): dense attention plus
  evidence, then the selector and the gather refresh the compact segment;
- fast: attention over the compact segment (sink + selected) and the recent window in place.

With ``sfi.selector = "quest"`` a slow row is a *selection* row that does not attend densely: it
scores the pages, refreshes its compact segment at once and then attends like a fast row, so the
plan marks it both slow and fast (``row_fast = row_sparse``). The counters follow what is read:
``sfi.fast_*`` (steps, retained and context tokens, the histogram) cover every row that attends over
sink + selected + recent (selection rows with the selection made in the step), and
``sfi.slow_steps`` counts the selections (a subset of ``sfi.fast_steps`` in this mode).
``row_page_slot`` (every mode) is the compact slot of each decode row of a request holding one (the
exactly-dense rows included), -1 elsewhere: quest mode keeps those requests' page max/min of K.

Slow rows are compacted, in row order, into ``slow_rows[:S]`` (``S`` = the SFI request capacity, so
the list never overflows: every sparse row holds its own compact slot); ``row_scratch[row] = e`` is
row ``slow_rows[e]``'s entry. Maintenance runs over the list in chunks of ``B`` entries
(``sfi.maintenance_rows``, the rows its scratch holds): chunk ``c`` is entries ``[c*B, (c+1)*B)``, its
live-entry count ``slow_chunk_count[c, 0]`` (``clamp(count - c*B, 0, B)``; one 16-byte row per chunk,
so every chunk's count pointer has the same alignment, i.e. the same Triton compile key). The entry
buffers are padded to whole chunks, so every chunk launches the same shapes. Unused entries have
``slow_rows = -1``, ``slow_sfi_slot = -1`` and an empty allowed set, so maintenance kernels launched
over a chunk exit at once for them: cost follows the slow rows, not the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.methods.sfi.config import MIN_MAINTENANCE_ROWS, SfiConfig
from vllm_ext.methods.sfi.prompt_tail import SfiPrefillEnd  # noqa: F401  (the plan's prefill-end part)
from vllm_ext.methods.sfi.schedule import allowed_range, decide_slow, mark_selected, needs_trigger_state

# the plan's device counters: their layout is the plan kernel's (a lower layer of the imports)
from vllm_ext.kernels.sfi_plan import (NUM_STATS, RETAINED_FRACTION_BOUNDS_PCT, STAT_CONTEXT,  # noqa: E402,F401
                                       STAT_COPY, STAT_DENSE, STAT_FAST, STAT_PREFILL_END, STAT_RETAINED,
                                       STAT_RETAINED_FRACTION_PPM, STAT_RETAINED_HIST, STAT_SLOW)


def maintenance_chunk(cfg: SfiConfig, capacity: int) -> int:
    """``B``: the slow entries one maintenance chunk covers (``sfi.maintenance_rows``, at most the
    request capacity ``S``); the plan and the runtime's scratch both use it."""
    rows = cfg.maintenance_rows if cfg.maintenance_rows is not None else MIN_MAINTENANCE_ROWS
    return max(1, min(int(rows), int(capacity)))


@dataclass
class SfiStep:
    """One step's plan: views of :class:`SfiPlanBuffers` (rows ``[:num_rows]``, entries ``[:S]``)."""

    row_slow: torch.Tensor          # bool  [rows]
    row_fast: torch.Tensor          # bool  [rows]
    row_sparse: torch.Tensor        # bool  [rows]: slow | fast
    row_sfi_slot: torch.Tensor      # int32 [rows]: compact-segment slot (0 where not sparse: safe index)
    row_k: torch.Tensor             # int32 [rows]: selection budget per KV head
    recent_start: torch.Tensor      # int32 [rows]: first position of the recent window
    allowed_lo: torch.Tensor        # int32 [rows]: the selector's allowed set [lo, hi)
    allowed_hi: torch.Tensor
    row_dense: torch.Tensor | None = None     # bool  [rows]: neither slow nor fast (padding included)
    row_scratch: torch.Tensor | None = None   # int32 [rows]: evidence slot of a slow row, else -1
    slow_rows: torch.Tensor | None = None     # int32 [S]: row of each evidence slot, -1 = unused
    slow_seq: torch.Tensor | None = None      # int32 [S]: its length (0 unused)
    slow_lo: torch.Tensor | None = None       # int32 [S]: its allowed set (empty unused)
    slow_hi: torch.Tensor | None = None
    slow_k: torch.Tensor | None = None        # int32 [S]: its budget (sfi.keep_prefill: besides the kept)
    slow_sfi_slot: torch.Tensor | None = None  # int32 [S]: its compact slot (-1 unused)
    slow_block_table: torch.Tensor | None = None  # int32 [S, max_blocks]: its block-table row
    # the block table slow_block_table's rows come from (the step's first attention group); a layer
    # of another KV-cache group gathers its own rows (vllm_ext.methods.sfi.path)
    slow_table_source: torch.Tensor | None = None
    slow_count: torch.Tensor | None = None    # int32 [1]: live entries (they are slow_rows[:count])
    slow_kept: torch.Tensor | None = None     # int32 [S]: sfi.keep_prefill: its kept tokens (0 unused)
    # int32 [chunks, 4]: live entries of each chunk of chunk_rows entries (column 0; the rest padding)
    slow_chunk_count: torch.Tensor | None = None
    chunk_rows: int = 0                       # B: entries per maintenance chunk (0: one chunk of S)
    prefill_end: "SfiPrefillEnd | None" = None
    row_page_slot: torch.Tensor | None = None  # int32 [rows]: compact slot of an SFI decode row, else -1
    row_page_first: torch.Tensor | None = None  # int32 [rows]: quest: first page the row (re)writes
    quest_pages: "object | None" = None        # quest mode: the step's prefill page updates (host plan)
    # CPU build, read once per step by the first layer: the decode rows whose output SFI writes (fast
    # rows, and slow rows unless its kernels are the PyTorch twins; the dense pass attends the
    # others) and whether any row is sparse (slow or fast)
    host_sfi_rows: "list[bool] | None" = None
    host_slow_dense: bool = False
    host_any_sparse: "bool | None" = None    # None: not read yet this step


class SfiPlanBuffers:
    """The plan's persistent device buffers, allocated once (``max_rows`` rows, ``capacity`` slow
    entries in chunks of ``chunk_rows``, default one chunk: :func:`maintenance_chunk`; the slow block
    table is sized at the first plan, from the runner's fixed width)."""

    def __init__(self, max_rows: int, capacity: int, device: torch.device,
                 chunk_rows: int | None = None):
        self.max_rows, self.capacity, self.device = max_rows, capacity, device
        self.chunk_rows = max(1, min(chunk_rows or capacity, capacity))
        self.num_chunks = -(-capacity // self.chunk_rows)
        # entries padded to whole chunks (never live: they keep their initial values)
        self.entries = self.num_chunks * self.chunk_rows
        i32 = dict(dtype=torch.int32, device=device)
        b = dict(dtype=torch.bool, device=device)
        n = max_rows
        self.row_slow = torch.zeros(n, **b)
        self.row_fast = torch.zeros(n, **b)
        self.row_sparse = torch.zeros(n, **b)
        self.row_dense = torch.ones(n, **b)
        self.row_sfi_slot = torch.zeros(n, **i32)
        self.row_k = torch.zeros(n, **i32)
        self.recent_start = torch.zeros(n, **i32)
        self.allowed_lo = torch.zeros(n, **i32)
        self.allowed_hi = torch.zeros(n, **i32)
        self.row_scratch = torch.full((n,), -1, **i32)
        self.row_page_slot = torch.full((n,), -1, **i32)
        self.row_page_first = torch.zeros(n, **i32)
        self.row_index = torch.arange(n, **i32)
        # compacted slow entries; index ``capacity`` is a trash entry for scatters of other rows
        s = self.entries + 1
        self.slow_rows = torch.full((s,), -1, **i32)
        self.slow_seq = torch.zeros(s, **i32)
        self.slow_lo = torch.zeros(s, **i32)
        self.slow_hi = torch.zeros(s, **i32)
        self.slow_k = torch.zeros(s, **i32)
        self.slow_sfi_slot = torch.full((s,), -1, **i32)
        self.slow_count = torch.zeros(1, **i32)
        self.slow_kept = torch.zeros(s, **i32)
        self.slow_chunk_count = torch.zeros(self.num_chunks, 4, **i32)
        self.chunk_offsets = torch.arange(0, self.entries, self.chunk_rows, **i32)
        self.slow_block_table: torch.Tensor | None = None
        self.slow_table_source: torch.Tensor | None = None

    def block_table_buffer(self, width: int) -> torch.Tensor:
        if self.slow_block_table is None:
            self.slow_block_table = torch.zeros(self.entries + 1, width, dtype=torch.int32,
                                                device=self.device)
        elif self.slow_block_table.shape[1] != width:
            # the runner's block table width is fixed for its lifetime; a change would leave
            # captured CUDA graphs reading a stale buffer
            raise RuntimeError(f"SPEEDSFI: block-table width changed from "
                               f"{self.slow_block_table.shape[1]} to {width}")
        return self.slow_block_table

    def step_view(self, rows: int) -> SfiStep:
        cap = self.entries
        bt = self.slow_block_table
        return SfiStep(row_slow=self.row_slow[:rows], row_fast=self.row_fast[:rows],
                       row_sparse=self.row_sparse[:rows], row_sfi_slot=self.row_sfi_slot[:rows],
                       row_k=self.row_k[:rows], recent_start=self.recent_start[:rows],
                       allowed_lo=self.allowed_lo[:rows], allowed_hi=self.allowed_hi[:rows],
                       row_dense=self.row_dense[:rows], row_scratch=self.row_scratch[:rows],
                       slow_rows=self.slow_rows[:cap], slow_seq=self.slow_seq[:cap],
                       slow_lo=self.slow_lo[:cap], slow_hi=self.slow_hi[:cap],
                       slow_k=self.slow_k[:cap], slow_sfi_slot=self.slow_sfi_slot[:cap],
                       slow_block_table=None if bt is None else bt[:cap],
                       slow_table_source=self.slow_table_source,
                       slow_count=self.slow_count, slow_kept=self.slow_kept[:cap],
                       slow_chunk_count=self.slow_chunk_count, chunk_rows=self.chunk_rows,
                       row_page_slot=self.row_page_slot[:rows],
                       row_page_first=self.row_page_first[:rows])

    @property
    def nbytes(self) -> int:
        ts = [t for t in vars(self).values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in ts)


def plan_step(cfg: SfiConfig, *, row_slot: torch.Tensor, row_last_token: torch.Tensor,
              row_is_decode: torch.Tensor, seq_lens: torch.Tensor, sfi_slot_of: torch.Tensor,
              sfi_on: torch.Tensor, sfi_k: torch.Tensor, steps_since_slow: torch.Tensor,
              has_selection: torch.Tensor, sel_count: torch.Tensor, trigger_lut: torch.Tensor,
              stats: torch.Tensor, buffers: SfiPlanBuffers | None = None,
              block_table: torch.Tensor | None = None,
              trigger_state: torch.Tensor | None = None,
              refresh_gap: torch.Tensor | None = None,
              row_copy: torch.Tensor | None = None) -> SfiStep:
    """Decide each row's mode, advance the per-slot schedule state in place, and (with ``buffers``)
    write the plan and the compacted slow list into the persistent buffers.

    Per-slot tables (indexed by the request slot): ``sfi_slot_of`` (compact slot or -1), ``sfi_on``,
    ``sfi_k``, ``steps_since_slow``, ``has_selection``, ``sel_count`` (tokens selected at the last
    slow step), ``trigger_state`` (the sentence-boundary state, :func:`decide_slow`; needed with
    ``fire_at = "sentence_start"`` or a ``sentence_cooldown``). ``stats`` (int64 ``[NUM_STATS]``)
    accumulates slow/fast/dense row counts and the retained and total context tokens of fast rows.

    The boundary state advances on every decode row of a request with SFI on and a compact slot,
    exactly-dense rows included (the token stream is the request's, whatever the row's mode), and
    only sparse rows can be slow.
    """
    rows = row_slot.shape[0]
    if buffers is not None:
        buffers.slow_table_source = block_table
    if buffers is not None and stats.device.type == "cuda":
        from vllm_ext.kernels.sfi_plan import can_plan_with_triton, plan_step_triton

        if (cfg.schedule == "boundary" and trigger_state is None
                and needs_trigger_state(cfg.fire_at, cfg.sentence_cooldown)):
            raise ValueError(f"SFI fire_at={cfg.fire_at!r} with sentence_cooldown={cfg.sentence_cooldown} "
                             "needs the per-slot trigger_state")
        if can_plan_with_triton(stats):
            plan_step_triton(cfg, buffers, row_slot=row_slot, row_last_token=row_last_token,
                             row_is_decode=row_is_decode, seq_lens=seq_lens[:rows],
                             sfi_slot_of=sfi_slot_of, sfi_on=sfi_on, sfi_k=sfi_k,
                             steps_since_slow=steps_since_slow, has_selection=has_selection,
                             sel_count=sel_count, trigger_lut=trigger_lut, stats=stats,
                             block_table=block_table, trigger_state=trigger_state,
                             refresh_gap=refresh_gap, row_copy=row_copy)
            return buffers.step_view(rows)
    slot = row_slot.long()
    t = seq_lens[:rows].to(torch.int32)
    k = sfi_k[slot]
    sfi_slot = sfi_slot_of[slot]
    decode = row_is_decode.bool()
    on = decode & sfi_on[slot] & (sfi_slot >= 0)
    sparse = on & (t > torch.clamp(k + (cfg.n_sink + cfg.n_recent), min=cfg.min_len))
    copying = None
    if row_copy is not None and cfg.schedule != "always_slow":
        copying = (row_copy[:rows] != 0) & sparse
    slow = decide_slow(row_last_token, row_slot, sparse, steps_since_slow, has_selection,
                       trigger_lut, schedule=cfg.schedule, refresh=cfg.refresh,
                       min_boundary_gap=cfg.min_boundary_gap, fire_at=cfg.fire_at,
                       sentence_cooldown=cfg.sentence_cooldown, trigger_state=trigger_state,
                       advance=on, refresh_gap=refresh_gap, force_slow=copying)
    quest = cfg.selector == "quest"
    fast = sparse if quest else sparse & ~slow
    page_slot = torch.where(on, sfi_slot, -1).to(torch.int32)
    lo, hi = allowed_range(t, cfg.n_sink, cfg.n_recent)
    recent_start = torch.clamp(t - cfg.n_recent, min=0)
    mark_selected(steps_since_slow, has_selection, row_slot, slow)
    # tokens the slow rows select (the same for every layer and KV head): min(k, |A|)
    n_sel = torch.minimum(k, torch.clamp(hi - lo, min=0))
    sel_count.index_put_((slot,), torch.where(slow, n_sel - sel_count[slot], 0), accumulate=True)
    retained = torch.where(fast, cfg.n_sink + sel_count[slot] + (t - recent_start), 0)
    # the schedule advances its own counter on sparse rows; a dense decode row ages the selection too
    steps_since_slow.index_add_(0, slot, (decode & ~sparse).to(steps_since_slow.dtype))
    stats[STAT_SLOW] += slow.sum()
    stats[STAT_FAST] += fast.sum()
    stats[STAT_DENSE] += (decode & ~sparse).sum()
    if copying is not None:
        stats[STAT_COPY] += copying.sum()
    stats[STAT_RETAINED] += retained.sum()
    stats[STAT_CONTEXT] += torch.where(fast, t, 0).sum()
    for j, pct in enumerate(RETAINED_FRACTION_BOUNDS_PCT):
        stats[STAT_RETAINED_HIST + j] += (fast & (retained * 100 <= pct * t)).sum()
    stats[STAT_RETAINED_FRACTION_PPM] += torch.where(
        fast, retained.long() * 1_000_000 // torch.clamp(t, min=1).long(), 0).sum()
    row_sfi_slot = torch.where(sparse, sfi_slot, 0).to(torch.int32)
    if buffers is None:
        return SfiStep(row_slow=slow, row_fast=fast, row_sparse=sparse, row_sfi_slot=row_sfi_slot,
                       row_k=k.to(torch.int32), recent_start=recent_start.to(torch.int32),
                       allowed_lo=lo, allowed_hi=hi, row_dense=~sparse, row_page_slot=page_slot)
    return write_plan(buffers, rows, slow=slow, fast=fast, sparse=sparse,
                       row_sfi_slot=row_sfi_slot, k=k, recent_start=recent_start, lo=lo, hi=hi,
                       t=t, block_table=block_table, page_slot=page_slot)


def write_plan(buf: SfiPlanBuffers, rows: int, *, slow, fast, sparse, row_sfi_slot, k,
               recent_start, lo, hi, t, block_table, page_slot=None) -> SfiStep:
    """Write row modes already decided into the persistent plan (and compact the slow rows).
    :func:`plan_step` calls it; tests and benchmarks use it to force modes."""
    if rows > buf.max_rows:
        raise RuntimeError(f"SPEEDSFI: a step with {rows} rows exceeds the plan's {buf.max_rows}")
    cap = buf.capacity
    buf.slow_table_source = block_table
    buf.row_slow[:rows].copy_(slow)
    buf.row_fast[:rows].copy_(fast)
    buf.row_sparse[:rows].copy_(sparse)
    torch.logical_not(sparse, out=buf.row_dense[:rows])
    buf.row_sfi_slot[:rows].copy_(row_sfi_slot)
    buf.row_k[:rows].copy_(k)
    buf.recent_start[:rows].copy_(recent_start)
    buf.allowed_lo[:rows].copy_(lo)
    buf.allowed_hi[:rows].copy_(hi)
    buf.row_page_slot[:rows].copy_(page_slot if page_slot is not None else
                                   torch.where(sparse, row_sfi_slot, -1))
    # compaction: the e-th slow row (in row order) takes entry e; other rows scatter to the trash
    entry = torch.cumsum(slow.to(torch.int32), 0, dtype=torch.int32) - 1
    entry = torch.where(slow & (entry < cap), entry, cap)
    buf.row_scratch[:rows].copy_(torch.where(entry < cap, entry, -1))
    buf.slow_count.copy_(torch.clamp(slow.sum(), max=cap).reshape(1))
    torch.clamp(buf.slow_count - buf.chunk_offsets, 0, buf.chunk_rows,
                out=buf.slow_chunk_count[:, 0])
    buf.slow_rows.fill_(-1)
    if rows:
        buf.slow_rows.index_copy_(0, entry.long(), buf.row_index[:rows])
        buf.slow_rows[cap:].fill_(-1)
    live = buf.slow_rows[:cap] >= 0
    src = buf.slow_rows[:cap].clamp(0, max(rows - 1, 0)).long()
    zero = torch.zeros((), dtype=torch.int32, device=buf.device)
    if rows:
        buf.slow_seq[:cap].copy_(torch.where(live, t[src], zero))
        buf.slow_lo[:cap].copy_(torch.where(live, lo[src], zero))
        buf.slow_hi[:cap].copy_(torch.where(live, hi[src], zero))
        buf.slow_k[:cap].copy_(torch.where(live, k.to(torch.int32)[src], zero))
        buf.slow_sfi_slot[:cap].copy_(torch.where(live, row_sfi_slot[src], -1))
    else:
        for b in (buf.slow_seq, buf.slow_lo, buf.slow_hi, buf.slow_k):
            b.zero_()
        buf.slow_sfi_slot.fill_(-1)
    if block_table is not None:
        slow_bt = buf.block_table_buffer(block_table.shape[1])
        if rows:
            torch.index_select(block_table[:rows], 0, src, out=slow_bt[:cap])
    return buf.step_view(rows)
