"""Where a prompt's prefill may be cut so that CritiPrefill's segments never are.

A query segment of the sparse range (``vllm_ext.methods.critiprefill.slots.sparse_range``) chooses its key
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

from vllm_ext.methods.critiprefill.config import CritiPrefillConfig


def first_sparse_segment(cfg: CritiPrefillConfig) -> int:
    """The first segment that starts at or after ``min_len`` (the authors' ``threshold_len``) and has
    more blocks before it than it selects (one with fewer selects them all, which is dense)."""
    per_seg = cfg.segment_size // cfg.block_size
    past_budget = cfg.selected_blocks // per_seg + 1
    past_threshold = -(-cfg.min_len // cfg.segment_size)
    return max(past_budget, past_threshold)


def sparse_range(cfg: CritiPrefillConfig, prompt_len: int) -> tuple[int, int]:
    """Absolute positions ``[lo, hi)`` whose queries attend sparsely (empty when ``lo >= hi``): from
    the first sparse segment to the prompt's final segment, which is dense."""
    if prompt_len <= 0:
        return 0, 0
    final = (prompt_len - 1) // cfg.segment_size
    return first_sparse_segment(cfg) * cfg.segment_size, final * cfg.segment_size


def is_critiprefill_prompt(cfg: CritiPrefillConfig, prompt_len: int) -> bool:
    """The prompt has a sparse range: every chunk of its prefill (of two tokens or more) runs
    through CritiPrefill's kernel, its dense segments included, so that no position's kernel
    depends on how the prompt was chunked."""
    lo, hi = sparse_range(cfg, prompt_len)
    return lo < hi


def is_critiprefill_chunk(cfg: CritiPrefillConfig, prompt_len: int, computed: int, num_new: int) -> bool:
    """The chunk ``[computed, computed + num_new)`` is a CritiPrefill row of its step (the worker
    holds a CritiPrefill slot for the request from its first such chunk until its prefill ends:
    ``CritiPrefillSlots.plan``)."""
    return num_new >= 2 and computed < prompt_len and is_critiprefill_prompt(cfg, prompt_len)


def aligned_chunk(cfg: CritiPrefillConfig, prompt_len: int, computed: int, num_new: int) -> int:
    """``num_new`` (the scheduler's chunk ``[computed, computed + num_new)``) shortened so that it
    does not end strictly inside a segment of the sparse range, nor leave or be a one-token chunk
    of the prompt (one-token rows run among the decode rows, through the dense path); 0 when no
    such chunk fits this step (the request waits for a step with more budget). A step with
    ``segment_size + 1`` tokens for the request always moves it (start-up refuses a smaller token
    budget)."""
    if num_new <= 0 or computed >= prompt_len or not is_critiprefill_prompt(cfg, prompt_len):
        return num_new
    lo, hi = sparse_range(cfg, prompt_len)
    end = computed + num_new
    while True:
        seg_start = end - end % cfg.segment_size
        if seg_start != end and lo <= seg_start < hi:
            end = seg_start
        elif end == prompt_len - 1:
            end -= 1
        else:
            break
    n = max(end - computed, 0)
    if n == 1 and prompt_len - computed > 1:
        return 0
    return n


def prefix_hit_limit(cfg: CritiPrefillConfig, prompt_len: int, num_hit: int, block_size: int) -> int:
    """The longest usable prefix-cache hit ``<= num_hit`` (whole KV blocks) that does not start the
    computed part strictly inside a segment of the sparse range, and leaves at least two prompt
    tokens to compute (no one-token chunk)."""
    if not is_critiprefill_prompt(cfg, prompt_len):
        return num_hit
    lo, hi = sparse_range(cfg, prompt_len)
    limit = min(num_hit, prompt_len - 2)
    limit -= limit % block_size
    while True:
        seg_start = limit - limit % cfg.segment_size
        if seg_start == limit or not lo <= seg_start < hi:
            return max(limit, 0)
        limit = seg_start - seg_start % block_size        # a block boundary, maybe in an earlier segment


def move_critiprefill_rows_last(batch, num_scheduled_tokens, cfg) -> int:
    """Move the rows that run CritiPrefill this step (``vllm_ext.methods.critiprefill.chunking.
    is_critiprefill_chunk``) behind every other row of vLLM's persistent batch, so that the step's
    CritiPrefill sub-batch holds them only: a row's kernel then depends on its own request, not on
    whether a CritiPrefill row happened to come before it. Such rows have two tokens or more, so
    vLLM's decode-like rows (one token) stay in front. Returns the number of swaps."""
    req_ids = batch.req_ids
    n = len(req_ids)
    computed, plen = batch.num_computed_tokens_cpu, batch.num_prompt_tokens
    is_cp = [is_critiprefill_chunk(cfg, int(plen[i]), int(computed[i]),
                                   num_scheduled_tokens.get(req_ids[i], 0)) for i in range(n)]
    i, j, swaps = 0, n - 1, 0
    while i < j:
        if not is_cp[i]:
            i += 1
        elif is_cp[j]:
            j -= 1
        else:
            batch.swap_states(i, j)
            is_cp[i], is_cp[j] = False, True
            swaps += 1
    return swaps
