"""vLLM's ``CPU_ATTN`` attention kernel (the CPU build's C++ op) over requests the caller composes.

``CPU_ATTN``'s op attends a batch of requests, each a run of query rows (``query_start_loc``) over the
first ``seq_lens[i]`` keys of the pages its block-table row lists, the queries at the last positions
(causal). Nothing in it knows whose pages they are: a request may be a cut of a real one (a range of
its queries) or a page list of the caller's own (a scratch copy of chosen pages in the same packing),
which is how a method sends dense and sparse parts of its rows through the platform's own kernel.

Imports vLLM's ops lazily (the CPU build only); the pages are :class:`PackedPages` in the ISA's
packing (vLLM allocates an fp8 cache as ``uint8``: the op gets those bytes and the scales as
floats, as vLLM's ``CPU_ATTN`` passes them).
"""

from __future__ import annotations

import torch

from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.packed_pages import PackedPages

_FP8_SPELLING = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def kv_cache_dtype_of(pages_dtype: torch.dtype) -> str:
    """vLLM's ``kv_cache_dtype`` spelling for pages of ``pages_dtype`` (``auto`` unless fp8)."""
    if kv_quant.is_fp8(pages_dtype):
        if pages_dtype not in _FP8_SPELLING:
            raise ValueError(f"CPU_ATTN reads no fp8 pages of {pages_dtype}")
        return _FP8_SPELLING[pages_dtype]
    return "auto"


def scheduler_metadata(*, num_heads: int, num_kv_heads: int, head_size: int, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, dtype: torch.dtype, isa: str,
                       kv_cache_dtype: str, num_reqs: int | None = None) -> torch.Tensor:
    """``CPU_ATTN``'s work split for one call (it depends on the lengths only, not on the pages) over
    the first ``num_reqs`` requests (default: every entry of ``seq_lens``)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0] if num_reqs is None else num_reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype=kv_cache_dtype)


def vllm_caches(pages: PackedPages) -> tuple[torch.Tensor, torch.Tensor]:
    """``CPU_ATTN``'s key and value caches as vLLM hands them to its C++ ops (an fp8 cache as its
    ``uint8`` allocation); made once per page view (every layer call asks for them)."""
    if pages.op_caches is None:
        pages.op_caches = (kv_quant.as_bytes(pages.key_cache), kv_quant.as_bytes(pages.value_cache))
    return pages.op_caches


def attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, *,
           scheduler: torch.Tensor, kv_cache_dtype: str, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """``output[:T] = attention(query[:T])`` of the requests (``T = query_start_loc[-1]``), causal,
    in ``CPU_ATTN``'s kernel over vLLM's caches (:func:`vllm_caches`)."""
    from vllm import _custom_ops as ops

    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=block_table, softcap=0, scheduler_metadata=scheduler, s_aux=None,
        dynamic_causal=None, k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)


def available() -> bool:
    """Whether vLLM's CPU attention ops are loaded (the CPU build of vLLM)."""
    try:
        from vllm import _custom_ops  # noqa: F401
    except Exception:
        return False
    return hasattr(torch.ops._C, "cpu_attention_with_kv_cache")
