"""Quest's page bounds are blocks of vLLM's KV cache (``vllm_ext.methods.sfi.quest_kv_spec``): no
bounds table sized by the request capacity at start-up. Real vLLM, CPU build, a tiny Qwen3, a small
KV cache and 40 requests at once, a third too short for SFI.

- vLLM's start-up concurrency counts a ``max_model_len`` request's bound-page blocks beside its KV
  and compact blocks;
- requests decode sparsely with Quest while holding their bound pages (no row without them);
- only requests that reach SFI's first length get bound pages (short ones never), each once;
- every request finishes with all its tokens; request slots, compact slots and KV blocks (bound
  pages included) all come back.
"""

import random

import pytest

from tests.e2e.engine import engine, leftover_after_probe, model_runner
from vllm_ext.runner_hooks import table_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUEST = {"enabled": True, "selector": "quest", "page_size": 8, "k": 16, "k_min": 4, "n_sink": 4,
         "n_recent": 16, "schedule": "periodic", "refresh": 4}
BLOCK = 32
NUM_BLOCKS = 150
MAX_LEN = 1024
MAX_TOKENS = 16
NUM_REQUESTS = 40


def _prompts():
    rng = random.Random(3636)
    lengths = [rng.randrange(3, 12) if i % 3 == 0 else rng.randrange(60, 400) for i in range(NUM_REQUESTS)]
    return [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def run(tiny_models):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from vllm_ext import metrics

    prompts = _prompts()
    metrics.reset()
    with engine(tiny_models["qwen3"], "SPEEDSFI", max_model_len=MAX_LEN, max_num_seqs=64,
                max_num_batched_tokens=4096, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                enable_prefix_caching=False, additional_config={"speedsfi": {"sfi": QUEST}}) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        mgr = sched.kv_cache_manager
        free0 = mgr.block_pool.get_num_free_blocks()
        concurrency = get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config, sched.kv_cache_config)
        table = table_of(model_runner(llm))
        quest = table.sfi.quest
        held = []
        gate = quest.gate

        def recording_gate(step, *args):
            out = gate(step, *args)
            if step.is_real and step.num_reqs:
                held.append(int(quest.held(step.group_tables, step.num_reqs).sum()))
            return out

        quest.gate = recording_gate
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        quest.gate = gate
        leftover = leftover_after_probe(llm, table, mgr, free0)
        counts = metrics.snapshot()
        specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
        num_blocks = sched.kv_cache_config.num_blocks
    print(f"SPEEDSFI quest: start-up concurrency {concurrency:.3f}, most bound-page blocks held in one "
          f"step {max(held, default=0)}")
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], prompts=prompts, held=held,
                leftover=leftover, counts=counts, concurrency=concurrency, specs=specs, num_blocks=num_blocks)


def test_startup_concurrency_counts_the_bound_pages(run):
    from vllm_ext.methods.sfi.quest_tables import quest_blocks

    names = [type(s).__name__ for s in run["specs"]]
    # refresh 4 leaves fast steps: the copy trigger (on by default) adds its token history's group
    assert sorted(names) == ["FullAttentionSpec", "SfiCompactSpec", "SfiHistorySpec", "SfiQuestPagesSpec"]
    by_name = dict(zip(names, run["specs"]))
    compact, quest, hist = by_name["SfiCompactSpec"], by_name["SfiQuestPagesSpec"], by_name["SfiHistorySpec"]
    assert quest.blocks_per_request == quest_blocks(MAX_LEN, 8, BLOCK) == 4
    assert compact.compact_blocks == 1                  # ceil((4 + 16) / 32); no prompt tail with quest
    # one int32 position per token, E = 32 x 2 KV heads x 2 x 32 x 4 B / 4 = 4096 per page
    assert hist.blocks_per_request == -(-MAX_LEN // (BLOCK * 2 * 2 * 32)) == 1
    per_request = (-(-MAX_LEN // BLOCK) + compact.compact_blocks + quest.blocks_per_request
                   + hist.blocks_per_request)
    assert run["concurrency"] == pytest.approx(run["num_blocks"] / per_request)


def test_quest_decodes_sparsely_holding_its_bound_pages(run):
    c = run["counts"]
    assert c["sfi.fast_steps"] > 0 and c["sfi.slow_steps"] > 0
    assert not c.get("fallback.sfi_no_quest_pages")
    assert max(run["held"]) > 0


def test_only_requests_reaching_the_first_length_get_bound_pages(run):
    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.state_pages import first_compact_len

    c = run["counts"]
    first = first_compact_len(SfiConfig(**QUEST))
    long = sum(len(p) + MAX_TOKENS >= first for p in run["prompts"])
    assert NUM_REQUESTS - long >= NUM_REQUESTS // 4
    resumes = c.get("fallback.sfi_preempted", 0)
    assert long <= c["sfi.quest_page_allocations"] <= long + resumes


def test_every_request_finishes_and_its_bound_pages_come_back(run):
    assert [len(t) for t in run["tokens"]] == [MAX_TOKENS] * NUM_REQUESTS
    assert run["leftover"] == {"request slots": 0, "SFI slots": 0, "CritiPrefill slots": 0, "KV blocks": 0}
