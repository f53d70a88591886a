"""SPEED's visibility rule and the per-step plan of the upper layers (torch only, no vLLM).

Upper layers (``>= l_cut``) hold KV only for the anchors (BoS, position 0, unless ``anchor: none``)
and the decode-phase tokens, the last prompt token included (position ``P - 1`` onwards, ``P`` the
prompt length). A query at position ``p >= P - 1`` of an upper layer sees keys ``[0, a) ∪ [P - 1, p]``
(``a`` = 1 with the BoS anchor, else 0); ``variant: self_only`` (the paper's diagnostic) sees
``[0, a) ∪ {p}``. Lower layers are plain causal. Positions are never renumbered.

A prompt token in ``[a, P - 1)`` does not exist in the upper layers: its upper-layer KV is never
written (the plan's slot mapping sends it to -1) and, when its upper-layer compute still runs, its
output there is unused (only the last prompt token's logits are sampled); such a query sees the
anchors only (a zero output without anchors), never the null block its own position maps to.

Everything is described per row by two numbers, ``anchor_end = a`` and ``tail_start = P - 1``; one
rule for the reference (:func:`visible_mask`), the PyTorch twin and the Triton kernel
(:mod:`vllm_ext.kernels.speed_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def anchor_count(anchor: str) -> int:
    return 1 if anchor == "bos" else 0


def first_upper_position(prompt_len: int | np.ndarray) -> int | np.ndarray:
    """The first position that exists in the upper layers besides the anchors (``P - 1``)."""
    return np.maximum(np.asarray(prompt_len) - 1, 0) if isinstance(prompt_len, np.ndarray) \
        else max(int(prompt_len) - 1, 0)


def upper_exists(positions: torch.Tensor, prompt_len: torch.Tensor, anchor_end: int) -> torch.Tensor:
    """Whether each token (``positions``, with its row's ``prompt_len``) has upper-layer KV."""
    return (positions < anchor_end) | (positions >= (prompt_len - 1).clamp_min(0))


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, prompt_len: int, anchor_end: int,
                 self_only: bool) -> torch.Tensor:
    """``[n_q, n_k]`` True where an upper-layer query at ``q_pos`` sees the key at ``k_pos``
    (the reference of the rule; causal included)."""
    q = q_pos[:, None]
    k = k_pos[None, :]
    p1 = max(prompt_len - 1, 0)
    start = q if self_only else torch.full_like(q, p1)
    tail = (q >= p1) & (k >= start)                  # interior prompt queries have no tail
    return (k <= q) & ((k < anchor_end) | tail)


@dataclass
class SpeedUpperStep:
    """The upper layers' view of one step (device tensors, views of persistent buffers).

    ``slot_mapping``: the step's slot mapping with tokens that have no upper-layer KV set to -1;
    ``tail_start [rows]``: ``P - 1`` per row (per query it is clipped to the query's own position,
    and replaced by it under ``self_only``); ``anchor_end``: 1 with the BoS anchor, else 0.
    ``keep_tokens`` / ``interior_tokens``: the step's tokens with / without upper-layer KV (host
    ints from the host geometry, for counters; 0 when unknown).
    """

    slot_mapping: torch.Tensor
    tail_start: torch.Tensor
    token_row: torch.Tensor        # int64 [tokens]: the row of each token
    positions: torch.Tensor        # int64 [tokens]: its position (-1 for padding tokens)
    anchor_end: int
    self_only: bool
    keep_tokens: int
    interior_tokens: int
    l_cut: int = 0                         # the first upper layer
    keep_idx: torch.Tensor | None = None   # int64 [keep_tokens]: the tokens the upper stack runs on
                                           # when prompt tokens skip it (None: every token runs it)


class SpeedPlanBuffers:
    """Persistent buffers of the upper-layer plan (sized once by the runner's limits)."""

    def __init__(self, max_rows: int, max_tokens: int, device: torch.device):
        self.slot_mapping = torch.empty(max_tokens, dtype=torch.int64, device=device)
        self.tail_start = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.positions = torch.empty(max_tokens, dtype=torch.int64, device=device)
        self.exists = torch.empty(max_tokens, dtype=torch.bool, device=device)
        self.token_row = torch.empty(max_tokens, dtype=torch.int64, device=device)
        self.arange = torch.arange(max_tokens, dtype=torch.int64, device=device)


def plan_upper_step(*, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, row_prompt_len: torch.Tensor, num_reqs: int,
                    anchor_end: int, self_only: bool, buffers: SpeedPlanBuffers,
                    host_counts: tuple[int, int] = (0, 0)) -> SpeedUpperStep:
    """The upper layers' slot mapping and per-row tail starts, on the device, no host sync.

    ``query_start_loc [rows + 1]`` / ``seq_lens [rows]`` are vLLM's (current queries included), so
    token ``i`` of row ``r`` sits at ``seq_lens[r] - q_len[r] + (i - query_start_loc[r])``.
    ``host_counts``: (kept, interior) tokens of the step when the host knows them (counters only).
    """
    n = slot_mapping.shape[0]
    rows = row_prompt_len.shape[0]
    out_slots = buffers.slot_mapping[:n]
    tail = buffers.tail_start[:rows]
    torch.sub(row_prompt_len, 1, out=tail)
    tail.clamp_(min=0)
    if n:
        idx = buffers.arange[:n]
        token_row = buffers.token_row[:n]
        # row of each token: the number of row starts at or before it, minus one
        torch.searchsorted(query_start_loc[1:rows + 1], idx, right=True, out=token_row)
        token_row.clamp_(max=max(rows - 1, 0))
        qsl = query_start_loc.long()
        pos = buffers.positions[:n]
        torch.sub(seq_lens.long()[token_row] - (qsl[token_row + 1] - qsl[token_row]), qsl[token_row],
                  out=pos)
        pos.add_(idx)
        # tokens past the last row's end are padding
        pos.masked_fill_(idx >= qsl[rows], -1)
        exists = buffers.exists[:n]
        torch.logical_or(pos < anchor_end, pos >= tail.long()[token_row], out=exists)
        exists.logical_and_(pos >= 0)
        torch.where(exists, slot_mapping.long(), torch.full_like(out_slots, -1), out=out_slots)
    return SpeedUpperStep(slot_mapping=out_slots, tail_start=tail,
                          token_row=buffers.token_row[:n], positions=buffers.positions[:n],
                          anchor_end=anchor_end, self_only=self_only, keep_tokens=host_counts[0],
                          interior_tokens=host_counts[1])


def kept_token_index(query_start_loc: np.ndarray, computed: np.ndarray, prompt_len: np.ndarray,
                     num_reqs: int, anchor_end: int) -> np.ndarray:
    """Indices (into the step's tokens, ascending) of the tokens that exist in the upper layers:
    per row, positions ``[c, c + q) ∩ ([0, a) ∪ [P - 1, ∞))`` (``c`` computed before the step, ``q``
    the row's query tokens). Vectorised over rows (host geometry is exact for every row)."""
    if num_reqs == 0:
        return np.zeros(0, dtype=np.int64)
    qs = query_start_loc[:num_reqs].astype(np.int64)
    q = query_start_loc[1:num_reqs + 1].astype(np.int64) - qs
    c = computed[:num_reqs].astype(np.int64)
    p1 = np.maximum(prompt_len[:num_reqs].astype(np.int64) - 1, 0)
    a_len = np.clip(np.minimum(c + q, anchor_end) - c, 0, None)            # anchors [c, min(c+q, a))
    b_lo = np.maximum(np.maximum(c, p1), anchor_end)
    b_len = np.clip(c + q - b_lo, 0, None)                                 # tail [b_lo, c+q)
    starts = np.concatenate([qs, qs + (b_lo - c)])
    lens = np.concatenate([a_len, b_len])
    order = np.argsort(starts, kind="stable")
    starts, lens = starts[order], lens[order]
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg = np.repeat(np.arange(len(lens)), lens)
    offsets = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    return starts[seg] + offsets


def host_token_counts(query_start_loc: np.ndarray, computed: np.ndarray, prompt_len: np.ndarray,
                      num_reqs: int, anchor_end: int) -> tuple[int, int]:
    """(tokens with upper-layer KV, interior prompt tokens) of a step, from host geometry."""
    keep = interior = 0
    for r in range(num_reqs):
        q = int(query_start_loc[r + 1] - query_start_loc[r])
        c = int(computed[r])
        lo_int, hi_int = anchor_end, max(int(prompt_len[r]) - 1, anchor_end)
        inter = max(0, min(c + q, hi_int) - max(c, lo_int))
        interior += inter
        keep += q - inter
    return keep, interior
