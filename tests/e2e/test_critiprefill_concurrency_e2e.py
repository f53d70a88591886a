"""CritiPrefill's per-request state is blocks of vLLM's KV cache (``vllm_ext.methods.critiprefill.
kv_spec``): no pool of ours caps the prompts in a sparse prefill (more than 4 at once, a default-sized slot pool's cap). Real vLLM,
CPU build, a tiny Qwen3 (2 layers, both sparse), a small KV cache and 16 prompts at once, a quarter
too short for CritiPrefill.

- vLLM's start-up concurrency counts the state pages of a ``max_model_len`` prompt;
- more than 4 prompts prefill sparsely in one step, each holding its state pages;
- only CritiPrefill prompts get state pages, which go back once each prompt is computed;
- every request finishes with all its tokens; request slots, prompts in a sparse prefill and KV
  blocks all come back to zero.
"""

import random

import pytest

from tests.e2e.engine import engine, leftover_after_probe, model_runner
from vllm_ext.runner_hooks import table_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CP = {"enabled": True, "segment_size": 64, "block_size": 16, "budget": 32, "min_len": 128,
      "dense_layers": []}
BLOCK = 32
NUM_BLOCKS = 240               # 7,680 tokens: the prompts' KV plus their state, not much more
MAX_LEN = 1024
MAX_TOKENS = 8
NUM_REQUESTS = 16


def _prompts():
    rng = random.Random(36)
    lengths = [rng.randrange(20, 100) if i % 4 == 0 else rng.randrange(200, 360) for i in range(NUM_REQUESTS)]
    return [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]


def _run(model, cp):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from vllm_ext import metrics

    prompts = _prompts()
    extra = {"speedsfi": {"critiprefill": cp}} if cp else {}
    metrics.reset()
    with engine(model, "SPEEDSFI", max_model_len=MAX_LEN, max_num_seqs=32, max_num_batched_tokens=8192,
                block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=False,
                additional_config=extra) as llm:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        mgr = sched.kv_cache_manager
        free0 = mgr.block_pool.get_num_free_blocks()
        concurrency = get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config, sched.kv_cache_config)
        table = table_of(model_runner(llm))
        steps = []
        if table.critiprefill is not None:
            plan = table.critiprefill.plan

            def recording_plan(**kw):
                st = plan(**kw)
                if st is not None:
                    steps.append(int(st.holds_state.sum()))
                return st

            table.critiprefill.plan = recording_plan
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        leftover = leftover_after_probe(llm, table, mgr, free0)
        counts = metrics.snapshot()
        specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
    print(f"SPEEDSFI {'CritiPrefill on' if cp else 'all off'}: start-up concurrency {concurrency:.3f}, "
          f"most prompts prefilling sparsely in one step {max(steps, default=0)}")
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], prompts=prompts, steps=steps,
                leftover=leftover, counts=counts, concurrency=concurrency, specs=specs)


@pytest.fixture(scope="module")
def runs(tiny_models):
    return _run(tiny_models["qwen3"], None), _run(tiny_models["qwen3"], CP)


def test_startup_concurrency_counts_the_state_pages(runs):
    from vllm_ext.methods.critiprefill.state_layout import state_pages

    dense, cp = runs
    names = [type(s).__name__ for s in cp["specs"]]
    assert names[0] == "FullAttentionSpec" and set(names[1:]) == {"CritiPrefillStateSpec"}
    state = [s for s in cp["specs"] if type(s).__name__ == "CritiPrefillStateSpec"][0]
    pages = state_pages(MAX_LEN, state.carry_entries, CP["block_size"], BLOCK)
    assert state.blocks_per_request == pages
    per_request = -(-MAX_LEN // BLOCK)
    groups = len(cp["specs"]) - 1                       # state groups beside the one attention group
    assert cp["concurrency"] == pytest.approx(dense["concurrency"] * per_request / (per_request + groups * pages))


def test_more_than_four_prompts_prefill_sparsely_at_once(runs):
    _, cp = runs
    c = cp["counts"]
    assert max(cp["steps"]) > 4, cp["steps"]                 # a default-sized slot pool's cap
    assert c.get("sched.critiprefill_admission_waits", 0) == 0
    assert c.get("fallback.critiprefill_no_state_blocks", 0) == 0
    assert c["critiprefill.sparse_segments"] > 0 and c["critiprefill.key_blocks_skipped"] > 0


def test_only_critiprefill_prompts_get_state_pages_and_give_them_back(runs):
    from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
    from vllm_ext.methods.critiprefill.chunking import is_critiprefill_prompt

    _, cp = runs
    c = cp["counts"]
    cfg = CritiPrefillConfig(**CP)
    long = sum(is_critiprefill_prompt(cfg, len(p)) for p in cp["prompts"])
    assert NUM_REQUESTS // 4 <= NUM_REQUESTS - long
    groups = len(cp["specs"]) - 1
    preempted = c.get("fallback.sfi_preempted", 0) + c.get("sched.preemptions", 0)
    assert long * groups <= c["critiprefill.state_allocations"] <= (long + preempted) * groups
    assert c["critiprefill.state_released_at_prefill_end"] >= long * groups - preempted * groups


def test_every_request_finishes_and_nothing_leaks(runs):
    for run in runs:
        assert [len(t) for t in run["tokens"]] == [MAX_TOKENS] * NUM_REQUESTS
        assert run["leftover"] == {"request slots": 0, "SFI slots": 0, "CritiPrefill slots": 0, "KV blocks": 0}
