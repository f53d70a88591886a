"""SPEEDSFI across processes: spawned engine cores and workers, `vllm serve` with an OpenAI client,
tensor parallelism 2 with the mp executor. Per-process counters (SPEEDSFI_TRACE_DIR) prove that our
backend ran inside the worker processes."""

import os

import pytest

from tests.e2e.engine import engine, greedy, random_prompts
from vllm_ext.metrics import read_traces

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def trace_dir(tmp_path, monkeypatch):
    d = str(tmp_path / "trace")
    monkeypatch.setenv("SPEEDSFI_TRACE_DIR", d)
    monkeypatch.setenv("SPEEDSFI_TRACE_INTERVAL_S", "0")
    return d


def _worker_counts(trace_dir):
    traces = {pid: c for pid, c in read_traces(trace_dir).items() if pid != os.getpid()}
    return traces


def _cpu_steps(counts) -> int:
    """Steps a process ran on the CPU path: dense rows through CPU_ATTN's kernels, or the PyTorch
    path (the tests' Triton interpreter keeps SPEEDSFI's own cache format when a method is on)."""
    return counts.get("steps.dense_cpu_attn", 0) + counts.get("steps.dense_torch", 0)


def test_spawned_engine_matches_in_process(tiny_models, trace_dir):
    prompts = random_prompts(lengths=(5, 300), seed=5)
    with engine(tiny_models["llama"], "SPEEDSFI", multiprocessing=True) as llm:
        spawned = greedy(llm, prompts, max_tokens=32)
    with engine(tiny_models["llama"], "CPU_ATTN") as llm:
        reference = greedy(llm, prompts, max_tokens=32)
    assert spawned == reference
    workers = _worker_counts(trace_dir)
    assert workers, "no counters from a spawned process"
    assert sum(_cpu_steps(c) for c in workers.values()) > 0


def test_tensor_parallel_2_matches_tp1(tiny_models, trace_dir, monkeypatch):
    """Each rank holds one of the two KV heads; with SFI every rank runs its own selector (cross-head
    exclusivity is off at <= 2 local heads either way), so TP=2 equals TP=1 token for token: on the
    150-token prompt's fast steps, on the short prompts (dense below SFI's minimum context) and with
    SFI turned off for a request (every method off)."""
    from vllm import SamplingParams

    extra = {"speedsfi": {"sfi": {"enabled": True, "k": 8, "k_min": 4, "n_sink": 4, "n_recent": 16}}}
    prompts = random_prompts(lengths=(5, 150, 40, 150), seed=6)
    greedy_ = dict(temperature=0, max_tokens=32, ignore_eos=True)
    params = [SamplingParams(**greedy_)] * 3 + [
        SamplingParams(**greedy_, extra_args={"speedsfi": {"sfi": {"enabled": False}}})]

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with engine(tiny_models["qwen3"], "SPEEDSFI", multiprocessing=True, tensor_parallel_size=2,
                distributed_executor_backend="mp", additional_config=extra) as llm:
        tp2 = run(llm)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with engine(tiny_models["qwen3"], "SPEEDSFI", additional_config=extra) as llm:
        tp1 = run(llm)
    assert tp2 == tp1
    ranks = [c for c in _worker_counts(trace_dir).values() if _cpu_steps(c)]
    assert len(ranks) == 2, f"expected both TP ranks to run SPEEDSFI, got {ranks}"
    assert all(c.get("sfi.fast_steps", 0) > 0 for c in ranks)


def test_vllm_serve_answers_an_openai_client(tiny_models, capsys, monkeypatch):
    """The README's main job: `vllm serve --attention-backend speedsfi` + the OpenAI client (the
    server in a reader's environment: not Triton's interpreter, which the suite sets for its kernel
    tests)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from vllm_ext.tools.demo import main

    rc = main(["--model", tiny_models["qwen3"], "--max-tokens", "8", "--timeout", "300"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "[demo] answer (8 tokens" in out
    assert '"steps.dense_cpu_attn"' in out
    assert 'speedsfi_events_total{event="steps.dense_cpu_attn"}' in out     # vLLM's /metrics
