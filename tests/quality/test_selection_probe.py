"""``vllm_ext.quality.selection_probe`` on the committed model (transformers, CPU, no vLLM engine):
one row per layer, KV head and target needle; a budget covering the allowed set keeps every needle
word, and ``--summary`` counts samples over the depths."""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "retrieval-llama")


@pytest.fixture(scope="module")
def model():
    import transformers                       # a dependency of vLLM: always installed with it

    return transformers.LlamaForCausalLM.from_pretrained(MODEL, attn_implementation="eager").eval()


def test_rows_per_needle_and_a_covering_budget(model):
    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.quality import tasks as T
    from vllm_ext.quality.selection_probe import probe

    sample = T.make_sample("niah_multivalue", 512, 0.5, 0)
    cfg = model.config
    big = SfiConfig(enabled=True, k=512, n_recent=64, select_span=6, select_span_back=6)
    rows = probe(model, sample, big, "all")
    assert len(rows) == cfg.num_hidden_layers * cfg.num_key_value_heads * T.N_MULTIVALUE
    assert all(all(r["selected"]) for r in rows)                # k >= |A|: everything is kept
    assert {len(r["positions"]) for r in rows} == {13}         # "the ORD magic number for K K is d d d d ."
    small = SfiConfig(enabled=True, k=64, n_recent=64, keep_prefill=16)
    rows = probe(model, sample, small, "all")
    # with keep_prefill the probe looks at the kept set: at most 16 positions outside the recent window
    per_head = {}
    for r in rows:
        per_head.setdefault((r["layer"], r["kv_head"]), set()).update(
            p for p, s in zip(r["positions"], r["selected"]) if s and p < 512 - 64)
    assert all(len(v) <= 16 for v in per_head.values())


def test_summary_counts_samples(model, capsys):
    from types import SimpleNamespace

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.quality import selection_probe

    args = SimpleNamespace(task="niah_single", length=512, seeds=1, needles="first")
    out = selection_probe.summary(model, args, SfiConfig(enabled=True, k=512, n_recent=64))
    assert out["samples"] == 5 and set(out["whole"].values()) == {5} and set(out["lost"].values()) == {0}
    assert "samples with every target needle whole" in capsys.readouterr().out
    json.dumps(out)
