"""A method on, in bf16: SPEEDSFI keeps ``CPU_ATTN``'s page packing for the ISA vLLM picks on this CPU
(``amx`` where the CPU has AMX tiles, ``vec`` otherwise), so its dense rows run ``CPU_ATTN``'s kernel
and its own rows read the same pages (``vllm_ext.backend.dense_path``). Fp32 engines (the rest of the
e2e suite) never take the ``amx`` packing, which is bf16 only."""

import pytest

from tests.e2e.engine import random_prompts, run_recorded
from vllm_ext.methods.sfi.step_plan import STAT_DENSE, STAT_FAST, STAT_SLOW

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = random_prompts(lengths=(300, 40, 200), seed=3)
SMALL = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8}


def _run(model, sfi, backend="SPEEDSFI"):
    from vllm_ext import metrics

    metrics.reset()
    if backend == "CPU_ATTN":
        from tests.e2e.engine import engine, greedy

        with engine(model, backend, dtype="bfloat16") as llm:
            return greedy(llm, PROMPTS, max_tokens=40), None, metrics.snapshot()
    tokens, stats, _ = run_recorded(model, sfi, PROMPTS, 40, dtype="bfloat16")
    return tokens, stats, metrics.snapshot()


def test_bf16_dense_rows_run_cpu_attn_on_its_own_pages(tiny_models):
    import torch

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, 32, 32, "auto")            # for the messages: amx or vec
    reference, _, _ = _run(tiny_models["qwen3"], None, backend="CPU_ATTN")
    # SFI on, with a budget that covers every context: every decode row dense, on CPU_ATTN's kernel
    covering, stats, counts = _run(tiny_models["qwen3"], {"enabled": True, "k": 1024})
    assert stats[STAT_FAST] == stats[STAT_SLOW] == 0 and stats[STAT_DENSE] > 0
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0, counts
    assert "fallback.cpu_attn_packed_pages" not in counts, f"ISA {isa}: {counts}"
    assert covering == reference, f"ISA {isa}"                  # token for token
    # a small budget: fast and slow steps read the same packed pages, nothing falls back
    sparse, stats, counts = _run(tiny_models["qwen3"], SMALL)
    assert stats[STAT_FAST] > stats[STAT_SLOW] > 0
    assert counts["steps.dense_cpu_attn"] == counts["steps.built"] > 0, counts
    assert not [k for k in counts if k.startswith("fallback.")], counts
    assert sparse != reference                              # the budget is small enough to matter
