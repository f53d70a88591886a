"""Block-sparse paged prefill attention for CritiPrefill (chunked-prefill aware, GQA-native).

Public function (Triton on CUDA / under ``TRITON_INTERPRET=1``, else the ``*_torch`` twin of the same
signature; the CPU build's engine calls the compiled pass first, :func:`block_sparse_prefill_cpu`):

``block_sparse_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, plan, scale, *, output=None,
k_scale=None, v_scale=None)``
    ``query`` ``[T, Hq, D]``; ``kv_cache`` ``[pages, Hkv, page_size, 2D]`` (vLLM's logical view, any
    strides, K = ``[..., :D]``, V = ``[..., D:]``); ``block_table`` int32 ``[R, max_pages]``;
    ``query_start_loc`` int ``[R + 1]``; ``seq_lens`` int ``[R]`` (the chunk included; its K/V are
    already in the cache); ``plan``: a :class:`vllm_ext.methods.critiprefill.plan.CritiPrefillPlan` (or any
    object with its fields) built for the same batch; ``scale``: softmax scale.
    Each query at absolute position ``p`` in segment ``j`` (start ``s0 = j * segment_size``) attends to

    - every key ``< s0`` when ``plan.dense[i, j - first_segment_i]``, else the keys of the plan's
      selected criticality blocks (``sel_blocks[i, j - first, h, :num_sel]``, blocks of
      ``plan.block_size`` keys, all ``< s0``), per KV head ``h``;
    - its segment's own keys ``s0 .. p`` (exact causal mask).

    Softmax in fp32 (online, exp2), fp32 accumulation; ``output`` ``[T, Hq, D]`` (default: new, the
    query's dtype) gets rows ``query_start_loc[0]:query_start_loc[R]``; other rows are untouched.
    fp8 pages (``kernels.kv_quant``): ``kv_cache`` the fp8 view, ``k_scale`` / ``v_scale`` the layer's
    per-tensor scales (``None``: 1); the kernel folds ``k_scale`` into the score scale and ``v_scale``
    into the normalised output, reading K and V as stored (one byte an element).

The plan's criticality block size is independent of the page size (16, 32, 64 ... either a whole
number of pages or a divisor of one): every key is addressed through the block table.

The Triton kernel runs one program per (query tile, KV head): a tile is ``BLOCK_Q`` consecutive
query positions of one request inside one segment (tiles are aligned to absolute positions;
``BLOCK_Q`` divides the segment size) times the ``G`` query heads of the KV head, so K/V are loaded
once per group. The tile list is built on the device (no host sync); the grid is the host bound
``ceil(T / BLOCK_Q) + R`` and surplus programs exit at once. Imports neither vLLM nor CUDA.
"""

from __future__ import annotations

import math

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.paged_reference import gather_kv
from vllm_ext.kernels.triton_utils import HAS_TRITON, dot_in_fp32, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.two_segment_decode import _kv_scale_factors, _widen

    @triton.jit
    def _attend_keys(q, m_i, l_i, acc, kv_head, bt_row, kpos, kok, vis, offs_d, dmask, s_bt_p, s_kv_p, s_kv_n,
                     s_kv_d, qk_scale, D: tl.constexpr, PAGE: tl.constexpr, F32_DOT: tl.constexpr):
        """One online-softmax step of the tile's query rows over the keys at ``kpos`` (``kok``: the key
        exists; ``vis``: which rows see it) of a paged cache."""
        page = tl.load(bt_row + (kpos // PAGE) * s_bt_p, mask=kok, other=0).to(tl.int64)
        kv_off = page * s_kv_p + (kpos % PAGE) * s_kv_n
        kptr = kv_head + kv_off[:, None] + offs_d[None, :] * s_kv_d
        lm = kok[:, None] & dmask[None, :]
        k = tl.load(kptr, mask=lm, other=0.0)
        v = tl.load(kptr + D * s_kv_d, mask=lm, other=0.0)
        k = _widen(k, q)                        # fp8: exact; the scales act on scores and output
        v = _widen(v, q)
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(vis, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _bsp_prefill_kernel(
            Q, KV, BT, QSL, SEQ, TILE_REQ, TILE_POS, SEL, NSEL, DENSE, O, KS, VS,
            s_q_t, s_q_h, s_q_d,
            s_kv_p, s_kv_h, s_kv_n, s_kv_d,
            s_bt_r, s_bt_p,
            s_sel_r, s_sel_s, s_sel_h, s_sel_w,
            s_ns_r, s_ns_s, s_ns_h,
            s_dn_r, s_dn_s,
            s_o_t, s_o_h, s_o_d,
            qk_scale,                      # softmax scale * log2(e)
            G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
            D: tl.constexpr, D_PAD: tl.constexpr,
            PAGE: tl.constexpr, BK: tl.constexpr, BK_PAD: tl.constexpr, NPI: tl.constexpr, SEG: tl.constexpr,
            F32_DOT: tl.constexpr, KV_SCALED: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.load(TILE_REQ + pid)
        if r < 0:
            return
        p0 = tl.load(TILE_POS + pid).to(tl.int64)           # first absolute position of the tile
        r64 = r.to(tl.int64)
        h64 = h.to(tl.int64)
        qs = tl.load(QSL + r64).to(tl.int64)
        qe = tl.load(QSL + r64 + 1).to(tl.int64)
        seq = tl.load(SEQ + r64).to(tl.int64)
        ctx = seq - (qe - qs)
        seg = p0 // SEG
        seg_start = seg * SEG
        s_local = seg - ctx // SEG

        M: tl.constexpr = BLOCK_Q * G_PAD
        rows = tl.arange(0, M)
        qi = rows // G_PAD
        g = rows % G_PAD
        qpos = p0 + qi
        row_ok = (qpos >= ctx) & (qpos < seq) & (g < G)
        tok = qs + qpos - ctx
        head = h64 * G + g
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        q = tl.load(Q + tok[:, None] * s_q_t + head[:, None] * s_q_h + offs_d[None, :] * s_q_d,
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        qk_scale, vsc = _kv_scale_factors(qk_scale, KS, VS, KV_SCALED)

        m_i = tl.full((M,), -1.0e30, tl.float32)
        l_i = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, D_PAD), tl.float32)

        # key tiles of BLOCK_N = NPI * BK_PAD keys: NPI selected blocks per step (contiguous keys when dense)
        BLOCK_N: tl.constexpr = NPI * BK_PAD
        offs_n = tl.arange(0, BLOCK_N)
        slot_in = offs_n // BK_PAD
        within = offs_n % BK_PAD
        bt_row = BT + r64 * s_bt_r
        kv_head = KV + h64 * s_kv_h

        # ---- keys before the segment: selected blocks, or all of them (dense)
        dense = tl.load(DENSE + r64 * s_dn_r + s_local * s_dn_s) != 0
        sel_row = SEL + r64 * s_sel_r + s_local * s_sel_s + h64 * s_sel_h
        n_sel = tl.load(NSEL + r64 * s_ns_r + s_local * s_ns_s + h64 * s_ns_h).to(tl.int64)
        if dense:
            n_iter = tl.cdiv(seg_start, BLOCK_N)
        else:
            n_iter = tl.cdiv(n_sel, NPI)
        for i in range(0, n_iter):
            if dense:
                kpos = i * BLOCK_N + offs_n
                kok = kpos < seg_start
            else:
                slot = i * NPI + slot_in
                sok = slot < n_sel
                blk = tl.load(sel_row + slot * s_sel_w, mask=sok, other=0).to(tl.int64)
                kpos = blk * BK + within
                kok = sok & (within < BK)
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, kv_head, bt_row, kpos, kok, kok[None, :], offs_d, dmask,
                                         s_bt_p, s_kv_p, s_kv_n, s_kv_d, qk_scale, D, PAGE, F32_DOT)

        # ---- the segment's own keys: seg_start .. end of the tile, exact causal mask
        k_end = tl.minimum(p0 + BLOCK_Q, seq)
        n_diag = tl.cdiv(k_end - seg_start, BLOCK_N)
        for j in range(0, n_diag):
            kpos = seg_start + j * BLOCK_N + offs_n
            kok = kpos < k_end
            vis = kok[None, :] & (kpos[None, :] <= qpos[:, None])
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, kv_head, bt_row, kpos, kok, vis, offs_d, dmask,
                                         s_bt_p, s_kv_p, s_kv_n, s_kv_d, qk_scale, D, PAGE, F32_DOT)

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc * (vsc / l_safe)[:, None]
        tl.store(O + tok[:, None] * s_o_t + head[:, None] * s_o_h + offs_d[None, :] * s_o_d,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


# ------------------------------------------------------------------------------------------ helpers
def _check(query: torch.Tensor, kv_cache: torch.Tensor, plan) -> tuple[int, int, int]:
    t, hq, d = query.shape
    hkv = kv_cache.shape[1]
    if kv_cache.shape[-1] != 2 * d:
        raise ValueError(f"kv_cache last dim {kv_cache.shape[-1]} != 2 * head_size {2 * d}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if plan.segment_size % plan.block_size:
        raise ValueError("plan.segment_size must be a multiple of plan.block_size")
    return t, hq, hkv


def _tile_q(segment_size: int, g_pad: int, target_rows: int = 128) -> int:
    """Largest power-of-two query count per tile with ``BLOCK_Q * G_PAD <= target_rows`` dividing the segment."""
    bq = max(1, target_rows // g_pad)
    bq = 1 << (bq.bit_length() - 1)
    while bq > 1 and segment_size % bq:
        bq //= 2
    return bq


def tile_table(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_q: int,
               num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per program: (request, first absolute position) of each query tile; ``-1`` request = no work.

    Tiles cover positions ``[ctx_i, seq_len_i)`` aligned to multiples of ``block_q``. Length is the
    host bound ``ceil(num_tokens / block_q) + R``.
    """
    r = seq_lens.shape[0]
    dev = seq_lens.device
    qsl = query_start_loc.long()
    seq = seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    ctx = seq - q_lens
    t_first = torch.div(ctx, block_q, rounding_mode="floor")
    t_end = torch.div(seq + block_q - 1, block_q, rounding_mode="floor")
    n_t = torch.where(q_lens > 0, t_end - t_first, 0)
    cum = torch.cumsum(n_t, 0)
    bound = -(-max(num_tokens, 1) // block_q) + r
    pid = torch.arange(bound, device=dev)
    req = torch.searchsorted(cum, pid, right=True)
    ok = req < r
    req_c = req.clamp_max(max(r - 1, 0))
    tile = t_first[req_c] + pid - (cum[req_c] - n_t[req_c])
    tile_req = torch.where(ok, req_c, -1).to(torch.int32)
    tile_pos = torch.where(ok, tile * block_q, 0).to(torch.int64)
    return tile_req, tile_pos


# ------------------------------------------------------------------------------------------- triton
def block_sparse_prefill_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, plan, scale: float, *,
                                output: torch.Tensor | None = None, block_n: int = 64, tile_rows: int = 128,
                                num_warps: int | None = None, num_stages: int = 2,
                                k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton path. ``block_n``: keys per inner step (``block_n // block_size`` selected blocks at once);
    ``tile_rows``: query rows (queries x group heads) per program."""
    t, hq, hkv = _check(query, kv_cache, plan)
    d = query.shape[-1]
    if output is None:
        output = torch.empty_like(query)
    r = seq_lens.shape[0]
    if r == 0 or t == 0:
        return output
    g = hq // hkv
    g_pad = next_pow2(g)
    bq = _tile_q(plan.segment_size, g_pad, tile_rows)
    if bq * g_pad < 16:                                  # tl.dot needs M >= 16
        g_pad = 16 // bq
    tile_req, tile_pos = tile_table(query_start_loc, seq_lens, bq, t)
    dense = plan.dense
    if dense.dtype == torch.bool:
        dense = dense.view(torch.uint8) if dense.is_contiguous() else dense.to(torch.uint8)
    sel, nsel = plan.sel_blocks, plan.num_sel
    bk = plan.block_size
    d_pad = max(16, next_pow2(d))
    bk_pad = max(16, next_pow2(bk))
    npi = max(1, block_n // bk_pad)
    if num_warps is None:
        num_warps = 4 if bq * g_pad * d_pad <= 128 * 64 else 8
    grid = (tile_req.shape[0], hkv)
    ks, vs, kv_scaled = kv_quant.launch_scales(kv_cache.dtype, k_scale, v_scale, output)
    _bsp_prefill_kernel[grid](
        query, kv_cache, block_table, query_start_loc, seq_lens, tile_req, tile_pos, sel, nsel, dense, output,
        ks, vs,
        *query.stride(), *kv_cache.stride(), *block_table.stride(), *sel.stride(), *nsel.stride(),
        *dense.stride(), *output.stride(),
        float(scale) * math.log2(math.e),
        G=g, G_PAD=g_pad, BLOCK_Q=bq, D=d, D_PAD=d_pad,
        PAGE=kv_cache.shape[2], BK=bk, BK_PAD=bk_pad, NPI=npi, SEG=plan.segment_size,
        F32_DOT=dot_in_fp32(kv_cache.dtype, query.dtype) or dot_in_fp32(query.dtype), KV_SCALED=kv_scaled,
        num_warps=num_warps, num_stages=num_stages,
    )
    return output


# -------------------------------------------------------------------------------------------- torch
def block_sparse_prefill_torch(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, plan, scale: float, *,
                               output: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin: per (request, segment), all KV heads at once, gathering only the visible keys.

    Each request's K/V are gathered and converted to fp32 once; each segment is one
    ``scaled_dot_product_attention`` (fp32, GQA native) with a boolean mask: the causal mask over the
    whole prefix for a dense segment, per KV head the selected blocks' validity plus the causal
    diagonal for a sparse one (the same visible keys and fp32 softmax as the per-segment masked
    einsum it replaces, several times faster on the CPU)."""
    import torch.nn.functional as F

    t, hq, hkv = _check(query, kv_cache, plan)
    if output is None:
        output = torch.empty_like(query)
    g = hq // hkv
    sq, bk = plan.segment_size, plan.block_size
    dev = query.device
    qsl = query_start_loc.tolist()
    seqs = seq_lens.tolist()
    dense_all = plan.dense.tolist()
    sel_cpu = plan.sel_blocks
    nsel_cpu = plan.num_sel
    offs = torch.arange(bk, device=dev)
    hidx = torch.arange(hkv, device=dev)[:, None]
    ks = kv_quant.twin_scale(kv_cache.dtype, k_scale)
    vs = kv_quant.twin_scale(kv_cache.dtype, v_scale)
    for i, seq in enumerate(seqs):
        qs, qe = qsl[i], qsl[i + 1]
        if qe <= qs:
            continue
        ctx = seq - (qe - qs)
        k_all, v_all = gather_kv(kv_cache, block_table[i], torch.arange(seq, device=kv_cache.device))
        k_all, v_all = kv_quant.dequantize(k_all, ks), kv_quant.dequantize(v_all, vs)   # [Hkv, seq, D] fp32
        first = ctx // sq
        for j in range(first, (seq - 1) // sq + 1):
            s_local = j - first
            s0 = j * sq
            p_lo, p_hi = max(ctx, s0), min(seq, s0 + sq)         # this chunk's queries of segment j
            rows = slice(qs + p_lo - ctx, qs + p_hi - ctx)
            n_q = p_hi - p_lo
            q = query[rows].float().transpose(0, 1).unsqueeze(0)    # [1, Hq, n_q, D]
            qpos = torch.arange(p_lo, p_hi, device=dev)
            diag = torch.arange(s0, p_hi, device=dev)
            diag_mask = diag[None, :] <= qpos[:, None]              # [n_q, n_diag]
            if dense_all[i][s_local]:
                kpos = torch.arange(0, p_hi, device=dev)
                mask = kpos[None, :] <= qpos[:, None]               # [n_q, p_hi]
                out = F.scaled_dot_product_attention(q, k_all[None, :, :p_hi], v_all[None, :, :p_hi],
                                                     attn_mask=mask, scale=scale, enable_gqa=True)
            else:
                w = int(nsel_cpu[i, s_local].max().item())
                blocks = sel_cpu[i, s_local, :, :w].long()           # [Hkv, w]
                ok = blocks >= 0
                pos = (blocks.clamp_min(0)[..., None] * bk + offs).reshape(hkv, w * bk)
                okp = ok[..., None].expand(hkv, w, bk).reshape(hkv, w * bk)
                k = torch.cat([k_all[hidx, pos], k_all[:, s0:p_hi]], dim=1)   # [Hkv, w*bk + n_diag, D]
                v = torch.cat([v_all[hidx, pos], v_all[:, s0:p_hi]], dim=1)
                mask = torch.cat([okp[:, None, :].expand(hkv, n_q, w * bk),
                                  diag_mask[None].expand(hkv, n_q, diag.shape[0])], dim=2)  # [Hkv, n_q, n_k]
                mask = mask[:, None].expand(hkv, g, n_q, mask.shape[-1]).reshape(1, hq, n_q, -1)
                out = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=scale,
                                                     enable_gqa=True)
            output[rows] = out[0].transpose(0, 1).to(output.dtype)
    return output


# ------------------------------------------------------------------------------------------ CPU build
def block_sparse_prefill_cpu(query: torch.Tensor, kv_cache, block_table: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, plan, scale: float, *,
                             output: torch.Tensor, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> bool:
    """The CPU build's compiled pass (:func:`vllm_ext.kernels.cpu_native.block_sparse_prefill`: every
    row, segment and KV head at once, ``kv_cache`` read in place: the logical layout or ``CPU_ATTN``'s
    packed pages). False (nothing written) where it does not apply (no compiled library, another
    dtype or layout): the caller runs the twin. fp8 pages: the scales are CPU tensors (read on the
    host, which costs nothing there)."""
    from vllm_ext.kernels import cpu_native

    dtype = getattr(kv_cache, "dtype", None)
    return cpu_native.block_sparse_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, plan, scale,
                                           output, k_scale=kv_quant.host_scale(dtype, k_scale),
                                           v_scale=kv_quant.host_scale(dtype, v_scale))


# ----------------------------------------------------------------------------------------- dispatch
def block_sparse_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, plan, scale: float, *,
                         output: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse paged prefill (see the module docstring)."""
    fn = block_sparse_prefill_triton if use_triton(query) else block_sparse_prefill_torch
    return fn(query, kv_cache, block_table, query_start_loc, seq_lens, plan, scale, output=output,
              k_scale=k_scale, v_scale=v_scale)
