"""The CritiPrefill plan of one layer for one batch of prefill chunks, built on the device without host sync.

A chunk of request ``i`` holds its queries at token rows ``query_start_loc[i]:query_start_loc[i+1]``,
at absolute positions ``ctx_i .. seq_len_i - 1`` (``ctx_i = seq_len_i - q_len_i``; the chunk's own K/V
are already in the paged cache). Its *segment rows* are the absolute segments
``first_segment_i + s`` for ``s = 0 .. num_segments_i - 1`` (a segment cut by a chunk boundary is
represented, in each chunk, by the queries that chunk holds).

Plan tensors (``R`` requests, ``S = max_segments`` a host bound ``ceil(T / segment_size) + 1``):

- ``sel_blocks`` int32 ``[R, S, Hkv, budget // block_size + sink_block]``: selected criticality
  blocks before the segment's start (ascending, padded with ``-1``);
- ``num_sel`` int32 ``[R, S, Hkv]``: how many entries of ``sel_blocks`` are valid;
- ``dense`` bool ``[R, S]``: the segment attends to every earlier key (dense fallback);
- ``first_segment``, ``num_segments`` int32 ``[R]``.

Every segment also attends to its own keys (from its start to each query, exact causal mask); that
part is implicit. Rows ``s >= num_segments_i`` are padding (never read by the kernel).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_ext.methods.critiprefill.criticality import (
    LayerFusion,
    candidate_mask,
    check_sizes,
    criticality_scores,
    dense_segments,
    select_blocks,
)
from vllm_ext.kernels.block_representatives import block_representatives, query_segment_representatives

# Elements of the largest transient score tensor (fp32) per scoring step; the segment axis is chunked
# so that ``R * C * Hq * 4 * NB`` stays under it.
_SCORE_CHUNK_ELEMS = 1 << 25


@dataclass
class CritiPrefillPlan:
    segment_size: int
    block_size: int
    topk: int                       # budget // block_size
    sel_blocks: torch.Tensor        # [R, S, Hkv, topk + sink] int32, -1 padded
    num_sel: torch.Tensor           # [R, S, Hkv] int32
    dense: torch.Tensor             # [R, S] bool
    first_segment: torch.Tensor     # [R] int32
    num_segments: torch.Tensor      # [R] int32
    all_dense: bool = False         # host-known: a dense layer (the scores were not computed)
    scores: torch.Tensor | None = None   # [R, S, Hkv, NB] fused fp32 (only with keep_scores=True)

    @property
    def max_segments(self) -> int:
        return self.sel_blocks.shape[1]

    @property
    def width(self) -> int:
        return self.sel_blocks.shape[-1]

    def to(self, device) -> "CritiPrefillPlan":
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)})


def _chunk_geometry(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, segment_size: int):
    qsl = query_start_loc.long()
    seq = seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    ctx = seq - q_lens
    first = torch.div(ctx, segment_size, rounding_mode="floor")
    last = torch.div(seq - 1, segment_size, rounding_mode="floor")
    nseg = torch.where(q_lens > 0, last - first + 1, 0)
    return qsl, seq, q_lens, ctx, first, nseg


def max_segments_bound(num_tokens: int, segment_size: int) -> int:
    """Host bound on the segments one chunk of at most ``num_tokens`` queries can touch."""
    return -(-max(num_tokens, 1) // segment_size) + 1


def dense_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, cfg, *,
               max_query_len: int | None = None, num_tokens: int | None = None) -> CritiPrefillPlan:
    """A plan where every segment attends densely (dense layers; also a handy kernel test case)."""
    sq, bk = cfg.segment_size, cfg.block_size
    check_sizes(sq, bk, cfg.budget)
    r = seq_lens.shape[0]
    dev = seq_lens.device
    t = max_query_len if max_query_len is not None else (num_tokens if num_tokens is not None else 1)
    s_max = max_segments_bound(t, sq)
    _, _, _, _, first, nseg = _chunk_geometry(query_start_loc, seq_lens, sq)
    topk = cfg.budget // bk
    return CritiPrefillPlan(
        segment_size=sq, block_size=bk, topk=topk,
        sel_blocks=torch.full((r, s_max, num_kv_heads, cfg.selected_blocks), -1, dtype=torch.int32,
                              device=dev),
        num_sel=torch.zeros((r, s_max, num_kv_heads), dtype=torch.int32, device=dev),
        dense=torch.ones((r, s_max), dtype=torch.bool, device=dev),
        first_segment=first.to(torch.int32), num_segments=nseg.to(torch.int32), all_dense=True)


def segment_query_representatives(query: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                  segment_size: int, max_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Qmax, Qmin`` fp32 ``[R, S, Hq, D]`` of each request's chunk segments (0 on padding rows)."""
    reps = query_segment_representatives(query, query_start_loc, seq_lens, segment_size, max_segments)
    return reps[0], reps[1]


def build_plan(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, cfg, *,
               layer_idx: int, fusion: LayerFusion | None = None,
               prompt_lens: torch.Tensor | None = None, max_seq_len: int | None = None,
               max_query_len: int | None = None, keep_scores: bool = False,
               key_reps: torch.Tensor | None = None,
               query_reps: tuple[torch.Tensor, torch.Tensor] | None = None,
               row_dense: torch.Tensor | None = None) -> CritiPrefillPlan:
    """Score and select key blocks for every (request, segment, KV head) of this batch of chunks.

    ``query`` ``[T, Hq, D]`` (RoPE applied), ``kv_cache`` ``[pages, Hkv, page, 2D]`` (any strides),
    ``block_table`` int32 ``[R, max_pages]``, ``query_start_loc`` int ``[R + 1]``, ``seq_lens`` int ``[R]``
    (device tensors). ``cfg``: a ``CritiPrefillConfig``. ``fusion``: the forward pass's
    :class:`LayerFusion` (``None`` = no layer fusion). ``prompt_lens`` ``[R]``: full prompt lengths (for
    the final segment); default ``seq_lens`` (this chunk ends the prompt).
    ``max_seq_len``/``max_query_len``: host bounds (vLLM's metadata has them); without them the
    bounds come from the tensor shapes. Layers in ``cfg.dense_layers`` give :func:`dense_plan`
    without touching the fusion state.

    The backend passes what it keeps itself (``vllm_ext.methods.critiprefill.path``): ``key_reps``
    ``[R, 2, NB, Hkv, D]`` (any float dtype; max, min per criticality block, e.g. a view of its
    persistent per-request table) instead of reading them from the paged cache; ``query_reps``
    ``(Qmax, Qmin)`` each ``[R, S, Hq, D]`` fp32 with ``S = max_segments_bound(max_query_len)``;
    ``row_dense`` bool ``[R]``: rows that attend densely whatever their prompt (rows the host did
    not give to CritiPrefill this step).
    """
    sq, bk = cfg.segment_size, cfg.block_size
    check_sizes(sq, bk, cfg.budget)
    hkv = kv_cache.shape[1]
    t = query.shape[0]
    qlen_bound = min(max_query_len, t) if max_query_len is not None else t
    if layer_idx in tuple(cfg.dense_layers):
        return dense_plan(query_start_loc, seq_lens, hkv, cfg, max_query_len=qlen_bound)

    r = seq_lens.shape[0]
    dev = query.device
    s_max = max_segments_bound(qlen_bound, sq)
    if key_reps is not None:
        nb = key_reps.shape[2]
    else:
        if max_seq_len is None:
            max_seq_len = block_table.shape[1] * kv_cache.shape[2]
        nb = max(1, -(-max_seq_len // bk))
    topk = cfg.budget // bk

    qsl, seq, q_lens, ctx, first, nseg = _chunk_geometry(query_start_loc, seq_lens, sq)
    if query_reps is not None:
        qmax, qmin = query_reps
        if qmax.shape[1] != s_max:
            raise ValueError(f"query_reps hold {qmax.shape[1]} segments per row, expected {s_max}")
    else:
        qmax, qmin = segment_query_representatives(query, query_start_loc, seq_lens, sq, s_max)
    kreps = key_reps if key_reps is not None else \
        block_representatives(kv_cache, block_table, seq_lens, bk, nb)      # [R, 2, NB, Hkv, D]
    kmax, kmin = kreps[:, 0], kreps[:, 1]

    seg_abs = first[:, None] + torch.arange(s_max, device=dev)[None, :]     # [R, S]
    seg_start_block = seg_abs * (sq // bk)
    scores = torch.empty((r, s_max, hkv, nb), dtype=torch.float32, device=dev)
    hq = query.shape[1]
    step = max(1, _SCORE_CHUNK_ELEMS // max(1, r * hq * 4 * nb))
    for s0 in range(0, s_max, step):
        s1 = min(s_max, s0 + step)
        vis = candidate_mask(seg_start_block[:, s0:s1], nb)                  # [R, C, NB]
        scores[:, s0:s1] = criticality_scores(qmax[:, s0:s1], qmin[:, s0:s1], kmax, kmin, vis, cfg.score)
    if fusion is not None:
        scores = fusion(scores)

    sel = select_blocks(scores, seg_start_block, topk, sink=cfg.sink_block)  # [R, S, Hkv, topk + sink]
    row_ok = torch.arange(s_max, device=dev)[None, :] < nseg[:, None]       # [R, S] rows of this chunk
    sel = torch.where(row_ok[:, :, None, None], sel, -1)
    num_sel = (sel >= 0).sum(dim=-1).to(torch.int32)
    plen = seq if prompt_lens is None else prompt_lens.to(dev).long()
    dense = dense_segments(seg_abs, plen[:, None], cfg)
    if row_dense is not None:
        dense = dense | row_dense.to(dev, torch.bool)[:, None]
    dense = dense & row_ok
    return CritiPrefillPlan(
        segment_size=sq, block_size=bk, topk=topk, sel_blocks=sel, num_sel=num_sel, dense=dense,
        first_segment=first.to(torch.int32), num_segments=nseg.to(torch.int32), all_dense=False,
        scores=scores if keep_scores else None)
