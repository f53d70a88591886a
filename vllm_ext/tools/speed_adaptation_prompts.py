"""Training prompts for SPEED self-distillation, from the project's own text generators (no data set).

Each prompt is drawn from a source by a seeded generator, with seeds from ``TRAIN_SEED_BASE`` on
(every evaluation in ``scripts/eval_quality.py`` and ``bench/`` draws below 100 000, so no training
prompt is an evaluation prompt):

* ``ruler``: the RULER-style text tasks of :mod:`vllm_ext.quality.tasks` (needles with several
  wordings, multi-key, multi-value, key-value lookup, passage copy), through the chat template;
* ``user_needle``: :mod:`vllm_ext.quality.user_needles` (a value in a card, e-mail, ticket ... in a logbook);
* ``document``: :mod:`vllm_ext.quality.document`'s logbook with one fact and a question;
* ``summary`` / ``continue``: :mod:`vllm_ext.quality.long_answers` (long answers over a logbook).

The answers are not used: the teacher is the dense model's own continuation. A tokenizer without a
chat template gets the ``ruler`` source's plain prompts only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TRAIN_SEED_BASE = 1_000_000
SOURCES = ("ruler", "user_needle", "document", "summary", "continue")
# retrieval-shaped prompts most, where SPEED loses most (bench/QUALITY.md)
SOURCE_WEIGHTS = {"ruler": 4, "user_needle": 2, "document": 2, "summary": 1, "continue": 1}
LONG_ANSWER_SOURCES = ("summary", "continue")


@dataclass(frozen=True)
class TrainingPrompt:
    source: str
    length: int            # the requested bound on the prompt's tokens
    seed: int
    prompt_ids: list[int]


def _ruler(tokenizer, length: int, depth: float, seed: int, rng: random.Random, chat: bool):
    from vllm_ext.quality import tasks as T

    task = rng.choice(T.TEXT_TASKS)
    wording = rng.choice(sorted(T.TEXT_WORDINGS)) if task == "niah_single" else "ruler"
    sample = T.make_text_sample(task, length, depth, seed, tokenizer, wording=wording,
                                value_digits=rng.choice((5, 6, 7, 8)))
    if chat:
        sample = T.chat_sample(sample, tokenizer)
    return f"ruler/{task}", list(sample.prompt_ids)


def training_prompt(tokenizer, index: int, *, min_length: int, max_length: int, seed: int = 0,
                    sources=SOURCES) -> TrainingPrompt:
    """The ``index``-th training prompt: its source, length (uniform in [min, max]) and depth drawn
    from a generator seeded by ``(seed, index)``."""
    rng = random.Random(f"speed-adapt|{seed}|{index}")
    chat = bool(getattr(tokenizer, "chat_template", None))
    usable = [s for s in sources if chat or s == "ruler"]
    if not usable:
        raise ValueError(f"no usable prompt source among {sources} for a tokenizer without a chat template")
    source = rng.choices(usable, weights=[SOURCE_WEIGHTS.get(s, 1) for s in usable])[0]
    length = rng.randint(min_length, max_length)
    depth = round(rng.random(), 4)
    draw_seed = TRAIN_SEED_BASE + 1000 * seed + index
    if source == "ruler":
        source, ids = _ruler(tokenizer, length, depth, draw_seed, rng, chat)
    elif source == "user_needle":
        from vllm_ext.quality.user_needles import FORMS, make_user_needle

        form = rng.choice(FORMS)
        ids = make_user_needle(form, length, depth, draw_seed, tokenizer).prompt_ids
        source = f"user_needle/{form}"
    elif source == "document":
        from vllm_ext.quality.document import _prompt_ids, make_document_question

        ids = _prompt_ids(tokenizer, make_document_question(tokenizer, length, depth, draw_seed).message())
    elif source in LONG_ANSWER_SOURCES:
        from vllm_ext.quality.long_answers import make_long_answer_prompt

        ids = make_long_answer_prompt(source, length, draw_seed, tokenizer).prompt_ids
    else:
        raise ValueError(f"unknown source {source!r}; known: {SOURCES}")
    return TrainingPrompt(source, length, draw_seed, list(ids))
