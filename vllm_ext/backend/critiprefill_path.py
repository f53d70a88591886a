"""CritiPrefill as the backend runs it: one sparse layer of one step's CritiPrefill sub-batch
(ALGORITHMS.md §3; the rows and their host plan: :mod:`vllm_ext.critiprefill.slots`). Torch-level
orchestration of the kernels (Triton on CUDA, PyTorch twins elsewhere); no vLLM import.

Per sparse layer, after the chunk's K/V are in the paged cache:
1. key-block representatives: the blocks this chunk wrote (from the block holding its first
   position, or from where the request's table stopped) are recomputed from the paged cache into the
   request's persistent table (:func:`update_block_representatives`); earlier blocks are kept;
2. query-segment representatives of the chunk; a segment that continues one cut by the previous
   chunk is merged with the carried representatives of its earlier part, and the chunk's last
   segment is carried onwards (per request and layer);
3. scores, layer fusion with the previous sparse layer of the same step (state per request, in a
   persistent buffer, reset at the first sparse layer of each step), selection
   (:func:`vllm_ext.critiprefill.plan.build_plan`);
4. block-sparse attention of the sub-batch (:func:`block_sparse_prefill`), dense segments included;
5. device counters: sparse segments, candidate and selected key blocks.

Memory (allocated before vLLM profiles memory, logged; ``C = critiprefill.max_requests``):
- per sparse layer: key representatives ``(C + 1) x 2 x ceil(max_model_len / Bk) x Hkv x D`` in
  the KV dtype (a max or min of cache values is exact in it) and the query carry
  ``(C + 1) x 2 x Hq x D`` fp32;
- shared: fused scores ``(C + 1) x S x Hkv x ceil(max_model_len / Bk)`` fp32,
  ``S = ceil(max_num_batched_tokens / Sq) + 1``. Slot ``C`` is the scratch of rows without a slot.
"""

from __future__ import annotations

import torch

from vllm_ext.config import CritiPrefillConfig
from vllm_ext.critiprefill.criticality import fuse_scores
from vllm_ext.critiprefill.plan import build_plan, max_segments_bound
from vllm_ext.critiprefill.slots import (STAT_BLOCKS_CANDIDATE, STAT_BLOCKS_SELECTED,
                                         STAT_SPARSE_SEGMENTS, CritiPrefillStep)
from vllm_ext.kernels.block_representatives import (query_segment_representatives,
                                                    update_block_representatives)
from vllm_ext.kernels.block_sparse_prefill import block_sparse_prefill


def _num_blocks(max_len: int, cfg: CritiPrefillConfig) -> int:
    return -(-max_len // cfg.block_size)


class CritiPrefillLayerBuffers:
    """One sparse layer's per-request tables: key-block representatives and the query carry."""

    def __init__(self, capacity: int, num_heads: int, num_kv_heads: int, head_size: int, max_len: int,
                 cfg: CritiPrefillConfig, dtype: torch.dtype, device: torch.device):
        nb = _num_blocks(max_len, cfg)
        self.key_reps = torch.zeros(capacity + 1, 2, nb, num_kv_heads, head_size, dtype=dtype, device=device)
        self.query_carry = torch.zeros(capacity + 1, 2, num_heads, head_size, dtype=torch.float32,
                                       device=device)

    @staticmethod
    def nbytes(capacity: int, num_heads: int, num_kv_heads: int, head_size: int, max_len: int,
               cfg: CritiPrefillConfig, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        nb = _num_blocks(max_len, cfg)
        return (capacity + 1) * 2 * head_size * (nb * num_kv_heads * elem + num_heads * 4)


class CritiPrefillRuntime:
    """What the sparse layers of a device share: the fused scores of layer fusion."""

    def __init__(self, cfg: CritiPrefillConfig, *, capacity: int, num_kv_heads: int, max_len: int,
                 max_num_batched_tokens: int, device: torch.device):
        self.cfg = cfg
        self.capacity = capacity
        self.max_segments = max_segments_bound(max_num_batched_tokens, cfg.segment_size)
        self.fused = torch.zeros(capacity + 1, self.max_segments, num_kv_heads, _num_blocks(max_len, cfg),
                                 dtype=torch.float32, device=device)
        self._fusion_step = None        # the step whose sparse layer stored the fused scores last
        self._fusion_shape = None

    @property
    def nbytes(self) -> int:
        return self.fused.numel() * 4

    def describe(self) -> str:
        c1, s, hkv, nb = self.fused.shape
        return (f"CritiPrefill fused scores {self.nbytes / 2**20:.1f} MiB = (C {self.capacity} + 1) x "
                f"S {s} x Hkv {hkv} x NB {nb} x 4 B (C = critiprefill.max_requests)")

    def fusion(self, step: CritiPrefillStep) -> "SlotFusion":
        return SlotFusion(self, step)


class SlotFusion:
    """Layer fusion over the persistent fused scores, rows addressed by their CritiPrefill slot
    (the protocol of :class:`vllm_ext.critiprefill.LayerFusion`: ``fused = fusion(scores)``)."""

    def __init__(self, rt: CritiPrefillRuntime, step: CritiPrefillStep):
        self.rt = rt
        self.step = step

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        rt, cfg = self.rt, self.rt.cfg
        _, n_seg, _, nb = s.shape
        if n_seg > rt.fused.shape[1] or nb > rt.fused.shape[3]:
            raise RuntimeError(f"vllm_ext: CritiPrefill scores [{n_seg} segments, {nb} blocks] exceed the "
                               f"fusion buffer {tuple(rt.fused.shape[1::2])}")
        view = rt.fused[:, :n_seg, :, :nb]
        slot = self.step.rep_slot.long()
        if rt._fusion_step is self.step and rt._fusion_shape == (n_seg, nb):
            fused = fuse_scores(s, view[slot], cfg.fusion, cfg.alpha)
        else:
            fused = s                                   # the step's first sparse layer
        view.index_copy_(0, slot, fused)
        rt._fusion_step, rt._fusion_shape = self.step, (n_seg, nb)
        return fused


def critiprefill_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         step: CritiPrefillStep, cfg: CritiPrefillConfig, layer: CritiPrefillLayerBuffers,
                         rt: CritiPrefillRuntime, layer_index: int, scale: float, output: torch.Tensor,
                         stats: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's CritiPrefill sub-batch in one sparse layer (see the module doc).

    ``query``/``output``: the step's ``[T, Hq, D]`` (the sub-batch's token rows are written);
    ``block_table``: the step's ``[R, pages]``; the sub-batch's K/V are already in ``kv_cache``.
    """
    sq, bk = cfg.segment_size, cfg.block_size
    t0, t1 = step.token_start, step.token_end
    q = query[t0:t1]
    out = output[t0:t1]
    bt = block_table[step.first_row:step.num_reqs]
    qsl, seq = step.query_start_loc, step.seq_lens
    slot = step.rep_slot
    # 1. the blocks this chunk wrote (and any not kept yet), into the request's table
    update_block_representatives(kv_cache, bt, seq, step.update_first, bk, step.max_update_blocks,
                                 layer.key_reps, slot)
    # 2. query segments, merged with the carried part of a cut segment; the last one carried on
    n_seg = max_segments_bound(step.max_query_len, sq)
    qreps = query_segment_representatives(q, qsl, seq, sq, n_seg)          # [2, R, S, Hq, D]
    carry = layer.query_carry[slot.long()]                                 # [R, 2, Hq, D]
    valid = step.carry_valid[:, None, None]
    qreps[0, :, 0] = torch.where(valid, torch.maximum(qreps[0, :, 0], carry[:, 0]), qreps[0, :, 0])
    qreps[1, :, 0] = torch.where(valid, torch.minimum(qreps[1, :, 0], carry[:, 1]), qreps[1, :, 0])
    rows = torch.arange(step.rows, device=q.device)
    last = qreps[:, rows, step.last_segment]                               # [2, R, Hq, D]
    layer.query_carry.index_copy_(0, slot.long(), last.transpose(0, 1))
    # 3. scores, fusion, selection
    nb = -(-step.max_seq_len // bk)
    key_reps = layer.key_reps[slot.long(), :, :nb]                         # [R, 2, NB, Hkv, D]
    plan = build_plan(q, kv_cache, bt, qsl, seq, cfg, layer_idx=layer_index, fusion=rt.fusion(step),
                      prompt_lens=step.prompt_lens, max_seq_len=step.max_seq_len,
                      max_query_len=step.max_query_len, key_reps=key_reps,
                      query_reps=(qreps[0], qreps[1]), row_dense=step.row_dense)
    # 4. attention
    block_sparse_prefill(q, kv_cache, bt, qsl, seq, plan, scale, output=out)
    # 5. counters (device): segments with more candidates than the budget, their blocks
    if stats is not None:
        seg_abs = plan.first_segment.long()[:, None] + torch.arange(plan.max_segments, device=q.device)
        sb = seg_abs * (sq // bk)                                          # candidate blocks
        live = torch.arange(plan.max_segments, device=q.device)[None, :] < plan.num_segments[:, None]
        sparse = live & ~plan.dense & (sb - 1 > plan.topk)
        hkv = plan.num_sel.shape[-1]
        stats[STAT_SPARSE_SEGMENTS] += sparse.sum() * hkv
        stats[STAT_BLOCKS_CANDIDATE] += (sb * sparse).sum() * hkv
        stats[STAT_BLOCKS_SELECTED] += (plan.num_sel * sparse[..., None]).sum()
    return output


_runtimes: dict[tuple, CritiPrefillRuntime] = {}


def shared_runtime(cfg: CritiPrefillConfig, *, capacity: int, num_kv_heads: int, max_len: int,
                   max_num_batched_tokens: int, device: torch.device) -> CritiPrefillRuntime:
    """One runtime per device and shape, shared by the sparse layers (allocated at the first sparse
    layer's ``process_weights_after_loading``, before vLLM profiles memory)."""
    import logging

    key = (device, cfg, capacity, num_kv_heads, max_len, max_num_batched_tokens)
    rt = _runtimes.get(key)
    if rt is None:
        _runtimes.clear()
        rt = CritiPrefillRuntime(cfg, capacity=capacity, num_kv_heads=num_kv_heads, max_len=max_len,
                                 max_num_batched_tokens=max_num_batched_tokens, device=device)
        _runtimes[key] = rt
        logging.getLogger("vllm_ext").info("vllm_ext: %s", rt.describe())
    return rt
