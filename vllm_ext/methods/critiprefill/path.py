"""CritiPrefill as the backend runs it: one sparse layer of one step's CritiPrefill sub-batch
(ALGORITHMS.md §3; the rows and their host plan: :mod:`vllm_ext.methods.critiprefill.slots`). Torch-level
orchestration of the kernels (Triton on CUDA, compiled C++ on the CPU build); no vLLM import.

Per sparse layer, after the chunk's K/V are in the paged cache:
1. key-block representatives: the blocks this chunk wrote (from the block holding its first
   position, or from where the request's state stopped) are recomputed from the paged cache into
   the request's state pages (:func:`update_block_representatives_paged`); earlier blocks are kept;
2. query-segment representatives of the chunk; a segment that continues one cut by the previous
   chunk is merged with the carried representatives of its earlier part, and the chunk's last
   segment is carried onwards (state pages, per request and layer);
3. scores, layer fusion with the previous sparse layer of the same step (the step keeps that
   layer's fused scores: fusion never spans steps, so it is no per-request state), selection
   (:func:`vllm_ext.methods.critiprefill.plan.build_plan`);
4. block-sparse attention of the sub-batch, dense segments included: on the CPU build
   ``CPU_ATTN``'s own kernel over the pages in place and a scratch copy of the sparse segments' keys
   (:mod:`vllm_ext.methods.critiprefill.cpu_attn_prefill`), where that does not apply the compiled
   pass (:func:`block_sparse_prefill_cpu`; logged once, counted ``fallback.critiprefill_cpu_attn``),
   else :func:`block_sparse_prefill` (Triton, or the PyTorch twin where the compiled pass does not
   apply either: logged once, counted ``fallback.critiprefill_cpu_native``);
5. device counters: sparse segments, candidate and selected key blocks.

Memory: none of its own. A request's state lives in pages of CritiPrefill's KV-cache group, which
vLLM allocates (``vllm_ext.methods.critiprefill.kv_spec``; layout: ``vllm_ext.methods.critiprefill.state_layout``):
``state_cache`` is the layer's state cache (``[pages, Hkv, page, 2D]``, the attention layer's page
format) and ``state_table`` the sub-batch's block-table rows of its group. A row that does not hold
its pages (``step.holds_state`` 0) is dense and writes nothing.
"""

from __future__ import annotations

import torch

from vllm_ext import metrics
from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.critiprefill.criticality import fuse_scores
from vllm_ext.methods.critiprefill.plan import build_plan, max_segments_bound
from vllm_ext.methods.critiprefill.slots import (STAT_BLOCKS_CANDIDATE, STAT_BLOCKS_SELECTED,
                                         STAT_SPARSE_SEGMENTS, CritiPrefillStep)
from vllm_ext.methods.critiprefill.state_layout import carry_entries
from vllm_ext.kernels import kv_quant
from vllm_ext.kernels.block_representatives import query_segment_representatives
from vllm_ext.kernels.block_sparse_prefill import block_sparse_prefill, block_sparse_prefill_cpu
from vllm_ext.kernels.triton_utils import use_triton
from vllm_ext.kernels.paged_state import (read_state_entries, update_block_representatives_paged,
                                          write_state_entries)


class StepFusion:
    """Layer fusion within one step (the protocol of :class:`vllm_ext.methods.critiprefill.LayerFusion`:
    ``fused = fusion(scores)``): the step's first sparse layer keeps its scores, each later one fuses
    with the previous layer's."""

    def __init__(self, step: CritiPrefillStep, cfg: CritiPrefillConfig):
        self.step = step
        self.cfg = cfg

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        prev = self.step.fused_scores
        fused = s if prev is None or prev.shape != s.shape else \
            fuse_scores(s, prev, self.cfg.fusion, self.cfg.alpha)
        self.step.fused_scores = fused
        return fused


def _carry_to_entries(last: torch.Tensor, hkv: int, query_dtype: torch.dtype, entry_bytes: int) -> torch.Tensor:
    """``[2, R, Hq, D]`` (max, min) -> the carry's state entries as bytes ``[R, C, Hkv, entry_bytes]``
    (``state_layout``: query head ``h*G + g`` in entries ``g*m .. g*m + m - 1`` of KV head ``h``, the
    bytes of its max then its min in ``query_dtype``, zero-padded to ``m`` entries)."""
    _, r, hq, d = last.shape
    g = hq // hkv
    x = last.to(query_dtype).view(2, r, hkv, g, d).permute(1, 3, 2, 0, 4).reshape(r, g, hkv, 2 * d)
    b = x.contiguous().view(torch.uint8)                                   # [R, G, Hkv, 2D * itemsize]
    m = -(-b.shape[-1] // entry_bytes)
    if m * entry_bytes != b.shape[-1]:
        b = torch.nn.functional.pad(b, (0, m * entry_bytes - b.shape[-1]))
    return b.view(r, g, hkv, m, entry_bytes).permute(0, 1, 3, 2, 4).reshape(r, g * m, hkv, entry_bytes)


def _entries_to_carry(x: torch.Tensor, g: int, query_dtype: torch.dtype, d: int) -> torch.Tensor:
    """The inverse: byte entries ``[R, C, Hkv, entry_bytes]`` -> ``[R, 2, Hq, D]`` fp32."""
    r, c, hkv, e = x.shape
    m = c // g
    b = x.view(r, g, m, hkv, e).permute(0, 1, 3, 2, 4).reshape(r, g, hkv, m * e)
    vals = b[..., :2 * d * query_dtype.itemsize].contiguous().view(query_dtype)      # [R, G, Hkv, 2D]
    return vals.view(r, g, hkv, 2, d).permute(0, 3, 2, 1, 4).reshape(r, 2, hkv * g, d).float()


def _through_cpu_attn(q, pages, bt, qsl, seq, plan, scale, out, scales) -> bool:
    """The CPU build's route: every segment in ``CPU_ATTN``'s own kernel
    (:mod:`vllm_ext.methods.critiprefill.cpu_attn_prefill`). Where it does not apply to ``CPU_ATTN``'s
    packed pages the compiled pass attends instead (logged once, counted
    ``fallback.critiprefill_cpu_attn``); other page formats are already counted where they are chosen."""
    from vllm_ext.kernels.packed_pages import PackedPages
    from vllm_ext.methods.critiprefill.cpu_attn_prefill import attend_segments

    if attend_segments(q, pages, bt, qsl, seq, plan, scale, output=out, **scales):
        return True
    if isinstance(pages, PackedPages):
        metrics.fallback("critiprefill_cpu_attn", "CritiPrefill's segments do not fit CPU_ATTN's kernel here "
                         "(page size %d, criticality block %d, ISA %s, or KV heads selecting different numbers "
                         "of blocks): the compiled block-sparse pass attends them (slower, same outputs)",
                         pages.shape[2], plan.block_size, pages.isa)
    return False


def critiprefill_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         step: CritiPrefillStep, cfg: CritiPrefillConfig, state_cache: torch.Tensor,
                         state_table: torch.Tensor, layer_index: int, scale: float, output: torch.Tensor,
                         stats: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's CritiPrefill sub-batch in one sparse layer (see the module doc).

    ``query``/``output``: the step's ``[T, Hq, D]`` (the sub-batch's token rows are written);
    ``block_table``: the step's ``[R, pages]``; the sub-batch's K/V are already in ``kv_cache``;
    ``state_cache``/``state_table``: this layer's state pages (in the pages' dtype: an fp8 cache's
    view) and the sub-batch's rows of them. ``k_scale`` / ``v_scale``: the layer's per-tensor scales
    of fp8 pages (``None``: 1): the key-block representatives are kept in the pages' stored units
    (exact) and scaled where they are scored; the attention folds both in.
    """
    sq, bk = cfg.segment_size, cfg.block_size
    t0, t1 = step.token_start, step.token_end
    q = query[t0:t1]
    out = output[t0:t1]
    bt = block_table[step.first_row:step.num_reqs]
    qsl, seq = step.query_start_loc, step.seq_lens
    hkv, d = kv_cache.shape[1], kv_cache.shape[-1] // 2
    g = q.shape[1] // hkv
    c = carry_entries(q.shape[1], hkv, q.element_size(), state_cache.element_size())
    state_bytes = state_cache.view(torch.uint8)                            # the carry's view
    # 1. the blocks this chunk wrote (and any not kept yet), into the request's state pages
    update_block_representatives_paged(kv_cache, bt, step.rep_seq, step.update_first, bk,
                                       step.max_update_blocks, state_cache, state_table, c)
    # 2. query segments, merged with the carried part of a cut segment; the last one carried on
    n_seg = max_segments_bound(step.max_query_len, sq)
    qreps = query_segment_representatives(q, qsl, seq, sq, n_seg)          # [2, R, S, Hq, D]
    carry = _entries_to_carry(read_state_entries(state_bytes, state_table, 0, c), g, q.dtype, d)   # [R, 2, Hq, D]
    valid = step.carry_valid[:, None, None]
    qreps[0, :, 0] = torch.where(valid, torch.maximum(qreps[0, :, 0], carry[:, 0]), qreps[0, :, 0])
    qreps[1, :, 0] = torch.where(valid, torch.minimum(qreps[1, :, 0], carry[:, 1]), qreps[1, :, 0])
    rows = torch.arange(step.rows, device=q.device)
    last = qreps[:, rows, step.last_segment]                               # [2, R, Hq, D]
    write_state_entries(state_bytes, state_table, torch.zeros_like(step.holds_state),
                        step.holds_state * c, _carry_to_entries(last, hkv, q.dtype, state_bytes.shape[-1]))
    # 3. scores, fusion, selection
    nb = -(-step.max_seq_len // bk)
    key_reps = kv_quant.dequantize(read_state_entries(state_cache, state_table, c, nb),
                                   kv_quant.twin_scale(state_cache.dtype, k_scale))   # [R, NB, Hkv, 2D] fp32
    # blocks the row keeps no representative for (past its chunk, or a row without pages) read as
    # 0, never as whatever a page held before: they are never candidates, but 0 * NaN is NaN
    kept = torch.arange(nb, device=q.device)[None, :] * bk < (step.rep_seq * step.holds_state)[:, None]
    key_reps = torch.where(kept[:, :, None, None], key_reps, 0)
    key_reps = key_reps.view(step.rows, nb, hkv, 2, d).permute(0, 3, 1, 2, 4)   # [R, 2, NB, Hkv, D]
    plan = build_plan(q, kv_cache, bt, qsl, seq, cfg, layer_idx=layer_index, fusion=StepFusion(step, cfg),
                      prompt_lens=step.prompt_lens, max_seq_len=step.max_seq_len,
                      max_query_len=step.max_query_len, key_reps=key_reps,
                      query_reps=(qreps[0], qreps[1]), row_dense=step.row_dense)
    # 4. attention
    on_cpu = q.device.type == "cpu" and not use_triton(q)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    done = on_cpu and (_through_cpu_attn(q, kv_cache, bt, qsl, seq, plan, scale, out, scales)
                       or block_sparse_prefill_cpu(q, kv_cache, bt, qsl, seq, plan, scale, output=out, **scales))
    if not done:
        if on_cpu:
            from vllm_ext.kernels import cpu_native

            metrics.fallback("critiprefill_cpu_native", "CritiPrefill's compiled CPU prefill does not apply "
                             "(%s; query %s, cache %s): the PyTorch twin attends its segments (slower, same "
                             "outputs)", cpu_native.unavailable_reason() or "dtype, head size or page layout",
                             q.dtype, getattr(kv_cache, "dtype", None))
        block_sparse_prefill(q, kv_cache, bt, qsl, seq, plan, scale, output=out, **scales)
    # 5. counters (device): sparse segments that read fewer blocks than precede them, their blocks
    if stats is not None:
        seg_abs = plan.first_segment.long()[:, None] + torch.arange(plan.max_segments, device=q.device)
        sb = seg_abs * (sq // bk)                                          # candidate blocks
        live = torch.arange(plan.max_segments, device=q.device)[None, :] < plan.num_segments[:, None]
        sparse = live & ~plan.dense & (sb > cfg.selected_blocks)
        hkv = plan.num_sel.shape[-1]
        stats[STAT_SPARSE_SEGMENTS] += sparse.sum() * hkv
        stats[STAT_BLOCKS_CANDIDATE] += (sb * sparse).sum() * hkv
        stats[STAT_BLOCKS_SELECTED] += (plan.num_sel * sparse[..., None]).sum()
    return output
