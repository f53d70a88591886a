"""Quest's page bounds per request (``sfi.selector = "quest"``), as the worker sees them: the bound
pages' block count, the per-compact-slot page tables the kernels read, and which rows may read and
write their bounds this step (``docs/per_request_memory.md``). Torch and numpy only (no vLLM).

Inside vLLM a request's bounds are blocks of SFI's Quest group (``vllm_ext.methods.sfi.quest_kv_spec``): one
Quest page's bounds (max and min of K over ``page_size`` tokens, ``Hkv x D`` each) is one token entry
of the attention layer's page ``[Hkv, block_size, 2D]``, so a request of ``t`` tokens holds
:func:`quest_blocks` ``(t)`` blocks, growing as it grows, from the step its length reaches the group's
first length. Every step :meth:`QuestPageTables.gate` copies the step's block-table rows of the Quest
groups into ``[capacity + 1, blocks per request]`` tables indexed by compact slot and compares each
row's block count with what its length needs, on the device: a decode row whose request lacks them
runs densely (exact), and its slot's page progress restarts at page 0, so the first row holding
them writes every page of its context. Rows that disagree with the manager's rule are counted
(``fallback.sfi_no_quest_pages``); the prefill chunks' plan (:meth:`QuestPageTables.plan_prefill`)
skips a chunk without them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.host_staging import PinnedStaging

# the name of an attention layer's Quest bound-page layer (``vllm_ext.methods.sfi.caches``)
QUEST_SUFFIX = ".sfi_quest"


def quest_blocks(num_tokens, page_size: int, block_size: int):
    """Blocks of bound pages a request of ``num_tokens`` tokens holds (int, numpy or torch)."""
    return -(-(-(-num_tokens // page_size)) // block_size)


@dataclass
class QuestPrefillPages:
    """Selector ``quest``: one step's prefill page updates (rows of requests holding a compact slot)."""
    rows: torch.Tensor              # int64 [n]: batch rows (their block-table rows)
    seq_lens: torch.Tensor          # int32 [n]: tokens in the cache after this step
    first_page: torch.Tensor        # int32 [n]: first page the row rewrites
    sfi_slot: torch.Tensor          # int32 [n]: compact slot (the page table's entry)
    max_pages: int                  # host bound of the pages one row rewrites


class QuestPageTables:
    """The Quest groups' per-compact-slot tables and the per-step check (see the module docstring).
    Without groups (outside vLLM) every row holds its bounds and nothing is gated."""

    def __init__(self, page_size: int, first_len: int, capacity: int, n_slots: int, max_rows: int,
                 device: torch.device):
        self.page_size, self.first_len, self.capacity = page_size, first_len, capacity
        self.device = device
        self.tables: dict[int, torch.Tensor] = {}
        self.table_of_layer: dict[str, torch.Tensor] = {}
        self.block_size = 0
        # request slot -> positions whose bounds its prefill chunks wrote (host; 0: none yet)
        self.written: dict[int, int] = {}
        self._n_slots, self._max_rows = n_slots, max_rows
        self._held: PinnedStaging | None = None
        self._ok_slot: torch.Tensor | None = None
        self._on_eff: torch.Tensor | None = None

    def bind(self, groups: Mapping[int, tuple[int, list[str], int]]) -> None:
        """The Quest groups: group id -> (blocks per request (the most), the attention layers whose
        bound pages it holds, its block size). Called again for a new KV cache (tables start empty:
        every live request's rows come back with its next step)."""
        dev = self.device
        self.tables = {gid: torch.zeros(self.capacity + 1, n, dtype=torch.int32, device=dev)
                       for gid, (n, _, _) in groups.items()}
        self.table_of_layer = {name: self.tables[gid] for gid, (_, names, _) in groups.items() for name in names}
        sizes = {bs for _, _, bs in groups.values()}
        if len(sizes) > 1:
            raise RuntimeError(f"SPEEDSFI: Quest's bound-page groups have block sizes {sorted(sizes)}")
        self.block_size = sizes.pop() if sizes else 0
        self._held = PinnedStaging(self._max_rows, torch.int32, dev)
        self._ok_slot = torch.zeros(self._n_slots, dtype=torch.bool, device=dev)
        self._on_eff = torch.zeros(self._n_slots, dtype=torch.bool, device=dev)

    def forget(self, slot: int) -> None:
        """Request slot ``slot`` took a new request or left: its bounds are not written."""
        self.written.pop(slot, None)

    def held(self, group_tables, num_reqs: int) -> np.ndarray | None:
        """Per real row (host): the bound-page blocks it holds (the fewest over the groups; None
        without groups); a group missing from the step counts as none held."""
        if not self.tables:
            return None
        held = None
        for gid in self.tables:
            if not group_tables or gid not in group_tables:
                return np.zeros(num_reqs, dtype=np.int64)
            n = np.asarray(group_tables[gid][2][:num_reqs], dtype=np.int64)
            held = n if held is None else np.minimum(held, n)
        return held

    def gate(self, step, sfi_slot_of: torch.Tensor, sfi_on: torch.Tensor, page_upto: torch.Tensor) -> torch.Tensor:
        """Copy the step's Quest block-table rows into the per-slot tables and return ``sfi_on``
        restricted to the requests whose rows hold the bounds their length needs; the page progress
        of the others restarts at 0 (device work, no sync). Counts the decode rows the manager should
        have given blocks (host facts)."""
        if not self.tables:
            return sfi_on
        n = step.num_reqs
        staged = step.group_tables or {}
        if step.is_real and n:
            held = self.held(staged, n)
            self._held.np[:n] = np.minimum(held, np.iinfo(np.int32).max)
            row_slot = step.row_slot[:n].long()
            need = quest_blocks(step.seq_lens[:n], self.page_size, self.block_size)
            ok = self._held.copy_to_device(n) >= need
            self._ok_slot.index_copy_(0, row_slot, ok)
            sfi_slot = sfi_slot_of[row_slot]
            dst = torch.where(sfi_slot >= 0, sfi_slot, self.capacity).long()
            page_upto.index_put_((dst,), torch.where(ok, page_upto[dst], 0))
            for gid, table in self.tables.items():
                if gid in staged:
                    table.index_copy_(0, dst, staged[gid][0][:n, :table.shape[1]].to(table.dtype))
            self._count_missing(step, held, n)
        torch.logical_and(sfi_on, self._ok_slot, out=self._on_eff)
        return self._on_eff

    def _count_missing(self, step, held: np.ndarray, n: int) -> None:
        """Decode rows past the group's first length without their blocks: vLLM's manager and this
        rule disagree (host estimate of the length; the device check above decides)."""
        if step.host_geometry is None:
            return
        qsl, computed = step.host_geometry
        q_len = qsl[1:n + 1] - qsl[:n]
        t = np.asarray(computed[:n], dtype=np.int64) + q_len
        # one-token decode rows (multi-token rows are the prefill plan's: plan_prefill counts them)
        decode = np.asarray(step.row_is_decode_np[:n], dtype=bool) & (q_len == 1)
        missing = int((decode & (t >= self.first_len)
                       & (held < quest_blocks(t, self.page_size, self.block_size))).sum())
        if missing:
            metrics.fallback("sfi_no_quest_pages", "a request decoding with Quest's page selector lacked "
                             "the blocks of its page bounds (vLLM's scheduler and SPEEDSFI's rule "
                             "disagree): its rows decode densely until it holds them")
            if missing > 1:
                metrics.bump("fallback.sfi_no_quest_pages", missing - 1)

    def plan_prefill(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
                     host_geometry, slot_host: Mapping[int, int], held: np.ndarray | None,
                     page_upto: torch.Tensor) -> QuestPrefillPages | None:
        """The pages each multi-token row of a request holding a compact slot writes this step: from
        the first page its earlier chunks did not write (page 0 for its first chunk, which also
        covers a prefix-cache hit, and for the first chunk holding its blocks), whatever the
        prompt's length (a short prompt grows into a sparse request). Multi-token rows include a
        request resumed after preemption that recomputes only generated tokens (its prompt a prefix
        hit): SFI runs them densely, and their pages must still be written before its first decode
        selects. One-token decode rows update their page on the device (``quest_page_update``). Host
        geometry is exact for multi-token rows; such steps run eagerly. ``held`` (inside vLLM): the
        rows' bound-page blocks; a chunk without the ones it needs writes nothing (its request
        writes every page once it holds them)."""
        page = self.page_size
        qsl, computed = host_geometry
        rows, seqs, firsts, slots, n_pages = [], [], [], [], 0
        for row in range(num_reqs):
            slot = int(row_slots[row])
            if slot not in slot_host or (row_is_decode[row] and qsl[row + 1] - qsl[row] == 1):
                continue
            done = int(computed[row])
            end = done + int(qsl[row + 1] - qsl[row])
            if held is not None and held[row] < quest_blocks(end, page, self.block_size):
                self.written[slot] = 0
                if end >= self.first_len:
                    metrics.fallback("sfi_no_quest_pages", "a request's prompt chunk past Quest's first "
                                     "length lacked the blocks of its page bounds (vLLM's scheduler and "
                                     "SPEEDSFI's rule disagree): it writes every page once it holds them")
                continue
            first_page = min(self.written.get(slot, 0), done) // page
            self.written[slot] = end
            rows.append(row)
            seqs.append(end)
            firsts.append(first_page)
            slots.append(slot_host[slot])
            n_pages = max(n_pages, -(-end // page) - first_page)
        if not rows:
            return None

        def dev(a, dtype):
            return torch.as_tensor(np.asarray(a), dtype=dtype).to(self.device, non_blocking=True)

        plan = QuestPrefillPages(rows=dev(rows, torch.int64), seq_lens=dev(seqs, torch.int32),
                                 first_page=dev(firsts, torch.int32), sfi_slot=dev(slots, torch.int32),
                                 max_pages=n_pages)
        page_upto.index_copy_(0, plan.sfi_slot.long(), plan.seq_lens)
        return plan
