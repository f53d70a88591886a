"""Quest's page bounds in vLLM's block manager: their KV-cache spec and its manager (vLLM glue;
``docs/per_request_memory.md``).

With ``sfi.selector = "quest"`` every SPEEDSFI layer with a compact cache also has a bound-page cache
layer (``vllm_ext.methods.sfi.caches``) reporting :class:`SfiQuestPagesSpec`: the
attention layer's page format, so vLLM groups it beside the attention layers (and the compact
layers) in the one shared pool. One Quest page's bounds (max and min of K over ``page_size`` tokens,
``Hkv x D`` each) fill one token entry of such a page (max in the K half, min in the V half), so a
request of ``t`` tokens holds ``cdiv(cdiv(t, page_size), block_size)`` blocks
(``vllm_ext.methods.sfi.quest_tables.quest_blocks``): ``1 / page_size`` of its KV blocks, rounded up.

:class:`SfiQuestPagesManager` gives a request its first blocks in the step its length reaches
``first_len`` (the shortest context SFI decodes sparsely at, as the compact blocks: a short chat
holds none) and grows them as the request grows, like KV; vLLM frees them on finish, abort and
preemption. Never prefix-cached or shared. A request that gets them after its first tokens writes
every page once (the worker's page progress restarts at page 0: ``vllm_ext.methods.sfi.quest_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ext import metrics
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.method_kv_spec import GrowingPagesManager, GrowingPagesSpec, page_format, register_method_spec
from vllm_ext.methods.sfi.quest_tables import quest_blocks
from vllm_ext.methods.sfi.state_pages import first_compact_len


@dataclass(frozen=True, kw_only=True)
class SfiQuestPagesSpec(GrowingPagesSpec):
    """One SPEEDSFI layer's Quest page bounds: pages of the layer's format, growing with the request
    from ``first_len`` tokens."""

    quest_page_size: int = 16       # sfi.page_size (tokens per Quest page)
    first_len: int = 1

    # the one interface (``vllm_ext.method_slots``): the method whose per-request memory this group holds
    speedsfi_method = "sfi"

    def pages_for(self, num_tokens: int) -> int:
        return quest_blocks(int(num_tokens), self.quest_page_size, self.block_size)


class SfiQuestPagesManager(GrowingPagesManager):
    """Bound-page blocks for a request from its first length on, grown with it (held for its life)."""

    def wants_pages(self, request_id: str, num_tokens: int) -> bool:
        return num_tokens >= self.kv_cache_spec.first_len

    def on_first_pages(self, request_id: str) -> None:
        metrics.bump("sfi.quest_page_allocations")    # once per request and group (and per resume)


def register_quest_kv_spec() -> None:
    """Register the spec and its manager (idempotent; after vLLM's built-ins, as the compact spec)."""
    register_method_spec(SfiQuestPagesSpec, SfiQuestPagesManager)


def quest_spec_for(spec: AttentionSpec, cfg: SfiConfig, *, max_len: int) -> SfiQuestPagesSpec:
    """The bound-page spec beside an attention layer's ``spec`` (same page format)."""
    return SfiQuestPagesSpec(**page_format(spec), quest_page_size=cfg.page_size, first_len=first_compact_len(cfg),
                             max_len=max_len)
