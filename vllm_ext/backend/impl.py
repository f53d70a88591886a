"""The SPEEDSFI attention impl. Per layer it holds only persistent buffers (SFI's compact segments);
every step-dependent decision comes from the step plan in the metadata (built by the builder).

Dense path (every method off, and whatever a method leaves dense):
- CUDA: vLLM's own Triton attention (``TritonAttentionImpl``) for the KV write and the attention, so
  output is identical to ``--attention-backend TRITON_ATTN``;
- CPU build: vLLM's own ``CPU_ATTN`` ops on their packed cache (``vllm_ext.backend.cpu_dense``):
  the whole layer with every method off (identical to ``CPU_ATTN``), the K/V write and the dense
  rows with a method on, while our PyTorch twins read the same pages through
  ``vllm_ext.kernels.packed_pages.PackedPages`` (vec and amx packings); where the packing is
  unreadable (Arm, a vLLM that packs otherwise), ``vllm_ext.kernels.paged_reference`` (PyTorch) over
  our layout (a counted fallback).
Both write K/V themselves (``forward_includes_kv_cache_update``) and read the cache through strides.

SFI (``speedsfi.sfi.enabled``): decode rows follow the step plan (dense / slow / fast, decided on the
device, ``vllm_ext.methods.sfi.step_plan``); ending prefills make the first selection; see
``vllm_ext.methods.sfi.path``. On CUDA a pure-decode step runs only our kernels, the same launches
whatever the rows decide, so vLLM captures it in a FULL CUDA graph. A step with prefills (piecewise)
computes every row once: the decode rows (first in vLLM's batch) go entirely through SFI's path,
dense ones through our ``paged_decode``, and the delegate attends only the prefill rows, from its
metadata cut to them (``metadata.delegate_rows``). The forward never synchronises with the host and
counts nothing on the host: counters are device tensors updated by the plan
(``vllm_ext.backend.row_counters``, when on, counts the rows each path computed).

``speedsfi.dense_decode`` (CUDA) names the kernel of the dense decode rows: ``paged_decode`` with
SFI on; with every method off the delegate, or ``paged_decode`` when asked (SFI's like-for-like
dense reference: then decode rows run as under SFI, prefill rows through the delegate).

CritiPrefill (``speedsfi.critiprefill.enabled``): in each sparse layer the step's CritiPrefill
sub-batch (prefill chunks of long prompts, host-planned by ``vllm_ext.methods.critiprefill.slots``) attends
block-sparsely (``vllm_ext.methods.critiprefill.path``); the rows before it take the dense path (on
CUDA the delegate, with its metadata cut to those rows). Decode rows are never affected.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from vllm_ext import metrics
from vllm_ext.backend import row_counters
from vllm_ext.backend.metadata import SpeedSfiMetadata, sfi_capacity
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
        vllm_config = get_current_vllm_config()
        self.config = resolve_config(vllm_config)
        self._max_rows = vllm_config.scheduler_config.max_num_seqs
        self._max_len = vllm_config.model_config.max_model_len
        self._sfi_capacity = sfi_capacity(vllm_config)
        self._sfi_layer = None
        self._compact = None                           # this layer's SfiCompactCache
        self._quest = None                             # its SfiQuestCache (selector quest)
        self._sfi_rt = None
        self._layer_index = -1
        self._cp_state = None                          # this layer's CritiPrefillStateCache (sparse layers)
        self._max_batched = vllm_config.scheduler_config.max_num_batched_tokens
        self._forward_context = vllm_config.compilation_config.static_forward_context
        self._speed_l_cut = (self.config.speed.resolved_l_cut(
            vllm_config.model_config.get_total_num_hidden_layers())
            if self.config.speed.enabled else 1 << 30)
        # CUDA: our kernels own the decode rows (SFI on, or dense_decode = "paged_decode")
        self._ours_decode = self.config.resolved_dense_decode == "paged_decode"
        self._dense_ws = None                          # paged_decode's scratch without SFI
        self._rows = row_counters.shared(_device())
        self._dense = None
        if not current_platform.is_cpu():
            from vllm_ext.backend.metadata import dense_delegate_impl_cls

            self._dense = dense_delegate_impl_cls(self.config.dense_delegate)(
                num_heads, head_size, scale, self.num_kv_heads, None, None, kv_cache_dtype, None,
                attn_type, None)
            # our Triton kernels compile while the engine starts (vLLM's JIT warm-up registry)
            from vllm_ext.backend.kernel_warmup import register_with_vllm

            register_with_vllm(vllm_config)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # Runs before vLLM profiles memory: what is allocated here comes out of its budget.
        if self.config.critiprefill.enabled:
            self._register_critiprefill_state()
        if self._ours_decode and not self._sfi_capacity and self._dense is not None:
            from vllm_ext.methods.sfi.runtime import shared_dense_workspace

            self._dense_ws = shared_dense_workspace(max_rows=self._max_rows, num_heads=self.num_heads,
                                                    num_kv_heads=self.num_kv_heads,
                                                    head_size=self.head_size, max_len=self._max_len,
                                                    device=_device())
        if self._sfi_capacity:
            self._register_compact_cache()
            from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, shared_runtime

            device = _device()
            self._sfi_layer = SfiLayerBuffers(self._sfi_capacity, self.num_kv_heads, self.config.sfi,
                                              self.head_size, act_dtype, device,
                                              num_heads=self.num_heads, max_len=self._max_len,
                                              paged=True)
            layer_mib = SfiLayerBuffers.nbytes(self._sfi_capacity, self.num_kv_heads, self.config.sfi,
                                               self.head_size, act_dtype, num_heads=self.num_heads,
                                               max_len=self._max_len, paged=True) / 2**20
            if self.config.sfi.selector == "quest":
                metrics.log_once("sfi_buffers", "vllm_ext: SFI (selector quest) per layer %.2f MiB of "
                                 "slot tables; the compact segments%s and the page max/min of K (one "
                                 "block per block_size x page_size %d tokens of a request) are blocks "
                                 "of vLLM's KV cache (docs/per_request_memory.md)", layer_mib,
                                 " and kept positions" if self.config.sfi.keep_prefill else "",
                                 self.config.sfi.page_size)
            else:
                metrics.log_once("sfi_buffers", "vllm_ext: SFI per layer %.2f MiB of slot tables; its "
                                 "per-request state (compact segment, Hkv %d x (n_sink + k) %d entries; "
                                 "prompt-tail queries w_prefill %d x Hq %d x D %d%s) is in blocks of "
                                 "vLLM's KV cache (docs/per_request_memory.md)",
                                 layer_mib, self.num_kv_heads, self.config.sfi.n_sink + self.config.sfi.k,
                                 self.config.sfi.w_prefill, self.num_heads, self.head_size,
                                 "; kept positions Hkv x %d int32" % self.config.sfi.keep_prefill
                                 if self.config.sfi.keep_prefill else "")
            self._sfi_rt = shared_runtime(self.config.sfi, capacity=self._sfi_capacity,
                                          max_rows=self._max_rows, num_heads=self.num_heads,
                                          num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                          max_len=self._max_len, device=device)

    def _own_layer_name(self) -> str | None:
        for name, attn in self._forward_context.items():
            if getattr(attn, "impl", None) is self:
                return name
        return None

    def _own_layer_index(self) -> int:
        """This impl's layer index, from vLLM's forward context (-1 if not found)."""
        from vllm.model_executor.models.utils import extract_layer_index

        name = self._own_layer_name()
        return -1 if name is None else extract_layer_index(name)

    def _register_compact_cache(self) -> bool:
        """Register this layer's SFI compact cache in the forward context, so that vLLM pages its
        compact segments (``vllm_ext.methods.sfi.caches``); none for a layer that never decodes
        sparsely (a SPEED upper layer). Returns whether it has one."""
        from vllm.model_executor.models.utils import extract_layer_index

        from vllm_ext.methods.sfi.caches import register_compact_layer

        name = self._own_layer_name()
        if name is None:
            raise RuntimeError("SPEEDSFI: an attention impl not found in vLLM's forward context")
        if extract_layer_index(name) >= self._speed_l_cut:
            return False
        self._compact = register_compact_layer(self._forward_context, name, self.config.sfi)
        if self.config.sfi.resolved_copy_ngram:
            # the copy trigger's token history: one history layer beside each compact layer
            # (vllm_ext.methods.sfi.caches), the same group pattern
            from vllm_ext.methods.sfi.caches import register_history_layer

            register_history_layer(self._forward_context, name, max_len=self._max_len)
        if self.config.sfi.selector == "quest":
            from vllm_ext.methods.sfi.caches import register_quest_layer

            self._quest = register_quest_layer(self._forward_context, name, self.config.sfi)
        return True

    def _register_critiprefill_state(self) -> None:
        """Register this layer's CritiPrefill state cache in the forward context, so that vLLM pages
        each prompt's state (``vllm_ext.methods.critiprefill.state_cache``). Every layer below SPEED's cut
        has one, its dense layers included (their pages are never read): the state layers then
        match the attention layers (and SFI's compact layers) one for one, so vLLM keeps one group
        pattern for all; fewer state layers would split the attention layers into groups of their
        own block tables. A SPEED upper layer has none."""
        from vllm.model_executor.models.utils import extract_layer_index

        from vllm_ext.methods.critiprefill.state_cache import register_state_layer

        name = self._own_layer_name()
        if name is None:
            raise RuntimeError("SPEEDSFI: an attention impl not found in vLLM's forward context")
        index = extract_layer_index(name)
        cfg = self.config.critiprefill
        if index >= self._speed_l_cut:
            return
        state = register_state_layer(self._forward_context, name, cfg, num_heads=self.num_heads,
                                     max_len=self._max_len)
        if index not in cfg.dense_layers:
            self._cp_state = state                     # this layer prefills sparsely

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: SpeedSfiMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("SPEEDSFI does not fuse output quantization")
        if attn_metadata is None:                     # profiling run
            return output.fill_(0)
        md = attn_metadata
        sfi = md.step.sfi if self._sfi_layer is not None else None
        if sfi is not None and self._compact is not None:
            # the compact segments, kept positions and prompt-tail queries: this layer's pages of
            # SFI's KV-cache group, through the group's per-slot block table (the runner hooks bound
            # it: vllm_ext.methods.sfi.slot_tables)
            self._sfi_layer.bind_pages(self._compact.kv_cache,
                                       md.step.table.sfi.compact_table_of_layer[layer.layer_name])
        if sfi is not None and self._quest is not None:
            quest_table = md.step.table.sfi.quest.table_of_layer.get(layer.layer_name)
            if quest_table is None:
                raise RuntimeError(f"vllm_ext: no KV-cache group holds {layer.layer_name}'s Quest page "
                                   "bounds (vLLM did not page its bound-page cache layer)")
            self._sfi_layer.bind_quest_pages(self._quest.kv_cache, quest_table)
        if self._layer_index < 0:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layer_index = extract_layer_index(layer.layer_name)
        try:
            if md.speed is not None and self._layer_index >= self._speed_l_cut:
                # SPEED upper layer: no SFI or CritiPrefill here (only anchors and decode-phase
                # tokens exist in these layers; ALGORITHMS.md §2, §4)
                return self._forward_speed_upper(layer, query, key, value, kv_cache, md, output)
            return self._forward(layer, query, key, value, kv_cache, md, output, sfi)
        finally:
            if sfi is not None and layer.layer_name == md.last_layer_name:
                self._sfi_rt.ring.join()              # the step's one join of side-stream work

    def _forward(self, layer, query, key, value, kv_cache, md, output, sfi):
        if self._rows is not None:
            # the rows of this layer call (a pure-decode step of ours: the padded batch it computes)
            pure = self._dense is not None and (sfi is not None or self._ours_decode) and \
                md.num_decodes and not md.num_prefills
            self._rows.add(row_counters.LAYER, min(md.num_reqs, query.shape[0]) if pure else md.num_reqs)
        if self._dense is not None:
            self._dense.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
            if sfi is None and not self._ours_decode:
                if md.delegate_first_row:
                    raise RuntimeError("SPEEDSFI: the metadata cut the delegate's rows, but this layer "
                                       "computes no decode rows itself")
                return self._prefill_attention(layer, query, key, value, kv_cache, md, output)
            return self._forward_sfi_cuda(layer, query, key, value, kv_cache, md, output, sfi)
        self._write_kv(layer, kv_cache, key, value, md.slot_mapping)
        sfi_rows = None
        if sfi is not None and md.num_decodes:
            # the decode rows whose output SFI writes this step; the host reads the plan for free on
            # the CPU, once per step. SFI's slow pass writes the slow rows' output from the scores
            # it computes for the evidence (Triton kernels: the interpreter in tests; on CPU_ATTN's
            # packed pages the compiled CPU kernels, one read of K and V); only when neither runs (the
            # PyTorch twins, several times slower at it) the dense pass (CPU_ATTN's kernel) attends
            # the slow rows too and SFI's pass only scores them.
            if sfi.host_sfi_rows is None:
                from vllm_ext.kernels import cpu_native
                from vllm_ext.kernels.packed_pages import PackedPages
                from vllm_ext.kernels.triton_utils import use_triton

                nd = md.num_decodes
                sfi.host_slow_dense = not use_triton(query) and not (
                    isinstance(kv_cache, PackedPages) and cpu_native.library() is not None)
                mine = sfi.row_fast[:nd] if sfi.host_slow_dense else ~sfi.row_dense[:nd]
                sfi.host_sfi_rows = mine.tolist()
                sfi.host_any_sparse = not bool(sfi.row_dense[:nd].all())
            sfi_rows = sfi.host_sfi_rows
        self._prefill_attention(layer, query, key, value, kv_cache, md, output, skip_rows=sfi_rows)
        if sfi is not None:
            self._sfi_prefill_end(query, kv_cache, md, sfi)
        if sfi_rows is not None and (sfi.host_any_sparse or self._rows is not None
                                     or self.config.sfi.selector == "quest"):
            # Rows the pass above attended have their output from it (bit-identical to all-off);
            # every other decode row was computed once, by SFI below. (With every row dense SFI has
            # nothing to do, except Quest's page bounds, which every SFI decode row keeps up to date.)
            self._decode_rows(query, kv_cache, md, output, sfi, md.num_decodes, dense_done=True,
                              slow_done=sfi.host_slow_dense)
        return output

    def _decode_rows(self, query, kv_cache, md, output, sfi, rows: int, *, dense_done: bool,
                     slow_done: bool = False) -> None:
        """The first ``rows`` rows (one query each) through our decode kernels: SFI's path, or with
        every method off and ``dense_decode = "paged_decode"`` our dense paged decode.
        ``dense_done``: the dense path already wrote the dense rows; ``slow_done`` (the CPU build):
        and the slow rows."""
        if sfi is not None:
            from vllm_ext.methods.sfi.path import sfi_decode

            sfi_decode(query[:rows], kv_cache, md.block_table[:rows], md.seq_lens[:rows], sfi,
                       self.config.sfi, self._sfi_layer, self._sfi_rt, self._layer_index, self.scale,
                       output[:rows], dense_done=dense_done, slow_done=slow_done)
            if self._rows is not None:
                self._rows.add_sfi(None if dense_done else sfi.row_dense[:rows],
                                   None if slow_done else sfi.row_slow[:rows], sfi.row_fast[:rows])
            return
        if dense_done:
            return
        from vllm_ext.kernels.dense_decode_evidence import paged_decode

        paged_decode(query[:rows], kv_cache, md.block_table[:rows], md.seq_lens[:rows], self.scale,
                     output[:rows], workspace=self._dense_ws)
        if self._rows is not None:
            self._rows.add(row_counters.PAGED_DECODE, rows)

    def _prefill_attention(self, layer, query, key, value, kv_cache, md, output, skip_rows=None):
        """Every row's attention as the dense path gives it, except the rows of the step's
        CritiPrefill sub-batch in a sparse layer (``vllm_ext.methods.critiprefill.path``): the rows
        before it go to the dense path (the delegate on CUDA), the sub-batch to CritiPrefill. K/V
        are already written. On CUDA the delegate starts at ``md.delegate_first_row`` (the first
        prefill row when our kernels compute the decode rows; its metadata is cut to its rows).
        ``skip_rows`` (CPU only: a host list of flags for the first rows): rows the dense pass
        leaves out because SFI computes them."""
        cp = md.step.critiprefill if self._cp_state is not None else None
        if cp is not None and self._layer_index in self.config.critiprefill.dense_layers:
            cp = None
        end = cp.first_row if cp is not None else md.num_reqs
        rc = self._rows
        if self._dense is not None:
            start = md.delegate_first_row
            if cp is None and not start:
                self._dense.forward(layer, query, key, value, kv_cache, md.delegate, output)
            else:
                cut = md.delegate_head if cp is not None else md.delegate_tail
                if cut is not None:
                    t0 = md.delegate_first_token
                    self._dense.forward(layer, query[t0:], key[t0:], value[t0:], kv_cache, cut,
                                        output[t0:])
            if rc is not None:
                rc.add(row_counters.DELEGATE, end - start)
        else:
            rows = cp.first_row if cp is not None else len(md.seq_lens_host)
            seq_lens = md.seq_lens_host[:rows]
            if skip_rows:
                seq_lens = [0 if i < len(skip_rows) and skip_rows[i] else n for i, n in enumerate(seq_lens)]
            self._dense_rows(layer, query, kv_cache, md, rows, seq_lens, output)
            if rc is not None:
                rc.add(row_counters.DELEGATE, rows - sum(bool(x) for x in (skip_rows or [])[:rows]))
        if cp is not None:
            from vllm_ext.methods.critiprefill.path import critiprefill_prefill

            state_table = cp.state_table(layer.layer_name)
            if state_table is None:
                raise RuntimeError(f"vllm_ext: no KV-cache group holds {layer.layer_name}'s CritiPrefill "
                                   "state (vLLM did not page its state cache layer)")
            critiprefill_prefill(query, kv_cache, md.block_table, cp, self.config.critiprefill,
                                 self._cp_state.kv_cache, state_table, self._layer_index, self.scale,
                                 output, stats=md.step.table.critiprefill.stats)
            if rc is not None:
                rc.add(row_counters.CRITIPREFILL, md.num_reqs - cp.first_row)
        return output

    def _write_kv(self, layer, kv_cache, key, value, slot_mapping) -> None:
        """K/V into the cache on the CPU build (the CUDA path writes through the delegate)."""
        paged_reference.write_kv(kv_cache, key, value, slot_mapping)

    def _dense_rows(self, layer, query, kv_cache, md, rows: int, seq_lens: list[int],
                    output) -> None:
        """The CPU build's dense attention of the first ``rows`` rows (``seq_lens``: host list, 0 =
        a row computed elsewhere)."""
        paged_reference.dense_paged_attention(query, kv_cache, md.block_table,
                                              md.query_start_loc_host[:rows + 1], seq_lens,
                                              self.scale, output)

    def _sfi_prefill_end(self, query, kv_cache, md, sfi) -> None:
        if sfi.quest_pages is not None:
            from vllm_ext.methods.sfi.path import quest_prefill_pages

            quest_prefill_pages(kv_cache, md.block_table, sfi.quest_pages, self.config.sfi,
                                self._sfi_layer)
        if sfi.prefill_end is None:
            return
        from vllm_ext.methods.sfi.path import sfi_prefill_end

        sfi_prefill_end(query, kv_cache, md.block_table, sfi.prefill_end, self.config.sfi,
                        self._sfi_layer, self._sfi_rt, self._layer_index, self.scale)

    def _forward_sfi_cuda(self, layer, query, key, value, kv_cache, md, output, sfi):
        """CUDA with our kernels owning the decode rows (SFI on, or ``dense_decode =
        "paged_decode"``; ``sfi`` is None in the latter case)."""
        nd = md.num_decodes
        if md.num_prefills or nd == 0:
            # A step with prefills (never captured in a FULL graph). The delegate attends the prefill
            # rows only (CritiPrefill's sub-batch block-sparsely), from ``md.delegate_first_row``;
            # SFI makes the ending prefills' selections and computes every decode row itself, each
            # once (dense rows by paged_decode). If the delegate's metadata could not be cut
            # (multimodal prefix ranges), it attends every row and SFI leaves the dense rows to it.
            self._prefill_attention(layer, query, key, value, kv_cache, md, output)
            if sfi is not None:
                self._sfi_prefill_end(query, kv_cache, md, sfi)
            if nd:
                self._decode_rows(query, kv_cache, md, output, sfi, nd,
                                  dense_done=md.delegate_first_row == 0)
            return output
        # Pure decode (padded rows included): our kernels only, decisions on the device.
        rows = min(md.num_reqs, query.shape[0])
        self._decode_rows(query, kv_cache, md, output, sfi, rows, dense_done=False)
        # One-token prefill chunks look like decode rows here; their prompt-tail work is host-planned
        # and runs eagerly (the runner hooks keep such steps out of FULL CUDA graphs).
        if sfi is not None:
            self._sfi_prefill_end(query, kv_cache, md, sfi)
        return output

    def _forward_speed_upper(self, layer, query, key, value, kv_cache, md, output):
        """SPEED upper layer: K/V written only for the tokens that exist here (the plan's slot
        mapping), attention over each row's anchors and decode-phase tokens (one kernel for prefill
        and decode rows; interior prompt queries get an unused anchor-only output)."""
        from vllm_ext.kernels.speed_attention import speed_attention

        sp = md.speed
        slots, rows, positions = sp.slot_mapping, sp.token_row, sp.positions
        if query.shape[0] < slots.shape[0]:
            # the upper stack runs on the kept rows only (vllm_ext.methods.speed.upper_stack)
            keep = sp.keep_idx
            slots, rows, positions = slots[keep], rows[keep], positions[keep]
        n = slots.shape[0]
        if self._dense is not None:
            self._dense.do_kv_cache_update(layer, key, value, kv_cache, slots)
        else:
            self._write_kv(layer, kv_cache, key, value, slots)
        speed_attention(query[:n], kv_cache, md.block_table, rows, positions, sp.tail_start,
                        sp.anchor_end, sp.self_only, self.scale, output[:n])
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # vLLM does not call this (forward_includes_kv_cache_update); kept for test harnesses.
        if self._dense is not None:
            self._dense.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        else:
            paged_reference.write_kv(kv_cache, key, value, slot_mapping)


def _device() -> torch.device:
    if current_platform.is_cpu():
        return torch.device("cpu")
    return torch.device(current_platform.device_type, torch.accelerator.current_device_index())


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
