"""As many requests at once as dense: SFI's compact segments are blocks of vLLM's KV cache
(``vllm_ext.methods.sfi.kv_spec``), so under a load the KV cache limits, SPEEDSFI with SFI on runs about as
many requests at once as with every method off, less exactly its compact-group blocks (compact segment + prompt-tail queries); no pool of ours
caps it (more than 32 at once, a default-sized slot pool's cap). Real vLLM, CPU build, a tiny Qwen3, a small KV
cache and 80 concurrent requests of mixed lengths, short ones included.

- vLLM's start-up concurrency counts the compact blocks: ``blocks(L) / (blocks(L) + n_c)`` of dense's;
- the most requests one step runs with SFI is at least dense's x ``ctx / (ctx + n_c * block_size)``
  (``ctx``: the requests' mean length), and above 32 (a default-sized slot pool's cap);
- only requests whose length reaches ``first_compact_len`` (earlier for a prompt long enough to select: ``vllm_ext.methods.sfi.state_pages.first_state_len``) get compact blocks (short ones never);
- every request finishes with all its tokens, and request slots, compact slots and KV blocks all
  come back.
"""

import random

import pytest

from tests.e2e.engine import engine, leftover_after_probe, model_runner
from vllm_ext.runner_hooks import table_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFI = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 32, "refresh": 8}
BLOCK = 32
NUM_BLOCKS = 260               # about 50 of these requests at once: the KV cache is the limit
MAX_TOKENS = 24
NUM_REQUESTS = 80


def _requests():
    rng = random.Random(36)
    # a third short (a chat question: 3-12 tokens, never reaching SFI's first compact length), the
    # rest 60-400 tokens
    lengths = [rng.randrange(3, 12) if i % 3 == 0 else rng.randrange(60, 400) for i in range(NUM_REQUESTS)]
    return [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]


def _run(model, sfi):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from vllm_ext import metrics

    prompts = _requests()
    extra = {"speedsfi": {"sfi": sfi}} if sfi else {}
    metrics.reset()
    with engine(model, "SPEEDSFI", max_model_len=1024, max_num_seqs=96, max_num_batched_tokens=4096,
                block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, enable_prefix_caching=False,
                additional_config=extra) as llm:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        mgr = sched.kv_cache_manager
        free0 = mgr.block_pool.get_num_free_blocks()
        concurrency = get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config,
                                                              sched.kv_cache_config)
        table = table_of(model_runner(llm))
        table.recorder = []
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        records = table.recorder
        table.recorder = None
        leftover = leftover_after_probe(llm, table, mgr, free0)
        counts = metrics.snapshot()
        groups = [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]
    print(f"SPEEDSFI {'SFI on' if sfi else 'all off'}: start-up concurrency {concurrency:.3f}, "
          f"peak requests in one step {max(len(step) for step in records)}")
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], prompts=prompts,
                peak=max(len(step) for step in records), leftover=leftover, counts=counts,
                concurrency=concurrency, groups=groups)


@pytest.fixture(scope="module")
def runs(tiny_models):
    return _run(tiny_models["qwen3"], None), _run(tiny_models["qwen3"], SFI)


def state_blocks() -> int:
    """Blocks of the compact group per request for the tiny Qwen3 (4 query / 2 KV heads, head 32,
    fp32): the compact segment and the prompt-tail queries (``vllm_ext.methods.sfi.state_pages``)."""
    import torch

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.state_pages import sfi_state_pages

    pages = sfi_state_pages(SfiConfig(**SFI), block_size=BLOCK, num_kv_heads=2, head_size=32, num_heads=4,
                            cache_dtype=torch.float32, act_dtype=torch.float32)
    assert (pages.segment, pages.kept, pages.tail) == (1, 0, 1)
    return pages.total


def history_blocks(max_len: int = 1024) -> int:
    """Blocks of the copy trigger's history group per request (on by default: sfi.copy_ngram 2):
    ``cdiv(t, E)`` with ``E`` the int32 positions of one page of the attention format (block 32 x
    2 KV heads x (K + V) 2 x head 32, fp32: 16 KiB, E = 4096): 1 at up to 1024 tokens."""
    e = BLOCK * 2 * 2 * 32 * 4 // 4
    return -(-max_len // e)


def test_startup_concurrency_counts_the_compact_blocks(runs):
    dense, sfi = runs
    assert dense["groups"] == ["FullAttentionSpec"]
    # the copy trigger (on by default) adds its token history's group
    assert sorted(sfi["groups"]) == ["FullAttentionSpec", "SfiCompactSpec", "SfiHistorySpec"]
    per_request = -(-1024 // BLOCK)                       # a max_model_len request, in blocks
    n_c = state_blocks() + history_blocks()
    assert sfi["concurrency"] == pytest.approx(dense["concurrency"] * per_request / (per_request + n_c))


def test_sfi_runs_as_many_requests_at_once_as_dense_less_its_blocks(runs):
    dense, sfi = runs
    ctx = sum(len(p) + MAX_TOKENS for p in dense["prompts"]) / len(dense["prompts"])
    n_c = state_blocks() + history_blocks()               # (every context here fits one history page)
    assert dense["peak"] > 32, "the KV cache, not max_num_seqs, must limit dense here"
    assert dense["peak"] < NUM_REQUESTS
    assert sfi["peak"] >= dense["peak"] * ctx / (ctx + n_c * BLOCK), (sfi["peak"], dense["peak"])
    assert sfi["peak"] > 32                               # a default-sized slot pool's cap
    assert sfi["counts"].get("sched.sfi_admission_waits", 0) == 0
    assert sfi["counts"]["sfi.fast_steps"] > 0 and sfi["counts"]["sfi.slow_steps"] > 0


def test_only_requests_that_can_go_sparse_get_compact_blocks(runs):
    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.state_pages import first_compact_len, first_state_len, tail_window

    _, sfi = runs
    cfg = SfiConfig(**SFI)
    first, tail = first_compact_len(cfg), tail_window(cfg)
    long = sum(len(p) + MAX_TOKENS >= first_state_len(first, tail, len(p)) for p in sfi["prompts"])
    short = len(sfi["prompts"]) - long
    assert short >= NUM_REQUESTS // 4
    resumes = sfi["counts"].get("fallback.sfi_preempted", 0)
    assert long <= sfi["counts"]["sfi.compact_allocations"] <= long + resumes
    # every prompt that selects at its prefill end held its blocks from its first tail query on
    # (chunks of 4096 tokens: whole prompts here; test_serving_traffic splits them)
    # (a request resumed after preemption recomputes its prompt and selects again)
    selecting = sum(len(p) > cfg.n_sink + cfg.n_recent + cfg.k for p in sfi["prompts"])
    assert selecting <= sfi["counts"]["sfi.prefill_end_selections"] <= selecting + resumes, \
        (sfi["counts"]["sfi.prefill_end_selections"], selecting, resumes)
    assert not sfi["counts"].get("fallback.sfi_prompt_tail_lost")
    assert not sfi["counts"].get("fallback.sfi_no_compact_blocks")


def test_every_request_finishes_and_nothing_leaks(runs):
    for run in runs:
        assert [len(t) for t in run["tokens"]] == [MAX_TOKENS] * NUM_REQUESTS
        assert run["leftover"] == {"request slots": 0, "SFI slots": 0, "CritiPrefill slots": 0, "KV blocks": 0}
