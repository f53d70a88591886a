"""The slow/fast schedule's per-request state (device, by request slot), which the step plan
(:func:`vllm_ext.methods.sfi.step_plan.plan_step`) advances in place: steps since the last slow step,
whether a selection exists, the tokens selected at the last slow step, the sentence-boundary state
(``trigger_state``: cooldown and arm, :mod:`vllm_ext.methods.sfi.schedule`) and the refresh budget.
Torch only (no vLLM).
"""

from __future__ import annotations

import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.sfi.schedule import mark_selected


class ScheduleSlots:
    """Per request slot: the schedule's state; ``trigger_lut``: the token ids that end a sentence."""

    def __init__(self, n_slots: int, cfg: SfiConfig, trigger_lut: torch.Tensor | None, device: torch.device):
        self.trigger_lut = (trigger_lut if trigger_lut is not None
                            else torch.zeros(1, dtype=torch.int8, device=device))
        i32 = dict(dtype=torch.int32, device=device)
        self.sel_count = torch.zeros(n_slots, **i32)
        self.steps_since_slow = torch.zeros(n_slots, **i32)
        self.has_selection = torch.zeros(n_slots, dtype=torch.bool, device=device)
        self.trigger_state = torch.zeros(n_slots, **i32)     # cooldown << 1 | armed; 0 = fresh
        # sfi.refresh_warmup: the refresh budget starts at 1 and doubles at each slow step
        self.first_refresh_gap = 1 if cfg.refresh_warmup else cfg.refresh
        self.refresh_gap = torch.full((n_slots,), self.first_refresh_gap, **i32)

    def reset(self, idx: torch.Tensor) -> None:
        self.sel_count.index_fill_(0, idx, 0)
        self.steps_since_slow.index_fill_(0, idx, 0)
        self.has_selection.index_fill_(0, idx, False)
        self.trigger_state.index_fill_(0, idx, 0)
        self.refresh_gap.index_fill_(0, idx, self.first_refresh_gap)

    def plan_args(self) -> dict[str, torch.Tensor]:
        """The state as :func:`vllm_ext.methods.sfi.step_plan.plan_step` takes it."""
        return dict(steps_since_slow=self.steps_since_slow, has_selection=self.has_selection,
                    sel_count=self.sel_count, trigger_lut=self.trigger_lut,
                    trigger_state=self.trigger_state, refresh_gap=self.refresh_gap)

    def selected_at_prefill(self, row_slot: torch.Tensor, n_sel: torch.Tensor) -> None:
        """Request slots ``row_slot`` made their selection (``n_sel`` tokens) as their prefill ended."""
        mark_selected(self.steps_since_slow, self.has_selection, row_slot,
                      torch.ones_like(row_slot, dtype=torch.bool))
        self.sel_count.index_copy_(0, row_slot.long(), n_sel)
