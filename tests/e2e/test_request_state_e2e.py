"""Per-request state inside the real engine: stable slots, prompt length, last sampled token on the
device, the steps-since-slow counter, and resets on finish, abort and preemption."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts
from vllm_ext.runner_hooks import table_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _by_request(records):
    """records: per-step {req_id: view} -> {req_id: [views in step order]}"""
    out = {}
    for step in records:
        for req_id, view in step.items():
            out.setdefault(req_id, []).append(view)
    return out


def _check_request(views, prompt, generated):
    assert {v["prompt_len"] for v in views} == {len(prompt)}
    assert len({v["slot"] for v in views}) == 1
    decode = [v for v in views if v["is_decode"]]
    # the first token comes from the last prefill step; every later one from a decode step whose
    # input (the row's last token) is the previously sampled token
    assert len(decode) == len(generated) - 1
    assert [v["last_token"] for v in decode] == generated[:-1]
    assert [v["steps_since_slow"] for v in decode] == list(range(1, len(decode) + 1))
    prefill = [v for v in views if not v["is_decode"]]
    assert prefill and prefill[-1]["last_token"] == prompt[-1]


def test_state_follows_requests_through_batches(tiny_models):
    prompts = random_prompts(lengths=(5, 300, 37), seed=7)
    with engine(tiny_models["qwen3"], "SPEEDSFI") as llm:
        table = table_of(model_runner(llm))
        table.recorder = []
        outs = greedy(llm, prompts, max_tokens=24)
        records = _by_request(table.recorder)
        # the worker hears of finished requests with the next step's scheduler output
        greedy(llm, [prompts[0]], max_tokens=2)
        still_held = set(table.slot_of) & set(records)
    assert len(records) == 3
    by_prompt_len = {views[0]["prompt_len"]: views for views in records.values()}
    for prompt, generated in zip(prompts, outs):
        _check_request(by_prompt_len[len(prompt)], prompt, generated)
    concurrent = [v for step in table.recorder for v in step.values()]
    assert len({v["slot"] for v in concurrent}) == 3          # three requests, three slots
    assert still_held == set()                                 # all finished, all released


def test_abort_releases_the_slot_and_reuse_starts_clean(tiny_models):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with engine(tiny_models["qwen3"], "SPEEDSFI", max_num_seqs=1) as llm:
        runner = model_runner(llm)
        eng = llm.llm_engine
        eng.add_request("victim", {"prompt_token_ids": random_prompts((20,), seed=1)[0]}, sp)
        for _ in range(12):
            eng.step()
        table = table_of(runner)
        (victim_id, slot), = table.slot_of.items()       # vLLM suffixes request ids internally
        assert victim_id.startswith("victim")
        assert int(table.decode_steps[slot]) >= 5
        eng.abort_request([victim_id], internal=True)
        table.recorder = []
        short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        eng.add_request("next", {"prompt_token_ids": random_prompts((9,), seed=2)[0]}, short)
        while eng.has_unfinished_requests():
            eng.step()
        by_req = _by_request(table.recorder)
    assert victim_id not in by_req and len(by_req) == 1
    (views,) = by_req.values()
    assert views[0]["slot"] == slot                            # the only slot, reused ...
    decode = [v for v in views if v["is_decode"]]
    assert [v["steps_since_slow"] for v in decode] == list(range(1, len(decode) + 1))  # ... clean
    assert table.counters.released >= 1 and victim_id not in table.slot_of


def test_preemption_resets_state_and_keeps_tokens_exact(tiny_models):
    """A KV cache of 20 blocks of 32 tokens cannot hold four 200-token prompts plus 120 generated
    tokens each: the scheduler preempts (recompute) and resumes requests."""
    prompts = random_prompts(lengths=(200, 190, 180, 170), seed=11)
    kw = dict(num_gpu_blocks_override=20, max_num_seqs=4, max_model_len=512)
    with engine(tiny_models["qwen3"], "SPEEDSFI", **kw) as llm:
        table = table_of(model_runner(llm))
        table.recorder = []
        ours = greedy(llm, prompts, max_tokens=120)
        records = _by_request(table.recorder)
        counters = table.counters
    with engine(tiny_models["qwen3"], "CPU_ATTN", **kw) as llm:
        reference = greedy(llm, prompts, max_tokens=120)
    assert ours == reference
    restarted = 0
    for views in records.values():
        counts = [v["steps_since_slow"] for v in views if v["is_decode"]]
        restarted += sum(1 for a, b in zip(counts, counts[1:]) if b <= a)
        gens = [v["generation"] for v in views]
        assert gens == sorted(gens)
    assert restarted > 0, "no preemption happened: the test no longer tests resets"
    assert counters.released > len(prompts)
