"""CritiPrefill's per-request bookkeeping inside the backend and the host-side plan of each step.

Indexed by the generic request slot of :class:`vllm_ext.request_state.RequestStateTable` (registered
there as its :class:`vllm_ext.method_slots.MethodSlots`); a prompt with a sparse range holds one of
``C`` *CritiPrefill slots* (``critiprefill.max_requests``) from its first prefill chunk to the end of
its prefill. The slot indexes the persistent per-layer tables of
``vllm_ext.backend.critiprefill_path`` (key-block representatives, the query carry) and the fused
scores of layer fusion. Everything here is decided on the host from facts the host has exactly for
prefill rows (tokens computed before the step, the chunk's length, the prompt length), so nothing
synchronises with the device. Torch + numpy only (no vLLM).

Which rows run CritiPrefill in a step (*CritiPrefill rows*): every prefill chunk of at least two
tokens of a prompt with a sparse range (``>= min_len`` tokens and a sparse segment: the rules of
``vllm_ext.critiprefill.chunking``), its dense segments included, so that the kernel that computes a
position never depends on how its prompt was chunked. Segment ``j`` (absolute positions
``[j*Sq, (j+1)*Sq)``) is sparse when it is before the prompt's final segment and has more candidate
blocks than the budget selects (``j*Sq/Bk - 1 > budget/Bk``); every other segment attends densely (a
segment whose candidates all fit the budget selects them all, which *is* dense). These rules depend
only on the prompt.

The rows ``[first_row, num_reqs)`` form the step's CritiPrefill sub-batch: the runner hooks move
CritiPrefill rows behind every other row (``vllm_ext.runner_hooks``; vLLM orders decode-like rows
first), so the sub-batch holds CritiPrefill rows only and every other row takes the dense path (on
CUDA the delegate). A row of the sub-batch without a slot (only if the scheduler's count and this
one disagree) attends densely through the same kernel (``row_dense``).

Chunk boundaries and traffic change nothing (``docs/critiprefill.md``): the scheduler ends every chunk of a
CritiPrefill prompt that stops inside the sparse range on a segment boundary, cuts prefix-cache hits
the same way (``vllm_ext.critiprefill.chunking``), and starts a prompt's sparse prefill only while a
CritiPrefill slot is free (``vllm_ext.scheduler_policy``), so each sparse segment is computed whole,
in one chunk, by a request that holds a slot. What remains:
- A segment that a chunk still cuts (the scheduler's rules bypassed: a prefix hit the block layout
  cannot cut, counted ``fallback.prefix_hit_uncut``) is represented (``Qmax, Qmin``) by the queries
  seen so far: the part in the earlier chunk selects from its own queries; the part in the later
  chunk uses the whole segment's representatives (carried per request and layer).
- A prompt that finds no free CritiPrefill slot (only if the scheduler's count and the worker's
  disagree) prefills densely until one frees (counted: ``fallback.critiprefill_capacity``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.config import CritiPrefillConfig
from vllm_ext.critiprefill.chunking import first_sparse_segment, is_critiprefill_prompt, sparse_range  # noqa: F401
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
    rep_slot: torch.Tensor          # int32 [R']: CritiPrefill slot, or the scratch slot C
    row_dense: torch.Tensor         # bool [R']: not a CritiPrefill row this step (dense)
    update_first: torch.Tensor      # int32 [R']: first key block to (re)compute from the cache
    carry_valid: torch.Tensor       # bool [R']: the first segment continues the carried queries
    last_segment: torch.Tensor      # int64 [R']: the chunk's last segment row (carried onwards)
    max_update_blocks: int          # host bound of the blocks any row recomputes
    max_query_len: int
    max_seq_len: int
    step_id: int
    sparse_tokens: int              # host counts (this step, per layer)
    sparse_segments: int

    @property
    def rows(self) -> int:
        return self.num_reqs - self.first_row


class CritiPrefillSlots(MethodSlots):
    name = "critiprefill"

    def __init__(self, capacity: int, max_rows: int, cfg: CritiPrefillConfig, device: torch.device):
        from vllm_ext.host_staging import PinnedStaging

        self.cfg = cfg
        self.capacity = capacity
        self.scratch = capacity                       # rows without a slot read/write here
        self.device = torch.device(device)
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.slot_of: dict[int, int] = {}             # request slot -> CritiPrefill slot
        self._valid_blocks = np.zeros(capacity + 1, dtype=np.int64)   # complete blocks kept
        self._carry_end = np.full(capacity + 1, -1, dtype=np.int64)    # carry covers [seg start, end)
        self._release_next: set[int] = set()          # request slots whose prefill ended
        self._fell_back: set[int] = set()
        i32 = torch.int32
        self._qsl = PinnedStaging(max_rows + 1, i32, self.device)
        self._seq = PinnedStaging(max_rows, i32, self.device)
        self._plen = PinnedStaging(max_rows, i32, self.device)
        self._slot = PinnedStaging(max_rows, i32, self.device)
        self._dense = PinnedStaging(max_rows, torch.bool, self.device)
        self._first = PinnedStaging(max_rows, i32, self.device)
        self._carry = PinnedStaging(max_rows, torch.bool, self.device)
        self._last = PinnedStaging(max_rows, torch.int64, self.device)
        self.counters = DeviceCounters(NUM_STATS, self.device)

    @property
    def stats(self) -> torch.Tensor:
        return self.counters.values

    # ------------------------------------------------------------------ lifecycle (host)
    def release(self, slot: int) -> None:
        """The request in request slot ``slot`` left (finished, aborted, preempted)."""
        cp = self.slot_of.pop(slot, None)
        self._release_next.discard(slot)
        self._fell_back.discard(slot)
        if cp is not None:
            self._free.append(cp)
            metrics.bump("critiprefill.slots_released")

    def slot_released(self, slot: int) -> None:
        self.release(slot)

    def _acquire(self, slot: int) -> int | None:
        if not self._free:
            return None
        cp = self._free.pop()
        self.slot_of[slot] = cp
        self._valid_blocks[cp] = 0
        self._carry_end[cp] = -1
        metrics.bump("critiprefill.slots_assigned")
        return cp

    # ------------------------------------------------------------------ per step (host plan)
    def plan(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
             prompt_len: np.ndarray, host_geometry, step_id: int) -> CritiPrefillStep | None:
        """The step's sub-batch, or ``None`` when no row runs CritiPrefill (everything dense)."""
        for slot in list(self._release_next):          # prefills that ended in an earlier step
            self.release(slot)
        self.counters.publish()                        # the previous steps' device counts
        cfg = self.cfg
        sq, bk = cfg.segment_size, cfg.block_size
        qsl, computed = host_geometry
        cp_rows: dict[int, tuple[int, int, int, int]] = {}
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
            n_sparse = max(0, min(seq, hi) - max(ctx, lo))
            if seq >= plen:
                self._release_next.add(slot)           # its prefill ends in this step
            if ctx >= plen or lo >= hi:
                continue                               # not a CritiPrefill prompt, or past its prompt
            cp = self.slot_of.get(slot)
            if cp is None:
                cp = self._acquire(slot)
            if cp is None:
                if slot not in self._fell_back:
                    self._fell_back.add(slot)
                    metrics.fallback("critiprefill_capacity", "all %d CritiPrefill slots "
                                     "(critiprefill.max_requests) are held: a prompt prefills densely "
                                     "until one frees", self.capacity)
                continue
            cp_rows[row] = (cp, ctx, seq, plen)
            if n_sparse:
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
            if entry is None:
                self._plen.np[r] = int(prompt_len[int(row_slots[row])])
                self._slot.np[r] = self.scratch
                self._dense.np[r] = True
                self._first.np[r] = -(-seq // bk)          # nothing to update
                self._carry.np[r] = False
                continue
            cp, _, _, plen = entry
            self._plen.np[r] = plen
            self._slot.np[r] = cp
            self._dense.np[r] = False
            upd = int(self._valid_blocks[cp])              # catches up after dense chunks too
            self._first.np[r] = upd
            max_upd = max(max_upd, -(-seq // bk) - upd)
            self._valid_blocks[cp] = seq // bk
            self._carry.np[r] = bool(ctx % sq and self._carry_end[cp] == ctx)
            self._carry_end[cp] = seq if seq % sq else -1
        step = CritiPrefillStep(
            first_row=first, num_reqs=num_reqs, token_start=t0, token_end=int(qsl[num_reqs]),
            query_start_loc=self._qsl.copy_to_device(n + 1), seq_lens=self._seq.copy_to_device(n),
            prompt_lens=self._plen.copy_to_device(n), rep_slot=self._slot.copy_to_device(n),
            row_dense=self._dense.copy_to_device(n), update_first=self._first.copy_to_device(n),
            carry_valid=self._carry.copy_to_device(n), last_segment=self._last.copy_to_device(n),
            max_update_blocks=max_upd, max_query_len=max_q, max_seq_len=max_seq, step_id=step_id,
            sparse_tokens=tokens, sparse_segments=segments)
        metrics.bump("critiprefill.steps")
        metrics.bump("critiprefill.prefill_tokens", tokens)
        metrics.bump("critiprefill.sparse_segments", segments)
        return step

    def plan_step(self, step: StepState) -> CritiPrefillStep | None:
        if not step.is_real or step.host_geometry is None:
            return None
        return self.plan(num_reqs=step.num_reqs, row_slots=step.row_slot_np,
                         row_is_decode=step.row_is_decode_np, prompt_len=step.table.prompt_len_np,
                         host_geometry=step.host_geometry, step_id=step.step_id)

    def counter_values(self) -> dict[str, int]:
        v = self.counters.read()
        return {"critiprefill.sparse_segment_heads": v[STAT_SPARSE_SEGMENTS],
                "critiprefill.key_blocks_candidate": v[STAT_BLOCKS_CANDIDATE],
                "critiprefill.key_blocks_read": v[STAT_BLOCKS_SELECTED],
                "critiprefill.key_blocks_skipped": v[STAT_BLOCKS_CANDIDATE] - v[STAT_BLOCKS_SELECTED]}
