"""``SPEEDSFI``: the attention backend class vLLM selects (capabilities only; the work is in the
builder and the impl).

Everything SPEEDSFI cannot do exactly is declared here, so vLLM's ``validate_configuration`` refuses
it at start-up with a reason (the CUDA platform runs that check for a selected backend; on the CPU
build ``vllm_patches`` runs it too): MLA, sliding windows, attention sinks, ALiBi square-root
variants, encoder and encoder-decoder attention, non-causal attention, quantised KV caches,
batch-invariant mode, KV connectors, context parallelism.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_ext.config import BACKEND_NAME


class SpeedSfiBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # "auto" = the model dtype. Quantised (fp8/int8) caches are refused until the kernels read them.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]
    # The impl writes K/V itself: SPEED's upper layers store a subset of the step's tokens.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME                  # must equal the registered enum member's name

    @staticmethod
    def get_impl_cls():
        from vllm_ext.backend.impl import SpeedSfiImpl

        return SpeedSfiImpl

    @staticmethod
    def get_builder_cls():
        from vllm_ext.backend.metadata import SpeedSfiMetadataBuilder

        return SpeedSfiMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # CUDA: physical [blocks, tokens, heads, K|V], the layout vLLM's Triton kernels (our dense
        # delegate) assume. CPU build: head-major pages [blocks, heads, tokens, C] first, the pages
        # vLLM's CPU_ATTN kernels pack (our dense rows and K/V writes, backend.dense_path; our twins
        # read them through kernels.packed_pages). Our own kernels read any layout through strides.
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is None or capability.major >= 8      # None: the CPU build

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability) -> str | None:
        if kv_cache_dtype not in (None, "auto") and dtype == torch.float32:
            return "an explicit fp16/bf16 KV cache with an fp32 model is not supported"
        return None
