"""SPEEDSFI with every method off equals CPU_ATTN token for token (fp32, sharp tiny models), and the
counters prove that our builder and forward ran, not CPU_ATTN's."""

import pytest

from tests.e2e.engine import engine, greedy, random_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _run(model, backend, prompts, **kwargs):
    from vllm_ext import metrics

    metrics.reset()
    with engine(model, backend, **kwargs) as llm:
        tokens = greedy(llm, prompts)
    return tokens, metrics.snapshot()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_all_off_matches_cpu_attn(tiny_models, arch):
    # 300 and 129 tokens exceed the 128-token chunked-prefill budget: chunked prefill and
    # mixed prefill/decode batches happen.
    prompts = random_prompts()
    ours, counts = _run(tiny_models[arch], "SPEEDSFI", prompts)
    reference, ref_counts = _run(tiny_models[arch], "CPU_ATTN", prompts)
    assert all(len(t) == 64 for t in ours)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a == b, f"prompt {i} ({len(prompts[i])} tokens) diverges at token " \
                       f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0        # every real step ran our path
    assert ref_counts == {}


def test_prefix_cache_hit_changes_nothing(tiny_models):
    """A batch that hits the prefix cache gives the same tokens as a cold run."""
    from vllm_ext import metrics

    base = random_prompts(lengths=(200,), seed=3)[0]
    tails = random_prompts(lengths=(9, 40, 1), seed=4)
    prompts = [base + t for t in tails]
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    def cold_then_warm():
        with engine(tiny_models["qwen3"], "SPEEDSFI", enable_prefix_caching=True) as llm:
            cold = greedy(llm, [prompts[0]])
            metrics.reset()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return cold, [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

    # (engines live inside helper functions: a lingering LLM reference tears down the next engine)
    cold, warm, cached = cold_then_warm()
    assert min(cached) >= 192, f"expected prefix-cache hits of >= 6 blocks of 32, got {cached}"
    assert metrics.snapshot()["steps.dense_cpu_attn"] > 0
    assert warm[0] == cold[0]
    reference, _ = _run(tiny_models["qwen3"], "CPU_ATTN", prompts, enable_prefix_caching=False)
    assert warm == reference
