"""The host plan of SFI's prefill-end selections: each step's prompt-tail writes and the requests
whose prefill ends in it (:mod:`vllm_ext.methods.sfi.prompt_tail`), with the host state that needs
(where each request's computation started, which requests lost prompt-tail positions) and, with
``sfi.keep_prefill``, the tokens each compact slot's prefill-end selection keeps for the whole
decode. Torch and numpy only (no vLLM).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.sfi.compact_slots import CompactSlots
from vllm_ext.methods.sfi.prompt_tail import (SfiPrefillEnd, TailRow, kept_count, makes_prefill_selection,
                                              plan_prompt_tail, tail_window)
from vllm_ext.methods.sfi.schedule_slots import ScheduleSlots
from vllm_ext.methods.sfi.step_plan import STAT_PREFILL_END, SfiStep


class PrefillEndPlanner:
    """Reads the compact slots (``compact``) and marks the selections it plans in the schedule's
    state (``schedule``) and in ``stats``. Host: per request slot the first position it computed
    (``first_computed``) and whether it computed prompt-tail positions while not holding its
    compact blocks (``tail_lost``); device: per compact slot (+ a scratch entry) the kept tokens
    (``n_kept``, 0 for a slot whose prefill made no selection)."""

    def __init__(self, cfg: SfiConfig, compact: CompactSlots, schedule: ScheduleSlots, stats: torch.Tensor,
                 device: torch.device):
        self.cfg, self.device, self.capacity = cfg, device, compact.capacity
        self.compact, self.schedule, self.stats = compact, schedule, stats
        self.first_computed: dict[int, int] = {}
        self.tail_lost: set[int] = set()
        self.n_kept = torch.zeros(compact.capacity + 1, dtype=torch.int32, device=device)

    def forget(self, slot: int) -> None:
        """Request slot ``slot`` took a new request or left."""
        self.first_computed.pop(slot, None)
        self.tail_lost.discard(slot)

    def reset(self, fresh: torch.Tensor) -> None:
        """Compact-slot entries ``fresh`` keep nothing."""
        if self.cfg.keep_prefill:
            self.n_kept.index_fill_(0, fresh, 0)

    def plan_kept(self, step: SfiStep) -> None:
        """``sfi.keep_prefill``: each slow row's kept tokens, and the budget it selects besides them."""
        live = step.slow_sfi_slot >= 0
        kept = self.n_kept[torch.where(live, step.slow_sfi_slot, self.capacity).long()]
        step.slow_kept.copy_(torch.where(live, kept, 0))
        step.slow_k.sub_(step.slow_kept)

    def plan(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
             prompt_len: np.ndarray, host_geometry, row_slot_device: torch.Tensor,
             row_has_blocks: np.ndarray | None = None) -> SfiPrefillEnd | None:
        """This step's prompt-tail writes and the requests whose prefill ends in it (host geometry
        is exact for prefill rows). ``row_has_blocks`` (inside vLLM): a request without its compact
        blocks makes no selection (its first decode step selects; counted)."""
        cfg = self.cfg
        slot_host, k_host = self.compact.slot_host, self.compact.k_host
        qsl, computed = host_geometry
        rows = []
        for row in range(num_reqs):
            slot = int(row_slots[row])
            if row_is_decode[row] or slot not in slot_host:
                continue
            p, k = int(prompt_len[slot]), k_host[slot]
            if not makes_prefill_selection(cfg, p, k):
                continue
            done, q_len = int(computed[row]), int(qsl[row + 1] - qsl[row])
            ends = done + q_len >= p
            first = self.first_computed.setdefault(slot, done)
            if row_has_blocks is not None and not row_has_blocks[row]:
                # its tail queries live in its compact-group blocks (vllm_ext.methods.sfi.state_pages): a
                # chunk without them writes none, and the request makes no prefill-end selection
                if done + q_len > tail_window(cfg, p)[0]:
                    self.tail_lost.add(slot)
                if ends:
                    metrics.fallback("sfi_no_compact_blocks", "a request's prefill ended without its "
                                     "SFI compact blocks (vLLM's scheduler and SPEEDSFI's rule "
                                     "disagree); its first decode step makes the selection")
                continue
            if ends and slot in self.tail_lost:
                metrics.fallback("sfi_prompt_tail_lost", "a request computed prompt-tail positions "
                                 "before it held its SFI blocks (vLLM's scheduler and SPEEDSFI's rule "
                                 "disagree); its first decode step makes the selection")
                continue
            rows.append(TailRow(row=row, token_start=int(qsl[row]), computed=done,
                                q_len=q_len, prompt_len=p, k=k,
                                sfi_slot=slot_host[slot], first_computed=first))
        plan, incomplete = plan_prompt_tail(cfg, rows, self.device)
        if incomplete:
            metrics.fallback("sfi_prompt_tail_incomplete", "a prefix-cache hit reached into the last "
                             "w_prefill=%d prompt positions of %d request(s): their prefill-end "
                             "evidence uses the queries they computed", cfg.w_prefill, incomplete)
        if plan is not None and plan.num_ends:
            n_sel = torch.minimum(plan.k, plan.allowed_hi - plan.allowed_lo)
            self.schedule.selected_at_prefill(row_slot_device[plan.rows], n_sel)
            if cfg.keep_prefill:
                self.n_kept.index_copy_(0, plan.sfi_slot.long(), kept_count(cfg, plan.k, n_sel))
            self.stats[STAT_PREFILL_END] += plan.num_ends
        return plan
