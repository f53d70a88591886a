"""SFI's copy-trigger token history in vLLM's block manager: its KV-cache spec and manager (vLLM glue;
``docs/per_request_memory.md``).

With ``sfi.copy_ngram`` on, every SPEEDSFI layer with a compact cache also has a history cache layer
(``vllm_ext.methods.sfi.caches``) reporting :class:`SfiHistorySpec`: the attention
layer's page format, so vLLM groups it beside the attention layers (one history layer per compact
layer keeps their group pattern) and both draw block ids from the one shared pool. A request's
history is one int32 per position: ``E = real page bytes / 4`` positions per page, ``cdiv(t, E)``
blocks at length ``t``, grown as the request grows like its KV and held for its life (finish, abort
and preemption free them), from its first chunk: the history records every input token, the prompt
included. It lives in the pages of one layer of the group (``vllm_ext.methods.sfi.history_slots``); the
other layers' pages of those blocks are unused. Never prefix-cached or shared.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ext import metrics
from vllm_ext.kernels.token_history import history_pages
from vllm_ext.method_kv_spec import GrowingPagesManager, GrowingPagesSpec, page_format, register_method_spec


@dataclass(frozen=True, kw_only=True)
class SfiHistorySpec(GrowingPagesSpec):
    """One SPEEDSFI layer's share of the token history: pages of the layer's format, ``cdiv(t, E)``
    at length ``t``."""

    # the one interface (``vllm_ext.method_slots``): the method whose per-request memory this group holds
    speedsfi_method = "sfi"

    @property
    def page_elems(self) -> int:
        """``E``: int32 positions per page (the page's real bytes, padding excluded)."""
        return self.real_page_size_bytes // 4

    def pages_for(self, num_tokens: int) -> int:
        return history_pages(num_tokens, self.page_elems)


class SfiHistoryManager(GrowingPagesManager):
    """``cdiv(t, E)`` pages for every request from its first chunk (the group exists only with the
    copy trigger on; a request's own SFI override is not known here)."""

    def on_first_pages(self, request_id: str) -> None:
        metrics.bump("sfi.history_allocations")      # once per request and group (and per resume)


def register_history_kv_spec() -> None:
    """Register the spec and its manager (idempotent; after vLLM's built-ins, as SFI's compact spec)."""
    register_method_spec(SfiHistorySpec, SfiHistoryManager)


def history_spec_for(spec: AttentionSpec, *, max_len: int) -> SfiHistorySpec:
    """The history spec beside an attention layer's ``spec`` (same page format); ``max_len``: the
    model's max_model_len (the most a request holds)."""
    return SfiHistorySpec(**page_format(spec), max_len=max_len)
