"""The SFI step plan in one Triton launch (plus one for the slow rows' block-table rows): the device
part of :func:`vllm_ext.methods.sfi.step_plan.plan_step`, its PyTorch twin. Writes every plan buffer and
advances the per-slot schedule state in place, with no allocation and no host synchronisation, so
the metadata builder's per-step work is two launches instead of some fifty small torch ops.

One program walks all rows of the step (``BLOCK_R`` = the next power of two of the row count; a
step has at most ``max_num_seqs`` rows): modes, allowed sets, the schedule update, the counters and
the compaction of the slow rows (a prefix sum in row order), and the sentence-boundary state
(``fire_at``, ``sentence_cooldown``; see :mod:`vllm_ext.methods.sfi.schedule`). Rows that are not decode rows
(prefill chunks, padding) never touch the per-slot state. Importable without vLLM; on CPU the twin runs
unless the Triton interpreter is on.
"""

from __future__ import annotations

import torch

from vllm_ext.kernels.triton_utils import HAS_TRITON, next_pow2, use_triton

# The plan's device counters (int64 [NUM_STATS]), shared with vllm_ext.methods.sfi.step_plan's PyTorch plan:
STAT_SLOW, STAT_FAST, STAT_RETAINED, STAT_CONTEXT, STAT_DENSE = range(5)
STAT_COPY = 5          # sparse rows the copy trigger (sfi.copy_ngram) made slow (whatever else fired)
STAT_PREFILL_END = 7
# histogram of the retained fraction (retained / context tokens) of each fast row-step: cumulative
# counts at these upper bounds, in percent (the +Inf bucket is STAT_FAST), and the sum of the
# fractions in parts per million (integer counters, so the device never holds a float sum)
RETAINED_FRACTION_BOUNDS_PCT = (1, 2, 5, 10, 20, 50)
STAT_RETAINED_HIST = 8
STAT_RETAINED_FRACTION_PPM = STAT_RETAINED_HIST + len(RETAINED_FRACTION_BOUNDS_PCT)
NUM_STATS = STAT_RETAINED_FRACTION_PPM + 1

_SCHEDULE_CODE = {"boundary": 0, "periodic": 1, "always_slow": 2}
_FIRE_AT_CODE = {"sentence_end": 0, "sentence_start": 1}
# _plan_kernel spells out the counter layout (slots 8-13 the histogram, 14 the ppm sum)
assert RETAINED_FRACTION_BOUNDS_PCT == (1, 2, 5, 10, 20, 50) and NUM_STATS == 15, \
    "update _plan_kernel's counters together with vllm_ext.methods.sfi.step_plan's layout"

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["R"])      # the step's row count: one compile for any batch
    def _plan_kernel(
        ROW_SLOT, ROW_TOK, ROW_DEC, SEQ,
        SFI_SLOT_OF, SFI_ON, SFI_K, STEPS, HAS_SEL, SEL_COUNT, LUT, STATS, TSTATE, GAP, ROW_COPY,
        O_SLOW, O_FAST, O_SPARSE, O_DENSE, O_SFI_SLOT, O_K, O_RSTART, O_LO, O_HI, O_SCRATCH,
        O_PAGE_SLOT,
        S_ROWS, S_SEQ, S_LO, S_HI, S_K, S_SFI_SLOT, S_COUNT, S_CHUNK_COUNT,
        R, CAP, CHUNK, NUM_CHUNKS, VOCAB, N_SINK, N_RECENT, MIN_LEN, REFRESH, MIN_GAP, COOLDOWN,
        SCHEDULE: tl.constexpr, FIRE_AT: tl.constexpr, TRACK: tl.constexpr, HAS_GAP: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, QUEST: tl.constexpr, HAS_COPY: tl.constexpr,
        BLOCK_CH: tl.constexpr,
    ):
        r = tl.arange(0, BLOCK_R)
        rm = r < R
        slot = tl.load(ROW_SLOT + r, mask=rm, other=0)
        tok = tl.load(ROW_TOK + r, mask=rm, other=-1)
        dec = (tl.load(ROW_DEC + r, mask=rm, other=0) != 0) & rm
        t = tl.load(SEQ + r, mask=rm, other=0)
        k = tl.load(SFI_K + slot, mask=rm, other=0)
        sfi_slot = tl.load(SFI_SLOT_OF + slot, mask=rm, other=-1)
        on = dec & (tl.load(SFI_ON + slot, mask=rm, other=0) != 0) & (sfi_slot >= 0)
        sparse = on & (t > tl.maximum(N_SINK + N_RECENT + k, MIN_LEN))
        steps = tl.load(STEPS + slot, mask=rm, other=0)
        nth = steps + 1
        has = tl.load(HAS_SEL + slot, mask=rm, other=0) != 0
        if SCHEDULE == 2:
            slow = sparse
        else:
            if HAS_GAP:
                gap = tl.load(GAP + slot, mask=rm, other=0)
                slow = (nth >= tl.minimum(gap, REFRESH)) | (~has)
            else:
                slow = (nth >= REFRESH) | (~has)
            if SCHEDULE == 0:
                inside = (tok >= 0) & (tok < VOCAB)
                bits = tl.load(LUT + tl.where(inside, tok, 0), mask=rm & inside, other=0).to(tl.int32)
                bits = tl.where(inside, bits, 0)
                ender = (bits & 1) != 0                     # schedule.LUT_ENDER
                if TRACK:
                    # sentence boundaries (schedule.boundary_step): state = cooldown << 1 | armed,
                    # advanced by every decode row of an SFI request (dense rows too)
                    space = (bits & 2) != 0                 # schedule.LUT_SPACE
                    st = tl.load(TSTATE + slot, mask=on, other=0)
                    cd = st >> 1
                    armed = (st & 1) != 0
                    arm = ender & (cd == 0)
                    cd = tl.where(arm, COOLDOWN, tl.maximum(cd - 1, 0))
                    if FIRE_AT == 0:                        # sentence_end: fire at the arm
                        trig = arm
                        new_st = cd << 1
                    else:                                   # sentence_start
                        armed = armed | arm
                        trig = armed & (~ender) & (~space)
                        armed = armed & (~trig)
                        cd = tl.where(trig, tl.maximum(cd, COOLDOWN), cd)
                        new_st = (cd << 1) | armed.to(tl.int32)
                    tl.store(TSTATE + slot, new_st, mask=on)
                else:
                    trig = ender
                if MIN_GAP > 0:
                    trig = trig & (nth >= MIN_GAP)
                slow = slow | trig
            if HAS_COPY:                                # sfi.copy_ngram (kernels.copy_match)
                copying = (tl.load(ROW_COPY + r, mask=rm, other=0) != 0) & sparse
                slow = slow | copying
                tl.store(STATS + 5, tl.load(STATS + 5) + tl.sum(copying.to(tl.int64), 0))
            slow = slow & sparse
        if QUEST:
            fast = sparse                           # a selection row attends like a fast row
        else:
            fast = sparse & (~slow)
        lo = tl.zeros([BLOCK_R], dtype=tl.int32) + N_SINK
        hi = tl.maximum(t - N_RECENT, lo)
        rstart = tl.maximum(t - N_RECENT, 0)
        # the schedule state: slow rows restart, fast rows count on, dense decode rows age too
        new_steps = tl.where(slow, 0, nth)
        tl.store(STEPS + slot, new_steps, mask=dec)
        if HAS_GAP and SCHEDULE != 2:
            tl.store(GAP + slot, tl.minimum(gap * 2, REFRESH), mask=slow)   # the budget doubles
        tl.store(HAS_SEL + slot, slow, mask=slow)
        n_sel = tl.minimum(k, tl.maximum(hi - lo, 0))
        old_sel = tl.load(SEL_COUNT + slot, mask=rm, other=0)
        tl.store(SEL_COUNT + slot, n_sel, mask=slow)
        if QUEST:
            cur_sel = tl.where(slow, n_sel, old_sel)    # a selection row reads what it selected
        else:
            cur_sel = old_sel
        retained = tl.where(fast, N_SINK + cur_sel + (t - rstart), 0)
        # counters (one program: plain read-modify-write)
        tl.store(STATS + 0, tl.load(STATS + 0) + tl.sum(slow.to(tl.int64), 0))
        tl.store(STATS + 1, tl.load(STATS + 1) + tl.sum(fast.to(tl.int64), 0))
        tl.store(STATS + 2, tl.load(STATS + 2) + tl.sum(retained.to(tl.int64), 0))
        tl.store(STATS + 3, tl.load(STATS + 3) + tl.sum(tl.where(fast, t, 0).to(tl.int64), 0))
        tl.store(STATS + 4, tl.load(STATS + 4) + tl.sum((dec & ~sparse).to(tl.int64), 0))
        # retained-fraction histogram (bounds in percent: step_plan.RETAINED_FRACTION_BOUNDS_PCT)
        r100 = retained * 100
        tl.store(STATS + 8, tl.load(STATS + 8) + tl.sum((fast & (r100 <= t)).to(tl.int64), 0))
        tl.store(STATS + 9, tl.load(STATS + 9) + tl.sum((fast & (r100 <= 2 * t)).to(tl.int64), 0))
        tl.store(STATS + 10, tl.load(STATS + 10) + tl.sum((fast & (r100 <= 5 * t)).to(tl.int64), 0))
        tl.store(STATS + 11, tl.load(STATS + 11) + tl.sum((fast & (r100 <= 10 * t)).to(tl.int64), 0))
        tl.store(STATS + 12, tl.load(STATS + 12) + tl.sum((fast & (r100 <= 20 * t)).to(tl.int64), 0))
        tl.store(STATS + 13, tl.load(STATS + 13) + tl.sum((fast & (r100 <= 50 * t)).to(tl.int64), 0))
        ppm = retained.to(tl.int64) * 1000000 // tl.maximum(t, 1).to(tl.int64)
        tl.store(STATS + 14, tl.load(STATS + 14) + tl.sum(tl.where(fast, ppm, 0), 0))
        # per-row plan
        tl.store(O_SLOW + r, slow, mask=rm)
        tl.store(O_FAST + r, fast, mask=rm)
        tl.store(O_SPARSE + r, sparse, mask=rm)
        tl.store(O_DENSE + r, (~sparse), mask=rm)
        tl.store(O_SFI_SLOT + r, tl.where(sparse, sfi_slot, 0), mask=rm)
        tl.store(O_K + r, k, mask=rm)
        tl.store(O_RSTART + r, rstart, mask=rm)
        tl.store(O_LO + r, lo, mask=rm)
        tl.store(O_HI + r, hi, mask=rm)
        tl.store(O_PAGE_SLOT + r, tl.where(on, sfi_slot, -1), mask=rm)
        # compaction of the slow rows, in row order
        slow_i = slow.to(tl.int32)
        entry = tl.cumsum(slow_i, 0) - slow_i
        count = tl.sum(slow_i, 0)
        keep = slow & (entry < CAP)
        tl.store(O_SCRATCH + r, tl.where(keep, entry, -1), mask=rm)
        tl.store(S_ROWS + entry, r, mask=keep)
        tl.store(S_SEQ + entry, t, mask=keep)
        tl.store(S_LO + entry, lo, mask=keep)
        tl.store(S_HI + entry, hi, mask=keep)
        tl.store(S_K + entry, k, mask=keep)
        tl.store(S_SFI_SLOT + entry, sfi_slot, mask=keep)
        tl.store(S_COUNT, tl.minimum(count, CAP))
        # live entries of each maintenance chunk (one 16-byte row per chunk)
        ch = tl.arange(0, BLOCK_CH)
        live = tl.minimum(count, CAP) - ch * CHUNK
        tl.store(S_CHUNK_COUNT + ch * 4, tl.minimum(tl.maximum(live, 0), CHUNK), mask=ch < NUM_CHUNKS)
        e = tl.arange(0, BLOCK_S)
        unused = (e >= count) & (e < CAP)              # disjoint from the entries written above
        zero = tl.zeros([BLOCK_S], dtype=tl.int32)
        tl.store(S_ROWS + e, zero - 1, mask=unused)
        tl.store(S_SEQ + e, zero, mask=unused)
        tl.store(S_LO + e, zero, mask=unused)
        tl.store(S_HI + e, zero, mask=unused)
        tl.store(S_K + e, zero, mask=unused)
        tl.store(S_SFI_SLOT + e, zero - 1, mask=unused)

    @triton.jit
    def _gather_rows_kernel(SRC, ROWS, DST, s_src_r, s_src_c, s_dst_r, s_dst_c, WIDTH,
                            BLOCK_C: tl.constexpr):
        e = tl.program_id(0)
        cb = tl.program_id(1)
        row = tl.load(ROWS + e)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = (c < WIDTH) & (row >= 0)
        v = tl.load(SRC + tl.maximum(row, 0).to(tl.int64) * s_src_r + c * s_src_c, mask=cm, other=0)
        tl.store(DST + e.to(tl.int64) * s_dst_r + c * s_dst_c, v, mask=cm)


def plan_step_triton(cfg, buffers, *, row_slot, row_last_token, row_is_decode, seq_lens,
                     sfi_slot_of, sfi_on, sfi_k, steps_since_slow, has_selection, sel_count,
                     trigger_lut, stats, block_table=None, trigger_state=None,
                     refresh_gap=None, row_copy=None) -> int:
    """Launch the plan into ``buffers`` (a ``SfiPlanBuffers``); returns the row count."""
    rows = row_slot.shape[0]
    track = trigger_state is not None and cfg.schedule == "boundary"
    if rows > buffers.max_rows:
        raise RuntimeError(f"SPEEDSFI: a step with {rows} rows exceeds the plan's {buffers.max_rows}")
    b = buffers
    cap = b.capacity
    block_r = max(16, next_pow2(max(b.max_rows, 1)))
    _plan_kernel[(1,)](
        row_slot, row_last_token, row_is_decode, seq_lens,
        sfi_slot_of, sfi_on, sfi_k, steps_since_slow, has_selection, sel_count, trigger_lut, stats,
        trigger_state if track else steps_since_slow,     # (a placeholder pointer when not tracked)
        refresh_gap if refresh_gap is not None else steps_since_slow,
        row_copy if row_copy is not None else steps_since_slow,
        b.row_slow, b.row_fast, b.row_sparse, b.row_dense, b.row_sfi_slot, b.row_k,
        b.recent_start, b.allowed_lo, b.allowed_hi, b.row_scratch, b.row_page_slot,
        b.slow_rows, b.slow_seq, b.slow_lo, b.slow_hi, b.slow_k, b.slow_sfi_slot, b.slow_count,
        b.slow_chunk_count, rows, cap, b.chunk_rows, b.num_chunks, trigger_lut.shape[0], int(cfg.n_sink), int(cfg.n_recent), int(cfg.min_len),
        int(cfg.refresh),
        int(cfg.min_boundary_gap), int(cfg.sentence_cooldown),
        SCHEDULE=_SCHEDULE_CODE[cfg.schedule], FIRE_AT=_FIRE_AT_CODE[cfg.fire_at], TRACK=track,
        HAS_GAP=refresh_gap is not None,
        BLOCK_R=block_r,
        BLOCK_S=max(16, next_pow2(cap)), QUEST=cfg.selector == "quest",
        HAS_COPY=row_copy is not None and cfg.schedule != "always_slow",
        BLOCK_CH=max(16, next_pow2(b.num_chunks)), num_warps=4)
    if block_table is not None:
        dst = b.block_table_buffer(block_table.shape[1])
        width = block_table.shape[1]
        block_c = 256
        _gather_rows_kernel[(cap, triton.cdiv(width, block_c))](
            block_table, b.slow_rows, dst, *block_table.stride(), *dst.stride(), width,
            BLOCK_C=block_c)
    return rows


def can_plan_with_triton(tensor: torch.Tensor) -> bool:
    return HAS_TRITON and use_triton(tensor)
