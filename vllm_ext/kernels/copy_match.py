"""The copy trigger of ``sfi.copy_ngram`` on the device: each SFI request's token history, and per
decode row whether its last ``m`` tokens repeat an earlier span whose next token lies outside the
sink and the recent window (the model is copying that span, and the next token it copies must be
attended).

The history is a :class:`vllm_ext.kernels.token_history.TokenHistory`: int32 tokens by position, in
pages reached through a per-slot block table (inside vLLM, blocks of SFI's history group; a
contiguous ``[slots + 1, max_len]`` tensor is accepted too, as the same with a trivial table). Two
ops, each a Triton kernel with a PyTorch twin of the same signature (the twin is the CPU build's
path: the CPU plan is PyTorch):

* :func:`record_tokens` writes the step's input tokens of each row at their positions into the
  history of slot ``row_hist_slot[r]`` (-1: nothing written). Grid ``(rows, cdiv(max_q_len,
  RECORD_BLOCK))``: a decode-only step launches one block per row. One block size and an
  unspecialised token count, so that every step launches the one compile key the start-up warm-up
  compiles (``vllm_ext.backend.kernel_warmup.warm_up_copy_trigger``).
* :func:`copy_match` sets ``out[r]`` (int32 0/1) for the rows marked ``active`` that hold a slot:
  with ``t = seq_lens[r]`` (the step's input token at position ``t - 1``), ``m = ngram`` and ``f =
  row_from[r]`` (the first position the slot's history holds; 0 when not given), an occurrence is a
  ``j`` with ``history[j - i] == history[t - 1 - i]`` for ``i < m``, ``j - m + 1 >= f`` and the
  follower ``j + 1`` in ``[n_sink, t - n_recent)`` (the selector's allowed set: what a fast step
  reads only if it was selected); a row whose last ``m`` tokens start before ``f`` is not active.
  ``out[r]`` is 1 when there are between 1 and ``max_matches`` occurrences (``max_matches`` 0: any
  number). A span that occurs once is one the model can only copy from there; a phrase that recurs
  all over the context (a repetitive haystack, boilerplate) needs no particular position. Grid
  ``(rows,)``, a loop over ``t - n_recent`` positions per row. With ``prev`` (int32 per slot,
  ``sfi.copy_once``) a row fires only at the first step of a run of copying steps: ``out = hit &
  ~prev[slot]``, and ``prev[slot] = hit`` for the active rows (that step's slow step reselects from
  the copying query, whose evidence points at the span's next token, and ``select_span`` brings the
  tokens after it).

Cost per decode row and step: ``m`` int32 reads per allowed position (``4 (t - n_recent)`` bytes
from memory, the rest cached) and one block-table entry per ``E`` positions, against a fast step's
``layers x 2 x H_kv x D x dtype`` bytes per retained token: about 0.1 % of a fast step's bytes at
8K on SmolLM2-135M (30 layers, 3 KV heads, D 64, bf16, 14 % retained). No host synchronisation and
no allocation in the kernels: the plan reads ``out``. Importable without vLLM.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.token_history import TokenHistory, as_token_history
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton

# record_tokens' positions per program: one size whatever the step (a decode row masks all but one
# lane; a prefill chunk of n tokens takes cdiv(n, RECORD_BLOCK) programs), so one compile key
RECORD_BLOCK = 256

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _hist_offset(TAB_ROW, pos, mask, E, BS, C, s_b, s_h, s_n):
        """The offset in the pages of position ``pos`` of the slot whose table row is ``TAB_ROW``
        (``vllm_ext.kernels.token_history``)."""
        blk = tl.load(TAB_ROW + pos // E, mask=mask, other=0).to(tl.int64)
        r = pos % E
        bsc = BS * C
        return blk * s_b + (r // bsc) * s_h + ((r % bsc) // C) * s_n + r % C

    @triton.jit(do_not_specialize=["n_ids"])
    def _record_kernel(PAGES, TAB, IDS, QSL, SEQ, HSLOT, n_ids, max_len, s_tab, E, BS, C, s_b, s_h, s_n,
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
        row = TAB + tl.maximum(slot, 0).to(tl.int64) * s_tab
        tl.store(PAGES + _hist_offset(row, pos, ok, E, BS, C, s_b, s_h, s_n), tok, mask=ok)

    @triton.jit
    def _match_kernel(PAGES, TAB, SEQ, HSLOT, FROM, ACTIVE, OUT, PREV, max_len, s_tab, E, BS, C, s_b, s_h,
                      s_n, n_sink, n_recent, max_matches, M: tl.constexpr, BLOCK: tl.constexpr,
                      ONCE: tl.constexpr, HAS_FROM: tl.constexpr):
        r = tl.program_id(0)
        t = tl.load(SEQ + r)
        slot = tl.load(HSLOT + r)
        first = tl.load(FROM + r) if HAS_FROM else 0
        act = (tl.load(ACTIVE + r) != 0) & (slot >= 0) & (t - M >= first) & (t <= max_len)
        row = TAB + tl.maximum(slot, 0).to(tl.int64) * s_tab
        # the occurrence's last position j: follower j + 1 in [n_sink, t - n_recent), j - M + 1 >= first
        j_lo = tl.maximum(tl.maximum(n_sink - 1, M - 1), first + M - 1)
        j_hi = tl.where(act, t - n_recent - 1, 0)
        hits = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(j_lo, j_hi, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < j_hi
            for i in tl.static_range(M):
                want = tl.load(PAGES + _hist_offset(row, t - 1 - i, act, E, BS, C, s_b, s_h, s_n))
                got = tl.load(PAGES + _hist_offset(row, j - i, ok, E, BS, C, s_b, s_h, s_n), mask=ok,
                              other=-1)
                ok = ok & (got == want)
            hits += ok.to(tl.int32)
        n = tl.sum(hits, 0)
        hit = (n > 0) & ((max_matches == 0) | (n <= max_matches))
        if ONCE:
            seen = tl.load(PREV + tl.maximum(slot, 0), mask=act, other=0) != 0
            tl.store(PREV + tl.maximum(slot, 0), hit.to(tl.int32), mask=act)
            hit = hit & (~seen)
        tl.store(OUT + r, hit.to(tl.int32))


def record_tokens_torch(history, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, row_hist_slot: torch.Tensor, max_q_len: int) -> None:
    """Write each row's input tokens at their positions into the history of slot
    ``row_hist_slot[r]`` (rows with slot -1 write nothing). ``max_q_len``: a host bound of the rows'
    query lengths. (Selects the written entries with a mask: a host synchronisation on CUDA, where
    the Triton kernel runs instead.)"""
    hist = as_token_history(history)
    rows = row_hist_slot.shape[0]
    if rows == 0 or max_q_len <= 0:
        return
    dev = hist.pages.device
    j = torch.arange(max_q_len, device=dev, dtype=torch.int64)[None, :]
    start = query_start_loc[:rows].long()[:, None]
    q_len = query_start_loc[1:rows + 1].long()[:, None] - start
    pos = seq_lens[:rows].long()[:, None] - q_len + j
    slot = row_hist_slot.long()[:, None].expand_as(pos)
    ok = (j < q_len) & (slot >= 0) & (pos >= 0) & (pos < hist.max_len) & (start + j < input_ids.shape[0])
    tok = input_ids[(start + j).clamp(0, max(input_ids.shape[0] - 1, 0))].to(torch.int32)
    hist.pages[hist.locate(slot[ok], pos[ok])] = tok[ok]


def copy_match_torch(history, seq_lens: torch.Tensor, row_hist_slot: torch.Tensor,
                     row_active: torch.Tensor, out: torch.Tensor, *, n_sink: int, n_recent: int,
                     ngram: int, max_matches: int = 0, prev: torch.Tensor | None = None,
                     row_from: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = 1`` where the row copies (module docstring), else 0; returns ``out``. ``prev``: the
    per-slot state of ``sfi.copy_once`` (updated in place); ``row_from``: each row's first recorded
    position (default 0)."""
    hist = as_token_history(history)
    rows = row_hist_slot.shape[0]
    max_len = hist.max_len
    m = int(ngram)
    t = seq_lens[:rows].long()
    slot = row_hist_slot.long()
    first = torch.zeros_like(t) if row_from is None else row_from[:rows].long()
    act = (row_active[:rows] != 0) & (slot >= 0) & (t - m >= first) & (t <= max_len)
    h = hist.read(slot.clamp(min=0))                                  # [rows, max_len]
    j = torch.arange(max_len, device=h.device)[None, :]
    ok = (act[:, None] & (j >= max(n_sink - 1, m - 1)) & (j >= (first + m - 1)[:, None])
          & (j < (t - n_recent - 1)[:, None]))
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


def _page_args(hist: TokenHistory) -> tuple:
    h, bs, c = hist.page_dims
    s_b, s_h, s_n, _ = hist.pages.stride()
    return hist.table.stride(0), hist.page_elems, bs, c, s_b, s_h, s_n


def record_tokens(history, input_ids, query_start_loc, seq_lens, row_hist_slot, max_q_len: int) -> None:
    """Triton on CUDA (or under the interpreter), else the twin: :func:`record_tokens_torch`."""
    hist = as_token_history(history)
    rows = row_hist_slot.shape[0]
    if not (HAS_TRITON and use_triton(hist.pages)):
        return record_tokens_torch(hist, input_ids, query_start_loc, seq_lens, row_hist_slot, max_q_len)
    if rows == 0 or max_q_len <= 0:
        return
    _record_kernel[(rows, triton.cdiv(max_q_len, RECORD_BLOCK))](
        hist.pages, hist.table, input_ids, query_start_loc, seq_lens, row_hist_slot, input_ids.shape[0],
        hist.max_len, *_page_args(hist), BLOCK=RECORD_BLOCK)


def copy_match(history, seq_lens, row_hist_slot, row_active, out, *, n_sink: int, n_recent: int,
               ngram: int, max_matches: int = 0, prev: torch.Tensor | None = None,
               row_from: torch.Tensor | None = None) -> torch.Tensor:
    """Triton on CUDA (or under the interpreter), else the twin: :func:`copy_match_torch`."""
    hist = as_token_history(history)
    if not (HAS_TRITON and use_triton(hist.pages)):
        return copy_match_torch(hist, seq_lens, row_hist_slot, row_active, out, n_sink=n_sink,
                                n_recent=n_recent, ngram=ngram, max_matches=max_matches, prev=prev,
                                row_from=row_from)
    rows = row_hist_slot.shape[0]
    if rows:
        _match_kernel[(rows,)](hist.pages, hist.table, seq_lens, row_hist_slot,
                               row_from if row_from is not None else seq_lens, row_active, out,
                               prev if prev is not None else out, hist.max_len, *_page_args(hist),
                               int(n_sink), int(n_recent), int(max_matches), M=int(ngram), BLOCK=512,
                               ONCE=prev is not None, HAS_FROM=row_from is not None)
    return out
