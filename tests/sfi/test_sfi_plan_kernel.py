"""The one-launch Triton step plan (``vllm_ext.kernels.sfi_plan``) against its PyTorch twin
(``vllm_ext.methods.sfi.step_plan.plan_step``): every plan buffer, the per-slot schedule state and the
counters agree step after step, for every schedule, with padded rows, prefill rows, SFI-off rows and
rows without a compact slot."""

import pytest
import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.kernels.sfi_plan import plan_step_triton
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton
from vllm_ext.methods.sfi.step_plan import NUM_STATS, SfiPlanBuffers, plan_step

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
pytestmark = pytest.mark.skipif(not (HAS_TRITON and use_triton(DEVICE)),
                                reason="needs CUDA or the Triton interpreter")


def _state(n_slots, device, gen):
    return dict(
        sfi_slot_of=torch.tensor([0, 1, -1, 2, 3, 4, 5, -1, -1], dtype=torch.int32)[:n_slots],
        sfi_on=torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)[:n_slots],
        sfi_k=torch.tensor([8, 8, 0, 16, 8, 4, 8, 0, 0], dtype=torch.int32)[:n_slots],
        steps_since_slow=torch.randint(0, 5, (n_slots,), generator=gen, dtype=torch.int32),
        has_selection=torch.rand(n_slots, generator=gen) < 0.5,
        sel_count=torch.randint(0, 8, (n_slots,), generator=gen, dtype=torch.int32),
        stats=torch.zeros(NUM_STATS, dtype=torch.int64),
        # cooldown << 1 | armed, from any earlier history
        trigger_state=(torch.randint(0, 4, (n_slots,), generator=gen, dtype=torch.int32) << 1)
        | (torch.rand(n_slots, generator=gen) < 0.5).to(torch.int32))


ENDERS, SPACES = [3, 17], [5, 17]          # 17: "\n" (both), 5: " "


SCHEDULES = [
    ("boundary", 0, "sentence_end", 0, True), ("boundary", 3, "sentence_end", 0, True),
    ("boundary", 0, "sentence_end", 0, False), ("boundary", 3, "sentence_end", 2, True),
    ("boundary", 0, "sentence_start", 0, True), ("boundary", 3, "sentence_start", 2, True),
    ("periodic", 0, "sentence_end", 0, True), ("periodic", 0, "sentence_start", 2, True),
    ("always_slow", 0, "sentence_end", 0, True),
    # sfi.refresh_warmup: per-slot budgets from 1 doubling up to refresh
    ("boundary", 0, "sentence_end", 0, "warmup"), ("periodic", 0, "sentence_end", 0, "warmup")]
# quest changes which rows select, not the trigger logic: boundary and periodic cases suffice
# (always_slow is refused with quest)
QUEST_SCHEDULES = [c for c in SCHEDULES if c[0] != "always_slow" and c[1:4] == (0, "sentence_end", 0)
                   and c[4] is True]


# sfi.min_len: rows 0 (slot 4, budget 20, context 40 + step) and 3 (slot 3, budget 28, context 50 +
# step) decode dense until their context exceeds 45, then sparse
MIN_LEN_CASES = [("sfi", "boundary", 0, "sentence_end", 0, "warmup", 45),
                 ("sfi", "periodic", 0, "sentence_end", 0, True, 45),
                 ("quest", "boundary", 0, "sentence_end", 0, True, 45)]


# sfi.copy_ngram: the copy flags of kernels.copy_match make rows slow (ignored by always_slow)
COPY_CASES = [("sfi", "boundary", 0, "sentence_end", 0, "warmup", 0, True),
              ("sfi", "boundary", 3, "sentence_start", 2, True, 45, True),
              ("sfi", "periodic", 0, "sentence_end", 0, True, 0, True),
              ("quest", "boundary", 0, "sentence_end", 0, True, 0, True),
              ("sfi", "always_slow", 0, "sentence_end", 0, True, 0, True)]


@pytest.mark.parametrize("selector, schedule, gap, fire_at, cooldown, track, min_len, copy",
                         [("sfi", *c, 0, False) for c in SCHEDULES]
                         + [("quest", *c, 0, False) for c in QUEST_SCHEDULES]
                         + [(*c, False) for c in MIN_LEN_CASES] + COPY_CASES)
def test_plan_kernel_equals_twin(schedule, gap, fire_at, cooldown, track, selector, min_len, copy):
    gen = torch.Generator().manual_seed(7)
    cfg = SfiConfig(enabled=True, k=16, k_min=4, n_sink=4, n_recent=8, refresh=4 if gap < 3 else 6,
                    schedule=schedule, min_boundary_gap=gap, fire_at=fire_at, sentence_cooldown=cooldown,
                    selector=selector, page_size=4, min_len=min_len)
    n_slots, rows, cap = 9, 8, 6
    lut = torch.zeros(50, dtype=torch.int8)
    lut[ENDERS] |= 1
    lut[SPACES] |= 2
    state = _state(n_slots, "cpu", gen)
    if track == "warmup":
        state["refresh_gap"] = torch.randint(1, cfg.refresh + 1, (n_slots,), generator=gen, dtype=torch.int32)
    elif not track:
        del state["trigger_state"]
        lut = lut & 1 != 0                 # a plain bool LUT works too where no state is kept
    twin = {k: v.clone() for k, v in state.items()}
    kern = {k: v.clone().to(DEVICE) for k, v in twin.items()}
    # maintenance chunks of 4 entries: two chunks, the entries padded to 8
    b_twin = SfiPlanBuffers(rows, cap, torch.device("cpu"), chunk_rows=4)
    b_kern = SfiPlanBuffers(rows, cap, DEVICE, chunk_rows=4)
    ent = b_twin.entries
    # rows: slots in a fixed order, the last row padding (scratch slot 8), row 2 a prefill row
    row_slot = torch.tensor([4, 0, 1, 3, 5, 6, 2, 8], dtype=torch.int32)
    bt = torch.arange(rows * 5, dtype=torch.int32).reshape(rows, 5)
    seq = torch.tensor([40, 29, 300, 50, 20, 61, 33, 0], dtype=torch.int32)
    for step in range(24):
        tok = torch.randint(0, 60, (rows,), generator=gen, dtype=torch.int32)   # some out of the LUT
        # plenty of enders and whitespace-only tokens so that arms, cooldowns and firings all happen
        pick = torch.rand(rows, generator=gen)
        boundary = torch.tensor(ENDERS + SPACES, dtype=torch.int32)[
            torch.randint(0, 4, (rows,), generator=gen)]
        tok = torch.where(pick < 0.4, boundary, tok)
        dec = torch.tensor([1, 1, int(step > 2), 1, 1, 1, 1, 0], dtype=torch.int32)
        row_copy = (torch.rand(rows, generator=gen) < 0.3).to(torch.int32) if copy else None
        plan_step(cfg, row_slot=row_slot, row_last_token=tok, row_is_decode=dec, seq_lens=seq,
                  trigger_lut=lut, buffers=b_twin, block_table=bt, row_copy=row_copy, **twin)
        plan_step_triton(cfg, b_kern, row_slot=row_slot.to(DEVICE), row_last_token=tok.to(DEVICE),
                         row_is_decode=dec.to(DEVICE), seq_lens=seq.to(DEVICE),
                         trigger_lut=lut.to(DEVICE), block_table=bt.to(DEVICE),
                         row_copy=None if row_copy is None else row_copy.to(DEVICE), **kern)
        if copy:
            forced = row_copy.bool() & b_twin.row_sparse[:rows]
            assert bool(b_twin.row_slow[:rows][forced].all()), f"step {step}: a copying row is not slow"
        if min_len:
            for r, budget in ((0, 20), (3, 28)):
                want = bool(dec[r]) and int(seq[r]) > max(budget, min_len)
                assert bool(b_twin.row_sparse[r]) == want, f"step {step}: row {r} sparse"
        for name in ("row_slow", "row_fast", "row_sparse", "row_dense", "row_k", "recent_start",
                     "allowed_lo", "allowed_hi", "row_scratch", "row_page_slot"):
            assert torch.equal(getattr(b_twin, name)[:rows], getattr(b_kern, name)[:rows].cpu()), \
                f"step {step}: {name}"
        sf = torch.equal(b_twin.row_sfi_slot[:rows], b_kern.row_sfi_slot[:rows].cpu())
        assert sf, f"step {step}: row_sfi_slot"
        for name in ("slow_rows", "slow_seq", "slow_lo", "slow_hi", "slow_k", "slow_sfi_slot",
                     "slow_count", "slow_chunk_count"):
            assert torch.equal(getattr(b_twin, name)[:ent], getattr(b_kern, name)[:ent].cpu()), \
                f"step {step}: {name}"
        count = int(b_twin.slow_count)
        assert b_twin.slow_chunk_count[:, 0].tolist() == [min(max(count - c * 4, 0), 4) for c in range(2)]
        assert bool((b_twin.slow_rows[cap:ent] == -1).all()), "padding entries stay unused"
        live = b_twin.slow_rows[:cap] >= 0
        assert torch.equal(b_twin.slow_block_table[:cap][live], b_kern.slow_block_table[:cap][live].cpu())
        for name in ("steps_since_slow", "has_selection", "sel_count", "stats", "trigger_state", "refresh_gap"):
            if name in twin:
                assert torch.equal(twin[name], kern[name].cpu()), f"step {step}: {name}"
        seq = seq + (dec.bool() & (seq > 0)).to(torch.int32)
    # the run exercised every mode the schedule has
    assert twin["stats"][0] > 0 and twin["stats"][4] > 0
    assert (twin["stats"][1] > 0) == (schedule != "always_slow")
    assert (twin["stats"][5] > 0) == (copy and schedule != "always_slow")     # STAT_COPY
    if selector == "quest":
        # a selection row attends sparsely: it is counted fast too
        assert twin["stats"][1] >= twin["stats"][0] > 0
