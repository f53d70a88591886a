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
    """Requests that can hold SFI compact state at once (``speedsfi.sfi.max_requests``)."""
    cfg = resolve_config(vllm_config).sfi
    if not cfg.enabled:
        return 0
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return min(cfg.max_requests or min(max_seqs, 32), max_seqs)


def critiprefill_capacity(vllm_config) -> int:
    """Prompts that can be in a sparse prefill at once (``speedsfi.critiprefill.max_requests``)."""
    cfg = resolve_config(vllm_config).critiprefill
    if not cfg.enabled:
        return 0
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return min(cfg.max_requests or min(max_seqs, 4), max_seqs)


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
    speed: Any = None               # vllm_ext.speed.visibility.SpeedUpperStep when SPEED is on
    # CUDA with a CritiPrefill sub-batch: the delegate's metadata of the rows before it
    delegate_head: Any = None


def delegate_head(delegate, cm: CommonAttentionMetadata, rows: int):
    """The dense delegate's metadata restricted to the batch's first ``rows`` rows (the decode rows
    and any prefill rows before the CritiPrefill sub-batch); ``None`` when there are none. Host-only:
    views of the delegate's tensors and host counts from ``query_start_loc_cpu``."""
    if rows <= 0:
        return None
    qsl = cm.query_start_loc_cpu
    n_tok = int(qsl[rows])
    max_q = int((qsl[1:rows + 1] - qsl[:rows]).max())
    return dataclasses.replace(delegate, num_actual_tokens=n_tok, max_query_len=max_q,
                               query_start_loc=delegate.query_start_loc[:rows + 1],
                               seq_lens=delegate.seq_lens[:rows], block_table=delegate.block_table[:rows],
                               slot_mapping=delegate.slot_mapping[:n_tok])


def _dense_delegate_builder_cls():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    return TritonAttentionMetadataBuilder


class SpeedSfiMetadataBuilder(AttentionMetadataBuilder[SpeedSfiMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not current_platform.is_cuda_alike():
            return AttentionCGSupport.NEVER
        cfg = resolve_config(vllm_config)
        if not cfg.any_enabled:
            # all methods off: exactly the Triton delegate, whose graphs vLLM already trusts
            return _dense_delegate_builder_cls().get_cudagraph_support(vllm_config, kv_cache_spec)
        if (cfg.sfi.enabled or cfg.critiprefill.enabled) and not cfg.speed.enabled:
            # A uniform single-token decode step runs only our kernels, with every decision in
            # device buffers the builder rewrites before each replay (and the side stream forked and
            # joined inside the step): FULL graphs. Steps with prefills run the delegate and the
            # host-planned prefill-end selection: piecewise. CritiPrefill never acts on such a step
            # (its rows are prefill chunks of >= 2 tokens; CritiPrefill alone decodes with the
            # delegate).
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = resolve_config(vllm_config)
        self._init_reorder_batch_threshold(1)        # V1 runner: decodes first
        from vllm.model_executor.models.utils import extract_layer_index

        self._last_layer_name = max(layer_names, key=extract_layer_index) if layer_names else ""
        self._on_cpu = torch.device(device).type == "cpu"
        self._state: RequestStateTable | None = None
        self._delegate = None
        self._speed_buffers = None
        if self.config.speed.enabled:
            from vllm_ext.speed.visibility import SpeedPlanBuffers

            sched = vllm_config.scheduler_config
            self._speed_buffers = SpeedPlanBuffers(sched.max_num_seqs, sched.max_num_batched_tokens,
                                                   torch.device(device))
            from vllm_ext.request_state import PinnedStaging

            self._speed_l_cut = self.config.speed.resolved_l_cut(
                vllm_config.model_config.get_total_num_hidden_layers())
            self._speed_keep_staging = PinnedStaging(sched.max_num_batched_tokens, torch.int64,
                                                     torch.device(device))
        if not self._on_cpu:
            self._delegate = _dense_delegate_builder_cls()(kv_cache_spec, layer_names, vllm_config,
                                                           device)

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
        if step.critiprefill is not None and delegate is not None:
            md.delegate_head = delegate_head(delegate, cm, step.critiprefill.first_row)
        if self._on_cpu:
            md.query_start_loc_host = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
            md.seq_lens_host = cm.seq_lens[: cm.num_reqs].tolist()
        if step.is_real:
            # host counters, once per step and group (never per layer)
            metrics.bump("steps.built")
            metrics.bump("steps.dense_torch" if self._on_cpu else
                         "steps.sfi" if step.sfi is not None else "steps.dense_triton")
        return md

    def _speed_plan(self, cm: CommonAttentionMetadata, step: StepState):
        """The upper layers' view of the step (SPEED): every group plans it (cheap), the upper
        layers use it (without vLLM's hybrid KV manager the upper layers share a group)."""
        from vllm_ext.speed.visibility import anchor_count, kept_token_index, plan_upper_step

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
