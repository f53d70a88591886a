"""SFI inside the real engine (CPU build, PyTorch twins of the kernels)."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts, run_recorded
from vllm_ext.runner_hooks import table_of
from vllm_ext.methods.sfi.step_plan import (STAT_CONTEXT, STAT_DENSE, STAT_FAST, STAT_PREFILL_END,
                                     STAT_RETAINED, STAT_SLOW)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = random_prompts(lengths=(300, 40, 200), seed=3)
SMALL = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8}


def _run(model, sfi=None, max_tokens=40, params=None, prompts=PROMPTS, **kwargs):
    return run_recorded(model, sfi, prompts, max_tokens, params, **kwargs)


def _run_small(model, **kwargs):
    """SMALL on the engine shared by the tests that follow each other here (the small-budget test, the
    per-request override test): this run's counters, the prefix cache emptied first."""
    return _run(model, SMALL, shared=True, **kwargs)


@pytest.fixture(scope="module")
def dense_tokens(tiny_models):
    return _run(tiny_models["qwen3"], None)[0]


def test_budget_covering_the_context_is_exactly_dense(tiny_models, dense_tokens):
    tokens, stats, _ = _run(tiny_models["qwen3"], {"enabled": True, "k": 1024})
    assert tokens == dense_tokens
    assert stats[STAT_FAST] == stats[STAT_SLOW] == 0 and stats[STAT_DENSE] > 0


def test_steps_with_every_row_dense_run_as_every_method_off(tiny_models, dense_tokens, monkeypatch):
    # a budget covering the context: every decode row dense, so no layer call of a pure-decode step
    # binds SFI's pages or runs its hooks (the layer goes through CPU_ATTN's kernels as with every
    # method off) where the cache is CPU_ATTN's pages; the tokens are dense's either way
    from vllm_ext.backend.dense_path import CpuAttnDense
    from vllm_ext.methods.sfi.layer import SfiLayer

    calls = {"idle": 0, "hooks": 0}
    forward_all, bind = CpuAttnDense.forward_all, SfiLayer.bind

    def counted_forward_all(self, *a, methods_idle=False, **k):
        out = forward_all(self, *a, methods_idle=methods_idle, **k)
        calls["idle"] += methods_idle and out is not None
        return out

    def counted_bind(self, layer_name, md, plan):
        calls["hooks"] += not md.num_prefills
        return bind(self, layer_name, md, plan)

    monkeypatch.setattr(CpuAttnDense, "forward_all", counted_forward_all)
    monkeypatch.setattr(SfiLayer, "bind", counted_bind)
    tokens, stats, _ = _run(tiny_models["qwen3"], {"enabled": True, "k": 1024})
    assert tokens == dense_tokens
    assert stats[STAT_FAST] == stats[STAT_SLOW] == 0
    from vllm_ext import metrics

    if metrics.snapshot().get("steps.dense_cpu_attn"):        # the cache is CPU_ATTN's pages
        assert calls["idle"] > 0 and calls["hooks"] == 0, calls


def test_small_budget_runs_fast_steps_with_the_configured_retention(tiny_models, dense_tokens):
    tokens, stats, records = _run_small(tiny_models["qwen3"])          # the engine's first run
    assert stats[STAT_FAST] > stats[STAT_SLOW] > 0
    assert tokens != dense_tokens                      # the comparison is sensitive
    # every fast row keeps n_sink + k + n_recent of its t tokens (|A| > k for every row here)
    views = [v for step in records for v in step.values() if v["mode"] == "fast"]
    assert len(views) == stats[STAT_FAST]
    assert stats[STAT_RETAINED] == len(views) * (4 + 8 + 16)
    fraction = stats[STAT_RETAINED] / stats[STAT_CONTEXT]
    assert 0.05 < fraction < 0.5
    from vllm_ext import metrics

    counts = metrics.snapshot()             # what the logs and /metrics report
    assert counts["sfi.fast_steps"] == stats[STAT_FAST] and counts["sfi.slow_steps"] == stats[STAT_SLOW]
    assert f"mean retained fraction {fraction:.3f}" in metrics.summary(counts)


def test_per_request_override_and_capacity_fallback(tiny_models, dense_tokens):
    from vllm import SamplingParams

    from vllm_ext import metrics

    # (the shared SMALL engine's runs first, while it is up: the engine below closes it)
    unlimited, _, _ = _run_small(tiny_models["qwen3"])
    # a request that turns SFI off decodes exactly like dense
    off = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                         extra_args={"speedsfi": {"sfi": {"enabled": False}}})
    tokens, stats, _ = _run_small(tiny_models["qwen3"], params=off)
    assert tokens == dense_tokens and stats[STAT_FAST] == 0
    metrics.reset()
    # max_requests=1: one request holds the only compact slot; the scheduler holds the others in its
    # queue until it frees (vllm_ext.scheduler_policy), so every request decodes with SFI and gives
    # the tokens it gives with a slot for everyone
    tokens, stats, records = _run(tiny_models["qwen3"], dict(SMALL, max_requests=1))
    counts = metrics.snapshot()
    assert counts.get("fallback.sfi_capacity", 0) == 0 and counts["sched.sfi_admission_waits"] > 0
    assert max(len(step) for step in records) == 1             # one request in the engine at a time
    assert tokens == unlimited


def test_periodic_schedule_refreshes_every_r_steps(tiny_models):
    sfi = dict(SMALL, schedule="periodic", refresh=5)
    _, stats, records = _run(tiny_models["qwen3"], sfi, max_tokens=30)
    by_req = {}
    for step in records:
        for req, v in step.items():
            if v["is_decode"]:
                by_req.setdefault(req, []).append(v["mode"])
    assert stats[STAT_PREFILL_END] == len(PROMPTS)   # every prompt is longer than 4 + 16 + 8
    for modes in by_req.values():
        sparse = [m for m in modes if m != "dense"]
        # the prefill's last queries made the first selection: fast until the refresh budget is due
        slow_at = [i for i, m in enumerate(sparse) if m == "slow"]
        assert slow_at == list(range(4, len(sparse), 5))


def test_always_slow_schedule_equals_dense(tiny_models, dense_tokens):
    tokens, stats, _ = _run(tiny_models["qwen3"], dict(SMALL, schedule="always_slow"))
    assert tokens == dense_tokens and stats[STAT_FAST] == 0 and stats[STAT_SLOW] > 0


def test_prefix_cache_hit_does_not_change_sfi_results(tiny_models):
    from vllm import SamplingParams

    base = random_prompts(lengths=(200,), seed=3)[0]
    prompts = [base + t for t in random_prompts(lengths=(9, 40), seed=4)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    extra = {"speedsfi": {"sfi": SMALL}}

    def cold_then_warm():
        with engine(tiny_models["qwen3"], "SPEEDSFI", enable_prefix_caching=True,
                    additional_config=extra) as llm:
            cold = [greedy(llm, [p], max_tokens=40)[0] for p in prompts[:1]]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            stats = table_of(model_runner(llm)).sfi.stats.tolist()
        return cold, outs, stats

    cold, outs, stats = cold_then_warm()
    assert min(o.num_cached_tokens for o in outs) >= 192
    assert [list(o.outputs[0].token_ids) for o in outs][0] == cold[0]
    assert stats[STAT_FAST] > 0


def test_preemption_with_sfi_resets_state(tiny_models):
    prompts = random_prompts(lengths=(200, 190, 180, 170), seed=11)
    extra = {"speedsfi": {"sfi": SMALL}}
    from vllm_ext import metrics

    before = metrics.snapshot().get("fallback.sfi_preempted", 0)
    with engine(tiny_models["qwen3"], "SPEEDSFI", num_gpu_blocks_override=20, max_num_seqs=4,
                max_model_len=512, additional_config=extra) as llm:
        table = table_of(model_runner(llm))
        table.recorder = []
        tokens = greedy(llm, prompts, max_tokens=120)
        stats = table.sfi.stats.tolist() if table.sfi is not None else None
        records = table.recorder
        released = table.counters.released
    assert all(len(t) == 120 for t in tokens)
    assert released > len(prompts)                      # preempted requests gave their slots back
    # each resume of an SFI request is a counted fallback (its tokens can change)
    assert metrics.snapshot()["fallback.sfi_preempted"] > before
    # a resumed request restarts from a fresh selection: its prefill-end selections count again
    assert stats[STAT_PREFILL_END] > len(prompts) and stats[STAT_FAST] > 0
    for step in records:
        assert len({v["slot"] for v in step.values()}) == len(step)


def test_triton_kernels_inside_the_engine_match_the_twins(tiny_models, monkeypatch):
    """SFI with the Triton kernels (interpreted on CPU: slow, so a short run) gives the tokens of the
    PyTorch twins, and both really ran fast and slow steps."""
    from vllm_ext.kernels import dense_decode_evidence, gather_compact, two_segment_decode

    prompts = [PROMPTS[1]]
    twins, stats_twins, _ = _run(tiny_models["qwen3"], SMALL, max_tokens=12, prompts=prompts)

    def twin_ran(*args, **kwargs):
        raise AssertionError("a PyTorch twin ran where the Triton kernel should")

    for module, name in [(two_segment_decode, "two_segment_decode_torch"),
                         (dense_decode_evidence, "dense_decode_with_evidence_torch"),
                         (gather_compact, "gather_compact_torch")]:
        monkeypatch.setattr(module, name, twin_ran)
    triton, stats_triton, _ = _run(tiny_models["qwen3"], SMALL, max_tokens=12, prompts=prompts,
                                   triton_kernels=True)
    assert stats_triton[STAT_FAST] > 0 and stats_triton[STAT_SLOW] > 0
    assert stats_triton == stats_twins
    assert triton == twins
