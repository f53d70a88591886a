"""The dense delegate (CUDA): which of vLLM's own backends attends the dense rows
(``speedsfi.dense_delegate``, resolved at start-up: ``auto`` is vLLM's own pick), its classes, and its
metadata cut to the rows it computes in a step (the rows before a method's trailing sub-batch; the
prefill rows when our kernels compute the decode rows)."""

from __future__ import annotations

import dataclasses
import logging

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_ext.config import ConfigError

logger = logging.getLogger("vllm_ext")


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
                           "(vllm_ext.backend.dense_delegate.resolve_dense_delegate)")


def dense_delegate_builder_cls(delegate: str = "triton"):
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


def cut_delegate(md, cm: CommonAttentionMetadata, delegate, *, decodes_apart: bool,
                 tail_row: int | None) -> None:
    """The rows the delegate computes this step. ``decodes_apart``: our kernels compute the decode
    rows (vLLM puts them first), so on a step with prefills the delegate starts at the first prefill
    row (pure decode steps never reach it); ``tail_row``: a method's trailing sub-batch starts there,
    and the delegate ends before it."""
    nd = md.num_decodes
    start = nd if nd and md.num_prefills and decodes_apart and can_cut_rows(delegate, nd) else 0
    md.delegate_first_row = start
    md.delegate_first_token = int(cm.query_start_loc_cpu[start]) if start else 0
    if tail_row is not None:
        md.delegate_head = delegate_rows(delegate, cm, start, tail_row)
    if start:
        # every row from ``start`` (layers where the tail's method does not act)
        md.delegate_tail = delegate_rows(delegate, cm, start, cm.num_reqs)


def check_flash_attn_delegate(vllm_config, *, on_cpu: bool, capability) -> None:
    """``speedsfi.dense_delegate = "flash_attn"``: FLASH_ATTN must take this model, cache and GPU,
    or start-up stops naming what it refuses (never a silent switch back to TRITON_ATTN)."""
    if on_cpu:
        logger.info("vllm_ext: speedsfi.dense_delegate = 'flash_attn' applies to CUDA; the CPU build "
                    "attends dense rows with CPU_ATTN")
        return
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    head = vllm_config.model_config.get_head_size()
    cache_dtype = vllm_config.cache_config.cache_dtype
    why = None
    if not FlashAttentionBackend.supports_head_size(head):
        why = f"head size {head}"
    elif not FlashAttentionBackend.supports_kv_cache_dtype(cache_dtype):
        why = f"KV cache dtype {cache_dtype}"
    elif capability is not None and not FlashAttentionBackend.supports_compute_capability(capability):
        why = f"compute capability {capability}"
    if why is not None:
        raise ConfigError(f"speedsfi.dense_delegate = 'flash_attn': vLLM's FLASH_ATTN does not support "
                          f"this {why}; use 'triton'")


# vLLM backends SPEEDSFI can hand its dense rows to, by vLLM's backend name
DELEGATES = {"FLASH_ATTN": "flash_attn", "TRITON_ATTN": "triton"}


def vllm_default_backend(vllm_config) -> str:
    """The name of the attention backend vLLM's own selector picks for this model, dtype, cache and
    device when no backend is named (what ``vllm serve MODEL`` runs)."""
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    model, cache = vllm_config.model_config, vllm_config.cache_config
    selector = AttentionSelectorConfig(
        head_size=model.get_head_size(), dtype=model.dtype, kv_cache_dtype=cache.cache_dtype,
        block_size=cache.block_size if getattr(cache, "user_specified_block_size", False) else None,
        use_mla=bool(getattr(model, "use_mla", False)))
    path = current_platform.get_attn_backend_cls(
        None, attn_selector_config=selector,
        num_heads=model.get_num_attention_heads(vllm_config.parallel_config))
    return resolve_obj_by_qualname(path).get_name()


def resolve_dense_delegate(cfg, vllm_config, *, on_cpu: bool, pick=None) -> str:
    """``speedsfi.dense_delegate`` as it runs: ``"auto"`` becomes the delegate of vLLM's own pick
    (``pick``: a callable returning that backend's name, default :func:`vllm_default_backend`).
    The CPU build's dense rows run ``CPU_ATTN`` whatever the field says: ``"auto"`` stays."""
    if cfg.dense_delegate != "auto":
        return cfg.dense_delegate
    if on_cpu:
        logger.info("vllm_ext: speedsfi.dense_delegate = 'auto': the CPU build's dense rows run CPU_ATTN")
        return "auto"
    name = (pick or vllm_default_backend)(vllm_config)
    delegate = DELEGATES.get(name)
    if delegate is None:
        from vllm_ext import metrics

        metrics.fallback("dense_delegate_auto", "vllm_ext: speedsfi.dense_delegate = 'auto': vLLM would "
                         "pick %s, which SPEEDSFI cannot hand dense rows to (it delegates to %s); "
                         "using TRITON_ATTN", name, " or ".join(sorted(DELEGATES)))
        return "triton"
    logger.info("vllm_ext: speedsfi.dense_delegate = 'auto': %s (vLLM's pick for head size %s, %s, "
                "KV cache %s) attends the dense rows", name, vllm_config.model_config.get_head_size(),
                vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype)
    return delegate
