"""SFI's share of one attention layer (:class:`~vllm_ext.methods.protocol.MethodLayer`): its pages
of vLLM's KV cache (compact segments, kept positions, prompt-tail queries; the copy trigger's
history; Quest's page bounds), and per step the decode rows the step plan makes sparse (slow rows
refresh their compact segment, fast rows read it, dense rows attend densely) and the selections of
the prompts that end (:mod:`vllm_ext.methods.sfi.path`). Every decision is on the device; on the
CPU build the host reads the plan once per step (free there) so the dense pass leaves out the rows
SFI computes.

An fp8 KV cache: SFI's compact and Quest groups are allocated as vLLM allocates the attention pages
(``uint8``, the same page format) and read as their fp8 view, of the dtype the attention pages store
(``kv_quant.stored_dtype``); every kernel gets the attention layer's ``k_scale`` / ``v_scale``. The
token history's group keeps int32 (``vllm_ext.methods.sfi.history_slots``).
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.methods.protocol import DenseRows, LayerGeometry, MethodLayer


class SfiLayer(MethodLayer):
    name = "sfi"

    def __init__(self, method, geometry: LayerGeometry):
        self.method = method
        self.cfg = method.config.sfi
        self.g = geometry
        self.buffers = None                 # SfiLayerBuffers
        self.compact = None                 # the compact cache holder
        self.quest = None                   # the Quest page-bound holder (selector quest)
        self.rows = method.row_counters
        self.attn = None                    # vLLM's attention layer (its KV scales)
        self.page_dtype = None              # fp8 cache: the pages' stored dtype
        self._views: dict[str, tuple] = {}  # holder -> (its kv_cache, the view the kernels read)

    def prepare(self, forward_context: dict, act_dtype: torch.dtype) -> None:
        from vllm_ext.methods.sfi.caches import (register_compact_layer, register_history_layer,
                                                 register_quest_layer)
        from vllm_ext.methods.sfi.runtime import SfiLayerBuffers

        g, cfg = self.g, self.cfg
        self.attn = forward_context.get(g.layer_name)
        self.page_dtype = kv_quant.stored_dtype(getattr(self.attn, "kv_cache_dtype", "auto"))
        self.compact = register_compact_layer(forward_context, g.layer_name, cfg)
        if cfg.resolved_copy_ngram:
            # the copy trigger's token history: one history holder beside each compact one (the
            # same group pattern)
            register_history_layer(forward_context, g.layer_name, max_len=g.max_len)
        if cfg.selector == "quest":
            self.quest = register_quest_layer(forward_context, g.layer_name, cfg)
        kw = dict(num_heads=g.num_heads, max_len=g.max_len, paged=True)
        capacity = self.method.capacity
        self.buffers = SfiLayerBuffers(capacity, g.num_kv_heads, cfg, g.head_size, act_dtype, g.device, **kw)
        self.method.log_buffers(SfiLayerBuffers.nbytes(capacity, g.num_kv_heads, cfg, g.head_size,
                                                       act_dtype, **kw), g)
        self.runtime = self.method.runtime(g)
        if g.device.type == "cpu":
            self.method.load_cpu_kernels()

    def plan(self, md):
        return md.step.plans.get("sfi") if self.buffers is not None else None

    def idle(self, md, sfi) -> bool:
        # no sparse decode row, no prompt ending, no Quest pages: none of SFI's kernels runs in this
        # layer (dense rows attend as with every method off)
        if sfi.prefill_end is not None or sfi.quest_pages is not None or self.cfg.selector == "quest":
            return False
        return not self._any_sparse(md, sfi)

    @staticmethod
    def _any_sparse(md, sfi) -> bool:
        """Whether a decode row of the step is slow or fast (host, read once per step)."""
        if sfi.host_any_sparse is None:
            nd = md.num_decodes
            sfi.host_any_sparse = bool(nd) and not bool(sfi.row_dense[:nd].all())
        return sfi.host_any_sparse

    def bind(self, layer_name: str, md, plan) -> None:
        # the compact segments, kept positions and prompt-tail queries: this layer's pages of SFI's
        # KV-cache group, through the group's per-slot block table (bound by the runner hooks)
        tables = md.step.table.method_tables["sfi"]
        self.buffers.bind_pages(self._pages_of(self.compact), tables.compact_table_of_layer[layer_name])
        if self.quest is not None:
            quest_table = tables.quest.table_of_layer.get(layer_name)
            if quest_table is None:
                raise RuntimeError(f"vllm_ext: no KV-cache group holds {layer_name}'s Quest page "
                                   "bounds (vLLM did not page its bound-page cache layer)")
            self.buffers.bind_quest_pages(self._pages_of(self.quest), quest_table)

    def _pages_of(self, holder) -> torch.Tensor:
        """A cache holder's pages as SFI's kernels read them: in the attention pages' dtype (an fp8
        cache's view; the same tensor object while vLLM's allocation is, so a binding is kept)."""
        raw = holder.kv_cache
        seen = self._views.get(holder.layer_name)
        if seen is None or seen[0] is not raw:
            seen = self._views[holder.layer_name] = (raw, kv_quant.page_view(raw, self.page_dtype))
        return seen[1]

    def _scales(self) -> dict:
        k_scale, v_scale = kv_quant.layer_scales(self.attn)
        return dict(k_scale=k_scale, v_scale=v_scale)

    def claim_rows(self, rows: DenseRows, query, kv_cache, md, sfi) -> None:
        rows.decode_owner = self
        if not rows.host_plan or not md.num_decodes:
            return
        # The decode rows whose output SFI writes this step. SFI's slow pass writes the slow rows'
        # output from the scores it computes for the evidence (Triton kernels; on CPU_ATTN's packed
        # pages the compiled CPU kernels, one read of K and V); only when neither runs (the PyTorch
        # twins, several times slower at it) the dense pass attends the slow rows too and SFI's pass
        # only scores them.
        if sfi.host_sfi_rows is None:
            from vllm_ext.kernels import cpu_native
            from vllm_ext.kernels.packed_pages import PackedPages
            from vllm_ext.kernels.triton_utils import use_triton

            nd = md.num_decodes
            sfi.host_slow_dense = not use_triton(query) and not (
                isinstance(kv_cache, PackedPages) and cpu_native.library() is not None
                and cpu_native.reads_pages(kv_cache.dtype))
            mine = sfi.row_fast[:nd] if sfi.host_slow_dense else ~sfi.row_dense[:nd]
            sfi.host_sfi_rows = mine.tolist()
        rows.host_skip = sfi.host_sfi_rows

    def attend_claimed(self, query, kv_cache, md, sfi, output, rows: DenseRows) -> None:
        nd = md.num_decodes
        if rows.host_plan:
            self._prefill_end(query, kv_cache, md, sfi)
            if nd and (self._any_sparse(md, sfi) or self.rows is not None or self.cfg.selector == "quest"):
                # Rows the dense pass attended have their output from it (bit-identical to all-off);
                # every other decode row is computed once, here. (With every row dense there is
                # nothing to do, except Quest's page bounds, which every decode row keeps current.)
                self._decode(query, kv_cache, md, output, sfi, nd, dense_done=True,
                             slow_done=sfi.host_slow_dense)
            return
        if md.num_prefills or nd == 0:
            # a step with prefills (never a FULL graph): the delegate attended the prefill rows from
            # ``rows.start``; if its metadata could not be cut it attended every row, and SFI leaves
            # the dense rows to it
            self._prefill_end(query, kv_cache, md, sfi)
            if nd:
                self._decode(query, kv_cache, md, output, sfi, nd, dense_done=rows.start == 0)
            return
        # pure decode (padded rows included): our kernels only, decisions on the device; one-token
        # prefill chunks look like decode rows here and their prompt-tail work is host-planned
        # (the runner hooks keep such steps out of FULL CUDA graphs)
        self._decode(query, kv_cache, md, output, sfi, min(md.num_reqs, query.shape[0]), dense_done=False)
        self._prefill_end(query, kv_cache, md, sfi)

    def end_layer(self, layer_name: str, md, plan) -> None:
        if plan is not None and layer_name == md.last_layer_name:
            self.runtime.ring.join()              # the step's one join of side-stream work

    def _decode(self, query, kv_cache, md, output, sfi, n: int, *, dense_done: bool,
                slow_done: bool = False) -> None:
        from vllm_ext.methods.sfi.path import sfi_decode

        sfi_decode(query[:n], kv_cache, md.block_table[:n], md.seq_lens[:n], sfi, self.cfg, self.buffers,
                   self.runtime, self.g.layer_index, self.g.scale, output[:n], dense_done=dense_done,
                   slow_done=slow_done, **self._scales())
        if self.rows is not None:
            self.rows.add_sfi(None if dense_done else sfi.row_dense[:n],
                              None if slow_done else sfi.row_slow[:n], sfi.row_fast[:n])

    def _prefill_end(self, query, kv_cache, md, sfi) -> None:
        if sfi.quest_pages is not None:
            from vllm_ext.methods.sfi.path import quest_prefill_pages

            quest_prefill_pages(kv_cache, md.block_table, sfi.quest_pages, self.cfg, self.buffers)
        if sfi.prefill_end is not None:
            from vllm_ext.methods.sfi.path import sfi_prefill_end

            sfi_prefill_end(query, kv_cache, md.block_table, sfi.prefill_end, self.cfg, self.buffers,
                            self.runtime, self.g.layer_index, self.g.scale,
                            k_scale=self._scales()["k_scale"])

    def warmup_key(self) -> tuple:
        return (self.name, self.buffers is not None)

    def warm_up(self, kv_cache: torch.Tensor, shape, dtype: torch.dtype) -> bool:
        if self.buffers is None:
            return False
        from vllm_ext.methods.sfi.warmup import warm_up_sfi_layer

        g = self.g
        warm_up_sfi_layer(cfg=self.cfg, layer_buffers=self.buffers, runtime=self.runtime, kv_cache=kv_cache,
                          num_heads=g.num_heads, head_size=g.head_size, scale=g.scale, dtype=dtype,
                          shape=shape, layer_index=max(g.layer_index, 0),
                          compact_cache=self._pages_of(self.compact),
                          quest_cache=None if self.quest is None else self._pages_of(self.quest),
                          **self._scales())
        return True
