"""SFI's copy-trigger token history is blocks of vLLM's KV cache (``vllm_ext.methods.sfi.
history_kv_spec``), not a ``[max_num_seqs + 1, max_model_len]`` table of ours. Real vLLM, CPU build, a
tiny Qwen3 (2 layers), a small KV cache and 24 requests of mixed lengths at once, with
``sfi.copy_ngram`` on and off:

- with the trigger's default (``copy_ngram`` unset: on), vLLM groups the history layers in a group of their own, and its start-up concurrency counts a
  ``max_model_len`` request's history pages (``cdiv(L, E)`` per history group);
- every request gets its history pages from its first chunk (counted once per request and group),
  no row ever lacks them, and what each step reads in its request's pages is exactly the tokens the
  request has computed;
- every request finishes with all its tokens, and request slots, SFI slots and KV blocks (history
  pages included) all come back;
- on a KV cache small enough to preempt, a resumed request records its history again from position 0
  in new pages, and everything still comes back;
- with prefix caching, a request whose prompt hits the cache (the second pass of the same prompts)
  gets the hit's positions written from the runner's host token ids at its first chunk
  (``HistorySlots.backfill``): its run starts at 0 and its pages hold every position, as without
  the hit, so the trigger does not depend on what other traffic left in the cache.
"""

import random

import pytest

from tests.e2e.engine import engine, leftover_after_probe, model_runner
from vllm_ext.runner_hooks import table_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFI = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 32, "refresh": 8}
BLOCK, NUM_BLOCKS, MAX_LEN, MAX_TOKENS, NUM_REQUESTS = 32, 200, 1024, 12, 24


def _prompts():
    rng = random.Random(36)
    lengths = [rng.randrange(3, 12) if i % 3 == 0 else rng.randrange(60, 300) for i in range(NUM_REQUESTS)]
    prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]
    for p in prompts[1::3]:                      # a span stated once and repeated at the end
        if len(p) > 50:
            p[-4:] = p[10:14]
    return prompts


def _run(model, sfi, num_blocks=NUM_BLOCKS, passes=1, prefix_caching=False):
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from vllm_ext import metrics

    prompts = _prompts()
    metrics.reset()
    with engine(model, "SPEEDSFI", max_model_len=MAX_LEN, max_num_seqs=32, max_num_batched_tokens=2048,
                block_size=BLOCK, num_gpu_blocks_override=num_blocks, enable_prefix_caching=prefix_caching,
                additional_config={"speedsfi": {"sfi": sfi}}) as llm:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        mgr = sched.kv_cache_manager
        free0 = mgr.block_pool.get_num_free_blocks()
        concurrency = get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config, sched.kv_cache_config)
        runner = model_runner(llm)
        table = table_of(runner)
        checked = {"rows": 0, "positions": 0, "hits": 0}
        if _copy_on(sfi):
            copy_rows = table.sfi.copy_rows

            def checking_copy_rows(step, sfi_rows, sfi_on):
                out = copy_rows(step, sfi_rows, sfi_on)
                if step.is_real:
                    _check_history(runner, table, step, checked)
                return out

            table.sfi.copy_rows = checking_copy_rows
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for _ in range(passes):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        leftover = leftover_after_probe(llm, table, mgr, free0)
        counts = metrics.snapshot()
        specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
    print(f"SPEEDSFI SFI{' + copy trigger' if _copy_on(sfi) else ''}: start-up concurrency "
          f"{concurrency:.3f}; history rows checked {checked['rows']}, positions {checked['positions']}")
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], leftover=leftover, counts=counts,
                concurrency=concurrency, specs=specs, checked=checked)


def _copy_on(sfi) -> bool:
    from vllm_ext.config import SpeedSfiConfig

    return bool(SpeedSfiConfig.from_dict({"sfi": sfi}).sfi.resolved_copy_ngram)


def _check_history(runner, table, step, checked) -> None:
    """Each real row whose request holds its history: the pages hold the request's tokens at every
    position of its recorded run (the prompt and the generated tokens known on the host)."""
    hs = table.sfi.history_slots
    for row in range(step.num_reqs):
        rid = runner.input_batch.req_ids[row]
        slot = table.sfi.slot_host.get(table.slot_of[rid])
        if slot is None:
            continue
        state = runner.requests[rid]
        tokens = list(state.prompt_token_ids) + list(state.output_token_ids)
        seq = int(step.seq_lens[row])
        first, upto = int(hs.first_pos[slot]), int(hs.upto[slot])
        computed = int(runner.input_batch.num_computed_tokens_cpu[row])
        assert upto == seq and first <= computed, (rid, first, upto, seq)
        checked["hits"] += first > 0
        got = hs.history.read(slot)[first:seq].tolist()
        known = [(g, w) for g, w in zip(got, tokens[first:seq]) if w >= 0]
        assert all(g == w for g, w in known), rid
        checked["rows"] += 1
        checked["positions"] += len(known)


@pytest.fixture(scope="module")
def runs(tiny_models):
    # off explicitly; on by default (copy_ngram unset: 2, copy_once)
    return _run(tiny_models["qwen3"], {**SFI, "copy_ngram": 0}), _run(tiny_models["qwen3"], SFI)


def test_startup_concurrency_counts_the_history_pages(runs):
    plain, copy = runs
    names = [type(s).__name__ for s in copy["specs"]]
    assert "SfiHistorySpec" not in [type(s).__name__ for s in plain["specs"]]
    hist = [s for s in copy["specs"] if type(s).__name__ == "SfiHistorySpec"]
    assert hist and len(names) == len(plain["specs"]) + len(hist)
    e = hist[0].page_elems
    assert e == 2 * BLOCK * 64                          # 2 KV heads x block x 2 x 32 fp32 -> int32
    pages = -(-MAX_LEN // e)
    assert hist[0].blocks_per_request == pages == 1
    # the same pool (num_gpu_blocks_override): a max_model_len request holds `pages` more blocks per
    # history group than without the copy trigger
    plain_per_request = NUM_BLOCKS / plain["concurrency"]
    assert copy["concurrency"] == pytest.approx(NUM_BLOCKS / (plain_per_request + len(hist) * pages))


def test_every_request_gets_its_history_pages_and_they_hold_its_tokens(runs):
    _, copy = runs
    c = copy["counts"]
    groups = len([s for s in copy["specs"] if type(s).__name__ == "SfiHistorySpec"])
    preempted = c.get("fallback.sfi_preempted", 0)
    # every request and the probe, once per history group (a resume after preemption again)
    assert (NUM_REQUESTS + 1) * groups <= c["sfi.history_allocations"] <= (NUM_REQUESTS + 1 + preempted) * groups
    assert c.get("fallback.sfi_no_history_pages", 0) == 0
    assert copy["checked"]["rows"] >= NUM_REQUESTS and copy["checked"]["positions"] > 2000
    assert copy["checked"]["hits"] == 0                   # no prefix caching: every run from position 0


def test_every_request_finishes_and_nothing_leaks(runs):
    for run in runs:
        assert [len(t) for t in run["tokens"]] == [MAX_TOKENS] * NUM_REQUESTS
        assert run["leftover"] == {"request slots": 0, "SFI slots": 0, "CritiPrefill slots": 0, "KV blocks": 0}


@pytest.fixture(scope="module")
def tight(tiny_models):
    return _run(tiny_models["qwen3"], {**SFI, "copy_ngram": 3}, num_blocks=60)


def test_preempted_requests_record_again_and_give_everything_back(tight):
    c = tight["counts"]
    assert c.get("fallback.sfi_preempted", 0) > 0, c
    assert c.get("fallback.sfi_no_history_pages", 0) == 0
    assert tight["checked"]["rows"] >= NUM_REQUESTS and tight["checked"]["hits"] == 0
    assert [len(t) for t in tight["tokens"]] == [MAX_TOKENS] * NUM_REQUESTS
    assert tight["leftover"] == {"request slots": 0, "SFI slots": 0, "CritiPrefill slots": 0, "KV blocks": 0}


@pytest.fixture(scope="module")
def cached(tiny_models):
    return _run(tiny_models["qwen3"], {**SFI, "copy_ngram": 3}, passes=2, prefix_caching=True)


def test_prefix_cache_hits_are_backfilled_and_record_from_position_0(cached):
    # the second pass hit the cache (its positions were backfilled), and still every row's run
    # starts at 0 with the pages holding the request's tokens at every position (_check_history)
    assert cached["counts"].get("sfi.history_backfilled_tokens", 0) > 0
    assert cached["checked"]["hits"] == 0 and cached["checked"]["rows"] >= 2 * NUM_REQUESTS
    assert cached["counts"].get("fallback.sfi_no_history_pages", 0) == 0
    assert [len(t) for t in cached["tokens"]] == [MAX_TOKENS] * NUM_REQUESTS
    assert cached["leftover"]["request slots"] == 0 and cached["leftover"]["SFI slots"] == 0
