"""CritiPrefill: segment-wise criticality for block-sparse prefill (ALGORITHMS.md §3).

Per layer of a prefill step (chunked prefill is the normal case)::

    fusion = LayerFusion.from_config(cfg)          # once per forward pass (or fusion.reset())
    plan = build_plan(query, kv_cache, block_table, query_start_loc, seq_lens, cfg,
                      layer_idx=layer_idx, fusion=fusion, prompt_lens=prompt_lens,
                      max_seq_len=max_seq_len, max_query_len=max_query_len)
    block_sparse_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, plan, scale,
                         output=output)

``plan.all_dense`` (a host bool) says the layer is dense (``cfg.dense_layers``); the caller may then
use its ordinary dense prefill kernel instead. Imports neither vLLM nor Triton directly.
"""

from vllm_ext.methods.critiprefill.criticality import (
    LayerFusion,
    SequenceSelection,
    candidate_mask,
    criticality_scores,
    fuse_scores,
    is_dense_layer,
    segment_representatives,
    select_blocks,
    select_for_sequence,
)
from vllm_ext.methods.critiprefill.plan import (
    CritiPrefillPlan,
    build_plan,
    dense_plan,
    max_segments_bound,
    segment_query_representatives,
)
from vllm_ext.kernels.block_representatives import block_representatives
from vllm_ext.kernels.block_sparse_prefill import block_sparse_prefill

__all__ = [
    "CritiPrefillPlan",
    "LayerFusion",
    "SequenceSelection",
    "block_representatives",
    "block_sparse_prefill",
    "build_plan",
    "candidate_mask",
    "criticality_scores",
    "dense_plan",
    "fuse_scores",
    "is_dense_layer",
    "max_segments_bound",
    "segment_query_representatives",
    "segment_representatives",
    "select_blocks",
    "select_for_sequence",
]
