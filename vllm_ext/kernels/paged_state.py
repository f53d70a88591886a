"""A method's per-request state kept in pages of vLLM's KV cache, in the attention layer's own entry
format (``docs/per_request_memory.md``): entry ``e`` of row ``r`` and KV head ``h`` is
``state_cache[state_table[r, e // page], h, e % page]`` (``[2*D]``: a K half and a V half), with
``state_cache`` ``[num_pages, Hkv, page, 2*D]`` (any strides) and ``state_table`` int32
``[R, max_pages]`` the rows' block-table rows of the method's KV-cache group.

Public functions (Triton on CUDA / under ``TRITON_INTERPRET=1``, else the ``*_torch`` twin of the same
signature):

``update_block_representatives_paged(kv_cache, block_table, seq_lens, first_block, block_size,
max_blocks, state_cache, state_table, entry_offset)``
    CritiPrefill's incremental key-block representatives (the form of
    ``block_representatives.update_block_representatives``) written into pages: for row ``i``, blocks
    ``b = first_block[i] + j`` (``0 <= j < max_blocks``, host bound) holding at least one key
    (``b*Bk < seq_lens[i]``) are recomputed from the paged KV cache and stored in entry
    ``entry_offset + b``: the max of K in the K half, the min in the V half (exact in the cache's
    dtype). A row with ``first_block[i] >= ceil(seq_lens[i] / Bk)`` writes nothing (rows without
    pages: their table rows are never trusted).

    ``state_slot`` (optional, int ``[R]``): row ``i`` writes through state-table row
    ``state_slot[i]`` instead of row ``i`` (a per-slot table, e.g. SFI's Quest page bounds: Quest's
    page max/min are this update with ``Bk`` = the Quest page and ``entry_offset`` 0).

``update_block_representatives_paged_from(kv_cache, block_table, seq_lens, first_block, block_size,
state_cache, state_table, entry_offset, *, state_slot=None)``
    The same with no host bound: every key block from ``first_block[i]`` to row ``i``'s last live
    one (a loop inside the kernel: a fixed launch that CUDA graphs capture). Quest's decode rows use
    it: one page normally, every page of a request that just got its page bounds.

``write_state_entries(state_cache, state_table, first_entry, num_entries, values)``
    ``values`` ``[R, E, Hkv, 2*D]`` (any float dtype): row ``i`` stores ``values[i, e]`` in entry
    ``first_entry[i] + e`` for ``e < num_entries[i]`` (0: nothing).

``read_state_entries(state_cache, state_table, first_entry, num)`` (PyTorch only, a gather)
    ``[R, num, Hkv, 2*D]``: entries ``first_entry .. first_entry + num - 1`` of every row (whatever a
    row's pages hold: the caller masks rows it does not trust).

The Triton kernels never synchronise; the twins' writes select the live entries with a boolean mask
(free on the CPU, a synchronisation on CUDA, where the Triton kernels run). Imports neither vLLM nor
CUDA.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.block_representatives import key_block_bounds, launch_update
from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_rep_entry(KV, BT, SC, ST, r, h, b, seq, srow, OFF,
                         s_kv_p, s_kv_h, s_kv_n, s_kv_d, s_bt_r, s_bt_p,
                         s_sc_p, s_sc_h, s_sc_n, s_sc_d, s_st_r, s_st_p,
                         D: tl.constexpr, D_PAD: tl.constexpr,
                         BK: tl.constexpr, BK_PAD: tl.constexpr, PAGE: tl.constexpr, SPAGE: tl.constexpr):
        offs_n = tl.arange(0, BK_PAD)
        offs_d = tl.arange(0, D_PAD)
        pos = b * BK + offs_n
        valid = (offs_n < BK) & (pos < seq)
        page = tl.load(BT + r * s_bt_r + (pos // PAGE) * s_bt_p, mask=valid, other=0).to(tl.int64)
        dmask = offs_d < D
        ptr = KV + page[:, None] * s_kv_p + h * s_kv_h + (pos % PAGE)[:, None] * s_kv_n \
            + offs_d[None, :] * s_kv_d
        m2 = valid[:, None] & dmask[None, :]
        k = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
        kmax = tl.max(tl.where(m2, k, float("-inf")), axis=0)
        kmin = tl.min(tl.where(m2, k, float("inf")), axis=0)
        e = OFF + b
        spage = tl.load(ST + srow * s_st_r + (e // SPAGE) * s_st_p).to(tl.int64)
        o = SC + spage * s_sc_p + h * s_sc_h + (e % SPAGE) * s_sc_n
        tl.store(o + offs_d * s_sc_d, kmax.to(SC.dtype.element_ty), mask=dmask)
        tl.store(o + (D + offs_d) * s_sc_d, kmin.to(SC.dtype.element_ty), mask=dmask)

    @triton.jit
    def _paged_reps_kernel(KV, BT, SEQ, FIRST, SC, ST, SROW, OFF,
                           s_kv_p, s_kv_h, s_kv_n, s_kv_d, s_bt_r, s_bt_p,
                           s_sc_p, s_sc_h, s_sc_n, s_sc_d, s_st_r, s_st_p,
                           D: tl.constexpr, D_PAD: tl.constexpr,
                           BK: tl.constexpr, BK_PAD: tl.constexpr, PAGE: tl.constexpr,
                           SPAGE: tl.constexpr, HAS_SROW: tl.constexpr, LOOP: tl.constexpr):
        # LOOP False: program (j, r, h) writes block FIRST[r] + j (a host bound sizes the grid);
        # LOOP True: program (r, h) writes every block from FIRST[r] to row r's last live one.
        # HAS_SROW: row r writes through state-table row SROW[r] (else row r)
        if LOOP:
            r = tl.program_id(0).to(tl.int64)
            h = tl.program_id(1).to(tl.int64)
        else:
            r = tl.program_id(1).to(tl.int64)
            h = tl.program_id(2).to(tl.int64)
        seq = tl.load(SEQ + r).to(tl.int64)
        first = tl.maximum(tl.load(FIRST + r).to(tl.int64), 0)
        if HAS_SROW:
            srow = tl.load(SROW + r).to(tl.int64)
        else:
            srow = r
        if LOOP:
            for b in range(first, (seq + BK - 1) // BK):
                _paged_rep_entry(KV, BT, SC, ST, r, h, b, seq, srow, OFF, s_kv_p, s_kv_h, s_kv_n, s_kv_d,
                                 s_bt_r, s_bt_p, s_sc_p, s_sc_h, s_sc_n, s_sc_d, s_st_r, s_st_p,
                                 D, D_PAD, BK, BK_PAD, PAGE, SPAGE)
        else:
            b = first + tl.program_id(0)
            if b * BK < seq:
                _paged_rep_entry(KV, BT, SC, ST, r, h, b, seq, srow, OFF, s_kv_p, s_kv_h, s_kv_n, s_kv_d,
                                 s_bt_r, s_bt_p, s_sc_p, s_sc_h, s_sc_n, s_sc_d, s_st_r, s_st_p,
                                 D, D_PAD, BK, BK_PAD, PAGE, SPAGE)

    @triton.jit
    def _write_entries_kernel(SC, ST, FIRST, NUM, VAL,
                              s_sc_p, s_sc_h, s_sc_n, s_sc_d, s_st_r, s_st_p,
                              s_v_r, s_v_e, s_v_h, s_v_d,
                              W: tl.constexpr, W_PAD: tl.constexpr, SPAGE: tl.constexpr):
        e = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2).to(tl.int64)
        if e < tl.load(NUM + r):
            ent = tl.load(FIRST + r).to(tl.int64) + e
            spage = tl.load(ST + r * s_st_r + (ent // SPAGE) * s_st_p).to(tl.int64)
            offs = tl.arange(0, W_PAD)
            m = offs < W
            x = tl.load(VAL + r * s_v_r + e * s_v_e + h * s_v_h + offs * s_v_d, mask=m, other=0.0)
            o = SC + spage * s_sc_p + h * s_sc_h + (ent % SPAGE) * s_sc_n + offs * s_sc_d
            tl.store(o, x.to(SC.dtype.element_ty), mask=m)


def _check_state(kv_cache: torch.Tensor, state_cache: torch.Tensor) -> None:
    if state_cache.dim() != 4 or state_cache.shape[1] != kv_cache.shape[1] \
            or state_cache.shape[3] != kv_cache.shape[3]:
        raise ValueError(f"state_cache must be [pages, {kv_cache.shape[1]}, page, {kv_cache.shape[3]}], "
                         f"got {tuple(state_cache.shape)}")


def _store(state_cache: torch.Tensor, state_table: torch.Tensor, entry: torch.Tensor, live: torch.Tensor,
           vals: torch.Tensor) -> None:
    """``state_cache[...entry...] = vals`` for the live entries (``entry``/``live`` ``[R, E]``, ``vals``
    ``[R, E, Hkv, 2D]``)."""
    spage = state_cache.shape[2]
    pidx = (entry // spage).clamp(0, state_table.shape[1] - 1)
    pages = torch.gather(state_table.long(), 1, pidx)
    state_cache[pages[live], :, (entry % spage)[live]] = vals[live].to(state_cache.dtype)


def _state_rows(state_table: torch.Tensor, state_slot: torch.Tensor | None, device) -> torch.Tensor:
    """Each row's state-table row (the twins gather them; the kernels read ``state_slot`` in place)."""
    table = state_table.to(device)
    return table if state_slot is None else table[state_slot.to(device).long()]


def update_block_representatives_paged_torch(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                             seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                             max_blocks: int, state_cache: torch.Tensor,
                                             state_table: torch.Tensor, entry_offset: int, *,
                                             state_slot: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`update_block_representatives_paged`."""
    _check_state(kv_cache, state_cache)
    r = seq_lens.shape[0]
    if r == 0 or max_blocks <= 0:
        return state_cache
    blk, live, kmax, kmin = key_block_bounds(kv_cache, block_table, seq_lens, first_block, block_size,
                                             max_blocks)
    _store(state_cache, _state_rows(state_table, state_slot, kv_cache.device), entry_offset + blk, live,
           torch.cat([kmax, kmin], -1))
    return state_cache


def _launch_paged(kv_cache, block_table, seq_lens, first_block, block_size, state_cache, state_table,
                  entry_offset, state_slot, max_blocks: int | None) -> torch.Tensor:
    _check_state(kv_cache, state_cache)
    launch_update(_paged_reps_kernel, kv_cache, block_table, seq_lens, first_block, block_size, max_blocks,
                  (state_cache, state_table, state_slot if state_slot is not None else seq_lens, int(entry_offset)),
                  (*state_cache.stride(), *state_table.stride()), SPAGE=state_cache.shape[2],
                  HAS_SROW=state_slot is not None)
    return state_cache


def update_block_representatives_paged_triton(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                              seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                              max_blocks: int, state_cache: torch.Tensor,
                                              state_table: torch.Tensor, entry_offset: int, *,
                                              state_slot: torch.Tensor | None = None) -> torch.Tensor:
    return _launch_paged(kv_cache, block_table, seq_lens, first_block, block_size, state_cache, state_table,
                         entry_offset, state_slot, max_blocks)


def update_block_representatives_paged(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                                       first_block: torch.Tensor, block_size: int, max_blocks: int,
                                       state_cache: torch.Tensor, state_table: torch.Tensor,
                                       entry_offset: int, *, state_slot: torch.Tensor | None = None) -> torch.Tensor:
    """Recompute the key blocks a chunk wrote into the rows' state pages (see the module docstring)."""
    fn = update_block_representatives_paged_triton if use_triton(kv_cache) else \
        update_block_representatives_paged_torch
    return fn(kv_cache, block_table, seq_lens, first_block, block_size, max_blocks, state_cache, state_table,
              entry_offset, state_slot=state_slot)


def update_block_representatives_paged_from_triton(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                                   seq_lens: torch.Tensor, first_block: torch.Tensor,
                                                   block_size: int, state_cache: torch.Tensor,
                                                   state_table: torch.Tensor, entry_offset: int, *,
                                                   state_slot: torch.Tensor | None = None) -> torch.Tensor:
    return _launch_paged(kv_cache, block_table, seq_lens, first_block, block_size, state_cache, state_table,
                         entry_offset, state_slot, None)


def update_block_representatives_paged_from_torch(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                                  seq_lens: torch.Tensor, first_block: torch.Tensor,
                                                  block_size: int, state_cache: torch.Tensor,
                                                  state_table: torch.Tensor, entry_offset: int, *,
                                                  state_slot: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`update_block_representatives_paged_from`. On the CPU, where reading the
    rows costs nothing, row by row over its own blocks; elsewhere (tests forcing the twins on a GPU)
    over the most blocks a state-table row addresses rather than synchronise."""
    r = seq_lens.shape[0]
    if r == 0:
        return state_cache
    if kv_cache.device.type != "cpu":
        span = state_table.shape[1] * state_cache.shape[2] - int(entry_offset)
        return update_block_representatives_paged_torch(kv_cache, block_table, seq_lens, first_block, block_size,
                                                        span, state_cache, state_table, entry_offset,
                                                        state_slot=state_slot)
    rows = _state_rows(state_table, state_slot, kv_cache.device)
    seqs, firsts = seq_lens.tolist(), first_block.tolist()
    for i in range(r):
        n = -(-int(seqs[i]) // block_size) - max(int(firsts[i]), 0)
        if n > 0:
            update_block_representatives_paged_torch(kv_cache, block_table[i:i + 1], seq_lens[i:i + 1],
                                                     first_block[i:i + 1].clamp_min(0), block_size, n,
                                                     state_cache, rows[i:i + 1], entry_offset)
    return state_cache


def update_block_representatives_paged_from(kv_cache: torch.Tensor, block_table: torch.Tensor,
                                            seq_lens: torch.Tensor, first_block: torch.Tensor, block_size: int,
                                            state_cache: torch.Tensor, state_table: torch.Tensor,
                                            entry_offset: int, *, state_slot: torch.Tensor | None = None
                                            ) -> torch.Tensor:
    """Every key block from ``first_block`` to the row's last live one (see the module docstring)."""
    fn = update_block_representatives_paged_from_triton if use_triton(kv_cache) else \
        update_block_representatives_paged_from_torch
    return fn(kv_cache, block_table, seq_lens, first_block, block_size, state_cache, state_table, entry_offset,
              state_slot=state_slot)


def write_state_entries_torch(state_cache: torch.Tensor, state_table: torch.Tensor, first_entry: torch.Tensor,
                              num_entries: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of :func:`write_state_entries`."""
    r, n = values.shape[:2]
    if r == 0 or n == 0:
        return state_cache
    dev = state_cache.device
    e = torch.arange(n, device=dev)[None, :]
    live = e < num_entries.to(dev).long()[:, None]
    _store(state_cache, state_table.to(dev), first_entry.to(dev).long()[:, None] + e, live, values.to(dev))
    return state_cache


def write_state_entries_triton(state_cache: torch.Tensor, state_table: torch.Tensor, first_entry: torch.Tensor,
                               num_entries: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    r, n, hkv, w = values.shape
    if r == 0 or n == 0:
        return state_cache
    _write_entries_kernel[(n, r, hkv)](
        state_cache, state_table, first_entry, num_entries, values,
        *state_cache.stride(), *state_table.stride(), *values.stride(),
        W=w, W_PAD=max(16, next_pow2(w)), SPAGE=state_cache.shape[2],
    )
    return state_cache


def write_state_entries(state_cache: torch.Tensor, state_table: torch.Tensor, first_entry: torch.Tensor,
                        num_entries: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Store ``values`` in the rows' state entries (see the module docstring)."""
    fn = write_state_entries_triton if use_triton(state_cache) else write_state_entries_torch
    return fn(state_cache, state_table, first_entry, num_entries, values)


def read_state_entries(state_cache: torch.Tensor, state_table: torch.Tensor, first_entry: int | torch.Tensor,
                       num: int) -> torch.Tensor:
    """``[R, num, Hkv, 2*D]``: the rows' entries ``first_entry ..`` (a gather, no host sync)."""
    r = state_table.shape[0]
    dev = state_cache.device
    spage, hkv = state_cache.shape[2], state_cache.shape[1]
    first = first_entry.to(dev).long()[:, None] if torch.is_tensor(first_entry) else int(first_entry)
    entry = first + torch.arange(num, device=dev)[None, :].expand(r, num)               # [R, num]
    pidx = (entry // spage).clamp(0, state_table.shape[1] - 1)
    pages = torch.gather(state_table.to(dev).long(), 1, pidx)
    heads = torch.arange(hkv, device=dev)[None, None, :]
    return state_cache[pages[..., None], heads, (entry % spage)[..., None]]
