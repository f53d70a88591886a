"""A fixed-size per-request array kept in KV-cache pages: the part of a tensor's interface that the
per-request tables' readers and writers use (``docs/per_request_memory.md``).

vLLM's block manager hands each request a row of block ids (a block table); SFI stores fixed-size
per-request state (the kept prefill positions, the prompt-tail queries) in blocks of its compact
group beside the compact segment. The page memory has the attention layer's format, ``[num_blocks,
H, block_size, C]`` (any strides, the last axis contiguous), so a state of another dtype views it as
``[num_blocks, H, block_size, C']`` with ``C' = C x cache element size / state element size``; a
page then holds ``H x block_size x C'`` elements of the state.

A request's state is ``shape`` elements of ``dtype`` in row-major order: element ``f`` lives in block
``table[slot, first + f // page_elems]`` at ``(h, n, c)`` = ``f % page_elems`` unravelled over ``(H,
block_size, C')``. :class:`PagedRows` reads and writes it through the table (``table [slots, n]``
int32, the per-slot block table the kernels read). Gathers for a negative slot give ``fill``
(nothing is read). Torch only; the Triton kernels that read such a state compute the same address
(``vllm_ext.kernels.sfi_selector``'s exclude kernel).
"""

from __future__ import annotations

import math

import torch


def state_pages(numel: int, dtype: torch.dtype, page_shape: tuple[int, int, int],
                cache_dtype: torch.dtype) -> int:
    """Pages of ``page_shape`` (``H, block_size, C`` in ``cache_dtype``) that hold ``numel``
    elements of ``dtype``."""
    page_bytes = math.prod(page_shape) * _esize(cache_dtype)
    return -(-numel * _esize(dtype) // page_bytes)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PagedRows:
    """``[slots, *shape]`` of ``dtype``, slot ``s`` in blocks ``table[s, first:first + pages]`` of
    ``cache`` (the layer's page memory, ``[num_blocks, H, block_size, C]``)."""

    def __init__(self, cache: torch.Tensor, table: torch.Tensor, first: int, shape: tuple[int, ...],
                 dtype: torch.dtype, fill: float = 0):
        if cache.stride(-1) != 1:
            raise ValueError("PagedRows: the page memory's last axis must be contiguous")
        self.pages = cache if cache.dtype == dtype else cache.view(dtype)    # [NB, H, bs, C']
        self.table = table
        self.first = int(first)
        self.row_shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.device = cache.device
        self.fill = fill
        _, h, bs, c = self.pages.shape
        self.page_dims = (int(h), int(bs), int(c))
        self.page_elems = int(h) * int(bs) * int(c)
        self.numel = math.prod(self.row_shape)
        self.num_pages = -(-self.numel // self.page_elems)
        if self.first + self.num_pages > table.shape[1]:
            raise ValueError(f"PagedRows: {self.num_pages} pages from column {self.first} do not fit "
                             f"a block table of {table.shape[1]} columns")

    # -------------------------------------------------------------- the tensor interface used
    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.table.shape[0]), *self.row_shape)

    def dim(self) -> int:
        return 1 + len(self.row_shape)

    @property
    def nbytes(self) -> int:
        return 0                        # the pages are vLLM's KV cache

    def __getitem__(self, slot) -> torch.Tensor:
        """The rows of ``slot`` (an int or an index tensor ``[n]``): ``[n, *shape]`` (``fill`` where
        the slot is negative)."""
        if isinstance(slot, int):
            return self[torch.tensor([slot], device=self.device)][0]
        slot = slot.to(self.device).long().reshape(-1)
        f = torch.arange(self.numel, device=self.device)
        out = self.pages[self._locate(slot[:, None], f[None, :])]
        out = torch.where((slot >= 0)[:, None], out, torch.tensor(self.fill, dtype=self.dtype,
                                                                    device=self.device))
        return out.view(-1, *self.row_shape)

    def index_copy_(self, dim: int, slot: torch.Tensor, values: torch.Tensor) -> "PagedRows":
        """``self[slot[i]] = values[i]`` (the rows' leading part when ``values`` is narrower in a
        trailing axis, as ``values`` of shape ``[n, *shape]`` is usual)."""
        if dim != 0:
            raise ValueError("PagedRows.index_copy_ copies whole slots (dim 0)")
        slot = slot.to(self.device).long().reshape(-1)
        if values.shape[1:] != self.row_shape:
            raise ValueError(f"PagedRows: rows of shape {self.row_shape}, got {tuple(values.shape[1:])}")
        f = torch.arange(self.numel, device=self.device)
        self.pages.index_put_(self._locate(slot[:, None], f[None, :]),
                              values.reshape(slot.shape[0], -1).to(self.dtype))
        return self

    def index_put_(self, indices: tuple[torch.Tensor, torch.Tensor], values: torch.Tensor) -> "PagedRows":
        """``self[slot[i], lead[i]] = values[i]`` for ``indices = (slot, lead)``: entry ``lead`` of
        the leading axis (e.g. a prompt-tail window entry)."""
        slot, lead = (t.to(self.device).long().reshape(-1) for t in indices)
        inner = math.prod(self.row_shape[1:])
        f = lead[:, None] * inner + torch.arange(inner, device=self.device)[None, :]
        self.pages.index_put_(self._locate(slot[:, None].expand_as(f), f),
                              values.reshape(slot.shape[0], inner).to(self.dtype))
        return self

    # ------------------------------------------------------------------------------ addresses
    def _locate(self, slot: torch.Tensor, f: torch.Tensor):
        """(block, h, n, c) index tensors of element ``f`` of slot ``slot`` (broadcast together)."""
        h, bs, c = self.page_dims
        page, r = torch.div(f, self.page_elems, rounding_mode="floor"), f % self.page_elems
        block = self.table[slot.clamp_min(0), self.first + page].long()
        return block, r // (bs * c), (r // c) % bs, r % c
