"""SFI compact segment: copy sink + selected KV entries from the paged cache into a contiguous buffer.

``gather_compact(kv_cache, block_table, slot_idx, selected, n_sel, n_sink, compact_kv, compact_len,
row_mask=None, *, seq_lens=None)`` writes, for each active row ``r`` (slot ``s = slot_idx[r]``) and
KV head ``h``::

    compact_kv[s, h, i]            = kv_cache entry of position i                     (i < ns)
    compact_kv[s, h, ns + i]       = kv_cache entry of position selected[r, h, i]     (i < nsel)
    compact_len[s]                 = ns + nsel

with ``ns = min(n_sink, seq_lens[r])`` (``n_sink`` when ``seq_lens`` is not given) and
``nsel = clamp(n_sel[r], 0, min(K, capacity - ns))``.

With ``offset [R]`` (``sfi.keep_prefill``) the selected entries go after the ``off = offset[r]``
entries a previous call left behind the sink, which are not touched::

    compact_kv[s, h, ns + off + i] = kv_cache entry of position selected[r, h, i]     (i < nsel)
    compact_len[s]                 = ns + off + nsel

with ``nsel = clamp(n_sel[r], 0, min(K, capacity - ns - off))`` (``off`` clamped to
``[0, capacity - ns]``). Entries of ``selected`` at index ``>= nsel``
are unused (conventionally ``-1``); an entry ``< 0`` (or ``>= seq_lens[r]`` when given) inside the
first ``nsel`` is a caller error: it is skipped, leaving that compact entry as it was.

With ``compact_table [num_slots, n_c]`` (int32) the compact segments are paged like the KV cache
(``vllm_ext.kernels.two_segment_decode``, module doc): ``compact_kv [num_blocks, Hkv, bs_c, 2D]``,
entry ``e`` of slot ``s`` at ``compact_kv[compact_table[s, e // bs_c], :, e % bs_c]``, ``capacity =
n_c * bs_c``; ``compact_len`` stays per slot.

Active rows must map to distinct slots. A row is active iff ``row_mask[r] != 0`` (when given),
``slot_idx[r] >= 0`` and, when ``seq_lens``
is given, ``seq_lens[r] > 0``; inactive rows touch nothing. Compact entries past ``compact_len``
keep stale values (the decode kernel never reads them). No host sync, no allocation.

fp8 pages (``kernels.kv_quant``): the compact segment has the pages' fp8 dtype and the gather copies
the stored bytes unchanged (no scale is applied: the segment carries the pages' scales), so an entry
is half its bf16 size.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, num_sms, use_triton
from vllm_ext.kernels.two_segment_decode import compact_capacity, compact_entries

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ext.kernels.program_rows import program_row

    @triton.jit
    def _gather_block(row, h, eb, slot, KV, BT, SEL, NSEL, CKV, CLEN, SEQ, OFF, CTAB,
                      s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b, s_sel_r, s_sel_h, s_sel_k,
                      s_ckv_s, s_ckv_h, s_ckv_n, s_ckv_c, s_ct_s, s_ct_b, N_SINK, K, CAP,
                      C2: tl.constexpr, BLOCK_C: tl.constexpr, PAGE: tl.constexpr,
                      HAS_SEQ: tl.constexpr, HAS_OFF: tl.constexpr, BLOCK_E: tl.constexpr,
                      HAS_CTAB: tl.constexpr, CPAGE: tl.constexpr):
        # entries [eb * BLOCK_E, +BLOCK_E) of one (row, KV head); the row is live (slot >= 0)
        ns = N_SINK
        seq_len = 0
        if HAS_SEQ:
            seq_len = tl.load(SEQ + row)
            ns = tl.minimum(ns, seq_len)
        ns = tl.minimum(ns, CAP)
        off = 0
        if HAS_OFF:
            off = tl.minimum(tl.maximum(tl.load(OFF + row), 0), CAP - ns)
        nsel = tl.minimum(tl.maximum(tl.load(NSEL + row), 0), tl.minimum(K, CAP - ns - off))
        if (h == 0) & (eb == 0):
            tl.store(CLEN + slot, ns + off + nsel)
        e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
        is_sink = e < ns
        si = e - ns
        is_sel = (e >= ns) & (si < nsel)
        sel = tl.load(SEL + row.to(tl.int64) * s_sel_r + h * s_sel_h + si * s_sel_k,
                      mask=is_sel, other=-1)
        pos = tl.where(is_sink, e, sel)
        valid = (is_sink | is_sel) & (pos >= 0)
        if HAS_SEQ:
            valid = valid & (pos < seq_len)
        blk = tl.load(BT + row.to(tl.int64) * s_bt_r + (pos // PAGE) * s_bt_b, mask=valid, other=0)
        src = blk.to(tl.int64) * s_kv_b + h * s_kv_h + (pos % PAGE).to(tl.int64) * s_kv_n
        # entry e of the sink + selected list; selected entries land after the kept ones
        de = tl.where(is_sink, e, e + off)
        if HAS_CTAB:
            dblk = tl.load(CTAB + slot.to(tl.int64) * s_ct_s + (de // CPAGE) * s_ct_b, mask=valid, other=0)
            dst = dblk.to(tl.int64) * s_ckv_s + h * s_ckv_h + (de % CPAGE).to(tl.int64) * s_ckv_n
        else:
            dst = slot.to(tl.int64) * s_ckv_s + h * s_ckv_h + de.to(tl.int64) * s_ckv_n
        offs_c = tl.arange(0, BLOCK_C)
        for c0 in range(0, C2, BLOCK_C):
            c = c0 + offs_c
            m = valid[:, None] & (c < C2)[None, :]
            x = tl.load(KV + src[:, None] + c[None, :] * s_kv_c, mask=m)
            tl.store(CKV + dst[:, None] + c[None, :] * s_ckv_c, x.to(CKV.dtype.element_ty), mask=m)

    @triton.jit
    def _gather_compact_kernel(
        KV, BT, SLOT, SEL, NSEL, CKV, CLEN, MASK, SEQ, OFF, CTAB,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_sel_r, s_sel_h, s_sel_k,
        s_ckv_s, s_ckv_h, s_ckv_n, s_ckv_c,
        s_ct_s, s_ct_b,
        N_SINK, K, CAP,
        C2: tl.constexpr, BLOCK_C: tl.constexpr, PAGE: tl.constexpr,
        HAS_MASK: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_OFF: tl.constexpr, BLOCK_E: tl.constexpr,
        HAS_CTAB: tl.constexpr, CPAGE: tl.constexpr,
    ):
        h = tl.program_id(1)
        eb = tl.program_id(2)
        row, live = program_row(tl.program_id(0), MASK, MASK, SEQ, False, HAS_MASK, HAS_SEQ)
        slot = tl.load(SLOT + row)
        if (live <= 0) | (slot < 0):
            return
        _gather_block(row, h, eb, slot, KV, BT, SEL, NSEL, CKV, CLEN, SEQ, OFF, CTAB,
                      s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b, s_sel_r, s_sel_h, s_sel_k,
                      s_ckv_s, s_ckv_h, s_ckv_n, s_ckv_c, s_ct_s, s_ct_b, N_SINK, K, CAP,
                      C2, BLOCK_C, PAGE, HAS_SEQ, HAS_OFF, BLOCK_E, HAS_CTAB, CPAGE)

    @triton.jit
    def _gather_compact_persistent_kernel(
        COUNT, KV, BT, SLOT, SEL, NSEL, CKV, CLEN, SEQ, OFF, CTAB,
        s_kv_b, s_kv_h, s_kv_n, s_kv_c,
        s_bt_r, s_bt_b,
        s_sel_r, s_sel_h, s_sel_k,
        s_ckv_s, s_ckv_h, s_ckv_n, s_ckv_c,
        s_ct_s, s_ct_b,
        N_SINK, K, CAP, NUM_EB,
        HKV: tl.constexpr, C2: tl.constexpr, BLOCK_C: tl.constexpr, PAGE: tl.constexpr,
        HAS_SEQ: tl.constexpr, HAS_OFF: tl.constexpr, BLOCK_E: tl.constexpr,
        HAS_CTAB: tl.constexpr, CPAGE: tl.constexpr,
    ):
        # rows [0, COUNT) are live (a compacted list): a fixed grid walks only their blocks
        per_row = HKV * NUM_EB
        for item in range(tl.program_id(0), tl.load(COUNT) * per_row, tl.num_programs(0)):
            row = item // per_row
            h = (item % per_row) // NUM_EB
            eb = item % NUM_EB
            slot = tl.load(SLOT + row)
            _gather_block(row, h, eb, slot, KV, BT, SEL, NSEL, CKV, CLEN, SEQ, OFF, CTAB,
                          s_kv_b, s_kv_h, s_kv_n, s_kv_c, s_bt_r, s_bt_b, s_sel_r, s_sel_h,
                          s_sel_k, s_ckv_s, s_ckv_h, s_ckv_n, s_ckv_c, s_ct_s, s_ct_b, N_SINK, K, CAP,
                          C2, BLOCK_C, PAGE, HAS_SEQ, HAS_OFF, BLOCK_E, HAS_CTAB, CPAGE)


def gather_compact(kv_cache, block_table, slot_idx, selected, n_sel, n_sink, compact_kv,
                   compact_len, row_mask=None, *, seq_lens=None, count=None, offset=None,
                   compact_table=None):
    """Build each active row's compact segment (see module doc). Returns ``compact_kv``.

    ``count`` (int32 ``[1]`` on the device, no ``row_mask``): rows ``[0, count)`` are the live ones
    (a compacted list; each has ``slot_idx >= 0`` and a positive length); a fixed grid then walks
    only their work, so a launch with no live row costs one small wave. ``offset``, ``compact_table``:
    see the module doc."""
    if kv_quant.is_fp8(kv_cache.dtype) and compact_kv.dtype != kv_cache.dtype:
        raise ValueError(f"gather_compact: the compact segment of {kv_cache.dtype} pages stores "
                         f"{kv_cache.dtype} (the stored bytes, with the pages' scales), not {compact_kv.dtype}")
    if not use_triton(kv_cache):
        if count is not None and row_mask is None and kv_cache.device.type == "cpu":
            live = max(0, min(slot_idx.shape[0], int(count.reshape(-1)[0])))   # free on the CPU
            if live == 0:
                return compact_kv

            def cut(t):
                return t[:live] if t is not None else None
            slot_idx, block_table, selected, n_sel = cut(slot_idx), cut(block_table), cut(selected), cut(n_sel)
            seq_lens, offset = cut(seq_lens), cut(offset)
        if kv_cache.device.type == "cpu":
            return gather_compact_cpu(kv_cache, block_table, slot_idx, selected, n_sel, n_sink,
                                      compact_kv, compact_len, row_mask, seq_lens=seq_lens, offset=offset,
                                      compact_table=compact_table, native=True)
        return gather_compact_torch(kv_cache, block_table, slot_idx, selected, n_sel, n_sink,
                                    compact_kv, compact_len, row_mask, seq_lens=seq_lens, offset=offset,
                                    compact_table=compact_table)
    num_rows = slot_idx.shape[0]
    hkv = kv_cache.shape[1]
    assert compact_kv.shape[1] == hkv and compact_kv.shape[-1] == kv_cache.shape[-1]
    assert selected.shape[:2] == (num_rows, hkv)
    if num_rows == 0:
        return compact_kv
    k = selected.shape[2]
    cap = compact_capacity(compact_kv, compact_table)
    c2 = kv_cache.shape[-1]
    block_e = 32
    has_ctab = compact_table is not None
    ctab = compact_table if has_ctab else slot_idx
    ct_strides = compact_table.stride() if has_ctab else (0, 0)
    cpage = compact_kv.shape[2] if has_ctab else 1
    n_ent = min(cap, int(n_sink) + k)
    num_eb = max(1, triton.cdiv(n_ent, block_e))
    if count is not None and row_mask is None:
        progs = min(num_rows * hkv * num_eb, 2 * num_sms(kv_cache.device))
        _gather_compact_persistent_kernel[(max(progs, 1),)](
            count, kv_cache, block_table, slot_idx, selected, n_sel, compact_kv, compact_len,
            seq_lens if seq_lens is not None else slot_idx, offset if offset is not None else slot_idx,
            ctab, *kv_cache.stride(), *block_table.stride(), *selected.stride(), *compact_kv.stride(),
            *ct_strides, int(n_sink), k, cap, num_eb,
            HKV=hkv, C2=c2, BLOCK_C=min(next_pow2(c2), 256), PAGE=kv_cache.shape[2],
            HAS_SEQ=seq_lens is not None, HAS_OFF=offset is not None, BLOCK_E=block_e,
            HAS_CTAB=has_ctab, CPAGE=cpage)
        return compact_kv
    grid = (num_rows, hkv, num_eb)
    _gather_compact_kernel[grid](
        kv_cache, block_table, slot_idx, selected, n_sel, compact_kv, compact_len,
        row_mask if row_mask is not None else slot_idx,
        seq_lens if seq_lens is not None else slot_idx, offset if offset is not None else slot_idx,
        ctab, *kv_cache.stride(), *block_table.stride(), *selected.stride(), *compact_kv.stride(),
        *ct_strides, int(n_sink), k, cap,
        C2=c2, BLOCK_C=min(next_pow2(c2), 256), PAGE=kv_cache.shape[2],
        HAS_MASK=row_mask is not None, HAS_SEQ=seq_lens is not None, HAS_OFF=offset is not None,
        BLOCK_E=block_e, HAS_CTAB=has_ctab, CPAGE=cpage)
    return compact_kv


def gather_compact_torch(kv_cache, block_table, slot_idx, selected, n_sel, n_sink, compact_kv,
                         compact_len, row_mask=None, *, seq_lens=None, offset=None, compact_table=None):
    """PyTorch twin of :func:`gather_compact` (no host sync, no row loop)."""
    num_rows = slot_idx.shape[0]
    if num_rows == 0:
        return compact_kv
    if compact_table is not None:
        return _gather_compact_paged_torch(kv_cache, block_table, slot_idx, selected, n_sel, n_sink,
                                           compact_kv, compact_len, row_mask, seq_lens=seq_lens,
                                           offset=offset, compact_table=compact_table)
    dev = kv_cache.device
    hkv = kv_cache.shape[1]
    bs = kv_cache.shape[2]
    cap = compact_kv.shape[2]
    k = selected.shape[2]
    # with an offset the whole capacity is rewritten (the kept entries with their current values)
    n_ent = cap if offset is not None else min(cap, int(n_sink) + k)
    slot = slot_idx.long()
    act = slot >= 0
    if row_mask is not None:
        act = act & (row_mask != 0).to(dev)
    ns = torch.full((num_rows,), int(n_sink), dtype=torch.long, device=dev)
    if seq_lens is not None:
        seq = seq_lens.long()
        act = act & (seq > 0)
        ns = torch.minimum(ns, seq)
    ns = ns.clamp(max=cap)
    off = (torch.zeros_like(ns) if offset is None else
           torch.minimum(offset.long().clamp_min(0), cap - ns))
    nsel = torch.minimum(n_sel.long().clamp_min(0), (cap - ns - off).clamp_max(k))    # [R]
    e = torch.arange(n_ent, device=dev)                                               # [E]
    is_sink = e[None, :] < ns[:, None]                                                # [R, E]
    si = (e[None, :] - ns[:, None] - off[:, None])
    is_sel = (si >= 0) & (si < nsel[:, None])
    sel = torch.gather(selected.long(), 2,
                       si.clamp(0, max(k - 1, 0))[:, None, :].expand(num_rows, hkv, n_ent))
    pos = torch.where(is_sink[:, None, :], e[None, None, :].expand(num_rows, hkv, n_ent), sel)
    valid = (is_sink | is_sel)[:, None, :] & (pos >= 0) & act[:, None, None]           # [R, H, E]
    if seq_lens is not None:
        valid = valid & (pos < seq_lens.long()[:, None, None])
    p = pos.clamp_min(0)
    bidx = (p // bs).clamp_max(block_table.shape[1] - 1)
    blk = torch.gather(block_table.long()[:, None, :].expand(num_rows, hkv, -1), 2, bidx)
    blk = blk.clamp(0, kv_cache.shape[0] - 1)
    heads = torch.arange(hkv, device=dev)[None, :, None].expand_as(blk)
    src = kv_cache[blk, heads, p % bs]                                                # [R, H, E, 2D]
    # Rows sharing a slot (an inactive padded row beside the slot's active row) must write identical
    # values, since index_put_ leaves the order of duplicate writes undefined: every row writes the
    # result of its slot's owner (the highest active row index mapped to it), or the current content.
    s_idx = slot.clamp(0, compact_kv.shape[0] - 1)
    rows = torch.arange(num_rows, device=dev)
    owner = torch.full((compact_kv.shape[0],), -1, dtype=torch.long, device=dev)
    owner = owner.scatter_reduce(0, s_idx, torch.where(act, rows, torch.full_like(rows, -1)),
                                 reduce="amax")
    o = owner[s_idx]                                                                   # [R]
    has_o = o >= 0
    oc = o.clamp_min(0)
    harange = torch.arange(hkv, device=dev)[None, :]
    cur = compact_kv[s_idx[:, None], harange][:, :, :n_ent]                             # [R, H, E, 2D]
    new = torch.where(valid[..., None], src.to(compact_kv.dtype), cur)
    final = torch.where(has_o[:, None, None, None], new[oc], cur)
    compact_kv[s_idx[:, None], harange, :n_ent] = final
    new_len = (ns + off + nsel).to(compact_len.dtype)
    compact_len[s_idx] = torch.where(has_o, new_len[oc], compact_len[s_idx])
    return compact_kv


def _gather_compact_paged_torch(kv_cache, block_table, slot_idx, selected, n_sel, n_sink, compact_kv,
                                compact_len, row_mask, *, seq_lens, offset, compact_table):
    """The twin for the paged layout: the rows' slots unpaged into a contiguous copy, the
    contiguous twin on it, and the copy written back into the blocks of the slots it changed (only
    those: slots without blocks share vLLM's null block)."""
    dev = kv_cache.device
    num_rows = slot_idx.shape[0]
    hkv, bs_c = compact_kv.shape[1], compact_kv.shape[2]
    cap = compact_capacity(compact_kv, compact_table)
    n_slots = compact_table.shape[0]
    slot = slot_idx.long()
    s_idx = slot.clamp(0, n_slots - 1)
    e = torch.arange(cap, device=dev)
    blocks = compact_table.long()[s_idx][:, e // bs_c]                               # [R, C]
    local = compact_kv[blocks, :, (e % bs_c)[None, :]].permute(0, 2, 1, 3).contiguous()   # [R, H, C, 2D]
    # the rows' own copies: row r owns local slot r (rows sharing a slot: the contiguous twin's rule
    # picks the owner, so map every row to the first row of its slot)
    first = torch.full((n_slots,), num_rows, dtype=torch.long, device=dev)
    first = first.scatter_reduce(0, s_idx, torch.arange(num_rows, device=dev), reduce="amin")
    local_slot = torch.where(slot >= 0, first[s_idx], -1)
    local_len = compact_len[s_idx].clone()
    before = local.clone()
    gather_compact_torch(kv_cache, block_table, local_slot, selected, n_sel, n_sink, local, local_len,
                         row_mask, seq_lens=seq_lens, offset=offset)
    written = (local != before).flatten(1).any(1) | (local_len != compact_len[s_idx])
    written = written & (slot >= 0) & (local_slot == torch.arange(num_rows, device=dev))
    w_blocks = torch.where(written[:, None], blocks, -1)
    keep = w_blocks >= 0                                                              # [R, C]
    rr, cc = keep.nonzero(as_tuple=True)
    compact_kv[w_blocks[rr, cc], :, (cc % bs_c)] = local[rr, :, cc]
    compact_len[s_idx] = torch.where(written, local_len, compact_len[s_idx])
    return compact_kv


def gather_compact_cpu(kv_cache, block_table, slot_idx, selected, n_sel, n_sink, compact_kv,
                       compact_len, row_mask=None, *, seq_lens=None, offset=None, compact_table=None,
                       native=False):
    """The twin on the CPU, where reading the rows' lengths costs nothing: per active row one gather
    of its sink + selected entries (every KV head at once) written straight into its slot; the same
    result as :func:`gather_compact_torch` (rows sharing a slot: the last active one writes).
    ``native`` (the backend's call): the compiled copy (:func:`vllm_ext.kernels.cpu_native.gather_compact`,
    the pages read in place) where it applies; this loop is its twin."""
    from vllm_ext.kernels.paged_reference import gather_entries

    num_rows = slot_idx.shape[0]
    if num_rows == 0:
        return compact_kv
    hkv, bs = kv_cache.shape[1], kv_cache.shape[2]
    cap, k = compact_capacity(compact_kv, compact_table), selected.shape[2]
    if native:
        from vllm_ext.kernels import cpu_native

        if cpu_native.gather_compact(kv_cache, block_table, slot_idx, selected, n_sel, n_sink, compact_kv,
                                     compact_len, compact_table, cap, row_mask, seq_lens, offset):
            return compact_kv
    slots = slot_idx.tolist()
    masks = (row_mask != 0).tolist() if row_mask is not None else None
    seqs = seq_lens.tolist() if seq_lens is not None else None
    offs = offset.tolist() if offset is not None else None
    nsels = n_sel.tolist()
    heads = torch.arange(hkv, device=kv_cache.device)[:, None]
    for r in range(num_rows):
        slot = slots[r]
        if slot < 0 or (masks is not None and not masks[r]) or (seqs is not None and seqs[r] <= 0):
            continue
        ns = min(int(n_sink), seqs[r]) if seqs is not None else int(n_sink)
        ns = min(ns, cap)
        off = min(max(offs[r], 0), cap - ns) if offs is not None else 0
        nsel = min(max(nsels[r], 0), min(k, cap - ns - off))
        sink = torch.arange(ns, device=kv_cache.device)[None, :].expand(hkv, ns)
        pos = torch.cat([sink, selected[r, :, :nsel].long()], dim=1)                 # [H, ns + nsel]
        ok = pos >= 0
        if seqs is not None:
            ok = ok & (pos < seqs[r])
        p = pos.clamp_min(0)
        blk = block_table[r].long()[(p // bs).clamp_max(block_table.shape[1] - 1)]
        src = gather_entries(kv_cache, blk.clamp(0, kv_cache.shape[0] - 1), heads, p % bs)   # [H, E, 2D]
        src = src.to(compact_kv.dtype)
        if compact_table is None:
            dst = compact_kv[slot]
            if not bool(ok.all()):                    # a caller error: those entries stay as they were
                cur = torch.cat([dst[:, :ns], dst[:, ns + off:ns + off + nsel]], dim=1)
                src = torch.where(ok[..., None], src, cur)
            dst[:, :ns] = src[:, :ns]
            dst[:, ns + off:ns + off + nsel] = src[:, ns:]
        else:
            de = torch.cat([torch.arange(ns), torch.arange(ns + off, ns + off + nsel)]).to(kv_cache.device)
            bs_c = compact_kv.shape[2]
            dblk = compact_table[slot].long()[de // bs_c]                            # [E]
            if not bool(ok.all()):
                cur = compact_kv[dblk[None, :], heads, (de % bs_c)[None, :]]
                src = torch.where(ok[..., None], src, cur)
            compact_kv[dblk[None, :], heads, (de % bs_c)[None, :]] = src
        compact_len[slot] = ns + off + nsel
    return compact_kv
