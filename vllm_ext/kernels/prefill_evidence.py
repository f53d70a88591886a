"""Triton kernels of SFI's prefill-end evidence (:func:`~vllm_ext.kernels.dense_decode_evidence.
prefill_evidence`; its PyTorch twin is ``prefill_evidence_torch`` there, whose docstring defines the
values).

Per ending request ``r`` and KV head ``h`` the ``M = W * G`` query vectors (the last ``W`` prompt
queries x the ``G`` query heads of the group) each see the keys of ``A = [lo, hi)`` up to their own
position. Two launches, K read twice (the raw scores of ``M`` queries over the whole prompt would be
``M`` times the evidence's size, too much scratch at 128K):

1. ``_prefill_lse_kernel``, grid ``(R, Hkv, splits)``: the log-sum-exp of each query's scores over
   its visible keys in one split of ``A`` (log2 units), into a small ``[R, Hkv, splits, M]`` buffer;
2. ``_prefill_evidence_kernel``, grid ``(R, Hkv, ceil(span / BLOCK_J))``: merges the splits' LSEs,
   recomputes a block of scores, pools ``log p`` over the ``M`` queries (power mean with ``alpha``,
   or the geometric mean at ``alpha == 0``), writes the block's evidence (``-inf`` outside ``A``) and
   ``||k_j||`` for ``j < seq_len``.

The grid covers the host-known ``span`` (the prefill end's plan holds the prompt lengths), so the
work follows the prompts, not ``max_model_len``; the prefill end runs eagerly, never in a graph.
Two launches per layer and ending step replace ~60 PyTorch ops per 4,096 positions per request.
fp8 pages (``kernels.kv_quant``): ``k_scale`` is folded into the score scale and the key norms.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.triton_utils import HAS_TRITON, dot_in_fp32, fixed_meta, next_pow2
from vllm_ext.kernels.two_segment_decode import LOG2E, active_rows

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.two_segment_decode import _paged_row_offsets, _scores

    @triton.jit
    def _load_window_q(Q, POS, r, h, s_q_r, s_q_w, s_q_h, s_q_d, s_p_r, s_p_w,
                       W: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        # query vector m = (window entry m // G, head h * G + m % G); its position (-1: padding)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mm = offs_m < W * G
        w = offs_m // G
        g = offs_m % G
        q = tl.load(Q + r.to(tl.int64) * s_q_r + w[:, None] * s_q_w + (h * G + g)[:, None] * s_q_h
                    + offs_d[None, :] * s_q_d, mask=mm[:, None] & (offs_d < D)[None, :], other=0.0)
        qpos = tl.load(POS + r.to(tl.int64) * s_p_r + w * s_p_w, mask=mm, other=-1)
        return q, qpos, mm

    @triton.jit
    def _row_window(SEQ, LO, HI, MASK, r, MAX_LEN, HAS_MASK: tl.constexpr):
        # the request's length (0: inactive, masked out) and its allowed set A = [lo, hi)
        seq_len = tl.load(SEQ + r)
        if HAS_MASK:
            seq_len = tl.where(tl.load(MASK + r).to(tl.int32) == 0, 0, seq_len)
        lo = tl.maximum(tl.load(LO + r), 0)
        hi = tl.minimum(tl.minimum(tl.load(HI + r), seq_len), MAX_LEN)
        return seq_len, lo, hi

    @triton.jit
    def _k_scaled(qk_scale, KS, KV_SCALED: tl.constexpr):
        if KV_SCALED:
            qk_scale = qk_scale * tl.load(KS)
        return qk_scale

    @triton.jit
    def _load_k(KV, BT, r, h, pos, valid, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
        rowoff = _paged_row_offsets(BT, r, pos, valid, s_bt_r, s_bt_b, h, s_kv_b, s_kv_h, s_kv_n, PAGE)
        offs_d = tl.arange(0, BLOCK_D)
        return tl.load(KV + rowoff[:, None] + offs_d[None, :] * s_kv_c,
                       mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)

    # a step ending several prompts passes each one's row of these int tables: any 4-byte offset
    @triton.jit(do_not_specialize_on_alignment=["POS", "SEQ", "LO", "HI", "MASK"])
    def _prefill_lse_kernel(
        Q, POS, KV, BT, SEQ, LO, HI, MASK, PL, KS,
        s_q_r, s_q_w, s_q_h, s_q_d, s_p_r, s_p_w,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b,
        s_pl_r, s_pl_h, s_pl_s,
        MAX_LEN, qk_scale, NUM_SPLITS,
        W: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_MASK: tl.constexpr, F32_DOT: tl.constexpr,
        KV_SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        r = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        seq_len, lo, hi = _row_window(SEQ, LO, HI, MASK, r, MAX_LEN, HAS_MASK)
        if seq_len <= 0:
            return
        qk_scale = _k_scaled(qk_scale, KS, KV_SCALED)
        q, qpos, mm = _load_window_q(Q, POS, r, h, s_q_r, s_q_w, s_q_h, s_q_d, s_p_r, s_p_w,
                                     W, G, BLOCK_M, D, BLOCK_D)
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, hi)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < end
            k = _load_k(KV, BT, r, h, pos, valid, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                        PAGE, D, BLOCK_D)
            s = _scores(q, k, qk_scale, F32_DOT)
            vis = valid[None, :] & (pos[None, :] <= qpos[:, None]) & (qpos >= 0)[:, None]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(l_i > 0, m_safe + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        offs_m = tl.arange(0, BLOCK_M)
        tl.store(PL + r.to(tl.int64) * s_pl_r + h * s_pl_h + split * s_pl_s + offs_m, lse, mask=mm)

    # a step ending several prompts passes each one's row of these int tables: any 4-byte offset
    @triton.jit(do_not_specialize_on_alignment=["POS", "SEQ", "LO", "HI", "MASK"])
    def _prefill_evidence_kernel(
        Q, POS, KV, BT, SEQ, LO, HI, MASK, PL, EV, KN, KS,
        s_q_r, s_q_w, s_q_h, s_q_d, s_p_r, s_p_w,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b,
        s_pl_r, s_pl_h, s_pl_s,
        s_ev_r, s_ev_h, s_ev_j, s_kn_r, s_kn_h, s_kn_j,
        MAX_LEN, SPAN, qk_scale, alpha, NUM_SPLITS,
        W: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_MASK: tl.constexpr, F32_DOT: tl.constexpr,
        GEOMETRIC: tl.constexpr, NORMS: tl.constexpr, KV_SCALED: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_J: tl.constexpr,
    ):
        r = tl.program_id(0)
        h = tl.program_id(1)
        jb = tl.program_id(2)
        seq_len, lo, hi = _row_window(SEQ, LO, HI, MASK, r, MAX_LEN, HAS_MASK)
        if seq_len <= 0:
            return
        qk_scale = _k_scaled(qk_scale, KS, KV_SCALED)
        q, qpos, mm = _load_window_q(Q, POS, r, h, s_q_r, s_q_w, s_q_h, s_q_d, s_p_r, s_p_w,
                                     W, G, BLOCK_M, D, BLOCK_D)
        # the splits' LSEs merged (log2 units); 0 where no key is visible, as the twin's lse_safe
        offs_m = tl.arange(0, BLOCK_M)
        offs_s = tl.arange(0, BLOCK_S)
        pl = tl.load(PL + r.to(tl.int64) * s_pl_r + h * s_pl_h + offs_s[None, :] * s_pl_s
                     + offs_m[:, None], mask=mm[:, None] & (offs_s < NUM_SPLITS)[None, :],
                     other=float("-inf"))
        pm = tl.max(pl, 1)
        pm_safe = tl.where(pm == float("-inf"), 0.0, pm)
        tot = tl.sum(tl.exp2(pl - pm_safe[:, None]), 1)
        lse = tl.where(tot > 0, pm_safe + tl.log2(tl.where(tot > 0, tot, 1.0)), 0.0)
        n_valid = tl.sum(((qpos >= 0) & mm).to(tl.float32), 0)
        log_n = tl.log(tl.maximum(n_valid, 1.0))

        offs_j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
        jm = offs_j < SPAN
        in_a = jm & (offs_j >= lo) & (offs_j < hi)
        has_key = jm & (offs_j < seq_len)
        k = _load_k(KV, BT, r, h, offs_j, has_key, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                    PAGE, D, BLOCK_D)
        if NORMS:
            kf = k.to(tl.float32)
            kn = tl.sqrt(tl.sum(kf * kf, 1))
            if KV_SCALED:
                kn = kn * tl.load(KS)
            tl.store(KN + r.to(tl.int64) * s_kn_r + h * s_kn_h + offs_j.to(tl.int64) * s_kn_j,
                     kn, mask=has_key & (offs_j < MAX_LEN))
        s = _scores(q, k, qk_scale, F32_DOT)
        vis = in_a[None, :] & (offs_j[None, :] <= qpos[:, None]) & (qpos >= 0)[:, None]
        logp = tl.where(vis, (s - lse[:, None]) * 0.6931471805599453, float("-inf"))
        if GEOMETRIC:
            lf = tl.sum(tl.where(mm[:, None], logp, 0.0), 0) / tl.maximum(n_valid, 1.0)
        else:
            a = tl.where(mm[:, None], alpha * logp, float("-inf"))
            am = tl.max(a, 0)
            am_safe = tl.where(am == float("-inf"), 0.0, am)
            tot_a = tl.sum(tl.exp(a - am_safe[None, :]), 0)
            lf = tl.where(tot_a > 0,
                          (am_safe + tl.log(tl.where(tot_a > 0, tot_a, 1.0)) - log_n) / alpha,
                          float("-inf"))
        lf = tl.where(in_a, lf, float("-inf"))
        tl.store(EV + r.to(tl.int64) * s_ev_r + h * s_ev_h + offs_j.to(tl.int64) * s_ev_j, lf,
                 mask=jm & (offs_j < MAX_LEN))


def prefill_evidence_triton(query_rows, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi,
                            scale, log_evidence, query_positions, row_mask=None, alpha=0.5, *,
                            key_norms=None, span=None, k_scale=None):
    """The two launches (arguments as ``prefill_evidence_torch``). Without ``span`` the grid covers
    ``max_len`` (no host sync)."""
    r, w, hq, d = query_rows.shape
    if r == 0:
        return log_evidence
    hkv = kv_cache.shape[1]
    g = hq // hkv
    max_len = log_evidence.shape[-1]
    span = max(1, min(max_len, max_len if span is None else int(span)))
    page = kv_cache.shape[2]
    block_m = max(16, next_pow2(w * g))
    block_d = max(16, next_pow2(d))
    meta = fixed_meta({"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_N": 32})
    block_n = meta.pop("BLOCK_N")
    num_splits = max(1, min(64, -(-span // 2048)))
    block_s = max(2, next_pow2(num_splits))
    dev = query_rows.device
    partial = torch.empty((r, hkv, num_splits, block_m), dtype=torch.float32, device=dev)
    mask = row_mask if row_mask is not None else seq_lens
    kn = key_norms if key_norms is not None else log_evidence
    f32 = dot_in_fp32(kv_cache.dtype, query_rows.dtype)
    ks, _, kv_scaled = kv_quant.launch_scales(kv_cache.dtype, k_scale, k_scale, log_evidence)  # no V read
    pos = query_positions
    common = (*query_rows.stride(), *pos.stride(), *kv_cache.stride(), *block_table.stride(),
              *partial.stride()[:3])
    qk_scale = scale * LOG2E
    _prefill_lse_kernel[(r, hkv, num_splits)](
        query_rows, pos, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi, mask, partial, ks,
        *common, max_len, qk_scale, num_splits,
        W=w, G=g, BLOCK_M=block_m, D=d, BLOCK_D=block_d, PAGE=page,
        HAS_MASK=row_mask is not None, F32_DOT=f32, KV_SCALED=kv_scaled, BLOCK_N=block_n, **meta)
    _prefill_evidence_kernel[(r, hkv, triton.cdiv(span, block_n))](
        query_rows, pos, kv_cache, block_table, seq_lens, allowed_lo, allowed_hi, mask, partial,
        log_evidence, kn, ks, *common,
        *log_evidence.stride(), *kn.stride(),
        max_len, span, qk_scale, float(alpha), num_splits,
        W=w, G=g, BLOCK_M=block_m, D=d, BLOCK_D=block_d, PAGE=page,
        HAS_MASK=row_mask is not None, F32_DOT=f32, GEOMETRIC=float(alpha) == 0.0,
        NORMS=key_norms is not None, KV_SCALED=kv_scaled, BLOCK_S=block_s, BLOCK_J=block_n, **meta)
    fill_past_span(log_evidence, active_rows(seq_lens, row_mask), span)
    return log_evidence


def fill_past_span(log_evidence: torch.Tensor, active: torch.Tensor, span: int) -> None:
    """``-inf`` evidence at and past ``span`` for the active rows (``span`` >= each one's length:
    nothing there is visible), the rest untouched."""
    if span < log_evidence.shape[-1]:
        tail = log_evidence[:, :, span:]
        tail.copy_(torch.where(active[:, None, None], float("-inf"), tail))

