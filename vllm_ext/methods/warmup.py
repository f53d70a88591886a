"""What every start-up warm-up shares: the shapes a layer's launches depend on besides its tensors,
the decode batch sizes that reach every integer class Triton specialises on, a block table as wide as
the runner's, and the dense path's own decode kernel (``paged_decode``). The backend runs each
layer's warm-up (:mod:`vllm_ext.backend.kernel_warmup`); each method warms up its own kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# decode batch sizes the warm-up runs: Triton specialises an integer argument on == 1 and on
# divisibility by 16, so these three reach every class a batch size can fall in
DECODE_BATCHES = (1, 2, 16)


@dataclass(frozen=True)
class WarmupShape:
    """What a layer's launches depend on besides its tensors."""
    max_rows: int                  # max_num_seqs
    block_table_width: int         # the runner's block table: ceil(max_model_len / block_size)


def chunked_batch(max_rows: int, capacity: int, chunk: int) -> int | None:
    """Rows of the warm-up batch that reaches the slow list's chunks 0..3 (or all it has), or None
    when a step never has more than one chunk. Every chunk launches the same shapes; what differs is
    each entry pointer's 16-byte alignment (``c x B x 4`` bytes, and ``x`` the block table's width),
    which repeats with a period of four chunks."""
    reach = min(max_rows, capacity)
    if reach <= chunk:
        return None
    return min(reach, 3 * chunk + 1)


def synthetic_block_table(shape: WarmupShape, rows: int, num_blocks: int, device) -> torch.Tensor:
    """Rows of a block table as wide as the runner's (its row stride is part of the compile key),
    pointing at blocks 1.. of the cache (read only)."""
    bt = torch.zeros(max(shape.max_rows, rows), shape.block_table_width, dtype=torch.int32,
                     device=device)
    ids = 1 + torch.arange(shape.block_table_width, dtype=torch.int32, device=device) % max(num_blocks - 1, 1)
    bt[:] = ids
    return bt


def warm_up_paged_decode(*, kv_cache: torch.Tensor, workspace, num_heads: int, head_size: int,
                         scale: float, dtype: torch.dtype, shape: WarmupShape,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``paged_decode`` (every method off with ``dense_decode = "paged_decode"``) at each batch class.
    ``k_scale``/``v_scale``: the layer's, as the forward passes them (fp8 pages: the scaled variant)."""
    from vllm_ext.kernels.dense_decode_evidence import paged_decode

    device = kv_cache.device
    bt = synthetic_block_table(shape, max(DECODE_BATCHES), kv_cache.shape[0], device)
    for rows in DECODE_BATCHES:
        if rows > shape.max_rows:
            continue
        q = torch.randn(rows, num_heads, head_size, dtype=dtype, device=device)
        seq = torch.full((rows,), 33, dtype=torch.int32, device=device)
        paged_decode(q, kv_cache, bt[:rows], seq, scale, torch.empty_like(q), workspace=workspace,
                     k_scale=k_scale, v_scale=v_scale)
