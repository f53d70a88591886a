"""Selector ``quest``'s page progress per compact slot and the step's page writes: how far each
slot's page bounds (max/min of K per page) are written, which pages the step's decode rows and
prefill chunks rewrite, and, inside vLLM, the Quest groups' page tables
(:class:`vllm_ext.methods.sfi.quest_tables.QuestPageTables`). Torch and numpy only (no vLLM).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.sfi.quest_tables import QuestPageTables, QuestPrefillPages
from vllm_ext.methods.sfi.state_pages import first_compact_len
from vllm_ext.methods.sfi.step_plan import SfiStep


class QuestSlots:
    """``page_upto``: per compact slot (+ a scratch entry) the positions whose page bounds are
    written (always allocated; only selector ``quest`` moves it); ``tables``: the page tables (None
    for the other selectors)."""

    def __init__(self, cfg: SfiConfig, capacity: int, n_slots: int, max_rows: int, device: torch.device):
        self.page_size, self.capacity = cfg.page_size, capacity
        # a fresh slot starts at 0, so its first decode row writes every page of a cached context
        self.page_upto = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
        self.tables = (QuestPageTables(cfg.page_size, first_compact_len(cfg), capacity, n_slots, max_rows, device)
                       if cfg.selector == "quest" else None)

    def forget(self, slot: int) -> None:
        if self.tables is not None:
            self.tables.forget(slot)

    def reset(self, fresh: torch.Tensor) -> None:
        """Compact-slot entries ``fresh`` start with no page written."""
        if self.tables is not None:
            self.page_upto.index_fill_(0, fresh, 0)

    def gate(self, step, sfi_slot_of: torch.Tensor, sfi_on: torch.Tensor) -> torch.Tensor:
        """``sfi_on`` restricted to the requests holding their page bounds (:meth:`QuestPageTables.gate`)."""
        if self.tables is None:
            return sfi_on
        return self.tables.gate(step, sfi_slot_of, sfi_on, self.page_upto)

    def plan_decode(self, step: SfiStep, seq_lens: torch.Tensor) -> None:
        """Each SFI decode row writes its pages from the first one its slot has not written
        (normally the newest token's page; page 0 for a slot that is fresh while its context is
        cached, e.g. a request resumed after preemption whose prefix hit left one token to compute)."""
        ps = step.row_page_slot
        on = ps >= 0
        slot = torch.where(on, ps, self.capacity).long()
        upto = self.page_upto[slot]
        step.row_page_first.copy_(torch.where(on, torch.div(upto, self.page_size, rounding_mode="floor"), 0))
        self.page_upto.index_put_((slot,), torch.where(on, seq_lens[:ps.shape[0]].to(upto.dtype), upto))

    def plan_prefill(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
                     host_geometry, slot_host, held: np.ndarray | None = None) -> QuestPrefillPages | None:
        """The pages the step's multi-token rows write (:meth:`QuestPageTables.plan_prefill`;
        ``held``: the rows' bound-page blocks inside vLLM)."""
        return self.tables.plan_prefill(num_reqs=num_reqs, row_slots=row_slots, row_is_decode=row_is_decode,
                                        host_geometry=host_geometry, slot_host=slot_host, held=held,
                                        page_upto=self.page_upto)
