"""SFI method logic (ALGORITHMS.md §1): trigger sets, the device-side slow/fast schedule and the
Selector. Pure PyTorch; imports neither vLLM nor Triton (the Triton selector is
:mod:`vllm_ext.kernels.sfi_selector`, with :func:`vllm_ext.kernels.sfi_selector_torch.select` as its twin)."""

from vllm_ext.methods.sfi.schedule import (SCHEDULES, allowed_range, decide_slow, dense_threshold, is_exactly_dense,
                                   is_trigger, mark_selected, reset_slots)
from vllm_ext.kernels.sfi_selector_torch import select, selector_scores
from vllm_ext.methods.sfi.triggers import boundary_token_ids, ends_in_trigger, trigger_lut, trigger_token_ids

__all__ = [
    "SCHEDULES", "allowed_range", "boundary_token_ids", "decide_slow", "dense_threshold",
    "ends_in_trigger", "is_exactly_dense", "is_trigger", "mark_selected", "reset_slots", "select",
    "selector_scores", "trigger_lut", "trigger_token_ids",
]
