"""``sfi.copy_ngram``'s per-request token history as the step plan sees it: where each compact slot's
history lives, which positions it holds, and which of the step's rows may record and match
(``docs/per_request_memory.md``; the ops: ``vllm_ext.kernels.copy_match``).

Inside vLLM (``paged``) the history is pages of SFI's history group (``vllm_ext.methods.sfi.history_kv_spec``):
a request holds ``cdiv(t, E)`` of them at length ``t`` (``E`` int32 positions per page), from its
first chunk. :meth:`HistorySlots.bind` takes the group (the page memory of its first layer holds the
history; the group's other layers' pages of those blocks are unused) and every step copies the rows'
block-table rows into a per-compact-slot table ``[capacity + 1, W]`` and each request's block count
(host) to the device. A row records and matches only while its request holds the pages of its
step's positions (device check against the step's ``seq_lens``); a row without them gets copy flag 0
(the plain schedule, exact), counted once per row and step as ``fallback.sfi_no_history_pages``.
Outside vLLM (tests, benchmarks) the history is a contiguous ``[capacity + 1, max_len]`` tensor (the
same addressing with a trivial table).

Each compact slot keeps the run of positions it recorded without a gap, ``[first, upto)``: a step
whose first position is not ``upto`` (a step without pages recorded nothing) starts a new run there,
and matching never reads before ``first`` (pages are reused blocks: positions never written hold
another request's bytes). So a request that records late never matches its earlier tokens.

A prefix-cache hit's tokens never pass through the step's input ids. Whether a request's prompt hits
the cache depends on other traffic, so a history that began after the hit would make its answer
depend on that traffic. :meth:`HistorySlots.backfill` writes them instead: at a request's first
chunk (fresh or resumed) that starts after position 0, the positions before it are copied from the
runner's host token ids (``StepState.token_ids_host``) into its pages, and its run starts at 0, as
if it had computed them. Torch only (no vLLM).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.host_staging import PinnedStaging
from vllm_ext.kernels.token_history import TokenHistory

# the name of an attention layer's history cache layer (``vllm_ext.methods.sfi.caches``)
HISTORY_SUFFIX = ".sfi_history"


class HistorySlots:
    """Per compact slot: the token history (``history``), its recorded run ``[first_pos, upto)``;
    per request slot: the history pages held (``paged``)."""

    def __init__(self, *, capacity: int, n_slots: int, max_rows: int, max_len: int,
                 device: torch.device, paged: bool):
        self.capacity, self.max_len, self.device, self.paged = capacity, int(max_len), device, paged
        i32 = dict(dtype=torch.int32, device=device)
        self.first_pos = torch.zeros(capacity + 1, **i32)
        self.upto = torch.zeros(capacity + 1, **i32)
        self.held = torch.zeros(n_slots, **i32)
        self.row_from = torch.zeros(max_rows, **i32)
        self.history: TokenHistory | None = (None if paged else
                                             TokenHistory.contiguous(capacity + 1, max_len, device))
        self.gid: int | None = None
        self.on_host = np.zeros(n_slots, dtype=bool)      # request slots recording a history
        self.started = np.zeros(n_slots, dtype=bool)      # ... that have had their first chunk
        self._held_staging = PinnedStaging(max_rows, torch.int32, device)

    # ------------------------------------------------------------------ vLLM's groups
    def bind(self, groups: Mapping[int, tuple]) -> None:
        """SFI's history groups: group id -> (pages per request (the most), layer names, spec, layer
        name -> its page memory). The first group's first layer holds the history."""
        if not self.paged:
            return
        if not groups:
            raise RuntimeError("vllm_ext: sfi.copy_ngram is on but no KV-cache group of vLLM holds SFI's "
                               "token history (its history cache layers were not paged)")
        gid = min(groups)
        width, names, spec, *rest = groups[gid]
        caches = rest[0] if rest else {}
        cache = caches.get(names[0])
        if cache is None or cache.numel() == 0:
            raise RuntimeError(f"vllm_ext: vLLM bound no page memory to {names[0]} (SFI's token history)")
        table = torch.zeros(self.capacity + 1, int(width), dtype=torch.int32, device=self.device)
        self.history = TokenHistory(cache, table, self.max_len)
        want = getattr(spec, "page_elems", self.history.page_elems)
        if want != self.history.page_elems:
            raise RuntimeError(f"vllm_ext: SFI's history spec counts {want} positions per page, the "
                               f"page memory holds {self.history.page_elems}")
        self.gid = gid
        self.held.zero_()

    # ------------------------------------------------------------------ lifecycle
    def reset(self, req_slots: torch.Tensor, sfi_slots: torch.Tensor) -> None:
        """Fresh state for newly assigned request slots (``sfi_slots``: their compact slots or the
        trash entry): nothing recorded, no pages known (they come with the next step)."""
        self.first_pos.index_fill_(0, sfi_slots, 0)
        self.upto.index_fill_(0, sfi_slots, 0)
        self.held.index_fill_(0, req_slots, 0)

    # ------------------------------------------------------------------ per step
    def plan_rows(self, step, on: torch.Tensor, sfi_slot: torch.Tensor):
        """The step's rows (device): the compact slot each row records and matches in (-1: none) and
        the first position its slot's history holds. ``on``: the row's request has SFI on and a
        compact slot; ``sfi_slot``: its compact slot. Real steps copy the rows' block-table rows and
        block counts first and advance the recorded runs."""
        num_rows, n = step.num_rows, step.num_reqs
        if self.paged and self.history is not None:
            self._update_tables(step, sfi_slot)
        t = step.seq_lens[:num_rows]
        ok = on & (t <= self.max_len)
        if self.paged:
            held = self.held[step.row_slot.long()].long()
            ok = ok & (held * self.history.page_elems >= t)
        s = torch.where(ok, sfi_slot, self.capacity).long()
        if step.is_real and n and step.query_start_loc is not None:
            qsl = step.query_start_loc
            first = t[:n] - (qsl[1:n + 1] - qsl[:n])
            sn, okn = s[:n], ok[:n]
            gap = okn & (first != self.upto[sn])
            self.first_pos.index_put_((sn,), torch.where(gap, first, self.first_pos[sn]))
            self.upto.index_put_((sn,), torch.where(okn, t[:n], self.upto[sn]))
            self._count_missing(step)
        self.row_from[:num_rows].copy_(self.first_pos[s])
        return torch.where(ok, sfi_slot, -1).to(torch.int32), self.row_from[:num_rows]

    def backfill(self, step, row_hist_slot: torch.Tensor) -> None:
        """Host plan, device writes: the rows at their request's first chunk that start after
        position 0 (a prefix-cache hit) write positions ``[0, computed)`` from the runner's host
        token ids, and their run starts at 0 (module docstring). Rows that neither record (-1 in
        ``row_hist_slot``, from :meth:`plan_rows`) nor have host token ids write nothing. Prefill
        steps only: a request's first chunk is never a decode row."""
        n = step.num_reqs
        if not (step.is_real and n and step.host_geometry is not None):
            return
        slots = step.row_slot_np[:n]
        first = self.on_host[slots] & ~self.started[slots]
        self.started[slots[self.on_host[slots]]] = True
        ids = step.token_ids_host
        if ids is None or self.history is None or not first.any():
            return
        computed = step.host_geometry[1][:n].astype(np.int64)
        rows = np.flatnonzero(first & (computed > 0) & (computed <= self.max_len))
        if rows.size == 0:
            return
        from vllm_ext.kernels.copy_match import record_tokens

        lens = computed[rows]
        qsl = np.zeros(rows.size + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        tokens = np.concatenate([ids[r, :c] for r, c in zip(rows, lens)]).astype(np.int32)
        dev = self.first_pos.device
        idx = torch.from_numpy(rows).to(dev)
        hist_slot = row_hist_slot[idx]
        record_tokens(self.history, torch.from_numpy(tokens).to(dev), torch.from_numpy(qsl).to(dev),
                      torch.from_numpy(lens.astype(np.int32)).to(dev), hist_slot, int(lens.max()))
        recorded = hist_slot >= 0
        s = torch.where(recorded, hist_slot, self.capacity).long()
        self.first_pos.index_put_((s,), torch.where(recorded, 0, self.first_pos[s]))
        self.row_from.index_put_((idx,), torch.where(recorded, 0, self.row_from[idx]))
        metrics.bump("sfi.history_backfilled_tokens", int(lens.sum()))

    def _update_tables(self, step, sfi_slot: torch.Tensor) -> None:
        """Copy the real rows' block-table rows of the history group into the per-compact-slot table
        and their block counts into ``held`` (device work, no sync; a request not in the step keeps
        its entries: its blocks do not move)."""
        n = step.num_reqs
        staged = step.group_tables or {}
        if not (step.is_real and n and self.gid in staged):
            return
        rows, _, counts = staged[self.gid][:3]
        self._held_staging.np[:n] = counts[:n]
        self.held.index_copy_(0, step.row_slot[:n].long(), self._held_staging.copy_to_device(n))
        table = self.history.table
        dst = torch.where(sfi_slot[:n] >= 0, sfi_slot[:n], self.capacity).long()
        table.index_copy_(0, dst, rows[:n, :table.shape[1]].to(table.dtype))

    def _count_missing(self, step) -> None:
        """Host: count the rows of requests recording a history that lack the pages of their step
        (vLLM's scheduler gives every group's blocks before a step, so this is a disagreement)."""
        staged = step.group_tables or {}
        if not self.paged or step.host_geometry is None or self.gid not in staged:
            return
        n = step.num_reqs
        qsl, computed = step.host_geometry
        seq = computed[:n].astype(np.int64) + (qsl[1:n + 1] - qsl[:n])
        need = -(-seq // self.history.page_elems)
        lack = self.on_host[step.row_slot_np[:n]] & (staged[self.gid][2][:n] < need) & (seq <= self.max_len)
        missing = int(lack.sum())
        if missing:
            metrics.fallback("sfi_no_history_pages", "a request decoding with SFI's copy trigger lacked "
                             "the token-history pages of its step (vLLM's scheduler and SPEEDSFI's rule "
                             "disagree): its rows run without the copy trigger, and it matches only "
                             "tokens recorded after the gap")
            if missing > 1:
                metrics.bump("fallback.sfi_no_history_pages", missing - 1)
