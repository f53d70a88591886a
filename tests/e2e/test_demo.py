"""The main job (``scripts/demo.sh`` -> ``python -m vllm_ext.tools.demo``). Its default: the real model
(``vllm_ext.tools.real_model``) served by ``vllm serve --attention-backend speedsfi`` once per method,
a question about a long document through the chat completions endpoint; here dense only, on a
shorter document, to keep it short (skipped when the model is not cached). ``--retrieval-model``: the
committed retrieval model once per method, one long-context retrieval question each; here with two
methods (dense and SFI) and a 1K-token question. The one-server mode (``--model``) is
tests/e2e/test_processes.py."""

import json
import re

import pytest

from vllm_ext.quality import tasks as T

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_shows_dense_and_sfi_on_the_retrieval_model(capsys):
    from vllm_ext.tools.demo import main

    rc = main(["--retrieval-model", "--methods", "dense,sfi", "--length", "1024", "--timeout", "600"])
    out = capsys.readouterr().out
    assert rc == 0, out
    sample = T.make_sample("niah_multikey", 1024, 0.5, 0)
    expected = " ".join(T.words_of(sample.answer_ids))
    assert "[demo] question (niah_multikey, 1,024 tokens" in out
    assert "question : what is the magic number for" in out          # the question, abbreviated
    assert f"[demo] expected answer: {expected!r}" in out
    # the committed model answers this densely (bench/QUALITY.md: 100 % on niah_multikey)
    assert f"[demo] dense: answer {expected!r}  correct: yes" in out
    assert re.search(r"\[demo\] sfi: answer '.*'  correct: (yes|no)", out)

    counters = {m: json.loads(c) for m, c in re.findall(r"\[demo\] (\w+): counters (\{.*\})", out)}
    assert set(counters) == {"dense", "sfi"}
    assert counters["dense"]["steps.built"] > 0 and "sfi.fast_steps" not in counters["dense"]
    sfi = counters["sfi"]
    assert sfi["sfi.fast_steps"] > 0 and sfi["sfi.prefill_end_selections"] == 1
    assert not [k for k in sfi if k.startswith("fallback.")]
    kept = float(re.search(r"\[demo\] sfi: kept ([0-9.]+) of the KV read on fast decode steps", out).group(1))
    assert kept == pytest.approx(sfi["sfi.fast_retained_tokens"] / sfi["sfi.fast_context_tokens"], abs=1e-3)
    assert 0 < kept < 1
    assert re.search(r"^\s+dense\s+.*\s+yes\s+1\.000\s", out, re.M)        # the summary table
    assert re.search(r"^\s+sfi\s+", out, re.M)


def test_demo_default_asks_the_real_model_about_a_document(capsys):
    from vllm_ext.quality.document import make_document_question
    from vllm_ext.tools import real_model
    from vllm_ext.tools.demo import main

    path = real_model.model_dir()
    if real_model.verify(path) is not None:
        pytest.skip("the real model is not cached (python -m vllm_ext.tools.real_model)")
    from transformers import AutoTokenizer

    rc = main(["--methods", "dense", "--length", "2048", "--timeout", "600"])
    out = capsys.readouterr().out
    assert rc == 0, out
    tok = AutoTokenizer.from_pretrained(str(path))
    q = make_document_question(tok, 2048, 0.5, 0)
    assert f"[demo] model: {path}" in out
    assert f"the prompt is {q.prompt_tokens(tok):,} tokens with the chat template" in out
    assert f"[demo] the fact: {q.fact!r}" in out
    assert f"[demo] expected answer: {q.answer}" in out
    m = re.search(r"\[demo\] dense: answer (['\"])(.*)\1  correct: (yes|no)", out)
    assert m and (m.group(3) == "yes") == q.correct(m.group(2))
    assert re.search(r"\[demo\] dense: request [0-9.]+ s \(.* the request only\), server start [0-9.]+ s", out)
    counters = json.loads(re.search(r"\[demo\] dense: counters (\{.*\})", out).group(1))
    assert counters["steps.built"] > 0 and not [k for k in counters if k.startswith("sfi.")]
    assert re.search(r"^\s+dense\s+.*\s+(yes|no)\s+1\.000\s+[0-9.]+\s+[0-9.]+\s+-$", out, re.M)
