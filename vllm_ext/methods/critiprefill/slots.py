"""CritiPrefill's per-request bookkeeping inside the backend and the host-side plan of each step.

Indexed by the generic request slot of :class:`vllm_ext.request_state.RequestStateTable` (registered
there as its :class:`vllm_ext.method_slots.MethodSlots`). A prompt's state (key-block
representatives, the query carry: ``vllm_ext.methods.critiprefill.state_layout``) lives in pages of
CritiPrefill's own KV-cache groups, which vLLM's block manager allocates as the prompt's chunks arrive
and frees when its prefill is computed (``vllm_ext.methods.critiprefill.kv_spec``); the step exposes each
group's block-table rows of the sub-batch (``state_tables``). There is no pool: a CritiPrefill row
runs sparsely while vLLM's count says it holds the pages its chunk needs (``state_pages``); otherwise
(only if the manager and this plan disagree) it attends densely through the same kernel and writes
no state (counted: ``fallback.critiprefill_no_state_blocks``). Everything here is decided on the
host from facts the host has exactly for prefill rows (tokens computed before the step, the chunk's
length, the prompt length, the blocks the runner holds per row), so nothing synchronises with the
device. Torch + numpy only (no vLLM).

Which rows run CritiPrefill in a step (*CritiPrefill rows*): every prefill chunk of at least two
tokens of a prompt with a sparse range (a sparse segment: the rules of
``vllm_ext.methods.critiprefill.chunking``), its dense segments included, so that the kernel that computes a
position never depends on how its prompt was chunked. Segment ``j`` (absolute positions
``[j*Sq, (j+1)*Sq)``) is sparse when it starts at or after ``min_len`` (the authors' ``threshold_len``),
is before the prompt's final segment and has more blocks before it than it selects
(``j*Sq/Bk > budget/Bk``, plus one with ``sink_block``); every other segment attends densely (a
segment whose candidates all fit the budget selects them all, which *is* dense). These rules depend
only on the prompt.

The rows ``[first_row, num_reqs)`` form the step's CritiPrefill sub-batch: the runner hooks move
CritiPrefill rows behind every other row (``vllm_ext.runner_hooks``; vLLM orders decode-like rows
first), so the sub-batch holds CritiPrefill rows only and every other row takes the dense path (on
CUDA the delegate). A row of the sub-batch without a slot (only if the scheduler's count and this
one disagree) attends densely through the same kernel (``row_dense``).

Chunk boundaries and traffic change nothing (``docs/critiprefill.md``): the scheduler ends every chunk of a
CritiPrefill prompt that stops inside the sparse range on a segment boundary, cuts prefix-cache hits
the same way (``vllm_ext.methods.critiprefill.chunking``), and vLLM schedules a chunk only with the pages it
needs, so each sparse segment is computed whole, in one chunk, by a request that holds its state.
What remains:
- A segment that a chunk still cuts (the scheduler's rules bypassed: a prefix hit the block layout
  cannot cut, counted ``fallback.prefix_hit_uncut``) is represented (``Qmax, Qmin``) by the queries
  seen so far: the part in the earlier chunk selects from its own queries; the part in the later
  chunk uses the whole segment's representatives (carried per request and layer).
- A chunk whose request lacks the pages (only if the manager's count and this plan's disagree)
  attends densely (counted: ``fallback.critiprefill_no_state_blocks``); a later chunk with its pages
  recomputes every key block not kept yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.critiprefill.chunking import first_sparse_segment, is_critiprefill_prompt, sparse_range  # noqa: F401
from vllm_ext.methods.critiprefill.state_layout import STATE_SUFFIX, state_pages
from vllm_ext.device_counters import DeviceCounters
from vllm_ext.method_slots import MethodSlots
from vllm_ext.request_state import StepState

# device counters (summed over sparse layers and KV heads)
STAT_SPARSE_SEGMENTS = 0     # (chunk segment, KV head, layer) triples that attended sparsely
STAT_BLOCKS_CANDIDATE = 1    # key blocks before those segments
STAT_BLOCKS_SELECTED = 2     # of which selected (read)
NUM_STATS = 3


@dataclass
class CritiPrefillStep:
    """The step's CritiPrefill sub-batch: rows ``first_row .. num_reqs - 1`` of the batch, tokens
    ``token_start .. token_end - 1``. Tensors are views of persistent buffers (device)."""

    first_row: int
    num_reqs: int
    token_start: int
    token_end: int
    query_start_loc: torch.Tensor   # int32 [R' + 1], rebased to token_start
    seq_lens: torch.Tensor          # int32 [R']
    prompt_lens: torch.Tensor       # int32 [R']
    rep_seq: torch.Tensor           # int32 [R']: tokens whose key blocks the state keeps (<= prompt)
    row_dense: torch.Tensor         # bool [R']: not a CritiPrefill row this step, or without pages (dense)
    update_first: torch.Tensor      # int32 [R']: first key block to (re)compute from the cache
    holds_state: torch.Tensor       # int32 [R']: 1 when the row holds its pages and writes its state, else 0
    carry_valid: torch.Tensor       # bool [R']: the first segment continues the carried queries
    last_segment: torch.Tensor      # int64 [R']: the chunk's last segment row (carried onwards)
    max_update_blocks: int          # host bound of the blocks any row recomputes
    max_query_len: int
    max_seq_len: int
    step_id: int
    sparse_tokens: int              # host counts (this step, per layer)
    sparse_segments: int
    state_tables: dict              # group id -> int32 [R', pages]: the sub-batch's rows (device views)
    state_group_of_layer: dict      # attention layer name -> group id
    fused_scores: torch.Tensor | None = None   # layer fusion: the previous sparse layer's, this step

    def state_table(self, layer_name: str) -> torch.Tensor | None:
        """The sub-batch's block-table rows of the group holding ``layer_name``'s state."""
        gid = self.state_group_of_layer.get(layer_name)
        return None if gid is None else self.state_tables.get(gid)

    @property
    def rows(self) -> int:
        return self.num_reqs - self.first_row


class CritiPrefillSlots(MethodSlots):
    name = "critiprefill"

    def __init__(self, num_slots: int, max_rows: int, cfg: CritiPrefillConfig, device: torch.device):
        from vllm_ext.host_staging import PinnedStaging

        self.cfg = cfg
        self.device = torch.device(device)
        self._valid_blocks = np.zeros(num_slots, dtype=np.int64)    # key blocks kept per request slot
        self._carry_end = np.full(num_slots, -1, dtype=np.int64)    # carry covers [seg start, end)
        self._fell_back: set[int] = set()
        # request slots in a sparse prefill (their state in pages): the events
        # critiprefill.slots_assigned / _released count entries and exits (in use = the difference)
        self.active: set[int] = set()
        self.groups: dict[int, tuple[int, int]] = {}                # gid -> (carry entries, page size)
        self.group_of_layer: dict[str, int] = {}
        i32 = torch.int32
        self._qsl = PinnedStaging(max_rows + 1, i32, self.device)
        self._seq = PinnedStaging(max_rows, i32, self.device)
        self._plen = PinnedStaging(max_rows, i32, self.device)
        self._rseq = PinnedStaging(max_rows, i32, self.device)
        self._dense = PinnedStaging(max_rows, torch.bool, self.device)
        self._first = PinnedStaging(max_rows, i32, self.device)
        self._hold = PinnedStaging(max_rows, i32, self.device)
        self._carry = PinnedStaging(max_rows, torch.bool, self.device)
        self._last = PinnedStaging(max_rows, torch.int64, self.device)
        self.counters = DeviceCounters(NUM_STATS, self.device)

    @property
    def stats(self) -> torch.Tensor:
        return self.counters.values

    # ------------------------------------------------------------------ KV-cache groups
    def bind_kv_groups(self, groups) -> None:
        """``MethodSlots``: CritiPrefill's state groups (``vllm_ext.methods.critiprefill.kv_spec``): group id
        -> (most pages per request, the state layers ``<attention layer>`` + ``STATE_SUFFIX``, the
        group's spec: carry entries and page size)."""
        self.groups, self.group_of_layer = {}, {}
        for gid, (_, names, *rest) in groups.items():
            spec = rest[0] if rest else None
            self.groups[gid] = (int(getattr(spec, "carry_entries", 1)), int(getattr(spec, "block_size", 16)))
            for name in names:
                if name.endswith(STATE_SUFFIX):
                    self.group_of_layer[name[:-len(STATE_SUFFIX)]] = gid

    def pages_needed(self, gid: int, num_tokens: int) -> int:
        carry, page = self.groups[gid]
        return state_pages(num_tokens, carry, self.cfg.block_size, page)

    # ------------------------------------------------------------------ lifecycle (host)
    def _leave(self, slot: int) -> None:
        if slot in self.active:
            self.active.discard(slot)
            metrics.bump("critiprefill.slots_released")

    def _reset(self, slot: int) -> None:
        self._leave(slot)
        self._valid_blocks[slot] = 0
        self._carry_end[slot] = -1
        self._fell_back.discard(slot)

    def slot_assigned(self, slot: int, overrides, *, resumed: bool) -> None:
        self._reset(slot)            # a resumed request recomputes its prompt: its pages are new

    def slot_released(self, slot: int) -> None:
        self._reset(slot)

    def _holds_state(self, row: int, num_tokens: int, counts) -> bool:
        if not self.groups or counts is None:
            return False
        return all(gid in counts and int(counts[gid][row]) >= self.pages_needed(gid, num_tokens)
                   for gid in self.groups)

    # ------------------------------------------------------------------ per step (host plan)
    def plan(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
             prompt_len: np.ndarray, host_geometry, step_id: int,
             group_tables=None) -> CritiPrefillStep | None:
        """The step's sub-batch, or ``None`` when no row runs CritiPrefill (everything dense).
        ``group_tables``: the step's ``StepState.group_tables`` (device rows, host flags, host
        counts per group id)."""
        self.counters.publish()                        # the previous steps' device counts
        cfg = self.cfg
        sq, bk = cfg.segment_size, cfg.block_size
        qsl, computed = host_geometry
        counts = None if group_tables is None else {gid: t[2] for gid, t in group_tables.items()
                                                    if len(t) > 2}
        cp_rows: dict[int, tuple[int, int, int, int, bool]] = {}
        tokens = segments = 0
        for row in range(num_reqs):
            ql = int(qsl[row + 1] - qsl[row])
            if row_is_decode[row] or ql < 2:
                continue
            slot = int(row_slots[row])
            ctx = int(computed[row])
            seq = ctx + ql
            plen = int(prompt_len[slot])
            lo, hi = sparse_range(cfg, plen)
            if ctx >= plen or lo >= hi:
                continue                               # not a CritiPrefill prompt, or past its prompt
            holds = self._holds_state(row, min(seq, plen), counts)
            if not holds and slot not in self._fell_back:
                self._fell_back.add(slot)
                metrics.fallback("critiprefill_no_state_blocks", "a CritiPrefill chunk without the "
                                 "KV-cache pages of its state (vLLM's count and the plan's disagree): "
                                 "it attends densely")
            cp_rows[row] = (slot, ctx, seq, plen, holds)
            if holds and slot not in self.active:
                self.active.add(slot)
                metrics.bump("critiprefill.slots_assigned")
            if seq >= plen:
                self._leave(slot)                      # its prefill ends in this step
            n_sparse = max(0, min(seq, hi) - max(ctx, lo))
            if n_sparse and holds:
                tokens += n_sparse
                segments += (min(seq, hi) - 1) // sq - max(ctx, lo) // sq + 1
        if not cp_rows:
            return None
        first = min(cp_rows)
        n = num_reqs - first
        t0 = int(qsl[first])
        self._qsl.np[:n + 1] = qsl[first:num_reqs + 1] - t0
        max_q = max_seq = max_upd = 0
        for r in range(n):
            row = first + r
            ql = int(qsl[row + 1] - qsl[row])
            ctx = int(computed[row])
            seq = ctx + ql
            max_q, max_seq = max(max_q, ql), max(max_seq, seq)
            self._seq.np[r] = seq
            self._last.np[r] = (seq - 1) // sq - ctx // sq
            entry = cp_rows.get(row)
            holds = entry is not None and entry[4]
            if not holds:                              # dense through the same kernel; no state written
                self._plen.np[r] = int(prompt_len[int(row_slots[row])])
                self._rseq.np[r] = seq
                self._dense.np[r] = True
                self._first.np[r] = -(-seq // bk)          # nothing to update
                self._hold.np[r] = 0
                self._carry.np[r] = False
                continue
            slot, _, _, plen, _ = entry
            rseq = min(seq, plen)                      # key blocks past the prompt are never candidates
            self._plen.np[r] = plen
            self._rseq.np[r] = rseq
            self._dense.np[r] = False
            upd = int(self._valid_blocks[slot])        # catches up after dense chunks too
            self._first.np[r] = upd
            max_upd = max(max_upd, -(-rseq // bk) - upd)
            self._valid_blocks[slot] = rseq // bk
            self._hold.np[r] = 1
            self._carry.np[r] = bool(ctx % sq and self._carry_end[slot] == ctx)
            self._carry_end[slot] = seq if seq % sq else -1
        tables = {} if group_tables is None else \
            {gid: group_tables[gid][0][first:num_reqs] for gid in self.groups if gid in group_tables}
        step = CritiPrefillStep(
            first_row=first, num_reqs=num_reqs, token_start=t0, token_end=int(qsl[num_reqs]),
            query_start_loc=self._qsl.copy_to_device(n + 1), seq_lens=self._seq.copy_to_device(n),
            prompt_lens=self._plen.copy_to_device(n), rep_seq=self._rseq.copy_to_device(n),
            row_dense=self._dense.copy_to_device(n), update_first=self._first.copy_to_device(n),
            holds_state=self._hold.copy_to_device(n),
            carry_valid=self._carry.copy_to_device(n), last_segment=self._last.copy_to_device(n),
            max_update_blocks=max_upd, max_query_len=max_q, max_seq_len=max_seq, step_id=step_id,
            sparse_tokens=tokens, sparse_segments=segments, state_tables=tables,
            state_group_of_layer=self.group_of_layer)
        metrics.bump("critiprefill.steps")
        metrics.bump("critiprefill.prefill_tokens", tokens)
        metrics.bump("critiprefill.sparse_segments", segments)
        return step

    def plan_step(self, step: StepState) -> CritiPrefillStep | None:
        if not step.is_real or step.host_geometry is None:
            return None
        return self.plan(num_reqs=step.num_reqs, row_slots=step.row_slot_np,
                         row_is_decode=step.row_is_decode_np, prompt_len=step.table.prompt_len_np,
                         host_geometry=step.host_geometry, step_id=step.step_id,
                         group_tables=step.group_tables)

    def counter_values(self) -> dict[str, int]:
        v = self.counters.read()
        return {"critiprefill.sparse_segment_heads": v[STAT_SPARSE_SEGMENTS],
                "critiprefill.key_blocks_candidate": v[STAT_BLOCKS_CANDIDATE],
                "critiprefill.key_blocks_read": v[STAT_BLOCKS_SELECTED],
                "critiprefill.key_blocks_skipped": v[STAT_BLOCKS_CANDIDATE] - v[STAT_BLOCKS_SELECTED]}
