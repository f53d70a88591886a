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
finish, abort and preemption. Torch only (no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ext.config import SfiConfig
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


def first_state_len(cfg: SfiConfig) -> int:
    """The shortest context at which a request gets its compact-group blocks: the shortest for which
    SFI writes a compact segment (a sparse decode row needs ``t > max(min_len, n_sink + n_recent +
    k)``, a prefill-end selection ``P > n_sink + n_recent + k``, with ``k >= k_min`` for any request),
    ``n_sink + n_recent + k_min + 1``, lowered by ``w_prefill - 1`` when the prefill end selects: a
    prompt of ``P`` tokens writes its tail queries (positions ``[P - w_prefill, P)``) from the chunk
    that computes position ``P - w_prefill``, i.e. from a length of ``P - w_prefill + 1``."""
    first = cfg.n_sink + cfg.n_recent + cfg.k_min + 1
    if cfg.prefill_end_selection:
        first -= cfg.w_prefill - 1
    return max(first, 1)
