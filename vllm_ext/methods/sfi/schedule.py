"""SFI step schedule on the device: which decode rows are slow this step (ALGORITHMS.md §1).

Everything here is a pure tensor function with fixed shapes and no data-dependent Python, so it runs
inside CUDA-graph replays and never syncs with the host (under async scheduling the host never sees
the last sampled token).

Per-slot persistent state (one entry per stable request slot, allocated once):

* ``steps_since_slow [slots] int32``: decode steps run since the slot's last slow step (the selection at
  the end of prefill counts as one). 0 right after a slow step; every fast step adds 1.
* ``has_selection [slots] bool``: the slot holds a selection (made at a slow step or at the end of
  prefill). False for a fresh slot, so its first decode step is slow unless prefill selected.

* ``refresh_gap [slots] int32`` (optional): the slot's current refresh budget, at most ``refresh``. It
  starts at ``refresh`` (the paper's schedule), or at 1 with ``refresh_warmup``, and doubles at every
  slow step up to ``refresh``: with the warm-up, slow steps come at decode steps 1, 3, 7, 15, 31 and
  then at least every ``refresh`` steps.
* ``trigger_state [slots] int32`` (only needed with ``fire_at = "sentence_start"`` or a
  ``sentence_cooldown``): ``cooldown << 1 | armed``. 0 for a fresh slot (not armed, no cooldown).

Rules (``schedule``):

* ``boundary`` (default): slow if a sentence boundary fires (below; when ``min_boundary_gap > 0``, only
  if at least ``min_boundary_gap`` decode steps passed since the last slow step, else the boundary is
  dropped), or if the refresh budget is due, or if the slot has no selection yet.
* ``periodic``: slow when the refresh budget is due (no triggers) or there is no selection yet.
* ``always_slow``: every decode step is slow (dense; the ablation's "disabled").

"Refresh budget due" means this step is the ``refresh``-th decode step since the last slow step
(``steps_since_slow + 1 >= refresh``; with ``refresh_gap``, ``>= refresh_gap[slot]``): slow steps are
never more than ``refresh`` decode steps apart, at most ``refresh - 1`` fast steps run in a row, and
``periodic`` is slow exactly every ``refresh`` steps (``refresh = 1`` is always slow; the warm-up's
first gaps are shorter). The boundary gap reads the same way: a trigger counts when
``steps_since_slow + 1 >= min_boundary_gap``.

Sentence boundaries (``schedule = "boundary"``), on the previous sampled token ``tok`` of each row, with
``C = sentence_cooldown``; the trigger LUT's bit 0 marks triggers ("enders"), bit 1 whitespace-only
tokens (:mod:`vllm_ext.methods.sfi.triggers`):

1. if ``cooldown == 0`` and ``tok`` is an ender: ``cooldown = C`` and the slot is armed; otherwise a
   positive ``cooldown`` counts down by one;
2. ``fire_at = "sentence_end"``: the arm fires at once (with ``C = 0``: every trigger token fires, the
   behaviour of ALGORITHMS.md §1). ``fire_at = "sentence_start"`` (the SFI authors' code): an armed
   slot fires at the first ``tok`` that is neither an ender nor whitespace-only, disarms and sets
   ``cooldown = max(cooldown, C)``;
3. a firing counts only outside the minimum gap (see above); inside it, it is consumed and dropped.

Rows that are not decode rows (prefill chunks, padding rows of a CUDA graph: ``is_decode`` False) are
never slow here and leave the state untouched; padding rows may carry any ``slot_idx`` (even -1).
A prefill that ends makes its selection and then calls :func:`mark_selected`.
"""

from __future__ import annotations

from typing import Literal

import torch

# the trigger LUT's bits (vllm_ext.methods.sfi.triggers.trigger_lut); a bool LUT carries bit 0 only
from vllm_ext.methods.sfi.triggers import LUT_ENDER, LUT_SPACE

Schedule = Literal["boundary", "periodic", "always_slow"]
SCHEDULES = ("boundary", "periodic", "always_slow")
FireAt = Literal["sentence_end", "sentence_start"]
FIRE_AT = ("sentence_end", "sentence_start")


def _safe_slots(slot_idx: torch.Tensor, num_slots: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot indices safe to gather/scatter with (0 where the row is invalid), and the validity mask."""
    slot = slot_idx.long()
    valid = valid & (slot >= 0) & (slot < num_slots)
    return torch.where(valid, slot, torch.zeros_like(slot)), valid


def lut_bits(last_token: torch.Tensor, trigger_lut: torch.Tensor) -> torch.Tensor:
    """``trigger_lut[last_token]`` as int32 bits (``LUT_ENDER``, ``LUT_SPACE``), 0 for ids outside
    ``[0, len(lut))`` (padding, -1). A bool LUT reads as bit 0."""
    v = trigger_lut.shape[0]
    tok = last_token.long()
    inside = (tok >= 0) & (tok < v)
    bits = trigger_lut[tok.clamp(0, max(v - 1, 0))].to(torch.int32)
    return torch.where(inside, bits, torch.zeros_like(bits))


def is_trigger(last_token: torch.Tensor, trigger_lut: torch.Tensor) -> torch.Tensor:
    """Bit 0 (``LUT_ENDER``) of ``trigger_lut[last_token]``; ids outside ``[0, len(lut))`` (padding, -1)
    map to False."""
    return (lut_bits(last_token, trigger_lut) & LUT_ENDER) != 0


def needs_trigger_state(fire_at: str, sentence_cooldown: int) -> bool:
    """Whether the boundary rule keeps per-slot state (:func:`decide_slow`'s ``trigger_state``)."""
    return fire_at != "sentence_end" or sentence_cooldown > 0


def boundary_step(bits: torch.Tensor, state: torch.Tensor, *, fire_at: FireAt,
                  sentence_cooldown: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rules 1-2 of the module docstring on gathered per-row values: ``bits`` (int32 LUT bits of the
    previous token) and ``state`` (int32 ``cooldown << 1 | armed``). Returns ``(fire, new_state)``;
    the minimum gap is the caller's."""
    ender = (bits & LUT_ENDER) != 0
    space = (bits & LUT_SPACE) != 0
    cd = state >> 1
    armed = (state & 1) != 0
    arm = ender & (cd == 0)
    cd = torch.where(arm, torch.full_like(cd, sentence_cooldown), torch.clamp(cd - 1, min=0))
    if fire_at == "sentence_end":
        fire = arm
        armed = torch.zeros_like(armed)
    else:
        armed = armed | arm
        fire = armed & ~ender & ~space
        armed = armed & ~fire
        cd = torch.where(fire, torch.clamp(cd, min=sentence_cooldown), cd)
    return fire, (cd << 1) | armed.to(cd.dtype)


def decide_slow(
    last_token: torch.Tensor,
    slot_idx: torch.Tensor,
    is_decode: torch.Tensor,
    steps_since_slow: torch.Tensor,
    has_selection: torch.Tensor,
    trigger_lut: torch.Tensor,
    *,
    schedule: Schedule = "boundary",
    refresh: int = 32,
    min_boundary_gap: int = 0,
    fire_at: FireAt = "sentence_end",
    sentence_cooldown: int = 0,
    trigger_state: torch.Tensor | None = None,
    advance: torch.Tensor | None = None,
    refresh_gap: torch.Tensor | None = None,
    force_slow: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decide slow/fast for each row of this step and advance ``steps_since_slow`` (and, with
    ``trigger_state``, the sentence-boundary state) in place.

    Args:
      last_token: ``[rows]`` int, the previous sampled token of each row (any value on padding rows).
      slot_idx: ``[rows]`` int, the row's stable request slot (any value, even -1, on non-decode rows).
      is_decode: ``[rows]`` bool, the row is a decode step of a request holding SFI state.
      steps_since_slow: ``[slots]`` int32, updated in place for decode rows: 0 if slow, else +1.
      has_selection: ``[slots]`` bool (read only; see :func:`mark_selected`).
      trigger_lut: ``[vocab]`` int8 bits (``LUT_ENDER``, ``LUT_SPACE``) or bool (enders only), from
        :func:`vllm_ext.methods.sfi.triggers.trigger_lut`.
      schedule, refresh, min_boundary_gap, fire_at, sentence_cooldown: ``SfiConfig`` fields.
      trigger_state: ``[slots]`` int32 ``cooldown << 1 | armed``, updated in place for the ``advance``
        rows (schedule ``boundary`` only). Required when :func:`needs_trigger_state`; without it (and
        without the need) every trigger token fires.
      advance: ``[rows]`` bool, the rows whose token stream advances ``trigger_state`` (must include
        the ``is_decode`` rows; e.g. also the exactly-dense decode rows of SFI requests, which are
        never slow here). ``None`` = ``is_decode``.
      refresh_gap: ``[slots]`` int32, each slot's refresh budget (``<= refresh``), doubled in place
        (up to ``refresh``) at each slow step; ``None`` = ``refresh`` for every slot.
      force_slow: ``[rows]`` bool, rows slow whatever the schedule says (``sfi.copy_ngram``'s copy
        trigger; decode rows only, ignored by ``always_slow``).

    Returns ``slow [rows]`` bool (False on non-decode rows). Decode rows must have distinct slots.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown SFI schedule {schedule!r}; expected one of {SCHEDULES}")
    if fire_at not in FIRE_AT:
        raise ValueError(f"unknown SFI fire_at {fire_at!r}; expected one of {FIRE_AT}")
    if trigger_state is None and schedule == "boundary" and needs_trigger_state(fire_at, sentence_cooldown):
        raise ValueError(f"SFI fire_at={fire_at!r} with sentence_cooldown={sentence_cooldown} needs the "
                         "per-slot trigger_state")
    slot, valid = _safe_slots(slot_idx, steps_since_slow.shape[0], is_decode.bool())
    steps = steps_since_slow[slot]
    nth = steps + 1                                          # this step's number since the last slow step
    if schedule == "always_slow":
        slow = valid.clone()
    else:
        if refresh_gap is None:
            due = nth >= refresh
        else:
            gap = refresh_gap[slot]
            due = nth >= torch.clamp(gap, max=refresh)
        no_sel = ~has_selection[slot].bool()
        slow = due | no_sel
        if schedule == "boundary":
            if trigger_state is None:
                trig = is_trigger(last_token, trigger_lut)
            else:
                adv = is_decode.bool() if advance is None else advance.bool() | is_decode.bool()
                tslot, tvalid = _safe_slots(slot_idx, trigger_state.shape[0], adv)
                old = trigger_state[tslot]
                trig, new = boundary_step(lut_bits(last_token, trigger_lut), old, fire_at=fire_at,
                                          sentence_cooldown=sentence_cooldown)
                tdelta = torch.where(tvalid, new - old, torch.zeros_like(old)).to(trigger_state.dtype)
                trigger_state.index_put_((tslot,), tdelta, accumulate=True)
            if min_boundary_gap > 0:
                trig = trig & (nth >= min_boundary_gap)
            slow = slow | trig
        if force_slow is not None:
            slow = slow | force_slow.bool()
        slow = slow & valid
    new = torch.where(slow, torch.zeros_like(steps), nth)
    if refresh_gap is not None and schedule != "always_slow":
        grown = torch.where(slow, torch.clamp(gap * 2, max=refresh), gap)
        refresh_gap.index_put_((slot,), torch.where(valid, grown - gap, torch.zeros_like(gap))
                               .to(refresh_gap.dtype), accumulate=True)
    # Add the change through accumulate=True: rows that are not decode rows add 0 to slot 0, which
    # is safe even when a real decode row also owns slot 0 (a plain scatter would race there).
    delta = torch.where(valid, new - steps, torch.zeros_like(steps)).to(steps_since_slow.dtype)
    steps_since_slow.index_put_((slot,), delta, accumulate=True)
    return slow


def mark_selected(
    steps_since_slow: torch.Tensor,
    has_selection: torch.Tensor,
    slot_idx: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Record that ``rows`` (``[rows]`` bool) made a selection this step (a slow step or the end of a
    prefill): ``has_selection[slot] = True`` and ``steps_since_slow[slot] = 0``. In place, no sync."""
    slot, valid = _safe_slots(slot_idx, steps_since_slow.shape[0], rows.bool())
    steps = steps_since_slow[slot]
    delta = torch.where(valid, -steps, torch.zeros_like(steps)).to(steps_since_slow.dtype)
    steps_since_slow.index_put_((slot,), delta, accumulate=True)
    hit = torch.zeros(has_selection.shape[0], dtype=torch.int32, device=has_selection.device)
    hit.index_put_((slot,), valid.to(torch.int32), accumulate=True)
    has_selection.logical_or_(hit > 0)


def reset_slots(
    steps_since_slow: torch.Tensor,
    has_selection: torch.Tensor,
    slot_idx: torch.Tensor,
    rows: torch.Tensor | None = None,
    trigger_state: torch.Tensor | None = None,
) -> None:
    """Fresh state for (re)assigned slots: no selection, counter 0, and (with ``trigger_state``) not
    armed, no cooldown. ``rows`` masks ``slot_idx`` (``None`` = all entries). In place, no sync."""
    rows = torch.ones_like(slot_idx, dtype=torch.bool) if rows is None else rows.bool()
    slot, valid = _safe_slots(slot_idx, steps_since_slow.shape[0], rows)
    steps = steps_since_slow[slot]
    delta = torch.where(valid, -steps, torch.zeros_like(steps)).to(steps_since_slow.dtype)
    steps_since_slow.index_put_((slot,), delta, accumulate=True)
    if trigger_state is not None:
        old = trigger_state[slot]
        tdelta = torch.where(valid, -old, torch.zeros_like(old)).to(trigger_state.dtype)
        trigger_state.index_put_((slot,), tdelta, accumulate=True)
    hit = torch.zeros(has_selection.shape[0], dtype=torch.int32, device=has_selection.device)
    hit.index_put_((slot,), valid.to(torch.int32), accumulate=True)
    has_selection.logical_and_(hit == 0)


def dense_threshold(n_sink: int, n_recent: int, k: int) -> int:
    """Largest sequence length at which the sparse set is the whole history."""
    return int(n_sink) + int(n_recent) + int(k)


def is_exactly_dense(seq_lens: torch.Tensor, n_sink: int, n_recent: int,
                     k: int | torch.Tensor) -> torch.Tensor:
    """``seq_lens [rows] <= n_sink + n_recent + k``: the sparse set covers the whole history, so the
    step is exactly dense (no fast step needed). ``k`` may be a per-row tensor. No sync."""
    return seq_lens <= (n_sink + n_recent + k)


def allowed_range(seq_lens: torch.Tensor, n_sink: int, n_recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's allowed set ``A_t = [n_sink, t - n_recent)`` per row as ``(lo, hi)`` int32 tensors,
    with ``hi`` clamped to ``>= lo`` (an empty set when the history is short). ``t`` = ``seq_lens``:
    the number of positions the slow step attends to (the current token included)."""
    t = seq_lens.to(torch.int32)
    lo = torch.full_like(t, int(n_sink))
    hi = torch.maximum(t - int(n_recent), lo)
    return lo, hi
