"""The scheduler's admission and chunk rules (vllm_ext.scheduler_policy) on fake vLLM requests: the
worker's pools never overflow (so no request is served densely for lack of a slot), requests held
back are admitted as soon as a slot frees, and a simulated scheduler under random budgets and
preemptions always finishes every prompt with chunks that never cut a sparse segment."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vllm_ext import metrics
from vllm_ext.config import SpeedSfiConfig
from vllm_ext.methods.critiprefill.chunking import is_critiprefill_chunk, sparse_range
from vllm_ext.methods.critiprefill.scheduling import CritiPrefillSchedulingRule
from vllm_ext.methods.sfi.scheduling import SfiSchedulingRule
from vllm_ext.scheduler_policy import SchedulerPolicy

CP = {"enabled": True, "segment_size": 64, "block_size": 16, "budget": 32, "min_len": 100}


class Req:
    def __init__(self, plen, overrides=None):
        self.num_prompt_tokens = plen
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.sampling_params = SimpleNamespace(extra_args={"speedsfi": overrides} if overrides else None)


def _policy(sfi_cap=0, cp_cap=0, sfi=None, cp_on=None):
    cfg = SpeedSfiConfig.from_dict({"sfi": sfi or {"enabled": bool(sfi_cap), "k": 64},
                                    "critiprefill": dict(CP, enabled=bool(cp_cap) if cp_on is None else cp_on)})
    return SchedulerPolicy([SfiSchedulingRule(cfg, sfi_cap),
                            CritiPrefillSchedulingRule(cfg.critiprefill, cp_cap) if cfg.critiprefill.enabled
                            else None])


def test_sfi_admission_waits_for_a_free_compact_slot():
    metrics.reset()
    p = _policy(sfi_cap=2)
    running = [Req(50), Req(60)]
    new, opted_out = Req(70), Req(70, {"sfi": {"enabled": False}})
    assert p.limit_chunk(new, 0, 70, admitted=False, running=running) == 0
    assert metrics.snapshot()["sched.sfi_admission_waits"] == 1
    # a request that turns SFI off takes no slot and is not held back; running requests never are
    assert p.limit_chunk(opted_out, 0, 70, admitted=False, running=running) == 70
    assert p.limit_chunk(running[0], 10, 40, admitted=True, running=running) == 40
    running.pop()                                     # one finished: its slot is free next step
    assert p.limit_chunk(new, 0, 70, admitted=False, running=running) == 70


def test_sfi_admission_follows_per_request_overrides_into_an_sfi_off_engine():
    p = _policy(sfi_cap=0, cp_cap=1)
    assert p.rule("sfi") is None                                     # no bound, no rule to apply
    rule = SfiSchedulingRule(SpeedSfiConfig.from_dict({"critiprefill": dict(CP, enabled=True)}), 0)
    assert not rule.wants_sfi(Req(10, {"sfi": {"enabled": True}}))   # the engine has no SFI slots


def test_invalid_override_counts_as_the_engine_setting():
    p = _policy(sfi_cap=1)
    assert p.rule("sfi").wants_sfi(Req(10, {"sfi": {"k": -3}}))


def test_critiprefill_without_max_requests_holds_nothing_back_but_still_aligns_chunks():
    """The default: each prompt's state is KV-cache pages (vLLM admits by its block accounting),
    so no sparse prefill waits for another; the chunk rules stay (answers never depend on chunking)."""
    metrics.reset()
    p = _policy(cp_on=True)
    assert p.active and not p.rule("critiprefill").capacity
    running = [Req(1000) for _ in range(8)]
    for r in running:
        assert p.limit_chunk(r, 0, 128, admitted=False, running=running) == 128
        r.num_computed_tokens = 128
    assert p.limit_chunk(running[0], 128, 100, admitted=True, running=running) == 64   # segment end
    assert metrics.snapshot().get("sched.critiprefill_admission_waits", 0) == 0


def test_critiprefill_admission_holds_one_sparse_prefill_per_slot():
    p = _policy(cp_cap=1)
    a, b = Req(1000), Req(1000)
    running = [a, b]
    assert p.limit_chunk(a, 0, 128, admitted=True, running=running) == 128      # takes the slot
    a.num_computed_tokens = 128
    assert p.limit_chunk(b, 0, 64, admitted=True, running=running) == 0          # waits for a
    short = Req(120)                                                             # no sparse range
    assert p.limit_chunk(short, 0, 120, admitted=False, running=running) == 120
    a.num_computed_tokens = 1000                                                 # a's prefill ended
    assert p.limit_chunk(b, 0, 64, admitted=True, running=running) == 64
    # preemption gives the slot back (the worker releases it when the request leaves the batch)
    c = Req(1000)
    b.num_preemptions, b.num_computed_tokens = 1, 0
    assert p.limit_chunk(c, 0, 128, admitted=False, running=running + [c]) == 128


@pytest.mark.parametrize("seed", range(4))
def test_simulated_scheduler_never_overflows_and_always_finishes(seed):
    """vLLM's loop reduced to what the policy sees: running requests first (prefills and decodes),
    then waiting ones in order; random budgets and preemptions. The worker's pools, replayed from
    the scheduled chunks as the worker sees them (vllm_ext.methods.critiprefill.slots.CritiPrefillSlots.plan,
    vllm_ext.methods.sfi.slot_tables), never overflow; every chunk end is on a segment boundary of the
    sparse range or outside it; every request finishes."""
    rng = random.Random(seed)
    p = _policy(sfi_cap=3, cp_cap=2, sfi={"enabled": True, "k": 64})
    cfg = p.rule("critiprefill").cfg
    waiting = [Req(rng.choice([50, 300, 700, 1300]), {"sfi": {"enabled": False}} if rng.random() < 0.3 else None)
               for _ in range(30)]
    for r in waiting:
        r.decode_left = rng.randint(1, 6)
    running, done, cp_held = [], [], set()
    for step in range(5000):
        if not waiting and not running:
            break
        budget = rng.randint(64, 400)
        cp_held = {id(r) for r in running if id(r) in cp_held and r.num_computed_tokens < r.num_prompt_tokens}
        scheduled = {}
        for r in list(running):
            want = min(r.num_prompt_tokens - r.num_computed_tokens, budget) \
                if r.num_computed_tokens < r.num_prompt_tokens else min(1, budget)
            n = p.limit_chunk(r, r.num_computed_tokens, want, admitted=True, running=running)
            if n:
                scheduled[id(r)] = (r, n)
                budget -= n
        while waiting and budget > 0:
            r = waiting[0]
            n = p.limit_chunk(r, 0, min(r.num_prompt_tokens, budget), admitted=False, running=running)
            if not n:
                break
            waiting.pop(0)
            running.append(r)
            scheduled[id(r)] = (r, n)
            budget -= n
        # the worker's view of this step
        assert sum(p.rule("sfi").wants_sfi(r) for r in running) <= p.rule("sfi").capacity
        for r, n in scheduled.values():
            c = r.num_computed_tokens
            if c < r.num_prompt_tokens:
                lo, hi = sparse_range(cfg, r.num_prompt_tokens)
                end = c + n
                assert end >= r.num_prompt_tokens or end % cfg.segment_size == 0 \
                    or not lo <= end - end % cfg.segment_size < hi
                if is_critiprefill_chunk(cfg, r.num_prompt_tokens, c, n):
                    cp_held.add(id(r))
        assert len(cp_held) <= p.rule("critiprefill").capacity
        for r, n in scheduled.values():
            if r.num_computed_tokens >= r.num_prompt_tokens:
                r.decode_left -= 1
            r.num_computed_tokens += n
            if r.decode_left == 0:
                running.remove(r)
                done.append(r)
        if running and rng.random() < 0.05:                       # preempt the newest
            r = running.pop()
            r.num_computed_tokens, r.num_preemptions = 0, r.num_preemptions + 1
            cp_held.discard(id(r))
            waiting.insert(0, r)
    assert len(done) == 30 and not waiting and not running
