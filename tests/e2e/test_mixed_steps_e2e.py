"""Mixed steps inside the real engine (CPU build): on steps that mix decode rows and prefill chunks, every
row of every layer call is computed by exactly one path (``vllm_ext.row_counters``): the dense
pass skips the rows whose output SFI writes, and the counts add up to the rows of the layer calls."""

import pytest

from tests.e2e.engine import engine, greedy, random_prompts

pytestmark = [pytest.mark.e2e]

SMALL = {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16, "refresh": 8}


def test_mixed_steps_compute_each_row_once(tiny_models, monkeypatch):
    from vllm_ext import metrics

    monkeypatch.setenv("SPEEDSFI_ROW_COUNTERS", "1")
    # a short prompt decodes while the long ones are still prefilled in chunks of <= 64 tokens
    prompts = random_prompts(lengths=(40, 300, 200), seed=5)
    before = metrics.snapshot()
    with engine(tiny_models["qwen3"], "SPEEDSFI", additional_config={"speedsfi": {"sfi": SMALL}},
                max_num_batched_tokens=64) as llm:
        greedy(llm, prompts, max_tokens=24)
        after = metrics.snapshot()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert d["steps.mixed"] > 0
    paths = ("rows.delegate", "rows.paged_decode", "rows.sfi_slow", "rows.sfi_fast", "rows.critiprefill")
    assert sum(d.get(k, 0) for k in paths) == d["rows.layer"] > 0
    # SFI's fast rows were left out of the dense pass, and its slow rows too where the compiled CPU
    # kernels write them; with the PyTorch twins the dense pass attends the slow rows (SFI's pass only
    # scores them). (The slow-step count is the engine's own: its counters start at 0 with it.)
    from vllm_ext.kernels import cpu_native

    assert d["rows.sfi_fast"] > 0 and after["sfi.slow_steps"] > 0
    assert (d["rows.sfi_slow"] > 0) == (cpu_native.library() is not None)
    assert d["rows.delegate"] < d["rows.layer"]
