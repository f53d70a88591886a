"""Per-request state in persistent device tables, indexed by a stable per-request slot.

vLLM's V1 model runner moves requests between batch rows (condense, swap, decode-first reorder), so
the row of a request says nothing across steps. This table gives each request a *slot* for as long
as it sits in the runner's persistent batch, and keeps what SFI and SPEED need per slot on the
device: the prompt length, the steps since the last slow step, whether a selection exists, and a
generation stamp that changes whenever the slot is (re)assigned. Per step it publishes, per batch
row, the slot, the prompt length and the last sampled token (read on the device from the step's
input ids, so it is right under async scheduling where the host never sees it).

A request loses its slot when it finishes or is aborted, is preempted (it comes back with its KV
recomputed, and so with fresh state), or leaves the persistent batch for any other reason; a slot
given out again starts from a clean state.

Torch only (no vLLM): ``vllm_ext.runner_hooks`` feeds it from the runner.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.config import ConfigError, SpeedSfiConfig


class PinnedStaging:
    """A host buffer (pinned when the device is CUDA) and its device twin; copies are non-blocking.

    Writes to the host side must only happen while the runner guarantees that the previous step's
    copy has completed (vLLM's ``synchronize_input_prep`` window, where these are written).
    """

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.cpu = torch.zeros(n, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(n, dtype=dtype, device=device)

    def copy_to_device(self, n: int) -> torch.Tensor:
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


# what a request's SamplingParams.extra_args["speedsfi"] may change; everything else is engine-wide
# (kernel constants, buffer sizes, the schedule) and is refused loudly
PER_REQUEST_FIELDS = frozenset({"sfi.enabled", "sfi.k"})


def _changed_fields(base: SpeedSfiConfig, other: SpeedSfiConfig) -> set[str]:
    """``section.field`` names whose values differ (the method sections; ``preset`` is not one)."""
    changed = set()
    for section in (f.name for f in fields(base) if f.name != "preset"):
        a, b = getattr(base, section), getattr(other, section)
        changed.update(f"{section}.{f.name}" for f in fields(a) if getattr(a, f.name) != getattr(b, f.name))
    return changed


@dataclass
class StepState:
    """What one model step knows about its rows. Tensors are views of persistent buffers."""

    num_reqs: int                  # real rows
    num_rows: int                  # rows including padding (padded rows use the scratch slot)
    is_real: bool                  # False for profiling, warm-up and CUDA-graph capture runs
    row_slot: torch.Tensor         # int32 [num_rows]
    row_prompt_len: torch.Tensor   # int32 [num_rows]
    row_last_token: torch.Tensor   # int32 [num_rows]: the row's last input token (the last sampled one in decode)
    row_is_decode: torch.Tensor    # int32 [num_rows], 0/1: every query token of the row is a generated token
    row_slot_np: np.ndarray        # host copy of row_slot (for host-side planning, e.g. SPEED)
    row_prompt_len_np: np.ndarray
    row_is_decode_np: np.ndarray
    table: "RequestStateTable"
    step_id: int
    seq_lens: torch.Tensor | None = None   # int32 [num_rows] (device), the current tokens included
    sfi: Any = None                        # vllm_ext.sfi.step_plan.SfiStep when SFI is configured


@dataclass
class SlotCounters:
    acquired: int = 0
    released: int = 0
    reset_on_resume: int = 0


class RequestStateTable:
    def __init__(self, max_reqs: int, device: torch.device | str, *,
                 config: SpeedSfiConfig | None = None, sfi_capacity: int = 0,
                 trigger_lut: torch.Tensor | None = None):
        device = torch.device(device)
        self.config = config or SpeedSfiConfig()
        # SFI: compact-segment slots are fewer than request slots (memory cap); requests without one
        # decode densely and are counted.
        self.sfi_enabled = self.config.sfi.enabled and sfi_capacity > 0
        self.trigger_lut = trigger_lut
        self.device = device
        self.max_reqs = max_reqs
        self.scratch_slot = max_reqs                    # padded rows point here
        n = max_reqs + 1
        i32 = dict(dtype=torch.int32, device=device)
        # per-slot tables
        self.prompt_len = torch.zeros(n, **i32)
        self.steps_since_slow = torch.zeros(n, **i32)
        self.decode_steps = torch.zeros(n, **i32)
        self.generation = torch.zeros(n, **i32)
        self.has_selection = torch.zeros(n, dtype=torch.bool, device=device)
        self.prompt_len_np = np.zeros(n, dtype=np.int32)
        self.overrides: dict[int, Mapping[str, Any] | None] = {}
        self.sfi_slot_of = torch.full((n,), -1, **i32)
        self.sfi_on = torch.zeros(n, dtype=torch.bool, device=device)
        self.sfi_k = torch.zeros(n, **i32)
        self.sel_count = torch.zeros(n, **i32)
        self.sfi_stats = torch.zeros(8, dtype=torch.int64, device=device)
        self._sfi_free: list[int] = list(range(sfi_capacity - 1, -1, -1))
        self._sfi_slot_host: dict[int, int] = {}
        self._sfi_k_host: dict[int, int] = {}
        # per-row buffers
        self._row_slot = PinnedStaging(max_reqs, torch.int32, device)
        self._row_is_decode = PinnedStaging(max_reqs, torch.int32, device)
        self._last_idx = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self._ones = torch.ones(n, **i32)
        self._row_prompt_len = torch.zeros(max_reqs, **i32)
        self._row_last_token = torch.zeros(max_reqs, **i32)
        self._row_prompt_len_np = np.zeros(max_reqs, dtype=np.int32)
        # slot resets staged on the host, applied on the device at the next step
        self._reset = PinnedStaging(n, torch.int64, device)
        self._reset_prompt_len = PinnedStaging(n, torch.int32, device)
        self._reset_sfi_slot = PinnedStaging(n, torch.int32, device)
        self._reset_sfi_k = PinnedStaging(n, torch.int32, device)
        self._reset_sfi_on = PinnedStaging(n, torch.bool, device)
        self._pending_resets: dict[int, tuple[int, int, int, bool]] = {}
        # host bookkeeping
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(max_reqs - 1, -1, -1))   # pop() hands out slot 0 first
        self.counters = SlotCounters()
        self._step_ids = itertools.count()
        self.recorder: list[dict[str, dict[str, int]]] | None = None   # tests: per-step host snapshot

    # ------------------------------------------------------------------ lifecycle (host)
    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
            self.overrides.pop(slot, None)
            sfi_slot = self._sfi_slot_host.pop(slot, None)
            if sfi_slot is not None:
                self._sfi_free.append(sfi_slot)
            self._pending_resets.pop(slot, None)
            self.counters.released += 1

    def acquire(self, req_id: str, prompt_len: int, overrides: Mapping[str, Any] | None = None) -> int:
        if req_id in self.slot_of:
            return self.slot_of[req_id]
        if not self._free:
            raise RuntimeError(f"vllm_ext: no free request slot for {req_id!r}: {self.max_reqs} slots "
                               f"all held by {sorted(self.slot_of)}")
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        self.prompt_len_np[slot] = prompt_len
        self.overrides[slot] = overrides
        sfi_slot, sfi_on, sfi_k = self._sfi_assignment(slot, overrides)
        self._pending_resets[slot] = (prompt_len, sfi_slot, sfi_k, sfi_on)
        self.counters.acquired += 1
        return slot

    def _sfi_assignment(self, slot: int, overrides: Mapping[str, Any] | None) -> tuple[int, bool, int]:
        cfg = self.config
        if overrides:
            try:
                cfg = cfg.with_overrides(overrides)
            except ConfigError as e:
                metrics.fallback("request_override_invalid", "ignoring a request's speedsfi override: %s", e)
                cfg = self.config
            engine_wide = _changed_fields(self.config, cfg) - PER_REQUEST_FIELDS
            if engine_wide:
                metrics.fallback("request_override_engine_wide", "a request's speedsfi override sets %s, which "
                                 "only the engine's configuration can change (a request can set %s); ignored",
                                 ", ".join(sorted(engine_wide)), ", ".join(sorted(PER_REQUEST_FIELDS)))
        if not cfg.sfi.enabled:
            return -1, False, 0
        if not self.sfi_enabled:
            metrics.fallback("sfi_not_configured", "a request enabled SFI but the engine was started "
                             "without it (no compact buffers); it decodes densely")
            return -1, False, 0
        k = cfg.sfi.k
        if k > self.config.sfi.k:
            metrics.fallback("sfi_k_clamped", "a request asked for sfi.k=%d above the engine's %d "
                             "(the compact buffers' size); using %d", k, self.config.sfi.k, self.config.sfi.k)
            k = self.config.sfi.k
        if not self._sfi_free:
            metrics.fallback("sfi_capacity", "all %d SFI compact slots are in use (speedsfi.sfi."
                             "max_requests); further requests decode densely", len(self._sfi_slot_host))
            return -1, False, k
        sfi_slot = self._sfi_free.pop()
        self._sfi_slot_host[slot] = sfi_slot
        self._sfi_k_host[slot] = k
        return sfi_slot, True, k

    def sync_membership(self, reset_req_ids: Iterable[str],
                        live: Mapping[str, tuple[int, Mapping[str, Any] | None]]) -> None:
        """Release ``reset_req_ids`` (finished, aborted, resumed after preemption) and every slot
        whose request left the batch; acquire slots for batch members without one.

        ``live``: req_id -> (prompt_len, per-request overrides) for the requests in the batch.
        """
        for req_id in reset_req_ids:
            if req_id in self.slot_of and req_id in live:
                self.counters.reset_on_resume += 1
            self.release(req_id)
        for req_id in [r for r in self.slot_of if r not in live]:
            self.release(req_id)
        for req_id, (prompt_len, overrides) in live.items():
            if req_id not in self.slot_of:
                self.acquire(req_id, prompt_len, overrides)

    def _apply_resets(self) -> None:
        if not self._pending_resets:
            return
        n = len(self._pending_resets)
        self._reset.np[:n] = list(self._pending_resets.keys())
        values = list(self._pending_resets.values())
        self._reset_prompt_len.np[:n] = [v[0] for v in values]
        self._reset_sfi_slot.np[:n] = [v[1] for v in values]
        self._reset_sfi_k.np[:n] = [v[2] for v in values]
        self._reset_sfi_on.np[:n] = [v[3] for v in values]
        self._pending_resets.clear()
        idx = self._reset.copy_to_device(n)
        self.prompt_len.index_copy_(0, idx, self._reset_prompt_len.copy_to_device(n))
        self.sfi_slot_of.index_copy_(0, idx, self._reset_sfi_slot.copy_to_device(n))
        self.sfi_k.index_copy_(0, idx, self._reset_sfi_k.copy_to_device(n))
        self.sfi_on.index_copy_(0, idx, self._reset_sfi_on.copy_to_device(n))
        self.sel_count.index_fill_(0, idx, 0)
        self.steps_since_slow.index_fill_(0, idx, 0)
        self.decode_steps.index_fill_(0, idx, 0)
        self.has_selection.index_fill_(0, idx, False)
        self.generation.index_add_(0, idx, self._ones[:n])

    # ------------------------------------------------------------------ per step
    def begin_step(self, row_req_ids: list[str | None], num_reqs: int, num_rows: int,
                   input_ids: torch.Tensor | None, query_start_loc: torch.Tensor | None,
                   row_is_decode: np.ndarray | None,
                   seq_lens: torch.Tensor | None = None,
                   host_geometry: tuple[np.ndarray, np.ndarray] | None = None) -> StepState:
        """Publish the step's rows. ``row_req_ids`` is the runner's row order; ``input_ids`` and
        ``query_start_loc`` are the step's device buffers (None for a dummy step);
        ``host_geometry`` = (host ``query_start_loc [num_reqs + 1]``, tokens computed before this
        step ``[num_reqs]``), exact for prefill rows, used to find the prefills that end here."""
        if num_rows > self.max_reqs:
            raise RuntimeError(f"vllm_ext: a step with {num_rows} rows exceeds the {self.max_reqs} "
                               f"request slots (max_num_seqs)")
        self._apply_resets()
        real = input_ids is not None
        slots = self._row_slot.np
        if real:
            for row in range(num_reqs):
                slots[row] = self.slot_of[row_req_ids[row]]
            self._row_is_decode.np[:num_reqs] = row_is_decode[:num_reqs]
        else:
            num_reqs = 0
        slots[num_reqs:num_rows] = self.scratch_slot
        self._row_is_decode.np[num_reqs:num_rows] = False
        row_slot = self._row_slot.copy_to_device(num_rows)
        row_is_decode = self._row_is_decode.copy_to_device(num_rows)
        self._row_prompt_len_np[:num_rows] = self.prompt_len_np[slots[:num_rows]]
        row_prompt_len = self._row_prompt_len[:num_rows]
        torch.index_select(self.prompt_len, 0, row_slot, out=row_prompt_len)
        row_last_token = self._row_last_token[:num_rows]
        row_last_token[num_reqs:].fill_(0)
        sfi_step = None
        if real and num_reqs:
            last_idx = self._last_idx[:num_reqs]
            torch.sub(query_start_loc[1:num_reqs + 1], 1, out=last_idx)
            torch.index_select(input_ids, 0, last_idx, out=row_last_token[:num_reqs])
            # one more decode step for every decode row (padded rows land in the scratch slot)
            self.decode_steps.index_add_(0, row_slot, row_is_decode)
            counted = row_is_decode
            if self.sfi_enabled and seq_lens is not None:
                from vllm_ext.sfi.step_plan import plan_step

                sfi_step = plan_step(self.config.sfi, row_slot=row_slot, row_last_token=row_last_token,
                                     row_is_decode=row_is_decode, seq_lens=seq_lens[:num_rows],
                                     sfi_slot_of=self.sfi_slot_of, sfi_on=self.sfi_on, sfi_k=self.sfi_k,
                                     steps_since_slow=self.steps_since_slow,
                                     has_selection=self.has_selection, sel_count=self.sel_count,
                                     trigger_lut=self.trigger_lut, stats=self.sfi_stats)
                # the SFI schedule owns the counter of its sparse rows
                counted = row_is_decode * (~sfi_step.row_sparse)
                if host_geometry is not None:
                    sfi_step.prefill_end = self._plan_prefill_end(num_reqs, host_geometry)
            self.steps_since_slow.index_add_(0, row_slot, counted.to(torch.int32))
        step = StepState(num_reqs=num_reqs, num_rows=num_rows, is_real=real, row_slot=row_slot,
                         row_prompt_len=row_prompt_len, row_last_token=row_last_token,
                         row_is_decode=row_is_decode, row_slot_np=slots[:num_rows],
                         row_prompt_len_np=self._row_prompt_len_np[:num_rows],
                         row_is_decode_np=self._row_is_decode.np[:num_rows], table=self,
                         step_id=next(self._step_ids),
                         seq_lens=None if seq_lens is None else seq_lens[:num_rows], sfi=sfi_step)
        if self.recorder is not None and real:
            self.recorder.append(self.snapshot(step, row_req_ids))
        return step

    def _plan_prefill_end(self, num_reqs: int, host_geometry):
        from vllm_ext.sfi.schedule import mark_selected
        from vllm_ext.sfi.step_plan import STAT_PREFILL_END, plan_prefill_end

        cfg = self.config.sfi
        qsl, computed = host_geometry
        slots = self._row_slot.np
        rows, ends, q_lens, seqs, ks, sfi_slots = [], [], [], [], [], []
        for row in range(num_reqs):
            slot = int(slots[row])
            if self._row_is_decode.np[row] or slot not in self._sfi_slot_host:
                continue
            q_len = int(qsl[row + 1] - qsl[row])
            seq = int(computed[row]) + q_len
            k = self._sfi_k_host[slot]
            if seq < self.prompt_len_np[slot] or seq <= cfg.n_sink + cfg.n_recent + k:
                continue
            rows.append(row); ends.append(int(qsl[row + 1])); q_lens.append(q_len)
            seqs.append(seq); ks.append(k); sfi_slots.append(self._sfi_slot_host[slot])
        plan = plan_prefill_end(cfg, rows=rows, query_end=ends, q_lens=q_lens, seq_lens=seqs, ks=ks,
                                sfi_slots=sfi_slots, device=self.device)
        if plan is not None:
            row_slot = self._row_slot.gpu[plan.rows]
            mark_selected(self.steps_since_slow, self.has_selection, row_slot,
                          torch.ones_like(plan.rows, dtype=torch.bool))
            n_sel = torch.minimum(plan.k, plan.allowed_hi - plan.allowed_lo)
            self.sel_count.index_copy_(0, row_slot.long(), n_sel)
            self.sfi_stats[STAT_PREFILL_END] += plan.rows.shape[0]
        return plan

    def snapshot(self, step: StepState, row_req_ids: list[str | None]) -> dict[str, dict[str, int]]:
        """Host copy of the step's per-request view (synchronises: tests and debugging only)."""
        slots = step.row_slot.tolist()
        return {
            row_req_ids[row]: {
                "slot": slots[row],
                "prompt_len": int(step.row_prompt_len[row]),
                "last_token": int(step.row_last_token[row]),
                "is_decode": bool(step.row_is_decode[row]),
                "steps_since_slow": int(self.steps_since_slow[slots[row]]),
                "generation": int(self.generation[slots[row]]),
                "mode": ("dense" if step.sfi is None or not bool(step.sfi.row_sparse[row]) else
                         "slow" if bool(step.sfi.row_slow[row]) else "fast"),
            }
            for row in range(step.num_reqs)
        }
