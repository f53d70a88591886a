"""The per-layer cache of SFI's copy-trigger token history, as vLLM pages it
(``docs/per_request_memory.md``).

:class:`SfiHistoryCache` is an ``AttentionLayerBase`` registered in the forward context beside a
SPEEDSFI attention layer that has a compact cache (``<layer>.sfi_history``), with ``sfi.copy_ngram``
on: vLLM collects its spec (``vllm_ext.sfi.history_kv_spec.SfiHistorySpec``, the attention layer's
page format), groups it, allocates its blocks from the shared pool as the request grows and binds a
view of the KV cache to it (``kv_cache``). The model never calls it; the step plan reads and writes
the history in the first layer's pages through the group's block table (the runner hooks hand the
group's page memory and block-table rows to ``vllm_ext.sfi.history_slots``). Its backend is the
compact caches' (page constraints, a builder that builds nothing).
"""

from __future__ import annotations

from vllm_ext.backend.method_cache_layer import MethodCacheLayer, register_cache_layer
from vllm_ext.backend.sfi_compact import SfiCompactBackend
from vllm_ext.sfi.history_slots import HISTORY_SUFFIX


class SfiHistoryBackend(SfiCompactBackend):
    @staticmethod
    def get_name() -> str:
        return "SPEEDSFI_SFI_HISTORY"


class SfiHistoryCache(MethodCacheLayer):
    """One SPEEDSFI layer's pages of the token history (``attn``: the attention layer), paged by vLLM."""

    backend = SfiHistoryBackend

    def __init__(self, attn, prefix: str, *, max_len: int):
        super().__init__(attn, prefix)
        self.max_len = max_len

    def spec_for(self, attn_spec, attn, vllm_config):
        from vllm_ext.sfi.history_kv_spec import history_spec_for

        return history_spec_for(attn_spec, max_len=self.max_len)


def register_history_layer(forward_context: dict, attn_layer_name: str, *, max_len: int) -> SfiHistoryCache:
    """The history cache of ``attn_layer_name`` in the forward context, registered on first call."""
    return register_cache_layer(forward_context, attn_layer_name, HISTORY_SUFFIX,
                                lambda attn, name: SfiHistoryCache(attn, name, max_len=max_len))
