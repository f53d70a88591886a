"""The Triton kernels of the SFI Selector (steps 0-7 of :mod:`vllm_ext.kernels.sfi_selector`, which
launches them through :mod:`vllm_ext.kernels.sfi_selector_launch`). Defined only where Triton imports.

Every kernel walks its items ``it`` over ``[program_id, n_live x items per row)`` with stride
``num_programs`` (:func:`_n_live`): one item per program on the full grid, a persistent walk on the
fixed grid of a launch with ``count``. An item is a (row, KV head) (:func:`_row_item` with ``N = H``),
a (row, chunk) of all KV heads (:func:`_row_item` with ``N`` chunks) or a (row x head, chunk)
(:func:`_head_chunk_item`).
"""

from __future__ import annotations

from vllm_ext.kernels.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    _kernel = triton.jit(do_not_specialize=["ROWS"])     # ROWS varies per step: one compile

    # ------------------------------------------------------------------------------------ helpers
    @triton.jit
    def _n_live(COUNT, ROWS, HAS_COUNT: tl.constexpr):
        """Rows whose work a launch walks: ``clamp(COUNT[0], 0, ROWS)`` (a live prefix; read on the
        device) with ``HAS_COUNT``, else all ``ROWS``."""
        if HAS_COUNT:
            n = tl.minimum(tl.maximum(tl.load(COUNT).to(tl.int32), 0), ROWS)
        else:
            n = ROWS
        return n

    @triton.jit
    def _i32(it):
        """A loop index as an int32 tensor (the interpreter's ``range`` yields Python ints)."""
        return it + tl.zeros([], dtype=tl.int32)

    @triton.jit
    def _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L):
        """A = [lo, hi) of a row clamped to [0, L) with hi >= lo (int32)."""
        lo = tl.load(lo_ptr + row * s_lo)
        hi = tl.load(hi_ptr + row * s_hi)
        lo = tl.minimum(tl.maximum(lo, 0), L).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, 0), L).to(tl.int32)
        return lo, tl.maximum(hi, lo)

    @triton.jit
    def _keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR: tl.constexpr):
        """Effective budget of a row: clamp(k[row], k_min, width) for a tensor k, else k_val."""
        if K_TENSOR:
            k = tl.load(k_ptr + row * s_k).to(tl.int64)
            k = tl.minimum(tl.maximum(k, k_min), width).to(tl.int32)
        else:
            k = tl.full([], 0, tl.int32) + k_val
        return k

    @triton.jit
    def _head_base(ptr, row, h, s_b, s_h):
        return ptr + row.to(tl.int64) * s_b + h.to(tl.int64) * s_h

    @triton.jit
    def _row_item(it, N, lo_ptr, s_lo, hi_ptr, s_hi, L):
        """Item ``it`` of a launch with ``N`` items per row: the row, the item's index in it, A = [lo, hi)."""
        row = _i32(it) // N
        lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
        return row, _i32(it) % N, lo, hi

    @triton.jit
    def _head_chunk_item(it, NC, H, CHUNK, score_ptr, s_sc_b, s_sc_h, lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k,
                         k_val, k_min, width, L, K_TENSOR: tl.constexpr):
        """Item ``it`` of a launch over (row x head, chunk of ``CHUNK`` positions): ``pid = row * H + h``,
        the chunk ``c``, the (row, head)'s scores, A = [lo, hi), ``n_sel = min(k_eff, |A|)`` and the
        chunk's part of A, ``[c0, c1)``."""
        pid = _i32(it) // NC
        c = _i32(it) % NC
        row = pid // H
        lo, hi = _bounds(row, lo_ptr, s_lo, hi_ptr, s_hi, L)
        n_sel = tl.minimum(_keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR), hi - lo)
        c0 = tl.maximum(c * CHUNK, lo)
        c1 = tl.minimum(c * CHUNK + CHUNK, hi)
        return pid, c, _head_base(score_ptr, row, pid % H, s_sc_b, s_sc_h), lo, hi, n_sel, c0, c1

    @triton.jit
    def _needs_scores(active, row, lo, hi, k_ptr, s_k, k_val, k_min, width, K_TENSOR: tl.constexpr,
                      SKIP_ALL: tl.constexpr):
        """``active``, less (with ``SKIP_ALL``) a row that takes all of A or nothing: it needs no scores."""
        if SKIP_ALL:
            k_eff = _keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR)
            active = active & (k_eff > 0) & (k_eff < hi - lo)
        return active

    @triton.jit
    def _pos_prior(offs, lo, den, w_pos, pos_power, pos_eta, pos_beta, eps):
        # w_pos * log delta(j), u and 1 - u from integers, as in the twin: 1 - u is exactly 0 at the
        # last position of A (GPU division is approximate; 1 - (1 - ulp) would dodge the eps clamp).
        rel = tl.minimum(tl.maximum(offs - lo, 0), den)
        denf = den.to(tl.float32)
        u = rel.to(tl.float32) / denf
        one_minus_u = (den - rel).to(tl.float32) / denf
        up = tl.where(u > 0, tl.exp(pos_power * tl.log(tl.maximum(u, 1e-30))), 0.0)
        return w_pos * (-pos_beta * up + pos_eta * tl.log(tl.maximum(one_minus_u, eps)))

    @triton.jit
    def _tile_inputs(row, offs, lo, hi, ev_ptr, s_ev_b, s_ev_h, s_ev_l, kn_ptr, s_kn_b, s_kn_h, s_kn_l, H,
                     gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps, H_PAD: tl.constexpr):
        """All heads' pooled ``log f`` (``-inf`` outside A) and unnormalised ``log r`` (key norm and
        position) at positions ``offs``, ``[H_PAD, T]``; with the heads ``hs``, their mask ``hm`` and
        the mask ``m2`` of (head, position in A)."""
        hs = tl.arange(0, H_PAD)
        hm = hs < H
        in_a = (offs >= lo) & (offs < hi)
        m2 = hm[:, None] & in_a[None, :]
        rb = row.to(tl.int64)
        hb = hs.to(tl.int64)[:, None]
        lf = tl.load(ev_ptr + rb * s_ev_b + hb * s_ev_h + offs[None, :] * s_ev_l, mask=m2,
                     other=float("-inf")).to(tl.float32)
        kn = tl.load(kn_ptr + rb * s_kn_b + hb * s_kn_h + offs[None, :] * s_kn_l, mask=m2,
                     other=1.0).to(tl.float32)
        lp = _pos_prior(offs, lo, tl.maximum(hi - lo - 1, 1), w_pos, pos_power, pos_eta, pos_beta, eps)
        lr = w_k * (-gamma_k * tl.log(tl.maximum(kn, eps))) + lp[None, :]
        return hs, hm, m2, lf, lr

    @triton.jit
    def _key(s):
        """Order-preserving uint32 key of fp32 scores (NaN -> the key of -inf)."""
        s = tl.where(s != s, float("-inf"), s)
        bits = s.to(tl.int32, bitcast=True)
        return (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) ^ (-2147483648)).to(tl.uint32, bitcast=True)

    @triton.jit
    def _bucket(s, m_up):
        """Histogram bucket of a score: its distance below the upper bound ``m_up``, log-spaced
        (bucket 0: < 2^-6; then 16 sub-buckets per octave; 255: >= 2^10, -inf, NaN). Non-increasing
        in the score, so a better score never falls in a later bucket."""
        d = m_up - s
        d = tl.where(d == d, tl.maximum(d, 0.0), float("inf"))
        b = (d.to(tl.int32, bitcast=True) >> 19) - 1936         # (127 - 6) * 16: 2^-6 in bucket 0
        return tl.minimum(tl.maximum(b, 0), 255)

    @triton.jit
    def _threshold_bucket(hist_base, n_sel, NB: tl.constexpr):
        """The bucket b* holding the n_sel-th best score; scores in buckets < b* (n_above of them)
        are all selected."""
        bins = tl.arange(0, NB)
        hist = tl.load(hist_base + bins)
        cum = tl.cumsum(hist, 0)
        bstar = tl.sum((cum < n_sel).to(tl.int32), axis=0)
        n_above = tl.sum(tl.where(bins < bstar, hist, 0), axis=0)
        return bstar, n_above

    @triton.jit
    def _candidate(cand_base, idx, n_items, lo, list_mode, sc):
        """Candidate ``idx`` of a (row, head): its position (from the list, or ``lo + idx`` when the
        list overflowed) and score, and whether it exists."""
        im = idx < n_items
        pos = tl.load(cand_base + idx, mask=im & list_mode, other=0)
        pos = tl.where(list_mode, pos, lo + idx)
        return pos, tl.load(sc + pos, mask=im, other=0.0), im

    @triton.jit
    def _mx(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _shift(x, d: tl.constexpr, T: tl.constexpr, H_PAD: tl.constexpr, GATHER: tl.constexpr, scr):
        """y[:, i] = x[:, clamp(i + d, 0, T - 1)]: an on-chip ``tl.gather``, or (``GATHER`` off) through
        this program's region of a global scratch (``scr``, ``H_PAD x T`` floats)."""
        i = tl.arange(0, T)
        idx = tl.minimum(tl.maximum(i + d, 0), T - 1)
        if GATHER:
            y = tl.gather(x, tl.broadcast_to(idx[None, :], (H_PAD, T)), 1)
        else:
            rows = tl.arange(0, H_PAD)[:, None] * T
            tl.debug_barrier()                     # the previous shift's readers are done
            tl.store(scr + rows + i[None, :], x)
            tl.debug_barrier()
            y = tl.load(scr + rows + idx[None, :])
        return y

    @triton.jit
    def _window_max(x, A: tl.constexpr, B: tl.constexpr, T: tl.constexpr, H_PAD: tl.constexpr,
                    GW: tl.constexpr, BS: tl.constexpr, KL: tl.constexpr, GATHER: tl.constexpr, scr):
        """m[:, i] = max x[:, i - A .. i + B], valid for A <= i < T - B (elsewhere garbage).
        ``BS = A + B``; ``KL = floor(log2(A + B + 1))`` (the sparse table's levels)."""
        if GW:
            # van Herk / Gil-Werman with blocks of BS = A + B: [i - A, i + B] (BS + 1 long) spans two
            # consecutive blocks: the suffix max of x[i - A] and the prefix max of x[i + B].
            t1 = _shift(x, -A, T, H_PAD, GATHER, scr)
            suf = tl.reshape(tl.associative_scan(tl.reshape(t1, (H_PAD, T // BS, BS)), 2, _mx, reverse=True),
                             (H_PAD, T))
            if B > 0:
                t2 = _shift(x, B, T, H_PAD, GATHER, scr)
            else:
                t2 = x
            pre = tl.reshape(tl.associative_scan(tl.reshape(t2, (H_PAD, T // BS, BS)), 2, _mx), (H_PAD, T))
            res = tl.maximum(suf, pre)
        else:
            # sparse table: W_k = max over [i, i + 2^k), then two overlapping windows of 2^KL
            w = x
            for kk in tl.static_range(KL):
                w = tl.maximum(w, _shift(w, 1 << kk, T, H_PAD, GATHER, scr))
            res = tl.maximum(_shift(w, -A, T, H_PAD, GATHER, scr),
                             _shift(w, B + 1 - (1 << KL), T, H_PAD, GATHER, scr))
        return res

    # ----------------------------------------------------------------------- 0. 4-D evidence pooling
    @_kernel
    def _pool_kernel(COUNT, ROWS, ev_ptr, s_ev_b, s_ev_h, s_ev_r, s_ev_l, out_ptr, s_out_b, s_out_h,
                     lo_ptr, s_lo, hi_ptr, s_hi, H, L, R, log_R, alpha, inv_alpha,
                     R_PAD: tl.constexpr, BLOCK_L: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * H, tl.num_programs(0)):
            row, h, lo, hi = _row_item(it, H, lo_ptr, s_lo, hi_ptr, s_hi, L)
            ev_base = _head_base(ev_ptr, row, h, s_ev_b, s_ev_h)
            out_base = _head_base(out_ptr, row, h, s_out_b, s_out_h)
            ar = tl.arange(0, BLOCK_L)
            offs_r = tl.arange(0, R_PAD)
            rmask = offs_r < R
            ninf = float("-inf")
            m_row = tl.full([R_PAD], ninf, tl.float32)
            s_row = tl.zeros([R_PAD], dtype=tl.float32)
            for j0 in range(lo, hi, BLOCK_L):                     # per evidence row: logsumexp over A
                offs = j0 + ar
                lm = offs < hi
                x = tl.load(ev_base + offs_r[:, None] * s_ev_r + offs[None, :] * s_ev_l,
                            mask=rmask[:, None] & lm[None, :], other=ninf).to(tl.float32)
                nm = tl.maximum(m_row, tl.max(x, axis=1))
                safe = tl.where(nm == ninf, 0.0, nm)
                s_row = s_row * tl.exp(m_row - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
                m_row = nm
            lse_r = tl.where(s_row > 0, m_row + tl.log(tl.maximum(s_row, 1e-30)), ninf)
            for j0 in range(lo, hi, BLOCK_L):                     # power mean -> unnormalised log f
                offs = j0 + ar
                lm = offs < hi
                x = tl.load(ev_base + offs_r[:, None] * s_ev_r + offs[None, :] * s_ev_l,
                            mask=rmask[:, None] & lm[None, :], other=ninf).to(tl.float32)
                ok = (lse_r > ninf)[:, None] & (x > ninf)
                y = tl.where(ok, alpha * (x - lse_r[:, None]), ninf)
                ym = tl.max(y, axis=0)
                ys = tl.where(ym == ninf, 0.0, ym)
                ps = tl.sum(tl.exp(y - ys[None, :]), axis=0)
                lf = tl.where(ps > 0, (ys + tl.log(tl.maximum(ps, 1e-30)) - log_R) * inv_alpha, ninf)
                tl.store(out_base + offs, lf, mask=lm)

    # ---------------------------------------------------------------------- 1. partial statistics
    @_kernel
    def _stats_kernel(COUNT, ROWS, NC, ev_ptr, s_ev_b, s_ev_h, s_ev_l, kn_ptr, s_kn_b, s_kn_h, s_kn_l,
                      lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, st_ptr, C1_WS,
                      H, L, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps,
                      T: tl.constexpr, H_PAD: tl.constexpr, K_TENSOR: tl.constexpr, SKIP_ALL: tl.constexpr,
                      HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * NC, tl.num_programs(0)):
            row, c, lo, hi = _row_item(it, NC, lo_ptr, s_lo, hi_ptr, s_hi, L)
            p0 = c * T
            if _needs_scores((p0 < hi) & (p0 + T > lo), row, lo, hi, k_ptr, s_k, k_val, k_min, width,
                             K_TENSOR, SKIP_ALL):
                ninf = float("-inf")
                hs, hm, m2, lf, lr = _tile_inputs(row, p0 + tl.arange(0, T), lo, hi, ev_ptr, s_ev_b, s_ev_h,
                                                  s_ev_l, kn_ptr, s_kn_b, s_kn_h, s_kn_l, H, gamma_k, w_k,
                                                  w_pos, pos_power, pos_eta, pos_beta, eps, H_PAD)
                lr = tl.where(m2, lr, ninf)
                lf = tl.where(m2, lf, ninf)
                m_f = tl.max(lf, axis=1)
                m_r = tl.max(lr, axis=1)
                e_f = tl.exp(lf - tl.where(m_f == ninf, 0.0, m_f)[:, None])
                e_r = tl.exp(lr - tl.where(m_r == ninf, 0.0, m_r)[:, None])
                base = st_ptr + ((row.to(tl.int64) * H + hs) * C1_WS + c) * 8
                tl.store(base + 0, m_f, mask=hm)
                tl.store(base + 1, m_r, mask=hm)
                tl.store(base + 2, tl.sum(e_f, axis=1), mask=hm)
                tl.store(base + 3, tl.sum(e_r, axis=1), mask=hm)
                tl.store(base + 4, tl.sum(e_f * e_f, axis=1), mask=hm)
                tl.store(base + 5, tl.sum(e_r * e_r, axis=1), mask=hm)
                tl.store(base + 6, tl.sum(e_f * e_r, axis=1), mask=hm)

    # -------------------------------------------------------------------- 2. merge -> lam, coefs
    @_kernel
    def _merge_kernel(COUNT, ROWS, st_ptr, C1_WS, consts_ptr, hist_ptr, cnt_ptr, lo_ptr, s_lo, hi_ptr, s_hi,
                      k_ptr, s_k, k_val, k_min, width, H, L, lambda_max, eps,
                      T1: tl.constexpr, C1_PAD: tl.constexpr, NB: tl.constexpr, K_TENSOR: tl.constexpr,
                      SKIP_ALL: tl.constexpr, PREP_TOPK: tl.constexpr, WRITE_LAM: tl.constexpr,
                      HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * H, tl.num_programs(0)):
            pid = _i32(it)
            row, _, lo, hi = _row_item(it, H, lo_ptr, s_lo, hi_ptr, s_hi, L)
            ninf = float("-inf")
            if _needs_scores(hi > lo, row, lo, hi, k_ptr, s_k, k_val, k_min, width, K_TENSOR, SKIP_ALL):
                cs = tl.arange(0, C1_PAD)
                cm = (cs >= lo // T1) & (cs < (hi + T1 - 1) // T1)
                base = st_ptr + (pid.to(tl.int64) * C1_WS + cs) * 8
                m_f = tl.load(base + 0, mask=cm, other=ninf)
                m_r = tl.load(base + 1, mask=cm, other=ninf)
                mf = tl.max(m_f, axis=0)
                mr = tl.max(m_r, axis=0)
                w_f = tl.exp(m_f - tl.where(mf == ninf, 0.0, mf))
                w_r = tl.exp(m_r - tl.where(mr == ninf, 0.0, mr))
                s_f = tl.sum(tl.load(base + 2, mask=cm, other=0.0) * w_f, axis=0)
                s_r = tl.sum(tl.load(base + 3, mask=cm, other=0.0) * w_r, axis=0)
                s_ff = tl.sum(tl.load(base + 4, mask=cm, other=0.0) * (w_f * w_f), axis=0)
                s_rr = tl.sum(tl.load(base + 5, mask=cm, other=0.0) * (w_r * w_r), axis=0)
                s_fr = tl.sum(tl.load(base + 6, mask=cm, other=0.0) * (w_f * w_r), axis=0)
                has_f = s_f > 0
                has_r = s_r > 0
                z_f = tl.where(has_f, mf + tl.log(tl.maximum(s_f, 1e-30)), ninf)
                z_r = tl.where(has_r, mr + tl.log(tl.maximum(s_r, 1e-30)), ninf)
                ff = tl.where(has_f, s_ff / tl.maximum(s_f * s_f, 1e-30), 0.0)
                rr = tl.where(has_r, s_rr / tl.maximum(s_r * s_r, 1e-30), 0.0)
                fr = tl.where(has_f & has_r, s_fr / tl.maximum(s_f * s_r, 1e-30), 0.0)
                lam = (ff - fr) / tl.maximum(ff - 2.0 * fr + rr, eps)
                lam = tl.minimum(tl.maximum(lam, 0.0), lambda_max)
                coef_f = tl.where(has_f & (lam < 1.0), tl.log(tl.maximum(1.0 - lam, 1e-30)) - z_f, ninf)
                coef_r = tl.where(has_r & (lam > 0.0), tl.log(tl.maximum(lam, 1e-30)) - z_r, ninf)
                # an upper bound of every score of the head: Soft-NMS and exclusivity only lower the fused one
                u1 = coef_f + mf
                u2 = coef_r + mr
                mx = tl.maximum(u1, u2)
                mn = tl.minimum(u1, u2)
                m_up = tl.where(mx == ninf, ninf, mx + tl.log(1.0 + tl.exp(mn - mx)))
                cb = consts_ptr + pid.to(tl.int64) * 4
                tl.store(cb + 0, coef_f)
                tl.store(cb + 1, coef_r)
                tl.store(cb + 2, m_up)
                tl.store(cb + 3, lam)
                if PREP_TOPK:
                    tl.store(hist_ptr + pid.to(tl.int64) * NB + tl.arange(0, NB), tl.zeros([NB], dtype=tl.int32))
                    tl.store(cnt_ptr + pid, 0)
            else:
                if WRITE_LAM:
                    tl.store(consts_ptr + pid.to(tl.int64) * 4 + 3, 0.0)   # lam of an empty set (the twin's 0)

    # ------------------------------------------------------------------------------ 3. scores
    @_kernel
    def _score_kernel(COUNT, ROWS, NC, ev_ptr, s_ev_b, s_ev_h, s_ev_l, kn_ptr, s_kn_b, s_kn_h, s_kn_l,
                      lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width,
                      consts_ptr, out_ptr, s_out_b, s_out_h, scr_ptr,
                      H, L, gamma_k, w_k, w_pos, pos_power, pos_eta, pos_beta, eps,
                      mu, inv_temp, lam_x, log_eps,
                      T: tl.constexpr, H_PAD: tl.constexpr, RADIUS: tl.constexpr, SPAN: tl.constexpr,
                      SPAN_BACK: tl.constexpr, HALO_L: tl.constexpr, HALO_R: tl.constexpr, OUT: tl.constexpr,
                      DO_NMS: tl.constexpr, DO_X: tl.constexpr,
                      NMS_GW: tl.constexpr, SPAN_GW: tl.constexpr, NMS_KL: tl.constexpr, SPAN_KL: tl.constexpr,
                      K_TENSOR: tl.constexpr, SKIP_ALL: tl.constexpr, GATHER: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * NC, tl.num_programs(0)):
            row, c, lo, hi = _row_item(it, NC, lo_ptr, s_lo, hi_ptr, s_hi, L)
            q0 = c * OUT                                   # this program writes positions [q0, q0 + OUT)
            if _needs_scores((q0 < hi) & (q0 + OUT > lo), row, lo, hi, k_ptr, s_k, k_val, k_min, width,
                             K_TENSOR, SKIP_ALL):
                ninf = float("-inf")
                i = tl.arange(0, T)
                offs = q0 - HALO_L + i
                hs, hm, m2, lf, lr = _tile_inputs(row, offs, lo, hi, ev_ptr, s_ev_b, s_ev_h, s_ev_l, kn_ptr,
                                                  s_kn_b, s_kn_h, s_kn_l, H, gamma_k, w_k, w_pos, pos_power,
                                                  pos_eta, pos_beta, eps, H_PAD)
                rb = row.to(tl.int64)
                cb = consts_ptr + (rb * H + hs) * 4
                coef_f = tl.load(cb + 0, mask=hm, other=ninf)
                coef_r = tl.load(cb + 1, mask=hm, other=ninf)
                # fused log s = logaddexp(log(1 - lam) + log f, log(lam) + log r), normalisations folded in
                u1 = coef_f[:, None] + lf
                u2 = coef_r[:, None] + lr
                mx = tl.maximum(u1, u2)
                mn = tl.minimum(u1, u2)
                l = tl.where(m2 & (mx > ninf), mx + tl.log(1.0 + tl.exp(mn - mx)), ninf)
                scr = scr_ptr + (rb * NC + c) * (H_PAD * T)     # unused with GATHER
                if DO_NMS:
                    m = _window_max(l, RADIUS, RADIUS, T, H_PAD, NMS_GW, 2 * RADIUS, NMS_KL, GATHER, scr)
                    fin = l > ninf
                    l = tl.where(fin, l - mu * tl.maximum(m - l, 0.0), ninf)
                if DO_X:
                    z = l * inv_temp
                    zm = tl.max(z, axis=0)
                    zs = tl.where(zm == ninf, 0.0, zm)
                    lse = zs + tl.log(tl.sum(tl.exp(z - zs[None, :]), axis=0))
                    fin = l > ninf
                    log_rho = tl.where(fin, z - lse[None, :], 0.0)
                    l = tl.where(fin, l + lam_x * tl.maximum(log_rho, log_eps), ninf)
                l = tl.where(l != l, ninf, l)
                if SPAN + SPAN_BACK > 0:                   # sfi.select_span(_back): max over [j - span, j + back] in A
                    l = tl.where(m2, _window_max(l, SPAN, SPAN_BACK, T, H_PAD, SPAN_GW, SPAN + SPAN_BACK, SPAN_KL,
                                                 GATHER, scr), ninf)
                om = m2 & ((i >= HALO_L) & (i < HALO_L + OUT))[None, :]
                tl.store(out_ptr + rb * s_out_b + hs.to(tl.int64)[:, None] * s_out_h + offs[None, :], l, mask=om)

    # ----------------------------------------------------------------- 3b. excluded positions
    @_kernel
    def _exclude_kernel(COUNT, ROWS, score_ptr, s_sc_b, s_sc_h, ex_ptr, s_ex_b, s_ex_h, s_ex_e, E, slot_ptr,
                        n_ex_ptr, lo_ptr, s_lo, hi_ptr, s_hi, H, L, tab_ptr, s_tab, tab_first, s_ex_c,
                        PAGE_ELEMS, PAGE_TOKENS, PAGE_C, BLOCK: tl.constexpr,
                        HAS_COUNT: tl.constexpr, HAS_SLOT: tl.constexpr, HAS_N: tl.constexpr,
                        PAGED: tl.constexpr):
        # sfi.keep_prefill: the kept positions of a (row, head) score -inf before the top-K (the twin's
        # exclude_positions); padding (< 0) and positions outside A are ignored. PAGED: the table is
        # kept in KV-cache pages (``vllm_ext.kernels.paged_rows``): element h * E + e of a slot's
        # [H, E] rows lives in block tab[slot, tab_first + f // PAGE_ELEMS] of the page memory
        # ``ex_ptr [blocks, heads, PAGE_TOKENS, PAGE_C]``
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * H, tl.num_programs(0)):
            row, h, lo, hi = _row_item(it, H, lo_ptr, s_lo, hi_ptr, s_hi, L)
            sc = _head_base(score_ptr, row, h, s_sc_b, s_sc_h)
            entry = row
            if HAS_SLOT:                                   # a table indexed by the row's slot
                entry = tl.load(slot_ptr + row)
                hi = tl.where(entry >= 0, hi, lo)
                entry = tl.maximum(entry, 0)
            ex = _head_base(ex_ptr, entry, h, s_ex_b, s_ex_h)
            n_e = E
            if HAS_N:                                      # only the row's first n entries count
                n_e = tl.minimum(tl.maximum(tl.load(n_ex_ptr + row), 0), E)
            ar = tl.arange(0, BLOCK)
            for e0 in range(0, E, BLOCK):
                e = e0 + ar
                if PAGED:
                    f = h * E + e
                    r = f % PAGE_ELEMS
                    blk = tl.load(tab_ptr + entry.to(tl.int64) * s_tab + tab_first + f // PAGE_ELEMS,
                                  mask=e < n_e, other=0)
                    addr = (ex_ptr + blk.to(tl.int64) * s_ex_b + (r // (PAGE_TOKENS * PAGE_C)) * s_ex_h
                            + ((r // PAGE_C) % PAGE_TOKENS) * s_ex_e + (r % PAGE_C) * s_ex_c)
                    pos = tl.load(addr, mask=e < n_e, other=-1)
                else:
                    pos = tl.load(ex + e * s_ex_e, mask=e < n_e, other=-1)
                ok = (e < n_e) & (pos >= lo) & (pos < hi)
                tl.store(sc + pos, tl.full([BLOCK], float("-inf"), tl.float32), mask=ok)

    # ------------------------------------------------------------------------- 4. histogram
    @_kernel
    def _hist_kernel(COUNT, ROWS, NC, score_ptr, s_sc_b, s_sc_h, consts_ptr, hist_ptr, lo_ptr, s_lo, hi_ptr,
                     s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK,
                     NB: tl.constexpr, BLOCK: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * (H * NC), tl.num_programs(0)):
            pid, c, sc, lo, hi, n_sel, c0, c1 = _head_chunk_item(it, NC, H, CHUNK, score_ptr, s_sc_b, s_sc_h, lo_ptr,
                                                                  s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width,
                                                                  L, K_TENSOR)
            if (c0 < c1) & (n_sel > 0) & (n_sel < hi - lo):
                m_up = tl.load(consts_ptr + pid.to(tl.int64) * 4 + 2)
                ar = tl.arange(0, BLOCK)
                acc = tl.zeros([NB], dtype=tl.int32)
                for j0 in range(c * CHUNK, c1, BLOCK):          # blocks aligned to absolute positions
                    offs = j0 + ar
                    lm = (offs >= c0) & (offs < c1)
                    s = tl.load(sc + offs, mask=lm, other=0.0)
                    acc += tl.histogram(_bucket(s, m_up), NB, mask=lm)
                bins = tl.arange(0, NB)
                tl.atomic_add(hist_ptr + pid.to(tl.int64) * NB + bins, acc, mask=acc > 0)

    # --------------------------------------------------------------------------- 5. compaction
    @_kernel
    def _compact_kernel(COUNT, ROWS, NC, score_ptr, s_sc_b, s_sc_h, consts_ptr, hist_ptr, cnt_ptr, cand_ptr,
                        above_ptr, lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK, CW_WS,
                        CAP, NB: tl.constexpr, BLOCK: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * (H * NC), tl.num_programs(0)):
            pid, c, sc, lo, hi, n_sel, c0, c1 = _head_chunk_item(it, NC, H, CHUNK, score_ptr, s_sc_b, s_sc_h, lo_ptr,
                                                                  s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width,
                                                                  L, K_TENSOR)
            if (c0 < c1) & (n_sel > 0) & (n_sel < hi - lo):
                m_up = tl.load(consts_ptr + pid.to(tl.int64) * 4 + 2)
                bstar, n_above = _threshold_bucket(hist_ptr + pid.to(tl.int64) * NB, n_sel, NB)
                cand_base = cand_ptr + pid.to(tl.int64) * CAP
                ar = tl.arange(0, BLOCK)
                above = tl.zeros([], dtype=tl.int32)
                for j0 in range(c * CHUNK, c1, BLOCK):
                    offs = j0 + ar
                    lm = (offs >= c0) & (offs < c1)
                    b = _bucket(tl.load(sc + offs, mask=lm, other=0.0), m_up)
                    above += tl.sum((lm & (b < bstar)).to(tl.int32), axis=0)
                    cand = lm & (b == bstar)
                    ci = cand.to(tl.int32)
                    nc = tl.sum(ci, axis=0)
                    if nc > 0:
                        slot = tl.atomic_add(cnt_ptr + pid, nc) + tl.cumsum(ci, 0) - ci
                        tl.store(cand_base + slot, offs, mask=cand & (slot < CAP))
                tl.store(above_ptr + pid.to(tl.int64) * CW_WS + c, above)

    # ---------------------------------------------------------------- 6. exact select + offsets
    @_kernel
    def _finish_kernel(COUNT, ROWS, score_ptr, s_sc_b, s_sc_h, consts_ptr, hist_ptr, cnt_ptr, cand_ptr,
                       above_ptr, prefix_ptr, thresh_ptr, sel_ptr, nsel_ptr, nprev_ptr,
                       lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK, CW_WS,
                       CAP, NB: tl.constexpr, BLOCK: tl.constexpr, CW_PAD: tl.constexpr,
                       POS_LEVELS: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        n_live = _n_live(COUNT, ROWS, HAS_COUNT)
        for it in range(tl.program_id(0), ROWS * H, tl.num_programs(0)):   # every row: n_sel, padding
            pid = _i32(it)
            row, h, lo, hi = _row_item(it, H, lo_ptr, s_lo, hi_ptr, s_hi, L)
            if HAS_COUNT:                               # rows past the live prefix: empty
                hi = tl.where(row < n_live, hi, lo)
            n = hi - lo
            n_sel = tl.minimum(_keff(row, k_ptr, s_k, k_val, k_min, width, K_TENSOR), n)
            n_sel = tl.maximum(n_sel, 0)
            if h == 0:
                tl.store(nsel_ptr + row, n_sel)
            # -1 padding: only what the previous call wrote past n_sel (entries >= n_prev are -1 already)
            n_prev = tl.load(nprev_ptr + pid)
            if n_prev != n_sel:
                ob = sel_ptr + pid.to(tl.int64) * width
                arb = tl.arange(0, BLOCK)
                for w0 in range(n_sel, n_prev, BLOCK):
                    idx = w0 + arb
                    tl.store(ob + idx, tl.full([BLOCK], -1, tl.int32), mask=idx < n_prev)
                tl.store(nprev_ptr + pid, n_sel)
            if (n_sel > 0) & (n_sel < n):
                sc = _head_base(score_ptr, row, h, s_sc_b, s_sc_h)
                m_up = tl.load(consts_ptr + pid.to(tl.int64) * 4 + 2)
                bstar, n_above = _threshold_bucket(hist_ptr + pid.to(tl.int64) * NB, n_sel, NB)
                cnt = tl.load(cnt_ptr + pid)
                list_mode = cnt <= CAP                      # else the list overflowed: scan all of A
                n_items = tl.where(list_mode, cnt, n)
                cand_base = cand_ptr + pid.to(tl.int64) * CAP
                ar = tl.arange(0, BLOCK)
                bins = tl.arange(0, NB)

                # radix select over the candidates' keys: the (n_sel - n_above)-th largest, 8 bits a pass
                prefix = tl.zeros([], dtype=tl.uint32)
                remaining = n_sel - n_above
                eq_total = tl.zeros([], dtype=tl.int32)
                for p in tl.static_range(4):
                    shift = 24 - 8 * p
                    acc = tl.zeros([NB], dtype=tl.int32)
                    for t0 in range(0, n_items, BLOCK):
                        pos, s, im = _candidate(cand_base, t0 + ar, n_items, lo, list_mode, sc)
                        key = _key(s)
                        match = im & (_bucket(s, m_up) == bstar)
                        if p > 0:
                            match = match & ((key >> (shift + 8)) == prefix)
                        acc += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), NB, mask=match)
                    cge = tl.cumsum(acc, 0, reverse=True)     # candidates with digit >= d
                    dsel = tl.max(tl.where(cge >= remaining, bins, 0), axis=0)
                    remaining = remaining - tl.sum(tl.where(bins == dsel, cge - acc, 0), axis=0)
                    eq_total = tl.sum(tl.where(bins == dsel, acc, 0), axis=0)
                    prefix = (prefix << 8) | dsel.to(tl.uint32)
                t_key = prefix

                # ties at T: the `remaining` lowest positions among them (radix select over positions)
                p_tie = tl.full([], 2147483647, tl.int32)
                if remaining < eq_total:
                    pprefix = tl.zeros([], dtype=tl.int32)
                    r = remaining
                    for p in tl.static_range(POS_LEVELS):
                        pshift = 8 * (POS_LEVELS - 1 - p)
                        acc = tl.zeros([NB], dtype=tl.int32)
                        for t0 in range(0, n_items, BLOCK):
                            pos, s, im = _candidate(cand_base, t0 + ar, n_items, lo, list_mode, sc)
                            match = im & (_key(s) == t_key)
                            if p > 0:
                                match = match & ((pos >> (pshift + 8)) == pprefix)
                            acc += tl.histogram((pos >> pshift) & 0xFF, NB, mask=match)
                        cle = tl.cumsum(acc, 0)                 # ties with digit <= d
                        dsel = tl.min(tl.where(cle >= r, bins, NB - 1), axis=0)
                        r = r - tl.sum(tl.where(bins == dsel, cle - acc, 0), axis=0)
                        pprefix = (pprefix << 8) | dsel
                    p_tie = pprefix
                tb = thresh_ptr + pid.to(tl.int64) * 2
                tl.store(tb + 0, t_key.to(tl.int32, bitcast=True))
                tl.store(tb + 1, p_tie)

                # output offset of every chunk: selected scores in the chunks before it
                cs = tl.arange(0, CW_PAD)
                chist = tl.zeros([CW_PAD], dtype=tl.int32)
                for t0 in range(0, n_items, BLOCK):
                    pos, s, im = _candidate(cand_base, t0 + ar, n_items, lo, list_mode, sc)
                    key = _key(s)
                    sel = im & (_bucket(s, m_up) == bstar) & ((key > t_key) | ((key == t_key) & (pos <= p_tie)))
                    chist += tl.histogram(pos // CHUNK, CW_PAD, mask=sel)
                cm = (cs >= lo // CHUNK) & (cs < (hi + CHUNK - 1) // CHUNK)
                above = tl.load(above_ptr + pid.to(tl.int64) * CW_WS + cs, mask=cm, other=0)
                tot = tl.where(cm, above + chist, 0)
                tl.store(prefix_ptr + pid.to(tl.int64) * CW_WS + cs, tl.cumsum(tot, 0) - tot, mask=cm)

    # ---------------------------------------------------------------------------------- 7. write
    @_kernel
    def _write_kernel(COUNT, ROWS, NC, score_ptr, s_sc_b, s_sc_h, thresh_ptr, prefix_ptr, sel_ptr,
                      lo_ptr, s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width, H, L, CHUNK, CW_WS,
                      BLOCK: tl.constexpr, K_TENSOR: tl.constexpr, HAS_COUNT: tl.constexpr):
        for it in range(tl.program_id(0), _n_live(COUNT, ROWS, HAS_COUNT) * (H * NC), tl.num_programs(0)):
            pid, c, sc, lo, hi, n_sel, c0, c1 = _head_chunk_item(it, NC, H, CHUNK, score_ptr, s_sc_b, s_sc_h, lo_ptr,
                                                                  s_lo, hi_ptr, s_hi, k_ptr, s_k, k_val, k_min, width,
                                                                  L, K_TENSOR)
            if (c0 < c1) & (n_sel > 0):
                ob = sel_ptr + pid.to(tl.int64) * width
                ar = tl.arange(0, BLOCK)
                if n_sel >= hi - lo:                            # all of A
                    for j0 in range(c0, c1, BLOCK):
                        offs = j0 + ar
                        tl.store(ob + (offs - lo), offs, mask=offs < c1)
                else:
                    t_key = tl.load(thresh_ptr + pid.to(tl.int64) * 2).to(tl.uint32, bitcast=True)
                    p_tie = tl.load(thresh_ptr + pid.to(tl.int64) * 2 + 1)
                    dst0 = tl.load(prefix_ptr + pid.to(tl.int64) * CW_WS + c)
                    for j0 in range(c * CHUNK, c1, BLOCK):
                        offs = j0 + ar
                        lm = (offs >= c0) & (offs < c1)
                        key = _key(tl.load(sc + offs, mask=lm, other=0.0))
                        sel = lm & ((key > t_key) | ((key == t_key) & (offs <= p_tie)))
                        si = sel.to(tl.int32)
                        tl.store(ob + dst0 + tl.cumsum(si, 0) - si, offs, mask=sel)
                        dst0 += tl.sum(si, axis=0)
