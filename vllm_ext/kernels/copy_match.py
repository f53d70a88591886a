"""The copy trigger of ``sfi.copy_ngram`` on the device: each SFI request's token history, and per
decode row whether its last ``m`` tokens repeat an earlier span whose next token lies outside the
sink and the recent window (the model is copying that span, and the next token it copies must be
attended).

Two ops, each a Triton kernel with a PyTorch twin of the same signature (the twin is the CPU
build's path: the CPU plan is PyTorch):

* :func:`record_tokens` writes the step's input tokens into ``history [slots + 1, max_len]``
  (int32; the row of compact slot ``s`` holds the request's token at each position; the last row is
  a trash row for writes that have no slot). Grid ``(rows, cdiv(max_q_len, BLOCK))``: a decode-only
  step launches one block per row.
* :func:`copy_match` sets ``out[r]`` (int32 0/1) for the rows marked ``active`` that hold a slot:
  with ``t = seq_lens[r]`` (the step's input token at position ``t - 1``) and ``m = ngram``, an
  occurrence is a ``j`` with ``history[j - i] == history[t - 1 - i]`` for ``i < m``, ``j - m + 1 >= 0``
  and the follower ``j + 1`` in ``[n_sink, t - n_recent)`` (the selector's allowed set: what a fast
  step reads only if it was selected); ``out[r]`` is 1 when there are between 1 and ``max_matches``
  occurrences (``max_matches`` 0: any number). A span that occurs once is one the model can only
  copy from there; a phrase that recurs all over the context (a repetitive haystack, boilerplate)
  needs no particular position. Grid ``(rows,)``, a loop over ``t - n_recent`` positions per row.
  With ``prev`` (int32 per slot, ``sfi.copy_once``) a row fires only at the first step of a run of
  copying steps: ``out = hit & ~prev[slot]``, and ``prev[slot] = hit`` for the active rows (that
  step's slow step reselects from the copying query, whose evidence points at the span's next
  token, and ``select_span`` brings the tokens after it).

Cost per decode row and step: ``m`` int32 reads per allowed position (``4 (t - n_recent)`` bytes
from memory, the rest cached), against a fast step's ``layers x 2 x H_kv x D x dtype`` bytes per
retained token: about 0.1 % of a fast step's bytes at 8K on SmolLM2-135M (30 layers, 3 KV heads,
D 64, bf16, 14 % retained). No host synchronisation and no allocation: the plan reads ``out``.
Importable without vLLM.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _record_kernel(HIST, IDS, QSL, SEQ, HSLOT, n_ids, max_len, trash, s_hist,
                       BLOCK: tl.constexpr):
        r = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        start = tl.load(QSL + r)
        q_len = tl.load(QSL + r + 1) - start
        t = tl.load(SEQ + r)
        slot = tl.load(HSLOT + r)
        pos = t - q_len + j
        ok = (j < q_len) & (slot >= 0) & (pos >= 0) & (pos < max_len) & (start + j < n_ids)
        tok = tl.load(IDS + start + j, mask=ok, other=0)
        tl.store(HIST + slot.to(tl.int64) * s_hist + pos, tok, mask=ok)

    @triton.jit
    def _match_kernel(HIST, SEQ, HSLOT, ACTIVE, OUT, PREV, max_len, s_hist, n_sink, n_recent, max_matches,
                      M: tl.constexpr, BLOCK: tl.constexpr, ONCE: tl.constexpr):
        r = tl.program_id(0)
        t = tl.load(SEQ + r)
        slot = tl.load(HSLOT + r)
        act = (tl.load(ACTIVE + r) != 0) & (slot >= 0) & (t >= M) & (t <= max_len)
        base = HIST + tl.maximum(slot, 0).to(tl.int64) * s_hist
        # the occurrence's last position j: follower j + 1 in [n_sink, t - n_recent), j >= M - 1
        j_lo = tl.maximum(n_sink - 1, M - 1)
        j_hi = tl.where(act, t - n_recent - 1, 0)
        hits = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(j_lo, j_hi, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < j_hi
            for i in tl.static_range(M):
                want = tl.load(base + t - 1 - i)
                got = tl.load(base + j - i, mask=ok, other=-1)
                ok = ok & (got == want)
            hits += ok.to(tl.int32)
        n = tl.sum(hits, 0)
        hit = (n > 0) & ((max_matches == 0) | (n <= max_matches))
        if ONCE:
            seen = tl.load(PREV + tl.maximum(slot, 0), mask=act, other=0) != 0
            tl.store(PREV + tl.maximum(slot, 0), hit.to(tl.int32), mask=act)
            hit = hit & (~seen)
        tl.store(OUT + r, hit.to(tl.int32))


def record_tokens_torch(history: torch.Tensor, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, row_hist_slot: torch.Tensor, max_q_len: int) -> None:
    """Write each row's input tokens at their positions into ``history[row_hist_slot[r]]`` (rows
    with slot -1 write nothing). ``max_q_len``: a host bound of the rows' query lengths."""
    rows = row_hist_slot.shape[0]
    if rows == 0 or max_q_len <= 0:
        return
    trash, max_len = history.shape[0] - 1, history.shape[1]
    j = torch.arange(max_q_len, device=history.device, dtype=torch.int64)[None, :]
    start = query_start_loc[:rows].long()[:, None]
    q_len = query_start_loc[1:rows + 1].long()[:, None] - start
    pos = seq_lens[:rows].long()[:, None] - q_len + j
    slot = row_hist_slot.long()[:, None]
    ok = (j < q_len) & (slot >= 0) & (pos >= 0) & (pos < max_len) & (start + j < input_ids.shape[0])
    tok = input_ids[(start + j).clamp(0, max(input_ids.shape[0] - 1, 0))].to(history.dtype)
    history.index_put_((torch.where(ok, slot, trash), torch.where(ok, pos, 0)), tok)


def copy_match_torch(history: torch.Tensor, seq_lens: torch.Tensor, row_hist_slot: torch.Tensor,
                     row_active: torch.Tensor, out: torch.Tensor, *, n_sink: int, n_recent: int,
                     ngram: int, max_matches: int = 0, prev: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = 1`` where the row copies (module docstring), else 0; returns ``out``. ``prev``: the
    per-slot state of ``sfi.copy_once`` (updated in place)."""
    rows = row_hist_slot.shape[0]
    max_len = history.shape[1]
    m = int(ngram)
    t = seq_lens[:rows].long()
    slot = row_hist_slot.long()
    act = (row_active[:rows] != 0) & (slot >= 0) & (t >= m) & (t <= max_len)
    h = history[slot.clamp(min=0)]                                    # [rows, max_len]
    j = torch.arange(max_len, device=history.device)[None, :]
    ok = act[:, None] & (j >= max(n_sink - 1, m - 1)) & (j < (t - n_recent - 1)[:, None])
    for i in range(m):
        want = h.gather(1, (t - 1 - i).clamp(0, max_len - 1)[:, None])
        got = h.gather(1, (j - i).clamp(min=0).expand(rows, -1))
        ok = ok & (got == want)
    n = ok.sum(1)
    hit = (n > 0) & ((n <= max_matches) if max_matches else True)
    if prev is not None:
        trash = prev.shape[0] - 1                  # the slot table's trash entry takes inactive rows
        idx = torch.where(act, slot, trash)
        seen = (prev[idx] != 0) & act
        prev.index_put_((idx,), hit.to(prev.dtype))
        hit = hit & ~seen
    out[:rows].copy_(hit.to(out.dtype))
    return out


def record_tokens(history, input_ids, query_start_loc, seq_lens, row_hist_slot, max_q_len: int) -> None:
    """Triton on CUDA (or under the interpreter), else the twin: :func:`record_tokens_torch`."""
    rows = row_hist_slot.shape[0]
    if not (HAS_TRITON and use_triton(history)):
        return record_tokens_torch(history, input_ids, query_start_loc, seq_lens, row_hist_slot, max_q_len)
    if rows == 0 or max_q_len <= 0:
        return
    block = min(1024, max(16, next_pow2(max_q_len)))
    _record_kernel[(rows, triton.cdiv(max_q_len, block))](
        history, input_ids, query_start_loc, seq_lens, row_hist_slot, input_ids.shape[0],
        history.shape[1], history.shape[0] - 1, history.stride(0), BLOCK=block)


def copy_match(history, seq_lens, row_hist_slot, row_active, out, *, n_sink: int, n_recent: int,
               ngram: int, max_matches: int = 0, prev: torch.Tensor | None = None) -> torch.Tensor:
    """Triton on CUDA (or under the interpreter), else the twin: :func:`copy_match_torch`."""
    if not (HAS_TRITON and use_triton(history)):
        return copy_match_torch(history, seq_lens, row_hist_slot, row_active, out, n_sink=n_sink,
                                n_recent=n_recent, ngram=ngram, max_matches=max_matches, prev=prev)
    rows = row_hist_slot.shape[0]
    if rows:
        _match_kernel[(rows,)](history, seq_lens, row_hist_slot, row_active, out,
                               prev if prev is not None else out, history.shape[1],
                               history.stride(0), int(n_sink), int(n_recent), int(max_matches),
                               M=int(ngram), BLOCK=512, ONCE=prev is not None)
    return out
