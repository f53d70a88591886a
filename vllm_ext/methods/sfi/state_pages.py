"""Which blocks of SFI's compact group hold what, per request (``docs/per_request_memory.md``).

A request's row of the compact group's block table is, in order:

- ``segment`` blocks: the compact segment, ``n_sink + k`` entries per KV head in the attention
  layer's own format (``ceil((n_sink + k) / block_size)``);
- ``kept`` blocks: ``sfi.keep_prefill``'s kept positions, ``Hkv x keep_prefill`` int32 (the page
  viewed as int32);
- ``tail`` blocks: the prompt-tail queries, ``w_prefill x Hq x D`` in the activation dtype (when
  the prefill end makes SFI's first selection).

Each fixed-size state takes ``ceil(bytes / page_bytes)`` blocks, ``page_bytes = Hkv x block_size x
2D x`` the cache's element size. All of them live as long as the request's compact segment: vLLM
gives the row in the step the request's length reaches :func:`first_state_len` and frees it on
finish, abort and preemption. (The tail queries are read only at the prefill end; they stay for the
request's life because vLLM frees a request's blocks only all at once or as a window's leading
blocks, and at 2 of the preset's 68 blocks they are not worth a group of their own.) Torch only (no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.paged_rows import state_pages


@dataclass(frozen=True)
class SfiStatePages:
    """Blocks per request of each part of a compact-group row (module doc)."""
    segment: int
    kept: int = 0
    tail: int = 0

    @property
    def total(self) -> int:
        return self.segment + self.kept + self.tail

    @property
    def kept_first(self) -> int:
        return self.segment

    @property
    def tail_first(self) -> int:
        return self.segment + self.kept


def sfi_state_pages(cfg: SfiConfig, *, block_size: int, num_kv_heads: int, head_size: int,
                    num_heads: int, cache_dtype: torch.dtype, act_dtype: torch.dtype) -> SfiStatePages:
    """The row layout of one layer's compact group for ``cfg`` and the layer's geometry."""
    page = (num_kv_heads, block_size, 2 * head_size)
    kept = (state_pages(num_kv_heads * cfg.keep_prefill, torch.int32, page, cache_dtype)
            if cfg.keep_prefill else 0)
    tail = (state_pages(cfg.w_prefill * num_heads * head_size, act_dtype, page, cache_dtype)
            if cfg.prefill_end_selection else 0)
    return SfiStatePages(segment=-(-(cfg.n_sink + cfg.k) // block_size), kept=kept, tail=tail)


def first_compact_len(cfg: SfiConfig) -> int:
    """The shortest context for which SFI writes a compact segment: a sparse decode row needs
    ``t > max(min_len, n_sink + n_recent + k)`` and a prefill-end selection ``P > n_sink + n_recent +
    k``, with ``k >= k_min`` for any request (its own override included)."""
    return cfg.n_sink + cfg.n_recent + cfg.k_min + 1


def tail_window(cfg: SfiConfig) -> int:
    """Prompt positions whose queries a request keeps in its blocks (0: no prefill-end selection)."""
    return cfg.w_prefill if cfg.prefill_end_selection else 0


def first_state_len(first_len: int, tail: int, prompt_len: int) -> int:
    """The length (tokens held after the step) from which a request with a ``prompt_len``-token
    prompt holds its compact-group blocks: ``first_len`` (:func:`first_compact_len`), or earlier for
    a prompt long enough to make a prefill-end selection (``P >= first_len``), whose chunk computing
    position ``P - tail`` (``tail``: :func:`tail_window`) already writes its tail queries there, i.e.
    from a length of ``P - tail + 1``. A prompt too short to select never writes tail queries: a
    short chat holds no blocks until its decode reaches ``first_len``."""
    if tail and prompt_len >= first_len:
        return max(1, min(first_len, prompt_len - tail + 1))
    return first_len
