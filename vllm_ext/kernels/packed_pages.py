"""One layer's paged KV cache in the packed page format of vLLM's CPU attention kernels, read as the
logical cache our PyTorch twins read.

vLLM's ``CPU_ATTN`` C++ ops (``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``) keep
each (block, KV head) page of the ``[num_blocks, Hkv, block_size, 2 * D]`` tensor vLLM allocates
in an ISA-specific packing. With the ``vec`` and ``vec16`` ISAs (x86 without AMX) a page is K
transposed (``[D, block_size]``) followed by V (``[block_size, D]``). No single strided view
``[blocks, Hkv, tokens, 2D]`` with K in ``[..., :D]`` expresses that, but a K view and a V view
do, each with its own strides. :class:`PackedPages` holds both and offers the part of a tensor's
interface the twins use on the logical cache (``shape``, ``dtype``, ``device``, entry indexing,
``index_select`` of whole blocks); :mod:`vllm_ext.kernels.paged_reference` reads it through
:func:`split_kv`-style views. Anything else raises (``AttributeError``), never reads the wrong
bytes. The backend checks the packing against vLLM's own write at start-up
(:func:`layout_matches`) before it uses this format (``vllm_ext.backend.cpu_dense``).

Entries come back in the logical layout (K then V, ``2D`` wide), in the cache dtype: the twins'
arithmetic is unchanged. Only the CPU build uses this; no Triton kernel reads it.
"""

from __future__ import annotations

import torch


def index_blocks(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)`` for a cache view ``[B, ...]``, copying whole pages: on a view
    whose last axis is strided and the one before it contiguous (``CPU_ATTN``'s K, transposed per
    page) ``index_select`` copies element by element, about 7x slower (the 8K prompt's K of one layer
    on a fragmented cache: 2.0 ms against 0.3 ms as runs of consecutive blocks), so the gather runs
    on the transposed view with each page as one row (2.4x faster again than with two page axes)."""
    if src.dim() >= 3 and src.stride(-2) == 1 and src.stride(-1) == src.shape[-2]:
        t = src.transpose(-1, -2)                              # pages contiguous in the last two axes
        return t.flatten(-2).index_select(0, index).view(-1, *t.shape[1:]).transpose(-1, -2)
    return src.index_select(0, index)


class PackedPages:
    """``raw``: the contiguous ``[num_blocks, Hkv, block_size, 2 * D]`` tensor vLLM allocated, whose
    pages hold ``CPU_ATTN``'s ``vec``/``vec16`` packing."""

    def __init__(self, raw: torch.Tensor) -> None:
        if raw.dim() != 4 or not raw.is_contiguous():
            raise ValueError(f"PackedPages needs the contiguous [blocks, Hkv, block_size, 2D] cache, "
                             f"got shape {tuple(raw.shape)} strides {raw.stride()}")
        nb, h, bs, c = raw.shape
        d = c // 2
        self.raw = raw
        self.shape = raw.shape
        self.dtype = raw.dtype
        self.device = raw.device
        s0, s1 = raw.stride(0), raw.stride(1)
        base = raw.storage_offset()
        # K[b, h, t, i] at page + i * block_size + t; V[b, h, t, i] at page + block_size * D + t * D + i
        self.k = raw.as_strided((nb, h, bs, d), (s0, s1, 1, bs), base)
        self.v = raw.as_strided((nb, h, bs, d), (s0, s1, d, 1), base + bs * d)
        # CPU_ATTN's own arguments: [blocks, Hkv, block_size, D] each, K pages then V pages
        self.key_cache, self.value_cache = raw.view(nb, h, 2 * bs, d).chunk(2, dim=2)

    def dim(self) -> int:
        return 4

    def __getitem__(self, index) -> torch.Tensor:
        """Entries ``[..., 2D]`` (K then V) at an index over the first three dims (block, head,
        token): integers, slices or index tensors, as on the logical cache."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > 3 or any(i is Ellipsis for i in index):
            raise IndexError("PackedPages indexes blocks, heads and tokens only (entries are K|V)")
        return torch.cat([self.k[index], self.v[index]], dim=-1)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Whole blocks in the logical layout ``[n, Hkv, block_size, 2D]`` (a copy)."""
        if dim != 0:
            raise IndexError("PackedPages selects whole blocks (dim 0) only")
        return torch.cat([index_blocks(self.k, index), self.v.index_select(0, index)], dim=-1)

    def __repr__(self) -> str:
        return f"PackedPages(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def layout_matches(write_fn, block_size: int, head_size: int, dtype: torch.dtype) -> bool:
    """Whether ``write_fn(key, value, key_cache, value_cache, slot_mapping)`` (vLLM's
    ``cpu_attn_reshape_and_cache`` for the engine's ISA) stores K and V where :class:`PackedPages`
    reads them: a small cache written through it, read back through the views."""
    nb, h, d = 3, 2, head_size
    raw = torch.zeros(nb, h, block_size, 2 * d, dtype=dtype)
    pages = PackedPages(raw)
    n = block_size + 3
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n, h, d, generator=gen).to(dtype)
    value = torch.randn(n, h, d, generator=gen).to(dtype)
    slots = torch.arange(n, dtype=torch.long) + block_size          # block 1 onwards
    write_fn(key, value, pages.key_cache, pages.value_cache, slots)
    blk, off = slots // block_size, slots % block_size
    return (torch.equal(pages.k[blk, :, off], key) and torch.equal(pages.v[blk, :, off], value)
            and bool((pages.k[0] == 0).all()) and bool((pages.v[0] == 0).all()))
