"""SFI's per-request tables, indexed by the generic request slot of
:class:`vllm_ext.request_state.RequestStateTable` (registered there as its
:class:`vllm_ext.method_slots.MethodSlots`), and the step plan built from them.

Per slot (device): the compact-segment slot (or -1), SFI on/off and ``k`` for the request, steps
since the last slow step, whether a selection exists, the tokens selected at the last slow step, and
the sentence-boundary state (``trigger_state``: cooldown and arm, :mod:`vllm_ext.methods.sfi.schedule`).
Compact slots: one per request slot by default (``sfi.max_requests`` can bound them: a request
without one decodes densely and is counted, ``fallback.sfi_capacity``). Inside vLLM the compact
segments are KV-cache blocks of SFI's own groups (``vllm_ext.methods.sfi.kv_spec``): :meth:`bind_compact_groups`
names the groups, and every step copies the rows' block-table rows into a per-compact-slot table
(``compact_tables``, read by the kernels) and marks which requests hold their blocks; a request
without them (vLLM gives them when its length first reaches ``first_compact_len``) decodes densely.
With ``sfi.copy_ngram`` the token histories are pages of SFI's history groups, bound and followed
step by step by :class:`vllm_ext.methods.sfi.history_slots.HistorySlots`. Counters live on the device (``stats``) and are
read asynchronously (:class:`vllm_ext.device_counters.DeviceCounters`). Torch only (no vLLM).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from vllm_ext import metrics
from vllm_ext.config import PER_REQUEST_FIELDS, ConfigError, SpeedSfiConfig, changed_fields
from vllm_ext.device_counters import DeviceCounters
from vllm_ext.host_staging import PinnedStaging
from vllm_ext.method_slots import MethodSlots
from vllm_ext.request_state import StepState
from vllm_ext.methods.sfi.prompt_tail import (TailRow, kept_count, makes_prefill_selection, plan_prompt_tail,
                                      tail_window)
from vllm_ext.kernels.copy_match import copy_match, record_tokens
from vllm_ext.kernels.token_history import TokenHistory
from vllm_ext.methods.sfi.history_slots import HISTORY_SUFFIX, HistorySlots
from vllm_ext.methods.sfi.quest_tables import QUEST_SUFFIX, QuestPageTables, QuestPrefillPages  # noqa: F401
from vllm_ext.methods.sfi.state_pages import first_compact_len
from vllm_ext.methods.sfi.step_plan import (NUM_STATS, RETAINED_FRACTION_BOUNDS_PCT, STAT_CONTEXT, STAT_COPY, STAT_DENSE,
                                    STAT_FAST, STAT_PREFILL_END, STAT_RETAINED,
                                    STAT_RETAINED_FRACTION_PPM, STAT_RETAINED_HIST, STAT_SLOW,
                                    SfiPlanBuffers, SfiStep, maintenance_chunk,
                                    plan_step as plan_sfi_step)

# what a request's SamplingParams.extra_args["speedsfi"] may change; everything else is engine-wide
# (kernel constants, buffer sizes, the schedule) and is refused loudly

# the name of an attention layer's compact cache layer (``vllm_ext.methods.sfi.caches``)
COMPACT_SUFFIX = ".sfi_compact"

STAT_NAMES = {STAT_SLOW: "sfi.slow_steps", STAT_FAST: "sfi.fast_steps",
              STAT_DENSE: "sfi.dense_rows", STAT_COPY: "sfi.copy_slow_steps", STAT_RETAINED: "sfi.fast_retained_tokens",
              STAT_CONTEXT: "sfi.fast_context_tokens",
              STAT_PREFILL_END: "sfi.prefill_end_selections",
              STAT_RETAINED_FRACTION_PPM: "sfi.fast_retained_fraction_sum_ppm",
              **{STAT_RETAINED_HIST + j: f"sfi.fast_retained_fraction_le_{pct}pct"
                 for j, pct in enumerate(RETAINED_FRACTION_BOUNDS_PCT)}}




class SfiSlotTables(MethodSlots):
    name = "sfi"

    def __init__(self, n_slots: int, capacity: int, max_rows: int, config: SpeedSfiConfig,
                 trigger_lut: torch.Tensor | None, device: torch.device, *, max_model_len: int = 0,
                 paged_history: bool = False):
        self.config = config
        self.cfg = config.sfi
        self.capacity = capacity
        self.device = device
        self.trigger_lut = (trigger_lut if trigger_lut is not None
                            else torch.zeros(1, dtype=torch.int8, device=device))
        i32 = dict(dtype=torch.int32, device=device)
        self.sfi_slot_of = torch.full((n_slots,), -1, **i32)
        self.sfi_on = torch.zeros(n_slots, dtype=torch.bool, device=device)
        self.sfi_k = torch.zeros(n_slots, **i32)
        self.sel_count = torch.zeros(n_slots, **i32)
        self.steps_since_slow = torch.zeros(n_slots, **i32)
        self.has_selection = torch.zeros(n_slots, dtype=torch.bool, device=device)
        self.trigger_state = torch.zeros(n_slots, **i32)     # cooldown << 1 | armed; 0 = fresh
        # the refresh budget of each slot (sfi.refresh_warmup: from 1, doubling at each slow step)
        self.first_refresh_gap = 1 if self.cfg.refresh_warmup else self.cfg.refresh
        self.refresh_gap = torch.full((n_slots,), self.first_refresh_gap, **i32)
        # quest: per compact slot (+ a scratch entry), the positions whose page max/min are written;
        # a fresh slot starts at 0, so its first decode row writes every page of a cached context
        self.page_upto = torch.zeros(capacity + 1, **i32)
        # quest inside vLLM: the page bounds' tables and which rows hold them (vllm_ext.methods.sfi.quest_tables)
        self.quest = (QuestPageTables(self.cfg.page_size, first_compact_len(self.cfg), capacity, n_slots,
                                      max_rows, device) if self.cfg.selector == "quest" else None)
        # sfi.keep_prefill: per compact slot (+ a scratch entry), the tokens its prefill-end selection
        # keeps for the whole decode (0 for a slot whose prefill made no selection)
        self.n_kept = torch.zeros(capacity + 1, **i32)
        # sfi.copy_ngram: per compact slot the request's tokens by position (vllm_ext.methods.sfi.history_slots;
        # ``paged_history``: in vLLM's KV-cache blocks), and each row's copy flag of the step
        self.history_slots: HistorySlots | None = None
        self.row_copy: torch.Tensor | None = None
        self.copy_prev: torch.Tensor | None = None
        if self.cfg.resolved_copy_ngram:
            if max_model_len <= 0:
                raise ConfigError("speedsfi.sfi.copy_ngram needs the model's max_model_len (the token "
                                  "history's size)")
            self.history_slots = HistorySlots(capacity=capacity, n_slots=n_slots, max_rows=max_rows,
                                              max_len=max_model_len, device=device, paged=paged_history)
            self.row_copy = torch.zeros(max_rows, **i32)
        # sfi.copy_once: per compact slot (+ the trash row) whether its last decode step copied
        self.copy_prev = (torch.zeros(capacity + 1, **i32) if self.cfg.copy_once and self.history_slots is not None
                          else None)
        self.counters = DeviceCounters(NUM_STATS, device)
        self.plan_buffers = SfiPlanBuffers(max_rows, capacity, device,
                                           chunk_rows=maintenance_chunk(self.cfg, capacity))
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.slot_host: dict[int, int] = {}          # request slot -> compact slot
        self.k_host: dict[int, int] = {}
        self.first_computed: dict[int, int] = {}     # request slot -> first position it computed
        # request slots that computed prompt-tail positions while not holding their blocks
        self.tail_lost: set[int] = set()
        # the fresh state of newly assigned slots, staged on the host until the next build
        self._pending_resets: dict[int, tuple[int, int, bool]] = {}   # slot -> (compact slot, k, on)
        self._reset_sfi_slot = PinnedStaging(n_slots, torch.int32, device)
        self._reset_k = PinnedStaging(n_slots, torch.int32, device)
        self._reset_on = PinnedStaging(n_slots, torch.bool, device)
        # SFI's KV-cache groups (bind_compact_groups): per group a table [capacity + 1, n_c] (entry
        # ``capacity`` takes the rows of requests without a compact slot), by attention layer name
        self.compact_tables: dict[int, torch.Tensor] = {}
        self.compact_table_of_layer: dict[str, torch.Tensor] = {}
        self._n_slots, self._max_rows = n_slots, max_rows
        self.compact_ok: torch.Tensor | None = None
        self._sfi_on_eff: torch.Tensor | None = None
        self._ok_staging: PinnedStaging | None = None

    @property
    def stats(self) -> torch.Tensor:
        return self.counters.values

    @property
    def history(self) -> TokenHistory | None:
        """``sfi.copy_ngram``'s token histories (None: off, or not bound to vLLM's pages yet)."""
        return None if self.history_slots is None else self.history_slots.history

    def bind_kv_groups(self, groups: Mapping[int, tuple[int, list[str]]]) -> None:
        """``MethodSlots``: SFI's KV-cache groups, group id -> (blocks per request, layer names[,
        spec, layer name -> page memory]), told apart by their layers' suffix: the compact groups
        (``vllm_ext.methods.sfi.kv_spec``, layers ``<attention layer>`` + :data:`COMPACT_SUFFIX`), the
        history groups (``vllm_ext.methods.sfi.history_kv_spec``, ``HISTORY_SUFFIX``) and with selector
        ``quest`` the groups of its page bounds (``vllm_ext.methods.sfi.quest_tables``, ``QUEST_SUFFIX``)."""
        def layers(names, suffix):
            return [n[:-len(suffix)] for n in names if n.endswith(suffix)]

        self.bind_compact_groups({gid: (n_c, layers(names, COMPACT_SUFFIX))
                                  for gid, (n_c, names, *_) in groups.items() if layers(names, COMPACT_SUFFIX)})
        if self.history_slots is not None:
            self.history_slots.bind({gid: g for gid, g in groups.items()
                                     if all(n.endswith(HISTORY_SUFFIX) for n in g[1])})
        if self.quest is not None:
            self.quest.bind({gid: (n, layers(names, QUEST_SUFFIX), rest[0].block_size)
                             for gid, (n, names, *rest) in groups.items() if layers(names, QUEST_SUFFIX)})

    def bind_compact_groups(self, groups: Mapping[int, tuple[int, list[str]]]) -> None:
        """The compact segments live in vLLM's KV-cache groups ``groups``: group id -> (blocks per
        request, the attention layers whose compact caches it holds). Called again when vLLM
        builds a new KV cache (the tables start empty; every live request's rows come back with its
        next step)."""
        dev = self.device
        self.compact_tables = {gid: torch.zeros(self.capacity + 1, n_c, dtype=torch.int32, device=dev)
                               for gid, (n_c, _) in groups.items()}
        self.compact_table_of_layer = {name: self.compact_tables[gid]
                                       for gid, (_, names) in groups.items() for name in names}
        self.compact_ok = torch.zeros(self._n_slots, dtype=torch.bool, device=dev)
        self._sfi_on_eff = torch.zeros(self._n_slots, dtype=torch.bool, device=dev)
        self._ok_staging = PinnedStaging(self._max_rows, torch.bool, dev)

    def _update_compact_tables(self, step: StepState) -> torch.Tensor:
        """Copy the step's block-table rows of SFI's groups into the per-compact-slot tables, mark
        which requests hold their blocks, and return ``sfi_on`` restricted to those (device work,
        no sync; a request not in the step keeps its rows: its blocks do not move)."""
        n = step.num_reqs
        staged = step.group_tables or {}
        if step.is_real and n and all(gid in staged for gid in self.compact_tables):
            row_slot = step.row_slot[:n].long()
            ok = np.ones(n, dtype=bool)
            for gid in self.compact_tables:
                ok &= staged[gid][1][:n]
            self._ok_staging.np[:n] = ok
            self.compact_ok.index_copy_(0, row_slot, self._ok_staging.copy_to_device(n))
            sfi_slot = self.sfi_slot_of[row_slot]
            dst = torch.where(sfi_slot >= 0, sfi_slot, self.capacity).long()
            for gid, table in self.compact_tables.items():
                rows = staged[gid][0]
                table.index_copy_(0, dst, rows[:n, :table.shape[1]].to(table.dtype))
        torch.logical_and(self.sfi_on, self.compact_ok, out=self._sfi_on_eff)
        return self._sfi_on_eff

    # ------------------------------------------------------------------ lifecycle (host)
    def assign(self, slot: int, overrides: Mapping[str, Any] | None) -> tuple[int, bool, int]:
        """Compact slot, on/off and ``k`` for a request taking request slot ``slot``."""
        self.first_computed.pop(slot, None)
        if self.quest is not None:
            self.quest.forget(slot)
        self.tail_lost.discard(slot)
        cfg = self.config
        if overrides:
            try:
                cfg = cfg.with_overrides(overrides)
            except ConfigError as e:
                metrics.fallback("request_override_invalid", "ignoring a request's speedsfi override: %s", e)
                cfg = self.config
            engine_wide = changed_fields(self.config, cfg) - PER_REQUEST_FIELDS
            if engine_wide:
                metrics.fallback("request_override_engine_wide", "a request's speedsfi override sets %s, which "
                                 "only the engine's configuration can change (a request can set %s); ignored",
                                 ", ".join(sorted(engine_wide)), ", ".join(sorted(PER_REQUEST_FIELDS)))
        if not cfg.sfi.enabled:
            return -1, False, 0
        k = cfg.sfi.k
        if k > self.cfg.k:
            metrics.fallback("sfi_k_clamped", "a request asked for sfi.k=%d above the engine's %d "
                             "(the compact buffers' size); using %d", k, self.cfg.k, self.cfg.k)
            k = self.cfg.k
        if not self._free:
            metrics.fallback("sfi_capacity", "all %d SFI compact slots are in use (speedsfi.sfi."
                             "max_requests); further requests decode densely", len(self.slot_host))
            return -1, False, k
        sfi_slot = self._free.pop()
        self.slot_host[slot] = sfi_slot
        if self.history_slots is not None:
            self.history_slots.on_host[slot] = True
            self.history_slots.started[slot] = False
        self.k_host[slot] = k
        metrics.bump("sfi.slots_assigned")       # exported: in use = assigned - released
        return sfi_slot, True, k

    def release(self, slot: int) -> None:
        sfi_slot = self.slot_host.pop(slot, None)
        self.k_host.pop(slot, None)
        if self.history_slots is not None:
            self.history_slots.on_host[slot] = False
        self.first_computed.pop(slot, None)
        self.tail_lost.discard(slot)
        if self.quest is not None:
            self.quest.forget(slot)
        if sfi_slot is not None:
            self._free.append(sfi_slot)
            metrics.bump("sfi.slots_released")

    def apply_resets(self, idx: torch.Tensor, sfi_slot: torch.Tensor, sfi_k: torch.Tensor,
                     sfi_on: torch.Tensor) -> None:
        self.sfi_slot_of.index_copy_(0, idx, sfi_slot)
        self.sfi_k.index_copy_(0, idx, sfi_k)
        self.sfi_on.index_copy_(0, idx, sfi_on)
        if self.compact_ok is not None:
            self.compact_ok.index_fill_(0, idx, False)      # its blocks come with its next step
        self.sel_count.index_fill_(0, idx, 0)
        self.steps_since_slow.index_fill_(0, idx, 0)
        self.has_selection.index_fill_(0, idx, False)
        self.trigger_state.index_fill_(0, idx, 0)
        self.refresh_gap.index_fill_(0, idx, self.first_refresh_gap)
        fresh = torch.where(sfi_slot >= 0, sfi_slot, self.capacity).long()
        if self.cfg.selector == "quest":
            self.page_upto.index_fill_(0, fresh, 0)
        if self.cfg.keep_prefill:
            self.n_kept.index_fill_(0, fresh, 0)
        if self.history_slots is not None:
            self.history_slots.reset(idx, fresh)
        if self.copy_prev is not None:
            self.copy_prev.index_fill_(0, fresh, 0)

    # ------------------------------------------------------------------ MethodSlots
    def slot_assigned(self, slot: int, overrides: Mapping[str, Any] | None, *, resumed: bool) -> None:
        sfi_slot, on, k = self.assign(slot, overrides)
        self._pending_resets[slot] = (sfi_slot, k, on)
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
        self._pending_resets.pop(slot, None)

    def reset_slots(self, idx: torch.Tensor, slots: list[int]) -> None:
        n = len(slots)
        values = [self._pending_resets.pop(slot) for slot in slots]
        self._reset_sfi_slot.np[:n] = [v[0] for v in values]
        self._reset_k.np[:n] = [v[1] for v in values]
        self._reset_on.np[:n] = [v[2] for v in values]
        self.apply_resets(idx, self._reset_sfi_slot.copy_to_device(n), self._reset_k.copy_to_device(n),
                          self._reset_on.copy_to_device(n))

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
        sfi_on = self._update_compact_tables(step) if self.compact_tables else self.sfi_on
        if self.quest is not None:
            sfi_on = self.quest.gate(step, self.sfi_slot_of, sfi_on, self.page_upto)
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
                row_slot_device=step.row_slot, row_has_blocks=self._host_blocks(step))
        self.counters.publish()
        return plan

    def snapshot_fields(self, plan: SfiStep | None, row: int, slot: int) -> dict[str, Any]:
        return {"steps_since_slow": int(self.steps_since_slow[slot]),
                "mode": ("dense" if plan is None or not bool(plan.row_sparse[row]) else
                         "slow" if bool(plan.row_slow[row]) else "fast")}

    # ------------------------------------------------------------------ per step (device)
    def copy_rows(self, step: StepState, sfi_rows: torch.Tensor, sfi_on: torch.Tensor) -> torch.Tensor:
        """``sfi.copy_ngram``: record the step's input tokens in the history, then flag the decode
        rows whose last tokens repeat an earlier span (:mod:`vllm_ext.kernels.copy_match`). A request
        with SFI on records from its first chunk, whether or not it holds its compact blocks yet;
        its rows match (and advance ``copy_once``'s state) while ``sfi_on`` (SFI on and its compact
        blocks held). A row whose request lacks the history pages of its step neither records nor
        matches (:mod:`vllm_ext.methods.sfi.history_slots`)."""
        num_rows = step.num_rows
        slot = step.row_slot.long()
        sfi_slot = self.sfi_slot_of[slot]
        hist_slot, row_from = self.history_slots.plan_rows(step, self.sfi_on[slot] & (sfi_slot >= 0),
                                                           sfi_slot)
        seq_lens = step.seq_lens[:num_rows]
        self.history_slots.backfill(step, hist_slot)
        if step.is_real and step.num_reqs and step.input_ids is not None:
            if step.host_geometry is not None and not bool(step.row_is_decode_np[:step.num_reqs].all()):
                qsl = step.host_geometry[0]
                max_q_len = int((qsl[1:step.num_reqs + 1] - qsl[:step.num_reqs]).max())
            else:
                max_q_len = 1                       # decode rows: one input token each
            record_tokens(self.history, step.input_ids, step.query_start_loc, seq_lens,
                          hist_slot[:step.num_reqs], max_q_len)
        active = sfi_rows * sfi_on[slot].to(sfi_rows.dtype)
        return copy_match(self.history, seq_lens, hist_slot, active, self.row_copy[:num_rows],
                          n_sink=self.cfg.n_sink, n_recent=self.cfg.n_recent, ngram=self.cfg.resolved_copy_ngram,
                          max_matches=self.cfg.copy_max_matches, prev=self.copy_prev, row_from=row_from)

    def plan(self, *, row_slot, row_last_token, row_is_decode, seq_lens, block_table,
             sfi_on: torch.Tensor | None = None, row_copy=None) -> SfiStep:
        step = plan_sfi_step(self.cfg, row_slot=row_slot, row_last_token=row_last_token,
                             row_is_decode=row_is_decode, seq_lens=seq_lens,
                             sfi_slot_of=self.sfi_slot_of,
                             sfi_on=self.sfi_on if sfi_on is None else sfi_on, sfi_k=self.sfi_k,
                             steps_since_slow=self.steps_since_slow, has_selection=self.has_selection,
                             sel_count=self.sel_count, trigger_lut=self.trigger_lut, stats=self.stats,
                             buffers=self.plan_buffers, block_table=block_table,
                             trigger_state=self.trigger_state, refresh_gap=self.refresh_gap,
                             row_copy=row_copy)
        if self.cfg.selector == "quest":
            self._plan_page_updates(step, seq_lens)
        if self.cfg.keep_prefill:
            live = step.slow_sfi_slot >= 0
            kept = self.n_kept[torch.where(live, step.slow_sfi_slot, self.capacity).long()]
            step.slow_kept.copy_(torch.where(live, kept, 0))
            step.slow_k.sub_(step.slow_kept)          # what a slow step selects besides its kept tokens
        return step

    def _plan_page_updates(self, step: SfiStep, seq_lens: torch.Tensor) -> None:
        """Quest: each SFI decode row writes its pages from the first one its slot has not written
        (normally the newest token's page; page 0 for a slot that is fresh while its context is
        cached, e.g. a request resumed after preemption whose prefix hit left one token to compute)."""
        ps = step.row_page_slot
        on = ps >= 0
        slot = torch.where(on, ps, self.capacity).long()
        upto = self.page_upto[slot]
        step.row_page_first.copy_(torch.where(on, torch.div(upto, self.cfg.page_size, rounding_mode="floor"), 0))
        self.page_upto.index_put_((slot,), torch.where(on, seq_lens[:ps.shape[0]].to(upto.dtype), upto))

    def _host_blocks(self, step: StepState) -> np.ndarray | None:
        """Per real row (host): the request holds its compact blocks (None: no SFI groups bound)."""
        if not self.compact_tables or not step.group_tables:
            return None
        ok = np.ones(step.num_reqs, dtype=bool)
        for gid in self.compact_tables:
            if gid not in step.group_tables:
                return np.zeros(step.num_reqs, dtype=bool)
            ok &= step.group_tables[gid][1][:step.num_reqs]
        return ok

    def plan_prefill_end(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
                         prompt_len: np.ndarray, host_geometry, row_slot_device: torch.Tensor,
                         row_has_blocks: np.ndarray | None = None):
        """This step's prompt-tail writes and the requests whose prefill ends in it (host geometry
        is exact for prefill rows); see :mod:`vllm_ext.methods.sfi.prompt_tail`. ``row_has_blocks`` (inside
        vLLM): a request without its compact blocks makes no selection (its first decode step
        selects; counted)."""
        from vllm_ext.methods.sfi.schedule import mark_selected

        cfg = self.cfg
        qsl, computed = host_geometry
        rows = []
        for row in range(num_reqs):
            slot = int(row_slots[row])
            if row_is_decode[row] or slot not in self.slot_host:
                continue
            p, k = int(prompt_len[slot]), self.k_host[slot]
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
                                sfi_slot=self.slot_host[slot], first_computed=first))
        plan, incomplete = plan_prompt_tail(cfg, rows, self.device)
        if incomplete:
            metrics.fallback("sfi_prompt_tail_incomplete", "a prefix-cache hit reached into the last "
                             "w_prefill=%d prompt positions of %d request(s): their prefill-end "
                             "evidence uses the queries they computed", cfg.w_prefill, incomplete)
        if plan is not None and plan.num_ends:
            row_slot = row_slot_device[plan.rows]
            mark_selected(self.steps_since_slow, self.has_selection, row_slot,
                          torch.ones_like(plan.rows, dtype=torch.bool))
            n_sel = torch.minimum(plan.k, plan.allowed_hi - plan.allowed_lo)
            self.sel_count.index_copy_(0, row_slot.long(), n_sel)
            if cfg.keep_prefill:
                self.n_kept.index_copy_(0, plan.sfi_slot.long(), kept_count(cfg, plan.k, n_sel))
            self.stats[STAT_PREFILL_END] += plan.num_ends
        return plan

    def plan_quest_pages(self, *, num_reqs: int, row_slots: np.ndarray, row_is_decode: np.ndarray,
                         host_geometry, held: np.ndarray | None = None) -> "QuestPrefillPages | None":
        """Selector ``quest``: the pages the step's multi-token rows write
        (``vllm_ext.methods.sfi.quest_tables.QuestPageTables.plan_prefill``; ``held``: the rows' bound-page
        blocks inside vLLM)."""
        return self.quest.plan_prefill(num_reqs=num_reqs, row_slots=row_slots, row_is_decode=row_is_decode,
                                       host_geometry=host_geometry, slot_host=self.slot_host, held=held,
                                       page_upto=self.page_upto)

    def counter_values(self) -> dict[str, int]:
        values = self.counters.read()
        return {name: values[i] for i, name in STAT_NAMES.items()}
