"""The dense path: how the rows no method takes are attended, chosen once per engine
(:func:`dense_path_for`). Every method off, SPEEDSFI's output is the dense path's alone.

- :class:`DelegateDense` (CUDA): vLLM's own attention impl (``TritonAttentionImpl`` or
  ``FlashAttentionImpl``, ``speedsfi.dense_delegate``) writes K/V and attends its rows, from metadata
  the builder cut to them (:mod:`vllm_ext.backend.dense_delegate`); with ``dense_decode =
  "paged_decode"`` and no method owning the decode rows, our ``paged_decode`` attends them.
  Nothing here reads the device plan on the host.
- :class:`CpuAttnDense` (the CPU build): ``CPU_ATTN``'s C++ ops on their own packed page format for
  the K/V write and every dense row (as a sub-batch of the step's rows); our kernels read the same
  pages through :class:`~vllm_ext.kernels.packed_pages.PackedPages` (``vec``/``vec16``: K transposed
  per page; ``amx``: K and V in VNNI pairs). Every method off, the whole layer is ``CPU_ATTN``'s
  (same kernel, inputs and scheduler metadata: bit for bit). Where the packing cannot be read (Arm,
  a vLLM that packs otherwise: checked once per shape against vLLM's own write), under another KV
  layout, or with Triton's interpreter on, the cache keeps SPEEDSFI's format and
  :class:`ReferenceDense` runs every row, logged once and counted
  (``fallback.cpu_attn_packed_pages``).
- :class:`ReferenceDense`: the PyTorch reference over SPEEDSFI's layout
  (:mod:`vllm_ext.kernels.paged_reference`).

The CPU build's dense paths read the step's host facts for free (``host_plan``): their pass skips
single rows a method computes. The delegate cuts rows by range only.

An fp8 cache (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``): vLLM allocates it as ``uint8``;
:meth:`DensePath.pages` hands the methods its fp8 view, of the dtype the writer stores
(:func:`vllm_ext.kernels.kv_quant.stored_dtype`), and every read of K or V takes the layer's
per-tensor ``k_scale`` / ``v_scale``. vLLM's own ops (the delegate, ``CPU_ATTN``'s C++ ops) get the
``uint8`` allocation and the scales exactly as vLLM's backends pass them.
"""

from __future__ import annotations

import torch

from vllm_ext import metrics
from vllm_ext import row_counters
from vllm_ext.kernels import cpu_attn_ops, kv_quant, paged_reference
from vllm_ext.kernels.packed_pages import PACKED_ISAS, PackedPages, layout_matches
from vllm_ext.methods.protocol import DenseRows


class DensePath:
    host_plan = False
    # whose write the pages hold: the CPU build's (CPU_ATTN, the reference) or vLLM's CUDA impls
    # (kv_quant.stored_dtype; None: the platform's)
    writes_on_cpu: bool | None = None

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 kv_cache_dtype: str, rows: row_counters.RowCounters | None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype
        self.page_dtype = kv_quant.stored_dtype(kv_cache_dtype, on_cpu=self.writes_on_cpu)  # None: not fp8
        self.rows = rows

    def forward_all(self, layer, query, key, value, kv_cache, md, output, *,
                    methods_idle: bool = False) -> torch.Tensor | None:
        """The whole layer when the engine runs no method, or (``methods_idle``, host plans only) none
        acts in this layer this step (``None``: not this path's to do)."""
        return None

    def pages(self, layer, query, kv_cache, md):
        """The cache as this step's kernels read it (an fp8 cache: its fp8 view)."""
        return self.page_view(kv_cache)

    def page_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_quant.page_view(kv_cache, self.page_dtype)

    def row_plan(self, md) -> DenseRows:
        return DenseRows(start=0, end=md.num_reqs, host_plan=self.host_plan)

    def write_kv(self, layer, key, value, pages, slot_mapping) -> None:
        raise NotImplementedError

    def write_kv_outside_forward(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """K/V into ``kv_cache`` for a caller outside the forward (test harnesses: vLLM does not
        call it, the forward writes K/V itself)."""
        self.write_kv(layer, key, value, kv_cache, slot_mapping)

    def attend(self, layer, query, key, value, pages, md, output, rows: DenseRows) -> None:
        raise NotImplementedError

    def attend_decode_rows(self, layer, query, pages, md, output, rows: DenseRows) -> None:
        """The decode rows when no method owns them and this path computes them apart (CUDA with
        ``dense_decode = "paged_decode"``)."""

    def owns_decode_kernel(self) -> bool:
        """Whether this path attends decode rows with our own kernel (apart from prefill rows)."""
        return False

    def warm_up(self, layer, pages, shape, dtype) -> bool:
        """Compile this path's own kernels over the layer's ``pages`` (its page view) at start-up."""
        return False

    def _count(self, n) -> None:
        if self.rows is not None:
            self.rows.add(row_counters.DELEGATE, n)


class ReferenceDense(DensePath):
    """The PyTorch reference over SPEEDSFI's own cache layout (the CPU build where ``CPU_ATTN``'s pages
    cannot be read; tests)."""

    host_plan = True
    writes_on_cpu = True

    def write_kv(self, layer, key, value, pages, slot_mapping) -> None:
        k_scale, v_scale = kv_quant.layer_scales(layer)
        paged_reference.write_kv(pages, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def attend(self, layer, query, key, value, pages, md, output, rows: DenseRows) -> None:
        seq_lens = _skipped(md.seq_lens_host[:rows.end], rows.host_skip)
        self._attend_rows(layer, query, pages, md, rows.end, seq_lens, output)
        self._count(rows.end - sum(bool(x) for x in (rows.host_skip or [])[:rows.end]))

    def _attend_rows(self, layer, query, pages, md, n: int, seq_lens: list[int], output) -> None:
        k_scale, v_scale = kv_quant.layer_scales(layer)
        paged_reference.dense_paged_attention(query, pages, md.block_table,
                                              md.query_start_loc_host[:n + 1], seq_lens, self.scale,
                                              output, k_scale=k_scale, v_scale=v_scale)


def _skipped(seq_lens: list[int], skip: list[bool] | None) -> list[int]:
    if not skip:
        return list(seq_lens)
    return [0 if i < len(skip) and skip[i] else n for i, n in enumerate(seq_lens)]


_layout_checked: dict[tuple, bool] = {}


def packed_pages_readable(isa: str, block_size: int, head_size: int, dtype: torch.dtype,
                          kv_cache_dtype: str) -> bool:
    """Whether our kernels can read ``CPU_ATTN``'s pages for this ISA and shape (a fact of the vLLM
    build, checked once per process and shape against vLLM's own write). ``dtype``: the model's (of
    the keys and values written); an fp8 ``kv_cache_dtype`` is read as its stored dtype."""
    key = (isa, block_size, head_size, dtype, kv_cache_dtype)
    if key not in _layout_checked:
        ok = False
        if isa in PACKED_ISAS:
            from vllm import _custom_ops as ops

            def write(k, v, kc, vc, slots):
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                               kv_cache_dtype=kv_cache_dtype)

            try:
                ok = layout_matches(write, block_size, head_size, dtype, isa,
                                    cache_dtype=kv_quant.stored_dtype(kv_cache_dtype, on_cpu=True))
            except (ValueError, RuntimeError):          # a shape this packing (or vLLM's op) refuses
                ok = False
        _layout_checked[key] = ok
        if not ok:
            metrics.fallback("cpu_attn_packed_pages",
                             "CPU_ATTN's KV pages (ISA %s, block %d, head %d, %s) are not readable by "
                             "SPEEDSFI's kernels: with a method on, every row runs the PyTorch path on "
                             "SPEEDSFI's own cache format (slower dense rows, same results)",
                             isa, block_size, head_size, f"{dtype}, KV cache {kv_cache_dtype}")
    return _layout_checked[key]


class _CpuAttnStep:
    """``CPU_ATTN``'s per-step arguments, made by the first layer that needs them and kept on the
    step's metadata object (one per step and KV-cache group; the sub-batch is the same in every
    layer)."""

    def __init__(self, md):
        self.md = md
        self.schedules: dict[tuple | None, object] = {}
        self.sub_batches: dict[tuple, tuple] = {}


class CpuAttnDense(DensePath):
    host_plan = True
    writes_on_cpu = True

    def __init__(self, *, all_off: bool, **kw):
        super().__init__(**kw)
        self.all_off = all_off
        self.reference = ReferenceDense(**kw)
        self._isa = None
        self._packed = None                 # decided at the first forward with a cache
        self._pages = None                  # (the cache tensor, its PackedPages)

    def _format(self, query, kv_cache) -> str:
        """"cpu_attn" (every method off), "packed" (a method on, CPU_ATTN's pages) or "ours"."""
        if self._packed is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            from vllm_ext.kernels.triton_utils import use_triton

            _, _, block_size, _ = kv_cache.shape
            self._isa = _get_attn_isa(query.dtype, block_size, self.head_size, self.kv_cache_dtype)
            if self.all_off:
                self._packed = True
            else:
                model_dtype = query.dtype if self.page_dtype is not None else kv_cache.dtype
                self._packed = (not use_triton(query) and packed_pages_readable(
                    self._isa, block_size, self.head_size, model_dtype, self.kv_cache_dtype))
                if self._packed:
                    metrics.log_once("cpu_attn_packed_pages",
                                     "SPEEDSFI (CPU build): K/V writes and dense rows through CPU_ATTN's "
                                     "kernels (ISA %s); SPEEDSFI's kernels read its pages", self._isa)
        if not self._packed or not kv_cache.is_contiguous():
            return "ours"
        return "cpu_attn" if self.all_off else "packed"

    def _count_step(self, layer, md, fmt: str) -> None:
        if layer.layer_name == md.last_layer_name and md.step.is_real:
            # once per step: which kernels attended the dense rows (the name says what ran)
            metrics.bump("steps.dense_torch" if fmt == "ours" else "steps.dense_cpu_attn")

    def forward_all(self, layer, query, key, value, kv_cache, md, output, *, methods_idle: bool = False):
        """The layer through ``CPU_ATTN``'s kernels alone (its write, then every row): every method
        off, or (``methods_idle``) none acting in this layer this step; None where the cache is not
        ``CPU_ATTN``'s pages."""
        if not (self.all_off or methods_idle):
            return None
        fmt = self._format(query, kv_cache)
        self._count_step(layer, md, fmt)
        if fmt == "ours":
            return None
        from vllm import _custom_ops as ops

        num_blocks, hkv, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, hkv, 2 * block_size, -1).chunk(2, dim=2)
        ks, vs = _scale_floats(layer)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping, self._isa,
                                       k_scale=ks, v_scale=vs, kv_cache_dtype=self.kv_cache_dtype)
        n_tok = md.query_start_loc_host[md.num_reqs] if md.query_start_loc_host else md.num_actual_tokens
        sched = self._schedule(md, None, md.num_reqs, md.seq_lens, md.query_start_loc, query.dtype)
        self._attend(layer, query[:n_tok], key_cache, value_cache, output[:n_tok], md.query_start_loc,
                     md.seq_lens, md.block_table, sched)
        return output

    def pages(self, layer, query, kv_cache, md):
        fmt = self._format(query, kv_cache)
        if not self.all_off:
            self._count_step(layer, md, fmt)
        if fmt != "packed":
            return self.page_view(kv_cache)
        if self._pages is None or self._pages[0] is not kv_cache:
            self._pages = (kv_cache, PackedPages(self.page_view(kv_cache), self._isa))
        return self._pages[1]

    def write_kv(self, layer, key, value, pages, slot_mapping) -> None:
        if not isinstance(pages, PackedPages):
            return self.reference.write_kv(layer, key, value, pages, slot_mapping)
        from vllm import _custom_ops as ops

        n = slot_mapping.shape[0]
        ks, vs = _scale_floats(layer)
        key_cache, value_cache = cpu_attn_ops.vllm_caches(pages)
        ops.cpu_attn_reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, self._isa,
                                       k_scale=ks, v_scale=vs, kv_cache_dtype=self.kv_cache_dtype)

    def write_kv_outside_forward(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.all_off and kv_cache.is_contiguous():
            raise NotImplementedError("SPEEDSFI (CPU, every method off) writes K/V in forward")
        self.reference.write_kv(layer, key, value, self.page_view(kv_cache), slot_mapping)

    def attend(self, layer, query, key, value, pages, md, output, rows: DenseRows) -> None:
        if not isinstance(pages, PackedPages):
            return self.reference.attend(layer, query, key, value, pages, md, output, rows)
        seq_lens = _skipped(md.seq_lens_host[:rows.end], rows.host_skip)
        qsl = md.query_start_loc_host
        picked = [i for i in range(rows.end) if seq_lens[i] > 0 and qsl[i + 1] > qsl[i]]
        if picked:
            self._cpu_attention(layer, query, pages, md, picked, output)
        self._count(rows.end - sum(bool(x) for x in (rows.host_skip or [])[:rows.end]))

    def _attend(self, layer, query, key_cache, value_cache, out, query_start_loc, seq_lens,
                block_table, sched) -> None:
        ks, vs = _scale_floats(layer)
        cpu_attn_ops.attend(query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
                            self.scale, scheduler=sched, kv_cache_dtype=self.kv_cache_dtype, k_scale=ks,
                            v_scale=vs)

    @staticmethod
    def _step(md) -> _CpuAttnStep:
        step = getattr(md, "cpu_attn_step", None)
        if step is None or step.md is not md:
            step = _CpuAttnStep(md)
            md.cpu_attn_step = step
        return step

    def _schedule(self, md, rows: tuple | None, num_reqs: int, seq_lens, query_start_loc, dtype):
        """``CPU_ATTN``'s scheduler metadata for ``rows`` of the step (None: all), once per step."""
        cache = self._step(md).schedules
        if rows not in cache:
            cache[rows] = cpu_attn_ops.scheduler_metadata(
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                seq_lens=seq_lens, query_start_loc=query_start_loc, dtype=dtype, isa=self._isa,
                kv_cache_dtype=self.kv_cache_dtype, num_reqs=num_reqs)
        return cache[rows]

    def _sub_batch(self, md, picked: tuple):
        """The rows ``picked`` of the step as ``CPU_ATTN``'s arguments (their tokens' indices, query
        start locations, lengths, block-table rows), once per step."""
        cache = self._step(md).sub_batches
        if picked not in cache:
            qsl = md.query_start_loc_host
            tok = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in picked])
            lens = torch.tensor([qsl[i + 1] - qsl[i] for i in picked], dtype=torch.int32)
            q_start = torch.zeros(len(picked) + 1, dtype=torch.int32)
            torch.cumsum(lens, 0, out=q_start[1:])
            idx = torch.tensor(picked, dtype=torch.long)
            cache[picked] = (tok, q_start, md.seq_lens.index_select(0, idx),
                             md.block_table.index_select(0, idx))
        return cache[picked]

    def _cpu_attention(self, layer, query, pages: PackedPages, md, picked: list[int], output) -> None:
        """``CPU_ATTN``'s kernel over the rows ``picked`` (host list, ascending) of the step: the
        step's own arguments when they are its first rows, else a gathered sub-batch whose output is
        scattered back."""
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
        key_cache, value_cache = cpu_attn_ops.vllm_caches(pages)
        self._attend(layer, q, key_cache, value_cache, out, q_start, seq, table, sched)
        if not prefix:
            output.index_copy_(0, tok, out)


def _scale_floats(layer) -> tuple[float, float]:
    """The layer's scales as host floats, as vLLM's ``CPU_ATTN`` passes them to its C++ ops."""
    return float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))


class DelegateDense(DensePath):
    """vLLM's own CUDA attention impl for the K/V write and the rows its (cut) metadata names."""

    writes_on_cpu = False

    def __init__(self, delegate_impl, *, paged_decode: bool, max_rows: int, max_len: int,
                 device: torch.device, shared: dict | None = None, **kw):
        super().__init__(**kw)
        self.impl = delegate_impl
        self.paged_decode = paged_decode
        self._max_rows = max_rows
        self._max_len = max_len
        self._device = device
        self._shared = {} if shared is None else shared
        self.workspace = None

    def allocate(self) -> None:
        """``paged_decode``'s split-K scratch, one for every layer of the same shape (allocated while
        the weights load: out of vLLM's budget)."""
        if self.paged_decode and self.workspace is None:
            key = ("paged_decode", self._max_rows, self.num_heads, self.num_kv_heads, self.head_size,
                   self._max_len, self._device)
            if key not in self._shared:
                self._shared[key] = paged_decode_workspace(
                    max_rows=self._max_rows, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size, max_len=self._max_len, device=self._device)
            self.workspace = self._shared[key]

    def owns_decode_kernel(self) -> bool:
        return self.paged_decode

    def write_kv(self, layer, key, value, pages, slot_mapping) -> None:
        # vLLM's impl gets the cache as vLLM allocates it (uint8 for fp8) and views it itself
        self.impl.do_kv_cache_update(layer, key, value, kv_quant.as_bytes(pages), slot_mapping)

    def attend(self, layer, query, key, value, pages, md, output, rows: DenseRows) -> None:
        ours = rows.decode_owner is not None or self.paged_decode
        if ours and md.num_decodes and not md.num_prefills:
            rows.start = rows.end = 0                    # pure decode: our kernels only
            return
        start = md.delegate_first_row if ours else 0
        if not ours and md.delegate_first_row:
            raise RuntimeError("SPEEDSFI: the metadata cut the delegate's rows, but this layer "
                               "computes no decode rows itself")
        rows.start = start
        cache = kv_quant.as_bytes(pages)
        if rows.end == md.num_reqs and not start:
            self.impl.forward(layer, query, key, value, cache, md.delegate, output)
        else:
            cut = md.delegate_head if rows.end < md.num_reqs else md.delegate_tail
            if cut is not None:
                t0 = md.delegate_first_token
                self.impl.forward(layer, query[t0:], key[t0:], value[t0:], cache, cut, output[t0:])
        self._count(rows.end - start)

    def attend_decode_rows(self, layer, query, pages, md, output, rows: DenseRows) -> None:
        if not self.paged_decode or rows.decode_owner is not None or not md.num_decodes:
            return
        if md.num_prefills:
            if rows.start == 0:
                return                                   # the delegate attended them
            n = md.num_decodes
        else:
            n = min(md.num_reqs, query.shape[0])
        from vllm_ext.kernels.dense_decode_evidence import paged_decode

        k_scale, v_scale = kv_quant.layer_scales(layer)
        paged_decode(query[:n], pages, md.block_table[:n], md.seq_lens[:n], self.scale, output[:n],
                     workspace=self.workspace, k_scale=k_scale, v_scale=v_scale)
        if self.rows is not None:
            self.rows.add(row_counters.PAGED_DECODE, n)

    def warm_up(self, layer, pages, shape, dtype) -> bool:
        if not self.paged_decode or self.workspace is None:
            return False
        from vllm_ext.methods.warmup import warm_up_paged_decode

        k_scale, v_scale = kv_quant.layer_scales(layer)
        warm_up_paged_decode(kv_cache=pages, workspace=self.workspace, num_heads=self.num_heads,
                             head_size=self.head_size, scale=self.scale, dtype=dtype, shape=shape,
                             k_scale=k_scale, v_scale=v_scale)
        return True


def paged_decode_workspace(*, max_rows: int, num_heads: int, num_kv_heads: int, head_size: int,
                           max_len: int, device: torch.device):
    """``paged_decode``'s split-K scratch for any batch up to ``max_rows`` rows of up to ``max_len``
    tokens."""
    from vllm_ext.kernels.dense_decode_evidence import dense_decode_workspace
    from vllm_ext.kernels.two_segment_decode import dense_num_splits, max_row_splits

    rs = max_row_splits(max_rows, lambda r: dense_num_splits(r, num_kv_heads, max_len, device))
    return dense_decode_workspace(1, num_heads, head_size,
                                  max(dense_num_splits(1, num_kv_heads, max_len, device), 1), device,
                                  row_splits=rs)


def dense_path_for(config, *, on_cpu: bool, num_heads: int, num_kv_heads: int, head_size: int,
                   scale: float, kv_cache_dtype: str, attn_type, max_rows: int, max_len: int,
                   device: torch.device, rows, owns_decode: bool, shared: dict | None = None) -> DensePath:
    """The engine's dense path (its choice never changes while the engine runs). ``shared``: the
    engine's buffers that layers of one shape share."""
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
              kv_cache_dtype=kv_cache_dtype, rows=rows)
    if on_cpu:
        return CpuAttnDense(all_off=not config.any_enabled, **kw)
    from vllm_ext.backend.dense_delegate import dense_delegate_impl_cls

    impl = dense_delegate_impl_cls(config.dense_delegate)(
        num_heads, head_size, scale, num_kv_heads, None, None, kv_cache_dtype, None, attn_type, None)
    paged = config.resolved_dense_decode == "paged_decode" and not owns_decode
    return DelegateDense(impl, paged_decode=paged, max_rows=max_rows, max_len=max_len, device=device,
                         shared=shared, **kw)
