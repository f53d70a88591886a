"""Per key block element-wise max / min of K, read from vLLM's paged KV cache (CritiPrefill's ``Kmax, Kmin``).

Public functions (Triton on CUDA / under ``TRITON_INTERPRET=1``, else the ``*_torch`` twin of the same
signature):

``block_representatives(kv_cache, block_table, seq_lens, block_size, num_blocks, *, out=None)``
    ``kv_cache``: ``[num_pages, Hkv, page_size, 2*D]`` (any strides; K = ``[..., :D]``);
    ``block_table``: int32 ``[R, max_pages]``; ``seq_lens``: int ``[R]`` (device);
    ``block_size``: the criticality block size ``Bk`` in tokens (any positive size; it need not be a
    multiple or a divisor of the page size, each key is addressed through the block table);
    ``num_blocks``: host int, how many blocks per request to produce.
    Returns ``out`` fp32 ``[R, 2, num_blocks, Hkv, D]``: ``out[:, 0]`` = max, ``out[:, 1]`` = min over
    the keys ``[b*Bk, min((b+1)*Bk, seq_len))`` of block ``b``. A partial last block covers the keys
    that exist; blocks with no key (``b*Bk >= seq_len``) are 0 (they are never candidates).

``update_block_representatives(kv_cache, block_table, seq_lens, first_block, block_size, max_blocks, reps, rep_slot)``
    The incremental form the backend keeps per request (chunked prefill): for row ``i``, blocks
    ``first_block[i] + j`` (``0 <= j < max_blocks``, host bound) that hold at least one key
    (``b*Bk < seq_lens[i]``) are recomputed from the paged cache and written to
    ``reps[rep_slot[i], 0 / 1, b]`` (``reps``: ``[slots, 2, NB, Hkv, D]``, any float dtype: a max or
    min of cache values is exact in the cache's dtype). Blocks before ``first_block[i]`` are left as
    they are, so a chunk costs its own blocks (plus the partial block it continues), never the
    whole prefix. Rows may share a ``rep_slot`` only if it is a scratch slot nobody reads.

``update_block_representatives_from(kv_cache, block_table, seq_lens, first_block, block_size, reps, rep_slot)``
    The same with no host bound: every block from ``first_block[i]`` to row ``i``'s last live block
    (a loop inside the kernel, so the launch is fixed and CUDA graphs can capture it). Quest-style
    page tables use it each decode step: one block normally, the whole prefix for a request that
    just took a fresh slot with its context already cached.

``query_segment_representatives(query, query_start_loc, seq_lens, segment_size, max_segments, *, out=None)``
    The query side (``Qmax, Qmin``) of a batch of prefill chunks: request ``i``'s queries (token rows
    ``query_start_loc[i]:query_start_loc[i+1]`` of ``query [T, Hq, D]``, positions
    ``seq_len_i - q_len_i .. seq_len_i - 1``) grouped by absolute segment ``p // segment_size``;
    row ``s`` of request ``i`` is segment ``(seq_len_i - q_len_i) // segment_size + s``.
    Returns ``out`` fp32 ``[2, R, max_segments, Hq, D]`` (max, min); rows without a query are 0.
    Token rows after ``query_start_loc[R]`` (padding) are ignored.

No host synchronisation. Imports neither vLLM nor CUDA.
"""

from __future__ import annotations

import warnings

import torch

from vllm_ext.kernels.paged_reference import split_kv
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _block_reps_kernel(KV, BT, SEQ, OUT,
                           s_kv_p, s_kv_h, s_kv_n, s_kv_d,
                           s_bt_r, s_bt_p,
                           s_o_r, s_o_w, s_o_b, s_o_h,
                           D: tl.constexpr, D_PAD: tl.constexpr,
                           BK: tl.constexpr, BK_PAD: tl.constexpr, PAGE: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1)
        h = tl.program_id(2)
        seq = tl.load(SEQ + r).to(tl.int64)
        offs_n = tl.arange(0, BK_PAD)
        offs_d = tl.arange(0, D_PAD)
        pos = b.to(tl.int64) * BK + offs_n
        valid = (offs_n < BK) & (pos < seq)
        page = tl.load(BT + r.to(tl.int64) * s_bt_r + (pos // PAGE) * s_bt_p, mask=valid, other=0).to(tl.int64)
        off = pos % PAGE
        dmask = offs_d < D
        ptr = KV + page[:, None] * s_kv_p + h.to(tl.int64) * s_kv_h + off[:, None] * s_kv_n \
            + offs_d[None, :] * s_kv_d
        m2 = valid[:, None] & dmask[None, :]
        k = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
        kmax = tl.max(tl.where(m2, k, float("-inf")), axis=0)
        kmin = tl.min(tl.where(m2, k, float("inf")), axis=0)
        any_valid = tl.sum(valid.to(tl.int32), axis=0) > 0
        kmax = tl.where(any_valid, kmax, 0.0)
        kmin = tl.where(any_valid, kmin, 0.0)
        o = OUT + r.to(tl.int64) * s_o_r + b.to(tl.int64) * s_o_b + h.to(tl.int64) * s_o_h + offs_d
        tl.store(o, kmax, mask=dmask)
        tl.store(o + s_o_w, kmin, mask=dmask)

    @triton.jit
    def _write_block_rep(KV, BT, OUT, r, h, b, seq, slot,
                         s_kv_p, s_kv_h, s_kv_n, s_kv_d, s_bt_r, s_bt_p, s_o_r, s_o_w, s_o_b, s_o_h,
                         D: tl.constexpr, D_PAD: tl.constexpr,
                         BK: tl.constexpr, BK_PAD: tl.constexpr, PAGE: tl.constexpr):
        offs_n = tl.arange(0, BK_PAD)
        offs_d = tl.arange(0, D_PAD)
        pos = b * BK + offs_n
        valid = (offs_n < BK) & (pos < seq)
        page = tl.load(BT + r.to(tl.int64) * s_bt_r + (pos // PAGE) * s_bt_p, mask=valid, other=0).to(tl.int64)
        off = pos % PAGE
        dmask = offs_d < D
        ptr = KV + page[:, None] * s_kv_p + h.to(tl.int64) * s_kv_h + off[:, None] * s_kv_n \
            + offs_d[None, :] * s_kv_d
        m2 = valid[:, None] & dmask[None, :]
        k = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
        kmax = tl.max(tl.where(m2, k, float("-inf")), axis=0)
        kmin = tl.min(tl.where(m2, k, float("inf")), axis=0)
        o = OUT + slot * s_o_r + b * s_o_b + h.to(tl.int64) * s_o_h + offs_d
        tl.store(o, kmax.to(OUT.dtype.element_ty), mask=dmask)
        tl.store(o + s_o_w, kmin.to(OUT.dtype.element_ty), mask=dmask)

    @triton.jit
    def _block_reps_update_kernel(KV, BT, SEQ, FIRST, SLOT, OUT,
                                  s_kv_p, s_kv_h, s_kv_n, s_kv_d,
                                  s_bt_r, s_bt_p,
                                  s_o_r, s_o_w, s_o_b, s_o_h,
                                  D: tl.constexpr, D_PAD: tl.constexpr,
                                  BK: tl.constexpr, BK_PAD: tl.constexpr, PAGE: tl.constexpr,
                                  LOOP: tl.constexpr):
        # LOOP False: program (j, r, h) writes block FIRST[r] + j (a host bound sizes the grid);
        # LOOP True: program (r, h) writes every block from FIRST[r] to row r's last live one
        if LOOP:
            r = tl.program_id(0)
            h = tl.program_id(1)
        else:
            r = tl.program_id(1)
            h = tl.program_id(2)
        seq = tl.load(SEQ + r).to(tl.int64)
        first = tl.load(FIRST + r).to(tl.int64)
        slot = tl.load(SLOT + r).to(tl.int64)
        if LOOP:
            for b in range(first, (seq + BK - 1) // BK):
                _write_block_rep(KV, BT, OUT, r, h, b, seq, slot, s_kv_p, s_kv_h, s_kv_n, s_kv_d, s_bt_r,
                                 s_bt_p, s_o_r, s_o_w, s_o_b, s_o_h, D, D_PAD, BK, BK_PAD, PAGE)
        else:
            b = first + tl.program_id(0)
            if b * BK < seq:
                _write_block_rep(KV, BT, OUT, r, h, b, seq, slot, s_kv_p, s_kv_h, s_kv_n, s_kv_d, s_bt_r,
                                 s_bt_p, s_o_r, s_o_w, s_o_b, s_o_h, D, D_PAD, BK, BK_PAD, PAGE)

    @triton.jit
    def _query_reps_kernel(Q, QSL, SEQ, OUT,
                           s_q_t, s_q_h, s_q_d,
                           s_o_w, s_o_r, s_o_s, s_o_h,
                           S_MAX, SEG,
                           D: tl.constexpr, D_PAD: tl.constexpr, TOK: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        r = (row // S_MAX).to(tl.int64)
        s = (row % S_MAX).to(tl.int64)
        qs = tl.load(QSL + r).to(tl.int64)
        qe = tl.load(QSL + r + 1).to(tl.int64)
        seq = tl.load(SEQ + r).to(tl.int64)
        ctx = seq - (qe - qs)
        seg = ctx // SEG + s
        p_lo = tl.maximum(ctx, seg * SEG)
        p_hi = tl.minimum(seq, seg * SEG + SEG)
        offs_t = tl.arange(0, TOK)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        mx = tl.full((TOK, D_PAD), float("-inf"), tl.float32)
        mn = tl.full((TOK, D_PAD), float("inf"), tl.float32)
        for t0 in range(p_lo, p_hi, TOK):
            pos = t0 + offs_t
            ok = pos < p_hi
            tok = qs + pos - ctx
            m2 = ok[:, None] & dmask[None, :]
            x = tl.load(Q + tok[:, None] * s_q_t + h * s_q_h + offs_d[None, :] * s_q_d, mask=m2, other=0.0)
            x = x.to(tl.float32)
            mx = tl.maximum(mx, tl.where(m2, x, float("-inf")))
            mn = tl.minimum(mn, tl.where(m2, x, float("inf")))
        vmax = tl.max(mx, axis=0)
        vmin = tl.min(mn, axis=0)
        has = p_hi > p_lo
        vmax = tl.where(has, vmax, 0.0)
        vmin = tl.where(has, vmin, 0.0)
        o = OUT + r * s_o_r + s * s_o_s + h * s_o_h + offs_d
        tl.store(o, vmax, mask=dmask)
        tl.store(o + s_o_w, vmin, mask=dmask)


def _alloc_out(kv_cache: torch.Tensor, num_reqs: int, num_blocks: int,
               out: torch.Tensor | None) -> torch.Tensor:
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    shape = (num_reqs, 2, num_blocks, hkv, d)
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=kv_cache.device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 {shape} with a unit last stride, got {out.dtype} {tuple(out.shape)}")
    return out


def block_representatives_torch(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                block_size: int, num_blocks: int, *,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`block_representatives` (vectorised, no host sync)."""
    num_reqs = seq_lens.shape[0]
    out = _alloc_out(kv_cache, num_reqs, num_blocks, out)
    if num_reqs == 0 or num_blocks == 0:
        return out
    page = kv_cache.shape[2]
    k_cache, _ = split_kv(kv_cache)                                  # [P, H, N, D]
    dev = kv_cache.device
    pos = torch.arange(num_blocks * block_size, device=dev)           # [NB*Bk]
    valid = pos[None, :] < seq_lens.to(dev).long()[:, None]           # [R, NB*Bk]
    pidx = (pos // page).clamp_max(block_table.shape[1] - 1)
    pages = block_table.to(dev).long()[:, pidx]                       # [R, NB*Bk]
    pages = torch.where(valid, pages, 0)
    k = k_cache[pages, :, (pos % page)[None, :].expand_as(pages)].float()   # [R, NB*Bk, H, D]
    k = k.reshape(num_reqs, num_blocks, block_size, *k.shape[-2:])
    vm = valid.reshape(num_reqs, num_blocks, block_size)[..., None, None]
    kmax = k.masked_fill(~vm, float("-inf")).amax(dim=2)
    kmin = k.masked_fill(~vm, float("inf")).amin(dim=2)
    anyv = vm.any(dim=2)
    out[:, 0] = torch.where(anyv, kmax, 0.0)
    out[:, 1] = torch.where(anyv, kmin, 0.0)
    return out


def block_representatives_triton(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                 block_size: int, num_blocks: int, *,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    num_reqs = seq_lens.shape[0]
    out = _alloc_out(kv_cache, num_reqs, num_blocks, out)
    if num_reqs == 0 or num_blocks == 0:
        return out
    hkv, page, d = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[-1] // 2
    grid = (num_blocks, num_reqs, hkv)
    _block_reps_kernel[grid](
        kv_cache, block_table, seq_lens, out, *kv_cache.stride(), *block_table.stride(), *out.stride()[:4],
        D=d, D_PAD=max(16, next_pow2(d)), BK=block_size, BK_PAD=max(16, next_pow2(block_size)), PAGE=page,
    )
    return out


def block_representatives(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          block_size: int, num_blocks: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Per criticality block max / min of K (see the module docstring)."""
    if use_triton(kv_cache):
        return block_representatives_triton(kv_cache, block_table, seq_lens, block_size, num_blocks, out=out)
    return block_representatives_torch(kv_cache, block_table, seq_lens, block_size, num_blocks, out=out)


# ------------------------------------------------------------------------- incremental (per request)
def _check_update(kv_cache: torch.Tensor, reps: torch.Tensor) -> None:
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    if reps.dim() != 5 or reps.shape[1] != 2 or tuple(reps.shape[3:]) != (hkv, d) or reps.stride(-1) != 1:
        raise ValueError(f"reps must be [slots, 2, NB, {hkv}, {d}] with a unit last stride, got "
                         f"{tuple(reps.shape)}")


def key_block_bounds(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     first_block: torch.Tensor, block_size: int, max_blocks: int):
    """The max and min of K over each row's key blocks ``first_block + [0, max_blocks)`` (the
    twins' shared step): ``(blocks [R, J], live [R, J]: the block holds a key, kmax, kmin [R, J, H, D]
    fp32)``."""
    r = seq_lens.shape[0]
    dev = kv_cache.device
    page = kv_cache.shape[2]
    k_cache, _ = split_kv(kv_cache)                                   # [P, H, N, D]
    seq = seq_lens.to(dev).long()
    blk = first_block.to(dev).long()[:, None] + torch.arange(max_blocks, device=dev)[None, :]   # [R, J]
    pos = blk[..., None] * block_size + torch.arange(block_size, device=dev)                   # [R, J, Bk]
    valid = pos < seq[:, None, None]
    pidx = (pos // page).clamp(0, block_table.shape[1] - 1)
    pages = torch.gather(block_table.to(dev).long(), 1, pidx.reshape(r, -1)).reshape(pidx.shape)
    pages = torch.where(valid, pages, 0)
    k = k_cache[pages, :, pos % page].float()                         # [R, J, Bk, H, D]
    vm = valid[..., None, None]
    kmax = k.masked_fill(~vm, float("-inf")).amax(dim=2)              # [R, J, H, D]
    kmin = k.masked_fill(~vm, float("inf")).amin(dim=2)
    return blk, valid[..., 0], kmax, kmin


def update_block_representatives_torch(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                       seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                       max_blocks: int, reps: torch.Tensor, rep_slot: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of :func:`update_block_representatives` (vectorised, no host sync)."""
    _check_update(kv_cache, reps)
    r = seq_lens.shape[0]
    nb_max = reps.shape[2]
    max_blocks = min(max_blocks, nb_max)          # a row's live blocks are fewer than NB
    if r == 0 or max_blocks <= 0:
        return reps
    blk, live, kmax, kmin = key_block_bounds(kv_cache, block_table, seq_lens, first_block, block_size,
                                             max_blocks)
    dev = kv_cache.device
    # Every entry writes (no host-side count): a dead one (no key) writes its location's current
    # value back. Locations are taken modulo NB: a row's J <= NB consecutive blocks land on distinct
    # locations, so a dead write never meets a live one of the same row.
    slot = rep_slot.to(dev).long()[:, None].expand_as(blk)
    b_w = blk % nb_max
    cur = reps[slot, :, b_w]                                          # [R, J, 2, H, D]
    new = torch.stack([kmax, kmin], dim=2).to(reps.dtype)
    vals = torch.where(live[..., None, None, None], new, cur)
    reps[slot.reshape(-1), :, b_w.reshape(-1)] = vals.reshape(-1, *vals.shape[2:])
    return reps


def launch_update(kernel, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  first_block: torch.Tensor, block_size: int, max_blocks: int | None, outputs: tuple,
                  out_strides: tuple, **meta) -> None:
    """Launch an update of the rows' block representatives: one program per (block, row, KV head) up
    to the host bound ``max_blocks``, or, with None, one per (row, KV head) looping over the row's
    blocks. The kernel takes the cache, table, lengths and first blocks, then ``outputs``, the
    strides of the cache and the table, then ``out_strides``."""
    rows = seq_lens.shape[0]
    if rows == 0 or (max_blocks is not None and max_blocks <= 0):
        return
    hkv, page, d = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[-1] // 2
    grid = (rows, hkv) if max_blocks is None else (max_blocks, rows, hkv)
    kernel[grid](kv_cache, block_table, seq_lens, first_block, *outputs, *kv_cache.stride(), *block_table.stride(),
                 *out_strides, D=d, D_PAD=max(16, next_pow2(d)), BK=block_size,
                 BK_PAD=max(16, next_pow2(block_size)), PAGE=page, LOOP=max_blocks is None, **meta)


def _launch_update(kv_cache, block_table, seq_lens, first_block, block_size, reps, rep_slot,
                   max_blocks: int | None) -> torch.Tensor:
    _check_update(kv_cache, reps)
    if max_blocks is not None:
        max_blocks = min(max_blocks, reps.shape[2])
    launch_update(_block_reps_update_kernel, kv_cache, block_table, seq_lens, first_block, block_size, max_blocks,
                  (rep_slot, reps), reps.stride()[:4])
    return reps


def update_block_representatives_triton(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                        seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                        max_blocks: int, reps: torch.Tensor, rep_slot: torch.Tensor) -> torch.Tensor:
    return _launch_update(kv_cache, block_table, seq_lens, first_block, block_size, reps, rep_slot, max_blocks)


def update_block_representatives(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                 first_block: torch.Tensor, block_size: int, max_blocks: int,
                                 reps: torch.Tensor, rep_slot: torch.Tensor) -> torch.Tensor:
    """Recompute the blocks a chunk wrote into a per-request table (see the module docstring)."""
    if use_triton(kv_cache):
        return update_block_representatives_triton(kv_cache, block_table, seq_lens, first_block, block_size,
                                                   max_blocks, reps, rep_slot)
    return update_block_representatives_torch(kv_cache, block_table, seq_lens, first_block, block_size,
                                              max_blocks, reps, rep_slot)


def update_block_representatives_from_triton(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                             seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                             reps: torch.Tensor, rep_slot: torch.Tensor) -> torch.Tensor:
    return _launch_update(kv_cache, block_table, seq_lens, first_block, block_size, reps, rep_slot, None)


def _update_from_cpu(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     first_block: torch.Tensor, block_size: int, reps: torch.Tensor,
                     rep_slot: torch.Tensor) -> torch.Tensor:
    """:func:`update_block_representatives_from_torch` on the CPU, where reading the rows costs
    nothing: per row with a live block, one gather of K over its blocks (every KV head at once) and
    one write of their max / min (the same values: a max or min is exact in any order)."""
    from vllm_ext.kernels.paged_reference import gather_entries

    _check_update(kv_cache, reps)
    page, d = kv_cache.shape[2], kv_cache.shape[-1] // 2
    hkv, nb_max = kv_cache.shape[1], reps.shape[2]
    seqs, firsts, slots = seq_lens.tolist(), first_block.tolist(), rep_slot.tolist()
    heads = torch.arange(hkv, device=kv_cache.device)[None, :]
    for i, seq in enumerate(seqs):
        first = max(int(firsts[i]), 0)
        n_blk = min(-(-int(seq) // block_size), nb_max) - first       # blocks holding a key
        if n_blk <= 0:
            continue
        pos = torch.arange(first * block_size, (first + n_blk) * block_size, device=kv_cache.device)
        valid = pos < seq
        pidx = torch.where(valid, pos // page, 0).clamp_max(block_table.shape[1] - 1)
        pages = torch.where(valid, block_table[i].long()[pidx], 0)
        k = gather_entries(kv_cache, pages[:, None], heads, (pos % page)[:, None], d).float()   # [n, H, D]
        k = k.view(n_blk, block_size, hkv, d)
        if (first + n_blk) * block_size > seq:                       # a partial last block
            vm = valid.view(n_blk, block_size, 1, 1)
            kmax = k.masked_fill(~vm, float("-inf")).amax(dim=1)
            kmin = k.masked_fill(~vm, float("inf")).amin(dim=1)
        else:
            kmax, kmin = k.amax(dim=1), k.amin(dim=1)
        slot = min(max(int(slots[i]), -reps.shape[0]), reps.shape[0] - 1)
        reps[slot, 0, first:first + n_blk] = kmax.to(reps.dtype)
        reps[slot, 1, first:first + n_blk] = kmin.to(reps.dtype)
    return reps


def update_block_representatives_from_torch(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                            seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                            reps: torch.Tensor, rep_slot: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of :func:`update_block_representatives_from`. On the CPU it reads the largest
    span to size its work; elsewhere (tests forcing the twins on a GPU) it spans the whole table
    rather than synchronise."""
    if seq_lens.shape[0] == 0:
        return reps
    if kv_cache.device.type == "cpu":
        return _update_from_cpu(kv_cache, block_table, seq_lens, first_block, block_size, reps, rep_slot)
    else:
        span = reps.shape[2]
    return update_block_representatives_torch(kv_cache, block_table, seq_lens, first_block, block_size, span,
                                              reps, rep_slot)


def update_block_representatives_from(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                      first_block: torch.Tensor, block_size: int, reps: torch.Tensor,
                                      rep_slot: torch.Tensor) -> torch.Tensor:
    """Every block from ``first_block`` to the last live one (see the module docstring)."""
    if use_triton(kv_cache):
        return update_block_representatives_from_triton(kv_cache, block_table, seq_lens, first_block,
                                                        block_size, reps, rep_slot)
    return update_block_representatives_from_torch(kv_cache, block_table, seq_lens, first_block, block_size,
                                                   reps, rep_slot)


# ------------------------------------------------------------------------------ query representatives
def _alloc_qout(query: torch.Tensor, num_reqs: int, max_segments: int, out: torch.Tensor | None) -> torch.Tensor:
    shape = (2, num_reqs, max_segments, query.shape[1], query.shape[2])
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=query.device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 {shape} with a unit last stride, got {out.dtype} {tuple(out.shape)}")
    return out


def query_segment_representatives_torch(query: torch.Tensor, query_start_loc: torch.Tensor,
                                        seq_lens: torch.Tensor, segment_size: int, max_segments: int, *,
                                        out: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`query_segment_representatives` (``index_reduce``, no host sync)."""
    r = seq_lens.shape[0]
    t, hq, d = query.shape
    out = _alloc_qout(query, r, max_segments, out)
    if r == 0:
        return out
    dev = query.device
    qsl = query_start_loc.to(dev).long()
    seq = seq_lens.to(dev).long()
    ctx = seq - (qsl[1:] - qsl[:-1])
    first = torch.div(ctx, segment_size, rounding_mode="floor")
    tok = torch.arange(t, device=dev)
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True)   # request of each token row
    in_batch = req < r
    req_c = req.clamp_max(r - 1)
    pos = ctx[req_c] + tok - qsl[req_c]
    seg_local = torch.div(pos, segment_size, rounding_mode="floor") - first[req_c]
    n_rows = r * max_segments
    row = torch.where(in_batch, req_c * max_segments + seg_local, n_rows)   # padding rows -> dump row
    src = query if query.dtype in (torch.float16, torch.bfloat16, torch.float32) else query.float()
    qmax = torch.zeros((n_rows + 1, hq, d), dtype=src.dtype, device=dev)
    qmin = torch.zeros((n_rows + 1, hq, d), dtype=src.dtype, device=dev)
    with warnings.catch_warnings():          # "index_reduce() is in beta"
        warnings.simplefilter("ignore", UserWarning)
        qmax.index_reduce_(0, row, src, "amax", include_self=False)
        qmin.index_reduce_(0, row, src, "amin", include_self=False)
    out[0] = qmax[:n_rows].reshape(r, max_segments, hq, d)
    out[1] = qmin[:n_rows].reshape(r, max_segments, hq, d)
    return out


def query_segment_representatives_triton(query: torch.Tensor, query_start_loc: torch.Tensor,
                                         seq_lens: torch.Tensor, segment_size: int, max_segments: int, *,
                                         out: torch.Tensor | None = None) -> torch.Tensor:
    r = seq_lens.shape[0]
    t, hq, d = query.shape
    out = _alloc_qout(query, r, max_segments, out)
    if r == 0 or max_segments == 0:
        return out
    grid = (r * max_segments, hq)
    _query_reps_kernel[grid](
        query, query_start_loc, seq_lens, out, *query.stride(), *out.stride()[:4],
        max_segments, segment_size,
        D=d, D_PAD=max(16, next_pow2(d)), TOK=32,
    )
    return out


def query_segment_representatives(query: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                  segment_size: int, max_segments: int, *,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Per (request, chunk segment) max / min of the queries (see the module docstring)."""
    if use_triton(query):
        return query_segment_representatives_triton(query, query_start_loc, seq_lens, segment_size,
                                                    max_segments, out=out)
    return query_segment_representatives_torch(query, query_start_loc, seq_lens, segment_size,
                                               max_segments, out=out)
