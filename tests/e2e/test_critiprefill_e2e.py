"""CritiPrefill inside the real engine (CPU build, PyTorch twins; one run with the Triton kernels).

The tiny checkpoints have 2 layers, so CritiPrefill runs with ``dense_layers: []``: with layer 0
dense, a sparse layer 1 could not change any token (the last prompt position is in the dense final
segment, and layer 1's keys come from layer 0). Segments of 64 queries, blocks of 16 keys, a budget
of 32 keys (sink + 2 blocks per segment and KV head)."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = random_prompts(lengths=(300, 40, 200), seed=3)   # > 128 tokens: chunked, mixed steps
SMALL = {"enabled": True, "segment_size": 64, "block_size": 16, "budget": 32, "min_len": 0,
         "dense_layers": []}
COVERING = dict(SMALL, budget=1024)
SFI = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8}
HKV, LAYERS = 2, 2


def _run(model, backend="SPEEDSFI", cp=None, sfi=None, prompts=PROMPTS, max_tokens=24, inspect=None,
         **kwargs):
    from vllm_ext import metrics

    metrics.reset()
    section = {k: v for k, v in (("critiprefill", cp), ("sfi", sfi)) if v is not None}
    extra = {"speedsfi": section} if section else {}
    with engine(model, backend, additional_config=extra, **kwargs) as llm:
        tokens = greedy(llm, prompts, max_tokens=max_tokens)
        counts = metrics.snapshot()            # host counters + the device counters' providers
        if inspect is not None:
            inspect(llm)
    return tokens, counts


def _assert_counters_consistent(counts):
    """Device counters (what the kernels read) against the host plan: every sparse segment of every
    chunk ran in every layer and KV head and read budget/Bk blocks of its candidates (no sink block:
    the authors' default)."""
    segs = counts["critiprefill.sparse_segments"]
    assert segs > 0 and counts["critiprefill.prefill_tokens"] > 0
    # every segment in CPU_ATTN's kernel (the compiled pass and the twin are fallbacks here)
    assert not {k for k in counts if k.startswith("fallback.critiprefill")}, counts
    assert counts["critiprefill.sparse_segment_heads"] == segs * HKV * LAYERS
    assert counts["critiprefill.key_blocks_read"] == SMALL["budget"] // SMALL["block_size"] * segs * HKV * LAYERS
    assert counts["critiprefill.key_blocks_skipped"] == \
        counts["critiprefill.key_blocks_candidate"] - counts["critiprefill.key_blocks_read"] > 0
    from vllm_ext import metrics

    assert f"key blocks skipped {counts['critiprefill.key_blocks_skipped']} of" in metrics.summary(counts)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_covering_budget_is_dense_and_small_budget_is_sparse(tiny_models, arch):
    reference, _ = _run(tiny_models[arch], "CPU_ATTN")
    covering, counts = _run(tiny_models[arch], cp=COVERING)
    assert covering == reference                              # token for token
    assert counts.get("critiprefill.steps", 0) == 0 and counts["critiprefill.key_blocks_read"] == 0
    sparse, counts = _run(tiny_models[arch], cp=SMALL)
    _assert_counters_consistent(counts)
    assert sparse[0] != reference[0] and sparse[2] != reference[2]   # the long prompts change
    assert sparse[1] == reference[1]            # 40 tokens: one segment, nothing to prune


def test_every_sparse_layer_runs_in_cpu_attn_kernel(tiny_models, monkeypatch):
    """The engine hands each sparse layer's segments to CPU_ATTN's kernel (the route applies to its
    packed pages), and its tokens are the compiled pass's (the same plan; float order only)."""
    from vllm_ext.methods.critiprefill import cpu_attn_prefill

    taken = []
    route = cpu_attn_prefill.attend_segments

    def spy(*args, **kwargs):
        taken.append(route(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(cpu_attn_prefill, "attend_segments", spy)
    tokens, counts = _run(tiny_models["llama"], cp=SMALL)
    assert taken and all(taken), taken
    assert len(taken) == counts["critiprefill.steps"] * LAYERS
    monkeypatch.setattr(cpu_attn_prefill, "attend_segments", lambda *a, **k: False)
    compiled, counts = _run(tiny_models["llama"], cp=SMALL)
    assert counts["fallback.critiprefill_cpu_attn"] > 0
    assert compiled == tokens


def test_chunk_size_does_not_change_the_answer(tiny_models):
    """One 400-token prompt in one chunk, with a 65-token budget (one segment a step) and with a
    96-token budget, which would cut segments: the scheduler ends its chunks on segment boundaries
    (vllm_ext.scheduler_policy), so every run computes each sparse segment whole and gives the same
    tokens, different from dense."""
    prompt = random_prompts(lengths=(400,), seed=9)
    model = tiny_models["qwen3"]
    runs = {}
    for budget in (512, 65, 96):
        runs[budget] = _run(model, cp=SMALL, prompts=prompt, max_num_batched_tokens=budget,
                            max_tokens=16)
        assert runs[budget][0] == runs[512][0], f"max_num_batched_tokens={budget} changed the answer"
        # one chunk-segment per sparse segment: segments 1..5 (0 is dense, 6 is the final one)
        assert runs[budget][1]["critiprefill.sparse_segments"] == 5
        _assert_counters_consistent(runs[budget][1])
    assert runs[96][1]["sched.critiprefill_chunk_cuts"] > 0 == runs[512][1].get("sched.critiprefill_chunk_cuts", 0)
    dense, _ = _run(model, prompts=prompt, max_tokens=16)
    assert dense != runs[512][0]


def test_prefix_cache_hit_on_a_segment_boundary_changes_nothing(tiny_models):
    from vllm import SamplingParams

    from vllm_ext import metrics

    base = random_prompts(lengths=(200,), seed=3)[0]
    prompts = [base + t for t in random_prompts(lengths=(9, 60), seed=4)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def cold_then_warm():
        metrics.reset()
        with engine(tiny_models["qwen3"], "SPEEDSFI", enable_prefix_caching=True,
                    additional_config={"speedsfi": {"critiprefill": SMALL}}) as llm:
            cold = greedy(llm, [prompts[0]], max_tokens=24)[0]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            counts = metrics.snapshot()
        return cold, outs, counts

    cold, outs, counts = cold_then_warm()
    # 192 cached tokens = 3 segments: the cached part's key blocks come from the paged cache
    assert min(o.num_cached_tokens for o in outs) == 192
    assert list(outs[0].outputs[0].token_ids) == cold
    _assert_counters_consistent(counts)


def test_critiprefill_with_sfi(tiny_models):
    model = tiny_models["qwen3"]
    sfi_alone, sfi_counts = _run(model, sfi=SFI)

    def tables_of_sparse_layers_only(llm):
        from vllm.model_executor.models.utils import extract_layer_index

        ctx = model_runner(llm).vllm_config.compilation_config.static_forward_context
        has = {extract_layer_index(n): any(s.name == "critiprefill" and s.state is not None for s in a.impl.layers) for n, a in ctx.items()
               if hasattr(a, "impl")}                   # not SFI's compact caches
        assert has == {0: False, 1: True}                 # dense_layers [0]: no state for layer 0
        # every layer has a state cache (one group pattern with the attention layers); layer 0's
        # pages are never read
        states = [extract_layer_index(n) for n in ctx if n.endswith(".critiprefill_state")]
        assert states == [0, 1]

    covering, counts = _run(model, cp=dict(COVERING, dense_layers=[0]), sfi=SFI,
                            inspect=tables_of_sparse_layers_only)
    assert covering == sfi_alone and counts["sfi.fast_steps"] == sfi_counts["sfi.fast_steps"] > 0
    both, counts = _run(model, cp=SMALL, sfi=SFI)
    _assert_counters_consistent(counts)
    assert counts["sfi.fast_steps"] > 0 and counts["sfi.slow_steps"] > 0
    assert both != sfi_alone


def test_triton_kernels_inside_the_engine_match_the_twins(tiny_models, monkeypatch):
    """The Triton kernels (interpreted on CPU: a short run) give the twins' tokens and counts."""
    from vllm_ext.kernels import block_representatives, block_sparse_prefill

    prompt = [PROMPTS[2]]
    twins, twin_counts = _run(tiny_models["qwen3"], cp=SMALL, prompts=prompt, max_tokens=6)

    def twin_ran(*args, **kwargs):
        raise AssertionError("a PyTorch twin ran where the Triton kernel should")

    for module, name in [(block_sparse_prefill, "block_sparse_prefill_torch"),
                         (block_representatives, "update_block_representatives_torch"),
                         (block_representatives, "query_segment_representatives_torch")]:
        monkeypatch.setattr(module, name, twin_ran)
    triton, counts = _run(tiny_models["qwen3"], cp=SMALL, prompts=prompt, max_tokens=6,
                          triton_kernels=True)
    _assert_counters_consistent(counts)
    assert triton == twins
    assert {k: v for k, v in counts.items() if k.startswith("critiprefill.")} == \
        {k: v for k, v in twin_counts.items() if k.startswith("critiprefill.")}
