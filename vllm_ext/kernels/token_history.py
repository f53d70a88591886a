"""Where ``sfi.copy_ngram``'s token history lives: each slot's tokens by position, in pages reached
through a per-slot block table (``docs/per_request_memory.md``, ``vllm_ext.kernels.copy_match``).

Inside vLLM the history is blocks of SFI's history group (``vllm_ext.methods.sfi.history_kv_spec``): the page
memory of one history cache layer, ``[num_blocks, H, block_size, C]`` of the cache dtype (any
strides, the last axis contiguous), viewed as int32 ``[num_blocks, H, block_size, C']``; a page holds
``E = H x block_size x C'`` positions. Position ``pos`` of slot ``s`` is in block ``table[s, pos //
E]`` at ``pos % E`` unravelled over ``(H, block_size, C')``. A contiguous history ``[slots,
max_len]`` is the same with a trivial table (slot ``s`` in block ``s``, one page of ``max_len``
positions): what tests and benchmarks without vLLM drive. The Triton kernels compute the same
address. Torch only.
"""

from __future__ import annotations

import torch


def history_pages(num_tokens: int, page_elems: int) -> int:
    """Pages that hold ``num_tokens`` positions (int32 each) at ``page_elems`` per page."""
    return -(-int(num_tokens) // int(page_elems))


class TokenHistory:
    """Slots' token histories (int32): ``pages [num_blocks, H, block_size, C']`` through ``table
    [slots, W]``; positions ``[0, max_len)``."""

    def __init__(self, pages: torch.Tensor, table: torch.Tensor, max_len: int):
        if pages.dim() != 4 or pages.stride(-1) != 1:
            raise ValueError("TokenHistory: pages must be [num_blocks, H, block_size, C] with the last "
                             "axis contiguous")
        self.pages = pages if pages.dtype == torch.int32 else pages.view(torch.int32)
        self.table = table
        _, h, bs, c = self.pages.shape
        self.page_dims = (int(h), int(bs), int(c))
        self.page_elems = int(h) * int(bs) * int(c)
        self.max_len = int(max_len)
        if table.shape[1] * self.page_elems < self.max_len:
            raise ValueError(f"TokenHistory: {table.shape[1]} pages of {self.page_elems} positions do "
                             f"not hold {self.max_len}")

    @classmethod
    def contiguous(cls, slots: int, max_len: int, device) -> "TokenHistory":
        """``[slots, max_len]`` (-1 everywhere) with the trivial table."""
        return cls.of_tensor(torch.full((slots, max_len), -1, dtype=torch.int32, device=device))

    @classmethod
    def of_tensor(cls, history: torch.Tensor) -> "TokenHistory":
        """A contiguous ``history [slots, max_len]`` (int32) as a paged one: slot ``s`` is block ``s``."""
        table = torch.arange(history.shape[0], dtype=torch.int32, device=history.device)[:, None]
        return cls(history[:, None, None, :], table, history.shape[1])

    def locate(self, slot: torch.Tensor, pos: torch.Tensor):
        """(block, h, n, c) index tensors of position ``pos`` of slot ``slot`` (broadcast together;
        both in range)."""
        h, bs, c = self.page_dims
        e = self.page_elems
        page, r = torch.div(pos, e, rounding_mode="floor"), pos % e
        block = self.table[slot.long(), page.long()].long()
        return block, r // (bs * c), (r // c) % bs, r % c

    def read(self, slot: torch.Tensor | int) -> torch.Tensor:
        """The histories of ``slot`` (an int, or an index tensor ``[n]``): ``[max_len]`` or ``[n,
        max_len]``, read page by page (a copy)."""
        one = isinstance(slot, int)
        idx = torch.as_tensor([slot] if one else slot, device=self.table.device).long().reshape(-1)
        blocks = self.table[idx].long()                                 # [n, W]
        rows = self.pages[blocks].reshape(idx.shape[0], -1)[:, :self.max_len]
        return rows[0] if one else rows


def as_token_history(history) -> TokenHistory:
    """A :class:`TokenHistory`, or a contiguous ``[slots, max_len]`` int32 tensor viewed as one."""
    return history if isinstance(history, TokenHistory) else TokenHistory.of_tensor(history)
