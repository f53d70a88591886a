"""Long-answer prompts (vllm_ext/quality/long_answers.py): within the length and close to it, the
summary through the chat template, the continuation ending on a day's heading, the same ids for the
same seed; ROUGE-L F against hand-computed LCS cases. No engine."""

import pytest

from vllm_ext.quality import long_answers as L


@pytest.mark.parametrize("kind", L.KINDS)
def test_prompt_fills_the_length(tok, kind):
    p = L.make_long_answer_prompt(kind, 2048, 1, tok)
    assert 1900 < len(p.prompt_ids) <= 2048
    text = tok.decode(p.prompt_ids)
    if kind == "summary":
        assert L.SUMMARY_REQUEST in text and text.rstrip().endswith("assistant")
    else:
        assert text.rstrip().split("\n")[-1].startswith("Day ") and text.endswith(".")
    assert L.make_long_answer_prompt(kind, 2048, 1, tok).prompt_ids == p.prompt_ids
    assert L.make_long_answer_prompt(kind, 2048, 2, tok).prompt_ids != p.prompt_ids


def test_bad_kind(tok):
    with pytest.raises(ValueError):
        L.make_long_answer_prompt("translate", 2048, 0, tok)


def test_rouge_l_hand_computed():
    pytest.importorskip("rouge_score")
    assert L.rouge_l_f("the cat sat", "the cat sat") == 1.0
    assert L.rouge_l_f("a b c", "d e f") == 0.0
    # LCS of "the cat sat on the mat" (6) and "the cat on a mat" (5) is "the cat on mat" (4):
    # P = 4/5, R = 4/6, F = 2PR / (P + R) = 8/11
    assert L.rouge_l_f("the cat sat on the mat", "the cat on a mat") == pytest.approx(8 / 11)
    # order matters (a subsequence, not a bag): LCS of "a b c d" and "d c b a" is 1
    assert L.rouge_l_f("a b c d", "d c b a") == pytest.approx(0.25)
