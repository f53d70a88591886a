"""The generic per-request slot table: persistent device tables indexed by a stable per-request slot.

vLLM's V1 model runner moves requests between batch rows (condense, swap, decode-first reorder), so
the row of a request says nothing across steps. This table gives each request a *slot* for as long
as the runner holds it, and keeps per slot on the device the prompt length, the
decode steps run and a generation stamp that changes whenever the slot is (re)assigned. Methods keep
their own per-slot tables in their own packages, indexed by the same slot, and register them here
(:class:`vllm_ext.method_slots.MethodSlots`); the table knows no method. The engine's table, with
its methods registered: :class:`vllm_ext.backend.request_table.EngineRequestTable`.

Per step there are two phases (plan/run split):
- ``stage`` (host only; the runner hooks call it before attention metadata is built): the rows'
  slots, which rows are decodes, the prefill geometry;
- ``build_step`` (the metadata builder calls it with vLLM's ``CommonAttentionMetadata``): the device
  side — the staged rows are copied to persistent device buffers, the last sampled token of each row
  is read on the device from the step's input ids (right under async scheduling, where the host never
  sees it), and each method plans the step into its persistent buffers. A step is built once
  however many KV-cache groups ask for it.

A request loses its slot when it finishes or is aborted, or is preempted (it comes back with its KV
recomputed, and so with fresh state); a request that is only not scheduled in a step keeps its slot
and its state. A slot given out again starts from a clean state.

Torch only (no vLLM): ``vllm_ext.runner_hooks`` feeds it from the runner.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.host_staging import PinnedStaging  # noqa: F401  (re-exported)
from vllm_ext.method_slots import MethodSlots


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
    query_start_loc: torch.Tensor | None = None   # the step's device buffer (real steps)
    input_ids: torch.Tensor | None = None         # the step's device buffer of input tokens (real steps)
    host_geometry: tuple[np.ndarray, np.ndarray] | None = None   # see RequestStateTable.stage
    block_table: torch.Tensor | None = None
    # other KV-cache groups' block tables of the real rows, by group id: (device table [num_reqs,
    # width], host flags [num_reqs]: the row holds all the blocks its group gives a request, and
    # (runner hooks) host counts [num_reqs]: the blocks it holds); a method that keeps per-request
    # memory in a group of its own reads its rows here
    group_tables: Mapping[int, tuple] | None = None
    # the runner's host token ids by row ([rows, max_model_len]: prompt and generated tokens; real steps
    # of the runner hooks): what a prefix-cache hit's positions hold, which no input id carries
    token_ids_host: np.ndarray | None = None
    plans: dict[str, Any] = field(default_factory=dict)   # method name -> its plan of the step (or None)


@dataclass
class SlotCounters:
    acquired: int = 0
    released: int = 0
    reset_on_resume: int = 0


class RequestStateTable:
    step_type = StepState

    def __init__(self, max_reqs: int, device: torch.device | str):
        device = torch.device(device)
        self.device = device
        self.max_reqs = max_reqs
        self.scratch_slot = max_reqs                    # padded rows point here
        self.num_slots = n = max_reqs + 1
        i32 = dict(dtype=torch.int32, device=device)
        # per-slot tables
        self.prompt_len = torch.zeros(n, **i32)
        self.decode_steps = torch.zeros(n, **i32)
        self.generation = torch.zeros(n, **i32)
        self.prompt_len_np = np.zeros(n, dtype=np.int32)
        self.overrides: dict[int, Mapping[str, Any] | None] = {}
        self.methods: list[MethodSlots] = []           # the methods' own per-slot tables
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
        self._pending_resets: dict[int, int] = {}      # slot -> prompt length
        # host bookkeeping
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(max_reqs - 1, -1, -1))   # pop() hands out slot 0 first
        self.counters = SlotCounters()
        self._step_ids = itertools.count()
        self._staged: _Staged | None = None
        self._built: StepState | None = None
        self.recorder: list[dict[str, dict[str, int]]] | None = None   # tests: per-step host snapshot

    def register(self, method: MethodSlots) -> MethodSlots:
        """Add a method's per-slot tables (``num_slots`` of them, like this table's); they plan each
        step in registration order. Before the first request: a method sees every slot's lifetime."""
        if self.counters.acquired:
            raise RuntimeError("vllm_ext: a method's slot tables must be registered before any request")
        self.methods.append(method)
        return method

    def bind_kv_groups(self, groups: Mapping[str, Mapping[int, tuple[int, list[str]]]]) -> None:
        """Hand each registered method its KV-cache groups (``groups``: method name -> group id ->
        (blocks per request, layer names[, the group's spec])); called once per KV cache vLLM builds."""
        for method in self.methods:
            method.bind_kv_groups(groups.get(method.name, {}))

    @property
    def staged_host_geometry(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The staged step's host geometry (``query_start_loc``, tokens computed before the step)."""
        return None if self._staged is None else self._staged.host_geometry

    # ------------------------------------------------------------------ lifecycle (host)
    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
            self.overrides.pop(slot, None)
            for method in self.methods:
                method.slot_released(slot)
            self._pending_resets.pop(slot, None)
            self.counters.released += 1
            metrics.bump("slots.released")       # exported: in use = acquired - released

    def acquire(self, req_id: str, prompt_len: int, overrides: Mapping[str, Any] | None = None, *,
                resumed: bool = False) -> int:
        if req_id in self.slot_of:
            return self.slot_of[req_id]
        if not self._free:
            raise RuntimeError(f"vllm_ext: no free request slot for {req_id!r}: {self.max_reqs} slots "
                               f"all held by {sorted(self.slot_of)}")
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        self.prompt_len_np[slot] = prompt_len
        self.overrides[slot] = overrides
        for method in self.methods:
            method.slot_assigned(slot, overrides, resumed=resumed)
        self._pending_resets[slot] = prompt_len
        self.counters.acquired += 1
        metrics.bump("slots.acquired")
        return slot

    def sync_membership(self, reset_req_ids: Iterable[str],
                        live: Mapping[str, tuple[int, Mapping[str, Any] | None]],
                        resumed_req_ids: Iterable[str] = (), known: Container[str] | None = None) -> None:
        """Release ``reset_req_ids`` (finished, aborted, preempted, resumed after preemption) and
        every slot whose request the runner no longer knows; acquire slots for batch members without
        one.

        ``live``: req_id -> (prompt_len, per-request overrides) for the requests in the batch;
        ``resumed_req_ids``: those resumed after preemption (also in ``reset_req_ids``); ``known``:
        every request the runner holds state for, scheduled in this step or not (``None``: the
        batch's). A request that is merely not scheduled in a step (the token budget went to others,
        or the scheduler holds a prefill chunk back: ``vllm_ext.scheduler_policy``) leaves vLLM's
        persistent batch but keeps its slot and its methods' state: its answer must not depend on
        that.
        """
        for req_id in reset_req_ids:
            if req_id in self.slot_of and req_id in live:
                self.counters.reset_on_resume += 1
            self.release(req_id)
        keep = live if known is None else known
        for req_id in [r for r in self.slot_of if r not in live and r not in keep]:
            self.release(req_id)
        resumed = set(resumed_req_ids)
        for req_id, (prompt_len, overrides) in live.items():
            if req_id not in self.slot_of:
                self.acquire(req_id, prompt_len, overrides, resumed=req_id in resumed)

    def _apply_resets(self) -> None:
        if not self._pending_resets:
            return
        n = len(self._pending_resets)
        slots = list(self._pending_resets.keys())
        self._reset.np[:n] = slots
        self._reset_prompt_len.np[:n] = list(self._pending_resets.values())
        self._pending_resets.clear()
        idx = self._reset.copy_to_device(n)
        self.prompt_len.index_copy_(0, idx, self._reset_prompt_len.copy_to_device(n))
        self.decode_steps.index_fill_(0, idx, 0)
        self.generation.index_add_(0, idx, self._ones[:n])
        for method in self.methods:
            method.reset_slots(idx, slots)

    # ------------------------------------------------------------------ per step: stage (host)
    def stage(self, row_req_ids: list[str | None], num_reqs: int, num_rows: int, *, real: bool,
              input_ids: torch.Tensor | None = None, query_start_loc: torch.Tensor | None = None,
              row_is_decode: np.ndarray | None = None,
              host_geometry: tuple[np.ndarray, np.ndarray] | None = None,
              group_tables: Mapping[int, tuple[torch.Tensor, np.ndarray]] | None = None,
              token_ids: np.ndarray | None = None) -> None:
        """Stage the step's rows on the host (no device work). ``row_req_ids`` is the runner's row
        order; ``input_ids`` / ``query_start_loc`` are the step's device buffers (read at build);
        ``host_geometry`` = (host ``query_start_loc [num_reqs + 1]``, tokens computed before this
        step ``[num_reqs]``), exact for prefill rows, used to find the prefills that end here;
        ``token_ids``: the runner's host token ids by row (read, never written)."""
        if num_rows > self.max_reqs:
            raise RuntimeError(f"vllm_ext: a step with {num_rows} rows exceeds the {self.max_reqs} "
                               f"request slots (max_num_seqs)")
        real = real and input_ids is not None
        if not real:
            num_reqs = 0
        slots = self._row_slot.np
        for row in range(num_reqs):
            slots[row] = self.slot_of[row_req_ids[row]]
        slots[num_reqs:num_rows] = self.scratch_slot
        if num_reqs:
            self._row_is_decode.np[:num_reqs] = row_is_decode[:num_reqs]
        self._row_is_decode.np[num_reqs:num_rows] = False
        self._staged = _Staged(list(row_req_ids[:num_reqs]), num_reqs, num_rows, real, input_ids,
                               query_start_loc, host_geometry, group_tables if real else None,
                               token_ids if real else None)
        self._built = None

    # ------------------------------------------------------------------ per step: build (device)
    def build_step(self, seq_lens: torch.Tensor | None = None,
                   block_table: torch.Tensor | None = None) -> StepState:
        """The staged step on the device (once per step: later calls return the same state)."""
        if self._built is not None:
            return self._built
        st = self._staged
        if st is None:
            raise RuntimeError("vllm_ext: no step was staged (the runner hooks did not run)")
        self._apply_resets()
        num_reqs, num_rows = st.num_reqs, st.num_rows
        slots = self._row_slot.np
        row_slot = self._row_slot.copy_to_device(num_rows)
        row_is_decode = self._row_is_decode.copy_to_device(num_rows)
        self._row_prompt_len_np[:num_rows] = self.prompt_len_np[slots[:num_rows]]
        row_prompt_len = self._row_prompt_len[:num_rows]
        torch.index_select(self.prompt_len, 0, row_slot, out=row_prompt_len)
        row_last_token = self._row_last_token[:num_rows]
        row_last_token[num_reqs:].fill_(0)
        if st.real and num_reqs:
            last_idx = self._last_idx[:num_reqs]
            torch.sub(st.query_start_loc[1:num_reqs + 1], 1, out=last_idx)
            torch.index_select(st.input_ids, 0, last_idx, out=row_last_token[:num_reqs])
            # one more decode step for every decode row (padded rows land in the scratch slot)
            self.decode_steps.index_add_(0, row_slot, row_is_decode)
        step = self.step_type(num_reqs=num_reqs, num_rows=num_rows, is_real=st.real, row_slot=row_slot,
                              row_prompt_len=row_prompt_len, row_last_token=row_last_token,
                              row_is_decode=row_is_decode, row_slot_np=slots[:num_rows],
                              row_prompt_len_np=self._row_prompt_len_np[:num_rows],
                              row_is_decode_np=self._row_is_decode.np[:num_rows], table=self,
                              step_id=next(self._step_ids),
                              seq_lens=None if seq_lens is None else seq_lens[:num_rows],
                              query_start_loc=st.query_start_loc, input_ids=st.input_ids,
                              host_geometry=st.host_geometry,
                              block_table=block_table, group_tables=st.group_tables,
                              token_ids_host=st.token_ids)
        for method in self.methods:
            step.plans[method.name] = method.plan_step(step)
        if self.recorder is not None and st.real:
            self.recorder.append(self.snapshot(step, st.row_req_ids))
        self._built = step
        return step

    def begin_step(self, row_req_ids: list[str | None], num_reqs: int, num_rows: int,
                   input_ids: torch.Tensor | None, query_start_loc: torch.Tensor | None,
                   row_is_decode: np.ndarray | None,
                   seq_lens: torch.Tensor | None = None,
                   host_geometry: tuple[np.ndarray, np.ndarray] | None = None,
                   block_table: torch.Tensor | None = None) -> StepState:
        """``stage`` + ``build_step`` in one call (tests and tools that drive the table directly)."""
        self.stage(row_req_ids, num_reqs, num_rows, real=input_ids is not None, input_ids=input_ids,
                   query_start_loc=query_start_loc, row_is_decode=row_is_decode,
                   host_geometry=host_geometry)
        return self.build_step(seq_lens, block_table)

    def snapshot(self, step: StepState, row_req_ids: list[str | None]) -> dict[str, dict[str, int]]:
        """Host copy of the step's per-request view (synchronises: tests and debugging only)."""
        slots = step.row_slot.tolist()
        views = {}
        for row in range(step.num_reqs):
            view = {"slot": slots[row], "prompt_len": int(step.row_prompt_len[row]),
                    "last_token": int(step.row_last_token[row]),
                    "is_decode": bool(step.row_is_decode[row]),
                    "generation": int(self.generation[slots[row]])}
            if step.host_geometry is not None:
                view["q_len"] = int(step.host_geometry[0][row + 1] - step.host_geometry[0][row])
            for method in self.methods:
                view.update(method.snapshot_fields(step.plans.get(method.name), row, slots[row]))
            views[row_req_ids[row]] = view
        return views


@dataclass
class _Staged:
    row_req_ids: list
    num_reqs: int
    num_rows: int
    real: bool
    input_ids: torch.Tensor | None
    query_start_loc: torch.Tensor | None
    host_geometry: tuple | None
    group_tables: Mapping | None = None
    token_ids: np.ndarray | None = None

