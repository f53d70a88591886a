"""SPEED's upper-layer attention: each query sees its row's anchors and its row's decode-phase
tokens, read in place from the paged cache (ALGORITHMS.md §2, :mod:`vllm_ext.methods.speed.visibility`).

For the query token ``t`` at position ``p`` of row ``r`` (``token_row[t]``, ``positions[t]``), with
``P1 = tail_start[r]`` (``P - 1``) and ``a = anchor_end``, the visible keys are

* ``[0, min(a, p + 1))`` — the anchors (causal), and
* ``[s, p]`` with ``s = max(p if self_only else P1, a)`` — only when ``p >= P1`` (a decode-phase
  token); an interior prompt query (``a <= p < P1``) sees the anchors only (zero output without
  anchors): it has no upper-layer KV and its upper-layer output is never used.

Interior prompt positions are never read (their blocks are vLLM's null block). One program per
(query token, KV head) with an online softmax over the two ranges; the G query heads of a KV head
share each K/V load. Works for prefill and decode tokens alike; no host synchronisation. fp8
pages take the layer's ``k_scale`` / ``v_scale`` (``kernels.kv_quant``).
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.paged_reference import attention_over, gather_kv
from vllm_ext.kernels.triton_utils import HAS_TRITON, dot_in_fp32, next_pow2, use_triton

LOG2E = 1.4426950408889634

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.two_segment_decode import (_kv_scale_factors, _load_group_q, _online_update,
                                                     _paged_kv_scores, _store_state)

    @triton.jit
    def _speed_range(q, m_i, l_i, acc, KV, BT, row, h, lo, hi,
                     s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c, qk_scale,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                     F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < hi
            _, v, s = _paged_kv_scores(q, KV, BT, row, h, pos, valid, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                                       qk_scale, D, BLOCK_D, PAGE, F32_DOT)
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, F32_DOT)
        return m_i, l_i, acc

    @triton.jit
    def _speed_attention_kernel(
        Q, KV, BT, TOKEN_ROW, POS, TAIL, OUT, KS, VS,
        s_q_r, s_q_h, s_q_d,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_o_r, s_o_h, s_o_d,
        qk_scale, ANCHOR_END,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, SELF_ONLY: tl.constexpr, F32_DOT: tl.constexpr,
        KV_SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(TOKEN_ROW + t)
        p = tl.load(POS + t).to(tl.int32)
        if p < 0:
            return
        qk_scale, vsc = _kv_scale_factors(qk_scale, KS, VS, KV_SCALED)
        p1 = tl.load(TAIL + row)
        q = _load_group_q(Q, t, h, s_q_r, s_q_h, s_q_d, G, BLOCK_G, D, BLOCK_D)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        a_hi = tl.minimum(ANCHOR_END, p + 1)
        m_i, l_i, acc = _speed_range(q, m_i, l_i, acc, KV, BT, row, h, 0, a_hi,
                                     s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c, qk_scale,
                                     D, BLOCK_D, PAGE, F32_DOT, BLOCK_N)
        if SELF_ONLY:
            start = p
        else:
            start = p1
        start = tl.maximum(start, ANCHOR_END)
        t_hi = tl.where(p >= p1, p + 1, start)        # interior prompt query: no tail
        m_i, l_i, acc = _speed_range(q, m_i, l_i, acc, KV, BT, row, h, start, t_hi,
                                     s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c, qk_scale,
                                     D, BLOCK_D, PAGE, F32_DOT, BLOCK_N)
        _store_state(acc, m_i, l_i, vsc, t, t, h, 0, OUT, OUT, OUT,
                     0, 0, 0, 0, 0, 0, 0, s_o_r, s_o_h, s_o_d, G, BLOCK_G, D, BLOCK_D, True)


def speed_visible_ranges(p: int, tail_start: int, anchor_end: int, self_only: bool
                         ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two key ranges ``[lo, hi)`` a query at ``p`` sees (the module rule, host ints)."""
    anchors = (0, min(anchor_end, p + 1))
    start = max(p if self_only else tail_start, anchor_end)
    tail = (start, p + 1) if p >= tail_start else (start, start)
    return anchors, tail


def speed_attention_torch(query, kv_cache, block_table, token_row, positions, tail_start,
                          anchor_end: int, self_only: bool, scale: float, out, *, k_scale=None,
                          v_scale=None) -> torch.Tensor:
    """PyTorch twin (CPU path, references): row by row, only the visible positions are gathered
    (fp8 K and V dequantised)."""
    n = positions.shape[0]
    if n == 0:
        return out
    rows = token_row[:n].tolist()
    pos = positions[:n].tolist()
    tails = tail_start.tolist()
    ks = kv_quant.twin_scale(kv_cache.dtype, k_scale)
    vs = kv_quant.twin_scale(kv_cache.dtype, v_scale)
    start = 0
    while start < n:
        r = rows[start]
        end = start
        while end < n and rows[end] == r:
            end += 1
        ps = pos[start:end]
        if max(ps) >= 0:
            keys = sorted({j for p in ps if p >= 0
                           for lo, hi in speed_visible_ranges(p, tails[r], anchor_end, self_only)
                           for j in range(lo, hi)})
            kpos = torch.tensor(keys, dtype=torch.long, device=query.device)
            qpos = torch.tensor(ps, dtype=torch.long, device=query.device)
            if keys:
                k, v = gather_kv(kv_cache, block_table[r], kpos)
                k, v = kv_quant.dequantize(k, ks), kv_quant.dequantize(v, vs)
                mask = torch.zeros(len(ps), len(keys), dtype=torch.bool, device=query.device)
                for i, p in enumerate(ps):
                    if p < 0:
                        continue
                    for lo, hi in speed_visible_ranges(p, tails[r], anchor_end, self_only):
                        mask[i] |= (kpos >= lo) & (kpos < hi)
                o, _ = attention_over(query[start:end], k, v, scale, mask)
                keep = qpos >= 0
                out[start:end][keep] = o[keep].to(out.dtype)
            else:
                out[start:end][qpos >= 0] = 0
        start = end
    return out


def speed_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    token_row: torch.Tensor, positions: torch.Tensor, tail_start: torch.Tensor,
                    anchor_end: int, self_only: bool, scale: float, out: torch.Tensor, *,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Upper-layer attention of the tokens ``0..n-1`` (``n = positions.shape[0]``; tokens with a
    negative position are skipped). ``query``/``out`` ``[>=n, Hq, D]``, ``token_row`` int ``[n]``,
    ``tail_start`` int32 ``[rows]`` (``P - 1``). ``k_scale``, ``v_scale``: of fp8 pages."""
    if not use_triton(query):
        return speed_attention_torch(query, kv_cache, block_table, token_row, positions, tail_start,
                                     anchor_end, self_only, scale, out, k_scale=k_scale, v_scale=v_scale)
    n = positions.shape[0]
    if n == 0:
        return out
    hq, d = query.shape[1], query.shape[2]
    hkv = kv_cache.shape[1]
    g = hq // hkv
    ks, vs, kv_scaled = kv_quant.launch_scales(kv_cache.dtype, k_scale, v_scale, out)
    _speed_attention_kernel[(n, hkv)](
        query, kv_cache, block_table, token_row, positions, tail_start, out, ks, vs,
        *query.stride(), *kv_cache.stride(), *block_table.stride(), *out.stride(),
        float(scale) * LOG2E, int(anchor_end),
        G=g, BLOCK_G=max(16, next_pow2(g)), D=d, BLOCK_D=max(16, next_pow2(d)),
        PAGE=kv_cache.shape[2], SELF_ONLY=bool(self_only),
        F32_DOT=dot_in_fp32(kv_cache.dtype, query.dtype), KV_SCALED=kv_scaled, BLOCK_N=32)
    return out
