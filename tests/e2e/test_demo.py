"""The main job (``scripts/demo.sh`` -> ``python -m vllm_ext.tools.demo``). Its default: the real model
(``vllm_ext.tools.real_model``) served by ``vllm serve --attention-backend speedsfi`` for each method,
a question about a long document through the chat completions endpoint; here dense only, on a
shorter document, to keep it short (skipped when the model is not cached). ``--retrieval-model``: the
committed retrieval model, one long-context retrieval question for each method; here with two
methods (dense and SFI: one server, dense a request with SFI off on it) and a 1K-token question.
``--batch-only``: requests decoding together, SFI off and the preset; here two requests on a tiny
checkpoint, long enough that the preset decodes sparse. The one-server mode (``--model``) is tests/e2e/test_processes.py."""

import json
import re

import pytest

from vllm_ext.quality import tasks as T

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _as_a_reader_runs_it(monkeypatch):
    """The demo's servers and its batch child get a reader's environment: without the suite's
    TRITON_INTERPRET (set for the kernel tests), they run SPEEDSFI's CPU path, as on a user's machine,
    not Triton's interpreter (minutes). The demo imports no kernel module in this process."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


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
    assert out.count("[demo] server healthy after") == 1                 # dense asked of SFI's server
    assert "[demo] ---- dense: SFI off for this request, on the sfi server" in out
    assert "--no-enable-prefix-caching" in out              # each request prefills its prompt whole
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

    rc = main(["--methods", "dense", "--length", "2048", "--timeout", "600", "--no-batch"])
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


def test_demo_batch_only_times_sfi_off_and_the_preset(capsys, tiny_models, monkeypatch):
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.tools.demo import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)     # the child runs as a reader's would

    length = SpeedSfiConfig.from_dict({"preset": "sfi"}).sfi.min_len + 300    # past it: sparse rows
    rc = main(["--batch-only", "--model", tiny_models["llama"], "--batch-requests", "2",
               "--batch-length", str(length), "--batch-steps", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"\[demo\] batch: 2 requests of [0-9,]+ prompt tokens decoding together, 8 steps timed "
                     r"per run \(thread CPU time, one OpenMP thread\), float32", out)
    assert "[demo] batch progress: SFI off: prefill" in out                 # a line as each run starts
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\[demo\]\s+(SFI off|sfi preset)\s+([0-9.]+)\s+([0-9]+)\s+([0-9.]+)\s+(\d+)\s+(\d+)\s+([0-9.]+)$", out, re.M)}
    assert set(rows) == {"SFI off", "sfi preset"}, out
    off, preset = rows["SFI off"], rows["sfi preset"]
    assert off[3:] == ("0", "0", "1.000")                                # dense rows only
    assert int(preset[4]) > 0 and 0 < float(preset[5]) < 1                 # fast steps, a part of the KV
    ratio = float(re.search(r"the preset's tokens/s over SFI off's: ([0-9.]+)x", out).group(1))
    assert ratio == pytest.approx(float(preset[0]) / float(off[0]), rel=0.02)
    section = out[out.index("[demo] ---- batch"):].splitlines()
    assert all(line.startswith("[demo]") for line in section if line.strip())   # vLLM's log: a file
