"""An fp8 KV cache end to end on the CPU build (``--kv-cache-dtype fp8``, ``fp8_e5m2``; bf16 tiny
models, whose head size 32 ``CPU_ATTN``'s fp8 packing takes).

Where ``CPU_ATTN`` serves fp8 (x86 with AVX-512 or AMX):

- every method off equals ``CPU_ATTN`` on fp8 token for token, and so does SFI with a budget covering
  every context; a small budget decodes sparsely over the same pages (SFI's compact group is ``uint8``
  pages of the attention format), counting only the compiled passes' fp8 decline as a fallback;
- vLLM's "Maximum concurrency" with SFI on fp8 is about twice that on bf16 at the same
  ``kv_cache_memory_bytes``;
- an answer depends only on its request (prefill chunking, prefix-cache hits), preemption resumes
  requests and leaks nothing, and a server refuses bad input naming the field, all on fp8.

Where it does not (this project's development machine: AVX2 only), SPEEDSFI refuses fp8 at start-up
with ``CPU_ATTN``'s own reason; the tests that need fp8 served skip with that reason.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.engine import engine, greedy, leftover_after_probe, model_runner, random_prompts, run_recorded
from vllm_ext.methods.sfi.step_plan import STAT_DENSE, STAT_FAST, STAT_PREFILL_END, STAT_SLOW
from vllm_ext.runner_hooks import table_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# vLLM's reason (vllm.v1.attention.backends.cpu_attn._get_attn_isa) and its condition
CPU_FP8_REASON = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
SERVES_FP8 = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
needs_fp8 = pytest.mark.skipif(not SERVES_FP8, reason=CPU_FP8_REASON)

FP8 = dict(kv_cache_dtype="fp8", dtype="bfloat16")
PROMPTS = random_prompts(lengths=(300, 40, 200, 129), seed=3)
SMALL = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8}
# the only fallback fp8 may bring: on a machine without a compiler, SFI's compiled CPU kernels are
# missing altogether (every compiled pass reads fp8 pages)
FP8_FALLBACKS = {"fallback.cpu_native"}


@pytest.fixture(scope="module")
def four_layer_qwen3(tmp_path_factory):
    from vllm_ext.tools.tiny_models import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-4l"), "qwen3", num_layers=4)


def _fallbacks(counts) -> set[str]:
    return {k for k in counts if k.startswith("fallback.")}


def _cpu_attn(model, prompts, max_tokens=40, **kwargs):
    with engine(model, "CPU_ATTN", **kwargs) as llm:
        return greedy(llm, prompts, max_tokens=max_tokens)


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.skipif(SERVES_FP8, reason="this CPU serves fp8 (AVX-512 or AMX): nothing to refuse")
def test_fp8_is_refused_at_start_up_with_cpu_attn_reason(tiny_models):
    with pytest.raises(Exception) as e:
        with engine(tiny_models["qwen3"], "SPEEDSFI", additional_config={"speedsfi": {"sfi": SMALL}}, **FP8):
            pass
    assert CPU_FP8_REASON in str(e.value)


# ----------------------------------------------------------------------------- token for token
@needs_fp8
@pytest.mark.parametrize("arch, spelling", [("llama", "fp8"), ("qwen2", "fp8_e4m3"), ("qwen3", "fp8"),
                                            ("qwen3", "fp8_e5m2")])
def test_every_method_off_equals_cpu_attn_on_fp8(tiny_models, arch, spelling):
    from vllm_ext import metrics

    kw = dict(FP8, kv_cache_dtype=spelling)
    reference = _cpu_attn(tiny_models[arch], PROMPTS, **kw)
    metrics.reset()
    ours, _, _ = run_recorded(tiny_models[arch], None, PROMPTS, 40, **kw)
    counts = metrics.snapshot()
    assert ours == reference
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0
    assert not _fallbacks(counts), counts


@needs_fp8
@pytest.mark.parametrize("spelling", ["fp8", "fp8_e5m2"])
def test_sfi_on_fp8_pages(tiny_models, spelling):
    """A budget covering every context: every decode row dense, on ``CPU_ATTN``'s kernel over its fp8
    pages, token for token ``CPU_ATTN``'s. A small budget: fast and slow steps read the same pages and
    SFI's compact group (``uint8`` pages, as the attention layers'), nothing else falls back."""
    from vllm_ext import metrics

    kw = dict(FP8, kv_cache_dtype=spelling)
    model = tiny_models["qwen3"]
    reference = _cpu_attn(model, PROMPTS, **kw)
    metrics.reset()
    covering, stats, _ = run_recorded(model, {"enabled": True, "k": 1024}, PROMPTS, 40, **kw)
    counts = metrics.snapshot()
    assert stats[STAT_FAST] == stats[STAT_SLOW] == 0 and stats[STAT_DENSE] > 0
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0, counts
    assert "fallback.cpu_attn_packed_pages" not in counts, counts
    assert covering == reference
    metrics.reset()
    with engine(model, "SPEEDSFI", additional_config={"speedsfi": {"sfi": SMALL}}, **kw) as llm:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        dtypes = {type(g.kv_cache_spec).__name__: g.kv_cache_spec.dtype for g in groups}
        table = table_of(model_runner(llm))
        sparse = greedy(llm, PROMPTS, max_tokens=40)
        stats = table.sfi.stats.tolist()
    counts = metrics.snapshot()
    assert dtypes["FullAttentionSpec"] == dtypes["SfiCompactSpec"] == torch.uint8, dtypes
    assert stats[STAT_FAST] > stats[STAT_SLOW] > 0
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0, counts
    assert _fallbacks(counts) <= FP8_FALLBACKS, counts
    assert sparse != reference                              # the budget is small enough to matter


# CritiPrefill sparse from the second 64-token segment on (the final segment stays dense)
CP = {"enabled": True, "segment_size": 64, "block_size": 16, "budget": 32, "min_len": 64}


@needs_fp8
@pytest.mark.parametrize("section", [
    {"sfi": dict(SMALL, selector="quest", page_size=8)},
    {"sfi": SMALL, "speed": {"enabled": True, "l_cut": 3}},
    {"critiprefill": CP},
    {"sfi": SMALL, "speed": {"enabled": True, "l_cut": 3}, "critiprefill": CP},
], ids=["sfi-quest", "sfi+speed", "critiprefill", "all three"])
def test_method_combinations_serve_fp8(four_layer_qwen3, section):
    """Every method and their combination on fp8, on a 4-layer Qwen3 (SPEED's upper layer 3): every
    request finishes, the methods run (CritiPrefill's block-sparse prefill over the fp8 pages),
    nothing falls back but the compiled passes' fp8 decline."""
    from vllm_ext import metrics

    metrics.reset()
    with engine(four_layer_qwen3, "SPEEDSFI", additional_config={"speedsfi": section},
                enable_prefix_caching=False, **FP8) as llm:
        tokens = greedy(llm, PROMPTS, max_tokens=40)
    counts = metrics.snapshot()
    assert [len(t) for t in tokens] == [40] * len(PROMPTS)
    if "sfi" in section:
        assert counts["sfi.fast_steps"] > 0, counts
    if "critiprefill" in section:
        assert counts["critiprefill.prefill_tokens"] > 0 and counts["critiprefill.key_blocks_skipped"] > 0, counts
    if "speed" in section:
        assert counts["speed.upper_tokens_skipped"] > 0, counts
    assert _fallbacks(counts) <= FP8_FALLBACKS | {"fallback.speed_compute_compiled"}, counts


# ------------------------------------------------------------------------------ concurrency
def _concurrency(model, kv_cache_dtype) -> float:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    with engine(model, "SPEEDSFI", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                additional_config={"speedsfi": {"sfi": TAIL_SFI}}) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        return get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config, sched.kv_cache_config)


@needs_fp8
def test_max_concurrency_with_sfi_on_fp8_is_about_twice_bf16(tiny_models):
    """Same ``kv_cache_memory_bytes`` (tests/e2e/engine.py): the attention pages and SFI's groups take
    half the bytes a block, so twice the blocks; SFI's fixed-size state (kept positions, prompt-tail
    queries in the model's dtype) takes up to twice the blocks, so twice or a little under (here 2:
    docs/per_request_memory.md, "With an fp8 KV cache"; the pool's rounding moves it by a block)."""
    bf16 = _concurrency(tiny_models["qwen3"], "auto")
    fp8 = _concurrency(tiny_models["qwen3"], "fp8")
    assert 1.85 <= fp8 / bf16 <= 2.01, (fp8, bf16)


# ------------------------------------------------------------------ an answer is its request's
TAIL_SFI = {"enabled": True, "k": 64, "n_recent": 64}


@needs_fp8
def test_chunking_does_not_change_sfi_tokens_on_fp8(tiny_models):
    prompt = random_prompts(lengths=(1001,), seed=13)[0]
    answers = {}
    for budget in (1001, 256):
        with engine(tiny_models["qwen3"], "SPEEDSFI", max_model_len=2048, max_num_batched_tokens=budget,
                    additional_config={"speedsfi": {"sfi": TAIL_SFI}}, **FP8) as llm:
            table = table_of(model_runner(llm))
            answers[budget] = greedy(llm, [prompt], max_tokens=24)[0]
            stats = table.sfi.stats.tolist()
        assert stats[STAT_PREFILL_END] == 1 and stats[STAT_FAST] > 0
    assert answers[256] == answers[1001]


def _cold_then_warm(model, backend, prompts):
    """One prompt alone, then every prompt (hitting the first one's cached prefix)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with engine(model, backend, enable_prefix_caching=True, **FP8) as llm:
        cold = greedy(llm, [prompts[0]], max_tokens=40)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return cold, [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@needs_fp8
def test_prefix_cache_hits_answer_as_cpu_attn_on_fp8(tiny_models):
    """Every method off: cold and prefix-cache hits answer as ``CPU_ATTN``'s under the same hits. (On
    the CPU build an fp8 hit can change an answer in vLLM itself: the hit's few tokens are computed in
    other shapes than the whole prompt was, and an fp8 store moves a last-bit difference a whole fp8
    step.) SFI: a hit reaching
    into the prompt tail is cut (608 of 645 tokens) and answers the same whether or not another
    prompt used the compact slot in between."""
    from vllm import SamplingParams

    model = tiny_models["qwen3"]
    base = random_prompts(lengths=(200,), seed=3)[0]
    prompts = [base + t for t in random_prompts(lengths=(9, 40, 1), seed=4)]
    ours = _cold_then_warm(model, "SPEEDSFI", prompts)
    assert min(ours[2]) >= 192
    assert ours == _cold_then_warm(model, "CPU_ATTN", prompts)

    a, b = random_prompts(lengths=(645, 645), seed=21)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with engine(model, "SPEEDSFI", max_model_len=2048, max_num_batched_tokens=1024, enable_prefix_caching=True,
                additional_config={"speedsfi": {"sfi": TAIL_SFI}}, **FP8) as llm:
        greedy(llm, [a], max_tokens=24)
        hit = llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)[0]
        greedy(llm, [b], max_tokens=24)
        again = llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)[0]
    assert hit.num_cached_tokens == again.num_cached_tokens == 608
    assert list(again.outputs[0].token_ids) == list(hit.outputs[0].token_ids)


# ------------------------------------------------------------------------------- preemption
PREEMPT_MAX_TOKENS = 96


def _preemption_run(model, blocks: int | None):
    """8 requests of 300-700 tokens, SFI off for the odd ones, SFI + SPEED on fp8; ``blocks``: a KV
    cache that small (None: roomy)."""
    from vllm import SamplingParams

    from vllm_ext import metrics

    rng = random.Random(5)
    lengths = rng.sample(range(300, 700), 8)
    prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=PREEMPT_MAX_TOKENS, ignore_eos=True,
                             extra_args=None if i % 2 == 0 else {"speedsfi": {"sfi": {"enabled": False}}})
              for i in range(len(prompts))]
    extra = {} if blocks is None else {"num_gpu_blocks_override": blocks}
    metrics.reset()
    with engine(model, "SPEEDSFI", max_model_len=1024, max_num_batched_tokens=512, enable_prefix_caching=False,
                additional_config={"speedsfi": {"sfi": TAIL_SFI, "speed": {"enabled": True, "l_cut": 3}}},
                **extra, **FP8) as llm:
        table = table_of(model_runner(llm))
        mgr = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        free0 = mgr.block_pool.get_num_free_blocks()
        table.recorder = []
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        records, table.recorder = table.recorder, None
        leftover = leftover_after_probe(llm, table, mgr, free0)
        counts = metrics.snapshot()
    held = {}
    for step in records:
        for view in step.values():
            held.setdefault(view["prompt_len"], set()).add((view["slot"], view["generation"]))
    preempted = [len(held[len(p)]) > 1 for p in prompts]
    return [list(o.outputs[0].token_ids) for o in outs], preempted, leftover, counts


@needs_fp8
def test_preemption_on_fp8(four_layer_qwen3):
    """A cache too small for the batch: requests of both kinds are preempted and resumed, every request
    finishes and nothing leaks. Unlike bf16 (tests/e2e/test_preemption_every_method.py), an SFI-off
    request is not held to its roomy-run tokens: on fp8 vLLM's own CPU_ATTN answers a request
    differently in another batch (other chunk shapes give last-bit differences, and an fp8 store moves
    such a difference a whole fp8 step; measured on this 4-layer model, 8 prompts of 300-700 tokens,
    a chunk budget of 512: one request alone and in the batch differ with CPU_ATTN on fp8, not on
    bf16). The block counts that preempt both kinds depend on the groups' block demand: the first
    of a few that does is used."""
    roomy, roomy_preempted, roomy_left, _ = _preemption_run(four_layer_qwen3, None)
    assert not any(roomy_preempted)
    for blocks in (230, 200, 260, 170):
        tight, preempted, leftover, counts = _preemption_run(four_layer_qwen3, blocks)
        if any(preempted[0::2]) and any(preempted[1::2]):
            break
    else:
        pytest.fail("no tight cache preempted requests of both kinds")
    assert counts.get("fallback.sfi_preempted", 0) >= sum(preempted[0::2])
    for tokens, left in ((roomy, roomy_left), (tight, leftover)):
        assert [len(t) for t in tokens] == [PREEMPT_MAX_TOKENS] * len(tokens)
        assert left == {"request slots": 0, "SFI slots": 0, "CritiPrefill slots": 0, "KV blocks": 0}
    assert _fallbacks(counts) <= FP8_FALLBACKS | {"fallback.sfi_preempted"}, counts


# -------------------------------------------------------------------------------- bad input
SERVE_ARGS = ("--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--max-model-len", "1024", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "256", "--no-enable-prefix-caching")
BAD = [
    ({"vllm_xargs": {"speedsfi": '{"sfi": {"k": "many"}}'}}, "speedsfi.sfi.k: expected an integer"),
    ({"vllm_xargs": {"speedsfi": '{"sfi": {"k": 100000}}'}}, "must be <= the server's sfi.k (64)"),
    ({"vllm_xargs": {"speedsfi": '{"sfi": {"n_recnt": 4}}'}}, "did you mean 'n_recent'"),
    ({"vllm_xargs": {"speedsfi": '{"critiprefill": {"enabled": true}}'}}, "speedsfi.critiprefill.enabled"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": list(range(5, 1100))}, "maximum context length"),
    ({"max_tokens": -1}, "max_tokens"),
]


@needs_fp8
def test_a_server_on_fp8_refuses_bad_input_naming_the_field(four_layer_qwen3, tmp_path):
    import httpx

    from tests.e2e.served import vllm_serve

    section = {"sfi": TAIL_SFI, "speed": {"enabled": True, "l_cut": 3}}

    def post(server, body):
        payload = {"model": server.model_name, "prompt": list(range(10, 410)), "max_tokens": 8,
                   "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        payload.update(body)
        return httpx.post(server.base + "/v1/completions", json=payload, timeout=300)

    with vllm_serve(four_layer_qwen3, str(tmp_path / "server.log"), additional_config={"speedsfi": section},
                    args=SERVE_ARGS) as server:
        first = post(server, {})
        assert first.status_code == 200, first.text
        reference = first.json()["choices"][0]["token_ids"]
        for body, message in BAD:
            r = post(server, body)
            assert 400 <= r.status_code < 500 and message in r.text, (body, r.status_code, r.text[:500])
            again = post(server, {})
            assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == reference
