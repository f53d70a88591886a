"""The per-layer cache of Quest's page bounds, as vLLM pages it (``docs/per_request_memory.md``).

:class:`SfiQuestCache` is registered in the forward context beside a SPEEDSFI attention layer that
has a compact cache (``<layer>.sfi_quest``; the same layers, so the attention layers stay in one
group pattern), with ``sfi.selector = "quest"``. vLLM collects its spec
(``vllm_ext.sfi.quest_kv_spec.SfiQuestPagesSpec``), groups it, allocates its blocks from the shared
pool and binds a view of the KV cache to it (``kv_cache``, logically ``[num_blocks, Hkv, block_size,
2D]``). The attention impl reads and writes the bounds through the group's per-slot table
(``vllm_ext.sfi.quest_tables``). Backend: the compact caches' (page constraints, an empty builder).
"""

from __future__ import annotations

from vllm_ext.backend.method_cache_layer import MethodCacheLayer, register_cache_layer
from vllm_ext.backend.sfi_compact import SfiCompactBackend
from vllm_ext.sfi.quest_tables import QUEST_SUFFIX


class SfiQuestBackend(SfiCompactBackend):
    @staticmethod
    def get_name() -> str:
        return "SPEEDSFI_QUEST_PAGES"


class SfiQuestCache(MethodCacheLayer):
    """The Quest page bounds of one SPEEDSFI attention layer (``attn``), paged by vLLM."""

    backend = SfiQuestBackend

    def __init__(self, attn, prefix: str, sfi_config):
        super().__init__(attn, prefix)
        self.sfi_config = sfi_config

    def spec_for(self, attn_spec, attn, vllm_config):
        from vllm_ext.sfi.quest_kv_spec import quest_spec_for

        return quest_spec_for(attn_spec, self.sfi_config, max_len=vllm_config.model_config.max_model_len)


def register_quest_layer(forward_context: dict, attn_layer_name: str, sfi_config) -> SfiQuestCache:
    """The bound-page cache of ``attn_layer_name`` in the forward context, registered on first call."""
    return register_cache_layer(forward_context, attn_layer_name, QUEST_SUFFIX,
                                lambda attn, name: SfiQuestCache(attn, name, sfi_config))
