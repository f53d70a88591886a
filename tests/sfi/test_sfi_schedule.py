"""The device-side slow/fast schedule on controlled token streams."""

import random

import pytest
import torch

from vllm_ext.sfi.schedule import (allowed_range, decide_slow, dense_threshold, is_exactly_dense, is_trigger,
                                   mark_selected, reset_slots)

T = 7                                   # the trigger token of these streams
VOCAB = 16


def lut(device="cpu"):
    table = torch.zeros(VOCAB, dtype=torch.bool, device=device)
    table[T] = True
    table[9] = True
    return table


class Oracle:
    """The rules of vllm_ext.sfi.schedule, one slot at a time in plain Python."""

    def __init__(self, schedule="boundary", refresh=4, min_gap=0):
        self.schedule, self.refresh, self.min_gap = schedule, refresh, min_gap
        self.steps, self.has = {}, {}

    def step(self, slot, token):
        nth = self.steps.get(slot, 0) + 1
        if self.schedule == "always_slow":
            slow = True
        else:
            slow = nth >= self.refresh or not self.has.get(slot, False)
            if self.schedule == "boundary" and token in (T, 9) and nth >= self.min_gap:
                slow = True
        self.steps[slot] = 0 if slow else nth
        return slow


def run_stream(tokens, *, schedule="boundary", refresh=4, min_gap=0, has_selection=True):
    steps = torch.zeros(1, dtype=torch.int32)
    has = torch.tensor([has_selection])
    out = []
    for tok in tokens:
        slow = decide_slow(torch.tensor([tok]), torch.tensor([0]), torch.tensor([True]), steps, has, lut(),
                           schedule=schedule, refresh=refresh, min_boundary_gap=min_gap)
        if slow[0]:
            mark_selected(steps, has, torch.tensor([0]), slow)
        out.append(int(slow[0]))
    return out


def test_boundary_triggers_and_refresh():
    # tokens[i] is the token sampled by the step before step i (the prefill made a selection)
    tokens = [1, 1, T, 1, 1, 1, 1, 1, 9, 1, 1, 1]
    # slow when the previous token is a trigger, and at the latest every 4th step
    assert run_stream(tokens, refresh=4) == [0, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0]
    # without triggers: exactly every `refresh` steps
    assert run_stream([1] * 12, refresh=4) == [0, 0, 0, 1] * 3
    assert run_stream([1] * 5, refresh=1) == [1] * 5


def test_trigger_is_the_previous_token():
    # last_token is what the previous step sampled: a trigger there makes *this* step slow
    assert run_stream([T, 1, 1], refresh=100) == [1, 0, 0]
    assert run_stream([T, T, T], refresh=100) == [1, 1, 1]


def test_no_selection_forces_slow():
    assert run_stream([1, 1, 1, 1, 1], refresh=100, has_selection=False) == [1, 0, 0, 0, 0]


def test_min_boundary_gap():
    tokens = [T, T, T, T, T, T]
    assert run_stream(tokens, refresh=100, min_gap=3) == [0, 0, 1, 0, 0, 1]
    assert run_stream([1, T, 1, 1, T, 1], refresh=100, min_gap=2) == [0, 1, 0, 0, 1, 0]


def test_periodic_and_always_slow():
    tokens = [T, 1, 1, T, 1, 1, 1, 1]
    assert run_stream(tokens, schedule="periodic", refresh=3) == [0, 0, 1, 0, 0, 1, 0, 0]
    assert run_stream(tokens, schedule="always_slow", refresh=3) == [1] * 8
    with pytest.raises(ValueError):
        run_stream(tokens, schedule="sometimes")


def test_padding_rows_and_non_decode_rows():
    steps = torch.tensor([5, 2, 0], dtype=torch.int32)
    has = torch.tensor([True, True, False])
    # rows: slot 0 decode; a padding row that points at -1; a prefill row on slot 2; a padding row on slot 0
    slow = decide_slow(torch.tensor([1, T, T, T]), torch.tensor([0, -1, 2, 0]),
                       torch.tensor([True, False, False, False]), steps, has, lut(), refresh=100)
    assert slow.tolist() == [False, False, False, False]
    assert steps.tolist() == [6, 2, 0]            # only slot 0 advanced; slot 2 untouched
    slow = decide_slow(torch.tensor([-1, 99, 1]), torch.tensor([1, 0, 2]), torch.tensor([True, True, True]),
                       steps, has, lut(), refresh=7)
    assert slow.tolist() == [False, True, True]   # slot 0 reaches its 7th step; slot 2 has no selection
    assert steps.tolist() == [0, 3, 0]
    assert not is_trigger(torch.tensor([-1, 16, 1000]), lut()).any()


def test_slot_reuse():
    steps = torch.zeros(2, dtype=torch.int32)
    has = torch.zeros(2, dtype=torch.bool)
    rows = torch.tensor([True])
    # request A in slot 1: prefill ends with a selection, then decodes
    mark_selected(steps, has, torch.tensor([1]), rows)
    assert has.tolist() == [False, True] and steps.tolist() == [0, 0]
    for _ in range(3):
        decide_slow(torch.tensor([1]), torch.tensor([1]), rows, steps, has, lut(), refresh=100)
    assert steps.tolist() == [0, 3]
    # A finishes, B takes slot 1 and its prefill made no selection (e.g. a short prompt)
    reset_slots(steps, has, torch.tensor([1]))
    assert has.tolist() == [False, False] and steps.tolist() == [0, 0]
    slow = decide_slow(torch.tensor([1]), torch.tensor([1]), rows, steps, has, lut(), refresh=100)
    assert slow.tolist() == [True]
    # masked reset leaves the other entries alone, even when they share a (padding) index
    mark_selected(steps, has, torch.tensor([0, 1]), torch.tensor([True, True]))
    reset_slots(steps, has, torch.tensor([0, 0]), torch.tensor([False, True]))
    assert has.tolist() == [False, True]


@pytest.mark.parametrize("schedule", ["boundary", "periodic", "always_slow"])
def test_random_streams_vs_oracle(schedule):
    rng = random.Random(1)
    slots, refresh, min_gap = 6, 5, 2
    oracle = Oracle(schedule, refresh, min_gap)
    steps = torch.zeros(slots, dtype=torch.int32)
    has = torch.zeros(slots, dtype=torch.bool)
    for slot in range(slots):
        if rng.random() < 0.5:
            oracle.has[slot] = True
            mark_selected(steps, has, torch.tensor([slot]), torch.tensor([True]))
    for _ in range(60):
        rows = rng.randint(1, slots + 2)
        perm = rng.sample(range(slots), k=min(rows, slots))
        slot_idx = perm + [-1] * (rows - len(perm))
        is_decode = [s >= 0 and rng.random() < 0.8 for s in slot_idx]
        tokens = [rng.choice([1, 2, T, 9, -1]) for _ in slot_idx]
        want = []
        for s, d, tok in zip(slot_idx, is_decode, tokens):
            if d:
                slow = oracle.step(s, tok)
                if slow:
                    oracle.has[s] = True
                want.append(slow)
            else:
                want.append(False)
        slow = decide_slow(torch.tensor(tokens), torch.tensor(slot_idx), torch.tensor(is_decode), steps, has,
                           lut(), schedule=schedule, refresh=refresh, min_boundary_gap=min_gap)
        mark_selected(steps, has, torch.tensor(slot_idx), slow)
        assert slow.tolist() == want
        assert steps.tolist() == [oracle.steps.get(s, 0) for s in range(slots)]


def test_dense_rule_and_allowed_range():
    assert dense_threshold(4, 256, 2048) == 2308
    seq = torch.tensor([1, 260, 2308, 2309, 10000])
    assert is_exactly_dense(seq, 4, 256, 2048).tolist() == [True, True, True, False, False]
    assert is_exactly_dense(seq, 4, 256, torch.tensor([0, 0, 0, 2049, 10000])).tolist() == \
        [True, True, False, True, True]
    lo, hi = allowed_range(seq, 4, 256)
    assert lo.tolist() == [4] * 5 and hi.tolist() == [4, 4, 2052, 2053, 9744]
    assert lo.dtype == torch.int32 and hi.dtype == torch.int32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay():
    dev = torch.device("cuda")
    steps = torch.zeros(4, dtype=torch.int32, device=dev)
    has = torch.ones(4, dtype=torch.bool, device=dev)
    tok = torch.zeros(4, dtype=torch.long, device=dev)
    slot = torch.arange(4, device=dev)
    dec = torch.ones(4, dtype=torch.bool, device=dev)
    table = lut(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                      # warm-up outside the graph
        decide_slow(tok, slot, dec, steps.clone(), has, table, refresh=3)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        slow = decide_slow(tok, slot, dec, steps, has, table, refresh=3)
    steps.zero_()
    seen = []
    for t in [1, T, 1, 1, 1]:
        tok.fill_(t)
        g.replay()
        seen.append(slow.tolist()[0])
    assert seen == [False, True, False, False, True]     # refresh 3: the 3rd step after the slow one
