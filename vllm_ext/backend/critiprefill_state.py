"""The per-layer cache of CritiPrefill's per-request state, as vLLM pages it (``docs/per_request_memory.md``).

:class:`CritiPrefillStateCache` is an ``AttentionLayerBase`` registered in the forward context beside a
SPEEDSFI attention layer below SPEED's cut (``<layer>.critiprefill_state``), as SFI's compact caches
(``vllm_ext.backend.sfi_compact``) and vLLM's own ``DeepseekV32IndexerCache`` are: vLLM collects its
spec (``vllm_ext.critiprefill.kv_spec.CritiPrefillStateSpec``, the attention layer's page format),
groups it, allocates its blocks from the shared pool and binds a view of the KV cache to it
(``kv_cache``, logically ``[num_blocks, Hkv, block_size, 2D]``). The model never calls it; the
attention impl reads and writes the state through the group's block table
(``vllm_ext.backend.critiprefill_path``). Its backend is the compact caches' (page constraints, a
builder that builds nothing).
"""

from __future__ import annotations

from vllm_ext.backend.method_cache_layer import MethodCacheLayer, register_cache_layer
from vllm_ext.backend.sfi_compact import SfiCompactBackend
from vllm_ext.critiprefill.state_layout import STATE_SUFFIX


class CritiPrefillStateBackend(SfiCompactBackend):
    @staticmethod
    def get_name() -> str:
        return "SPEEDSFI_CRITIPREFILL_STATE"


class CritiPrefillStateCache(MethodCacheLayer):
    """The CritiPrefill state of one sparse SPEEDSFI attention layer (``attn``), paged by vLLM."""

    backend = CritiPrefillStateBackend

    def __init__(self, attn, prefix: str, cp_config, *, num_heads: int, max_len: int):
        super().__init__(attn, prefix)
        self.cp_config = cp_config
        self.num_heads = num_heads
        self.max_len = max_len

    def spec_for(self, attn_spec, attn, vllm_config):
        from vllm_ext.critiprefill.kv_spec import state_spec_for

        return state_spec_for(attn_spec, self.cp_config, num_heads=self.num_heads, max_len=self.max_len)


def register_state_layer(forward_context: dict, attn_layer_name: str, cp_config, *, num_heads: int,
                         max_len: int) -> CritiPrefillStateCache:
    """The state cache of ``attn_layer_name`` in the forward context, registered on first call."""
    return register_cache_layer(forward_context, attn_layer_name, STATE_SUFFIX,
                                lambda attn, name: CritiPrefillStateCache(attn, name, cp_config,
                                                                          num_heads=num_heads,
                                                                          max_len=max_len))
