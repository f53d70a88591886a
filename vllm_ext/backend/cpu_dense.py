"""The CPU build's impl: vLLM's own ``CPU_ATTN`` kernels for every dense row, on ``CPU_ATTN``'s cache
format; our PyTorch twins for what only SPEEDSFI computes (SFI's sparse and slow rows,
CritiPrefill's block-sparse prefill, SPEED's upper layers), reading the same pages.

Why ``CPU_ATTN``'s format. Its C++ ops (``cpu_attn_reshape_and_cache``,
``cpu_attention_with_kv_cache``) keep each (block, KV head) page in an ISA-specific packing inside the
``[num_blocks, Hkv, block_size, 2 * D]`` cache. Its kernel reads a 2K context in about a third of the
time of PyTorch's fused attention on the same CPU (0.10 vs 0.28 ms per layer for one decode query
of the real model's shape in bf16, one thread of the 2-core AMD EPYC VM; kernel-only, by a script
not committed), and its write of one token per layer is one call instead of a dozen ops. So:

- every method off: the whole layer is ``CPU_ATTN``'s (same kernel, inputs and scheduler metadata):
  SPEEDSFI all off gives ``CPU_ATTN``'s output bit for bit, in every dtype;
- a method on: K/V are written by ``CPU_ATTN``'s op, and the rows attended densely (prefill chunks,
  CritiPrefill's decode rows, SFI's dense rows, requests with SFI off) go to ``CPU_ATTN``'s kernel,
  as a sub-batch of the step's rows; everything else reads the pages through
  :class:`~vllm_ext.kernels.packed_pages.PackedPages` (K and V views with their own strides: K
  transposed per page with the ``vec``/``vec16`` ISAs, both in VNNI pairs with ``amx``). Where that
  packing cannot be read (Arm, a vLLM whose packing differs: checked at the first forward by writing
  a page through vLLM's op and reading it back), the cache keeps our format and every row runs the
  PyTorch path (:mod:`vllm_ext.kernels.paged_reference`), logged once and counted as
  ``fallback.cpu_attn_packed_pages``.

The packed format needs head-major contiguous pages: ``SpeedSfiBackend`` prefers the ``LBHNC``
layout on the CPU; under any other layout (an explicit ``VLLM_KV_CACHE_LAYOUT``) the PyTorch path
runs on our format. So does a run with Triton's interpreter on (the tests' Triton kernels read our
format).
"""

from __future__ import annotations

import torch

from vllm_ext import metrics
from vllm_ext.backend.impl import SpeedSfiImpl
from vllm_ext.kernels.packed_pages import PACKED_ISAS, PackedPages, layout_matches

_layout_checked: dict[tuple, bool] = {}


class _StepSchedule:
    """``CPU_ATTN``'s scheduler metadata of the step's dense sub-batch, made by the first layer of a
    step that needs it and shared by the others (the metadata object is one per step and KV-cache
    group; the sub-batch is the same in every layer)."""

    md = None
    rows = None
    sched = None
    sub_md = None
    sub_rows = None
    sub = None


def _isa_of(dtype, block_size, head_size, kv_cache_dtype) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def packed_pages_readable(isa: str, block_size: int, head_size: int, dtype: torch.dtype,
                          kv_cache_dtype: str) -> bool:
    """Whether our twins can read ``CPU_ATTN``'s pages for this ISA and shape (checked once per
    process and shape against vLLM's own write)."""
    key = (isa, block_size, head_size, dtype, kv_cache_dtype)
    if key not in _layout_checked:
        ok = False
        if isa in PACKED_ISAS:
            from vllm import _custom_ops as ops

            def write(k, v, kc, vc, slots):
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                               kv_cache_dtype=kv_cache_dtype)

            try:
                ok = layout_matches(write, block_size, head_size, dtype, isa)
            except (ValueError, RuntimeError):          # a shape this packing (or vLLM's op) refuses
                ok = False
        _layout_checked[key] = ok
        if not ok:
            metrics.fallback("cpu_attn_packed_pages",
                             "CPU_ATTN's KV pages (ISA %s, block %d, head %d, %s) are not readable by "
                             "SPEEDSFI's kernels: with a method on, every row runs the PyTorch path on "
                             "SPEEDSFI's own cache format (slower dense rows, same results)",
                             isa, block_size, head_size, dtype)
    return _layout_checked[key]


class SpeedSfiCpuImpl(SpeedSfiImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # every method off: nothing of ours reads the cache, the whole layer is CPU_ATTN's
        self._all_off = not self.config.any_enabled
        self._isa = None
        self._packed = None                 # decided at the first forward with a cache
        self._pages = None                  # (the cache tensor, its PackedPages)
        if self.config.sfi.enabled:
            # SFI's compiled slow-step kernels: built (about 2 s, once per machine) or loaded now,
            # at engine start, not at the first request's first slow step
            from vllm_ext.kernels import cpu_native

            cpu_native.library()

    def _cache_format(self, query, kv_cache) -> str:
        """"cpu_attn" (every method off), "packed" (a method on, CPU_ATTN's pages) or "ours"."""
        if self._packed is None:
            from vllm_ext.kernels.triton_utils import use_triton

            num_blocks, hkv, block_size, _ = kv_cache.shape
            self._isa = _isa_of(query.dtype, block_size, self.head_size, self.kv_cache_dtype)
            if self._all_off:
                self._packed = True
            else:
                self._packed = (not use_triton(query) and packed_pages_readable(
                    self._isa, block_size, self.head_size, kv_cache.dtype, self.kv_cache_dtype))
                if self._packed:
                    metrics.log_once("cpu_attn_packed_pages",
                                     "SPEEDSFI (CPU build): K/V writes and dense rows through CPU_ATTN's "
                                     "kernels (ISA %s); SPEEDSFI's kernels read its pages", self._isa)
        if not self._packed or not kv_cache.is_contiguous():
            return "ours"
        return "cpu_attn" if self._all_off else "packed"

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None or output_scale is not None or output_block_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        fmt = self._cache_format(query, kv_cache)
        if layer.layer_name == attn_metadata.last_layer_name and attn_metadata.step.is_real:
            # once per step: which kernels attended the dense rows (the name says what ran)
            metrics.bump("steps.dense_torch" if fmt == "ours" else "steps.dense_cpu_attn")
        if fmt == "ours":
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        if fmt == "packed":
            if self._pages is None or self._pages[0] is not kv_cache:
                self._pages = (kv_cache, PackedPages(kv_cache, self._isa))
            return super().forward(layer, query, key, value, self._pages[1], attn_metadata, output)
        return self._forward_all_off(layer, query, key, value, kv_cache, attn_metadata, output)

    def _forward_all_off(self, layer, query, key, value, kv_cache, md, output):
        """Every method off: exactly what ``CPU_ATTN``'s impl runs."""
        from vllm import _custom_ops as ops

        num_blocks, hkv, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, hkv, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, self._isa,
                                       k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)
        n_tok = md.query_start_loc_host[md.num_reqs] if md.query_start_loc_host else md.num_actual_tokens
        sched = self._schedule(md, None, md.num_reqs, md.seq_lens, md.query_start_loc, query.dtype)
        self._attend(layer, query[:n_tok], key_cache, value_cache, output[:n_tok], md.query_start_loc,
                     md.seq_lens, md.block_table, sched)
        return output

    def _attend(self, layer, query, key_cache, value_cache, out, query_start_loc, seq_lens,
                block_table, sched) -> None:
        from vllm import _custom_ops as ops

        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0,
            scheduler_metadata=sched, s_aux=None, dynamic_causal=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)

    def _schedule(self, md, rows: tuple | None, num_reqs: int, seq_lens, query_start_loc, dtype):
        """``CPU_ATTN``'s scheduler metadata for ``rows`` of the step (None: all), once per step."""
        step = _StepSchedule
        if step.md is not md or step.rows != rows:
            from vllm import _custom_ops as ops
            from vllm import envs

            step.sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=num_reqs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_lens, dtype=dtype,
                query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=self._isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
                kv_cache_dtype=self.kv_cache_dtype)
            step.md, step.rows = md, rows
        return step.sched

    @staticmethod
    def _sub_batch(md, picked: tuple):
        """The rows ``picked`` of the step as ``CPU_ATTN``'s arguments (their tokens' indices,
        query start locations, lengths, block-table rows), once per step."""
        step = _StepSchedule
        if step.sub_md is not md or step.sub_rows != picked:
            qsl = md.query_start_loc_host
            tok = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in picked])
            lens = torch.tensor([qsl[i + 1] - qsl[i] for i in picked], dtype=torch.int32)
            q_start = torch.zeros(len(picked) + 1, dtype=torch.int32)
            torch.cumsum(lens, 0, out=q_start[1:])
            idx = torch.tensor(picked, dtype=torch.long)
            step.sub = (tok, q_start, md.seq_lens.index_select(0, idx),
                        md.block_table.index_select(0, idx))
            step.sub_md, step.sub_rows = md, picked
        return step.sub

    def _write_kv(self, layer, kv_cache, key, value, slot_mapping) -> None:
        if not isinstance(kv_cache, PackedPages):
            return super()._write_kv(layer, kv_cache, key, value, slot_mapping)
        from vllm import _custom_ops as ops

        n = slot_mapping.shape[0]
        ops.cpu_attn_reshape_and_cache(key[:n], value[:n], kv_cache.key_cache, kv_cache.value_cache,
                                       slot_mapping, self._isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)

    def _dense_rows(self, layer, query, kv_cache, md, rows, seq_lens, output) -> None:
        if not isinstance(kv_cache, PackedPages):
            return super()._dense_rows(layer, query, kv_cache, md, rows, seq_lens, output)
        qsl = md.query_start_loc_host
        picked = [i for i in range(rows) if seq_lens[i] > 0 and qsl[i + 1] > qsl[i]]
        if picked:
            self._cpu_attention(layer, query, kv_cache, md, picked, output)

    def _cpu_attention(self, layer, query, pages: PackedPages, md, picked: list[int],
                       output) -> None:
        """``CPU_ATTN``'s kernel over the rows ``picked`` (host list, ascending) of the step: the
        step's own arguments when they are its first rows, else a gathered sub-batch whose
        output is scattered back."""
        qsl = md.query_start_loc_host
        n = len(picked)
        prefix = picked[-1] == n - 1
        if prefix:
            q, out = query[:qsl[n]], output[:qsl[n]]
            q_start, seq, table = md.query_start_loc[:n + 1], md.seq_lens[:n], md.block_table[:n]
        else:
            tok, q_start, seq, table = self._sub_batch(md, tuple(picked))
            q, out = query.index_select(0, tok), torch.empty_like(query[:tok.shape[0]])
        sched = self._schedule(md, tuple(picked), n, seq, q_start, query.dtype)
        self._attend(layer, q, pages.key_cache, pages.value_cache, out, q_start, seq, table, sched)
        if not prefix:
            output.index_copy_(0, tok, out)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self._all_off and kv_cache.is_contiguous():
            raise NotImplementedError("SPEEDSFI (CPU, every method off) writes K/V in forward")
        return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
