"""What the generic per-request slot table (:class:`vllm_ext.request_state.RequestStateTable`) asks
of a method's own per-request tables, which live in the method's package and are indexed by the same
request slot. The table calls every registered method table, in registration order:

- host, when a request takes a slot: ``slot_assigned`` (stage the slot's fresh state; nothing on the
  device yet), and when it gives the slot back: ``slot_released``;
- device, at the next build: ``reset_slots`` (the slots assigned since the last build start clean);
- per step, at build: ``plan_step`` (the method's plan of the step into its persistent buffers, or
  ``None``; the step exposes it under the method's ``name``), and, when a test records the steps,
  ``snapshot_fields`` (extra host fields of a row's snapshot);
- once per KV cache vLLM builds: ``bind_kv_groups`` (the KV-cache groups whose spec names this method
  in ``speedsfi_method``: a method's per-request memory that vLLM's block manager pages, e.g. SFI's
  compact segments, CritiPrefill's state; their block-table rows and each row's block count reach
  ``plan_step`` as ``step.group_tables``).

Everything here runs inside the plan half of the plan/run split (see ``vllm_ext.request_state``).
Torch only (no vLLM).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


class MethodSlots:
    """Base of a method's per-request tables; each hook does nothing unless the method needs it."""

    name = ""    # the key of the method's plan in ``StepState.plans``

    def slot_assigned(self, slot: int, overrides: Mapping[str, Any] | None, *, resumed: bool) -> None:
        """A request took request slot ``slot`` (``resumed``: it resumes after preemption)."""

    def slot_released(self, slot: int) -> None:
        """The request in ``slot`` left (finished, aborted, preempted); its reset may still be staged."""

    def reset_slots(self, idx: torch.Tensor, slots: list[int]) -> None:
        """On the device: fresh state for the slots assigned since the last build (``idx``: their
        device index, in the order of the host list ``slots``)."""

    def plan_step(self, step) -> Any:
        """The method's plan of ``step`` (a :class:`vllm_ext.request_state.StepState`), or ``None``."""
        return None

    def bind_kv_groups(self, groups: Mapping[int, tuple[int, list[str]]]) -> None:
        """This method's KV-cache groups: group id -> (blocks a request holds there (the most, for a
        growing allocation), the group's layer names[, the group's KV-cache spec])."""

    def snapshot_fields(self, plan: Any, row: int, slot: int) -> dict[str, Any]:
        """Host fields this method adds to row ``row``'s snapshot (synchronises: tests only)."""
        return {}
