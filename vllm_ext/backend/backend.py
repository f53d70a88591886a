"""``SPEEDSFI``: the attention backend class vLLM selects (capabilities only; the work is in the
builder and the impl).

Everything SPEEDSFI cannot do exactly is declared here, so vLLM's ``validate_configuration`` refuses
it at start-up with a reason (the CUDA platform runs that check for a selected backend; on the CPU
build ``vllm_patches`` runs it too): MLA, sliding windows, attention sinks, ALiBi square-root
variants, encoder and encoder-decoder attention, non-causal attention, quantised KV caches other
than per-tensor fp8, batch-invariant mode, KV connectors, context parallelism.

A per-tensor fp8 KV cache (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) is taken where the platform's dense
backend takes it, and refused with that backend's own reason where it does not: on the CPU build
``CPU_ATTN``'s (x86 with AVX-512 or AMX, head sizes divisible by 32; its kernel block sizes are
multiples of 32), on CUDA vLLM's Triton attention's (native fp8, compute capability 8.9 or newer).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_ext.config import BACKEND_NAME
from vllm_ext.kernels.kv_quant import FP8_KV_CACHE_DTYPES, is_fp8_kv_cache_dtype


class SpeedSfiBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # "auto" = the model dtype; per-tensor fp8 where the platform's dense backend takes it
    # (supports_combination). Per-token-head, int8/int4 and fp4 caches are refused.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]
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
        if is_fp8_kv_cache_dtype(kv_cache_dtype or "auto"):
            return fp8_kv_cache_refusal(head_size, dtype, kv_cache_dtype, block_size, device_capability)
        # a 16-bit cache under an fp32 model: our kernels read pages in the model's dtype (an fp8
        # cache is widened exactly, so it is taken with any model dtype)
        if kv_cache_dtype not in (None, "auto") and dtype == torch.float32:
            return "an explicit fp16/bf16 KV cache with an fp32 model is not supported"
        return None


def fp8_kv_cache_refusal(head_size: int, dtype: torch.dtype, kv_cache_dtype: str, block_size: int | None,
                         device_capability) -> str | None:
    """Why the platform's dense backend refuses this fp8 KV cache (its own words), or None."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        # CPU_ATTN's check (ISA and head size); its kernel block sizes are multiples of 32
        try:
            _get_attn_isa(dtype, 32, head_size, kv_cache_dtype)
        except NotImplementedError as exc:
            return str(exc)
        if block_size is not None and block_size % 32:
            return (f"FP8 KV cache on CPU needs a block size that is a multiple of 32 (CPU_ATTN's "
                    f"kernel block sizes), not {block_size}")
        return None
    if device_capability is not None and device_capability.to_int() < 89:
        # vLLM's Triton attention (the dense delegate) and our Triton kernels load fp8 natively
        return ("FP8 KV cache needs native FP8 (fp8e4nv, compute capability 8.9 or newer); "
                f"this GPU is {device_capability.as_version_str()}")
    return None
