"""CritiPrefill's per-request state in vLLM's block manager: its KV-cache spec and manager (vLLM glue;
``docs/per_request_memory.md``).

Every SPEEDSFI layer below SPEED's cut (its dense layers included: one group pattern with the
attention layers, see ``vllm_ext.backend.impl``; their pages are never read) has a companion cache
layer (``vllm_ext.methods.critiprefill.state_cache``) reporting
:class:`CritiPrefillStateSpec`: the attention layer's page format, so vLLM groups it beside the
attention layers and both draw block ids from the one shared pool. The state's layout in those pages
is ``vllm_ext.methods.critiprefill.state_layout``.

:class:`CritiPrefillStateManager` gives a request pages only when its prompt has a sparse range
(``vllm_ext.methods.critiprefill.chunking.is_critiprefill_prompt``, decided by the prompt length alone), and
grows them with the prompt's chunks (``state_pages`` of the tokens scheduled so far, never past the
prompt). Once the prompt is computed (vLLM's ``remove_skipped_blocks``, called every step before
the request's allocation with the tokens whose forward has finished) it gives them all back, as
sliding-window layers give back what left the window; finish, abort and preemption free them too.
A resumed request starts over (its recompute grows them again). Never prefix-cached or shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ext import metrics
from vllm_ext.method_kv_spec import GrowingPagesManager, GrowingPagesSpec, page_format, register_method_spec
from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.critiprefill.chunking import is_critiprefill_prompt
from vllm_ext.methods.critiprefill.state_layout import carry_entries, state_pages


@dataclass(frozen=True, kw_only=True)
class CritiPrefillStateSpec(GrowingPagesSpec):
    """One sparse layer's CritiPrefill state: pages of the layer's format, growing with the prompt."""

    carry_entries: int = 1          # G = Hq / Hkv times the page entries a query head's carry takes
    cp_block_size: int = 16         # critiprefill.block_size (key block)
    segment_size: int = 512
    budget: int = 2048
    min_len: int = 0
    sink_block: bool = False

    # the one interface (``vllm_ext.method_slots``): the method whose per-request memory this group holds
    speedsfi_method = "critiprefill"

    def pages_for(self, num_tokens: int) -> int:
        return state_pages(num_tokens, self.carry_entries, self.cp_block_size, self.block_size)

    @property
    def cp_config(self) -> CritiPrefillConfig:
        return CritiPrefillConfig(enabled=True, block_size=self.cp_block_size, segment_size=self.segment_size,
                                  budget=self.budget, min_len=self.min_len, sink_block=self.sink_block)

    # blocks_per_request (GrowingPagesSpec): a ``max_model_len`` prompt's pages, what "Maximum
    # concurrency" counts; a bound, since the state is freed when the prefill ends


class CritiPrefillStateManager(GrowingPagesManager):
    """Pages for a CritiPrefill prompt's state, grown with its chunks, freed when it is computed."""

    def __init__(self, kv_cache_spec: CritiPrefillStateSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self._cfg = kv_cache_spec.cp_config
        self._prompt_len: dict[str, int] = {}       # from vLLM's per-step remove_skipped_blocks
        self._done: set[str] = set()                 # prompt computed: state given back

    def target_pages(self, request_id: str, num_tokens: int) -> int:
        plen = self._prompt_len.get(request_id, 0)
        if request_id in self._done or not is_critiprefill_prompt(self._cfg, plen):
            return 0
        return self.kv_cache_spec.pages_for(min(num_tokens, plen))

    def on_first_pages(self, request_id: str) -> None:
        metrics.bump("critiprefill.state_allocations")   # once per request and group (and resume)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        if prefill_end > 0:          # a new request's admission check runs before remove_skipped_blocks
            self._prompt_len.setdefault(request_id, prefill_end)
        return self._growth(request_id, num_tokens)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is not None:
            self._prompt_len[request_id] = num_prompt_tokens
        plen = self._prompt_len.get(request_id, 0)
        if request_id in self._done or plen <= 0 or processed_computed_tokens < plen:
            return
        self._done.add(request_id)
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            # the prompt is computed (its last chunk's forward has finished): the state is never read again
            self._remove_blocks_in_range(request_id, 0, len(blocks))
            metrics.bump("critiprefill.state_released_at_prefill_end")

    def pop_blocks_for_free(self, request_id: str):
        self._prompt_len.pop(request_id, None)
        self._done.discard(request_id)
        return super().pop_blocks_for_free(request_id)


def register_critiprefill_kv_spec() -> None:
    """Register the spec and its manager (idempotent; after vLLM's built-ins, as SFI's)."""
    register_method_spec(CritiPrefillStateSpec, CritiPrefillStateManager)


def state_spec_for(spec: AttentionSpec, cfg: CritiPrefillConfig, *, num_heads: int, max_len: int,
                   query_dtype: torch.dtype) -> CritiPrefillStateSpec:
    """The state spec beside an attention layer's ``spec`` (same page format; the query carry in the
    bytes of ``query_dtype``: ``state_layout.carry_entries``)."""
    carry = carry_entries(num_heads, spec.num_kv_heads, query_dtype.itemsize, spec.dtype.itemsize)
    return CritiPrefillStateSpec(**page_format(spec), carry_entries=carry,
                                 cp_block_size=cfg.block_size, segment_size=cfg.segment_size,
                                 budget=cfg.budget, min_len=cfg.min_len, sink_block=cfg.sink_block,
                                 max_len=max_len)
