"""Forced-agreement counting (vllm_ext/quality/forced_agreement.py): a request's step kinds from the
backend's per-step snapshots, the distance since the last selection, and agreement rates by group
against hand-counted cases. No engine."""

import pytest

from vllm_ext.quality import forced_agreement as FA


def _view(mode, is_decode=True):
    return {"mode": mode, "is_decode": is_decode}


def test_request_modes_follow_the_request_through_the_batch():
    snaps = [
        {"0-aa": _view("dense", False), "1-bb": _view("dense", False)},     # prefill chunks
        {"0-aa": _view("dense", False), "1-bb": _view("dense", False)},     # prefill ends: token 0
        {"0-aa": _view("slow"), "1-bb": _view("slow")},
        {"1-bb": _view("fast"), "0-aa": _view("fast")},                     # rows reordered
        {"10-cc": _view("slow"), "0-aa": _view("fast")},                    # "10" is not "1"
        {"0-aa": _view("slow"), "1-bb": _view("fast")},
    ]
    assert FA.request_modes(snaps, "0", 5) == ["prefill", "slow", "fast", "fast", "slow"]
    assert FA.request_modes(snaps, "1", 4) == ["prefill", "slow", "fast", "fast"]
    # a count that does not match the tokens is not guessed at
    assert FA.request_modes(snaps, "1", 5) is None


def test_since_select_counts_from_the_prefill_and_each_slow_step():
    modes = ["prefill", "fast", "fast", "slow", "fast", "dense", "fast", "slow"]
    assert FA.since_select(modes) == [None, 1, 2, 0, 1, None, 3, 0]


def test_step_rows_and_summary_hand_counted():
    ref = {"tokens": [5, 6, 7, 8, 9, 10], "gap": [2.0, 0.1, 5.0, 0.5, 0.0, 4.0]}
    req = {"argmax": [5, 1, 7, 2, 3, 10], "margin": [0.0, 0.3, 0.0, 0.0, 1.5, 0.0],
           "modes": ["prefill", "slow", "fast", "fast", "slow", "fast"]}
    rows = FA.step_rows(ref, req, "continue|4096|0")
    assert [r["agree"] for r in rows] == [True, False, True, False, False, True]
    assert [r["since_select"] for r in rows] == [None, 0, 1, 2, 0, 1]
    s = FA.summarise(rows)
    assert s["n"] == 6 and s["disagree_n"] == 3 and s["agree"] == pytest.approx(0.5)
    # step 3's reference token ties the best logit (margin 0): agree_or_tie counts it
    assert s["agree_or_tie"] == pytest.approx(4 / 6)
    assert s["first_disagreement"] == {"continue|4096|0": 1}
    assert s["by_mode"]["slow"] == dict(n=2, agree=0.0, disagree_n=2, share_of_disagreements=pytest.approx(2 / 3))
    assert s["by_mode"]["fast"]["agree"] == pytest.approx(2 / 3)
    assert s["by_mode"]["prefill"]["agree"] == 1.0 and "dense" not in s["by_mode"]
    assert s["by_since_select"]["0"]["disagree_n"] == 2 and s["by_since_select"]["2-3"]["disagree_n"] == 1
    assert s["by_reference_gap"]["<0.25"] == dict(n=2, agree=0.0, disagree_n=2,
                                                  share_of_disagreements=pytest.approx(2 / 3))
    assert s["by_reference_gap"][">=3"]["agree"] == 1.0
    assert s["by_position"]["0-15"]["n"] == 6


def test_without_modes_every_decode_step_is_dense():
    ref = {"tokens": [1, 2, 3], "gap": [1.0, 1.0, 1.0]}
    rows = FA.step_rows(ref, {"argmax": [1, 2, 4], "margin": [0, 0, 1], "modes": None}, "k|1|0")
    assert [r["mode"] for r in rows] == ["prefill", "dense", "dense"]
    assert FA.summarise(rows)["by_mode"]["dense"]["agree"] == pytest.approx(0.5)


def test_step_rows_rejects_a_short_record():
    with pytest.raises(ValueError):
        FA.step_rows({"tokens": [1, 2, 3], "gap": [0, 0, 0]}, {"argmax": [1, 2], "margin": [0, 0]}, "k")
