"""Long answers: a 4K-8K document and a 256-token answer about it, to compare
the text one configuration writes with another's (ROUGE-L), not with a reference.

Two kinds of prompt on the survey logbook of :mod:`.document`:

- ``summary``: the logbook in the user's turn of the chat template, then "Summarise ...";
- ``continue``: the logbook as plain text, cut after a day's heading, for the model to go on writing.

:func:`rouge_l_f` is the ROUGE-L F-measure of Google's ``rouge-score`` package (its default
tokenizer: lower-cased alphanumeric words, no stemming).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import document as D

KINDS = ("summary", "continue")
SUMMARY_REQUEST = ("Summarise these notes: what the crew did, what the weather was like and what they saw. "
                   "Write several paragraphs.")


@dataclass(frozen=True)
class LongAnswerPrompt:
    kind: str
    length: int            # the requested bound on the prompt's tokens
    seed: int
    prompt_ids: list[int]

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.length}|{self.seed}"


def _days(seed: int, n: int) -> list[str]:
    return [D._day(random.Random(f"long-answer-day|{seed}|{i}"), i + 1) for i in range(n)]


def make_long_answer_prompt(kind: str, length: int, seed: int, tokenizer) -> LongAnswerPrompt:
    """The longest logbook whose prompt has at most ``length`` tokens of ``tokenizer``."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")
    days = _days(seed, D.MAX_DAYS // 8)

    def text(n: int) -> str:
        notes = "Here are my notes from the survey trip.\n\n" + "\n\n".join(days[:n])
        if kind == "continue":
            return notes + f"\n\nDay {n + 1}."
        return tokenizer.apply_chat_template([{"role": "user", "content": f"{notes}\n\n{SUMMARY_REQUEST}"}],
                                             tokenize=False, add_generation_prompt=True)

    def ids(n: int) -> list[int]:
        # the chat template writes its special tokens; a plain text starts with none (the model's
        # tokenizer adds no BOS for SmolLM2 either way)
        return list(tokenizer(text(n), add_special_tokens=kind == "continue")["input_ids"])

    lo, hi = 1, 2
    if len(ids(lo)) > length:
        raise ValueError(f"length {length} is too small for one day of the logbook")
    while len(ids(hi)) <= length:
        if hi >= len(days):
            raise ValueError(f"length {length} needs more than {len(days)} days")
        lo, hi = hi, min(2 * hi, len(days))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(ids(mid)) <= length else (lo, mid)
    return LongAnswerPrompt(kind, length, seed, ids(lo))


def rouge_l_f(reference: str, generated: str) -> float:
    """ROUGE-L F-measure (``rouge-score``, no stemming)."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False).score(reference, generated)["rougeL"].fmeasure
