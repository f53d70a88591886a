"""User-written needle prompts (vllm_ext/quality/user_needles.py): each form's value once in the
prompt, inside the needle, at its depth, the prompt within the length with the real model's chat
template, no answer prefix, the same prompt for the same arguments, and a JSON row rebuilds it."""

import pytest

from vllm_ext.quality import tasks as T
from vllm_ext.quality import user_needles as U


@pytest.mark.parametrize("form", U.FORMS)
@pytest.mark.parametrize("depth", [0.05, 0.95])
def test_one_value_in_its_needle_within_the_length(tok, form, depth):
    s = U.make_user_needle(form, 1024, depth, 3, tok, value_digits=6)
    assert 900 < s.length <= 1024 and len(s.prompt_ids) == s.length
    assert len(s.answer) == 6 and s.prompt.count(s.answer) == 1
    a, b = s.target_spans[0]
    assert s.answer in s.prompt[a:b]
    # the needle sits near its depth of the document (whole paragraphs: within a day's length)
    assert abs(a / len(s.prompt) - depth) < 0.1
    # a plain question ends the user's turn; the assistant's turn is empty (no answer prefix)
    opening = tok.apply_chat_template([{"role": "user", "content": "Q?"}], tokenize=False,
                                      add_generation_prompt=True).split("Q?", 1)[1]
    assert s.prompt.endswith(s.meta["question"] + opening)
    assert T.sample_score(s, f"It is {s.answer}.") == 1.0
    assert T.sample_score(s, f"It is {s.answer[:3]}{s.answer[4:]}.") == 0.0


def test_same_arguments_same_prompt_and_rebuild(tok):
    s = U.make_user_needle("table", 1024, 0.5, 7, tok, value_digits=5)
    assert U.make_user_needle("table", 1024, 0.5, 7, tok, value_digits=5).prompt_ids == s.prompt_ids
    assert U.make_user_needle("table", 1024, 0.5, 8, tok, value_digits=5).answer != s.answer
    row = dict(task=s.task, length=1024, depth=0.5, seed=7, expected=s.answer, wording=s.meta["wording"])
    assert U.is_user_wording(row["wording"]) and not U.is_user_wording("order")
    assert U.rebuild(row, tok).prompt_ids == s.prompt_ids


def test_bad_arguments(tok):
    with pytest.raises(ValueError):
        U.make_user_needle("memo", 1024, 0.5, 0, tok)
    with pytest.raises(ValueError):
        U.make_user_needle("card", 1024, 1.5, 0, tok)


def test_eval_quality_builds_them_per_form_and_length(tok, monkeypatch):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "eval_quality.py")
    spec = importlib.util.spec_from_file_location("eval_quality_for_test", path)
    eq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eq)
    args = eq.parse(["--text", "--chat", "--user-forms", "card,email", "--value-digits", "5",
                     "--lengths", "1024", "--depths", "0.1,0.9", "--per-cell", "1", "--seed", "40"])
    samples = eq.build_samples(args, tok)
    assert [s.meta["wording"] for s in samples] == ["user_card"] * 2 + ["user_email"] * 2
    assert len({s.key for s in samples}) == 4                  # the forms take their own seeds
    assert all(len(s.answer) == 5 and s.length <= 1024 for s in samples)
    # --chat does not template them twice
    assert all(s.prompt.count("<|im_start|>user") == 1 for s in samples)
    assert samples[0].prompt_ids == U.rebuild(dict(task="niah_single", length=1024, depth=0.1, seed=40,
                                                   expected=samples[0].answer, wording="user_card"), tok).prompt_ids
