"""The engine's per-request table: the generic slot table (:mod:`vllm_ext.request_state`) with the
per-slot tables of the methods the engine runs registered in it (SFI's, CritiPrefill's), and the
views the backend, the runner hooks and the tests read them through. Torch only (no vLLM).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vllm_ext import metrics
from vllm_ext.config import SpeedSfiConfig
from vllm_ext.methods.critiprefill.slots import CritiPrefillSlots, CritiPrefillStep
from vllm_ext.request_state import RequestStateTable, StepState
from vllm_ext.methods.sfi.slot_tables import SfiSlotTables
from vllm_ext.methods.sfi.step_plan import SfiStep


class EngineStepState(StepState):
    @property
    def sfi(self) -> SfiStep | None:
        return self.plans.get("sfi")

    @property
    def critiprefill(self) -> CritiPrefillStep | None:
        """Prefill steps with a CritiPrefill sub-batch only."""
        return self.plans.get("critiprefill")


class EngineRequestTable(RequestStateTable):
    step_type = EngineStepState

    def __init__(self, max_reqs: int, device: torch.device | str, *,
                 config: SpeedSfiConfig | None = None, sfi_capacity: int = 0,
                 trigger_lut: torch.Tensor | None = None, max_model_len: int = 0,
                 paged_history: bool = False):
        super().__init__(max_reqs, device)
        self.config = config or SpeedSfiConfig()
        self.sfi: SfiSlotTables | None = None
        if self.config.sfi.enabled and sfi_capacity > 0:
            self.sfi = self.register(SfiSlotTables(self.num_slots, sfi_capacity, max_reqs, self.config,
                                                   trigger_lut, self.device, max_model_len=max_model_len,
                                                   paged_history=paged_history))
        self.critiprefill: CritiPrefillSlots | None = None
        if self.config.critiprefill.enabled:
            # no pool: the state of each prompt is pages of CritiPrefill's KV-cache groups
            self.critiprefill = self.register(CritiPrefillSlots(self.num_slots, max_reqs,
                                                                self.config.critiprefill, self.device))

    @property
    def sfi_enabled(self) -> bool:
        return self.sfi is not None

    @property
    def steps_since_slow(self) -> torch.Tensor:
        """SFI's per-slot counter; without SFI there is no slow step, so it is the decode steps
        since the slot was assigned."""
        return self.decode_steps if self.sfi is None else self.sfi.steps_since_slow

    @property
    def has_selection(self) -> torch.Tensor | None:
        return None if self.sfi is None else self.sfi.has_selection

    @property
    def sfi_stats(self) -> torch.Tensor | None:
        return None if self.sfi is None else self.sfi.stats

    def acquire(self, req_id: str, prompt_len: int, overrides: Mapping[str, Any] | None = None, *,
                resumed: bool = False) -> int:
        new = req_id not in self.slot_of
        slot = super().acquire(req_id, prompt_len, overrides, resumed=resumed)
        if new and self.sfi is None and _asks_for_sfi(overrides):
            metrics.fallback("sfi_not_configured", "a request enabled SFI but the engine was started "
                             "without it (no compact buffers); it decodes densely")
        return slot

    def publish_device_counters(self) -> None:
        """Queue a copy of the methods' device counters (no host sync). The builders do this at each
        step's plan, which covers the steps before it; a step without a forward (vLLM runs one to
        hand back finished requests) calls this so that the last forward's counts are published."""
        for tables in (self.sfi, self.critiprefill):
            if tables is not None:
                tables.counters.publish()

    def snapshot(self, step: StepState, row_req_ids: list[str | None]) -> dict[str, dict[str, int]]:
        views = super().snapshot(step, row_req_ids)
        if self.sfi is None:
            for view in views.values():
                view["steps_since_slow"] = int(self.decode_steps[view["slot"]])
                view["mode"] = "dense"
        return views


def _asks_for_sfi(overrides: Mapping[str, Any] | None) -> bool:
    sfi = (overrides or {}).get("sfi") if isinstance(overrides, Mapping) else None
    return isinstance(sfi, Mapping) and bool(sfi.get("enabled"))
