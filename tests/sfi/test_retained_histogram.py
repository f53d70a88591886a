"""The retained-fraction histogram the step plan keeps on the device (exported as the Prometheus
histogram ``speedsfi_sfi_fast_retained_fraction``): per fast row-step, retained / context tokens
falls in cumulative buckets at 1, 2, 5, 10, 20, 50 %, the +Inf bucket is the fast-step count and the
sum (in ppm) is the sum of the fractions, all recomputed here from the plan's own rows."""

import torch

from vllm_ext.methods.sfi.config import SfiConfig
from vllm_ext.methods.sfi.step_plan import (NUM_STATS, RETAINED_FRACTION_BOUNDS_PCT, STAT_FAST,
                                    STAT_RETAINED_FRACTION_PPM, STAT_RETAINED_HIST, plan_step)


def test_histogram_counts_each_fast_row_in_its_buckets():
    cfg = SfiConfig(enabled=True, k=16, n_sink=4, n_recent=8, refresh=1000, schedule="periodic")
    # context lengths spread over the buckets: (4 + 16 + 8) / t = 28 / t
    seq = torch.tensor([29, 60, 150, 300, 600, 1500, 2900, 5000], dtype=torch.int32)
    rows = seq.shape[0]
    slots = torch.arange(rows, dtype=torch.int32)
    state = dict(sfi_slot_of=slots.clone(), sfi_on=torch.ones(rows, dtype=torch.bool),
                 sfi_k=torch.full((rows,), 16, dtype=torch.int32),
                 steps_since_slow=torch.zeros(rows, dtype=torch.int32),
                 has_selection=torch.zeros(rows, dtype=torch.bool),
                 sel_count=torch.zeros(rows, dtype=torch.int32))
    stats = torch.zeros(NUM_STATS, dtype=torch.int64)
    lut = torch.zeros(8, dtype=torch.bool)
    fractions = []
    for step in range(3):               # step 0 selects (slow), steps 1-2 are fast
        before = stats.clone()
        plan = plan_step(cfg, row_slot=slots, row_last_token=torch.zeros(rows, dtype=torch.int32),
                         row_is_decode=torch.ones(rows, dtype=torch.int32), seq_lens=seq,
                         trigger_lut=lut, stats=stats, **state)
        fast = plan.row_fast
        assert bool(fast.any()) == (step > 0)
        for t, f in zip(seq.tolist(), fast.tolist()):
            if f:
                fractions.append((cfg.n_sink + cfg.k + cfg.n_recent) / t)
        assert stats[STAT_FAST] - before[STAT_FAST] == int(fast.sum())
        seq = seq + 1
    assert len(fractions) == 2 * rows                        # every row is longer than 4 + 16 + 8
    for j, pct in enumerate(RETAINED_FRACTION_BOUNDS_PCT):
        assert int(stats[STAT_RETAINED_HIST + j]) == sum(f <= pct / 100 for f in fractions), pct
    assert int(stats[STAT_FAST]) == len(fractions)
    assert abs(int(stats[STAT_RETAINED_FRACTION_PPM]) / 1e6 - sum(fractions)) < 1e-5 * len(fractions)
    hist = stats[STAT_RETAINED_HIST:STAT_RETAINED_HIST + len(RETAINED_FRACTION_BOUNDS_PCT)]
    assert torch.all(hist[1:] >= hist[:-1]) and 0 < hist[0] < hist[-1] < stats[STAT_FAST]
