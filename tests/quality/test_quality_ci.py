"""CI subset of the quality harness: the committed retrieval model through real vLLM (CPU build).

* dense (SPEEDSFI, every method off) answers a fixed sample of the retrieval tasks at its trained
  length with >= 95% exact match (greedy);
* SFI with a budget that covers the whole context decodes exactly like dense, token for token;
* SFI at a real budget (n_recent 64, k 256: about a sixth of a 2K context on fast steps) still
  answers, and its counters say it ran sparse.

The full suite is ``scripts/eval_quality.py`` (results in ``bench/QUALITY.md``).
"""

import os

import pytest

from tests.e2e.engine import engine
from vllm_ext.quality import tasks as T

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "retrieval-llama")
LENGTH = 2048
# 4 tasks x 5 depths, one seed each; seeds far from the evaluation suite's (0, 1)
SAMPLES = T.make_suite(T.TASKS, [LENGTH], (0.0, 0.25, 0.5, 0.75, 1.0), 1, seed=900)
EXTRA = 4
SETTINGS = dict(max_model_len=LENGTH + 128, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=2048,
                max_num_seqs=10)


def _generate(sfi=None):
    from vllm import SamplingParams

    from vllm_ext import metrics

    extra = {"speedsfi": {"sfi": sfi}} if sfi is not None else {}
    metrics.reset()
    with engine(MODEL, "SPEEDSFI", additional_config=extra, **SETTINGS) as llm:
        params = [SamplingParams(temperature=0, max_tokens=len(s.answer_ids) + EXTRA, ignore_eos=True)
                  for s in SAMPLES]
        outs = llm.generate([{"prompt_token_ids": s.prompt_ids} for s in SAMPLES], params, use_tqdm=False)
        counts = metrics.snapshot()
    return [list(o.outputs[0].token_ids) for o in outs], counts


@pytest.fixture(scope="module")
def dense():
    if not os.path.exists(os.path.join(MODEL, "model.safetensors")):
        pytest.fail(f"the committed model is missing: {MODEL} (scripts/train_retrieval_model.py)")
    return _generate()[0]


def test_dense_accuracy_on_the_committed_model(dense):
    hits = [T.exact_match(s, out) for s, out in zip(SAMPLES, dense)]
    missed = [(s.task, s.depth) for s, h in zip(SAMPLES, hits) if not h]
    assert sum(hits) / len(hits) >= 0.95, f"missed {missed}"


def test_sfi_budget_covering_the_context_equals_dense(dense):
    tokens, counts = _generate({"enabled": True, "k": 4096, "n_recent": 64})
    assert tokens == dense
    assert counts.get("sfi.fast_steps", 0) == 0 and counts.get("sfi.dense_rows", 0) > 0


def test_sfi_sparse_budget_still_retrieves(dense):
    tokens, counts = _generate({"enabled": True, "k": 256, "n_recent": 64})
    assert counts["sfi.fast_steps"] > counts["sfi.slow_steps"] > 0
    fraction = counts["sfi.fast_retained_tokens"] / counts["sfi.fast_context_tokens"]
    assert 0.1 < fraction < 0.2
    hits = [T.exact_match(s, out) for s, out in zip(SAMPLES, tokens)]
    assert sum(hits) / len(hits) >= 0.9
