"""SFI step schedule on the device: which decode rows are slow this step (ALGORITHMS.md §1).

Everything here is a pure tensor function with fixed shapes and no data-dependent Python, so it runs
inside CUDA-graph replays and never syncs with the host (under async scheduling the host never sees
the last sampled token).

Per-slot persistent state (one entry per stable request slot, allocated once):

* ``steps_since_slow [slots] int32``: decode steps run since the slot's last slow step (the selection at
  the end of prefill counts as one). 0 right after a slow step; every fast step adds 1.
* ``has_selection [slots] bool``: the slot holds a selection (made at a slow step or at the end of
  prefill). False for a fresh slot, so its first decode step is slow unless prefill selected.

Rules (``schedule``):

* ``boundary`` (default): slow if the previous token is a trigger (and, when ``min_boundary_gap > 0``,
  at least ``min_boundary_gap`` decode steps passed since the last slow step), or if the refresh
  budget is due, or if the slot has no selection yet.
* ``periodic``: slow when the refresh budget is due (no triggers) or there is no selection yet.
* ``always_slow``: every decode step is slow (dense; the ablation's "disabled").

"Refresh budget due" means this step is the ``refresh``-th decode step since the last slow step
(``steps_since_slow + 1 >= refresh``): slow steps are never more than ``refresh`` decode steps apart,
at most ``refresh - 1`` fast steps run in a row, and ``periodic`` is slow exactly every ``refresh``
steps (``refresh = 1`` is always slow). The boundary gap reads the same way: a trigger counts when
``steps_since_slow + 1 >= min_boundary_gap``.

Rows that are not decode rows (prefill chunks, padding rows of a CUDA graph: ``is_decode`` False) are
never slow here and leave the state untouched; padding rows may carry any ``slot_idx`` (even -1).
A prefill that ends makes its selection and then calls :func:`mark_selected`.
"""

from __future__ import annotations

from typing import Literal

import torch

Schedule = Literal["boundary", "periodic", "always_slow"]
SCHEDULES = ("boundary", "periodic", "always_slow")


def _safe_slots(slot_idx: torch.Tensor, num_slots: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot indices safe to gather/scatter with (0 where the row is invalid), and the validity mask."""
    slot = slot_idx.long()
    valid = valid & (slot >= 0) & (slot < num_slots)
    return torch.where(valid, slot, torch.zeros_like(slot)), valid


def is_trigger(last_token: torch.Tensor, trigger_lut: torch.Tensor) -> torch.Tensor:
    """``trigger_lut[last_token]`` with ids outside ``[0, len(lut))`` (padding, -1) mapped to False."""
    v = trigger_lut.shape[0]
    tok = last_token.long()
    inside = (tok >= 0) & (tok < v)
    return trigger_lut[tok.clamp(0, max(v - 1, 0))] & inside


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
) -> torch.Tensor:
    """Decide slow/fast for each row of this step and advance ``steps_since_slow`` in place.

    Args:
      last_token: ``[rows]`` int, the previous sampled token of each row (any value on padding rows).
      slot_idx: ``[rows]`` int, the row's stable request slot (any value, even -1, on non-decode rows).
      is_decode: ``[rows]`` bool, the row is a decode step of a request holding SFI state.
      steps_since_slow: ``[slots]`` int32, updated in place for decode rows: 0 if slow, else +1.
      has_selection: ``[slots]`` bool (read only; see :func:`mark_selected`).
      trigger_lut: ``[vocab]`` bool, from :func:`vllm_ext.sfi.triggers.trigger_lut`.
      schedule, refresh, min_boundary_gap: ``SfiConfig`` fields of the same names.

    Returns ``slow [rows]`` bool (False on non-decode rows). Decode rows must have distinct slots.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown SFI schedule {schedule!r}; expected one of {SCHEDULES}")
    slot, valid = _safe_slots(slot_idx, steps_since_slow.shape[0], is_decode.bool())
    steps = steps_since_slow[slot]
    nth = steps + 1                                          # this step's number since the last slow step
    if schedule == "always_slow":
        slow = valid.clone()
    else:
        due = nth >= refresh
        no_sel = ~has_selection[slot].bool()
        slow = due | no_sel
        if schedule == "boundary":
            trig = is_trigger(last_token, trigger_lut)
            if min_boundary_gap > 0:
                trig = trig & (nth >= min_boundary_gap)
            slow = slow | trig
        slow = slow & valid
    new = torch.where(slow, torch.zeros_like(steps), nth)
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
) -> None:
    """Fresh state for (re)assigned slots: no selection, counter 0. ``rows`` masks ``slot_idx``
    (``None`` = all entries). In place, no sync."""
    rows = torch.ones_like(slot_idx, dtype=torch.bool) if rows is None else rows.bool()
    slot, valid = _safe_slots(slot_idx, steps_since_slow.shape[0], rows)
    steps = steps_since_slow[slot]
    delta = torch.where(valid, -steps, torch.zeros_like(steps)).to(steps_since_slow.dtype)
    steps_since_slow.index_put_((slot,), delta, accumulate=True)
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
