"""SFI's prompt tail: the queries of each request's last ``w_prefill`` prompt positions, kept per layer
across prefill chunks, and the prefill-end selection made from them (ALGORITHMS.md §1: "prefill ends
with a slow step: the selection is made from the last ``W_p`` prompt queries").

A request's prompt may be split into chunks anywhere (the token budget, the other requests of the
step, a prefix-cache hit decide where), so the last ``W_p`` prompt queries may come from several
chunks. DESIGN.md: "an answer depends only on its request ... the prefill-end evidence window spans
chunks". Each layer therefore keeps the window ``[W_p, Hq, D]`` per request (inside vLLM in blocks of
the request's compact group, ``vllm_ext.methods.sfi.state_pages``) indexed by the request's compact slot; whichever chunk computes a
position of ``[P - W_p, P)`` (``P`` = prompt length) writes its query to entry ``position - (P - W_p)``,
and the chunk that reaches ``P`` runs the evidence from the buffer over the prompt's K/V once its own
K/V are in the cache. The selection then depends on the prompt only, never on the chunking.

The plan is built on the host from the prefill geometry the runner already has (prefill runs eagerly,
outside CUDA graphs); the per-layer work is an index copy plus :func:`prefill_evidence`. Torch and
numpy only (no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ext.methods.sfi.config import SfiConfig


class PromptTailQueries:
    """One layer's prompt-tail queries ``[C, W_p, Hq, D]`` (the activation dtype), indexed by the
    compact SFI slot: a tensor (:meth:`allocate`, outside vLLM) or, inside vLLM, pages of the request's
    compact-group blocks (``vllm_ext.kernels.paged_rows.PagedRows``, bound by the layer before each
    forward: ``vllm_ext.methods.sfi.state_pages``)."""

    def __init__(self, queries):
        self.queries = queries

    @staticmethod
    def allocate(capacity: int, w_prefill: int, num_heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.zeros(capacity, w_prefill, num_heads, head_size, dtype=dtype, device=device)

    @staticmethod
    def nbytes(capacity: int, w_prefill: int, num_heads: int, head_size: int,
               dtype: torch.dtype) -> int:
        return capacity * w_prefill * num_heads * head_size * torch.empty((), dtype=dtype).element_size()

    def write(self, query: torch.Tensor, plan: "SfiPrefillEnd") -> None:
        """Store this step's prompt-tail queries (``query [T, Hq, D]``, the step's batch)."""
        if plan.num_writes:
            self.queries.index_put_((plan.write_slot, plan.write_index),
                                    query[plan.write_token].to(self.queries.dtype))

    def gather(self, plan: "SfiPrefillEnd") -> torch.Tensor:
        """The ending requests' windows ``[n, W_p, Hq, D]`` (entry ``j`` = position ``P - W_p + j``)."""
        return self.queries[plan.sfi_slot.long()]


@dataclass
class SfiPrefillEnd:
    """One step's prompt-tail work: the writes into the per-layer buffers, and the requests whose
    prefill ends in this step and make their first selection from the buffer."""

    # this step's tokens at prompt-tail positions -> (compact slot, window entry)
    write_token: torch.Tensor       # int64 [m]: token index in the step's batch
    write_slot: torch.Tensor        # int64 [m]: compact SFI slot
    write_index: torch.Tensor       # int64 [m]: window entry, position - (P - W_p)
    num_writes: int                 # m (host)
    # the requests whose prefill ends in this step (n may be 0)
    rows: torch.Tensor              # int64 [n]: batch rows (their block-table rows)
    positions: torch.Tensor         # int64 [n, W]: position of window entry j (-1 = no query there)
    seq_lens: torch.Tensor          # int32 [n]: the prompt length P (K/V the evidence reads)
    allowed_lo: torch.Tensor        # int32 [n]
    allowed_hi: torch.Tensor        # int32 [n]
    k: torch.Tensor                 # int32 [n]
    sfi_slot: torch.Tensor          # int32 [n]
    num_ends: int                   # n (host)
    prompt_lens: list[int]          # P of each ending request (host): the evidence's span


@dataclass
class TailRow:
    """Host geometry of one prefill row of a request holding a compact slot."""
    row: int                        # batch row
    token_start: int                # index of the row's first query in the step's batch
    computed: int                   # positions computed before this step
    q_len: int                      # positions in this step
    prompt_len: int                 # P
    k: int
    sfi_slot: int
    first_computed: int             # first position this request computed itself (its prefix hit)


def tail_window(cfg: SfiConfig, prompt_len: int) -> tuple[int, int]:
    """Positions whose queries the prefill-end evidence reads: ``[max(P - W_p, 0), P)``."""
    return max(prompt_len - cfg.w_prefill, 0), prompt_len


def kept_count(cfg: SfiConfig, k: torch.Tensor, n_sel: torch.Tensor) -> torch.Tensor:
    """``sfi.keep_prefill``: the tokens a prefill-end selection of ``n_sel`` tokens (budget ``k``,
    int32 tensors) keeps for the whole decode, ``min(keep_prefill, k, n_sel)``."""
    return torch.minimum(torch.minimum(k, n_sel), torch.full_like(k, cfg.keep_prefill))


def makes_prefill_selection(cfg: SfiConfig, prompt_len: int, k: int) -> bool:
    """A prefill makes a selection when its history exceeds ``n_sink + n_recent + k`` (otherwise the
    first decode steps are exactly dense)."""
    return prompt_len > cfg.n_sink + cfg.n_recent + k


def prefix_hit_limit(cfg: SfiConfig, prompt_len: int, block_size: int) -> int:
    """The longest prefix-cache hit (whole blocks) that leaves the prompt tail to the request itself:
    a hit reaching into ``[P - W_p, P)`` would skip those queries, and whether it happens depends on
    what other requests left in the cache. ``vllm_ext.vllm_patches`` caps the scheduler's hits here."""
    a, _ = tail_window(cfg, prompt_len)
    return a // block_size * block_size


def plan_prompt_tail(cfg: SfiConfig, rows: list[TailRow], device: torch.device
                     ) -> tuple[SfiPrefillEnd | None, int]:
    """The step's prompt-tail writes and prefill-end selections for ``rows`` (prefill rows whose
    request holds a compact slot and makes a prefill selection). Returns the plan (None when there is
    nothing to do) and the number of ending requests whose window has positions they never computed
    (a prefix-cache hit reaching into the window, which :func:`prefix_hit_limit` prevents): those
    entries are padding (``-1``)."""
    w = cfg.w_prefill
    tok, wslot, widx = [], [], []
    ends: list[TailRow] = []
    for r in rows:
        a, p = tail_window(cfg, r.prompt_len)
        lo, hi = max(r.computed, a), min(r.computed + r.q_len, p)
        if hi > lo:
            pos = np.arange(lo, hi)
            tok.append(r.token_start + pos - r.computed)
            widx.append(pos - (p - w))
            wslot.append(np.full(hi - lo, r.sfi_slot))
        if r.computed < p <= r.computed + r.q_len:
            ends.append(r)
    m, n = sum(len(t) for t in tok), len(ends)
    if m == 0 and n == 0:
        return None, 0
    j = np.arange(w)
    p_end = np.array([r.prompt_len for r in ends], dtype=np.int64)
    first = np.array([max(r.first_computed, 0) for r in ends], dtype=np.int64)
    pos = p_end[:, None] - w + j[None, :]
    have = pos >= np.maximum(first, 0)[:, None]
    incomplete = int(np.sum(np.any(~have & (pos >= 0), axis=1))) if n else 0
    pos = np.where(have, pos, -1)
    lo = np.full(n, cfg.n_sink, dtype=np.int32)
    hi = np.maximum(lo, p_end - cfg.n_recent).astype(np.int32)

    def dev(a, dtype):
        return torch.as_tensor(np.asarray(a), dtype=dtype).to(device, non_blocking=True)

    def cat(parts):
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    plan = SfiPrefillEnd(
        write_token=dev(cat(tok), torch.int64), write_slot=dev(cat(wslot), torch.int64),
        write_index=dev(cat(widx), torch.int64), num_writes=m,
        rows=dev([r.row for r in ends], torch.int64), positions=dev(pos.reshape(n, w), torch.int64),
        seq_lens=dev(p_end, torch.int32), allowed_lo=dev(lo, torch.int32),
        allowed_hi=dev(hi, torch.int32), k=dev([r.k for r in ends], torch.int32),
        sfi_slot=dev([r.sfi_slot for r in ends], torch.int32), num_ends=n,
        prompt_lens=[r.prompt_len for r in ends])
    return plan, incomplete
