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

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from vllm_ext.backend.sfi_compact import SfiCompactBackend
from vllm_ext.sfi.history_slots import HISTORY_SUFFIX


class SfiHistoryBackend(SfiCompactBackend):
    @staticmethod
    def get_name() -> str:
        return "SPEEDSFI_SFI_HISTORY"


class SfiHistoryCache(torch.nn.Module, AttentionLayerBase):
    """One SPEEDSFI layer's pages of the token history (``attn``: the attention layer), paged by vLLM."""

    def __init__(self, attn, prefix: str, *, max_len: int):
        super().__init__()
        self.kv_cache = torch.tensor([])
        self.layer_name = prefix
        self.max_len = max_len
        self._attn = [attn]          # not a submodule: the model owns the attention layer

    def get_kv_cache_spec(self, vllm_config):
        from vllm.v1.kv_cache_interface import AttentionSpec

        from vllm_ext.sfi.history_kv_spec import history_spec_for

        spec = self._attn[0].get_kv_cache_spec(vllm_config)
        if not isinstance(spec, AttentionSpec):
            return None
        return history_spec_for(spec, max_len=self.max_len)

    def get_attn_backend(self):
        return SfiHistoryBackend

    def forward(self):  # never called: the step plan reads the pages
        raise RuntimeError("SfiHistoryCache is a KV-cache holder, not a model layer")


def register_history_layer(forward_context: dict, attn_layer_name: str, *, max_len: int) -> SfiHistoryCache:
    """The history cache of ``attn_layer_name`` in the forward context, registered on first call
    (before vLLM collects the KV-cache specs: the attention impl calls this while the weights load)."""
    name = attn_layer_name + HISTORY_SUFFIX
    layer = forward_context.get(name)
    if layer is None:
        layer = SfiHistoryCache(forward_context[attn_layer_name], name, max_len=max_len)
        forward_context[name] = layer
    return layer
