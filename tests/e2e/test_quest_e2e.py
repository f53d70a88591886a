"""SFI with the Quest-style page selector (``sfi.selector = "quest"``) inside the real engine (CPU
build, PyTorch twins of the kernels)."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts, run_recorded
from vllm_ext.runner_hooks import table_of
from vllm_ext.methods.sfi.step_plan import (STAT_CONTEXT, STAT_DENSE, STAT_FAST, STAT_PREFILL_END,
                                     STAT_RETAINED, STAT_SLOW)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = random_prompts(lengths=(300, 40, 200), seed=5)
QUEST = {"enabled": True, "selector": "quest", "page_size": 8, "k": 16, "k_min": 4, "n_sink": 4,
         "n_recent": 16, "schedule": "periodic", "refresh": 1}
# SFI's prefill-end selection keeps 8 tokens; the pages fill the other 8 at every step
QUEST_KEEP = dict(QUEST, keep_prefill=8, select_span=2, select_span_back=1)


def _run(model, sfi=None, max_tokens=24, **kwargs):
    return run_recorded(model, sfi, PROMPTS, max_tokens, **kwargs)


@pytest.fixture(scope="module")
def dense_tokens(tiny_models):
    return _run(tiny_models["qwen3"], None)[0]


def test_quest_budget_covering_the_context_is_exactly_dense(tiny_models, dense_tokens):
    tokens, stats, _ = _run(tiny_models["qwen3"], dict(QUEST, k=1024))
    assert tokens == dense_tokens
    assert stats[STAT_FAST] == stats[STAT_SLOW] == 0 and stats[STAT_DENSE] > 0


# refresh 1 last: its engine (QUEST itself) is shared with the next test's plain run
@pytest.mark.parametrize("refresh", [4, 1])
def test_quest_small_budget_counts_its_rows(tiny_models, dense_tokens, refresh):
    tokens, stats, records = _run(tiny_models["qwen3"], dict(QUEST, refresh=refresh), shared=True)
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


def test_quest_with_kept_prefill_selection(tiny_models, dense_tokens):
    plain, _, _ = _run(tiny_models["qwen3"], QUEST, shared=True)       # the engine of the test above
    tokens, stats, records = _run(tiny_models["qwen3"], QUEST_KEEP)
    assert tokens != dense_tokens and tokens != plain        # the kept tokens change what is read
    assert stats[STAT_PREFILL_END] == len(PROMPTS)           # every prompt is longer than 4 + 16 + 16
    views = [v for step in records for v in step.values() if v["mode"] in ("slow", "fast")]
    assert stats[STAT_FAST] == stats[STAT_SLOW] == len(views) > 0
    # the kept tokens are part of the budget: the same reads as without them
    assert stats[STAT_RETAINED] == len(views) * (4 + 16 + 16)


def test_quest_rerank_covering_the_allowed_set_does_not_depend_on_the_page(tiny_models, dense_tokens):
    """``quest_rerank`` 16 x k 32 = 512 candidates cover every allowed set here (at most 300 + 24 - 4 -
    16 positions): the selection is the top-k by the group's attention mass whatever the page size,
    so pages of 8 and of 16 give the same tokens; plain Quest's pages give other ones."""
    rerank = dict(QUEST, k=32, quest_rerank=16)
    by8, stats, records = _run(tiny_models["qwen3"], rerank)
    by16, _, _ = _run(tiny_models["qwen3"], dict(rerank, page_size=16))
    plain, _, _ = _run(tiny_models["qwen3"], dict(QUEST, k=32, page_size=16))
    assert by8 == by16
    assert by8 != plain and by8 != dense_tokens
    views = [v for step in records for v in step.values() if v["mode"] in ("slow", "fast")]
    assert stats[STAT_FAST] == stats[STAT_SLOW] == len(views) > 0
    assert stats[STAT_RETAINED] == len(views) * (4 + 32 + 16)        # the budget is unchanged


@pytest.mark.parametrize("sfi", [QUEST, QUEST_KEEP], ids=["quest", "quest_keep"])
def test_quest_prefix_cache_hit_gives_the_same_tokens(tiny_models, sfi):
    # the second request hits the first one's cached blocks: its first own prefill chunk must write
    # the pages of the cached prefix too (else its page scores would read zeros); with keep_prefill
    # the hit stops before the prompt's last w_prefill positions (their queries make the kept set)
    with engine(tiny_models["qwen3"], "SPEEDSFI", additional_config={"speedsfi": {"sfi": sfi}},
                enable_prefix_caching=True) as llm:
        first = greedy(llm, PROMPTS[:1], max_tokens=24)
        greedy(llm, PROMPTS[2:], max_tokens=4)         # reuses the compact slot: its pages now differ
        again = greedy(llm, PROMPTS[:1], max_tokens=24)
        stats = table_of(model_runner(llm)).sfi.stats.tolist()
    assert first == again
    assert stats[STAT_SLOW] > 0


def test_quest_resumed_with_one_token_to_compute_keeps_its_tokens(tiny_models):
    """A small KV cache preempts and resumes requests. A resumed request takes a fresh slot; when the
    prefix cache holds all but its last token it decodes at once, and its first decode row must write
    every page of its context before selecting. Such a request gives the tokens of a run with room
    for everyone (refresh 1: no schedule phase to lose). A resume that recomputes generated tokens
    computes the last one in a dense prefill, so only the first kind is compared."""
    prompts = random_prompts(lengths=(200, 190, 180, 170), seed=11)
    extra = {"speedsfi": {"sfi": QUEST}}
    runs = {}
    # 23 blocks of 32 tokens: the requests also hold their compact block and their page bounds' blocks
    # (one per 256 tokens at page 8); a cache this size preempts and resumes some with one token to compute
    for name, kw in (("roomy", {}), ("pressed", {"num_gpu_blocks_override": 23})):
        with engine(tiny_models["qwen3"], "SPEEDSFI", max_num_seqs=4, max_model_len=512,
                    additional_config=extra, **kw) as llm:
            table = table_of(model_runner(llm))
            table.recorder = []
            runs[name] = (greedy(llm, prompts, max_tokens=120), table.recorder, table.counters.released)
    tokens, records, released = runs["pressed"]
    assert released > len(prompts), "no preemption happened: the test no longer tests resumes"
    # request index -> its generations (slot lives); a generation after the first that starts with
    # a decode row resumed with one token to compute
    order = {}
    first_rows = {}
    for step in records:
        for req, v in step.items():
            order.setdefault(req, len(order))
            first_rows.setdefault((req, v["generation"]), v)
    # (a resume whose prompt is a prefix hit but whose generated tokens are not recomputes them in a
    # row of several decode tokens: SFI runs it densely, so it is a recompute too)
    one_token = {order[req] for (req, gen), v in first_rows.items()
                 if gen > 1 and v["is_decode"] and v["q_len"] == 1}
    recomputed = {order[req] for (req, gen), v in first_rows.items()
                  if gen > 1 and (not v["is_decode"] or v["q_len"] > 1)}
    clean = one_token - recomputed
    assert clean, "no request resumed with one token to compute: the test no longer tests fresh slots"
    for i in sorted(clean):
        assert tokens[i] == runs["roomy"][0][i], f"request {i}"
