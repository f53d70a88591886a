"""Where a prompt's prefill may be cut so that CritiPrefill's segments never are.

A query segment of the sparse range (``vllm_ext.critiprefill.slots.sparse_range``) chooses its key
blocks from the max/min of *its* queries (ALGORITHMS.md §3). A chunk boundary inside such a segment
would make the chunk before it choose from part of the segment's queries, and that part's output
would depend on the token budget and on the other requests of the step. So the scheduler
(``vllm_ext.scheduler_policy``) ends every prefill chunk of a CritiPrefill prompt that stops inside
the sparse range on a segment boundary, and cuts prefix-cache hits the same way: each segment of
the sparse range is then computed whole, in one chunk, whatever the traffic. Chunks outside the
sparse range (the dense head before it, the final segment) are exact whatever their boundaries.

Pure functions of the prompt and the configuration (no vLLM, no torch).
"""

from __future__ import annotations

from vllm_ext.config import CritiPrefillConfig
from vllm_ext.critiprefill.slots import sparse_range


def aligned_chunk(cfg: CritiPrefillConfig, prompt_len: int, computed: int, num_new: int) -> int:
    """``num_new`` (the scheduler's chunk ``[computed, computed + num_new)``) shortened so that it
    does not end strictly inside a segment of the sparse range; 0 when the chunk cannot reach the
    next segment boundary this step (the request waits for a step with more budget)."""
    if num_new <= 0:
        return num_new
    lo, hi = sparse_range(cfg, prompt_len)
    end = computed + num_new
    seg_start = end - end % cfg.segment_size
    if seg_start == end or not lo <= seg_start < hi:
        return num_new
    return max(seg_start - computed, 0)


def touches_sparse_range(cfg: CritiPrefillConfig, prompt_len: int, computed: int, num_new: int) -> bool:
    """The chunk holds queries that attend sparsely (the worker then holds a CritiPrefill slot for
    the request until its prefill ends: ``CritiPrefillSlots.plan``)."""
    lo, hi = sparse_range(cfg, prompt_len)
    return num_new >= 2 and max(computed, lo) < min(computed + num_new, hi)


def prefix_hit_limit(cfg: CritiPrefillConfig, prompt_len: int, num_hit: int, block_size: int) -> int:
    """The longest usable prefix-cache hit ``<= num_hit`` (whole KV blocks) that does not start the
    computed part strictly inside a segment of the sparse range."""
    lo, hi = sparse_range(cfg, prompt_len)
    limit = num_hit
    while True:
        seg_start = limit - limit % cfg.segment_size
        if seg_start == limit or not lo <= seg_start < hi:
            return limit
        limit = seg_start - seg_start % block_size        # a block boundary, maybe in an earlier segment
