"""The SPEEDSFI metadata builder: a thin layer over vLLM's common metadata plus the step's plan.

Plan/run split (as FlashInfer's wrappers): the runner hooks only stage host-side facts (rows -> request
slots, which rows decode, prefill geometry) in the request-state table, which the hooks bind to this
builder once; ``build`` turns them into the device plan inside the table's persistent buffers
(``RequestStateTable.build_step``), and every layer of the step reads that plan. Builds for CUDA-graph
capture produce a real plan too, so a captured decode step records the real SFI path.

One metadata object per KV-cache group and step. On CUDA the dense path delegates to vLLM's Triton
backend, so its builder runs too and its metadata rides along (``delegate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_ext import metrics
from vllm_ext.backend.startup import resolve_config
from vllm_ext.request_state import RequestStateTable, StepState


def sfi_capacity(vllm_config) -> int:
    """Requests that can hold SFI state at once: every request the engine runs
    (``--max-num-seqs``); the compact segments themselves are vLLM's KV-cache blocks
    (``vllm_ext.methods.sfi.kv_spec``). ``speedsfi.sfi.max_requests``, when set, is an upper bound."""
    cfg = resolve_config(vllm_config).sfi
    if not cfg.enabled:
        return 0
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return min(cfg.max_requests or max_seqs, max_seqs)


def sfi_admission_cap(vllm_config) -> int:
    """How many requests with SFI the scheduler admits at once: ``sfi.max_requests`` when it is
    set below ``--max-num-seqs``, else 0 (no cap of ours: vLLM's KV-cache blocks decide)."""
    cap = sfi_capacity(vllm_config)
    return cap if cap < vllm_config.scheduler_config.max_num_seqs else 0


def critiprefill_admission_cap(vllm_config) -> int:
    """How many prompts the scheduler lets be in a CritiPrefill sparse prefill at once:
    ``critiprefill.max_requests`` when it is set below ``--max-num-seqs``, else 0 (no cap of ours:
    each prompt's state is KV-cache pages, ``vllm_ext.methods.critiprefill.kv_spec``, and vLLM's block
    accounting decides)."""
    cfg = resolve_config(vllm_config).critiprefill
    if not cfg.enabled or not cfg.max_requests:
        return 0
    cap = cfg.max_requests
    return cap if cap < vllm_config.scheduler_config.max_num_seqs else 0


@dataclass
class SpeedSfiMetadata:
    num_actual_tokens: int          # tokens including padding
    num_reqs: int                   # rows including padding
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # [num_reqs + 1]
    seq_lens: torch.Tensor          # [num_reqs], current queries included
    block_table: torch.Tensor       # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor      # [num_actual_tokens], -1 = do not store
    num_decodes: int                # decode rows come first
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    step: StepState
    # host copies for the CPU path (None on CUDA, where nothing may synchronise)
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    delegate: Any = None            # TritonAttentionMetadata on CUDA
    last_layer_name: str = ""       # the group's last layer: joins the step's side-stream work
    speed: Any = None               # vllm_ext.methods.speed.visibility.SpeedUpperStep when SPEED is on
    # CUDA with a CritiPrefill sub-batch: the delegate's metadata of the rows before it (from
    # ``delegate_first_row``)
    delegate_head: Any = None
    # CUDA, a step with prefills and SFI decode rows: the delegate computes only the rows
    # ``[delegate_first_row, num_reqs)`` (the prefill rows; SFI computes every decode row itself,
    # each once), from ``delegate_tail`` (or ``delegate_head`` up to a CritiPrefill sub-batch); its
    # first row's first token is ``delegate_first_token``. 0 = the delegate sees the batch from row 0.
    delegate_tail: Any = None
    delegate_first_row: int = 0
    delegate_first_token: int = 0


def delegate_rows(delegate, cm: CommonAttentionMetadata, start: int, end: int):
    """The dense delegate's metadata restricted to the batch's rows ``[start, end)``; ``None`` when
    there are none. The cut sees its first row's first token as token 0: the caller passes
    ``query[t0:]`` / ``output[t0:]`` with ``t0 = query_start_loc_cpu[start]`` (``delegate_first_token``).
    Host counts from ``query_start_loc_cpu``; views of the delegate's per-row tensors, and for
    ``start > 0`` one small device subtraction (the shifted ``query_start_loc``).

    Every per-row field ``TritonAttentionImpl.forward`` reads is cut (``tests/test_critiprefill_contract``
    walks the forward's source): ``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``,
    the counts, and a per-row ``causal`` / ``rswa_prefix_lens``. Multimodal prefix ranges (keyed by row)
    are not cut: :func:`can_cut_rows` says no, and the caller keeps the whole batch."""
    if end <= start:
        return None
    qsl = cm.query_start_loc_cpu
    t0 = int(qsl[start])
    n_tok = int(qsl[end]) - t0
    max_q = int((qsl[start + 1:end + 1] - qsl[start:end]).max())
    qsl_dev = delegate.query_start_loc[start:end + 1]
    if t0:
        qsl_dev = qsl_dev - t0
    kw = dict(num_actual_tokens=n_tok, max_query_len=max_q, query_start_loc=qsl_dev,
              seq_lens=delegate.seq_lens[start:end], block_table=delegate.block_table[start:end],
              slot_mapping=delegate.slot_mapping[t0:t0 + n_tok])
    if getattr(delegate, "scheduler_metadata", None) is not None:
        # FLASH_ATTN's ahead-of-time schedule is the whole batch's: FA3 schedules the cut itself
        kw["scheduler_metadata"] = None
    if isinstance(getattr(delegate, "causal", None), torch.Tensor) and delegate.causal.dim():
        kw["causal"] = delegate.causal[start:end]
    if getattr(delegate, "rswa_prefix_lens", None) is not None:
        kw["rswa_prefix_lens"] = delegate.rswa_prefix_lens[start:end]
    return dataclasses.replace(delegate, **kw)


def can_cut_rows(delegate, start: int) -> bool:
    """Can :func:`delegate_rows` cut from row ``start``? (Rows from 0 always.)"""
    return start == 0 or (getattr(delegate, "mm_prefix_range", None) is None
                          and getattr(delegate, "mm_prefix_range_tensor", None) is None
                          and getattr(delegate, "mm_prefix_query_range_tensor", None) is None)


def delegate_head(delegate, cm: CommonAttentionMetadata, rows: int):
    """The dense delegate's metadata restricted to the batch's first ``rows`` rows (the decode rows
    and any prefill rows before the CritiPrefill sub-batch); ``None`` when there are none."""
    return delegate_rows(delegate, cm, 0, rows)


def _check_resolved(delegate: str) -> None:
    if delegate not in ("triton", "flash_attn"):
        raise RuntimeError(f"SPEEDSFI: dense delegate {delegate!r} was not resolved at start-up "
                           "(vllm_ext.backend.startup.resolve_dense_delegate)")


def _dense_delegate_builder_cls(delegate: str = "triton"):
    """The metadata builder of ``speedsfi.dense_delegate``'s vLLM backend."""
    _check_resolved(delegate)
    if delegate == "flash_attn":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

        return FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    return TritonAttentionMetadataBuilder


def dense_delegate_impl_cls(delegate: str = "triton"):
    """The attention impl of ``speedsfi.dense_delegate``'s vLLM backend (same constructor)."""
    _check_resolved(delegate)
    if delegate == "flash_attn":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

        return FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    return TritonAttentionImpl


class SpeedSfiMetadataBuilder(AttentionMetadataBuilder[SpeedSfiMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not current_platform.is_cuda_alike():
            return AttentionCGSupport.NEVER
        cfg = resolve_config(vllm_config)
        if not cfg.any_enabled and cfg.resolved_dense_decode == "delegate":
            # all methods off: exactly the Triton delegate, whose graphs vLLM already trusts
            return _dense_delegate_builder_cls(cfg.dense_delegate).get_cudagraph_support(
                vllm_config, kv_cache_spec)
        if not cfg.speed.enabled:
            # A uniform single-token decode step runs only our kernels, with every decision in
            # device buffers the builder rewrites before each replay (and the side stream forked and
            # joined inside the step): FULL graphs. Steps with prefills run the delegate and the
            # host-planned prefill-end selection: piecewise. CritiPrefill never acts on such a step
            # (its rows are prefill chunks of >= 2 tokens; CritiPrefill alone decodes with the
            # delegate). All off with ``dense_decode = "paged_decode"``: a decode step is our
            # paged_decode alone, the same.
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = resolve_config(vllm_config)
        self._init_reorder_batch_threshold(1)        # V1 runner: decodes first
        from vllm.model_executor.models.utils import extract_layer_index

        self._last_layer_name = max(layer_names, key=extract_layer_index) if layer_names else ""
        self._on_cpu = torch.device(device).type == "cpu"
        # CUDA: our kernels own the decode rows (SFI, or dense_decode = "paged_decode")
        self._ours_decode = self.config.resolved_dense_decode == "paged_decode"
        from vllm_ext.backend import row_counters

        self._rows = row_counters.shared(torch.device(device))
        self._state: RequestStateTable | None = None
        self._delegate = None
        self._speed_buffers = None
        if self.config.speed.enabled:
            from vllm_ext.methods.speed.visibility import SpeedPlanBuffers

            sched = vllm_config.scheduler_config
            self._speed_buffers = SpeedPlanBuffers(sched.max_num_seqs, sched.max_num_batched_tokens,
                                                   torch.device(device))
            from vllm_ext.host_staging import PinnedStaging

            self._speed_l_cut = self.config.speed.resolved_l_cut(
                vllm_config.model_config.get_total_num_hidden_layers())
            self._speed_keep_staging = PinnedStaging(sched.max_num_batched_tokens, torch.int64,
                                                     torch.device(device))
        if not self._on_cpu:
            self._delegate = _dense_delegate_builder_cls(self.config.dense_delegate)(
                kv_cache_spec, layer_names, vllm_config, device)

    def bind_request_state(self, table: RequestStateTable) -> None:
        """Called by the runner hooks once the runner's request-state table exists."""
        self._state = table

    def _step(self, cm: CommonAttentionMetadata) -> StepState:
        if self._state is None:
            raise RuntimeError("SPEEDSFI: no request-state table is bound to the metadata builder. "
                               "SPEEDSFI runs on vLLM's V1 model runner with vllm_ext's hooks (do not "
                               "set VLLM_USE_V2_MODEL_RUNNER=1).")
        step = self._state.build_step(cm.seq_lens, cm.block_table_tensor)
        if step.num_rows != cm.num_reqs:
            raise RuntimeError(f"SPEEDSFI: step state has {step.num_rows} rows but the batch has "
                               f"{cm.num_reqs}; vllm_ext's runner hooks do not match this vLLM")
        return step

    def _build(self, cm: CommonAttentionMetadata, delegate) -> SpeedSfiMetadata:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = \
            split_decodes_and_prefills(cm, decode_threshold=1)
        step = self._step(cm)
        md = SpeedSfiMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
            step=step, delegate=delegate, last_layer_name=self._last_layer_name)
        if self._speed_buffers is not None:
            md.speed = self._speed_plan(cm, step)
        if delegate is not None:
            self._cut_delegate(md, cm, delegate, step)
        if self._on_cpu:
            md.query_start_loc_host = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
            md.seq_lens_host = cm.seq_lens[: cm.num_reqs].tolist()
        if self._rows is not None:
            self._rows.publish()                     # the previous steps' row counts (no sync)
        if step.is_real:
            # host counters, once per step and group (never per layer)
            metrics.bump("steps.built")
            if num_decodes and num_prefills:
                metrics.bump("steps.mixed")
            if not self._on_cpu:             # the CPU impl counts which kernels ran (cpu_dense.py)
                metrics.bump("steps.sfi" if step.sfi is not None else "steps.dense_triton")
        return md

    def _cut_delegate(self, md: SpeedSfiMetadata, cm: CommonAttentionMetadata, delegate,
                      step: StepState) -> None:
        """The rows the delegate computes this step (CUDA). Pure decode steps never reach it when
        our kernels own the decode rows. On a step with prefills, SFI's decode rows (vLLM puts the
        decode rows first) go entirely through SFI's path, so the delegate starts at the first
        prefill row; CritiPrefill's sub-batch (the last rows) ends it."""
        nd = md.num_decodes
        start = 0
        if nd and md.num_prefills and (step.sfi is not None or self._ours_decode) \
                and can_cut_rows(delegate, nd):
            start = nd
        end = step.critiprefill.first_row if step.critiprefill is not None else cm.num_reqs
        md.delegate_first_row = start
        md.delegate_first_token = int(cm.query_start_loc_cpu[start]) if start else 0
        if step.critiprefill is not None:
            md.delegate_head = delegate_rows(delegate, cm, start, end)
        if start:
            # every row from ``start`` (layers where CritiPrefill does not act: its dense layers)
            md.delegate_tail = delegate_rows(delegate, cm, start, cm.num_reqs)

    def _speed_plan(self, cm: CommonAttentionMetadata, step: StepState):
        """The upper layers' view of the step (SPEED): every group plans it (cheap), the upper
        layers use it (without vLLM's hybrid KV manager the upper layers share a group)."""
        from vllm_ext.methods.speed.visibility import anchor_count, kept_token_index, plan_upper_step

        cfg = self.config.speed
        anchor_end = anchor_count(cfg.anchor)
        geometry = self._state.staged_host_geometry if step.is_real else None
        n = cm.num_actual_tokens
        if n > self._speed_buffers.slot_mapping.shape[0]:
            raise RuntimeError(f"SPEEDSFI: a step of {n} tokens exceeds max_num_batched_tokens")
        keep = None
        counts = (0, 0)
        if geometry is not None:
            # host geometry is exact for every row: the tokens the upper stack must run on
            idx = kept_token_index(geometry[0], geometry[1], step.row_prompt_len_np, step.num_reqs,
                                   anchor_end)
            counts = (len(idx), int(geometry[0][step.num_reqs]) - len(idx))
            staging = self._speed_keep_staging
            staging.np[:len(idx)] = idx
            keep = staging.copy_to_device(len(idx))
        plan = plan_upper_step(slot_mapping=cm.slot_mapping[:n], query_start_loc=cm.query_start_loc,
                               seq_lens=cm.seq_lens, row_prompt_len=step.row_prompt_len,
                               num_reqs=cm.num_reqs, anchor_end=anchor_end,
                               self_only=cfg.variant == "self_only", buffers=self._speed_buffers,
                               host_counts=counts)
        plan.keep_idx = keep
        plan.l_cut = self._speed_l_cut
        return plan

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SpeedSfiMetadata:
        delegate = None
        if self._delegate is not None:
            delegate = self._delegate.build(common_prefix_len, common_attn_metadata, fast_build)
        return self._build(common_attn_metadata, delegate)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        delegate = None
        if self._delegate is not None:
            delegate = self._delegate.build_for_cudagraph_capture(common_attn_metadata)
        return self._build(common_attn_metadata, delegate)
