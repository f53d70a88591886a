"""Per-step SFI plan on the device: which decode rows are dense, slow or fast, and the index ranges
every layer's kernels read (ALGORITHMS.md §1). Built once per step, read by every layer: the packed
step descriptor of the SFI design. Pure tensor code with fixed shapes: no host synchronisation.

Row modes (decode rows of requests with SFI on and a compact slot; every other row is ``dense``):
- dense: ``t <= n_sink + n_recent + k`` (the sparse set is the whole history) — exactly dense;
- slow: the schedule says so (trigger token, refresh budget, no selection yet): dense attention plus
  evidence, then the selector and the gather refresh the compact segment;
- fast: attention over the compact segment (sink + selected) and the recent window in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.config import SfiConfig
from vllm_ext.sfi.schedule import allowed_range, decide_slow, mark_selected

STAT_SLOW, STAT_FAST, STAT_RETAINED, STAT_CONTEXT, STAT_DENSE = range(5)
STAT_PREFILL_END = 7


@dataclass
class SfiStep:
    row_slow: torch.Tensor          # bool  [rows]
    row_fast: torch.Tensor          # bool  [rows]
    row_sparse: torch.Tensor        # bool  [rows]: slow | fast
    row_sfi_slot: torch.Tensor      # int32 [rows]: compact-segment slot (0 where not sparse: safe index)
    row_k: torch.Tensor             # int32 [rows]: selection budget per KV head
    recent_start: torch.Tensor      # int32 [rows]: first position of the recent window
    allowed_lo: torch.Tensor        # int32 [rows]: the selector's allowed set [lo, hi)
    allowed_hi: torch.Tensor
    prefill_end: "SfiPrefillEnd | None" = None


def plan_step(cfg: SfiConfig, *, row_slot: torch.Tensor, row_last_token: torch.Tensor,
              row_is_decode: torch.Tensor, seq_lens: torch.Tensor, sfi_slot_of: torch.Tensor,
              sfi_on: torch.Tensor, sfi_k: torch.Tensor, steps_since_slow: torch.Tensor,
              has_selection: torch.Tensor, sel_count: torch.Tensor, trigger_lut: torch.Tensor,
              stats: torch.Tensor) -> SfiStep:
    """Decide each row's mode and advance the per-slot schedule state in place.

    Per-slot tables (indexed by the request slot): ``sfi_slot_of`` (compact slot or -1), ``sfi_on``,
    ``sfi_k``, ``steps_since_slow``, ``has_selection``, ``sel_count`` (tokens selected at the last
    slow step). ``stats`` (int64 ``[NUM_STATS]``) accumulates slow/fast/dense row counts and the
    retained and total context tokens of fast rows.
    """
    slot = row_slot.long()
    t = seq_lens.to(torch.int32)
    k = sfi_k[slot]
    sfi_slot = sfi_slot_of[slot]
    decode = row_is_decode.bool()
    on = decode & sfi_on[slot] & (sfi_slot >= 0)
    sparse = on & (t > cfg.n_sink + cfg.n_recent + k)
    slow = decide_slow(row_last_token, row_slot, sparse, steps_since_slow, has_selection,
                       trigger_lut, schedule=cfg.schedule, refresh=cfg.refresh,
                       min_boundary_gap=cfg.min_boundary_gap)
    fast = sparse & ~slow
    lo, hi = allowed_range(t, cfg.n_sink, cfg.n_recent)
    recent_start = torch.clamp(t - cfg.n_recent, min=0)
    mark_selected(steps_since_slow, has_selection, row_slot, slow)
    # tokens the slow rows select (the same for every layer and KV head): min(k, |A|)
    n_sel = torch.minimum(k, torch.clamp(hi - lo, min=0))
    sel_count.index_put_((slot,), torch.where(slow, n_sel - sel_count[slot], 0), accumulate=True)
    retained = torch.where(fast, cfg.n_sink + sel_count[slot] + (t - recent_start), 0)
    stats[STAT_SLOW] += slow.sum()
    stats[STAT_FAST] += fast.sum()
    stats[STAT_DENSE] += (decode & ~sparse).sum()
    stats[STAT_RETAINED] += retained.sum()
    stats[STAT_CONTEXT] += torch.where(fast, t, 0).sum()
    return SfiStep(row_slow=slow, row_fast=fast, row_sparse=sparse,
                   row_sfi_slot=torch.where(sparse, sfi_slot, 0).to(torch.int32),
                   row_k=k.to(torch.int32), recent_start=recent_start.to(torch.int32),
                   allowed_lo=lo, allowed_hi=hi)


@dataclass
class SfiPrefillEnd:
    """Requests whose prefill ends in this step and that make their first selection from their last
    ``w_prefill`` prompt queries (ALGORITHMS.md §1: "prefill ends with a slow step"). Built on the
    host, where prefill geometry is exact; prefill runs eagerly, outside CUDA graphs."""

    rows: torch.Tensor              # int64 [n]: batch rows
    token_idx: torch.Tensor         # int64 [n, W]: the queries' token indices in the step's batch
    positions: torch.Tensor         # int64 [n, W]: their positions (-1 = padding query)
    seq_lens: torch.Tensor          # int32 [n]
    allowed_lo: torch.Tensor        # int32 [n]
    allowed_hi: torch.Tensor        # int32 [n]
    k: torch.Tensor                 # int32 [n]
    sfi_slot: torch.Tensor          # int32 [n]


def plan_prefill_end(cfg: SfiConfig, *, rows, query_end, q_lens, seq_lens, ks, sfi_slots,
                     device: torch.device) -> SfiPrefillEnd | None:
    """Host lists of the ending prefills (already filtered: SFI on, a compact slot, and a history
    longer than ``n_sink + n_recent + k``) -> device tensors."""
    import numpy as np

    n = len(rows)
    if n == 0:
        return None
    w = cfg.w_prefill
    j = np.arange(w)
    q_lens = np.asarray(q_lens)
    seq = np.asarray(seq_lens)
    real = j[None, :] >= (w - np.minimum(q_lens, w))[:, None]             # right-aligned queries
    token = np.asarray(query_end)[:, None] - w + j[None, :]
    pos = seq[:, None] - w + j[None, :]
    token = np.where(real, token, np.asarray(query_end)[:, None] - 1)
    pos = np.where(real, pos, -1)
    lo = np.full(n, cfg.n_sink, dtype=np.int32)
    hi = np.maximum(lo, seq - cfg.n_recent).astype(np.int32)

    def dev(a, dtype):
        return torch.as_tensor(np.asarray(a), dtype=dtype).to(device, non_blocking=True)

    return SfiPrefillEnd(rows=dev(rows, torch.int64), token_idx=dev(token, torch.int64),
                         positions=dev(pos, torch.int64), seq_lens=dev(seq, torch.int32),
                         allowed_lo=dev(lo, torch.int32), allowed_hi=dev(hi, torch.int32),
                         k=dev(ks, torch.int32), sfi_slot=dev(sfi_slots, torch.int32))
