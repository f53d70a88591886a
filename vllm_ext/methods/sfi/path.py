"""SFI decode for one layer, as the backend runs it: slow rows refresh their compact segment, fast
rows read it, dense rows attend densely (ALGORITHMS.md §1). Torch-level orchestration of the kernels
(each dispatches to Triton on CUDA and to its PyTorch twin elsewhere); no vLLM import.

Cost follows the work:
- dense rows: one dense paged pass (split for the batch);
- fast rows: one two-segment pass (compact segment + recent window);
- slow rows: the compacted slow list in chunks of ``B`` entries (``sfi.maintenance_rows``: the rows
  the runtime's scratch holds); per chunk, one dense pass (split as for a single row so that one
  long slow row still fills the GPU) that also writes each row's evidence and ``||k||`` into the
  chunk's ring slot (one read of K), then maintenance (selector + gather) over the same entries, each
  over its own allowed set. Every chunk runs inside the step (a request's schedule never depends on
  other traffic). Unused entries exit at once.

On CUDA every phase is launched every step and its kernels skip masked rows on the device, so the
sequence of launches is the same whatever the rows decide: a uniform decode step is captured in a
CUDA graph once and replayed with any mix of dense / slow / fast rows. The slow pass launches
``ceil(min(R, S) / B)`` chunks, a host value from the step's row count ``R`` (fixed for a captured
graph); chunks past the live count exit on the device. On the CPU a host check is free and skips
whole phases and empty chunks.

Each entry's evidence, selection and gather are computed by itself (per-entry programs, the
single-row split count), so the results do not depend on ``B`` or on which chunk an entry falls in.

fp8 pages (``vllm_ext.kernels.kv_quant``): ``kv_cache`` is the fp8 view, the compact segment and
Quest's page bounds are views of their groups in the same dtype (stored units: the gather and the
bounds copy or compare stored values), and every read of K takes the layer's ``k_scale``, every
read of V its ``v_scale``.
"""

from __future__ import annotations

import torch

from vllm_ext import metrics
from vllm_ext.methods.sfi.runtime import SfiLayerBuffers, SfiRuntime
from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.dense_decode_evidence import (dense_decode_with_evidence, paged_decode,
                                                    prefill_evidence)
from vllm_ext.kernels.paged_state import (update_block_representatives_paged,
                                          update_block_representatives_paged_from)
from vllm_ext.kernels.gather_compact import gather_compact
from vllm_ext.kernels.quest_pages import quest_page_evidence
from vllm_ext.kernels.quest_rerank import quest_candidate_evidence
from vllm_ext.kernels.selector_params import SelectorParams, output_width
from vllm_ext.kernels.sfi_selector import select
from vllm_ext.kernels.triton_utils import use_triton
from vllm_ext.kernels.two_segment_decode import two_segment_decode
from vllm_ext.methods.sfi.step_plan import SfiPrefillEnd, SfiStep


def _chunks(step: SfiStep, rt: SfiRuntime, rows: int, on_cpu: bool) -> int:
    """The chunks of the slow list this step runs: ``ceil(min(R, S) / B)`` on CUDA (fixed by the row
    count, so a captured graph replays any step); on the CPU only the non-empty ones."""
    b = rt.maintenance_rows
    if step.chunk_rows != b:
        raise RuntimeError(f"SPEEDSFI: the step plan's maintenance chunk ({step.chunk_rows} slow rows) "
                           f"differs from the runtime's ({b}): both come from sfi.maintenance_rows")
    if on_cpu:
        return -(-int(step.slow_count.reshape(-1)[0]) // b)
    return min(rt.chunks(rows), step.slow_chunk_count.shape[0])


def _chunk_of(step: SfiStep, c: int, b: int):
    """Chunk ``c``'s entries ``[c*B, (c+1)*B)`` (views of the plan) and its live count."""
    e = slice(c * b, (c + 1) * b)
    return e, step.slow_chunk_count[c, :1]


def _at(t: torch.Tensor | None, e: slice) -> torch.Tensor | None:
    return None if t is None else t[e]


def _same_table(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _slow_tables(step: SfiStep, block_table: torch.Tensor, e: slice, scratch, rt: SfiRuntime):
    """The block-table rows of chunk ``e``'s slow entries, in this layer's own KV-cache group.

    The plan gathers them once per step from the step's first attention group. vLLM gives each
    group its own block ids, and it splits the attention layers into several groups when another
    spec has fewer layers (SPEED's upper layers: 27 lower + 9 upper layers of a 36-layer model make
    three groups of nine), so a layer whose table is not the plan's gathers its own rows into the
    ring slot's persistent buffer (the side stream reads them). The choice is a host fact fixed for
    a layer (the tables are persistent buffers), so a captured graph replays it."""
    src = step.slow_table_source
    if step.slow_block_table is None or src is None or _same_table(block_table, src):
        return _at(step.slow_block_table, e)
    rows = rt.slow_rows_in_range[:e.stop - e.start]
    torch.clamp(step.slow_rows[e], min=0, out=rows)        # unused entries (-1) read row 0, unused
    tables, persistent = scratch.block_tables(block_table, rows, rows.shape[0])
    if not persistent:
        rt.ring.keep(tables)
    return tables


def _maintain(rt: SfiRuntime, cfg: SfiConfig, layer: SfiLayerBuffers, kv_cache, block_table,
              sfi_slot, seq_lens, evidence, norms, lo, hi, k, count=None, kept=None,
              rest_cfg: SelectorParams | None = None) -> None:
    """Selector + gather of the rows ``[0, count)``. ``kept`` (``sfi.keep_prefill``, int32 per row):
    the tokens each row's prefill-end selection keeps (compact entries after the sink, positions in
    ``layer.kept_pos`` of its slot); the row then selects ``k`` more among the other positions (``k``
    is the rest of its budget) with ``rest_cfg`` (default: the decode-time selector's,
    ``rt.rest_select_cfg``), and the gather writes them after the kept ones."""
    if kept is None:
        selected, n_sel = select(evidence, norms, lo, hi, rt.select_cfg, k, k_cap=cfg.k,
                                 workspace=rt.selector_workspace, count=count)
        gather_compact(kv_cache, block_table, sfi_slot, selected, n_sel, cfg.n_sink,
                       layer.compact_kv, layer.compact_len, seq_lens=seq_lens, count=count,
                       compact_table=layer.compact_table)
        return
    selected, n_sel = select(evidence, norms, lo, hi, rest_cfg or rt.rest_select_cfg, k, k_cap=cfg.k,
                             workspace=rt.selector_workspace, count=count, exclude=layer.kept_pos,
                             exclude_slot=sfi_slot, exclude_count=kept)
    gather_compact(kv_cache, block_table, sfi_slot, selected, n_sel, cfg.n_sink,
                   layer.compact_kv, layer.compact_len, seq_lens=seq_lens, count=count, offset=kept,
                   compact_table=layer.compact_table)


def _prefill_end_select(rt: SfiRuntime, cfg: SfiConfig, layer: SfiLayerBuffers, kv_cache, block_table,
                        sfi_slot, seq_lens, evidence, norms, lo, hi, k) -> None:
    """The first selection of requests whose prefill ends (eager; SFI's selector in either mode). With
    ``sfi.keep_prefill`` its best ``min(keep_prefill, k)`` tokens are kept for the whole decode
    (``layer.kept_pos`` and the compact entries after the sink) and the rest of the budget is selected
    from the same scores: the union is the top-``k``, as without keeping."""
    if not cfg.keep_prefill:
        _maintain(rt, cfg, layer, kv_cache, block_table, sfi_slot, seq_lens, evidence, norms, lo, hi, k)
        return
    kept_sel, n_kept = select(evidence, norms, lo, hi, rt.kept_select_cfg, k.clamp(max=cfg.keep_prefill),
                              k_cap=cfg.k, workspace=rt.selector_workspace)
    n_kept = n_kept.clone()
    layer.kept_pos.index_copy_(0, sfi_slot.long(), kept_sel[:, :, :cfg.keep_prefill])
    gather_compact(kv_cache, block_table, sfi_slot, kept_sel, n_kept, cfg.n_sink, layer.compact_kv,
                   layer.compact_len, seq_lens=seq_lens, compact_table=layer.compact_table)
    # the rest from the same (SFI) evidence, also in quest mode: its pages replace it at the first
    # decode selection
    _maintain(rt, cfg, layer, kv_cache, block_table, sfi_slot, seq_lens, evidence, norms, lo, hi,
              (k - n_kept).clamp_min(0), kept=n_kept, rest_cfg=rt.kept_select_cfg)


def sfi_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, step: SfiStep, cfg: SfiConfig, layer: SfiLayerBuffers,
               rt: SfiRuntime, layer_index: int, scale: float, out: torch.Tensor, *,
               dense_done: bool, slow_done: bool = False,
               fixed_launches: bool | None = None, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """SFI for the decode rows ``0..R-1`` (one query each; ``query``/``out`` are ``[R, Hq, D]``).

    ``dense_done``: ``out`` already holds dense attention for the dense rows (the dense path ran
    first: on CUDA a mixed step's delegate, which computed every row; on the CPU the dense rows):
    slow rows run the dense pass (for their evidence), fast rows are written by the
    two-segment pass. Otherwise dense and slow rows are attended here. ``slow_done`` (the CPU
    build with the PyTorch twins): the slow rows' output is the dense path's too, and their pass
    computes only their evidence and key norms (in the twin, V's gather and ``p @ V`` cost as much
    as ``CPU_ATTN``'s attention).

    The maintenance of the slow rows goes to ``rt.ring``: on CUDA with ``dual_stream`` a side stream
    overlaps it with the next layers; the compact segments it writes are read at the next step,
    after the step's join (``MaintenanceRing.join``).

    ``fixed_launches`` (default: on CUDA): every phase launches whatever the rows decide, so one
    captured graph replays any step; otherwise (the CPU) a host check skips an empty phase. The
    start-up warm-up and the launch tests ask for the CUDA sequence on any device.

    ``k_scale`` / ``v_scale``: the layer's per-tensor scales of fp8 pages (``None``: 1).
    """
    if cfg.selector == "quest":
        return _quest_decode(query, kv_cache, block_table, seq_lens, step, cfg, layer, rt,
                             layer_index, scale, out, dense_done=dense_done,
                             fixed_launches=fixed_launches, k_scale=k_scale, v_scale=v_scale)
    rows = query.shape[0]
    on_cpu = query.device.type == "cpu" if fixed_launches is None else not fixed_launches
    fast = step.row_fast[:rows]
    dense = step.row_dense[:rows]
    if not dense_done and (not on_cpu or bool(dense.any())):
        paged_decode(query, kv_cache, block_table, seq_lens, scale, out, row_mask=dense,
                     workspace=rt.dense_workspace, k_scale=k_scale, v_scale=v_scale)
    if not on_cpu or bool(fast.any()):
        two_segment_decode(query, kv_cache, block_table, seq_lens, step.recent_start[:rows],
                           layer.compact_kv, layer.compact_len, step.row_sfi_slot[:rows], scale, out,
                           row_mask=fast, max_recent=cfg.n_recent, workspace=rt.split_workspace,
                           compact_table=layer.compact_table, k_scale=k_scale, v_scale=v_scale)
    if on_cpu and not bool(step.row_slow[:rows].any()):
        return out
    if on_cpu and _slow_rows_compiled(query, kv_cache, block_table, seq_lens, step, cfg, layer, rt, scale,
                                      None if slow_done else out, k_scale, v_scale):
        return out
    # slow rows, chunk by chunk: a dense pass over the chunk's entries, writing their output (unless
    # the dense path did), evidence and ||k|| into the chunk's ring slot; then its maintenance
    b = rt.maintenance_rows
    for c in range(_chunks(step, rt, rows, on_cpu)):
        e, count = _chunk_of(step, c, b)
        entry, scratch = rt.ring.entry()
        dense_decode_with_evidence(query, kv_cache, block_table, seq_lens, step.allowed_lo[:rows],
                                   step.allowed_hi[:rows], scale, None if slow_done else out,
                                   scratch.log_evidence,
                                   alpha=cfg.alpha, workspace=rt.dense_workspace,
                                   evidence_rows=step.slow_rows[e], key_norms=scratch.key_norms,
                                   evidence_count=count, k_scale=k_scale, v_scale=v_scale)
        tables = _slow_tables(step, block_table, e, scratch, rt)
        rt.ring.submit(entry, lambda e=e, count=count, scratch=scratch, tables=tables: _maintain(
            rt, cfg, layer, kv_cache, tables, step.slow_sfi_slot[e],
            step.slow_seq[e], scratch.log_evidence, scratch.key_norms, step.slow_lo[e],
            step.slow_hi[e], step.slow_k[e], count,
            kept=step.slow_kept[e] if cfg.keep_prefill else None))
    return out


def _slow_rows_compiled(query, kv_cache, block_table, seq_lens, step: SfiStep, cfg: SfiConfig,
                        layer: SfiLayerBuffers, rt: SfiRuntime, scale: float, out, k_scale, v_scale) -> bool:
    """The CPU build's slow step of this layer in one compiled call over every live slow entry
    (:func:`vllm_ext.kernels.cpu_native.slow_rows`: the dense pass with evidence, the selector and the
    gather of the chunk loop below, the same values, no Python between them). False where it does not
    apply (not ``CPU_ATTN``'s packed pages, no compiled kernels: the loop runs the twins, as chosen and
    counted at start-up); a refusal on packed pages with the kernels there is logged once and counted
    (``fallback.sfi_slow_rows_cpu``) and the loop runs the separate kernels."""
    from vllm_ext.kernels import cpu_native, kv_quant
    from vllm_ext.kernels.packed_pages import PackedPages

    if not isinstance(kv_cache, PackedPages) or use_triton(query) or cpu_native.library() is None:
        return False
    rows = query.shape[0]
    params = rt.rest_select_cfg if cfg.keep_prefill else rt.select_cfg
    if cpu_native.slow_rows(query, kv_cache, block_table, seq_lens, step.allowed_lo[:rows], step.allowed_hi[:rows],
                            step, int(step.slow_count.reshape(-1)[0]), out=out,
                            max_len=rt.ring.entries[0].log_evidence.shape[-1], cfg=params,
                            k_min=int(params.k_min), width=output_width(step.slow_k, params, cfg.k), scale=scale,
                            alpha=cfg.alpha, n_sink=cfg.n_sink, compact_kv=layer.compact_kv,
                            compact_table=layer.compact_table, compact_len=layer.compact_len,
                            kept=layer.kept_pos if cfg.keep_prefill else None,
                            k_scale=kv_quant.host_scale(kv_cache.dtype, k_scale),
                            v_scale=kv_quant.host_scale(kv_cache.dtype, v_scale)):
        return True
    metrics.fallback("sfi_slow_rows_cpu", "SFI's fused slow step does not take this layer's tensors "
                     "(query %s, output %s, pages %s): its slow rows run the separate compiled kernels",
                     query.dtype, None if out is None else out.dtype, kv_cache.dtype)
    return False


def sfi_prefill_end(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    plan: SfiPrefillEnd, cfg: SfiConfig, layer: SfiLayerBuffers, rt: SfiRuntime,
                    layer_index: int, scale: float, *, k_scale: torch.Tensor | None = None) -> None:
    """The step's prompt-tail work for one layer: store the queries of prompt positions
    ``[P - w_prefill, P)`` that this step computes (whatever chunk they fall in), then make the
    first selection of the requests whose prefill ends in this step from their stored window
    (:mod:`vllm_ext.methods.sfi.prompt_tail`). The K/V of this step must already be in the cache. Runs eagerly
    (prefill is never captured; the host knows the count); at most ``S`` requests end (each holds a
    compact slot), in chunks of ``B`` (the scratch's rows) as the decode slow rows. ``k_scale``: the
    layer's, of fp8 pages (the evidence reads K only)."""
    tail = layer.prompt_tail
    tail.write(query, plan)
    n = plan.num_ends
    if n == 0:
        return
    queries = tail.gather(plan)                                            # [n, W, Hq, D]
    b = rt.maintenance_rows
    for c0 in range(0, n, b):
        c1 = min(c0 + b, n)
        entry, scratch = rt.ring.entry()
        # The side stream reads these rows after this function returns: they go into the ring slot's
        # persistent buffer (free once the slot's previous chunk is done: ``entry`` waited for it),
        # never a temporary the main stream could free and reuse before the side stream has read it.
        # The plan's own tensors live in the step's metadata, released after the step's join.
        tables, persistent = scratch.block_tables(block_table, plan.rows[c0:c1], c1 - c0)
        if not persistent:
            rt.ring.keep(tables)
        evidence, norms = scratch.log_evidence[:c1 - c0], scratch.key_norms[:c1 - c0]
        # one request at a time: the shapes (and so the reduction orders) of a request's evidence
        # never depend on how many other prefills end in the same step; the work covers its prompt
        # only (covering max_model_len would cost ~1 s for an 8K prompt's end at 131K)
        for i in range(c0, c1):
            p, e = slice(i, i + 1), slice(i - c0, i - c0 + 1)
            prefill_evidence(queries[p], kv_cache, tables[e], plan.seq_lens[p], plan.allowed_lo[p],
                             plan.allowed_hi[p], scale, evidence[e], plan.positions[p],
                             alpha=cfg.alpha, key_norms=norms[e], span=plan.prompt_lens[i],
                             k_scale=k_scale)
        slot, seq, lo, hi, k = (_chunk_rows(t, c0, c1, rt) for t in
                                (plan.sfi_slot, plan.seq_lens, plan.allowed_lo, plan.allowed_hi, plan.k))
        rt.ring.submit(entry, lambda tables=tables, slot=slot, seq=seq, evidence=evidence, norms=norms,
                       lo=lo, hi=hi, k=k: _prefill_end_select(
                           rt, cfg, layer, kv_cache, tables, slot, seq, evidence, norms, lo, hi, k))


def _chunk_rows(t: torch.Tensor, c0: int, c1: int, rt: SfiRuntime) -> torch.Tensor:
    """Rows ``[c0, c1)`` of a prefill-end plan tensor for the selector. A later chunk's rows are
    copied to a fresh (16-byte aligned) tensor: a view at an odd offset would be another Triton
    compile key than the warm-up's; the side stream reading the copy holds it (``keep``)."""
    if c0 == 0:
        return t[:c1]
    out = t[c0:c1].clone()
    rt.ring.keep(out)
    return out


# ------------------------------------------------------------------------------ selector "quest"
def quest_page_update(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      page_slot: torch.Tensor, page_first: torch.Tensor, cfg: SfiConfig,
                      layer: SfiLayerBuffers) -> None:
    """Each decode row of a request holding a compact slot (``page_slot >= 0``) rewrites the page
    max/min of K from page ``page_first`` (the plan's: the first its slot has not written) to the
    page holding its newest token: one page per row and layer in the steady state. Other rows write
    nothing (their length reads as 0, their slot is the scratch entry). The bounds are written
    through the layer's per-slot page table (``layer.quest_table``)."""
    table = layer.quest_table
    on = page_slot >= 0
    seq = torch.where(on, seq_lens, 0)
    slot = torch.where(on, page_slot, table.shape[0] - 1)
    update_block_representatives_paged_from(kv_cache, block_table, seq, page_first, cfg.page_size,
                                            layer.quest_pages, table, 0, state_slot=slot)


def quest_prefill_pages(kv_cache: torch.Tensor, block_table: torch.Tensor, plan, cfg: SfiConfig,
                        layer: SfiLayerBuffers) -> None:
    """The pages the step's prefill chunks wrote (``QuestPrefillPages``, host-planned; eager). The
    chunk's K/V must be in the cache."""
    update_block_representatives_paged(kv_cache, block_table[plan.rows], plan.seq_lens, plan.first_page,
                                       cfg.page_size, plan.max_pages, layer.quest_pages, layer.quest_table, 0,
                                       state_slot=plan.sfi_slot)


def _quest_rerank(query, kv_cache, step: SfiStep, e: slice, count, cfg: SfiConfig,
                  layer: SfiLayerBuffers, rt: SfiRuntime, scale: float, scratch, tables,
                  k_scale: torch.Tensor | None = None) -> None:
    """``sfi.quest_rerank`` for the slow entries ``e`` (one chunk, live count ``count``): the tokens of
    each selection row's best pages by bound, ``quest_rerank`` times its budget (the kept tokens left
    out), become candidates, and the row's evidence becomes their exact share of the GQA group's
    attention (``-inf`` elsewhere), so the selection that follows keeps the candidates that hold the
    most of it."""
    slow_k = step.slow_k[e]
    cand_k = rt.candidate_k[:slow_k.shape[0]]
    torch.mul(slow_k, cfg.quest_rerank, out=cand_k)
    kept = step.slow_kept[e] if cfg.keep_prefill else None
    cand, n_cand = select(scratch.log_evidence, scratch.key_norms, step.slow_lo[e], step.slow_hi[e],
                          rt.rest_select_cfg, cand_k, k_cap=cfg.quest_rerank * cfg.k,
                          workspace=rt.candidate_workspace, count=count,
                          exclude=layer.kept_pos if kept is not None else None,
                          exclude_slot=step.slow_sfi_slot[e] if kept is not None else None,
                          exclude_count=kept)
    quest_candidate_evidence(query, kv_cache, tables, step.slow_rows[e], cand, n_cand,
                             step.slow_hi[e], scale, scratch.log_evidence, count=count,
                             workspace=rt.candidate_scores, k_scale=k_scale)


def _quest_decode(query, kv_cache, block_table, seq_lens, step: SfiStep, cfg: SfiConfig,
                  layer: SfiLayerBuffers, rt: SfiRuntime, layer_index: int, scale: float,
                  out: torch.Tensor, *, dense_done: bool,
                  fixed_launches: bool | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows with the Quest-style selector (``sfi.selector = "quest"``):

    1. every SFI decode row updates its newest page's max/min of K (every page its slot has not
       written yet, for a fresh slot over a cached context);
    2. dense rows attend densely (unless ``dense_done``);
    3. selection rows (the plan's slow rows) write the page bounds as pooled log evidence into the
       ring scratch, and the selector (neutral refinements) + gather refresh their compact segments
       now, on the main stream: the selection is used in this step. With ``sfi.keep_prefill`` the
       pages fill the budget besides the tokens the prefill-end selection (SFI's) keeps, and the
       gather writes them after those;
    4. fast rows, the selection rows included (the plan marks them fast too), attend over the
       compact segment + the recent window ``[t - n_recent, t)`` (the selection's allowed set ends
       at ``t - n_recent``, so the two are disjoint and cover sink + selected + recent).
    """
    rows = query.shape[0]
    on_cpu = query.device.type == "cpu" if fixed_launches is None else not fixed_launches
    fast = step.row_fast[:rows]
    dense = step.row_dense[:rows]
    quest_page_update(kv_cache, block_table, seq_lens, step.row_page_slot[:rows], step.row_page_first[:rows],
                      cfg, layer)
    if not dense_done and (not on_cpu or bool(dense.any())):
        paged_decode(query, kv_cache, block_table, seq_lens, scale, out, row_mask=dense,
                     workspace=rt.dense_workspace, k_scale=k_scale, v_scale=v_scale)
    if not on_cpu or bool(step.row_slow[:rows].any()):
        b = rt.maintenance_rows
        for c in range(_chunks(step, rt, rows, on_cpu)):
            e, count = _chunk_of(step, c, b)
            _, scratch = rt.ring.entry()
            quest_page_evidence(query, layer.quest_pages, layer.quest_table, scale, step.slow_rows[e],
                                step.slow_sfi_slot[e],
                                step.slow_lo[e], step.slow_hi[e], cfg.page_size, scratch.log_evidence,
                                count=count, k_scale=k_scale)
            tables = _slow_tables(step, block_table, e, scratch, rt)
            if cfg.quest_rerank:
                _quest_rerank(query, kv_cache, step, e, count, cfg, layer, rt, scale, scratch, tables,
                              k_scale=k_scale)
            _maintain(rt, cfg, layer, kv_cache, tables, step.slow_sfi_slot[e],
                      step.slow_seq[e], scratch.log_evidence, scratch.key_norms, step.slow_lo[e],
                      step.slow_hi[e], step.slow_k[e], count,
                      kept=step.slow_kept[e] if cfg.keep_prefill else None)
    if not on_cpu or bool(fast.any()):
        two_segment_decode(query, kv_cache, block_table, seq_lens, step.recent_start[:rows],
                           layer.compact_kv, layer.compact_len, step.row_sfi_slot[:rows], scale, out,
                           row_mask=fast, max_recent=cfg.n_recent, workspace=rt.split_workspace,
                           compact_table=layer.compact_table, k_scale=k_scale, v_scale=v_scale)
    return out
