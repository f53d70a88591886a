"""The demo's document question (vllm_ext/quality/document.py): one fact, its number once, the prompt
within the length (chat template applied, with the real model's tokenizer when it is cached), the same
text for the same seed, and what counts as a right answer. No engine."""

import re

import pytest

from vllm_ext.quality.document import QUESTION, DocumentQuestion, make_document_question


class WordTokenizer:
    """Words and punctuation marks as tokens; no chat template (the message alone is the prompt)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [hash(t) % 50000 for t in re.findall(r"\w+|[^\w\s]", text)]}


def _real_tokenizer():
    from vllm_ext.tools import real_model

    path = real_model.model_dir()
    if not (path / real_model.MANIFEST).is_file() or not (path / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module", params=["words", "smollm2"])
def tokenizer(request):
    if request.param == "words":
        return WordTokenizer()
    tok = _real_tokenizer()
    if tok is None:
        pytest.skip("the real model is not cached (python -m vllm_ext.tools.real_model)")
    assert tok.chat_template, "the real model's tokenizer carries its chat template"
    return tok


@pytest.mark.parametrize("length, depth", [(1000, 0.5), (5000, 0.5), (5000, 0.0), (3000, 1.0)])
def test_one_fact_one_number_within_the_length(tokenizer, length, depth):
    q = make_document_question(tokenizer, length, depth, seed=3)
    assert re.fullmatch(r"[1-9]\d{3}", q.answer)
    assert q.document.count(q.fact) == 1 and q.answer in q.fact
    assert q.document.count(q.answer) == 1                    # the number only in the fact
    assert q.message().count(q.answer) == 1
    assert q.document.count("locker") == 1 and q.document.count("spare key") == 1
    assert q.question == QUESTION and q.message().rstrip().endswith("Answer with the number only.")
    n = q.prompt_tokens(tokenizer)
    assert n <= length
    assert n > length - 200                                    # the longest log that fits (a day < 200 tokens)
    at = q.document.index(q.fact) / len(q.document)
    assert abs(at - depth) < 0.1, (at, depth)


def test_prompt_tokens_count_the_chat_template(tokenizer):
    q = make_document_question(tokenizer, 1500, 0.5, seed=0)
    plain = len(tokenizer(q.message(), add_special_tokens=False)["input_ids"])
    if getattr(tokenizer, "chat_template", None):
        assert q.prompt_tokens(tokenizer) > plain             # system turn, roles, assistant opening
    else:
        assert q.prompt_tokens(tokenizer) == plain
    assert q.messages() == [{"role": "user", "content": q.message()}]


def test_same_seed_same_text_other_seed_other_text():
    tok = WordTokenizer()
    a, b = make_document_question(tok, 2000, 0.4, seed=7), make_document_question(tok, 2000, 0.4, seed=7)
    assert a == b
    c = make_document_question(tok, 2000, 0.4, seed=8)
    assert c.document != a.document and c.answer != a.answer
    d = make_document_question(tok, 2000, 0.8, seed=7)
    assert d.answer == a.answer and d.document.index(d.fact) > a.document.index(a.fact)


def test_the_number_stays_unique_past_day_999():
    """Day numbers reach four digits in a long log; the locker number is drawn among those it lacks."""
    tok = WordTokenizer()
    q = make_document_question(tok, 120_000, 0.5, seed=0)
    assert q.document.count("\n\n") + 1 > 1000
    assert q.document.count(q.answer) == 1


def test_too_short_a_length_is_refused():
    with pytest.raises(ValueError, match="too small"):
        make_document_question(WordTokenizer(), 20)
    with pytest.raises(ValueError, match="depth"):
        make_document_question(WordTokenizer(), 2000, 1.5)


@pytest.mark.parametrize("reply, right", [
    ("9186", True),
    ("9186.", True),
    ("Locker 9186", True),
    ("The spare key to the lighthouse is kept in locker number 9186, behind the tide tables.", True),
    ("9,186", True),
    ("918", False),                     # cut short
    ("91860", False),
    ("19186", False),
    ("Locker 12, or maybe 9186", False),   # another number first
    ("in the locker by the door", False),
    ("", False),
    (None, False),
])
def test_correct(reply, right):
    q = DocumentQuestion("log", QUESTION, "9186", "fact", 0.5)
    assert q.correct(reply) is right
