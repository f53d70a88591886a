"""The SPEEDSFI metadata builder: a thin layer over vLLM's common metadata plus the step's plan.

Plan/run split (as FlashInfer's wrappers): the runner hooks only stage host-side facts (rows -> request
slots, which rows decode, prefill geometry) in the request-state table, which the hooks bind to this
builder once; ``build`` turns them into the device plan inside the table's persistent buffers
(``RequestStateTable.build_step``), and every layer of the step reads that plan. Builds for CUDA-graph
capture produce a real plan too, so a captured decode step records the real SFI path.

One metadata object per KV-cache group and step. On CUDA the dense path delegates to vLLM's own
backend, so its builder runs too and its metadata rides along (``delegate``, cut to the rows it
computes: :mod:`vllm_ext.backend.dense_delegate`). A method that plans per group (its plan depends on
the group's own metadata) does so here (``Method.plan_group``, into ``plans``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_ext import metrics
from vllm_ext.backend.startup import engine_of
from vllm_ext.backend.dense_delegate import cut_delegate, dense_delegate_builder_cls
from vllm_ext.request_state import RequestStateTable, StepState


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
    plans: dict[str, Any] = field(default_factory=dict)   # method -> its plan of the step for this group
    # CUDA with a method's trailing sub-batch: the delegate's metadata of the rows before it (from
    # ``delegate_first_row``)
    delegate_head: Any = None
    # CUDA, a step with prefills whose decode rows our kernels compute: the delegate computes only
    # the rows ``[delegate_first_row, num_reqs)`` (the prefill rows; every decode row is computed once,
    # by our kernels), from ``delegate_tail`` (or ``delegate_head`` up to a trailing sub-batch); its
    # first row's first token is ``delegate_first_token``. 0 = the delegate sees the batch from row 0.
    delegate_tail: Any = None
    delegate_first_row: int = 0
    delegate_first_token: int = 0


class SpeedSfiMetadataBuilder(AttentionMetadataBuilder[SpeedSfiMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not current_platform.is_cuda_alike():
            return AttentionCGSupport.NEVER
        engine = engine_of(vllm_config)
        cfg, methods = engine.config, engine.methods()
        if not methods and cfg.resolved_dense_decode == "delegate":
            # all methods off: exactly the delegate, whose graphs vLLM already trusts
            return dense_delegate_builder_cls(cfg.dense_delegate).get_cudagraph_support(
                vllm_config, kv_cache_spec)
        if all(m.keeps_full_cuda_graphs() for m in methods):
            # A uniform single-token decode step runs only our kernels, with every decision in
            # device buffers the builder rewrites before each replay (and side-stream work forked
            # and joined inside the step): FULL graphs. Steps with prefills run the delegate and
            # host-planned work: piecewise. All off with ``dense_decode = "paged_decode"``: a decode
            # step is our paged_decode alone, the same.
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        engine = engine_of(vllm_config)
        self.config = engine.config
        self.methods = engine.methods()
        self._init_reorder_batch_threshold(1)        # V1 runner: decodes first
        from vllm.model_executor.models.utils import extract_layer_index

        self._last_layer_name = max(layer_names, key=extract_layer_index) if layer_names else ""
        self._on_cpu = torch.device(device).type == "cpu"
        # CUDA: our kernels compute the decode rows when the dense path decodes with paged_decode
        # or a method owns them
        self._paged_decode = self.config.resolved_dense_decode == "paged_decode"
        self._rows = engine.row_counters(torch.device(device))
        self._state: RequestStateTable | None = None
        self.method_state: dict[str, Any] = {}       # a method's persistent buffers for plan_group
        self._delegate = None
        if not self._on_cpu:
            self._delegate = dense_delegate_builder_cls(self.config.dense_delegate)(
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
        for m in self.methods:
            plan = m.plan_group(self, cm, step)
            if plan is not None:
                md.plans[m.name] = plan
        decode_owner = next((m for m in self.methods
                             if m.owns_decode_rows() and step.plans.get(m.name) is not None), None)
        if delegate is not None:
            tails = [r for r in (m.tail_row(step) for m in self.methods) if r is not None]
            cut_delegate(md, cm, delegate, decodes_apart=decode_owner is not None or self._paged_decode,
                         tail_row=min(tails) if tails else None)
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
            if not self._on_cpu:             # the CPU dense path counts which kernels ran
                metrics.bump(f"steps.{decode_owner.name}" if decode_owner is not None
                             else "steps.dense_triton")
        return md

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
