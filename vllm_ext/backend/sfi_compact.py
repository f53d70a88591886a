"""The per-layer cache of SFI's compact segments, as vLLM pages it (``docs/per_request_memory.md``).

:class:`SfiCompactCache` is an ``AttentionLayerBase`` registered in the forward context beside a
SPEEDSFI attention layer (``<layer>.sfi_compact``), as vLLM's own ``DeepseekV32IndexerCache`` and
``CompressorStateCache`` are: vLLM collects its spec (``vllm_ext.sfi.kv_spec.SfiCompactSpec``, the
attention layer's page format), groups it, allocates its blocks from the shared pool and binds a
view of the KV cache to it (``kv_cache``, logically ``[num_blocks, Hkv, block_size, 2D]``). The
model never calls it; the attention impl reads and writes its blocks through the compact group's
block table (the runner hooks hand that table to the request table every step). Its backend's
metadata builder has nothing to build.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                       MultipleOf)

from vllm_ext.backend.method_cache_layer import MethodCacheLayer, register_cache_layer
from vllm_ext.sfi.slot_tables import COMPACT_SUFFIX as SUFFIX  # noqa: E402


def compact_layer_name(attn_layer_name: str) -> str:
    return attn_layer_name + SUFFIX


class SfiCompactMetadataBuilder(AttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        return None

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return None


class SfiCompactBackend(AttentionBackend):
    """The compact caches' backend: SPEEDSFI's page constraints (``backend.SpeedSfiBackend``: kernel
    block sizes, layouts; the compact pages share the attention layer's format), a builder that
    builds nothing, no impl (the model never calls the layer)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "SPEEDSFI_COMPACT"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("SPEEDSFI's compact caches are read by the attention impl")

    @staticmethod
    def get_builder_cls():
        return SfiCompactMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.platforms import current_platform
        from vllm.v1.kv_cache_layout import KVCacheLayout

        if current_platform.is_cpu():
            return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
        return (KVCacheLayout.LBNHC,)


class SfiCompactCache(MethodCacheLayer):
    """The compact segments of one SPEEDSFI attention layer (``attn``), paged by vLLM."""

    backend = SfiCompactBackend

    def __init__(self, attn, prefix: str, sfi_config):
        super().__init__(attn, prefix)
        self.sfi_config = sfi_config

    def spec_for(self, attn_spec, attn, vllm_config):
        from vllm_ext.sfi.kv_spec import compact_spec_for

        return compact_spec_for(attn_spec, self.sfi_config, num_heads=attn.num_heads,
                                act_dtype=vllm_config.model_config.dtype)


def register_compact_layer(forward_context: dict, attn_layer_name: str, sfi_config) -> SfiCompactCache:
    """The compact cache of ``attn_layer_name`` in the forward context, registered on first call."""
    return register_cache_layer(forward_context, attn_layer_name, SUFFIX,
                                lambda attn, name: SfiCompactCache(attn, name, sfi_config))
