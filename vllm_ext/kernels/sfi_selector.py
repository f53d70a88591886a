"""The SFI Selector in Triton (ALGORITHMS.md §1 steps 1-5), twin of :func:`vllm_ext.sfi.selector.select`.

Three launches, no host sync, fixed shapes (CUDA-graph safe):

1. ``_fuse_kernel``, one program per (row, KV head), looping over ``A`` only:
   pass A: per evidence row ``logsumexp`` over ``A`` (skipped for pooled 3-D evidence);
   pass B: power-mean pooling -> unnormalised ``log f`` (stored to the workspace), the prior, and five
   online log-sum-exps (``Z_f``, ``Z_r``, ``log sum f^2``, ``log sum r^2``, ``log sum f r``) that give
   the clipped ``lam``; pass C: the fused ``log s`` over the workspace, in place.
2. ``_refine_kernel``, one program per (row, block of positions) holding all KV heads: Soft-NMS
   (window max from ``2 * nms_radius`` shifted loads of the workspace) and cross-head exclusivity.
3. ``_topk_kernel``, one program per (row, KV head): an exact radix select (4 passes of 8-bit digit
   histograms over an order-preserving integer key) finds the ``n_sel``-th largest key, then one
   pass keeps every position above it plus the lowest positions equal to it and writes them in
   position order, so the output comes out sorted without a sort. Ties go to the lower position,
   exactly as in the PyTorch twin. With ``sfi.select_span`` each score is read dilated over the
   ``select_span`` positions before it (that many more loads per score and pass).

Dispatch: :func:`select` follows :func:`vllm_ext.kernels.triton_utils.use_triton` (Triton for CUDA
tensors or under ``TRITON_INTERPRET=1``, the twin with ``SPEEDSFI_FORCE_TORCH_KERNELS=1``).
Importable without Triton (then always the twin) and without vLLM.
"""

from __future__ import annotations

import math

import torch

from vllm_ext.config import SfiConfig
from vllm_ext.kernels import triton_utils
from vllm_ext.sfi import selector as _ref

try:                                              # the CPU image may lack triton; the twin still works
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:                               # pragma: no cover
    HAS_TRITON = False

select_torch = _ref.select
selector_scores_torch = _ref.selector_scores


use_triton = triton_utils.use_triton           # the package's one dispatch rule


def select(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           cfg: SfiConfig, k: int | torch.Tensor, *, k_cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`vllm_ext.sfi.selector.select`; Triton on CUDA / under the interpreter."""
    if use_triton(key_norms):
        return select_triton(evidence, key_norms, lo, hi, cfg, k, k_cap=k_cap)
    return select_torch(evidence, key_norms, lo, hi, cfg, k, k_cap=k_cap)


if HAS_TRITON:

    @triton.jit
    def _log_prior(offs, lo, den, kn, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps):
        # u and 1 - u from integers, as in the twin: 1 - u is exactly 0 at the last position of A
        # (GPU division is approximate; 1 - (1 - ulp) would dodge the eps floor of the tail brake).
        rel = tl.minimum(tl.maximum(offs - lo, 0), den)
        denf = den.to(tl.float32)
        u = rel.to(tl.float32) / denf
        one_minus_u = (den - rel).to(tl.float32) / denf
        up = tl.where(u > 0, tl.exp(pos_power * tl.log(tl.maximum(u, 1e-30))), 0.0)
        log_delta = -pos_beta * up + pos_eta * tl.log(tl.maximum(one_minus_u, eps))
        log_pi = -gamma_k * tl.log(tl.maximum(kn, eps))
        return w_k * log_pi + w_pos * log_delta

    @triton.jit
    def _fuse_kernel(ev_ptr, s_ev_b, s_ev_h, s_ev_r, s_ev_l,
                     kn_ptr, s_kn_b, s_kn_h, s_kn_l,
                     lo_ptr, hi_ptr, ws_ptr, lam_ptr,
                     H, L, R, log_R, alpha, inv_alpha,
                     gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, lambda_max, eps,
                     POOL: tl.constexpr, R_PAD: tl.constexpr, BLOCK_L: tl.constexpr):
        pid = tl.program_id(0)
        row = pid // H
        h = pid % H
        lo = tl.maximum(tl.load(lo_ptr + row).to(tl.int32), 0)
        lo = tl.minimum(lo, L)
        hi = tl.minimum(tl.load(hi_ptr + row).to(tl.int32), L)
        hi = tl.maximum(hi, lo)
        den = tl.maximum(hi - lo - 1, 1)
        ev_base = ev_ptr + row.to(tl.int64) * s_ev_b + h.to(tl.int64) * s_ev_h
        kn_base = kn_ptr + row.to(tl.int64) * s_kn_b + h.to(tl.int64) * s_kn_h
        ws_base = ws_ptr + pid.to(tl.int64) * L
        ar = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, R_PAD)
        rmask = offs_r < R
        ninf = float("-inf")

        # ---- pass A: logsumexp over A of every evidence row
        lse_r = tl.zeros([R_PAD], dtype=tl.float32)
        if POOL:
            m_row = tl.full([R_PAD], ninf, tl.float32)
            s_row = tl.zeros([R_PAD], dtype=tl.float32)
            for j0 in range(lo, hi, BLOCK_L):
                offs = j0 + ar
                lm = offs < hi
                x = tl.load(ev_base + offs_r[:, None] * s_ev_r + offs[None, :] * s_ev_l,
                            mask=rmask[:, None] & lm[None, :], other=ninf).to(tl.float32)
                nm = tl.maximum(m_row, tl.max(x, axis=1))
                safe = tl.where(nm == ninf, 0.0, nm)
                s_row = s_row * tl.exp(m_row - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
                m_row = nm
            lse_r = tl.where(s_row > 0, m_row + tl.log(tl.maximum(s_row, 1e-30)), ninf)

        # ---- pass B: log f (unnormalised) to the workspace; fusion statistics. Two running maxima
        # (of log f and log r) and five rescaled sums give Z_f, Z_r and the normalised |f|^2, |r|^2, <f,r>.
        m_f = tl.full([], ninf, tl.float32)
        m_r = tl.full([], ninf, tl.float32)
        s_f = tl.zeros([], dtype=tl.float32)
        s_r = tl.zeros([], dtype=tl.float32)
        s_ff = tl.zeros([], dtype=tl.float32)
        s_rr = tl.zeros([], dtype=tl.float32)
        s_fr = tl.zeros([], dtype=tl.float32)
        for j0 in range(lo, hi, BLOCK_L):
            offs = j0 + ar
            lm = offs < hi
            if POOL:
                x = tl.load(ev_base + offs_r[:, None] * s_ev_r + offs[None, :] * s_ev_l,
                            mask=rmask[:, None] & lm[None, :], other=ninf).to(tl.float32)
                ok = (lse_r > ninf)[:, None] & (x > ninf)
                y = tl.where(ok, alpha * (x - lse_r[:, None]), ninf)
                ym = tl.max(y, axis=0)
                ys = tl.where(ym == ninf, 0.0, ym)
                ps = tl.sum(tl.exp(y - ys[None, :]), axis=0)
                lf = tl.where(ps > 0, (ys + tl.log(tl.maximum(ps, 1e-30)) - log_R) * inv_alpha, ninf)
            else:
                lf = tl.load(ev_base + offs * s_ev_l, mask=lm, other=ninf).to(tl.float32)
            lf = tl.where(lm, lf, ninf)
            tl.store(ws_base + offs, lf, mask=lm)
            kn = tl.load(kn_base + offs * s_kn_l, mask=lm, other=1.0).to(tl.float32)
            lr = _log_prior(offs, lo, den, kn, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps)
            lr = tl.where(lm, lr, ninf)
            nm_f = tl.maximum(m_f, tl.max(lf, axis=0))
            nm_r = tl.maximum(m_r, tl.max(lr, axis=0))
            sh_f = tl.where(nm_f == ninf, 0.0, nm_f)
            sh_r = tl.where(nm_r == ninf, 0.0, nm_r)
            c_f = tl.exp(m_f - sh_f)
            c_r = tl.exp(m_r - sh_r)
            e_f = tl.exp(lf - sh_f)
            e_r = tl.exp(lr - sh_r)
            s_f = s_f * c_f + tl.sum(e_f, axis=0)
            s_r = s_r * c_r + tl.sum(e_r, axis=0)
            s_ff = s_ff * (c_f * c_f) + tl.sum(e_f * e_f, axis=0)
            s_rr = s_rr * (c_r * c_r) + tl.sum(e_r * e_r, axis=0)
            s_fr = s_fr * (c_f * c_r) + tl.sum(e_f * e_r, axis=0)
            m_f = nm_f
            m_r = nm_r
        has_f = s_f > 0
        has_r = s_r > 0
        z_f = tl.where(has_f, m_f + tl.log(tl.maximum(s_f, 1e-30)), ninf)
        z_r = tl.where(has_r, m_r + tl.log(tl.maximum(s_r, 1e-30)), ninf)
        ff = tl.where(has_f, s_ff / tl.maximum(s_f * s_f, 1e-30), 0.0)
        rr = tl.where(has_r, s_rr / tl.maximum(s_r * s_r, 1e-30), 0.0)
        fr = tl.where(has_f & has_r, s_fr / tl.maximum(s_f * s_r, 1e-30), 0.0)
        lam = (ff - fr) / tl.maximum(ff - 2.0 * fr + rr, eps)
        lam = tl.minimum(tl.maximum(lam, 0.0), lambda_max)
        tl.store(lam_ptr + pid, lam)
        coef_f = tl.where(has_f & (lam < 1.0), tl.log(tl.maximum(1.0 - lam, 1e-30)) - z_f, ninf)
        coef_r = tl.where(has_r & (lam > 0.0), tl.log(tl.maximum(lam, 1e-30)) - z_r, ninf)

        tl.debug_barrier()    # pass C reads what other threads of this program wrote in pass B
        # ---- pass C: fused log s = logaddexp(log(1-lam) + log f, log(lam) + log r), in place
        for j0 in range(lo, hi, BLOCK_L):
            offs = j0 + ar
            lm = offs < hi
            lf = tl.load(ws_base + offs, mask=lm, other=ninf)
            kn = tl.load(kn_base + offs * s_kn_l, mask=lm, other=1.0).to(tl.float32)
            lr = _log_prior(offs, lo, den, kn, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps)
            u1 = coef_f + lf
            u2 = coef_r + lr
            mx = tl.maximum(u1, u2)
            mn = tl.minimum(u1, u2)
            ls = tl.where(mx == ninf, ninf, mx + tl.log(1.0 + tl.exp(mn - mx)))
            tl.store(ws_base + offs, ls, mask=lm)

    @triton.jit
    def _refine_kernel(ws_ptr, out_ptr, lo_ptr, hi_ptr, H, L, mu, inv_temp, lam_x, log_eps,
                       RADIUS: tl.constexpr, DO_NMS: tl.constexpr, DO_X: tl.constexpr,
                       H_PAD: tl.constexpr, BLOCK_L: tl.constexpr):
        row = tl.program_id(0)
        jb = tl.program_id(1)
        lo = tl.minimum(tl.maximum(tl.load(lo_ptr + row).to(tl.int32), 0), L)
        hi = tl.maximum(tl.minimum(tl.load(hi_ptr + row).to(tl.int32), L), lo)
        offs = jb * BLOCK_L + tl.arange(0, BLOCK_L)
        in_a = (offs >= lo) & (offs < hi)
        hs = tl.arange(0, H_PAD)
        hm = hs < H
        ninf = float("-inf")
        if (jb * BLOCK_L < hi) & (jb * BLOCK_L + BLOCK_L > lo):
            base = ws_ptr + row.to(tl.int64) * H * L + hs[:, None].to(tl.int64) * L
            l = tl.load(base + offs[None, :], mask=hm[:, None] & in_a[None, :], other=ninf)
            if DO_NMS:
                m = l
                for d in tl.static_range(1, RADIUS + 1):
                    p = offs + d
                    v = tl.load(base + p[None, :], mask=hm[:, None] & ((p >= lo) & (p < hi))[None, :],
                                other=ninf)
                    m = tl.maximum(m, v)
                    p = offs - d
                    v = tl.load(base + p[None, :], mask=hm[:, None] & ((p >= lo) & (p < hi))[None, :],
                                other=ninf)
                    m = tl.maximum(m, v)
                fin = l > ninf
                gap = tl.where(fin, tl.maximum(m - l, 0.0), 0.0)
                l = tl.where(fin, l - mu * gap, ninf)
            if DO_X:
                z = l * inv_temp
                zm = tl.max(z, axis=0)
                zs = tl.where(zm == ninf, 0.0, zm)
                lse = zs + tl.log(tl.sum(tl.exp(z - zs[None, :]), axis=0))
                fin = l > ninf
                log_rho = tl.where(fin, z - lse[None, :], 0.0)
                l = tl.where(fin, l + lam_x * tl.maximum(log_rho, log_eps), ninf)
            l = tl.where(l != l, ninf, l)
            obase = out_ptr + row.to(tl.int64) * H * L + hs[:, None].to(tl.int64) * L
            tl.store(obase + offs[None, :], l, mask=hm[:, None] & in_a[None, :])

    @triton.jit
    def _span_key(base, offs, lm, lo, SPAN: tl.constexpr):
        # the score at offs, dilated over the SPAN positions before it inside A (NaN -> -inf), as an
        # order-preserving uint32 key
        ninf = float("-inf")
        sc = tl.load(base + offs, mask=lm, other=0.0)
        sc = tl.where(sc != sc, ninf, sc)
        for d in tl.static_range(1, SPAN + 1):
            p = offs - d
            v = tl.load(base + p, mask=lm & (p >= lo), other=ninf)
            sc = tl.maximum(sc, tl.where(v != v, ninf, v))
        bits = sc.to(tl.int32, bitcast=True)
        return (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) ^ (-2147483648)).to(tl.uint32, bitcast=True)

    @triton.jit
    def _topk_kernel(score_ptr, lo_ptr, hi_ptr, keff_ptr, out_ptr, nsel_ptr, H, L, WIDTH,
                     SPAN: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
        pid = tl.program_id(0)
        row = pid // H
        h = pid % H
        lo = tl.minimum(tl.maximum(tl.load(lo_ptr + row).to(tl.int32), 0), L)
        hi = tl.maximum(tl.minimum(tl.load(hi_ptr + row).to(tl.int32), L), lo)
        n_sel = tl.minimum(tl.load(keff_ptr + row).to(tl.int32), hi - lo)
        base = score_ptr + pid.to(tl.int64) * L
        obase = out_ptr + pid.to(tl.int64) * WIDTH
        ar = tl.arange(0, BLOCK_L)
        bins = tl.arange(0, 256)

        # radix select: the n_sel-th largest key, 8 bits per pass, most significant first
        prefix = tl.zeros([], dtype=tl.uint32)
        remaining = n_sel
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros([256], dtype=tl.int32)
            for j0 in range(lo, hi, BLOCK_L):
                offs = j0 + ar
                lm = offs < hi
                key = _span_key(base, offs, lm, lo, SPAN)
                digit = ((key >> shift) & 0xFF).to(tl.int32)
                if p == 0:
                    match = lm
                else:
                    match = lm & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(digit, 256, mask=match)
            cge = tl.cumsum(hist, 0, reverse=True)                  # keys with digit >= d
            dsel = tl.max(tl.where(cge >= remaining, bins, 0), axis=0)
            greater = tl.sum(tl.where(bins == dsel, cge - hist, 0), axis=0)
            remaining = remaining - greater
            prefix = (prefix << 8) | dsel.to(tl.uint32)

        # keep keys > threshold and the first `remaining` keys == threshold, in position order
        cnt_sel = tl.zeros([], dtype=tl.int32)
        cnt_eq = tl.zeros([], dtype=tl.int32)
        for j0 in range(lo, hi, BLOCK_L):
            offs = j0 + ar
            lm = offs < hi
            key = _span_key(base, offs, lm, lo, SPAN)
            eq = lm & (key == prefix)
            eq_i = eq.to(tl.int32)
            eq_rank = cnt_eq + tl.cumsum(eq_i, 0) - eq_i
            sel = (lm & (key > prefix)) | (eq & (eq_rank < remaining))
            sel_i = sel.to(tl.int32)
            dst = cnt_sel + tl.cumsum(sel_i, 0) - sel_i
            tl.store(obase + dst, offs, mask=sel)
            cnt_sel += tl.sum(sel_i, axis=0)
            cnt_eq += tl.sum(eq_i, axis=0)
        for w0 in range(0, WIDTH, BLOCK_W):
            idx = w0 + tl.arange(0, BLOCK_W)
            tl.store(obase + idx, tl.full([BLOCK_W], -1, tl.int32), mask=(idx >= n_sel) & (idx < WIDTH))
        if h == 0:
            tl.store(nsel_ptr + row, tl.maximum(n_sel, 0))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def selector_scores_triton(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor,
                           hi: torch.Tensor, cfg: SfiConfig, *, fill_outside: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 in Triton: refined scores ``[rows, Hkv, L]`` fp32 and ``lam [rows, Hkv]``.

    Outside ``A`` the scores are ``-inf`` with ``fill_outside`` (as the twin), else left unwritten."""
    if not HAS_TRITON:                                       # pragma: no cover
        raise RuntimeError("triton is not installed")
    rows, heads, length = key_norms.shape
    device = key_norms.device
    if evidence.dim() == 4:
        pool, n_rows = True, evidence.shape[2]
        s_ev = evidence.stride()
    elif evidence.dim() == 3:
        pool, n_rows = False, 1
        s_ev = (evidence.stride(0), evidence.stride(1), 0, evidence.stride(2))
    else:
        raise ValueError(f"evidence must be [rows, Hkv, R, L] or [rows, Hkv, L], got {tuple(evidence.shape)}")
    if evidence.shape[:2] != (rows, heads) or evidence.shape[-1] != length:
        raise ValueError(f"evidence {tuple(evidence.shape)} does not match key_norms {tuple(key_norms.shape)}")
    lo = lo.to(device=device, dtype=torch.int32).contiguous()
    hi = hi.to(device=device, dtype=torch.int32).contiguous()
    ws = torch.empty((rows, heads, length), dtype=torch.float32, device=device)
    out = (torch.full((rows, heads, length), float("-inf"), dtype=torch.float32, device=device) if fill_outside
           else torch.empty((rows, heads, length), dtype=torch.float32, device=device))
    lam = torch.empty((rows, heads), dtype=torch.float32, device=device)
    if rows == 0 or heads == 0 or length == 0:
        return out, lam.zero_()
    r_pad = max(2, _next_pow2(n_rows)) if pool else 2
    block_l = max(16, min(1024, 4096 // r_pad))
    _fuse_kernel[(rows * heads,)](
        evidence, s_ev[0], s_ev[1], s_ev[2], s_ev[3],
        key_norms, key_norms.stride(0), key_norms.stride(1), key_norms.stride(2),
        lo, hi, ws, lam,
        heads, length, n_rows, math.log(max(n_rows, 1)), float(cfg.alpha), 1.0 / float(cfg.alpha),
        float(cfg.gamma_k), float(cfg.w_k), float(cfg.w_pos), float(cfg.pos_power), float(cfg.pos_eta),
        float(cfg.pos_beta), float(cfg.lambda_max), float(cfg.eps),
        POOL=pool, R_PAD=r_pad, BLOCK_L=block_l)
    h_pad = max(2, _next_pow2(heads))
    block_r = max(16, min(256, 2048 // h_pad))
    do_nms = cfg.nms_radius > 0 and cfg.mu != 0.0
    do_x = heads > 2 and cfg.lam_x != 0.0
    _refine_kernel[(rows, triton.cdiv(length, block_r))](
        ws, out, lo, hi, heads, length, float(cfg.mu), 1.0 / float(cfg.cross_head_temperature),
        float(cfg.lam_x), math.log(cfg.eps),
        RADIUS=int(cfg.nms_radius) if do_nms else 0, DO_NMS=do_nms, DO_X=do_x, H_PAD=h_pad, BLOCK_L=block_r)
    return out, lam


def select_triton(evidence: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  cfg: SfiConfig, k: int | torch.Tensor, *, k_cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`vllm_ext.sfi.selector.select` (same arguments and results)."""
    rows, heads, length = key_norms.shape
    device = key_norms.device
    width, k_eff = _ref.resolve_k(k, cfg, rows, device, k_cap)
    selected = torch.empty((rows, heads, width), dtype=torch.int32, device=device)
    n_sel = torch.zeros((rows,), dtype=torch.int32, device=device)
    if rows == 0 or heads == 0:
        return selected, n_sel
    if length == 0:
        return selected.fill_(-1), n_sel
    score, _ = selector_scores_triton(evidence, key_norms, lo, hi, cfg, fill_outside=False)
    lo = lo.to(device=device, dtype=torch.int32).contiguous()
    hi = hi.to(device=device, dtype=torch.int32).contiguous()
    _topk_kernel[(rows * heads,)](score, lo, hi, k_eff, selected, n_sel, heads, length, width,
                                  SPAN=int(cfg.select_span), BLOCK_L=1024, BLOCK_W=1024)
    return selected, n_sel
