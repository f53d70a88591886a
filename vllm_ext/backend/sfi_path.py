"""SFI decode for one layer, as the backend runs it: slow rows refresh their compact segment, fast
rows read it, dense rows attend densely (ALGORITHMS.md §1). Torch-level orchestration of the kernels
(each dispatches to Triton on CUDA and to its PyTorch twin elsewhere); no vLLM import.

Cost follows the work:
- dense rows: one dense paged pass (split for the batch);
- fast rows: one two-segment pass (compact segment + recent window);
- slow rows: one dense pass over the compacted slow list (``S`` entries, the SFI capacity, split as
  for a single row so that one long slow row still fills the GPU) that also writes each row's
  evidence and ``||k||`` into its slot (one read of K); then maintenance (selector + gather) over the
  same list, each entry over its own allowed set. Unused entries exit at once.

On CUDA every phase is launched every step and its kernels skip masked rows on the device, so the
sequence of launches is the same whatever the rows decide: a uniform decode step is captured in a
CUDA graph once and replayed with any mix of dense / slow / fast rows. On the CPU a host check is
free and skips whole phases.
"""

from __future__ import annotations

import torch

from vllm_ext.backend.sfi_runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.config import SfiConfig
from vllm_ext.kernels.dense_decode_evidence import (dense_decode_with_evidence, paged_decode,
                                                    prefill_evidence)
from vllm_ext.kernels.gather_compact import gather_compact
from vllm_ext.kernels.sfi_selector import select
from vllm_ext.kernels.two_segment_decode import two_segment_decode
from vllm_ext.sfi.step_plan import SfiPrefillEnd, SfiStep


def _maintain(rt: SfiRuntime, cfg: SfiConfig, layer: SfiLayerBuffers, kv_cache, block_table,
              sfi_slot, seq_lens, evidence, norms, lo, hi, k, count=None) -> None:
    selected, n_sel = select(evidence, norms, lo, hi, cfg, k, k_cap=cfg.k,
                             workspace=rt.selector_workspace, count=count)
    gather_compact(kv_cache, block_table, sfi_slot, selected, n_sel, cfg.n_sink,
                   layer.compact_kv, layer.compact_len, seq_lens=seq_lens, count=count)


def sfi_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, step: SfiStep, cfg: SfiConfig, layer: SfiLayerBuffers,
               rt: SfiRuntime, layer_index: int, scale: float, out: torch.Tensor, *,
               dense_done: bool) -> torch.Tensor:
    """SFI for the decode rows ``0..R-1`` (one query each; ``query``/``out`` are ``[R, Hq, D]``).

    ``dense_done``: ``out`` already holds dense attention for every row (a mixed step, where the dense
    delegate ran first): only slow rows run the dense pass again (for their evidence), fast rows are
    overwritten. Otherwise dense and slow rows are attended here.

    The maintenance of the slow rows goes to ``rt.ring``: on CUDA with ``dual_stream`` a side stream
    overlaps it with the next layers; the compact segments it writes are read at the next step,
    after the step's join (``MaintenanceRing.join``).
    """
    rows = query.shape[0]
    on_cpu = query.device.type == "cpu"
    fast = step.row_fast[:rows]
    dense = step.row_dense[:rows]
    if not dense_done and (not on_cpu or bool(dense.any())):
        paged_decode(query, kv_cache, block_table, seq_lens, scale, out, row_mask=dense,
                     workspace=rt.dense_workspace)
    if not on_cpu or bool(fast.any()):
        two_segment_decode(query, kv_cache, block_table, seq_lens, step.recent_start[:rows],
                           layer.compact_kv, layer.compact_len, step.row_sfi_slot[:rows], scale, out,
                           row_mask=fast, max_recent=cfg.n_recent, workspace=rt.split_workspace)
    if on_cpu and not bool(step.row_slow[:rows].any()):
        return out
    # slow rows: one dense pass over the compacted list, writing their output, evidence and ||k||
    entry, scratch = rt.ring.entry(layer_index)
    dense_decode_with_evidence(query, kv_cache, block_table, seq_lens, step.allowed_lo[:rows],
                               step.allowed_hi[:rows], scale, out, scratch.log_evidence,
                               alpha=cfg.alpha, workspace=rt.dense_workspace,
                               evidence_rows=step.slow_rows, key_norms=scratch.key_norms,
                               evidence_count=step.slow_count)
    rt.ring.submit(entry, lambda: _maintain(
        rt, cfg, layer, kv_cache, step.slow_block_table, step.slow_sfi_slot, step.slow_seq,
        scratch.log_evidence, scratch.key_norms, step.slow_lo, step.slow_hi, step.slow_k,
        step.slow_count))
    return out


def sfi_prefill_end(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    plan: SfiPrefillEnd, cfg: SfiConfig, layer: SfiLayerBuffers, rt: SfiRuntime,
                    layer_index: int, scale: float) -> None:
    """The step's prompt-tail work for one layer: store the queries of prompt positions
    ``[P - w_prefill, P)`` that this step computes (whatever chunk they fall in), then make the
    first selection of the requests whose prefill ends in this step from their stored window
    (:mod:`vllm_ext.sfi.prompt_tail`). The K/V of this step must already be in the cache. Runs eagerly
    (prefill is never captured); at most ``S`` requests end (each holds a compact slot)."""
    tail = layer.prompt_tail
    tail.write(query, plan)
    n = plan.num_ends
    if n == 0:
        return
    queries = tail.gather(plan)                                            # [n, W, Hq, D]
    tables = block_table[plan.rows]
    entry, scratch = rt.ring.entry(layer_index)
    evidence, norms = scratch.log_evidence[:n], scratch.key_norms[:n]
    # one request at a time: the shapes (and so the reduction orders) of a request's evidence never
    # depend on how many other prefills end in the same step
    for i in range(n):
        e = slice(i, i + 1)
        prefill_evidence(queries[e], kv_cache, tables[e], plan.seq_lens[e], plan.allowed_lo[e],
                         plan.allowed_hi[e], scale, evidence[e], plan.positions[e],
                         alpha=cfg.alpha, key_norms=norms[e])
    rt.ring.submit(entry, lambda: _maintain(
        rt, cfg, layer, kv_cache, tables, plan.sfi_slot, plan.seq_lens, evidence, norms,
        plan.allowed_lo, plan.allowed_hi, plan.k))
