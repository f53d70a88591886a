"""Merging partial attention states ``(v, s)`` by log-sum-exp (FlashInfer's ``merge_state`` family).

A state is an attention output ``v`` over some KV segment and ``s``, the natural-log log-sum-exp of
that segment's scaled scores (fp32). Merging two states gives exactly the attention over the union
of the (disjoint) segments:

    s = logaddexp(s_a, s_b),   v = exp(s_a - s) * v_a + exp(s_b - s) * v_b

A state with ``s = -inf`` (empty segment) contributes nothing; merging only empty states gives
``v = 0`` and ``s = -inf`` (FlashInfer would give NaN there; zero is what ``attention_over`` gives).

Public functions (each dispatches to Triton on CUDA / under ``TRITON_INTERPRET=1``, else to its
``*_torch`` twin of the same signature):

- ``merge_state(v_a, s_a, v_b, s_b, *, out=None, out_lse=None) -> (v, s)``
  ``v_*``: ``[N, H, D]`` (any float dtype, any strides), ``s_*``: ``[N, H]`` fp32.
- ``merge_state_in_place(v, s, v_other, s_other, mask=None) -> None``
  updates ``(v, s)``; rows ``n`` with ``mask[n] == 0`` are left untouched (CUDA-graph friendly).
- ``merge_states(v, s, *, out=None, out_lse=None, row_mask=None) -> (v, s)``
  ``v``: ``[N, S, H, D]``, ``s``: ``[N, S, H]`` -> ``[N, H, D]``, ``[N, H]``. Rows with
  ``row_mask == 0`` are left untouched in ``out``/``out_lse``.

Natural-log LSE everywhere (as vLLM's ``merge_attn_states`` and ``paged_reference.attention_over``).
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.program_rows import program_row

    @triton.jit
    def _merge_two_kernel(VA, SA, VB, SB, VO, SO, MASK,
                          s_va_n, s_va_h, s_va_d, s_sa_n, s_sa_h,
                          s_vb_n, s_vb_h, s_vb_d, s_sb_n, s_sb_h,
                          s_vo_n, s_vo_h, s_vo_d, s_so_n, s_so_h,
                          D: tl.constexpr, BLOCK_D: tl.constexpr,
                          HAS_MASK: tl.constexpr, WRITE_LSE: tl.constexpr):
        n = tl.program_id(0)
        h = tl.program_id(1)
        if HAS_MASK:
            if tl.load(MASK + n).to(tl.int32) == 0:
                return
        sa = tl.load(SA + n * s_sa_n + h * s_sa_h).to(tl.float32)
        sb = tl.load(SB + n * s_sb_n + h * s_sb_h).to(tl.float32)
        m = tl.maximum(sa, sb)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(sa - m_safe)
        wb = tl.exp(sb - m_safe)
        tot = wa + wb
        inv = tl.where(tot > 0, 1.0 / tl.where(tot > 0, tot, 1.0), 0.0)
        offs = tl.arange(0, BLOCK_D)
        dm = offs < D
        va = tl.load(VA + n * s_va_n + h * s_va_h + offs * s_va_d, mask=dm, other=0.0).to(tl.float32)
        vb = tl.load(VB + n * s_vb_n + h * s_vb_h + offs * s_vb_d, mask=dm, other=0.0).to(tl.float32)
        vo = (va * wa + vb * wb) * inv
        tl.store(VO + n * s_vo_n + h * s_vo_h + offs * s_vo_d, vo.to(VO.dtype.element_ty), mask=dm)
        if WRITE_LSE:
            so = tl.where(tot > 0, m_safe + tl.log(tl.where(tot > 0, tot, 1.0)), float("-inf"))
            tl.store(SO + n * s_so_n + h * s_so_h, so)

    @triton.jit
    def _merge_many_kernel(V, S, VO, SO, MASK, LENS, OUT_ROWS,
                           s_v_n, s_v_s, s_v_h, s_v_d, s_s_n, s_s_s, s_s_h,
                           s_vo_n, s_vo_h, s_vo_d, s_so_n, s_so_h,
                           NUM_STATES, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr, HAS_MASK: tl.constexpr,
                           HAS_LENS: tl.constexpr, WRITE_LSE: tl.constexpr,
                           HAS_OUT_ROWS: tl.constexpr):
        n = tl.program_id(0)
        h = tl.program_id(1)
        # state row n merges into output row o (OUT_ROWS: compacted rows); MASK and LENS are
        # indexed by the output row
        o, live = program_row(n, OUT_ROWS, MASK, LENS, HAS_OUT_ROWS, HAS_MASK, HAS_LENS)
        if live <= 0:
            return
        offs_d = tl.arange(0, BLOCK_D)
        dm = offs_d < D
        offs_s = tl.arange(0, BLOCK_S)
        m_i = float("-inf")
        l_i = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, NUM_STATES, BLOCK_S):
            si = s0 + offs_s
            sm = si < NUM_STATES
            s = tl.load(S + n * s_s_n + si * s_s_s + h * s_s_h, mask=sm,
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            corr = tl.exp(m_i - m_safe)
            w = tl.exp(s - m_safe)
            v = tl.load(V + n * s_v_n + si[:, None] * s_v_s + h * s_v_h + offs_d[None, :] * s_v_d,
                        mask=sm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            acc = acc * corr + tl.sum(w[:, None] * v, 0)
            l_i = l_i * corr + tl.sum(w, 0)
            m_i = m_new
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        tl.store(VO + o.to(tl.int64) * s_vo_n + h * s_vo_h + offs_d * s_vo_d,
                 (acc * inv).to(VO.dtype.element_ty), mask=dm)
        if WRITE_LSE:
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            so = tl.where(l_i > 0, m_safe + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(SO + o.to(tl.int64) * s_so_n + h * s_so_h, so)


# ----------------------------------------------------------------------------------------------
# PyTorch twins
# ----------------------------------------------------------------------------------------------

def _merge_two_math(v_a, s_a, v_b, s_b):
    s_a = s_a.float()
    s_b = s_b.float()
    m = torch.maximum(s_a, s_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa = torch.exp(s_a - m_safe)
    wb = torch.exp(s_b - m_safe)
    tot = wa + wb
    inv = torch.where(tot > 0, 1.0 / tot.clamp_min(1e-38), torch.zeros_like(tot))
    v = (v_a.float() * wa.unsqueeze(-1) + v_b.float() * wb.unsqueeze(-1)) * inv.unsqueeze(-1)
    s = torch.where(tot > 0, m_safe + torch.log(tot.clamp_min(1e-38)),
                    torch.full_like(tot, float("-inf")))
    return v, s


def merge_state_torch(v_a, s_a, v_b, s_b, *, out=None, out_lse=None):
    v, s = _merge_two_math(v_a, s_a, v_b, s_b)
    if out is None:
        out = torch.empty_like(v_a)
    if out_lse is None:
        out_lse = torch.empty(s.shape, dtype=torch.float32, device=s.device)
    out.copy_(v.to(out.dtype))
    out_lse.copy_(s)
    return out, out_lse


def merge_state_in_place_torch(v, s, v_other, s_other, mask=None):
    vm, sm = _merge_two_math(v, s, v_other, s_other)
    if mask is None:
        v.copy_(vm.to(v.dtype))
        s.copy_(sm.to(s.dtype))
    else:
        keep = (mask != 0).to(v.device)
        v.copy_(torch.where(keep[:, None, None], vm.to(v.dtype), v))
        s.copy_(torch.where(keep[:, None], sm.to(s.dtype), s))


def _merge_many_math(v, s):
    s = s.float()                                                   # [N, S, H]
    m = s.amax(dim=1, keepdim=True)                                 # [N, 1, H]
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(s - m_safe)                                       # [N, S, H]
    tot = w.sum(dim=1)                                              # [N, H]
    acc = (w.unsqueeze(-1) * v.float()).sum(dim=1)                  # [N, H, D]
    inv = torch.where(tot > 0, 1.0 / tot.clamp_min(1e-38), torch.zeros_like(tot))
    out = acc * inv.unsqueeze(-1)
    lse = torch.where(tot > 0, m_safe.squeeze(1) + torch.log(tot.clamp_min(1e-38)),
                      torch.full_like(tot, float("-inf")))
    return out, lse


def merge_states_torch(v, s, *, out=None, out_lse=None, row_mask=None):
    vm, sm = _merge_many_math(v, s)
    n, _, h, d = v.shape
    if out is None:
        out = torch.empty((n, h, d), dtype=v.dtype, device=v.device)
    if out_lse is None:
        out_lse = torch.empty((n, h), dtype=torch.float32, device=v.device)
    if row_mask is None:
        out.copy_(vm.to(out.dtype))
        out_lse.copy_(sm)
    else:
        keep = (row_mask != 0).to(v.device)
        out.copy_(torch.where(keep[:, None, None], vm.to(out.dtype), out))
        out_lse.copy_(torch.where(keep[:, None], sm, out_lse))
    return out, out_lse


# ----------------------------------------------------------------------------------------------
# Triton launchers / public API
# ----------------------------------------------------------------------------------------------

def merge_state(v_a, s_a, v_b, s_b, *, out=None, out_lse=None):
    """Merge two states ``[N, H, D]``/``[N, H]`` -> ``(v, s)``; ``out`` may alias ``v_a``."""
    if not use_triton(v_a):
        return merge_state_torch(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    n, h, d = v_a.shape
    if out is None:
        out = torch.empty_like(v_a)
    if out_lse is None:
        out_lse = torch.empty((n, h), dtype=torch.float32, device=v_a.device)
    if n == 0:
        return out, out_lse
    _merge_two_kernel[(n, h)](
        v_a, s_a, v_b, s_b, out, out_lse, v_a,
        *v_a.stride(), *s_a.stride(), *v_b.stride(), *s_b.stride(), *out.stride(), *out_lse.stride(),
        D=d, BLOCK_D=next_pow2(d), HAS_MASK=False, WRITE_LSE=True)
    return out, out_lse


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    """``(v, s) <- merge((v, s), (v_other, s_other))`` for rows with ``mask != 0`` (all if None)."""
    if not use_triton(v):
        return merge_state_in_place_torch(v, s, v_other, s_other, mask)
    n, h, d = v.shape
    if n == 0:
        return None
    _merge_two_kernel[(n, h)](
        v, s, v_other, s_other, v, s, mask if mask is not None else v,
        *v.stride(), *s.stride(), *v_other.stride(), *s_other.stride(), *v.stride(), *s.stride(),
        D=d, BLOCK_D=next_pow2(d), HAS_MASK=mask is not None, WRITE_LSE=True)
    return None


def merge_states(v, s, *, out=None, out_lse=None, row_mask=None):
    """Merge ``S`` states: ``v [N, S, H, D]``, ``s [N, S, H]`` -> ``([N, H, D], [N, H])``."""
    if not use_triton(v):
        return merge_states_torch(v, s, out=out, out_lse=out_lse, row_mask=row_mask)
    n, _, h, d = v.shape
    if out is None:
        out = torch.empty((n, h, d), dtype=v.dtype, device=v.device)
    if out_lse is None:
        out_lse = torch.empty((n, h), dtype=torch.float32, device=v.device)
    launch_merge_states(v, s, out, out_lse, row_mask=row_mask)
    return out, out_lse


def launch_merge_states(v, s, out, out_lse=None, *, row_mask=None, row_lens=None,
                        out_rows=None) -> None:
    """Triton reduce used by the split-K kernels: rows with ``row_mask == 0`` or ``row_lens <= 0``
    are left untouched. ``out_rows`` (int32 ``[n]``): state row ``i`` goes to output row
    ``out_rows[i]`` (-1: skipped), and ``row_mask``/``row_lens`` are indexed by the output row.
    ``out_lse`` may be None (not written). No allocation, no host sync."""
    n, num_states, h, d = v.shape
    if n == 0:
        return
    so = out_lse if out_lse is not None else s
    s_so = out_lse.stride() if out_lse is not None else (0, 0)
    _merge_many_kernel[(n, h)](
        v, s, out, so, row_mask if row_mask is not None else v,
        row_lens if row_lens is not None else v, out_rows if out_rows is not None else v,
        *v.stride(), *s.stride(), *out.stride(), *s_so,
        num_states, D=d, BLOCK_D=next_pow2(d), BLOCK_S=min(next_pow2(num_states), 16),
        HAS_MASK=row_mask is not None, HAS_LENS=row_lens is not None,
        WRITE_LSE=out_lse is not None, HAS_OUT_ROWS=out_rows is not None)
