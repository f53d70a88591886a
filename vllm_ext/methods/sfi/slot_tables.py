"""SFI's per-request tables, indexed by the generic request slot of
:class:`vllm_ext.request_state.RequestStateTable` (registered there as its
:class:`vllm_ext.method_slots.MethodSlots`), and the step plan built from them.

:class:`SfiSlotTables` composes the parts and plans each step over them:

- the compact slots, SFI on/off and ``k`` per request, and inside vLLM the block tables of SFI's
  compact KV-cache groups (:mod:`vllm_ext.methods.sfi.compact_slots`);
- the slow/fast schedule's state (:mod:`vllm_ext.methods.sfi.schedule_slots`);
- selector ``quest``'s page progress and page tables (:mod:`vllm_ext.methods.sfi.quest_slots`);
- ``sfi.copy_ngram``'s token histories and copy flags (:mod:`vllm_ext.methods.sfi.copy_trigger`);
- the prefill-end selections and ``sfi.keep_prefill``'s kept tokens
  (:mod:`vllm_ext.methods.sfi.prefill_end`);
- the counters, on the device (``stats``) and read asynchronously
  (:class:`vllm_ext.device_counters.DeviceCounters`).

Torch only (no vLLM).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.device_counters import DeviceCounters
from vllm_ext.method_slots import MethodSlots
from vllm_ext.request_state import StepState
from vllm_ext.methods.sfi.compact_slots import COMPACT_SUFFIX, CompactBlockTables, CompactSlots
from vllm_ext.methods.sfi.copy_trigger import CopyTrigger
from vllm_ext.methods.sfi.prefill_end import PrefillEndPlanner
from vllm_ext.methods.sfi.quest_slots import QuestSlots
from vllm_ext.methods.sfi.quest_tables import QUEST_SUFFIX, QuestPrefillPages  # noqa: F401
from vllm_ext.methods.sfi.schedule_slots import ScheduleSlots
from vllm_ext.methods.sfi.step_plan import (NUM_STATS, RETAINED_FRACTION_BOUNDS_PCT, STAT_CONTEXT, STAT_COPY, STAT_DENSE,
                                    STAT_FAST, STAT_PREFILL_END, STAT_RETAINED,
                                    STAT_RETAINED_FRACTION_PPM, STAT_RETAINED_HIST, STAT_SLOW,
                                    SfiPlanBuffers, SfiStep, maintenance_chunk,
                                    plan_step as plan_sfi_step)

STAT_NAMES = {STAT_SLOW: "sfi.slow_steps", STAT_FAST: "sfi.fast_steps",
              STAT_DENSE: "sfi.dense_rows", STAT_COPY: "sfi.copy_slow_steps", STAT_RETAINED: "sfi.fast_retained_tokens",
              STAT_CONTEXT: "sfi.fast_context_tokens",
              STAT_PREFILL_END: "sfi.prefill_end_selections",
              STAT_RETAINED_FRACTION_PPM: "sfi.fast_retained_fraction_sum_ppm",
              **{STAT_RETAINED_HIST + j: f"sfi.fast_retained_fraction_le_{pct}pct"
                 for j, pct in enumerate(RETAINED_FRACTION_BOUNDS_PCT)}}


def _part(part: str, name: str) -> property:
    """A read-only view of attribute ``name`` of the part ``part``."""
    return property(lambda self: getattr(getattr(self, part), name),
                    doc=f"``self.{part}.{name}``")


def _copy_part(name: str) -> property:
    """Attribute ``name`` of the copy trigger (None with ``sfi.copy_ngram`` off)."""
    return property(lambda self: None if self.copy is None else getattr(self.copy, name),
                    doc=f"``self.copy.{name}`` (None without the copy trigger)")


class SfiSlotTables(MethodSlots):
    name = "sfi"

    def __init__(self, n_slots: int, capacity: int, max_rows: int, config,
                 trigger_lut: torch.Tensor | None, device: torch.device, *, max_model_len: int = 0,
                 paged_history: bool = False):
        self.config = config
        self.cfg = config.sfi
        self.capacity = capacity
        self.device = device
        self.compact = CompactSlots(n_slots, capacity, config, device)
        self.blocks = CompactBlockTables(capacity, n_slots, max_rows, device)
        self.schedule = ScheduleSlots(n_slots, self.cfg, trigger_lut, device)
        self.quest_pages = QuestSlots(self.cfg, capacity, n_slots, max_rows, device)
        self.copy = (CopyTrigger(self.cfg, capacity=capacity, n_slots=n_slots, max_rows=max_rows,
                                 max_len=max_model_len, device=device, paged=paged_history)
                     if self.cfg.resolved_copy_ngram else None)
        self.counters = DeviceCounters(NUM_STATS, device)
        self.prefill_end = PrefillEndPlanner(self.cfg, self.compact, self.schedule, self.counters.values, device)
        self.plan_buffers = SfiPlanBuffers(max_rows, capacity, device,
                                           chunk_rows=maintenance_chunk(self.cfg, capacity))

    # what other modules, the benchmarks and the tests read of the parts
    sfi_slot_of = _part("compact", "sfi_slot_of")
    sfi_on = _part("compact", "sfi_on")
    sfi_k = _part("compact", "sfi_k")
    slot_host = _part("compact", "slot_host")
    k_host = _part("compact", "k_host")
    compact_tables = _part("blocks", "tables")
    compact_table_of_layer = _part("blocks", "table_of_layer")
    steps_since_slow = _part("schedule", "steps_since_slow")
    has_selection = _part("schedule", "has_selection")
    sel_count = _part("schedule", "sel_count")
    trigger_state = _part("schedule", "trigger_state")
    refresh_gap = _part("schedule", "refresh_gap")
    page_upto = _part("quest_pages", "page_upto")
    quest = _part("quest_pages", "tables")
    n_kept = _part("prefill_end", "n_kept")
    history_slots = _copy_part("history_slots")
    row_copy = _copy_part("row_copy")
    copy_prev = _copy_part("copy_prev")
    history = _copy_part("history")
    stats = _part("counters", "values")

    def bind_kv_groups(self, groups: Mapping[int, tuple[int, list[str]]]) -> None:
        """``MethodSlots``: SFI's KV-cache groups, group id -> (blocks per request, layer names[,
        spec, layer name -> page memory]), told apart by their layers' suffix: the compact groups
        (``vllm_ext.methods.sfi.kv_spec``, layers ``<attention layer>`` + :data:`COMPACT_SUFFIX`), the
        history groups (``vllm_ext.methods.sfi.history_kv_spec``, ``HISTORY_SUFFIX``) and with selector
        ``quest`` the groups of its page bounds (``vllm_ext.methods.sfi.quest_tables``, ``QUEST_SUFFIX``)."""
        def layers(names, suffix):
            return [n[:-len(suffix)] for n in names if n.endswith(suffix)]

        self.blocks.bind({gid: (n_c, layers(names, COMPACT_SUFFIX))
                          for gid, (n_c, names, *_) in groups.items() if layers(names, COMPACT_SUFFIX)})
        if self.copy is not None:
            self.copy.bind(groups)
        if self.quest is not None:
            self.quest.bind({gid: (n, layers(names, QUEST_SUFFIX), rest[0].block_size)
                             for gid, (n, names, *rest) in groups.items() if layers(names, QUEST_SUFFIX)})

    # ------------------------------------------------------------------ lifecycle (host)
    def assign(self, slot: int, overrides: Mapping[str, Any] | None) -> tuple[int, bool, int]:
        """Compact slot, on/off and ``k`` for a request taking request slot ``slot``."""
        self.prefill_end.forget(slot)
        self.quest_pages.forget(slot)
        sfi_slot, on, k = self.compact.assign(slot, overrides)
        if sfi_slot >= 0 and self.copy is not None:
            self.copy.assigned(slot)
        return sfi_slot, on, k

    def release(self, slot: int) -> None:
        if self.copy is not None:
            self.copy.released(slot)
        self.prefill_end.forget(slot)
        self.quest_pages.forget(slot)
        self.compact.release(slot)

    def apply_resets(self, idx: torch.Tensor, sfi_slot: torch.Tensor, sfi_k: torch.Tensor,
                     sfi_on: torch.Tensor) -> None:
        fresh = self.compact.reset(idx, sfi_slot, sfi_k, sfi_on)
        self.blocks.reset(idx)
        self.schedule.reset(idx)
        self.quest_pages.reset(fresh)
        self.prefill_end.reset(fresh)
        if self.copy is not None:
            self.copy.reset(idx, fresh)

    # ------------------------------------------------------------------ MethodSlots
    def slot_assigned(self, slot: int, overrides: Mapping[str, Any] | None, *, resumed: bool) -> None:
        sfi_slot, on, k = self.assign(slot, overrides)
        self.compact.stage_reset(slot, (sfi_slot, k, on))
        if resumed and slot in self.slot_host:
            # vLLM preempts by recomputation: the KV of the generated tokens is recomputed by
            # a dense prefill, not by the sparse decode steps that first wrote it
            metrics.fallback("sfi_preempted", "a request decoding with SFI was preempted and "
                             "resumes from a dense recompute of its context with a fresh "
                             "selection: its later tokens can differ from an unpreempted run "
                             "(preemption depends on other traffic; give the KV cache headroom "
                             "or lower --max-num-seqs to avoid it)")

    def slot_released(self, slot: int) -> None:
        self.release(slot)
        self.compact.drop_reset(slot)

    def reset_slots(self, idx: torch.Tensor, slots: list[int]) -> None:
        self.apply_resets(idx, *self.compact.staged_resets(slots))

    def plan_step(self, step: StepState) -> SfiStep | None:
        if step.seq_lens is None:
            return None
        # planned on every build, real or not: a CUDA-graph capture records the real SFI path
        # over these buffers (its rows are padding, so they plan as dense)
        num_reqs, num_rows = step.num_reqs, step.num_rows
        sfi_rows = step.row_is_decode
        if step.is_real and num_reqs:
            # SFI decodes one-query rows only: a resumed request recomputing its generated
            # tokens (several per row, all "decode") attends densely and leaves SFI state alone
            qsl = step.query_start_loc
            q_len = qsl[1:num_rows + 1] - qsl[:num_rows]
            sfi_rows = step.row_is_decode * (q_len == 1)
        sfi_on = self.blocks.gate(step, self.sfi_slot_of, self.sfi_on) if self.compact_tables else self.sfi_on
        sfi_on = self.quest_pages.gate(step, self.sfi_slot_of, sfi_on)
        row_copy = None
        if self.history is not None:
            row_copy = self.copy_rows(step, sfi_rows, sfi_on)
        plan = self.plan(row_slot=step.row_slot, row_last_token=step.row_last_token,
                         row_is_decode=sfi_rows, seq_lens=step.seq_lens, block_table=step.block_table,
                         sfi_on=sfi_on, row_copy=row_copy)
        if step.is_real and step.host_geometry is not None and self.cfg.selector == "quest":
            # quest: the prefill chunks write their pages' max/min of K; without keep_prefill
            # there is no prefill-end selection (the first decode step selects)
            plan.quest_pages = self.plan_quest_pages(
                num_reqs=num_reqs, row_slots=step.row_slot_np, row_is_decode=step.row_is_decode_np,
                host_geometry=step.host_geometry, held=self.quest.held(step.group_tables, num_reqs))
        if step.is_real and step.host_geometry is not None and self.cfg.prefill_end_selection:
            plan.prefill_end = self.plan_prefill_end(
                num_reqs=num_reqs, row_slots=step.row_slot_np, row_is_decode=step.row_is_decode_np,
                prompt_len=step.table.prompt_len_np, host_geometry=step.host_geometry,
                row_slot_device=step.row_slot, row_has_blocks=self.blocks.held(step))
        self.counters.publish()
        return plan

    def snapshot_fields(self, plan: SfiStep | None, row: int, slot: int) -> dict[str, Any]:
        return {"steps_since_slow": int(self.steps_since_slow[slot]),
                "mode": ("dense" if plan is None or not bool(plan.row_sparse[row]) else
                         "slow" if bool(plan.row_slow[row]) else "fast")}

    # ------------------------------------------------------------------ per step (device)
    def copy_rows(self, step: StepState, sfi_rows: torch.Tensor, sfi_on: torch.Tensor) -> torch.Tensor:
        """``sfi.copy_ngram``: the step's copy flags (:meth:`CopyTrigger.rows`)."""
        return self.copy.rows(step, sfi_rows, sfi_on, self.sfi_slot_of, self.sfi_on)

    def plan(self, *, row_slot, row_last_token, row_is_decode, seq_lens, block_table,
             sfi_on: torch.Tensor | None = None, row_copy=None) -> SfiStep:
        step = plan_sfi_step(self.cfg, row_slot=row_slot, row_last_token=row_last_token,
                             row_is_decode=row_is_decode, seq_lens=seq_lens,
                             sfi_slot_of=self.sfi_slot_of,
                             sfi_on=self.sfi_on if sfi_on is None else sfi_on, sfi_k=self.sfi_k,
                             stats=self.stats, buffers=self.plan_buffers, block_table=block_table,
                             row_copy=row_copy, **self.schedule.plan_args())
        if self.cfg.selector == "quest":
            self.quest_pages.plan_decode(step, seq_lens)
        if self.cfg.keep_prefill:
            self.prefill_end.plan_kept(step)
        return step

    def plan_prefill_end(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
                         prompt_len: np.ndarray, host_geometry, row_slot_device: torch.Tensor,
                         row_has_blocks: np.ndarray | None = None):
        """This step's prompt-tail writes and the requests whose prefill ends in it
        (:meth:`PrefillEndPlanner.plan`)."""
        return self.prefill_end.plan(num_reqs=num_reqs, row_slots=row_slots, row_is_decode=row_is_decode,
                                     prompt_len=prompt_len, host_geometry=host_geometry,
                                     row_slot_device=row_slot_device, row_has_blocks=row_has_blocks)

    def plan_quest_pages(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
                         host_geometry, held: np.ndarray | None = None) -> "QuestPrefillPages | None":
        """Selector ``quest``: the pages the step's multi-token rows write (:meth:`QuestSlots.plan_prefill`)."""
        return self.quest_pages.plan_prefill(num_reqs=num_reqs, row_slots=row_slots, row_is_decode=row_is_decode,
                                             host_geometry=host_geometry, slot_host=self.slot_host, held=held)

    def counter_values(self) -> dict[str, int]:
        values = self.counters.read()
        return {name: values[i] for i, name in STAT_NAMES.items()}
