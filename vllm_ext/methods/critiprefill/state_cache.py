"""CritiPrefill's per-layer cache holder, as vLLM pages it (``vllm_ext.method_cache_layer``;
``docs/per_request_memory.md``): ``<layer>.critiprefill_state`` beside each SPEEDSFI attention layer
below SPEED's cut, holding each prompt's key-block representatives and query carry
(:class:`~vllm_ext.methods.critiprefill.kv_spec.CritiPrefillStateSpec`), read and written by
:mod:`vllm_ext.methods.critiprefill.path` through the group's block table.
"""

from __future__ import annotations

from vllm_ext.method_cache_layer import CacheKind, MethodCacheLayer, register_cache_layer
from vllm_ext.methods.critiprefill.state_layout import STATE_SUFFIX

STATE = CacheKind(STATE_SUFFIX, "SPEEDSFI_CRITIPREFILL_STATE")


def register_state_layer(forward_context: dict, attn_layer_name: str, cp_config, *, num_heads: int,
                         max_len: int, query_dtype) -> MethodCacheLayer:
    from vllm_ext.methods.critiprefill.kv_spec import state_spec_for

    return register_cache_layer(forward_context, attn_layer_name, STATE, lambda spec, attn, vc: (
        state_spec_for(spec, cp_config, num_heads=num_heads, max_len=max_len, query_dtype=query_dtype)))
