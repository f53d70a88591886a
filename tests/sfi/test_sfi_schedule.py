"""The device-side slow/fast schedule on controlled token streams."""

import random

import pytest
import torch

from vllm_ext.methods.sfi.schedule import (allowed_range, decide_slow, dense_threshold, is_exactly_dense, is_trigger,
                                   mark_selected, reset_slots)

T = 7                                   # the trigger token of these streams
VOCAB = 16


def lut(device="cpu"):
    table = torch.zeros(VOCAB, dtype=torch.bool, device=device)
    table[T] = True
    table[9] = True
    return table


class Oracle:
    """The rules of vllm_ext.methods.sfi.schedule, one slot at a time in plain Python."""

    def __init__(self, schedule="boundary", refresh=4, min_gap=0, warmup=False):
        self.schedule, self.refresh, self.min_gap, self.warmup = schedule, refresh, min_gap, warmup
        self.steps, self.has, self.gap = {}, {}, {}

    def step(self, slot, token):
        nth = self.steps.get(slot, 0) + 1
        gap = self.gap.get(slot, 1 if self.warmup else self.refresh)
        if self.schedule == "always_slow":
            slow = True
        else:
            slow = nth >= gap or not self.has.get(slot, False)
            if self.schedule == "boundary" and token in (T, 9) and nth >= self.min_gap:
                slow = True
            if slow:
                self.gap[slot] = min(2 * gap, self.refresh)
        self.steps[slot] = 0 if slow else nth
        return slow


def run_stream(tokens, *, schedule="boundary", refresh=4, min_gap=0, has_selection=True, gap=None):
    steps = torch.zeros(1, dtype=torch.int32)
    has = torch.tensor([has_selection])
    out = []
    for tok in tokens:
        slow = decide_slow(torch.tensor([tok]), torch.tensor([0]), torch.tensor([True]), steps, has, lut(),
                           schedule=schedule, refresh=refresh, min_boundary_gap=min_gap, refresh_gap=gap)
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


def test_refresh_warmup_doubles_the_budget_up_to_refresh():
    """``sfi.refresh_warmup``: the budget starts at 1 and doubles at each slow step up to ``refresh``:
    slow at decode steps 1, 3, 7, 15, 31, then every ``refresh``; a sentence boundary's slow step
    doubles it too; without the warm-up (gap = refresh) the schedule is the paper's."""
    slow_at = lambda out: [i + 1 for i, s in enumerate(out) if s]
    gap = torch.tensor([1], dtype=torch.int32)
    out = run_stream([1] * 100, schedule="periodic", refresh=32, gap=gap)
    assert slow_at(out) == [1, 3, 7, 15, 31, 63, 95]
    assert gap.tolist() == [32]
    gap = torch.tensor([1], dtype=torch.int32)
    # the boundary at step 4 (its input token is a trigger) is a slow step: the next budget is 8
    out = run_stream([1, 1, 1, T, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], refresh=16, gap=gap)
    assert slow_at(out) == [1, 3, 4, 12]
    assert run_stream([1] * 40, schedule="periodic", refresh=8, gap=torch.tensor([8], dtype=torch.int32)) \
        == run_stream([1] * 40, schedule="periodic", refresh=8)


def test_refresh_warmup_starts_again_for_a_reused_slot():
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.sfi.slot_tables import SfiSlotTables

    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 64, "refresh_warmup": True}})
    tables = SfiSlotTables(3, 2, 2, cfg, None, torch.device("cpu"), max_model_len=1024)
    assert tables.refresh_gap.tolist() == [1, 1, 1]
    tables.refresh_gap.fill_(32)
    tables.apply_resets(torch.tensor([1]), torch.tensor([0], dtype=torch.int32),
                        torch.tensor([64], dtype=torch.int32), torch.tensor([True]))
    assert tables.refresh_gap.tolist() == [32, 1, 32]
    paper = SfiSlotTables(3, 2, 2, SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": 64}}), None,
                          torch.device("cpu"), max_model_len=1024)
    assert paper.refresh_gap.tolist() == [32, 32, 32]


@pytest.mark.parametrize("schedule, warmup", [("boundary", False), ("periodic", False), ("always_slow", False),
                                              ("boundary", True), ("periodic", True)])
def test_random_streams_vs_oracle(schedule, warmup):
    rng = random.Random(1)
    slots, refresh, min_gap = 6, 5, 2
    oracle = Oracle(schedule, refresh, min_gap, warmup)
    steps = torch.zeros(slots, dtype=torch.int32)
    gap = torch.full((slots,), 1 if warmup else refresh, dtype=torch.int32)
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
                           lut(), schedule=schedule, refresh=refresh, min_boundary_gap=min_gap,
                           refresh_gap=gap)
        mark_selected(steps, has, torch.tensor(slot_idx), slow)
        assert slow.tolist() == want
        if schedule != "always_slow":
            assert gap.tolist() == [oracle.gap.get(s, 1 if warmup else refresh) for s in range(slots)]
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


# ---------------------------------------------------------------------------------------------------
# sentence boundaries: fire_at = "sentence_start", sentence_cooldown (the SFI authors' refresh trigger)
# ---------------------------------------------------------------------------------------------------

NL, SP = 10, 11                          # "\n" (an ender and whitespace-only) and " " (whitespace-only)
W = 1                                    # a word
ENDERS, SPACES = (T, 9, NL), (NL, SP)


def bits_lut(device="cpu"):
    from vllm_ext.methods.sfi.triggers import trigger_lut as build

    return build(ENDERS, VOCAB, device, whitespace_ids=SPACES)


class AuthorsRef:
    """One request's refresh decisions, written from the authors' rules (per decode step, on the
    latest sampled token): a sentence ender arms when the cooldown is 0 (cooldown = C), else a
    positive cooldown counts down; an armed request fires at the first token that is neither an
    ender nor whitespace-only (disarm, cooldown = max(cooldown, C)); a firing needs `min_gap` steps
    since the last refresh (else it is dropped); the refresh budget and "no selection yet" force a
    refresh. fire_at="sentence_end" fires at the arm itself."""

    def __init__(self, fire_at, cooldown, min_gap, refresh, has_selection):
        self.fire_at, self.c, self.min_gap, self.refresh = fire_at, cooldown, min_gap, refresh
        self.has = has_selection
        self.cooldown, self.armed, self.since = 0, False, 0
        self.boundary_fires = 0          # slow steps only a sentence boundary asked for

    def advance_boundary(self, tok):
        """Rules 1-2 only (also what an exactly-dense decode row does): returns 'wants a refresh'."""
        want = False
        if self.cooldown == 0 and tok in ENDERS:
            self.cooldown = self.c
            self.armed = True
            if self.fire_at == "sentence_end":
                self.armed, want = False, True
        elif self.cooldown > 0:
            self.cooldown -= 1
        if self.fire_at == "sentence_start" and self.armed and tok not in ENDERS and tok not in SPACES:
            self.armed = False
            self.cooldown = max(self.cooldown, self.c)
            want = True
        return want

    def step(self, tok):
        want = self.advance_boundary(tok)
        nth = self.since + 1
        boundary = want and nth >= self.min_gap
        self.boundary_fires += boundary and nth < self.refresh and self.has
        slow = nth >= self.refresh or not self.has or boundary
        self.since = 0 if slow else nth
        self.has = self.has or slow
        return slow

    def state(self):
        return (self.cooldown << 1) | int(self.armed)

    def reset(self):
        self.cooldown, self.armed, self.since, self.has = 0, False, 0, False


def run_boundary(tokens, *, fire_at="sentence_start", cooldown=2, min_gap=0, refresh=100,
                 has_selection=True):
    steps = torch.zeros(1, dtype=torch.int32)
    has = torch.tensor([has_selection])
    state = torch.zeros(1, dtype=torch.int32)
    ref = AuthorsRef(fire_at, cooldown, min_gap, refresh, has_selection)
    out = []
    for tok in tokens:
        slow = decide_slow(torch.tensor([tok]), torch.tensor([0]), torch.tensor([True]), steps, has,
                           bits_lut(), refresh=refresh, min_boundary_gap=min_gap, fire_at=fire_at,
                           sentence_cooldown=cooldown, trigger_state=state)
        mark_selected(steps, has, torch.tensor([0]), slow)
        out.append(int(slow[0]))
        assert bool(slow[0]) == ref.step(tok)
        assert int(state[0]) == ref.state() and int(steps[0]) == ref.since
    return out


def test_sentence_start_fires_at_the_first_word():
    # step i decides on tokens[i] (sampled by step i - 1): ". \n word" fires at the word's step
    assert run_boundary([W, T, NL, W, W]) == [0, 0, 0, 1, 0]
    assert run_boundary([W, T, SP, SP, W, W]) == [0, 0, 0, 0, 1, 0]
    assert run_boundary([T, 9, T, W], cooldown=0) == [0, 0, 0, 1]        # enders in a row: one firing
    # our sentence_end firing, with and without the cooldown
    assert run_boundary([W, T, NL, W, W], fire_at="sentence_end", cooldown=0) == [0, 1, 1, 0, 0]
    assert run_boundary([W, T, NL, W, W], fire_at="sentence_end", cooldown=2) == [0, 1, 0, 0, 0]


def test_sentence_start_default_config_is_the_stateless_schedule():
    """fire_at sentence_end, cooldown 0 with a trigger_state = without one (the stateless rule)."""
    rng = random.Random(3)
    tokens = [rng.choice([W, 2, T, 9, NL, SP, -1]) for _ in range(80)]
    with_state = run_boundary(tokens, fire_at="sentence_end", cooldown=0, min_gap=3, refresh=6)
    # without a state: the bool LUT rule of run_stream (NL counts as a trigger there too)
    steps, has = torch.zeros(1, dtype=torch.int32), torch.tensor([True])
    stateless = []
    for tok in tokens:
        slow = decide_slow(torch.tensor([tok]), torch.tensor([0]), torch.tensor([True]), steps, has,
                           bits_lut(), refresh=6, min_boundary_gap=3)
        mark_selected(steps, has, torch.tensor([0]), slow)
        stateless.append(int(slow[0]))
    assert with_state == stateless


def test_cooldown_blocks_rearming():
    # the firing at step 1 sets the cooldown to 2: the ender at step 2 is inside it and arms nothing
    assert run_boundary([T, W, T, W, W, T, W]) == [0, 1, 0, 0, 0, 0, 1]
    # an ender right after an arm (cooldown 2) does not re-arm either; the arm itself stays
    assert run_boundary([T, T, W, W], cooldown=2) == [0, 0, 1, 0]


def test_start_inside_min_gap_is_dropped():
    # min gap 4, the prefill selection counts as the last refresh: the start at step 1 (2nd step) is
    # inside the gap, so it is consumed and never fires later; the next sentence fires normally
    assert run_boundary([T, W, W, W, W, W, T, W], cooldown=0, min_gap=4) == [0, 0, 0, 0, 0, 0, 0, 1]
    assert run_boundary([W, W, T, W, W], cooldown=0, min_gap=4) == [0, 0, 0, 1, 0]   # 4th step: fires


def test_refresh_budget_and_no_selection_still_force_slow():
    assert run_boundary([W] * 8, refresh=4) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert run_boundary([W] * 4, refresh=100, has_selection=False) == [1, 0, 0, 0]
    # an arm survives a budget refresh; its start then falls inside the min gap and is dropped
    assert run_boundary([W, W, T, W, W, W], refresh=3, min_gap=2) == [0, 0, 1, 0, 0, 1]


def test_boundary_state_non_decode_rows_and_reset():
    lut_ = bits_lut()
    steps = torch.tensor([0, 0, 0], dtype=torch.int32)
    has = torch.tensor([True, True, True])
    state = torch.tensor([0, 5, 0], dtype=torch.int32)           # slot 1: cooldown 2, armed
    kw = dict(refresh=100, fire_at="sentence_start", sentence_cooldown=2, trigger_state=state)
    # a decode row on slot 0 (ender: arms), a prefill row on slot 1 (a word: would fire), a padding
    # row at -1 and a padding row on slot 0
    slow = decide_slow(torch.tensor([T, W, W, W]), torch.tensor([0, 1, -1, 0]),
                       torch.tensor([True, False, False, False]), steps, has, lut_, **kw)
    assert slow.tolist() == [False] * 4
    assert state.tolist() == [5, 5, 0] and steps.tolist() == [1, 0, 0]
    # an `advance` row that is not a decode row (an exactly-dense decode row) moves the state only
    slow = decide_slow(torch.tensor([W, W]), torch.tensor([0, 1]), torch.tensor([False, False]),
                       steps, has, lut_, advance=torch.tensor([True, False]), **kw)
    assert slow.tolist() == [False, False]
    assert state.tolist() == [4, 5, 0] and steps.tolist() == [1, 0, 0]  # fired (and disarmed) unseen
    # reset clears the arm and the cooldown of the reset slots only
    reset_slots(steps, has, torch.tensor([1, 0]), torch.tensor([True, False]), trigger_state=state)
    assert state.tolist() == [4, 0, 0] and has.tolist() == [True, False, True]
    mark_selected(steps, has, torch.tensor([1]), torch.tensor([True]))
    slow = decide_slow(torch.tensor([W]), torch.tensor([1]), torch.tensor([True]), steps, has, lut_, **kw)
    assert slow.tolist() == [False]                                # the old arm is gone
    with pytest.raises(ValueError, match="trigger_state"):
        decide_slow(torch.tensor([W]), torch.tensor([1]), torch.tensor([True]), steps, has, lut_,
                    fire_at="sentence_start")
    with pytest.raises(ValueError, match="fire_at"):
        decide_slow(torch.tensor([W]), torch.tensor([1]), torch.tensor([True]), steps, has, lut_,
                    fire_at="sentence_middle", trigger_state=state)


@pytest.mark.parametrize("fire_at, cooldown, min_gap, refresh", [
    ("sentence_start", 2, 16, 32), ("sentence_start", 2, 3, 7), ("sentence_start", 0, 0, 5),
    ("sentence_start", 3, 2, 100), ("sentence_end", 2, 3, 7), ("sentence_end", 0, 2, 5)])
def test_random_streams_vs_authors_reference(fire_at, cooldown, min_gap, refresh):
    rng = random.Random(f"{fire_at}-{cooldown}-{min_gap}-{refresh}")
    slots = 6
    refs = {s: AuthorsRef(fire_at, cooldown, min_gap, refresh, False) for s in range(slots)}
    steps = torch.zeros(slots, dtype=torch.int32)
    has = torch.zeros(slots, dtype=torch.bool)
    state = torch.zeros(slots, dtype=torch.int32)
    lut_ = bits_lut()
    fired = 0
    for it in range(300):
        if rng.random() < 0.03:                                   # a slot changes hands
            s = rng.randrange(slots)
            refs[s].reset()
            reset_slots(steps, has, torch.tensor([s]), trigger_state=state)
        if rng.random() < 0.05:                                   # a prefill ends with a selection
            s = rng.randrange(slots)
            refs[s].has, refs[s].since = True, 0
            mark_selected(steps, has, torch.tensor([s]), torch.tensor([True]))
        rows = rng.randint(1, slots + 2)
        perm = rng.sample(range(slots), k=min(rows, slots))
        slot_idx = perm + [rng.choice([-1, 0]) for _ in range(rows - len(perm))]
        kind = [rng.choices(["decode", "dense", "prefill"], [0.75, 0.1, 0.15])[0] if i < len(perm)
                else "pad" for i in range(rows)]
        tokens = [rng.choices([W, 2, T, 9, NL, SP, -1, 99], [30, 10, 8, 3, 6, 6, 1, 1])[0] for _ in slot_idx]
        want = []
        for s, k, tok in zip(slot_idx, kind, tokens):
            if k == "decode":
                want.append(refs[s].step(tok))
            else:
                if k == "dense":
                    refs[s].advance_boundary(tok)
                want.append(False)
        is_decode = torch.tensor([k == "decode" for k in kind])
        advance = torch.tensor([k in ("decode", "dense") for k in kind])
        slow = decide_slow(torch.tensor(tokens), torch.tensor(slot_idx), is_decode, steps, has, lut_,
                           refresh=refresh, min_boundary_gap=min_gap, fire_at=fire_at,
                           sentence_cooldown=cooldown, trigger_state=state, advance=advance)
        mark_selected(steps, has, torch.tensor(slot_idx), slow)
        assert slow.tolist() == want, f"step {it}"
        assert steps.tolist() == [refs[s].since for s in range(slots)], f"step {it}"
        assert state.tolist() == [refs[s].state() for s in range(slots)], f"step {it}"
        assert has.tolist() == [refs[s].has for s in range(slots)], f"step {it}"
        fired += sum(want)
    assert fired > 20 and sum(r.boundary_fires for r in refs.values()) > 5
