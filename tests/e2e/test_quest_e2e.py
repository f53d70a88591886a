"""SFI with the Quest-style page selector (``sfi.selector = "quest"``) inside the real engine (CPU
build, PyTorch twins of the kernels)."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts
from vllm_ext.runner_hooks import table_of
from vllm_ext.sfi.step_plan import (STAT_CONTEXT, STAT_DENSE, STAT_FAST, STAT_PREFILL_END,
                                     STAT_RETAINED, STAT_SLOW)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = random_prompts(lengths=(300, 40, 200), seed=5)
QUEST = {"enabled": True, "selector": "quest", "page_size": 8, "k": 16, "k_min": 4, "n_sink": 4,
         "n_recent": 16, "schedule": "periodic", "refresh": 1}


def _run(model, sfi=None, max_tokens=24):
    extra = {"speedsfi": {"sfi": sfi}} if sfi is not None else {}
    with engine(model, "SPEEDSFI", additional_config=extra) as llm:
        table = table_of(model_runner(llm))
        table.recorder = []
        tokens = greedy(llm, PROMPTS, max_tokens=max_tokens)
        stats = table.sfi_stats.tolist() if table.sfi is not None else None
        records = table.recorder
    return tokens, stats, records


@pytest.fixture(scope="module")
def dense_tokens(tiny_models):
    return _run(tiny_models["qwen3"], None)[0]


def test_quest_budget_covering_the_context_is_exactly_dense(tiny_models, dense_tokens):
    tokens, stats, _ = _run(tiny_models["qwen3"], dict(QUEST, k=1024))
    assert tokens == dense_tokens
    assert stats[STAT_FAST] == stats[STAT_SLOW] == 0 and stats[STAT_DENSE] > 0


@pytest.mark.parametrize("refresh", [1, 4])
def test_quest_small_budget_counts_its_rows(tiny_models, dense_tokens, refresh):
    tokens, stats, records = _run(tiny_models["qwen3"], dict(QUEST, refresh=refresh))
    assert tokens != dense_tokens                      # the comparison is sensitive
    assert stats[STAT_PREFILL_END] == 0                # the first decode step selects
    views = [v for step in records for v in step.values() if v["mode"] in ("slow", "fast")]
    n_sel = sum(v["mode"] == "slow" for v in views)
    # a selection row also attends sparsely: it is counted as a fast row and a slow step
    assert stats[STAT_FAST] == len(views) > 0 and stats[STAT_SLOW] == n_sel > 0
    if refresh == 1:
        assert n_sel == len(views)
    else:
        assert 0 < n_sel < len(views)
    # every sparse row reads n_sink + k + n_recent of its t tokens (|A| > k for every such row)
    assert stats[STAT_RETAINED] == len(views) * (4 + 16 + 16)
    assert 0.05 < stats[STAT_RETAINED] / stats[STAT_CONTEXT] < 0.5


def test_quest_prefix_cache_hit_gives_the_same_tokens(tiny_models):
    # the second request hits the first one's cached blocks: its first own prefill chunk must write
    # the pages of the cached prefix too (else its page scores would read zeros)
    with engine(tiny_models["qwen3"], "SPEEDSFI", additional_config={"speedsfi": {"sfi": QUEST}},
                enable_prefix_caching=True) as llm:
        first = greedy(llm, PROMPTS[:1], max_tokens=24)
        greedy(llm, PROMPTS[2:], max_tokens=4)         # reuses the compact slot: its pages now differ
        again = greedy(llm, PROMPTS[:1], max_tokens=24)
        stats = table_of(model_runner(llm)).sfi_stats.tolist()
    assert first == again
    assert stats[STAT_SLOW] > 0
