"""One layer's paged KV cache in the packed page format of vLLM's CPU attention kernels, read as the
logical cache our PyTorch twins read.

vLLM's ``CPU_ATTN`` C++ ops (``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``) keep
each (block, KV head) page of the ``[num_blocks, Hkv, block_size, 2 * D]`` tensor vLLM allocates
in an ISA-specific packing, K's ``block_size * D`` elements first, then V's:

- ``vec`` and ``vec16`` (x86 without AMX): K transposed (``[D, block_size]``), V row-major
  (``[block_size, D]``). No single strided view ``[blocks, Hkv, tokens, 2D]`` with K in
  ``[..., :D]`` expresses that, but a K view and a V view do, each with its own strides.
- ``amx`` (x86 with AMX tiles, bf16): both in the VNNI pairs its tile multiplies take. K as
  ``[block_size / 16][D / 2][16 tokens][2 dims]`` (the B operand of ``q @ K^T``: pairs of
  dimensions interleaved per token), V as ``[D / 16][block_size / 2][16 dims][2 tokens]`` (the B
  operand of ``p @ V``: pairs of tokens interleaved per dimension). No 4-d view expresses either, but
  a 6-d one does: ``[blocks, Hkv, tokens / t, t, D / e, e]`` in the logical order, with strides
  (``t`` = 16, ``e`` = 2 for K; ``t`` = 2, ``e`` = 16 for V): :class:`PageView`.

:class:`PackedPages` holds both views and offers the part of a tensor's interface the twins use on
the logical cache (``shape``, ``dtype``, ``device``, entry indexing, ``index_select`` of whole
blocks); :mod:`vllm_ext.kernels.paged_reference` reads it through :func:`split_kv`-style views.
Anything else raises (``AttributeError``, ``IndexError``), never reads the wrong bytes. The backend
checks the packing against vLLM's own write at start-up (:func:`layout_matches`) before it uses
this format (``vllm_ext.backend.dense_path``). The AMX layout was read off vLLM 0.32's write op
(every block size 32-128 and head size 32-256 the check covers): a later vLLM that packs otherwise
fails the check and runs the counted fallback.

Entries come back in the logical layout (K then V, ``2D`` wide), in the cache dtype: the twins'
arithmetic is unchanged. An fp8 cache is read through its fp8 view (``kernels.kv_quant``; vLLM
allocates ``uint8``), the packing's element offsets unchanged. Only the CPU build uses this; no
Triton kernel reads it.
"""

from __future__ import annotations

import torch


def index_blocks(src, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)`` for a cache view ``[B, ...]`` (or a :class:`PageView`), copying
    whole pages: on a view whose last axis is strided and the one before it contiguous
    (``CPU_ATTN``'s K, transposed per page) ``index_select`` copies element by element, about 7x
    slower (the 8K prompt's K of one layer on a fragmented cache: 2.0 ms against 0.3 ms as runs of
    consecutive blocks), so the gather runs on the transposed view with each page as one row (2.4x
    faster again than with two page axes)."""
    if isinstance(src, PageView):
        return src.index_select(0, index)
    if src.dim() >= 3 and src.stride(-2) == 1 and src.stride(-1) == src.shape[-2]:
        t = src.transpose(-1, -2)                              # pages contiguous in the last two axes
        return t.flatten(-2).index_select(0, index).view(-1, *t.shape[1:]).transpose(-1, -2)
    return src.index_select(0, index)


def split_view(t: torch.Tensor, tok: int, elem: int) -> torch.Tensor:
    """A ``[..., tokens, D]`` tensor (any strides) as ``[..., tokens / tok, tok, D / elem, elem]``
    (a view: splitting an axis never needs a copy)."""
    return t.unflatten(-1, (t.shape[-1] // elem, elem)).unflatten(-3, (t.shape[-2] // tok, tok))


class PageView:
    """K or V of every page, ``[blocks, Hkv, block_size, D]`` in the logical order, where the page's
    packing needs the token and the dimension axes split: ``t6`` is the 6-d strided view
    ``[blocks, Hkv, block_size / tok, tok, D / elem, elem]``. Indexing by (block, head, token) and
    whole-block gathers give logical tensors (copies); what else a tensor offers is not here."""

    def __init__(self, t6: torch.Tensor) -> None:
        self.t6 = t6
        nb, h, th, tok, eh, elem = t6.shape
        self.tok, self.elem = tok, elem
        self.shape = torch.Size((nb, h, th * tok, eh * elem))
        self.dtype = t6.dtype
        self.device = t6.device

    def dim(self) -> int:
        return 4

    def _index(self, index) -> tuple:
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > 3 or any(i is Ellipsis or i is None for i in index):
            raise IndexError("a PageView indexes blocks, heads and tokens only")
        if len(index) < 3:
            return index
        tok = index[2]
        if isinstance(tok, slice):
            raise IndexError("a PageView takes tokens by integer or index tensor, not by slice")
        return index[:2] + (tok // self.tok, tok % self.tok)

    def __getitem__(self, index) -> torch.Tensor:
        """Entries ``[..., D]`` (or whole pages ``[..., block_size, D]`` when no token is given)."""
        idx = self._index(index)
        got = self.t6[idx]
        if len(idx) == 4:
            return got.flatten(-2)
        return got.flatten(-2).flatten(-3, -2)

    def __setitem__(self, index, value: torch.Tensor) -> None:
        idx = self._index(index)
        if len(idx) != 4:
            raise IndexError("a PageView writes entries (block, head, token) only")
        self.t6[idx] = value.unflatten(-1, (value.shape[-1] // self.elem, self.elem))

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Whole blocks ``[n, Hkv, block_size, D]`` (contiguous)."""
        if dim != 0:
            raise IndexError("a PageView selects whole blocks (dim 0) only")
        return self.t6.index_select(0, index).flatten(-2).flatten(-3, -2)

    def copy_(self, src: torch.Tensor) -> "PageView":
        """Every page from a logical ``[blocks, Hkv, block_size, D]`` tensor."""
        self.t6.copy_(split_view(src, self.tok, self.elem))
        return self

    def copy_blocks_to(self, dst: torch.Tensor, blocks, perm: tuple) -> None:
        """``dst.copy_(self[blocks].permute(perm))`` in one copy, without the logical intermediate:
        ``blocks`` a slice or an index tensor of blocks, ``perm`` a permutation of the 4 logical axes
        (block, head, token, dim); ``dst`` has the permuted shape, any strides."""
        src = self.t6[blocks] if isinstance(blocks, slice) else self.t6.index_select(0, blocks)
        axes = {0: (0,), 1: (1,), 2: (2, 3), 3: (4, 5)}
        src = src.permute(tuple(a for p in perm for a in axes[p]))
        for j in reversed(range(4)):             # split dst's axes from the last: indices stay valid
            if perm[j] == 2:
                dst = dst.unflatten(j, (dst.shape[j] // self.tok, self.tok))
            elif perm[j] == 3:
                dst = dst.unflatten(j, (dst.shape[j] // self.elem, self.elem))
        dst.copy_(src)

    def __repr__(self) -> str:
        return f"PageView(shape={tuple(self.shape)}, split=({self.tok}, {self.elem}), dtype={self.dtype})"


PACKED_ISAS = ("vec", "vec16", "amx")


class PackedPages:
    """``raw``: the contiguous ``[num_blocks, Hkv, block_size, 2 * D]`` tensor vLLM allocated, whose
    pages hold ``CPU_ATTN``'s packing for ``isa`` (``vec``/``vec16``: ``k``, ``v`` are 4-d strided
    views; ``amx``: :class:`PageView`)."""

    def __init__(self, raw: torch.Tensor, isa: str = "vec") -> None:
        if raw.dim() != 4 or not raw.is_contiguous():
            raise ValueError(f"PackedPages needs the contiguous [blocks, Hkv, block_size, 2D] cache, "
                             f"got shape {tuple(raw.shape)} strides {raw.stride()}")
        if isa not in PACKED_ISAS:
            raise ValueError(f"PackedPages reads CPU_ATTN's {PACKED_ISAS} packings, not {isa!r}")
        nb, h, bs, c = raw.shape
        d = c // 2
        if isa == "amx" and (bs % 16 or d % 16):
            raise ValueError(f"CPU_ATTN's amx packing needs block and head sizes that are multiples "
                             f"of 16, got {bs} and {d}")
        self.raw = raw
        self.isa = isa
        self.shape = raw.shape
        self.dtype = raw.dtype
        self.device = raw.device
        s0, s1 = raw.stride(0), raw.stride(1)
        base = raw.storage_offset()
        if isa == "amx":
            # K[b, h, t, i] at page + (t // 16) * 16D + (i // 2) * 32 + (t % 16) * 2 + i % 2
            self.k = PageView(raw.as_strided((nb, h, bs // 16, 16, d // 2, 2), (s0, s1, 16 * d, 2, 32, 1),
                                             base))
            # V[b, h, t, i] at page + bs*D + (i // 16) * 16bs + (t // 2) * 32 + (i % 16) * 2 + t % 2
            self.v = PageView(raw.as_strided((nb, h, bs // 2, 2, d // 16, 16), (s0, s1, 32, 1, 16 * bs, 2),
                                             base + bs * d))
        else:
            # K[b, h, t, i] at page + i * block_size + t; V[b, h, t, i] at page + block_size * D + t * D + i
            self.k = raw.as_strided((nb, h, bs, d), (s0, s1, 1, bs), base)
            self.v = raw.as_strided((nb, h, bs, d), (s0, s1, d, 1), base + bs * d)
        # CPU_ATTN's own arguments: [blocks, Hkv, block_size, D] each, K pages then V pages
        self.key_cache, self.value_cache = raw.view(nb, h, 2 * bs, d).chunk(2, dim=2)
        self.op_caches = None               # the same as vLLM's C++ ops take them (cpu_attn_ops.vllm_caches)

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
        return (f"PackedPages(shape={tuple(self.shape)}, isa={self.isa}, dtype={self.dtype}, "
                f"device={self.device})")


def layout_matches(write_fn, block_size: int, head_size: int, dtype: torch.dtype, isa: str = "vec",
                   cache_dtype: torch.dtype | None = None) -> bool:
    """Whether ``write_fn(key, value, key_cache, value_cache, slot_mapping)`` (vLLM's
    ``cpu_attn_reshape_and_cache`` for the engine's ISA) stores K and V where :class:`PackedPages`
    reads them: a small cache written through it, read back through the views. ``dtype``: of the
    keys and values written; ``cache_dtype``: an fp8 cache's dtype (``write_fn`` then gets vLLM's
    ``uint8`` allocation and stores the values quantised with scale 1), else the cache is ``dtype``.
    The values written for an fp8 cache are fp8 values (exact in ``dtype``), so that the check is of
    where they land, not of how the write rounds (vLLM's CPU build rounds toward zero, CUDA's write
    to nearest)."""
    from vllm_ext.kernels.kv_quant import is_fp8, quantize

    nb, h, d = 3, 2, head_size
    fp8 = cache_dtype is not None and is_fp8(cache_dtype)
    raw = torch.zeros(nb, h, block_size, 2 * d, dtype=torch.uint8 if fp8 else dtype)
    pages = PackedPages(raw.view(cache_dtype) if fp8 else raw, isa)
    n = block_size + 3
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n, h, d, generator=gen)
    value = torch.randn(n, h, d, generator=gen)
    if fp8:
        key, value = quantize(key, 1.0, cache_dtype).float(), quantize(value, 1.0, cache_dtype).float()
    key, value = key.to(dtype), value.to(dtype)
    slots = torch.arange(n, dtype=torch.long) + block_size          # block 1 onwards
    key_cache, value_cache = raw.view(nb, h, 2 * block_size, d).chunk(2, dim=2)
    write_fn(key, value, key_cache, value_cache, slots)
    blk, off = slots // block_size, slots % block_size
    # fp8 compared as values: a zero may be stored with either sign
    same = (lambda a, b: torch.equal(a.float(), b.float())) if fp8 else torch.equal
    return (same(pages.k[blk, :, off], key) and same(pages.v[blk, :, off], value)
            and bool((raw[0].view(torch.uint8) == 0).all()))
