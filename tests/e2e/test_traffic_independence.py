"""An answer depends only on its request (DESIGN.md): the same prompt gives the same greedy
tokens with SFI on however its prefill is split into chunks (the token budget decides here; under
load the other requests do) and whatever an earlier request left in the prefix cache. Real vLLM,
CPU build, fp32, a small SFI budget (``k`` 64, ``n_recent`` 64, ``w_prefill`` 16)."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts
from vllm_ext.runner_hooks import table_of
from vllm_ext.methods.sfi.step_plan import STAT_FAST, STAT_PREFILL_END

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFI = {"enabled": True, "k": 64, "n_recent": 64}
PROMPT = random_prompts(lengths=(1001,), seed=13)[0]
# budget -> chunks of the 1001-token prompt: one chunk; 997 + 4; 500 + 500 + 1; 256 x 3 + 233
BUDGETS = (1001, 997, 500, 256)
MAX_TOKENS = 24


def _run(model, budget, sfi):
    extra = {"speedsfi": {"sfi": sfi}} if sfi else {}
    with engine(model, "SPEEDSFI", max_model_len=2048, max_num_batched_tokens=budget,
                additional_config=extra) as llm:
        table = table_of(model_runner(llm))
        table.recorder = []
        tokens = greedy(llm, [PROMPT], max_tokens=MAX_TOKENS)[0]
        stats = table.sfi.stats.tolist() if table.sfi is not None else None
        chunks = sum(1 for step in table.recorder for v in step.values() if not v["is_decode"])
    return tokens, stats, chunks


@pytest.fixture(scope="module")
def runs(tiny_models):
    return {(sfi, budget): _run(tiny_models["qwen3"], budget, SFI if sfi else None)
            for sfi in (False, True) for budget in BUDGETS}


def test_chunking_does_not_change_sfi_tokens(runs):
    sfi = {b: runs[True, b] for b in BUDGETS}
    for budget, (_, stats, chunks) in sfi.items():
        assert chunks == -(-len(PROMPT) // budget)          # the prefill really was split so
        assert stats[STAT_PREFILL_END] == 1 and stats[STAT_FAST] > 0
    one_chunk = sfi[BUDGETS[0]][0]
    for budget, (tokens, _, _) in sfi.items():
        assert tokens == one_chunk, f"max_num_batched_tokens={budget} changed the answer"


def test_dense_control(runs):
    dense = {b: runs[False, b][0] for b in BUDGETS}
    assert all(t == dense[BUDGETS[0]] for t in dense.values())
    # SFI really decodes sparsely here: its answer is not the dense one
    assert runs[True, BUDGETS[0]][0] != dense[BUDGETS[0]]


def test_prefix_cache_hit_reaching_into_the_prompt_tail(tiny_models):
    """645 tokens with 32-token blocks: vLLM would reuse 640 cached tokens and compute 5, fewer than
    ``w_prefill``. The hit is cut to 608 so the request computes its whole evidence window, and a
    different prompt that used the same compact slot in between changes nothing."""
    from vllm import SamplingParams

    a, b = random_prompts(lengths=(645, 645), seed=21)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine(tiny_models["qwen3"], "SPEEDSFI", max_model_len=2048, max_num_batched_tokens=1024,
                enable_prefix_caching=True, additional_config={"speedsfi": {"sfi": SFI}}) as llm:
        table = table_of(model_runner(llm))
        cold = greedy(llm, [a], max_tokens=MAX_TOKENS)[0]
        greedy(llm, [b], max_tokens=MAX_TOKENS)
        warm = llm.generate([{"prompt_token_ids": a}], sp, use_tqdm=False)[0]
        stats = table.sfi.stats.tolist()
    assert warm.num_cached_tokens == 608
    assert list(warm.outputs[0].token_ids) == cold
    assert stats[STAT_PREFILL_END] == 3 and stats[STAT_FAST] > 0


# ------------------------------------------------------------------ every method, every combination
# A 4-layer Qwen3 (SPEED keeps the prompt in layers 0-2, CritiPrefill is sparse in layers 1-3),
# CritiPrefill's 128-query segments with a 200-token budget (chunks that would cut segments), SFI on
# in the engine and turned off by half of the requests: each engine covers a method set with and
# without SFI, so the three engines cover every combination (SFI alone: the tests above).
COMBO_SFI = {"enabled": True, "k": 64, "n_recent": 64}
COMBO_CP = {"enabled": True, "segment_size": 128, "block_size": 16, "budget": 256, "min_len": 256}
COMBO_SPEED = {"enabled": True, "l_cut": 3}
COMBOS = {"critiprefill": {"critiprefill": COMBO_CP}, "speed": {"speed": COMBO_SPEED},
          "critiprefill+speed": {"critiprefill": COMBO_CP, "speed": COMBO_SPEED},
          # SFI alone with its slow rows maintained in chunks of 2 (sfi.maintenance_rows), a slow
          # step every other step: up to 8 SFI rows slow in one step, so up to four chunks
          "sfi_in_chunks_of_2": {"sfi": {"maintenance_rows": 2, "schedule": "periodic", "refresh": 2}}}


@pytest.fixture(scope="module")
def four_layer_qwen3(tmp_path_factory):
    from vllm_ext.tools.tiny_models import make_model

    return make_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-4l"), "qwen3", num_layers=4)


@pytest.mark.parametrize("combo", list(COMBOS))
def test_every_method_combination_answers_as_alone(four_layer_qwen3, combo):
    """16 prompts of 20-1,500 tokens, each alone, then all at once in two orders (other chunk
    boundaries, other batch neighbours): the same greedy tokens, each method really on, no
    fallback (no request served densely for lack of a slot: the scheduler holds it back instead)."""
    import random

    from vllm import SamplingParams

    from vllm_ext import metrics

    rng = random.Random(1)
    lengths = [20, 1500] + [rng.choice((rng.randint(20, 120), rng.randint(120, 600),
                                        rng.randint(600, 1500))) for _ in range(14)]
    prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             extra_args=None if i % 2 else {"speedsfi": {"sfi": {"enabled": False}}})
              for i in range(len(prompts))]
    section = dict(COMBOS[combo])
    section["sfi"] = dict(COMBO_SFI, **section.get("sfi", {}))
    metrics.reset()

    def run(order):
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], [params[i] for i in order],
                            use_tqdm=False)
        return {i: list(o.outputs[0].token_ids) for i, o in zip(order, outs)}

    with engine(four_layer_qwen3, "SPEEDSFI", max_model_len=2048, max_num_seqs=16,
                max_num_batched_tokens=200, kv_cache_memory_bytes=64 << 20,
                enable_prefix_caching="speed" not in combo,
                additional_config={"speedsfi": section}) as llm:
        alone = {}
        for i in range(len(prompts)):
            alone.update(run([i]))
        together = run(list(range(len(prompts))))
        reverse = run(list(range(len(prompts)))[::-1])
        counts = metrics.snapshot()
    for i in range(len(prompts)):
        assert together[i] == alone[i], f"prompt {i} ({lengths[i]} tokens) changed beside the others"
        assert reverse[i] == alone[i], f"prompt {i} ({lengths[i]} tokens) changed in the other order"
    assert counts["sfi.fast_steps"] > 0
    assert not {k for k in counts if k.startswith("fallback.")}, counts
    if "critiprefill" in combo:
        assert counts["critiprefill.sparse_segments"] > 0 and counts["sched.critiprefill_chunk_cuts"] > 0
    if "speed" in combo:
        assert counts["speed.upper_tokens_skipped"] > 0
