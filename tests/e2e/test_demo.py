"""The main job's default (``scripts/demo.sh`` -> ``python -m vllm_ext.tools.demo``): the committed
retrieval model served by ``vllm serve --attention-backend speedsfi`` once per method, one
long-context retrieval question each. Here with two methods (dense and SFI) and a 1K-token question
to keep it short; the one-server mode (``--model``) is tests/e2e/test_processes.py."""

import json
import re

import pytest

from vllm_ext.quality import tasks as T

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_shows_dense_and_sfi_on_the_retrieval_model(capsys):
    from vllm_ext.tools.demo import main

    rc = main(["--methods", "dense,sfi", "--length", "1024", "--timeout", "600"])
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
