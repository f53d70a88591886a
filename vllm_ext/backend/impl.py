"""The SPEEDSFI attention impl: stateless per layer apart from persistent buffers.

Dense path (every method off, and whatever a method leaves dense):
- CUDA: vLLM's own Triton attention (``TritonAttentionImpl``) for the KV write and the attention, so
  output is identical to ``--attention-backend TRITON_ATTN``;
- CPU build: ``vllm_ext.kernels.paged_reference`` (PyTorch), identical to ``CPU_ATTN`` in fp32.
Both write K/V themselves (``forward_includes_kv_cache_update``) and read the cache through strides.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from vllm_ext import metrics
from vllm_ext.backend.metadata import SpeedSfiMetadata
from vllm_ext.backend.startup import resolve_config
from vllm_ext.config import ConfigError
from vllm_ext.kernels import paged_reference

# Extra Attention(...) kwargs that are harmless at these values; anything else is refused.
_NEUTRAL_EXTRA_ARGS = {"sinks": None, "use_alibi_sqrt": False, "chunk_lookback": -1}


class SpeedSfiImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra_impl_args) -> None:
        _refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, attn_type,
                            kv_sharing_target_layer_name, extra_impl_args)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"SPEEDSFI: {num_heads} query heads are not a multiple of "
                              f"{self.num_kv_heads} KV heads")
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = None
        self.kv_sharing_target_layer_name = None
        self.config = resolve_config(get_current_vllm_config())
        self._dense = None
        if not current_platform.is_cpu():
            from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

            self._dense = TritonAttentionImpl(num_heads, head_size, scale, self.num_kv_heads, None,
                                              None, kv_cache_dtype, None, attn_type, None)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: SpeedSfiMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("SPEEDSFI does not fuse output quantization")
        if attn_metadata is None:                     # profiling run
            return output.fill_(0)
        md = attn_metadata
        if self._dense is not None:
            metrics.bump("forward.dense_triton")
            self._dense.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
            return self._dense.forward(layer, query, key, value, kv_cache, md.delegate, output)
        metrics.bump("forward.dense_torch")
        paged_reference.write_kv(kv_cache, key, value, md.slot_mapping)
        paged_reference.dense_paged_attention(query, kv_cache, md.block_table, md.query_start_loc_host,
                                              md.seq_lens_host, self.scale, output)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # vLLM does not call this (forward_includes_kv_cache_update); kept for test harnesses.
        if self._dense is not None:
            self._dense.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        else:
            paged_reference.write_kv(kv_cache, key, value, slot_mapping)


def _refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, attn_type,
                        kv_sharing_target_layer_name, extra_impl_args) -> None:
    if alibi_slopes is not None:
        raise ConfigError("SPEEDSFI does not support ALiBi attention")
    if sliding_window is not None:
        raise ConfigError(f"SPEEDSFI does not support sliding-window attention (window {sliding_window})")
    if logits_soft_cap:
        raise ConfigError("SPEEDSFI does not support attention logit soft-capping")
    if attn_type != AttentionType.DECODER:
        raise ConfigError(f"SPEEDSFI supports decoder self-attention only, not {attn_type}")
    if kv_sharing_target_layer_name is not None:
        raise ConfigError("SPEEDSFI does not support cross-layer KV sharing")
    for name, value in extra_impl_args.items():
        neutral = _NEUTRAL_EXTRA_ARGS.get(name, object())
        if not (value is neutral or (not isinstance(value, torch.Tensor) and value == neutral)):
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise ConfigError(f"SPEEDSFI does not support the attention option {name}={shown}")
