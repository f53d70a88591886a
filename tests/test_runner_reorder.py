"""CritiPrefill rows go behind every other row of the step (vllm_ext.runner_hooks.
move_critiprefill_rows_last), so the CritiPrefill sub-batch holds them only."""

import numpy as np

from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.critiprefill.chunking import is_critiprefill_chunk
from vllm_ext.methods.critiprefill.chunking import move_critiprefill_rows_last

CFG = CritiPrefillConfig(enabled=True, segment_size=64, block_size=16, budget=32, min_len=100)


class Batch:
    def __init__(self, rows):                      # (req_id, computed, prompt_len)
        self.req_ids = [r[0] for r in rows]
        self.num_computed_tokens_cpu = np.array([r[1] for r in rows])
        self.num_prompt_tokens = np.array([r[2] for r in rows])

    def swap_states(self, i, j):
        for a in (self.req_ids, self.num_computed_tokens_cpu, self.num_prompt_tokens):
            a[i], a[j] = a[j], a[i]


def test_critiprefill_rows_move_last_and_decode_rows_stay_first():
    rows = [("d0", 500, 400), ("d1", 90, 80), ("x1", 100, 700),      # decodes, a one-token chunk
            ("cp0", 0, 1000), ("short", 0, 90), ("cp1", 128, 700), ("p2", 0, 64)]
    sched = {"d0": 1, "d1": 1, "x1": 1, "cp0": 200, "short": 90, "cp1": 128, "p2": 64}
    batch = Batch(rows)
    assert move_critiprefill_rows_last(batch, sched, CFG) == 1
    flags = [is_critiprefill_chunk(CFG, int(p), int(c), sched[r])
             for r, c, p in zip(batch.req_ids, batch.num_computed_tokens_cpu, batch.num_prompt_tokens)]
    assert flags == [False] * 5 + [True] * 2
    assert batch.req_ids[:3] == ["d0", "d1", "x1"]
    assert sorted(batch.req_ids) == sorted(r[0] for r in rows)
    assert move_critiprefill_rows_last(batch, sched, CFG) == 0        # already in order
