"""SPEED's per-step plan of the upper layers against a host reference: slot mapping (-1 where a
token has no upper-layer KV), token rows, positions, tail starts; padding tokens and rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ext.methods.speed.visibility import (SpeedPlanBuffers, host_token_counts, plan_upper_step,
                                       visible_mask)


@pytest.mark.parametrize("anchor_end", [1, 0])
def test_plan_matches_host_reference(anchor_end):
    # rows: (prompt_len, computed before the step, query tokens): first chunk, middle chunk,
    # final chunk, decode, decode of a one-token prompt, then a padded row
    rows = [(100, 0, 40), (100, 40, 30), (100, 70, 30), (60, 75, 1), (1, 5, 1)]
    pad_rows, pad_tokens = 1, 3
    q_lens = [q for _, _, q in rows] + [0] * pad_rows
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    n_real = int(qsl[-1])
    seq_lens = [c + q for _, c, q in rows] + [0] * pad_rows
    prompt = [p for p, _, _ in rows] + [0] * pad_rows
    slot_mapping = torch.arange(1000, 1000 + n_real + pad_tokens)
    slot_mapping[n_real:] = -1
    buf = SpeedPlanBuffers(8, 256, torch.device("cpu"))
    counts = host_token_counts(qsl, np.array([c for _, c, _ in rows] + [0]), np.array(prompt),
                               len(rows), anchor_end)
    step = plan_upper_step(slot_mapping=slot_mapping, query_start_loc=torch.tensor(qsl),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           row_prompt_len=torch.tensor(prompt, dtype=torch.int32),
                           num_reqs=len(rows), anchor_end=anchor_end, self_only=False, buffers=buf,
                           host_counts=counts)
    exp_slots, exp_pos, exp_row = [], [], []
    for r, (p, c, q) in enumerate(rows):
        for i in range(q):
            pos = c + i
            has_kv = pos < anchor_end or pos >= p - 1
            exp_slots.append(1000 + int(qsl[r]) + i if has_kv else -1)
            exp_pos.append(pos)
            exp_row.append(r)
    exp_slots += [-1] * pad_tokens
    exp_pos += [-1] * pad_tokens
    assert step.slot_mapping.tolist() == exp_slots
    assert step.positions.tolist() == exp_pos
    assert step.token_row[:n_real].tolist() == exp_row
    assert step.tail_start.tolist()[:len(rows)] == [max(p - 1, 0) for p, _, _ in rows]
    kept = sum(s >= 0 for s in exp_slots)
    assert counts == (kept, n_real - kept)
    # the slot mapping agrees with the visibility rule: a token has upper KV iff a later decode
    # query of its row sees it
    for r, (p, c, q) in enumerate(rows):
        later = torch.tensor([max(p - 1, c + q)])
        pos = torch.arange(c, c + q)
        seen = visible_mask(later, pos, p, anchor_end, False)[0]
        got = [exp_slots[int(qsl[r]) + i] >= 0 for i in range(q)]
        assert seen.tolist() == got


@pytest.mark.parametrize("anchor_end", [1, 0])
def test_kept_token_index_matches_the_rule(anchor_end):
    from vllm_ext.methods.speed.visibility import kept_token_index

    rng = np.random.default_rng(0)
    for _ in range(50):
        r = int(rng.integers(1, 6))
        prompt = rng.integers(1, 60, r)
        computed = np.array([int(rng.integers(0, p + 20)) for p in prompt])
        q = np.array([int(rng.integers(0, 40)) for _ in range(r)])
        qsl = np.concatenate([[0], np.cumsum(q)])
        got = kept_token_index(qsl, computed, prompt, r, anchor_end).tolist()
        exp = [int(qsl[i]) + j for i in range(r) for j in range(q[i])
               if computed[i] + j < anchor_end or computed[i] + j >= prompt[i] - 1]
        assert got == exp
        assert host_token_counts(qsl, computed, prompt, r, anchor_end) == (len(exp), int(q.sum()) - len(exp))
