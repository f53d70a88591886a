"""SFI's compact segments in vLLM's block manager: their KV-cache spec and its manager (vLLM glue;
``docs/per_request_memory.md``).

Every SPEEDSFI attention layer that can decode sparsely has a companion cache layer
(``vllm_ext.methods.sfi.caches``) reporting :class:`SfiCompactSpec`: the layer's own
page format (block size, KV heads, head size, dtype, so vLLM groups it beside the attention layers
and both draw block ids from the one shared pool), with a fixed ``compact_blocks`` blocks per
request: the compact segment and SFI's other fixed-size per-request state (the kept prefill
positions, the prompt-tail queries: ``vllm_ext.methods.sfi.state_pages``). :class:`SfiCompactManager` gives a request those blocks in the step its length first
reaches ``first_len`` (the shortest context SFI writes any of that state for), never earlier, and
vLLM frees them with the request's other blocks on finish, abort and preemption. The blocks are
never prefix-cached or shared (``prefix_cacheable`` is False: vLLM's hybrid coordinator leaves the
group out of hit lookup, and the manager caches nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ext import metrics
from vllm_ext.method_kv_spec import MethodPagesManager, MethodPagesSpec, page_format, register_method_spec
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.sfi.state_pages import first_compact_len, first_state_len, sfi_state_pages, tail_window


@dataclass(frozen=True, kw_only=True)
class SfiCompactSpec(MethodPagesSpec):
    """One SPEEDSFI layer's per-request SFI state: ``compact_blocks`` pages of the layer's format per
    request (the compact segment, then the kept positions and the prompt-tail queries:
    ``vllm_ext.methods.sfi.state_pages``), from the step its length reaches ``first_len``."""

    compact_blocks: int = 1
    first_len: int = 1
    # prompt positions whose queries the blocks hold (0: none): a prompt long enough to select gets
    # the blocks from the chunk that reaches its tail (``vllm_ext.methods.sfi.state_pages.first_state_len``)
    tail_window: int = 0

    # the one interface (``vllm_ext.method_slots``): the method whose per-request memory this group holds
    speedsfi_method = "sfi"

    @property
    def blocks_per_request(self) -> int:
        return self.compact_blocks

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return self.compact_blocks


class SfiCompactManager(MethodPagesManager):
    """``compact_blocks`` blocks per request once its length reaches its first state length
    (``first_len``, earlier for a prompt that writes tail queries); none before."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # each request's prefill end as the last block count saw it (vLLM's allocate_slots counts,
        # then allocates, with the same arguments; allocate_new_blocks is not told the prefill end)
        self._prefill_end: dict[str, int] = {}

    def _wants(self, request_id: str, num_tokens: int, prefill_end: int) -> int:
        spec = self.kv_cache_spec
        if self.req_to_blocks.get(request_id):
            return 0
        if num_tokens < first_state_len(spec.first_len, spec.tail_window, prefill_end):
            return 0
        return spec.compact_blocks

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        self._prefill_end[request_id] = prefill_end
        return self._wants(request_id, num_tokens, prefill_end)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        n = self._wants(request_id, num_tokens, self._prefill_end.get(request_id, 0))
        if not n:
            return []
        metrics.bump("sfi.compact_allocations")   # once per request and group (and per resume)
        return self._take(request_id, n)

    def pop_blocks_for_free(self, request_id: str):
        self._prefill_end.pop(request_id, None)    # free() and the deferred free both come here
        return super().pop_blocks_for_free(request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None                  # held for the request's life


def register_sfi_kv_spec() -> None:
    """Register the spec and its manager (idempotent; after vLLM's built-ins, as SPEED's)."""
    register_method_spec(SfiCompactSpec, SfiCompactManager)


def compact_spec_for(spec: AttentionSpec, cfg: SfiConfig, *, num_heads: int | None = None,
                     act_dtype=None) -> SfiCompactSpec:
    """The compact spec beside an attention layer's ``spec`` (same page format), with as many blocks
    per request as the layer's SFI state takes (``num_heads``, ``act_dtype``: the layer's query heads
    and activation dtype, for the prompt-tail queries; default the KV heads and the cache dtype)."""
    pages = sfi_state_pages(cfg, block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                            head_size=spec.head_size,
                            num_heads=spec.num_kv_heads if num_heads is None else num_heads,
                            cache_dtype=spec.dtype, act_dtype=spec.dtype if act_dtype is None else act_dtype)
    return SfiCompactSpec(**page_format(spec), compact_blocks=pages.total, first_len=first_compact_len(cfg),
                          tail_window=tail_window(cfg))
