"""SFI fast-step decode: attention over the compact segment plus the recent window read in place.

For each batch row ``r`` and KV head ``h`` the G query heads of the group attend to

* segment 1, the compact segment ``compact_kv[slot_idx[r], h, :compact_len[slot_idx[r]]]``
  (sink + selected entries, contiguous), and
* segment 2, the recent window, positions ``[recent_start[r], seq_lens[r])`` read in place from
  the paged cache through ``block_table``.

The two are disjoint by construction; the result is softmax attention over their union.

Kernel: split-K over the virtual concatenation ``compact ++ recent`` (``num_splits`` chunks per
(row, KV head)); each program walks its share of the compact part and then of the paged part with
an online softmax, the G query heads padded to a 16-row ``tl.dot`` tile so each KV entry is loaded
once per group. Partial ``(out, lse)`` pairs are merged by log-sum-exp (``merge_state``'s reduce);
with ``num_splits == 1`` the kernel writes ``out`` directly.

Conventions: ``kv_cache`` is vLLM's logical ``[num_blocks, Hkv, block_size, 2*D]`` view with any
strides; ``compact_kv`` is ``[num_slots, Hkv, capacity, 2*D]`` (any strides too), or, with
``compact_table [num_slots, n_c]`` (int32), paged like the KV cache: ``compact_kv [num_blocks, Hkv,
bs_c, 2*D]`` and entry ``e`` of slot ``s`` at ``compact_kv[compact_table[s, e // bs_c], :, e % bs_c]``
(capacity ``n_c * bs_c``; vLLM's blocks of SFI's own KV-cache group, ``vllm_ext.methods.sfi.kv_spec``). A row is active
iff ``row_mask[r] != 0`` (when given) and ``seq_lens[r] > 0``; inactive rows are left untouched.
No host synchronisation; pass a :func:`two_segment_workspace` to avoid allocation.

fp8 pages (``kernels.kv_quant``): ``kv_cache`` the fp8 view with the layer's ``k_scale`` /
``v_scale``; the compact segment holds the pages' stored values (the same fp8 dtype: half the bytes
of bf16 per entry) and takes the same scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.merge_state import launch_merge_states
from vllm_ext.kernels.triton_utils import (HAS_TRITON, autotune, dot_in_fp32, fixed_meta,
                                           launch_meta, next_pow2, num_sms, untuned, use_triton)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------
# Shared Triton building blocks (also used by dense_decode_evidence)
# ----------------------------------------------------------------------------------------------

def _configs():
    """Decode tiles to autotune on CUDA (memory-bound: a few tile sizes, warps and stages)."""
    if not HAS_TRITON:
        return []
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bn, w, s in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 2),
                             (128, 4, 2), (128, 8, 2), (128, 8, 3))]


if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.program_rows import program_row

    @triton.jit
    def _load_group_q(Q, row, h, s_q_r, s_q_h, s_q_d,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        qm = (offs_g < G)[:, None] & (offs_d < D)[None, :]
        q = tl.load(Q + row.to(tl.int64) * s_q_r + (h * G + offs_g)[:, None] * s_q_h
                    + offs_d[None, :] * s_q_d, mask=qm, other=0.0)
        return q

    @triton.jit
    def _widen(x, q):
        """fp8 K or V (as stored) in the query's dtype for the dot (exact for both fp8 formats)."""
        if x.dtype.is_fp8():
            x = x.to(q.dtype)
        return x

    @triton.jit
    def _kv_scale_factors(qk_scale, KS, VS, KV_SCALED: tl.constexpr):
        """The score scale with ``k_scale`` folded in and the output factor ``v_scale`` (1 when the
        pages are not scaled: ``kernels.kv_quant``)."""
        vsc = qk_scale * 0.0 + 1.0
        if KV_SCALED:
            qk_scale = qk_scale * tl.load(KS)
            vsc = tl.load(VS)
        return qk_scale, vsc

    @triton.jit
    def _scores(q, k, qk_scale, F32_DOT: tl.constexpr):
        """``q [BG, BD]`` x ``k [BN, BD]`` -> scaled scores ``[BG, BN]`` (log2 units)."""
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            k = _widen(k, q)
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        return s * qk_scale

    @triton.jit
    def _online_update(s, v, m_i, l_i, acc, F32_DOT: tl.constexpr):
        """One online-softmax step. ``s [BG, BN]`` log2-unit scores (-inf = invisible)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        corr = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * corr + tl.sum(p, 1)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            acc = acc * corr[:, None] + pv
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * corr[:, None])
        return m_new, l_i, acc

    @triton.jit
    def _store_state(acc, m_i, l_i, vsc, row, out_row, h, split, PO, PLSE, OUT,
                     s_po_r, s_po_s, s_po_h, s_po_d, s_pl_r, s_pl_s, s_pl_h,
                     s_o_r, s_o_h, s_o_d,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, DIRECT: tl.constexpr):
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        gm = offs_g < G
        om = gm[:, None] & (offs_d < D)[None, :]
        # vsc: v_scale of fp8 pages (the output is linear in V), else 1
        inv = tl.where(l_i > 0, vsc / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        heads = h * G + offs_g
        if DIRECT:
            tl.store(OUT + out_row.to(tl.int64) * s_o_r + heads[:, None] * s_o_h + offs_d[None, :] * s_o_d,
                     o.to(OUT.dtype.element_ty), mask=om)
        else:
            base = row.to(tl.int64) * s_po_r + split * s_po_s
            tl.store(PO + base + heads[:, None] * s_po_h + offs_d[None, :] * s_po_d, o, mask=om)
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            lse = tl.where(l_i > 0, (m_safe + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(PLSE + row.to(tl.int64) * s_pl_r + split * s_pl_s + heads * s_pl_h, lse, mask=gm)

    @triton.jit
    def _paged_row_offsets(BT, row, pos, valid, s_bt_r, s_bt_b, h, s_kv_b, s_kv_h, s_kv_n,
                           PAGE: tl.constexpr):
        blk = tl.load(BT + row.to(tl.int64) * s_bt_r + (pos // PAGE) * s_bt_b, mask=valid, other=0)
        return blk.to(tl.int64) * s_kv_b + h * s_kv_h + (pos % PAGE).to(tl.int64) * s_kv_n

    @triton.jit
    def _load_kv_rows(KV, rowoff, valid, s_kv_c, D: tl.constexpr, BLOCK_D: tl.constexpr):
        offs_d = tl.arange(0, BLOCK_D)
        lm = valid[:, None] & (offs_d < D)[None, :]
        k = tl.load(KV + rowoff[:, None] + offs_d[None, :] * s_kv_c, mask=lm, other=0.0)
        v = tl.load(KV + rowoff[:, None] + (offs_d[None, :] + D) * s_kv_c, mask=lm, other=0.0)
        return k, v

    @triton.jit
    def _kv_scores(q, KV, rowoff, valid, s_kv_c, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   F32_DOT: tl.constexpr):
        """K and V of the cache entries at ``rowoff`` and the group's scores on them (``-inf`` where
        not ``valid``)."""
        k, v = _load_kv_rows(KV, rowoff, valid, s_kv_c, D, BLOCK_D)
        k = _widen(k, q)
        v = _widen(v, q)
        s = _scores(q, k, qk_scale, F32_DOT)
        return k, v, tl.where(valid[None, :], s, float("-inf"))

    @triton.jit
    def _paged_kv_scores(q, KV, BT, row, h, pos, valid, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c, qk_scale,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, F32_DOT: tl.constexpr):
        """:func:`_kv_scores` of the keys at positions ``pos`` of a row's paged cache."""
        rowoff = _paged_row_offsets(BT, row, pos, valid, s_bt_r, s_bt_b, h, s_kv_b, s_kv_h, s_kv_n, PAGE)
        k, v, s = _kv_scores(q, KV, rowoff, valid, s_kv_c, qk_scale, D, BLOCK_D, F32_DOT)
        return k, v, s

    @autotune(configs=_configs(), key=["G", "D", "NUM_SPLITS", "PAGE", "DIRECT"])
    @triton.jit
    def _two_segment_kernel(
        Q, KV, BT, SEQ, RSTART, CKV, CLEN, SLOT, MASK, CTAB, PO, PLSE, OUT, KS, VS,
        s_q_r, s_q_h, s_q_d,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_ckv_s, s_ckv_h, s_ckv_n, s_ckv_c,
        s_ct_s, s_ct_b,
        s_po_r, s_po_s, s_po_h, s_po_d,
        s_pl_r, s_pl_s, s_pl_h,
        s_o_r, s_o_h, s_o_d,
        CAP, qk_scale, NUM_SPLITS,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_CTAB: tl.constexpr, CPAGE: tl.constexpr,
        F32_DOT: tl.constexpr, DIRECT: tl.constexpr, KV_SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        h = tl.program_id(1)
        split = tl.program_id(2)
        row, seq_len = program_row(tl.program_id(0), MASK, MASK, SEQ, False, HAS_MASK, True)
        if seq_len <= 0:
            return
        # the compact segment holds the pages' stored values: one pair of scales for both segments
        qk_scale, vsc = _kv_scale_factors(qk_scale, KS, VS, KV_SCALED)
        slot = tl.load(SLOT + row)
        clen = tl.load(CLEN + tl.maximum(slot, 0))
        clen = tl.minimum(tl.maximum(clen, 0), CAP)
        clen = tl.where(slot < 0, 0, clen)
        rstart = tl.minimum(tl.maximum(tl.load(RSTART + row), 0), seq_len)
        total = clen + (seq_len - rstart)
        chunk = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, total)

        q = _load_group_q(Q, row, h, s_q_r, s_q_h, s_q_d, G, BLOCK_G, D, BLOCK_D)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)

        # segment 1: compact entries [start, min(end, clen))
        c_end = tl.minimum(end, clen)
        cbase = tl.maximum(slot, 0).to(tl.int64) * s_ckv_s + h * s_ckv_h
        for n0 in range(start, c_end, BLOCK_N):
            idx = n0 + offs_n
            valid = idx < c_end
            if HAS_CTAB:
                # paged compact segment: the slot's block-table row, as the recent window's
                cblk = tl.load(CTAB + tl.maximum(slot, 0).to(tl.int64) * s_ct_s + (idx // CPAGE) * s_ct_b,
                               mask=valid, other=0)
                rowoff = (cblk.to(tl.int64) * s_ckv_s + h * s_ckv_h
                          + (idx % CPAGE).to(tl.int64) * s_ckv_n)
            else:
                rowoff = cbase + idx.to(tl.int64) * s_ckv_n
            _, v, s = _kv_scores(q, CKV, rowoff, valid, s_ckv_c, qk_scale, D, BLOCK_D, F32_DOT)
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, F32_DOT)

        # segment 2: recent window, virtual indices [max(start, clen), end) -> positions
        p_begin = tl.maximum(start, clen)
        for n0 in range(p_begin, end, BLOCK_N):
            idx = n0 + offs_n
            valid = idx < end
            pos = rstart + (idx - clen)
            _, v, s = _paged_kv_scores(q, KV, BT, row, h, pos, valid, s_bt_r, s_bt_b, s_kv_b, s_kv_h, s_kv_n, s_kv_c,
                                       qk_scale, D, BLOCK_D, PAGE, F32_DOT)
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, F32_DOT)

        _store_state(acc, m_i, l_i, vsc, row, row, h, split, PO, PLSE, OUT,
                     s_po_r, s_po_s, s_po_h, s_po_d, s_pl_r, s_pl_s, s_pl_h,
                     s_o_r, s_o_h, s_o_d, G, BLOCK_G, D, BLOCK_D, DIRECT)


def _interp_meta() -> dict:
    # Autotune off (interpreter, SPEEDSFI_AUTOTUNE=0): pass the meta-parameters explicitly.
    return launch_meta({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, {"BLOCK_N": 32})


# ----------------------------------------------------------------------------------------------
# Workspace and split heuristic
# ----------------------------------------------------------------------------------------------

@dataclass
class SplitWorkspace:
    """Scratch of a split-K decode, flat fp32 buffers viewed as partial outputs ``[R, S, Hq, D]`` and
    LSEs ``[R, S, Hq]`` for any ``R * S <= row_splits``: the split count shrinks as rows grow, so the
    scratch follows ``max_R R * splits(R)``, not ``max_rows * max_splits``."""
    partial_out: torch.Tensor          # flat [row_splits * Hq * D]
    partial_lse: torch.Tensor          # flat [row_splits * Hq]
    num_heads: int
    head_size: int

    @property
    def row_splits(self) -> int:
        return self.partial_lse.numel() // self.num_heads

    def fits(self, num_rows: int, num_heads: int, head_size: int, num_splits: int) -> bool:
        return (num_heads == self.num_heads and head_size == self.head_size
                and num_rows * num_splits <= self.row_splits)

    def views(self, num_rows: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = num_rows * num_splits
        h, d = self.num_heads, self.head_size
        return (self.partial_out[: n * h * d].view(num_rows, num_splits, h, d),
                self.partial_lse[: n * h].view(num_rows, num_splits, h))

    @property
    def nbytes(self) -> int:
        return (self.partial_out.numel() + self.partial_lse.numel()) * 4


def default_num_splits(num_rows: int, num_kv_heads: int, est_len: int,
                       device: torch.device | str | None, *, waves: float = 2.0,
                       min_per_split: int = 256, max_splits: int = 32) -> int:
    """Split count from shapes only (CUDA-graph stable): enough programs for ``waves`` waves of
    the GPU's SMs, at least ``min_per_split`` entries per split, at most ``max_splits``."""
    progs = max(1, num_rows * num_kv_heads)
    want = max(1, math.ceil(waves * num_sms(device) / progs))
    useful = max(1, -(-int(est_len) // min_per_split))
    return int(max(1, min(want, useful, max_splits)))


# Measured on H100 (bench/bench_fast_step.py, batch 16 x 8 KV heads = 128 programs): the
# two-segment kernel saturates HBM with one program per SM (its compact segment is contiguous) and
# a second split only adds the merge; the dense paged kernel wants ~2 waves.
TWO_SEGMENT_WAVES = 0.75
DENSE_WAVES = 2.0
# the tile of masked launches (rows decided on the device, so not autotuned: triton_utils.untuned);
# bench/tune_fixed_tiles.py sweeps it
MASKED_META = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def two_segment_num_splits(num_rows: int, num_kv_heads: int, est_len: int, device) -> int:
    """Default split count of :func:`two_segment_decode` (``est_len`` = capacity + recent bound)."""
    return default_num_splits(num_rows, num_kv_heads, est_len, device, waves=TWO_SEGMENT_WAVES)


def dense_num_splits(num_rows: int, num_kv_heads: int, est_len: int, device) -> int:
    """Default split count of the dense paged decode (``est_len`` = max context)."""
    return default_num_splits(num_rows, num_kv_heads, est_len, device, waves=DENSE_WAVES)


def two_segment_workspace(num_rows: int, num_heads: int, head_size: int, num_splits: int,
                          device: torch.device | str, *, row_splits: int | None = None
                          ) -> SplitWorkspace:
    """Allocate once: scratch for up to ``num_rows`` rows x ``num_splits`` splits (or any shape with
    ``R * S <= row_splits`` when given: see :func:`max_row_splits`)."""
    n = int(row_splits) if row_splits is not None else max(int(num_rows), 1) * max(int(num_splits), 1)
    return SplitWorkspace(torch.empty(n * num_heads * head_size, dtype=torch.float32, device=device),
                          torch.empty(n * num_heads, dtype=torch.float32, device=device),
                          num_heads, head_size)


def max_row_splits(max_rows: int, split_fn) -> int:
    """``max_{1 <= R <= max_rows} R * split_fn(R)``: the workspace a split heuristic needs."""
    return max(r * int(split_fn(r)) for r in range(1, max(int(max_rows), 1) + 1))


def _est_recent(kv_cache: torch.Tensor, block_table: torch.Tensor, max_recent: int | None) -> int:
    if max_recent is not None:
        return int(max_recent)
    return int(block_table.shape[1]) * int(kv_cache.shape[2])


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------

def compact_capacity(compact_kv: torch.Tensor, compact_table: torch.Tensor | None) -> int:
    """Entries one slot's compact segment can hold (contiguous or paged layout, module doc)."""
    if compact_table is None:
        return int(compact_kv.shape[2])
    return int(compact_table.shape[1]) * int(compact_kv.shape[2])


def compact_entries(compact_kv: torch.Tensor, compact_table: torch.Tensor | None, slot: int,
                    n: int) -> torch.Tensor:
    """Entries ``[0, n)`` of slot ``slot``'s compact segment as ``[Hkv, n, 2D]`` (a view for the
    contiguous layout; for the paged one a gather of its first ``ceil(n / bs_c)`` blocks)."""
    if compact_table is None:
        return compact_kv[slot, :, :n]
    bs = compact_kv.shape[2]
    nb = -(-n // bs)
    if nb == 0:
        return compact_kv.new_empty((compact_kv.shape[1], 0, compact_kv.shape[3]))
    blocks = compact_kv.index_select(0, compact_table[slot, :nb].long())          # [nb, H, bs, 2D]
    return blocks.transpose(0, 1).reshape(compact_kv.shape[1], nb * bs, -1)[:, :n]


def two_segment_decode(query, kv_cache, block_table, seq_lens, recent_start, compact_kv,
                       compact_len, slot_idx, scale, out, row_mask=None, *, num_splits=None,
                       max_recent=None, workspace=None, compact_table=None, k_scale=None, v_scale=None):
    """Fast-step decode attention (see module doc). Writes ``out [R, Hq, D]`` in place and returns it.

    ``num_splits``: split-K count (default from shapes: :func:`two_segment_num_splits`, the compact
    capacity plus ``max_recent`` entries). ``max_recent``: a host-side bound on the recent window
    length (default ``max_blocks * block_size``); it only sizes the split heuristic and the PyTorch
    twin's gather. ``workspace``: a :class:`SplitWorkspace` (from :func:`two_segment_workspace`).
    ``compact_table``: the paged compact layout (module doc); ``None``: contiguous.
    ``k_scale``, ``v_scale``: the per-tensor scales of fp8 pages (``kernels.kv_quant``).
    """
    if not use_triton(query):
        return two_segment_decode_torch(query, kv_cache, block_table, seq_lens, recent_start,
                                        compact_kv, compact_len, slot_idx, scale, out, row_mask,
                                        num_splits=num_splits, max_recent=max_recent,
                                        workspace=workspace, compact_table=compact_table,
                                        k_scale=k_scale, v_scale=v_scale)
    num_rows, hq, d = query.shape
    hkv = kv_cache.shape[1]
    assert kv_cache.shape[-1] == 2 * d and compact_kv.shape[-1] == 2 * d
    assert hq % hkv == 0, "query heads must be a multiple of KV heads"
    assert compact_kv.shape[1] == hkv
    g = hq // hkv
    if num_rows == 0:
        return out
    if num_splits is None:
        num_splits = two_segment_num_splits(
            num_rows, hkv, compact_capacity(compact_kv, compact_table)
            + _est_recent(kv_cache, block_table, max_recent),
            query.device)
    num_splits = int(num_splits)
    direct = num_splits == 1
    if direct:
        po, pl = out, out  # unused pointers
        po_strides, pl_strides = (0, 0, 0, 0), (0, 0, 0)
    else:
        if workspace is None or not workspace.fits(num_rows, hq, d, num_splits):
            workspace = two_segment_workspace(num_rows, hq, d, num_splits, query.device)
        po, pl = workspace.views(num_rows, num_splits)
        po_strides, pl_strides = po.stride(), pl.stride()
    has_mask = row_mask is not None
    grid = (num_rows, hkv, num_splits)
    # a masked launch's work is decided on the device: fixed config (see triton_utils.untuned)
    kernel = untuned(_two_segment_kernel) if has_mask else _two_segment_kernel
    meta = fixed_meta(MASKED_META, {"BLOCK_N": 32}) if has_mask else _interp_meta()
    has_ctab = compact_table is not None
    ks, vs, kv_scaled = kv_quant.launch_scales(kv_cache.dtype, k_scale, v_scale, out)
    kernel[grid](
        query, kv_cache, block_table, seq_lens, recent_start, compact_kv, compact_len, slot_idx,
        row_mask if has_mask else seq_lens, compact_table if has_ctab else slot_idx, po, pl, out, ks, vs,
        *query.stride(), *kv_cache.stride(), *block_table.stride(), *compact_kv.stride(),
        *(compact_table.stride() if has_ctab else (0, 0)),
        *po_strides, *pl_strides, *out.stride(),
        compact_capacity(compact_kv, compact_table), float(scale) * LOG2E, num_splits,
        G=g, BLOCK_G=max(16, next_pow2(g)), D=d, BLOCK_D=max(16, next_pow2(d)),
        PAGE=kv_cache.shape[2], HAS_MASK=has_mask, HAS_CTAB=has_ctab,
        CPAGE=compact_kv.shape[2] if has_ctab else 1,
        F32_DOT=dot_in_fp32(kv_cache.dtype, query.dtype), DIRECT=direct, KV_SCALED=kv_scaled, **meta)
    if not direct:
        launch_merge_states(po, pl, out, None, row_mask=row_mask, row_lens=seq_lens)
    return out


# ----------------------------------------------------------------------------------------------
# PyTorch twin
# ----------------------------------------------------------------------------------------------

def gather_paged_rows(kv_cache: torch.Tensor, block_table: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every row at ``positions [R, N]`` (any value; out-of-range ones are clamped, the
    caller masks them) -> ``[R, Hkv, N, D]`` each, in the cache dtype. No host sync."""
    bs = kv_cache.shape[2]
    d = kv_cache.shape[-1] // 2
    nb = kv_cache.shape[0]
    mb = block_table.shape[1]
    pos = positions.long().clamp_min(0)
    bidx = (pos // bs).clamp_max(max(mb - 1, 0))
    blocks = torch.gather(block_table.long(), 1, bidx).clamp(0, max(nb - 1, 0))   # [R, N]
    ent = kv_cache[blocks, :, pos % bs]                                          # [R, N, H, 2D]
    ent = ent.permute(0, 2, 1, 3)                                                # [R, H, N, 2D]
    return ent[..., :d], ent[..., d:]


def live_length(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> int:
    """How many positions a twin's dense pass covers: the block table's width (no host sync), or on
    the CPU, where reading the lengths costs nothing, the longest row rounded up to a block."""
    width = block_table.shape[1] * block_size
    if seq_lens.device.type != "cpu" or seq_lens.numel() == 0:
        return width
    return max(min(width, -(-int(seq_lens.max()) // block_size) * block_size), block_size)


def gather_paged_prefix(kv_cache: torch.Tensor, block_table: torch.Tensor,
                        length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every row at positions ``[0, length)`` (``length`` a multiple of the block size; the
    caller masks what lies beyond a row's own length) -> ``[R, Hkv, length, D]`` each. Gathers whole
    blocks, not tokens. No host sync."""
    bs = kv_cache.shape[2]
    d = kv_cache.shape[-1] // 2
    n_blocks = length // bs
    r, h = block_table.shape[0], kv_cache.shape[1]
    blocks = block_table[:, :n_blocks].long().clamp(0, max(kv_cache.shape[0] - 1, 0))
    ent = kv_cache.index_select(0, blocks.flatten()).view(r, n_blocks, *kv_cache.shape[1:])  # [R, nb, H, N, 2D]
    ent = ent.transpose(1, 2).reshape(r, h, n_blocks * bs, 2 * d)               # [R, H, L, 2D]
    return ent[..., :d], ent[..., d:]


def batched_masked_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention per row. query ``[R, Hq, D]``, k/v ``[R, Hkv, N, D]``, mask ``[R, N]`` or
    ``[R, Hq, N]`` (True = visible) -> (out ``[R, Hq, D]``, lse ``[R, Hq]``); rows with nothing
    visible give zeros and ``-inf``."""
    r, hq, d = query.shape
    hkv = k.shape[1]
    g = hq // hkv
    q = query.float().reshape(r, hkv, g, d)
    s = torch.einsum("rhgd,rhnd->rhgn", q, k.float()) * scale                # [R, Hkv, G, N]
    if mask.dim() == 2:
        m = mask[:, None, None, :]
    else:
        m = mask.reshape(r, hkv, g, -1)
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                         # [R, Hkv, G]
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe.unsqueeze(-1))
    p = torch.where(m, p, torch.zeros_like(p))
    o = torch.einsum("rhgn,rhnd->rhgd", p, v.float())
    return o.reshape(r, hq, d), lse.reshape(r, hq)


def active_rows(seq_lens: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    act = seq_lens > 0
    if row_mask is not None:
        act = act & (row_mask != 0).to(act.device)
    return act


def two_segment_decode_torch(query, kv_cache, block_table, seq_lens, recent_start, compact_kv,
                             compact_len, slot_idx, scale, out, row_mask=None, *, num_splits=None,
                             max_recent=None, workspace=None, compact_table=None, k_scale=None,
                             v_scale=None):
    """PyTorch twin of :func:`two_segment_decode` (fp32 math, no host sync, no Python row loop); on
    the CPU :func:`two_segment_decode_cpu` (same result). fp8 K and V are dequantised."""
    del num_splits, workspace
    num_rows, hq, d = query.shape
    if num_rows == 0:
        return out
    if query.device.type == "cpu":
        return two_segment_decode_cpu(query, kv_cache, block_table, seq_lens, recent_start, compact_kv,
                                      compact_len, slot_idx, scale, out, row_mask, max_recent=max_recent,
                                      compact_table=compact_table, native=True, k_scale=k_scale,
                                      v_scale=v_scale)
    dev = query.device
    cap = compact_capacity(compact_kv, compact_table)
    seq = seq_lens.long()
    slot = slot_idx.long()
    n_slots = compact_kv.shape[0] if compact_table is None else compact_table.shape[0]
    slot_c = slot.clamp(0, n_slots - 1)
    clen = compact_len.long()[slot_c].clamp(0, cap)
    clen = torch.where(slot < 0, torch.zeros_like(clen), clen)
    if compact_table is None:
        ckv = compact_kv[slot_c]                                              # [R, Hkv, C, 2D]
        ck, cv = ckv[..., :d], ckv[..., d:]
    else:
        ck, cv = gather_paged_rows(compact_kv, compact_table[slot_c],
                                   torch.arange(cap, device=dev)[None, :].expand(num_rows, cap))
    cmask = torch.arange(cap, device=dev)[None, :] < clen[:, None]            # [R, C]

    w = _est_recent(kv_cache, block_table, max_recent)
    rstart = torch.minimum(recent_start.long().clamp_min(0), seq)
    pos = rstart[:, None] + torch.arange(w, device=dev)[None, :]              # [R, W]
    rmask = pos < seq[:, None]
    rk, rv = gather_paged_rows(kv_cache, block_table, pos)

    ks = kv_quant.twin_scale(kv_cache.dtype, k_scale)
    vs = kv_quant.twin_scale(kv_cache.dtype, v_scale)
    k = torch.cat([kv_quant.dequantize(ck.to(rk.dtype), ks), kv_quant.dequantize(rk, ks)], dim=2)
    v = torch.cat([kv_quant.dequantize(cv.to(rv.dtype), vs), kv_quant.dequantize(rv, vs)], dim=2)
    mask = torch.cat([cmask, rmask], dim=1)
    o, _ = batched_masked_attention(query, k, v, mask, scale)
    act = active_rows(seq_lens, row_mask)
    out.copy_(torch.where(act[:, None, None], o.to(out.dtype), out))
    return out


def two_segment_decode_cpu(query, kv_cache, block_table, seq_lens, recent_start, compact_kv, compact_len,
                           slot_idx, scale, out, row_mask=None, *, max_recent=None, compact_table=None,
                           native=False, k_scale=None, v_scale=None):
    """The twin on the CPU, where reading lengths costs nothing and the vectorised form's padding
    to the widest row dominates: per active row, the compact segment and the recent window's blocks
    (gathered once) copied, converted to fp32 in the same pass, into a persistent buffer, then one
    fused attention (``scaled_dot_product_attention``) with the GQA group's query heads as query
    rows of their KV head (each KV head's keys read once).

    ``native`` (the backend's call): the compiled pass (:func:`vllm_ext.kernels.cpu_native.two_segment`:
    every row and KV head at once, the pages read in place) where it applies; this loop is its
    twin and runs where it does not. fp8 pages: ``k_scale`` folded into the score scale,
    ``v_scale`` into the output (read on the host: CPU tensors)."""
    import torch.nn.functional as F

    from vllm_ext.kernels.paged_reference import _scratch_buffer

    num_rows, hq, d = query.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[1]
    g = hq // hkv
    cap = compact_capacity(compact_kv, compact_table)
    n_slots = compact_kv.shape[0] if compact_table is None else min(compact_table.shape[0], compact_len.shape[0])
    w = _est_recent(kv_cache, block_table, max_recent)
    ks = kv_quant.host_scale(kv_cache.dtype, k_scale)
    vs = kv_quant.host_scale(kv_cache.dtype, v_scale)
    if native:
        from vllm_ext.kernels import cpu_native

        if cpu_native.two_segment(query, kv_cache, block_table, seq_lens, recent_start, compact_kv, compact_table,
                                  cap, compact_len, slot_idx, scale, out, row_mask, w, k_scale=ks, v_scale=vs):
            return out
    act = active_rows(seq_lens, row_mask).tolist()
    seqs, starts, slots = seq_lens.tolist(), recent_start.tolist(), slot_idx.tolist()
    lens = compact_len.tolist()
    for r in range(num_rows):
        if not act[r]:
            continue
        seq = seqs[r]
        slot = slots[r]
        clen = 0 if slot < 0 or slot >= n_slots else max(0, min(int(lens[slot]), cap))
        rs = min(max(starts[r], 0), seq)
        re = min(seq, rs + w)
        n = clen + max(re - rs, 0)
        if n == 0:
            out[r] = 0
            continue
        kv = _scratch_buffer(hkv * n * 2 * d, torch.float32, query.device, tag="two_segment")
        kv = kv.view(hkv, n, 2 * d)                                              # [H, n, 2D] fp32
        if clen:
            kv[:, :clen].copy_(compact_entries(compact_kv, compact_table, slot, clen))
        if re > rs:
            b0, b1 = rs // bs, (re - 1) // bs + 1
            blk = kv_cache.index_select(0, block_table[r, b0:b1].long())       # [nb, H, N, 2D]
            blk = blk.transpose(0, 1).reshape(hkv, (b1 - b0) * bs, 2 * d)[:, rs - b0 * bs: re - b0 * bs]
            if blk.dtype != compact_kv.dtype:
                blk = blk.to(compact_kv.dtype)                                  # as the compact segment
            kv[:, clen:].copy_(blk)
        q = query[r].float().view(1, hkv, g, d)                                 # [1, Hkv, G, D]
        o = F.scaled_dot_product_attention(q, kv[None, ..., :d], kv[None, ..., d:], scale=scale * ks)
        if vs != 1.0:
            o = o * vs
        out[r] = o[0].reshape(hq, d).to(out.dtype)
    return out
