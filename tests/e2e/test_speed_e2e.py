"""SPEED inside the real engine (CPU build, PyTorch twins): token-exact against an independent
reference of the visibility rule (Hugging Face with per-layer masks) on Llama, Qwen2 and Qwen3,
with chunked prompts and steps that mix prefills and decodes; vLLM's own capacity accounting; every
block back after the run; composition with SFI."""

import pytest

from tests.e2e.engine import engine, greedy, model_runner, random_prompts, shared_engine
from tests.speed.speed_reference import speed_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYERS, L_CUT = 4, 3
# chunked (max_num_batched_tokens 128): 300 and 200 span several steps, and the short prompts
# decode while the long ones still prefill
PROMPTS = random_prompts(lengths=(300, 40, 200, 7), seed=3)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def speed_models(tmp_path_factory):
    from vllm_ext.tools.tiny_models import make_model

    root = tmp_path_factory.mktemp("speed_models")
    return {arch: make_model(str(root / arch), arch, num_layers=LAYERS)
            for arch in ("llama", "qwen2", "qwen3")}


def _speed(**fields):
    return {"speedsfi": {"speed": dict({"enabled": True, "l_cut": L_CUT}, **fields)}}


def _engine_state(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager, llm.llm_engine.vllm_config.cache_config


def _speed_engine(model):
    """The SPEED engine (``_speed()``, prefix caching off) of ``model``, shared by the tests that follow
    each other here (tests/e2e/engine.py ``shared_engine``): the capacity test, the abort test and
    the reference test on Llama, the reference test and the masked test on Qwen3."""
    return shared_engine(model, "SPEEDSFI", additional_config=_speed(), enable_prefix_caching=False)


def test_capacity_in_vllms_accounting(speed_models):
    """vLLM's own capacity line: a prompt-dominated max_model_len request needs the lower
    groups' blocks plus a few upper blocks, so concurrency grows by that block ratio."""
    model = speed_models["llama"]
    bs, max_len = 32, 1024
    with engine(model, "SPEEDSFI", enable_prefix_caching=False) as llm:
        _, dense_cache = _engine_state(llm)
        dense = dense_cache.kv_cache_max_concurrency
    llm = _speed_engine(model)
    mgr, cache = _engine_state(llm)
    groups = mgr.kv_cache_config.kv_cache_groups
    from vllm_ext.methods.speed.kv_spec import SpeedUpperSpec

    upper = [g for g in groups if isinstance(g.kv_cache_spec, SpeedUpperSpec)]
    assert len(upper) == 1 and len(groups) == LAYERS        # 3 lower groups of 1 layer + 1 upper
    assert upper[0].layer_names == [f"model.layers.{L_CUT}.self_attn.attn"]
    speed = cache.kv_cache_max_concurrency
    # the pool is the same; blocks per max_model_len request: dense 4 x 32, SPEED 3 x 32 + 2
    per_req_dense, per_req_speed = LAYERS * max_len // bs, L_CUT * max_len // bs + 2
    assert speed / dense == pytest.approx(per_req_dense / per_req_speed, rel=1e-6)
    # and a real prompt-dominated request holds exactly that many blocks
    free0 = mgr.block_pool.get_num_free_blocks()
    from vllm import SamplingParams

    llm.llm_engine.add_request("long", {"prompt_token_ids": random_prompts((900,), seed=1)[0]},
                               SamplingParams(max_tokens=3, temperature=0,
                                              ignore_eos=True))
    peak = 0
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        peak = max(peak, free0 - mgr.block_pool.get_num_free_blocks())
    # at its peak (decoding, 902 tokens) the request held 3 lower rows of 29 blocks and, in
    # the upper group, block 0 and the block of P - 1 = 899
    assert peak == L_CUT * -(-900 // bs) + 2
    assert mgr.block_pool.get_num_free_blocks() == free0


def test_prompt_logprobs_are_refused_and_abort_frees_both_groups(speed_models):
    from vllm import SamplingParams

    llm = _speed_engine(speed_models["llama"])
    with pytest.raises(Exception, match="prompt_logprobs are not available with speedsfi.speed"):
        greedy(llm, PROMPTS[:1], max_tokens=2, prompt_logprobs=1)
    mgr, _ = _engine_state(llm)
    free0 = mgr.block_pool.get_num_free_blocks()
    eng = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", {"prompt_token_ids": p},
                        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(4):                            # mid-prefill and mid-decode
        eng.step()
    assert mgr.block_pool.get_num_free_blocks() < free0
    eng.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    while eng.has_unfinished_requests():
        eng.step()
    assert mgr.block_pool.get_num_free_blocks() == free0
    # the engine still answers exactly after the aborts
    assert greedy(llm, PROMPTS[:2], max_tokens=MAX_TOKENS) == \
        speed_greedy(speed_models["llama"], PROMPTS[:2], MAX_TOKENS, L_CUT)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_speed_equals_the_visibility_reference(speed_models, arch):
    from vllm_ext import metrics

    model = speed_models[arch]
    before = metrics.snapshot()
    llm = _speed_engine(model)
    mgr, _ = _engine_state(llm)
    free0 = mgr.block_pool.get_num_free_blocks()
    tokens = greedy(llm, PROMPTS, max_tokens=MAX_TOKENS)
    assert mgr.block_pool.get_num_free_blocks() == free0      # both groups gave back every block
    after = metrics.snapshot()
    ref = speed_greedy(model, PROMPTS, MAX_TOKENS, L_CUT)
    assert tokens == ref
    dense = speed_greedy(model, PROMPTS, MAX_TOKENS, LAYERS)
    assert tokens != dense                                          # the rule changed the output
    # the interior prompt tokens [1, P - 1) skipped the upper stack; their blocks were never taken
    skipped = after.get("speed.upper_tokens_skipped", 0) - before.get("speed.upper_tokens_skipped", 0)
    assert skipped == sum(max(len(p) - 2, 0) for p in PROMPTS)
    saved = after.get("speed.blocks_saved", 0) - before.get("speed.blocks_saved", 0)
    assert saved == sum(max(0, max(1, (len(p) - 1) // 32) - 1) for p in PROMPTS)


def test_masked_upper_stack_without_token_dropping_is_the_same(speed_models, monkeypatch):
    """Where the model is compiled, prompt tokens run the upper layers with SPEED's masking
    (the fallback): the same tokens as with the skip."""
    from vllm_ext.methods.speed import upper_stack

    monkeypatch.setattr(upper_stack, "_current_plan", lambda: None)
    model = speed_models["qwen3"]
    tokens = greedy(_speed_engine(model), PROMPTS, max_tokens=MAX_TOKENS)
    assert tokens == speed_greedy(model, PROMPTS, MAX_TOKENS, L_CUT)


@pytest.mark.parametrize("fields", [{"anchor": "none"}, {"variant": "self_only"}])
def test_speed_variants_equal_the_reference(speed_models, fields):
    model = speed_models["llama"]
    with engine(model, "SPEEDSFI", additional_config=_speed(**fields),
                enable_prefix_caching=False) as llm:
        tokens = greedy(llm, PROMPTS, max_tokens=MAX_TOKENS)
    assert tokens == speed_greedy(model, PROMPTS, MAX_TOKENS, L_CUT, **fields)


def test_l_cut_at_the_top_is_dense(speed_models):
    model = speed_models["qwen3"]
    with engine(model, "SPEEDSFI", additional_config=_speed(l_cut=LAYERS),
                enable_prefix_caching=False) as llm:
        tokens = greedy(llm, PROMPTS, max_tokens=MAX_TOKENS)
    with engine(model, "SPEEDSFI", enable_prefix_caching=False) as llm:
        dense = greedy(llm, PROMPTS, max_tokens=MAX_TOKENS)
    assert tokens == dense


def test_speed_with_sfi_runs_sfi_in_the_lower_layers(speed_models):
    model = speed_models["llama"]
    sfi = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8}
    cfg = {"speedsfi": {"speed": {"enabled": True, "l_cut": L_CUT}, "sfi": sfi}}
    with engine(model, "SPEEDSFI", additional_config=cfg, enable_prefix_caching=False) as llm:
        from vllm_ext.runner_hooks import table_of
        from vllm_ext.methods.sfi.step_plan import STAT_FAST

        table = table_of(model_runner(llm))
        tokens = greedy(llm, PROMPTS, max_tokens=24)
        fast = table.sfi.stats.tolist()[STAT_FAST]
    assert fast > 0
    assert tokens != speed_greedy(model, PROMPTS, 24, L_CUT)        # SFI changed the lower layers


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_prefix_caching=True), "SPEED needs --no-enable-prefix-caching"),
])
def test_speed_refuses_unsupported_engines(speed_models, kwargs, message):
    with pytest.raises(Exception, match=message):
        with engine(speed_models["llama"], "SPEEDSFI", additional_config=_speed(), **kwargs):
            pass


def test_speed_refuses_models_outside_its_families(tmp_path, speed_models):
    import os

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    path = str(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=4,
                               n_positions=1024)).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(speed_models["llama"], f), os.path.join(path, f))
    with pytest.raises(Exception, match="SPEED supports the LlamaForCausalLM, Qwen2ForCausalLM, "
                                        "Qwen3ForCausalLM families; this model is GPT2LMHeadModel"):
        with engine(path, "SPEEDSFI", additional_config=_speed(), enable_prefix_caching=False):
            pass


def test_speed_with_critiprefill_sparsifies_only_the_lower_layers(speed_models):
    """CritiPrefill runs on the lower layers' prefill (the upper layers hold no prompt): a covering
    budget is SPEED exactly; a small one runs the sparse path in the lower layers only."""
    from vllm_ext import metrics

    model = speed_models["llama"]
    small = {"enabled": True, "segment_size": 64, "block_size": 16, "budget": 32, "min_len": 0,
             "dense_layers": []}

    def run(cp):
        metrics.reset()
        cfg = {"speedsfi": {"speed": {"enabled": True, "l_cut": L_CUT}, "critiprefill": cp}}
        with engine(model, "SPEEDSFI", additional_config=cfg, enable_prefix_caching=False) as llm:
            tokens = greedy(llm, PROMPTS, max_tokens=MAX_TOKENS)
            return tokens, metrics.snapshot()

    covering, _ = run(dict(small, budget=1024))
    assert covering == speed_greedy(model, PROMPTS, MAX_TOKENS, L_CUT)
    sparse, counts = run(small)
    segs = counts["critiprefill.sparse_segments"]
    assert segs > 0
    # every sparse segment ran in the L_CUT lower layers (x 2 KV heads), never in the upper one
    assert counts["critiprefill.sparse_segment_heads"] == segs * 2 * L_CUT
    assert sparse != covering
