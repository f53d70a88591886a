"""The CPU build's impl: with every method off, vLLM's own ``CPU_ATTN`` kernels on ``CPU_ATTN``'s cache
format; otherwise exactly :class:`~vllm_ext.backend.impl.SpeedSfiImpl`.

Why a second format. ``CPU_ATTN``'s C++ ops (``cpu_attn_reshape_and_cache``,
``cpu_attention_with_kv_cache``) keep each (block, KV head) page in an ISA-specific packing inside the
``[num_blocks, Hkv, block_size, 2 * D]`` cache: on AVX-512 (ISA ``vec``) K is stored transposed
(``[D, block_size]``) followed by V (``[block_size, D]``); AMX and NEON pack differently again. No
strided ``[blocks, Hkv, tokens, 2D]`` view (K in ``[..., :D]``, V in ``[..., D:]``, the view every
twin of ours reads) can express a transposed K, so the twins cannot read that format. But with every
method off nothing of ours reads the cache: the dense path alone does, so it can be vLLM's. Then:

- the dense path costs what ``CPU_ATTN`` costs (the PyTorch path gathers and converts each row's
  prefix to fp32 every layer and step: 1.5-3x ``CPU_ATTN``'s decode step on the real model);
- SPEEDSFI all off gives ``CPU_ATTN``'s output bit for bit (same kernel, same inputs, same
  scheduler metadata), in every dtype.

With a method on (SFI, CritiPrefill, SPEED) the cache holds our format and every row goes through
:class:`SpeedSfiImpl` (the PyTorch dense path, :mod:`vllm_ext.kernels.paged_reference`).

The packed format needs head-major contiguous pages: ``SpeedSfiBackend`` prefers the ``LBHNC``
layout on the CPU; under any other layout (an explicit ``VLLM_KV_CACHE_LAYOUT``) the PyTorch path runs.
"""

from __future__ import annotations

import torch

from vllm_ext.backend.impl import SpeedSfiImpl


class _StepSchedule:
    """``CPU_ATTN``'s per-step scheduler metadata, made by the first layer of a step and shared by the
    others (the metadata object is one per step and KV-cache group)."""

    md = None
    sched = None


class SpeedSfiCpuImpl(SpeedSfiImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # every method off: nothing of ours reads the cache, so it can be CPU_ATTN's
        self._cpu_attn = not self.config.any_enabled
        self._isa = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if (not self._cpu_attn or attn_metadata is None or output_scale is not None
                or output_block_scale is not None or not kv_cache.is_contiguous()):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        from vllm import _custom_ops as ops

        md = attn_metadata
        num_blocks, hkv, block_size, _ = kv_cache.shape
        if self._isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            self._isa = _get_attn_isa(query.dtype, block_size, self.head_size, self.kv_cache_dtype)
        # CPU_ATTN's view: [blocks, Hkv, 2 * block_size, D], K pages then V pages
        packed = kv_cache.view(num_blocks, hkv, 2 * block_size, -1)
        key_cache, value_cache = packed.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, self._isa,
                                       k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)
        n_tok = md.query_start_loc_host[md.num_reqs] if md.query_start_loc_host else md.num_actual_tokens
        step = _StepSchedule
        if step.md is not md:
            from vllm import envs

            step.sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=md.num_reqs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=md.seq_lens, dtype=query.dtype,
                query_start_loc=md.query_start_loc, causal=True, sliding_window_size=-1, isa=self._isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
                kv_cache_dtype=self.kv_cache_dtype)
            step.md = md
        ops.cpu_attention_with_kv_cache(
            query=query[:n_tok], key_cache=key_cache, value_cache=value_cache, output=output[:n_tok],
            query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=md.block_table, softcap=0,
            scheduler_metadata=step.sched, s_aux=None, dynamic_causal=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self._cpu_attn or not kv_cache.is_contiguous():
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        raise NotImplementedError("SPEEDSFI (CPU, every method off) writes K/V in forward")
