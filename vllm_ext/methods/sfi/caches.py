"""SFI's per-layer cache holders, as vLLM pages them (``vllm_ext.method_cache_layer``;
``docs/per_request_memory.md``). Beside each SPEEDSFI attention layer that decodes sparsely:

- ``<layer>.sfi_compact``: the compact segments (:class:`~vllm_ext.methods.sfi.kv_spec.SfiCompactSpec`),
  the kept positions and the prompt-tail queries, read and written by the attention impl through
  the group's per-slot block table;
- ``<layer>.sfi_history`` (``sfi.copy_ngram`` on): the copy trigger's token history, read by the
  step plan in the first layer's pages (:mod:`vllm_ext.methods.sfi.history_slots`);
- ``<layer>.sfi_quest`` (``sfi.selector = "quest"``): Quest's page bounds (the same layers, so the
  attention layers keep one group pattern).
"""

from __future__ import annotations

from vllm_ext.method_cache_layer import CacheKind, MethodCacheLayer, register_cache_layer
from vllm_ext.methods.sfi.history_slots import HISTORY_SUFFIX
from vllm_ext.methods.sfi.quest_tables import QUEST_SUFFIX
from vllm_ext.methods.sfi.slot_tables import COMPACT_SUFFIX

COMPACT = CacheKind(COMPACT_SUFFIX, "SPEEDSFI_COMPACT")
HISTORY = CacheKind(HISTORY_SUFFIX, "SPEEDSFI_SFI_HISTORY")
QUEST = CacheKind(QUEST_SUFFIX, "SPEEDSFI_QUEST_PAGES")


def register_compact_layer(forward_context: dict, attn_layer_name: str, sfi_config) -> MethodCacheLayer:
    from vllm_ext.methods.sfi.kv_spec import compact_spec_for

    return register_cache_layer(forward_context, attn_layer_name, COMPACT, lambda spec, attn, vc: (
        compact_spec_for(spec, sfi_config, num_heads=attn.num_heads, act_dtype=vc.model_config.dtype)))


def register_history_layer(forward_context: dict, attn_layer_name: str, *, max_len: int) -> MethodCacheLayer:
    from vllm_ext.methods.sfi.history_kv_spec import history_spec_for

    return register_cache_layer(forward_context, attn_layer_name, HISTORY,
                                lambda spec, attn, vc: history_spec_for(spec, max_len=max_len))


def register_quest_layer(forward_context: dict, attn_layer_name: str, sfi_config) -> MethodCacheLayer:
    from vllm_ext.methods.sfi.quest_kv_spec import quest_spec_for

    return register_cache_layer(forward_context, attn_layer_name, QUEST, lambda spec, attn, vc: (
        quest_spec_for(spec, sfi_config, max_len=vc.model_config.max_model_len)))
