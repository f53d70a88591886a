"""SFI's compact slots: which request slot holds which compact segment, with its on/off and ``k``
(:class:`CompactSlots`), and, inside vLLM, the block tables of SFI's compact KV-cache groups by
compact slot (:class:`CompactBlockTables`). Torch and numpy only (no vLLM).

Compact slots: one per request slot by default (``sfi.max_requests`` can bound them: a request
without one decodes densely and is counted, ``fallback.sfi_capacity``). Inside vLLM the compact
segments are KV-cache blocks of SFI's own groups (``vllm_ext.methods.sfi.kv_spec``): every step copies
the rows' block-table rows into a per-compact-slot table (read by the kernels) and marks which
requests hold their blocks; a request without them (vLLM gives them when its length first reaches
``first_compact_len``) decodes densely.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.config_fields import ConfigError, changed_fields
from vllm_ext.host_staging import PinnedStaging

# the name of an attention layer's compact cache layer (``vllm_ext.methods.sfi.caches``)
COMPACT_SUFFIX = ".sfi_compact"


class CompactSlots:
    """Per request slot (device): the compact slot (or -1), SFI on/off and ``k``; the free compact
    slots and each assigned slot's compact slot and ``k`` (host); the fresh values of newly assigned
    slots, staged on the host until the next build."""

    def __init__(self, n_slots: int, capacity: int, config, device: torch.device):
        self.config = config
        self.capacity = capacity
        i32 = dict(dtype=torch.int32, device=device)
        self.sfi_slot_of = torch.full((n_slots,), -1, **i32)
        self.sfi_on = torch.zeros(n_slots, dtype=torch.bool, device=device)
        self.sfi_k = torch.zeros(n_slots, **i32)
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.slot_host: dict[int, int] = {}          # request slot -> compact slot
        self.k_host: dict[int, int] = {}
        self._pending: dict[int, tuple[int, int, bool]] = {}   # slot -> (compact slot, k, on)
        self._reset_sfi_slot = PinnedStaging(n_slots, torch.int32, device)
        self._reset_k = PinnedStaging(n_slots, torch.int32, device)
        self._reset_on = PinnedStaging(n_slots, torch.bool, device)

    # ------------------------------------------------------------------ host
    def assign(self, slot: int, overrides: Mapping[str, Any] | None) -> tuple[int, bool, int]:
        """Compact slot, on/off and ``k`` for a request taking request slot ``slot``."""
        cfg = self.config
        if overrides:
            try:
                cfg = cfg.with_overrides(overrides)
            except ConfigError as e:
                metrics.fallback("request_override_invalid", "ignoring a request's speedsfi override: %s", e)
                cfg = self.config
            engine_wide = changed_fields(self.config, cfg) - self.config.per_request_fields
            if engine_wide:
                metrics.fallback("request_override_engine_wide", "a request's speedsfi override sets %s, which "
                                 "only the engine's configuration can change (a request can set %s); ignored",
                                 ", ".join(sorted(engine_wide)), ", ".join(sorted(self.config.per_request_fields)))
        if not cfg.sfi.enabled:
            return -1, False, 0
        k, k_max = cfg.sfi.k, self.config.sfi.k
        if k > k_max:
            metrics.fallback("sfi_k_clamped", "a request asked for sfi.k=%d above the engine's %d "
                             "(the compact buffers' size); using %d", k, k_max, k_max)
            k = k_max
        if not self._free:
            metrics.fallback("sfi_capacity", "all %d SFI compact slots are in use (speedsfi.sfi."
                             "max_requests); further requests decode densely", len(self.slot_host))
            return -1, False, k
        sfi_slot = self._free.pop()
        self.slot_host[slot] = sfi_slot
        self.k_host[slot] = k
        metrics.bump("sfi.slots_assigned")       # exported: in use = assigned - released
        return sfi_slot, True, k

    def release(self, slot: int) -> None:
        sfi_slot = self.slot_host.pop(slot, None)
        self.k_host.pop(slot, None)
        if sfi_slot is not None:
            self._free.append(sfi_slot)
            metrics.bump("sfi.slots_released")

    def stage_reset(self, slot: int, values: tuple[int, int, bool]) -> None:
        """Stage the fresh (compact slot, k, on) of ``slot`` for the next build."""
        self._pending[slot] = values

    def drop_reset(self, slot: int) -> None:
        self._pending.pop(slot, None)

    def staged_resets(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The staged values of ``slots`` (consumed), as device tensors (compact slot, k, on)."""
        n = len(slots)
        values = [self._pending.pop(slot) for slot in slots]
        self._reset_sfi_slot.np[:n] = [v[0] for v in values]
        self._reset_k.np[:n] = [v[1] for v in values]
        self._reset_on.np[:n] = [v[2] for v in values]
        return (self._reset_sfi_slot.copy_to_device(n), self._reset_k.copy_to_device(n),
                self._reset_on.copy_to_device(n))

    # ------------------------------------------------------------------ device
    def reset(self, idx: torch.Tensor, sfi_slot: torch.Tensor, sfi_k: torch.Tensor,
              sfi_on: torch.Tensor) -> torch.Tensor:
        """Write the fresh values of request slots ``idx``; returns each one's compact-slot entry
        (the scratch entry ``capacity`` for a request without a compact slot)."""
        self.sfi_slot_of.index_copy_(0, idx, sfi_slot)
        self.sfi_k.index_copy_(0, idx, sfi_k)
        self.sfi_on.index_copy_(0, idx, sfi_on)
        return torch.where(sfi_slot >= 0, sfi_slot, self.capacity).long()


class CompactBlockTables:
    """SFI's compact KV-cache groups: per group a table ``[capacity + 1, blocks per request]`` by
    compact slot (entry ``capacity`` takes the rows of requests without a compact slot), the same
    tables by attention layer name, and per request slot whether it holds its blocks. Empty until
    :meth:`bind` (outside vLLM nothing is gated)."""

    def __init__(self, capacity: int, n_slots: int, max_rows: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self._n_slots, self._max_rows = n_slots, max_rows
        self.tables: dict[int, torch.Tensor] = {}
        self.table_of_layer: dict[str, torch.Tensor] = {}
        self.ok: torch.Tensor | None = None
        self._on_eff: torch.Tensor | None = None
        self._ok_staging: PinnedStaging | None = None

    def bind(self, groups: Mapping[int, tuple[int, list[str]]]) -> None:
        """The compact segments live in vLLM's KV-cache groups ``groups``: group id -> (blocks per
        request, the attention layers whose compact caches it holds). Called again when vLLM
        builds a new KV cache (the tables start empty; every live request's rows come back with its
        next step)."""
        dev = self.device
        self.tables = {gid: torch.zeros(self.capacity + 1, n_c, dtype=torch.int32, device=dev)
                       for gid, (n_c, _) in groups.items()}
        self.table_of_layer = {name: self.tables[gid]
                               for gid, (_, names) in groups.items() for name in names}
        self.ok = torch.zeros(self._n_slots, dtype=torch.bool, device=dev)
        self._on_eff = torch.zeros(self._n_slots, dtype=torch.bool, device=dev)
        self._ok_staging = PinnedStaging(self._max_rows, torch.bool, dev)

    def reset(self, idx: torch.Tensor) -> None:
        if self.ok is not None:
            self.ok.index_fill_(0, idx, False)      # its blocks come with its next step

    def gate(self, step, sfi_slot_of: torch.Tensor, sfi_on: torch.Tensor) -> torch.Tensor:
        """Copy the step's block-table rows of SFI's groups into the per-compact-slot tables, mark
        which requests hold their blocks, and return ``sfi_on`` restricted to those (device work,
        no sync; a request not in the step keeps its rows: its blocks do not move)."""
        n = step.num_reqs
        staged = step.group_tables or {}
        if step.is_real and n and all(gid in staged for gid in self.tables):
            row_slot = step.row_slot[:n].long()
            ok = np.ones(n, dtype=bool)
            for gid in self.tables:
                ok &= staged[gid][1][:n]
            self._ok_staging.np[:n] = ok
            self.ok.index_copy_(0, row_slot, self._ok_staging.copy_to_device(n))
            sfi_slot = sfi_slot_of[row_slot]
            dst = torch.where(sfi_slot >= 0, sfi_slot, self.capacity).long()
            for gid, table in self.tables.items():
                rows = staged[gid][0]
                table.index_copy_(0, dst, rows[:n, :table.shape[1]].to(table.dtype))
        torch.logical_and(sfi_on, self.ok, out=self._on_eff)
        return self._on_eff

    def held(self, step) -> np.ndarray | None:
        """Per real row (host): the request holds its compact blocks (None: no SFI groups bound)."""
        if not self.tables or not step.group_tables:
            return None
        ok = np.ones(step.num_reqs, dtype=bool)
        for gid in self.tables:
            if gid not in step.group_tables:
                return np.zeros(step.num_reqs, dtype=bool)
            ok &= step.group_tables[gid][1][:step.num_reqs]
        return ok
