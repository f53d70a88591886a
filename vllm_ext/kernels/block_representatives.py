"""Per key block element-wise max / min of K, read from vLLM's paged KV cache (CritiPrefill's ``Kmax, Kmin``).

Public function (Triton on CUDA / under ``TRITON_INTERPRET=1``, else the ``*_torch`` twin of the same
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

No host synchronisation. Imports neither vLLM nor CUDA.
"""

from __future__ import annotations

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
        kv_cache, block_table, seq_lens, out,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), block_table.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
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
