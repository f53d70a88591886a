"""SFI slow step: dense paged decode attention plus the selector's evidence, and the dense baseline.

``dense_decode_with_evidence`` computes, per batch row (one decode query per row):

* ``out``: dense causal attention of each query head over all ``seq_lens[r]`` cached positions;
* ``log_evidence [R, Hkv, max_len]`` (fp32): for each KV head ``h``, the power-mean pooled evidence
  of its G query heads over the allowed set ``A = [allowed_lo[r], allowed_hi[r])`` (clamped to
  ``[0, min(seq_len, max_len))``)::

      p_g(j)   = softmax_{j in A}(q_g . k_j * scale)
      log f(j) = (logsumexp_g(alpha * log p_g(j)) - log G) / alpha      (alpha > 0)
      log f(j) = mean_g log p_g(j)                                         (alpha == 0, geometric)

  un-normalised; ``-inf`` at the columns of ``[0, min(seq_len, max_len))`` outside ``A``; columns
  past the row's own length are not touched (work follows each row's length, not ``max_len``).

With ``evidence_rows`` (compact mode, the SFI decode path) the launch covers a compacted list of rows
(the step's slow rows) instead of the batch, each entry's evidence goes to its own slot, and
``key_norms`` (when given) receives ``||k_j||`` from the same pass over K, so the selector's prior
needs no second gather of K.

One pass over K/V (split-K, online softmax) writes the partial outputs, the raw scores of the G
heads into a scratch ``[R, Hq, max_len]`` fp32 and per-split LSEs over ``A``; a cheap second pass
over the scores (``Hq * 4`` bytes per position instead of ``2 * Hkv * D * dtype`` bytes of KV) turns
them into the evidence. ``max_len = log_evidence.shape[-1]`` must be ``>= max(seq_lens)`` for the
evidence to cover the whole history (positions beyond it are attended to but get no evidence).

``paged_decode`` is the same kernel without evidence: the strong dense paged decode used as the
benchmark baseline and as the CUDA dense path.

``prefill_evidence`` is the prefill-end variant: ``W`` query rows per request (the last W prompt
queries), each with its own causal limit ``query_positions``, pooled into one ``G * W`` power mean
(``log(G * W_valid)`` normaliser, where ``W_valid`` counts queries with position ``>= 0``). Two
Triton launches (:mod:`vllm_ext.kernels.prefill_evidence`) or the chunked PyTorch twin (runs once
per request and layer at the end of its prefill, eagerly).

A row is active iff ``row_mask[r] != 0`` (when given) and ``seq_lens[r] > 0``; inactive rows are
untouched (``out`` and ``log_evidence``). No host synchronisation; pass a workspace to avoid
allocation.

fp8 pages (``kernels.kv_quant``): every op takes the layer's ``k_scale`` / ``v_scale``; the scores,
hence the evidence, and ``key_norms`` are of the dequantised keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.merge_state import launch_merge_states
from vllm_ext.kernels.prefill_evidence import fill_past_span, prefill_evidence_triton
from vllm_ext.kernels.triton_utils import (HAS_TRITON, autotune, dot_in_fp32, fixed_meta,
                                           launch_meta, next_pow2, num_sms, untuned, use_triton)
from vllm_ext.kernels.two_segment_decode import (LOG2E, SplitWorkspace, _configs, active_rows,
                                                 batched_masked_attention, dense_num_splits,
                                                 gather_paged_prefix, gather_paged_rows, live_length,
                                                 two_segment_workspace)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.program_rows import program_row
    from vllm_ext.kernels.two_segment_decode import (_kv_scale_factors, _load_group_q, _online_update,
                                                     _paged_kv_scores, _store_state)

    @triton.jit
    def _dense_split_body(e, row, h, split, seq_len, Q, KV, BT, LO, HI, PO, PLSE, PLSEA, SC, KN, OUT, KS, VS,
        s_q_r, s_q_h, s_q_d,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_po_r, s_po_s, s_po_h, s_po_d,
        s_pl_r, s_pl_s, s_pl_h,
        s_pa_r, s_pa_s, s_pa_h,
        s_sc_r, s_sc_h, s_sc_j,
        s_kn_r, s_kn_h, s_kn_j,
        s_o_r, s_o_h, s_o_d,
        MAX_LEN, qk_scale, NUM_SPLITS,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, F32_DOT: tl.constexpr, DIRECT: tl.constexpr, EVIDENCE: tl.constexpr,
        NORMS: tl.constexpr, KV_SCALED: tl.constexpr, BLOCK_N: tl.constexpr):
        # one (program row e -> batch row ``row``, KV head, split) of the split-K pass; partial
        # states and evidence are indexed by e, the output by the batch row
        qk_scale, vsc = _kv_scale_factors(qk_scale, KS, VS, KV_SCALED)
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)

        q = _load_group_q(Q, row, h, s_q_r, s_q_h, s_q_d, G, BLOCK_G, D, BLOCK_D)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        offs_g = tl.arange(0, BLOCK_G)
        gm = offs_g < G
        heads = h * G + offs_g
        if EVIDENCE:
            lo = tl.maximum(tl.load(LO + row), 0)
            hi = tl.minimum(tl.minimum(tl.load(HI + row), seq_len), MAX_LEN)
            ma_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            la_i = tl.zeros([BLOCK_G], dtype=tl.float32)
            sc_base = SC + e.to(tl.int64) * s_sc_r + heads[:, None].to(tl.int64) * s_sc_h
            kn_base = KN + e.to(tl.int64) * s_kn_r + h.to(tl.int64) * s_kn_h

        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < end
            k, v, s = _paged_kv_scores(q, KV, BT, row, h, pos, valid, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                                       qk_scale, D, BLOCK_D, PAGE, F32_DOT)
            if EVIDENCE:
                keep = valid & (pos < MAX_LEN)
                tl.store(sc_base + pos[None, :].to(tl.int64) * s_sc_j, s,
                         mask=gm[:, None] & keep[None, :])
                if NORMS:
                    # ||k_j|| from the K this pass reads anyway (the selector's prior)
                    kf = k.to(tl.float32)
                    kn = tl.sqrt(tl.sum(kf * kf, 1))
                    if KV_SCALED:
                        kn = kn * tl.load(KS)
                    tl.store(kn_base + pos.to(tl.int64) * s_kn_j, kn, mask=keep)
                in_a = valid & (pos >= lo) & (pos < hi)
                sa = tl.where(in_a[None, :], s, float("-inf"))
                ma_new = tl.maximum(ma_i, tl.max(sa, 1))
                ma_safe = tl.where(ma_new == float("-inf"), 0.0, ma_new)
                la_i = la_i * tl.exp2(ma_i - ma_safe) + tl.sum(tl.exp2(sa - ma_safe[:, None]), 1)
                ma_i = ma_new
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, F32_DOT)

        _store_state(acc, m_i, l_i, vsc, e, row, h, split, PO, PLSE, OUT,
                     s_po_r, s_po_s, s_po_h, s_po_d, s_pl_r, s_pl_s, s_pl_h,
                     s_o_r, s_o_h, s_o_d, G, BLOCK_G, D, BLOCK_D, DIRECT)
        if EVIDENCE:
            # per-split LSE over A, in log2 units (internal scratch, indexed by the evidence slot)
            ma_safe = tl.where(ma_i == float("-inf"), 0.0, ma_i)
            lsea = tl.where(la_i > 0, ma_safe + tl.log2(tl.where(la_i > 0, la_i, 1.0)),
                            float("-inf"))
            tl.store(PLSEA + e.to(tl.int64) * s_pa_r + split * s_pa_s + heads * s_pa_h, lsea,
                     mask=gm)

    @autotune(configs=_configs(), key=["G", "D", "NUM_SPLITS", "PAGE", "DIRECT", "EVIDENCE",
                                        "COMPACT", "NORMS"])
    @triton.jit
    def _dense_split_kernel(
        Q, KV, BT, SEQ, LO, HI, MASK, ROWS, PO, PLSE, PLSEA, SC, KN, OUT, KS, VS,
        s_q_r, s_q_h, s_q_d,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_po_r, s_po_s, s_po_h, s_po_d,
        s_pl_r, s_pl_s, s_pl_h,
        s_pa_r, s_pa_s, s_pa_h,
        s_sc_r, s_sc_h, s_sc_j,
        s_kn_r, s_kn_h, s_kn_j,
        s_o_r, s_o_h, s_o_d,
        MAX_LEN, qk_scale, NUM_SPLITS,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, HAS_MASK: tl.constexpr,
        F32_DOT: tl.constexpr, DIRECT: tl.constexpr, EVIDENCE: tl.constexpr,
        COMPACT: tl.constexpr, NORMS: tl.constexpr, KV_SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # program row e: batch row ROWS[e] in compact mode (the slow-row list), else row e
        e = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        row, seq_len = program_row(e, ROWS, MASK, SEQ, COMPACT, HAS_MASK, True)
        if seq_len <= 0:
            return
        _dense_split_body(
            e, row, h, split, seq_len, Q, KV, BT, LO, HI, PO, PLSE, PLSEA, SC, KN, OUT, KS, VS,
            s_q_r, s_q_h, s_q_d, s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b,
            s_po_r, s_po_s, s_po_h, s_po_d, s_pl_r, s_pl_s, s_pl_h, s_pa_r, s_pa_s, s_pa_h,
            s_sc_r, s_sc_h, s_sc_j, s_kn_r, s_kn_h, s_kn_j, s_o_r, s_o_h, s_o_d,
            MAX_LEN, qk_scale, NUM_SPLITS, G, BLOCK_G, D, BLOCK_D, PAGE, F32_DOT, DIRECT, EVIDENCE,
            NORMS, KV_SCALED, BLOCK_N)

    @triton.jit
    def _dense_split_persistent_kernel(
        COUNT, SEQ, ROWS, Q, KV, BT, LO, HI, PO, PLSE, PLSEA, SC, KN, OUT, KS, VS,
        s_q_r, s_q_h, s_q_d,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_po_r, s_po_s, s_po_h, s_po_d,
        s_pl_r, s_pl_s, s_pl_h,
        s_pa_r, s_pa_s, s_pa_h,
        s_sc_r, s_sc_h, s_sc_j,
        s_kn_r, s_kn_h, s_kn_j,
        s_o_r, s_o_h, s_o_d,
        MAX_LEN, qk_scale, NUM_SPLITS,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, F32_DOT: tl.constexpr, DIRECT: tl.constexpr, EVIDENCE: tl.constexpr,
        NORMS: tl.constexpr, KV_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, HKV: tl.constexpr,
    ):
        # compact mode with the live-entry count on the device: a fixed grid of programs walks the
        # (entry, KV head, split) items of the live entries only, so a step without slow rows
        # costs one small wave instead of S x Hkv x splits programs
        count = tl.load(COUNT)
        per_entry = HKV * NUM_SPLITS
        for item in range(tl.program_id(0), count * per_entry, tl.num_programs(0)):
            e = item // per_entry
            h = (item % per_entry) // NUM_SPLITS
            split = item % NUM_SPLITS
            row = tl.load(ROWS + e)
            seq_len = tl.load(SEQ + row)
            _dense_split_body(
                e, row, h, split, seq_len, Q, KV, BT, LO, HI, PO, PLSE, PLSEA, SC, KN, OUT, KS, VS,
            s_q_r, s_q_h, s_q_d, s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b,
            s_po_r, s_po_s, s_po_h, s_po_d, s_pl_r, s_pl_s, s_pl_h, s_pa_r, s_pa_s, s_pa_h,
            s_sc_r, s_sc_h, s_sc_j, s_kn_r, s_kn_h, s_kn_j, s_o_r, s_o_h, s_o_d,
            MAX_LEN, qk_scale, NUM_SPLITS, G, BLOCK_G, D, BLOCK_D, PAGE, F32_DOT, DIRECT, EVIDENCE,
            NORMS, KV_SCALED, BLOCK_N)

    @triton.jit
    def _evidence_kernel(
        SEQ, LO, HI, MASK, ROWS, PLSEA, SC, EV,
        s_pa_r, s_pa_s, s_pa_h,
        s_sc_r, s_sc_h, s_sc_j,
        s_ev_r, s_ev_h, s_ev_j,
        MAX_LEN, alpha, log_g, NUM_SPLITS, NUM_JP,
        G: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr, HAS_MASK: tl.constexpr, COMPACT: tl.constexpr,
        GEOMETRIC: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        # one program per (evidence slot, KV head, position lane); each lane walks the row's own
        # length [0, min(seq_len, MAX_LEN)) in BLOCK_J steps, NUM_JP lanes apart
        slot = tl.program_id(0)
        h = tl.program_id(1)
        lane = tl.program_id(2)
        row, seq_len = program_row(slot, ROWS, MASK, SEQ, COMPACT, HAS_MASK, True)
        if seq_len <= 0:
            return
        lim = tl.minimum(seq_len, MAX_LEN)
        lo = tl.maximum(tl.load(LO + row), 0)
        hi = tl.minimum(tl.load(HI + row), lim)
        offs_g = tl.arange(0, BLOCK_G)
        gm = offs_g < G
        heads = h * G + offs_g
        # merge the per-split LSEs over A (log2 units)
        offs_s = tl.arange(0, BLOCK_S)
        pa = tl.load(PLSEA + slot.to(tl.int64) * s_pa_r + offs_s[None, :] * s_pa_s
                     + heads[:, None] * s_pa_h,
                     mask=gm[:, None] & (offs_s < NUM_SPLITS)[None, :], other=float("-inf"))
        pm = tl.max(pa, 1)
        pm_safe = tl.where(pm == float("-inf"), 0.0, pm)
        lse_a = pm_safe + tl.log2(tl.maximum(tl.sum(tl.exp2(pa - pm_safe[:, None]), 1), 1e-30))
        lse_a = tl.where(gm, lse_a, 0.0)
        ev_row = EV + slot.to(tl.int64) * s_ev_r + h * s_ev_h
        sc_row = SC + slot.to(tl.int64) * s_sc_r + heads[:, None].to(tl.int64) * s_sc_h
        for jb in range(lane, tl.cdiv(lim, BLOCK_J), NUM_JP):
            offs_j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
            jm = offs_j < lim
            in_a = (offs_j >= lo) & (offs_j < hi)
            ev_ptr = ev_row + offs_j.to(tl.int64) * s_ev_j
            if (jb * BLOCK_J >= hi) | ((jb + 1) * BLOCK_J <= lo):
                tl.store(ev_ptr, tl.full([BLOCK_J], float("-inf"), tl.float32), mask=jm)
            else:
                m2 = gm[:, None] & (in_a & jm)[None, :]
                s = tl.load(sc_row + offs_j[None, :].to(tl.int64) * s_sc_j, mask=m2, other=0.0)
                logp = (s - lse_a[:, None]) * 0.6931471805599453           # natural log p_g(j)
                if GEOMETRIC:
                    lf = tl.sum(tl.where(gm[:, None], logp, 0.0), 0) / G
                else:
                    a = tl.where(gm[:, None], alpha * logp, float("-inf"))
                    am = tl.max(a, 0)
                    am_safe = tl.where(am == float("-inf"), 0.0, am)
                    lse = am_safe + tl.log(tl.sum(tl.exp(a - am_safe[None, :]), 0))
                    lf = (lse - log_g) / alpha
                lf = tl.where(in_a, lf, float("-inf"))
                tl.store(ev_ptr, lf, mask=jm)


def _interp_meta() -> dict:
    return launch_meta({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, {"BLOCK_N": 32})


# ----------------------------------------------------------------------------------------------
# Workspace
# ----------------------------------------------------------------------------------------------

@dataclass
class DenseWorkspace:
    """Scratch of the dense split-K decode: ``split`` (partial outputs/LSEs, any ``R * S`` up to its
    capacity) and, with evidence, per evidence slot the raw scores ``[E, Hq, max_len]`` and the
    per-split LSEs over ``A`` ``[E, max_splits, Hq]`` (log2 units)."""
    split: SplitWorkspace
    partial_lse_allowed: torch.Tensor | None = None
    scores: torch.Tensor | None = None

    def fits(self, num_rows, num_heads, head_size, num_splits, max_len=None, evidence_rows=None
             ) -> bool:
        ok = self.split.fits(num_rows, num_heads, head_size, num_splits)
        if max_len is not None:
            e = num_rows if evidence_rows is None else evidence_rows
            ok = ok and self.scores is not None and self.scores.shape[0] >= e \
                and self.scores.shape[2] >= max_len and self.partial_lse_allowed.shape[1] >= num_splits
        return ok

    @property
    def nbytes(self) -> int:
        n = self.split.nbytes
        for t in (self.partial_lse_allowed, self.scores):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


def dense_decode_workspace(num_rows: int, num_heads: int, head_size: int, num_splits: int,
                           device, *, max_len: int | None = None, evidence_rows: int | None = None,
                           row_splits: int | None = None) -> DenseWorkspace:
    """Allocate once. ``max_len`` (the evidence length) adds the evidence scratch for
    ``evidence_rows`` slots (default ``num_rows``); ``row_splits`` sizes the split scratch for any
    ``R * S <= row_splits`` (default ``num_rows * num_splits``)."""
    s = max(int(num_splits), 1)
    ws = DenseWorkspace(two_segment_workspace(num_rows, num_heads, head_size, s, device,
                                              row_splits=row_splits))
    if max_len is not None:
        e = int(num_rows if evidence_rows is None else evidence_rows)
        ws.partial_lse_allowed = torch.empty((e, s, num_heads), dtype=torch.float32, device=device)
        ws.scores = torch.empty((e, num_heads, max_len), dtype=torch.float32, device=device)
    return ws


# ----------------------------------------------------------------------------------------------
# Triton launcher
# ----------------------------------------------------------------------------------------------

EVIDENCE_LANES = 16          # position lanes per (evidence slot, KV head) of the evidence pass
PERSISTENT_WAVES = 2         # programs per SM of the count-driven slow pass
# tiles of launches whose work is decided on the device (not autotuned: triton_utils.untuned):
# masked / compact launches, and the count-driven slow pass; bench/tune_fixed_tiles.py sweeps them
FIXED_META = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
SLOW_PASS_META = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def _launch_dense(query, kv_cache, block_table, seq_lens, scale, out, row_mask, num_splits,
                  workspace, allowed_lo=None, allowed_hi=None, log_evidence=None, alpha=0.5,
                  evidence_rows=None, key_norms=None, evidence_count=None, k_scale=None, v_scale=None):
    hq, d = query.shape[1], query.shape[2]
    hkv = kv_cache.shape[1]
    assert kv_cache.shape[-1] == 2 * d and hq % hkv == 0
    g = hq // hkv
    compact = evidence_rows is not None
    # program rows: the compacted entries (compact mode) or the batch rows
    num_rows = evidence_rows.shape[0] if compact else query.shape[0]
    if num_rows == 0 or query.shape[0] == 0:
        return out
    evidence = log_evidence is not None
    max_len = log_evidence.shape[-1] if evidence else 0
    if num_splits is None:
        # compact mode: typically one or two live entries, so split as for a single row (dead
        # entries' programs exit at once)
        num_splits = dense_num_splits(1 if compact else num_rows, hkv,
                                      block_table.shape[1] * kv_cache.shape[2], query.device)
    num_splits = int(num_splits)
    direct = num_splits == 1
    need_ws = (not direct) or evidence
    if need_ws and (workspace is None
                    or not workspace.fits(num_rows, hq, d, num_splits,
                                          max_len if evidence else None, num_rows)):
        workspace = dense_decode_workspace(num_rows, hq, d, num_splits, query.device,
                                           max_len=max_len if evidence else None)
    if direct:
        po, pl, po_st, pl_st = out, out, (0, 0, 0, 0), (0, 0, 0)
    else:
        po, pl = workspace.split.views(num_rows, num_splits)
        po_st, pl_st = po.stride(), pl.stride()
    if evidence:
        pa = workspace.partial_lse_allowed[:num_rows, :num_splits]
        sc = workspace.scores[:num_rows]
        pa_st, sc_st = pa.stride(), sc.stride()
        lo, hi = allowed_lo, allowed_hi
    else:
        pa, sc, pa_st, sc_st = out, out, (0, 0, 0), (0, 0, 0)
        lo = hi = seq_lens
    norms = key_norms is not None
    kn, kn_st = (key_norms, key_norms.stride()) if norms else (out, (0, 0, 0))
    has_mask = row_mask is not None
    mask_arg = row_mask if has_mask else seq_lens
    rows_arg = evidence_rows if compact else seq_lens
    strides = (*query.stride(), *kv_cache.stride(), *block_table.stride(),
               *po_st, *pl_st, *pa_st, *sc_st, *kn_st, *out.stride())
    ks, vs, kv_scaled = kv_quant.launch_scales(kv_cache.dtype, k_scale, v_scale, out)
    meta = dict(G=g, BLOCK_G=max(16, next_pow2(g)), D=d, BLOCK_D=max(16, next_pow2(d)),
                PAGE=kv_cache.shape[2], F32_DOT=dot_in_fp32(kv_cache.dtype, query.dtype), DIRECT=direct,
                EVIDENCE=evidence, NORMS=norms, KV_SCALED=kv_scaled)
    if compact and evidence_count is not None and not has_mask:
        progs = min(num_rows * hkv * num_splits, PERSISTENT_WAVES * num_sms(query.device))
        _dense_split_persistent_kernel[(max(progs, 1),)](
            evidence_count, seq_lens, rows_arg, query, kv_cache, block_table, lo, hi,
            po, pl, pa, sc, kn, out, ks, vs, *strides, max_len, float(scale) * LOG2E, num_splits,
            HKV=hkv, **meta, **fixed_meta(SLOW_PASS_META, {"BLOCK_N": 32}))
    else:
        # work decided on the device (a mask, a compacted list): no autotuning (triton_utils.untuned)
        device_decided = has_mask or compact
        kernel = untuned(_dense_split_kernel) if device_decided else _dense_split_kernel
        tile = fixed_meta(FIXED_META, {"BLOCK_N": 32}) if device_decided else _interp_meta()
        kernel[(num_rows, hkv, num_splits)](
            query, kv_cache, block_table, seq_lens, lo, hi, mask_arg, rows_arg,
            po, pl, pa, sc, kn, out, ks, vs, *strides, max_len, float(scale) * LOG2E, num_splits,
            HAS_MASK=has_mask, COMPACT=compact, **meta, **tile)
    if not direct:
        launch_merge_states(po, pl, out, None, row_mask=row_mask, row_lens=seq_lens,
                            out_rows=evidence_rows)
    if evidence:
        block_j = 128 if max_len >= 128 else max(16, next_pow2(max_len))
        geometric = float(alpha) == 0.0
        lanes = max(1, min(EVIDENCE_LANES, triton.cdiv(max_len, block_j)))
        _evidence_kernel[(num_rows, hkv, lanes)](
            seq_lens, allowed_lo, allowed_hi, mask_arg, rows_arg, pa, sc, log_evidence,
            *pa_st, *sc_st, *log_evidence.stride(),
            max_len, float(alpha) if not geometric else 1.0, math.log(g), num_splits, lanes,
            G=g, BLOCK_G=next_pow2(g),
            BLOCK_S=next_pow2(num_splits), HAS_MASK=has_mask, COMPACT=compact,
            GEOMETRIC=geometric, BLOCK_J=block_j)
    return out


# ----------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------

def paged_decode(query, kv_cache, block_table, seq_lens, scale, out, row_mask=None, *,
                 num_splits=None, workspace=None, k_scale=None, v_scale=None):
    """Dense paged decode (one query per row over all ``seq_lens[r]`` positions), split-K."""
    if not use_triton(query):
        return paged_decode_torch(query, kv_cache, block_table, seq_lens, scale, out, row_mask,
                                  num_splits=num_splits, workspace=workspace, k_scale=k_scale,
                                  v_scale=v_scale)
    return _launch_dense(query, kv_cache, block_table, seq_lens, scale, out, row_mask,
                         num_splits, workspace, k_scale=k_scale, v_scale=v_scale)


def _check_evidence_args(query, kv_cache, log_evidence, evidence_rows, key_norms):
    assert log_evidence.dtype == torch.float32 and log_evidence.shape[1] == kv_cache.shape[1]
    if evidence_rows is None:
        assert log_evidence.shape[0] == query.shape[0]
    else:
        assert evidence_rows.shape[0] == log_evidence.shape[0]
    if key_norms is not None:
        assert key_norms.dtype == torch.float32 and key_norms.shape == log_evidence.shape


def dense_decode_with_evidence(query, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi,
                               scale, out, log_evidence, row_mask=None, alpha=0.5, *,
                               num_splits=None, workspace=None, evidence_rows=None, key_norms=None,
                               evidence_count=None, k_scale=None, v_scale=None):
    """Slow-step decode: dense ``out`` and ``log_evidence [E, Hkv, max_len]`` (see module doc).

    Without ``evidence_rows`` every active row ``r`` is attended and gets evidence in
    ``log_evidence[r]`` (``E = R``). With it (int32 ``[E]``, compact mode: the step's slow rows,
    -1 = unused entry) only those rows are attended, ``out[evidence_rows[e]]`` written and their
    evidence put in ``log_evidence[e]``; the launch covers the ``E`` entries, not the batch, and
    splits as for one row (dead entries exit at once). ``key_norms`` (fp32, the shape of
    ``log_evidence``) receives ``||k_j||`` of the evidence rows from the same pass over K. ``out``
    None (the PyTorch twin only: the CPU build without its compiled kernels, whose dense pass then
    attends the slow rows): evidence and key norms only."""
    _check_evidence_args(query, kv_cache, log_evidence, evidence_rows, key_norms)
    if out is None and use_triton(query):
        raise ValueError("dense_decode_with_evidence: the Triton kernel writes the output (out=None "
                         "is the PyTorch twin's evidence-only pass)")
    if not use_triton(query):
        return dense_decode_with_evidence_torch(query, kv_cache, block_table, seq_lens, allowed_lo,
                                                allowed_hi, scale, out, log_evidence, row_mask,
                                                alpha, num_splits=num_splits, workspace=workspace,
                                                evidence_rows=evidence_rows, key_norms=key_norms,
                                                evidence_count=evidence_count, k_scale=k_scale,
                                                v_scale=v_scale)
    return _launch_dense(query, kv_cache, block_table, seq_lens, scale, out, row_mask,
                         num_splits, workspace, allowed_lo, allowed_hi, log_evidence, alpha,
                         evidence_rows, key_norms, evidence_count, k_scale, v_scale)


# ----------------------------------------------------------------------------------------------
# PyTorch twins
# ----------------------------------------------------------------------------------------------

def _dense_scores_torch(query, kv_cache, block_table, length, scale, k_scale=None, v_scale=None):
    """Positions ``[0, length)`` of every row: K/V gathered (fp32, fp8 dequantised) and fp32 scores
    ``[R, Hq, length]``."""
    r, hq, d = query.shape
    k, v = _dequantized_prefix(kv_cache, block_table, length, k_scale, v_scale)
    hkv = k.shape[1]
    q = query.float().reshape(r, hkv, hq // hkv, d)
    s = torch.einsum("rhgd,rhnd->rhgn", q, k).reshape(r, hq, length) * scale
    return s, k, v


def _dequantized_prefix(kv_cache, block_table, length, k_scale, v_scale):
    k, v = gather_paged_prefix(kv_cache, block_table, length)
    return (kv_quant.dequantize(k, kv_quant.twin_scale(kv_cache.dtype, k_scale)),
            kv_quant.dequantize(v, kv_quant.twin_scale(kv_cache.dtype, v_scale)))


def paged_decode_torch(query, kv_cache, block_table, seq_lens, scale, out, row_mask=None, *,
                       num_splits=None, workspace=None, k_scale=None, v_scale=None):
    del num_splits, workspace
    r = query.shape[0]
    if r == 0:
        return out
    length = live_length(seq_lens, block_table, kv_cache.shape[2])
    k, v = _dequantized_prefix(kv_cache, block_table, length, k_scale, v_scale)
    mask = torch.arange(length, device=query.device)[None, :] < seq_lens.long()[:, None]
    o, _ = batched_masked_attention(query, k, v, mask, scale)
    act = active_rows(seq_lens, row_mask)
    out.copy_(torch.where(act[:, None, None], o.to(out.dtype), out))
    return out


def _pool_evidence(logp: torch.Tensor, in_a: torch.Tensor, alpha: float, n_rows: torch.Tensor
                   ) -> torch.Tensor:
    """``logp [R, Hkv, M, L]`` (M pooled rows per KV head, ``-inf`` where p = 0 or invalid) ->
    power-mean log evidence ``[R, Hkv, L]``; ``n_rows`` ``[R]`` is the count M actually pooled."""
    lognr = torch.log(n_rows.float().clamp_min(1.0))[:, None, None]
    if alpha == 0.0:
        lf = logp.sum(dim=2) / n_rows.float().clamp_min(1.0)[:, None, None]
    else:
        lf = (torch.logsumexp(alpha * logp, dim=2) - lognr) / alpha
    return torch.where(in_a, lf, torch.full_like(lf, float("-inf")))


def dense_decode_with_evidence_torch(query, kv_cache, block_table, seq_lens, allowed_lo,
                                     allowed_hi, scale, out, log_evidence, row_mask=None,
                                     alpha=0.5, *, num_splits=None, workspace=None,
                                     evidence_rows=None, key_norms=None, evidence_count=None,
                                     k_scale=None, v_scale=None):
    """PyTorch twin of :func:`dense_decode_with_evidence` (fp32, no row loop); on the CPU
    :func:`dense_decode_with_evidence_cpu` (the same values up to summation order)."""
    del num_splits, workspace, evidence_count      # live entries are the ones with a row >= 0
    r_all = query.shape[0]
    if r_all == 0:
        return out
    if query.device.type == "cpu":
        return dense_decode_with_evidence_cpu(query, kv_cache, block_table, seq_lens, allowed_lo,
                                              allowed_hi, scale, out, log_evidence, row_mask, alpha,
                                              evidence_rows=evidence_rows, key_norms=key_norms,
                                              native=True, k_scale=k_scale, v_scale=v_scale)
    return dense_decode_with_evidence_batched(query, kv_cache, block_table, seq_lens, allowed_lo,
                                              allowed_hi, scale, out, log_evidence, row_mask, alpha,
                                              evidence_rows=evidence_rows, key_norms=key_norms,
                                              k_scale=k_scale, v_scale=v_scale)


def dense_decode_with_evidence_cpu(query, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi,
                                   scale, out, log_evidence, row_mask=None, alpha=0.5, *,
                                   evidence_rows=None, key_norms=None, native=False, k_scale=None,
                                   v_scale=None):
    """The twin on the CPU, where reading lengths costs nothing: per live entry, its row's blocks
    gathered and converted to fp32 as K transposed (and V when ``out`` is given;
    :func:`gather_prefix_kt_into`: contiguous matmuls), the scores of its G query heads per KV head
    by one matmul, then output, evidence over ``A`` (on the allowed span only) and ``||k||`` from
    those scores and that K. The batched form pads every row to the longest and converts K/V
    piecewise: 2-4x slower at 2K on the real model's slow steps. ``native`` (the CPU build's
    dispatch): on ``CPU_ATTN``'s packed pages every entry goes to the compiled kernel in one call
    (:func:`vllm_ext.kernels.cpu_native.evidence`, the same values up to summation order) when it
    applies. fp8 pages: ``k_scale`` folded into the score scale and the key norms, ``v_scale`` into
    the output."""
    from vllm_ext.kernels import cpu_native
    from vllm_ext.kernels.packed_pages import PackedPages
    from vllm_ext.kernels.paged_reference import _scratch_buffer, gather_prefix_kt_into

    r_all, hq, d = query.shape
    hkv = kv_cache.shape[1]
    g = hq // hkv
    max_len = log_evidence.shape[-1]
    ks = kv_quant.host_scale(kv_cache.dtype, k_scale)
    vs = kv_quant.host_scale(kv_cache.dtype, v_scale)
    native = native and isinstance(kv_cache, PackedPages)
    if native:
        rows = (torch.arange(r_all, dtype=torch.int32) if evidence_rows is None
                else evidence_rows.to(torch.int32))
        if row_mask is not None:
            rows = torch.where(row_mask.bool()[rows.long().clamp(0, r_all - 1)], rows, -1)
        if cpu_native.evidence(query, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi, rows, scale,
                               alpha, log_evidence, key_norms, out, k_scale=ks, v_scale=vs):
            return out
    seqs, los, his = seq_lens.tolist(), allowed_lo.tolist(), allowed_hi.tolist()
    on = [True] * r_all if row_mask is None else [bool(m) for m in row_mask.tolist()]
    if evidence_rows is None:
        pairs = list(enumerate(range(r_all)))
    else:
        pairs = [(e, r) for e, r in enumerate(evidence_rows.tolist()) if 0 <= r < r_all]
    log_g = math.log(g)
    for e, r in pairs:
        seq = int(seqs[r])
        if seq <= 0 or not on[r]:
            continue
        lim = min(seq, max_len)
        lo, hi = max(int(los[r]), 0), min(int(his[r]), lim)
        kt, v = gather_prefix_kt_into(kv_cache, block_table[r], seq, torch.float32,
                                      values=out is not None)                         # [Hkv, D, seq]
        q = query[r].float().view(hkv, g, d)
        s = torch.bmm(q, kt).mul_(scale * ks)                                       # [Hkv, G, seq]
        if out is not None:
            o = torch.bmm(torch.softmax(s, dim=-1), v)
            out[r] = (o.mul_(vs) if vs != 1.0 else o).reshape(hq, d).to(out.dtype)
        ev = log_evidence[e]
        if hi > lo:
            ev[:, :lo].fill_(float("-inf"))
            ev[:, hi:lim].fill_(float("-inf"))
            # log p over A and the power mean over the group, in place on the span's (finite)
            # scores: no infinity handling, a third of torch.logsumexp's passes
            sa = s[..., lo:hi]
            sa.sub_(sa.amax(dim=-1, keepdim=True))
            logp = sa.sub_(sa.exp().sum(dim=-1, keepdim=True).log_())                # [Hkv, G, n]
            if alpha == 0.0:
                torch.sum(logp, dim=1, out=ev[:, lo:hi]).div_(g)
            else:
                logp.mul_(alpha)
                m = logp.amax(dim=1, keepdim=True)
                pooled = logp.sub_(m).exp_().sum(dim=1).log_().add_(m[:, 0])
                torch.sub(pooled, log_g, out=ev[:, lo:hi]).div_(alpha)
        else:
            ev[:, :lim].fill_(float("-inf"))
        if key_norms is not None:
            # sum over D as a matmul: a norm over K^T's middle dimension is 10x slower on the CPU
            ktl = kt[:, :, :lim]
            sq = _scratch_buffer(ktl.numel(), torch.float32, ktl.device, tag="kt_sq").view(ktl.shape)
            torch.mul(ktl, ktl, out=sq)
            torch.sqrt(torch.bmm(kt.new_ones(hkv, 1, d), sq).view(hkv, lim), out=key_norms[e, :, :lim])
            if ks != 1.0:
                key_norms[e, :, :lim].mul_(ks)
    return out


def dense_decode_with_evidence_batched(query, kv_cache, block_table, seq_lens, allowed_lo,
                                       allowed_hi, scale, out, log_evidence, row_mask=None,
                                       alpha=0.5, *, evidence_rows=None, key_norms=None, k_scale=None,
                                       v_scale=None):
    """The twin's batched form (every row padded to the longest; no host sync off the CPU)."""
    r_all = query.shape[0]
    if r_all == 0:
        return out
    if evidence_rows is None:
        src = torch.arange(r_all, device=query.device)
        live = torch.ones(r_all, dtype=torch.bool, device=query.device)
    else:
        src = evidence_rows.long().clamp(0, r_all - 1)
        live = (evidence_rows >= 0) & (evidence_rows < r_all)
        if query.device.type == "cpu" and not bool(live.all()):
            # the CPU reads the live entries for free: compute those only (the list has S entries)
            ent = torch.nonzero(live).flatten()
            if ent.numel():
                sub_ev = log_evidence[ent]
                sub_kn = key_norms[ent] if key_norms is not None else None
                dense_decode_with_evidence_batched(query, kv_cache, block_table, seq_lens,
                                                   allowed_lo, allowed_hi, scale, out, sub_ev,
                                                   row_mask, alpha, evidence_rows=evidence_rows[ent],
                                                   key_norms=sub_kn, k_scale=k_scale, v_scale=v_scale)
                log_evidence[ent] = sub_ev
                if key_norms is not None:
                    key_norms[ent] = sub_kn
            return out
    r, hq, d = src.shape[0], query.shape[1], query.shape[2]
    if r == 0:
        return out
    hkv = kv_cache.shape[1]
    g = hq // hkv
    max_len = log_evidence.shape[-1]
    length = live_length(seq_lens, block_table, kv_cache.shape[2])
    q = query[src]
    s, k, v = _dense_scores_torch(q, kv_cache, block_table[src], length, scale, k_scale,
                                  v_scale)                                          # [E, Hq, L]
    seq = seq_lens.long()[src]
    pos = torch.arange(length, device=query.device)
    vis = pos[None, :] < seq[:, None]                                              # [E, L]
    sm = s.masked_fill(~vis[:, None, :], float("-inf"))
    lse = torch.logsumexp(sm, dim=-1, keepdim=True)
    p = torch.exp(sm - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    p = torch.where(vis[:, None, :], p, torch.zeros_like(p))
    act = live & active_rows(seq_lens, row_mask)[src]
    if out is not None:
        o = torch.einsum("rhgn,rhnd->rhgd", p.reshape(r, hkv, g, length), v).reshape(r, hq, d)
        if evidence_rows is None:
            out.copy_(torch.where(act[:, None, None], o.to(out.dtype), out))
        else:
            idx = torch.nonzero(act).flatten()             # the twin may synchronise
            out[src[idx]] = o[idx].to(out.dtype)

    lo = allowed_lo.long()[src].clamp_min(0)
    lim = torch.clamp(seq, max=max_len)
    hi = torch.minimum(allowed_hi.long()[src], lim)
    # positions [0, n) only: nothing at or past a row's length (<= the gathered length) is written
    n = min(max_len, length)
    jpos = torch.arange(n, device=query.device)
    in_a = (jpos[None, :] >= lo[:, None]) & (jpos[None, :] < hi[:, None])           # [E, n]
    sa = s[:, :, :n].masked_fill(~in_a[:, None, :], float("-inf"))
    lse_a = torch.logsumexp(sa, dim=-1, keepdim=True)
    logp = sa - torch.where(torch.isinf(lse_a), torch.zeros_like(lse_a), lse_a)
    logp = logp.reshape(r, hkv, g, n)
    ev = _pool_evidence(logp, in_a[:, None, :], float(alpha),
                        torch.full((r,), g, device=query.device))                  # [E, Hkv, n]
    m = (act[:, None] & (jpos[None, :] < lim[:, None]))[:, None, :]
    log_evidence[..., :n].copy_(torch.where(m, ev, log_evidence[..., :n]))
    if key_norms is not None:
        norms = torch.linalg.vector_norm(k[:, :, :n], dim=-1)
        key_norms[..., :n].copy_(torch.where(m, norms, key_norms[..., :n]))
    return out


def prefill_evidence_torch(query_rows, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi,
                           scale, log_evidence, query_positions, row_mask=None, alpha=0.5, *,
                           chunk=4096, key_norms=None, span=None, k_scale=None):
    """Prefill-end evidence from ``W`` queries per row (see module doc).

    ``query_rows [R, W, Hq, D]``; ``query_positions [R, W]`` int (absolute position of each query;
    it attends to positions ``<= position``; ``< 0`` = padding query, excluded from the pool).
    Writes ``log_evidence [R, Hkv, max_len]`` for active rows. Chunked over positions (two passes,
    K read twice, no ``[R, W*Hq, max_len]`` scratch). No host sync. ``key_norms`` (fp32, the shape of
    ``log_evidence``) receives ``||k_j||`` for ``j < min(seq_len, max_len)`` from the first pass.
    ``span`` (host int, >= every active row's ``seq_len``): the positions the chunks cover; past it
    an active row's evidence is ``-inf``. The caller passes it when the lengths are on the host (the
    prefill end's plan): without it a device's chunks cover all of ``max_len`` (the model's length,
    whatever the prompt's) to avoid a sync, and the CPU reads the longest row. ``k_scale``: of fp8
    pages (``kernels.kv_quant``); the keys are dequantised.
    """
    r, w, hq, d = query_rows.shape
    if r == 0:
        return log_evidence
    dev = query_rows.device
    hkv = kv_cache.shape[1]
    g = hq // hkv
    max_len = log_evidence.shape[-1]
    seq = seq_lens.long()
    qpos = query_positions.long()                                             # [R, W]
    qvalid = qpos >= 0
    lo = allowed_lo.long().clamp_min(0)
    hi = torch.minimum(torch.minimum(allowed_hi.long(), seq), torch.full_like(seq, max_len))
    q = query_rows.float().reshape(r, w, hkv, g, d)

    act = active_rows(seq_lens, row_mask)
    ks = kv_quant.twin_scale(kv_cache.dtype, k_scale)

    def chunk_logits(j0, j1, want_norms=False):
        jpos = torch.arange(j0, j1, device=dev)
        pos = jpos[None, :].expand(r, j1 - j0)
        k, _ = gather_paged_rows(kv_cache, block_table, pos)                  # [R, Hkv, n, D]
        k = kv_quant.dequantize(k, ks)
        if key_norms is not None and want_norms:
            cur = key_norms[:, :, j0:j1]
            inside = (jpos[None, :] < seq[:, None]) & act[:, None]                # [R, n]
            cur.copy_(torch.where(inside[:, None, :], torch.linalg.vector_norm(k, dim=-1),
                                  cur))
        s = torch.einsum("rwhgd,rhnd->rhwgn", q, k) * scale                   # [R, Hkv, W, G, n]
        in_a = (jpos[None, :] >= lo[:, None]) & (jpos[None, :] < hi[:, None])  # [R, n]
        causal = jpos[None, None, :] <= qpos[:, :, None]                        # [R, W, n]
        vis = in_a[:, None, :] & causal & qvalid[:, :, None]                    # [R, W, n]
        s = s.masked_fill(~vis[:, None, :, None, :], float("-inf"))
        return s, in_a

    if span is None:
        # the CPU reads the lengths for free; a device would have to synchronise
        span = int(seq.max()) if dev.type == "cpu" else max_len
    span = max(1, min(max_len, span))
    fill_past_span(log_evidence, act, span)       # the chunks end at the span
    # pass 1: LSE over A ∩ causal, per (row, KV head, query, head); on the CPU the chunks' logits
    # are kept for pass 2 while they are small (the same values, K read once)
    keep = dev.type == "cpu" and r * hkv * w * g * span * 4 <= (64 << 20)
    kept = []
    lse = torch.full((r, hkv, w, g), float("-inf"), device=dev)
    for j0 in range(0, span, chunk):
        s, in_a = chunk_logits(j0, min(span, j0 + chunk), want_norms=True)
        lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
        if keep:
            kept.append((s, in_a))
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    n_pool = qvalid.sum(dim=1) * g                                              # [R]
    # pass 2: pooled evidence
    for i, j0 in enumerate(range(0, span, chunk)):
        j1 = min(span, j0 + chunk)
        s, in_a = kept[i] if keep else chunk_logits(j0, j1)
        logp = s - lse_safe[..., None]                                          # [R, Hkv, W, G, n]
        logp = logp.reshape(r, hkv, w * g, j1 - j0)
        ev = _pool_evidence(logp, in_a[:, None, :], float(alpha), n_pool)
        cur = log_evidence[:, :, j0:j1]
        cur.copy_(torch.where(act[:, None, None], ev, cur))
    return log_evidence


def prefill_evidence(query_rows, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi, scale,
                     log_evidence, query_positions, row_mask=None, alpha=0.5, *, chunk=4096,
                     key_norms=None, span=None, k_scale=None):
    """Prefill-end evidence: the Triton kernels where they run (``chunk`` is the twin's), else
    :func:`prefill_evidence_torch`, which defines the values."""
    if use_triton(query_rows):
        return prefill_evidence_triton(query_rows, kv_cache, block_table, seq_lens, allowed_lo,
                                       allowed_hi, scale, log_evidence, query_positions, row_mask,
                                       alpha, key_norms=key_norms, span=span, k_scale=k_scale)
    return prefill_evidence_torch(query_rows, kv_cache, block_table, seq_lens, allowed_lo,
                                  allowed_hi, scale, log_evidence, query_positions, row_mask, alpha,
                                  chunk=chunk, key_norms=key_norms, span=span, k_scale=k_scale)
