"""Single-needle prompts as a user writes them, not in RULER's form.

The project's own needle prompts (:func:`vllm_ext.quality.tasks.make_text_sample`) put a needle
sentence in RULER's repeated-noise haystack, and open the assistant's turn with an answer prefix
("The order number for X is"), so the value is the first thing the model writes. A user asks
differently: a document of ordinary prose (here the survey logbook of :mod:`.document`), a value in
one of the forms people keep values in (a paragraph of its own between two days), and a plain question after the document, with no answer
prefix; the model writes a sentence and the value somewhere in it. The forms (:data:`FORMS`):

- ``card``: a record card, field per line ("Order reference: 621500");
- ``vault``: one sentence ("The code to open the vault is 541581.");
- ``table``: a small markdown table whose one row holds the value;
- ``email``: a quoted e-mail ("> Your booking number is 318204.");
- ``ticket``: a support ticket's header lines ("Ticket #: 7731942");
- ``sms``: a quoted text message ("Got a text from the bank: your PIN reset code is 55028.").

Each prompt is a :class:`~vllm_ext.quality.tasks.Sample` of task ``niah_single`` scored like the
others (:func:`~vllm_ext.quality.tasks.sample_score`: the value's digits in the reply), with the
chat template already applied (``meta["chat_template"]``), so :func:`tasks.chat_sample` must not be
applied again.
"""

from __future__ import annotations

import random

from . import document as D
from .tasks import Sample, _largest_fitting

FORMS = ("card", "vault", "table", "email", "ticket", "sms")
_PEOPLE = ("Marta Lindqvist", "Oskar Brenner", "Priya Raman", "Tomasz Wolny", "Helen Okafor",
           "Jules Moreau", "Ana Ferreira", "Kenji Sato", "Ruth Abernathy", "Samir Haddad")
_CITIES = ("Bergen", "Porto", "Gdansk", "Lyon", "Leeds", "Osaka", "Tunis", "Graz")


def _value(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def _needle(form: str, rng: random.Random, value: str) -> tuple[str, str]:
    """(the text holding the value, the user's question about it)."""
    name, other = rng.sample(_PEOPLE, 2)
    if form == "card":
        return (f"Record card\nCustomer: {name}\nCity: {rng.choice(_CITIES)}\nOrder reference: {value}\n"
                f"Status: shipped",
                f"What is the order reference on {name}'s record card?")
    if form == "vault":
        return (f"The code to open the vault is {value}.",
                "What is the code to open the vault?")
    if form == "table":
        other_value = _value(rng, len(value))
        a, b = rng.sample(_CITIES, 2)
        rows = [f"| {name} | {a} | {value} |", f"| {other} | {b} | {other_value} |"]
        rng.shuffle(rows)
        return ("| Member | City | Account number |\n|---|---|---|\n" + "\n".join(rows),
                f"What is {name}'s account number in the members' table?")
    if form == "email":
        return (f"> From: {name}\n> Subject: your booking\n>\n> Dear guest, thank you for staying with us. "
                f"Your booking number is {value}. Please quote it when you call.\n> Kind regards, {name}",
                f"What booking number did {name}'s e-mail give?")
    if form == "ticket":
        return (f"SUPPORT TICKET\nOpened by: {name}\nTicket #: {value}\nPriority: normal\n"
                f"Problem: the generator at the hut will not start.",
                f"What is the number of the support ticket {name} opened?")
    if form == "sms":
        return (f"Got a text from the bank at noon: \"Your PIN reset code is {value}. Do not share it.\"",
                "What PIN reset code did the bank's text message give?")
    raise ValueError(f"unknown form {form!r}; known: {FORMS}")


def make_user_needle(form: str, length: int, depth: float, seed: int, tokenizer, *,
                     value_digits: int = 6) -> Sample:
    """The longest logbook whose chat prompt has at most ``length`` tokens, with ``form``'s needle
    as its own paragraph at ``depth`` (0: before the first day, 1: after the last) and the question
    after the document. The value occurs in the prompt exactly once."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; known: {FORMS}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"user-needle|{form}|{length}|{depth:.6f}|{seed}|{value_digits}")
    value = _value(rng, value_digits)
    needle, question = _needle(form, rng, value)
    days: list[str] = []

    def message(n_days: int) -> str:
        while len(days) < n_days:
            days.append(D._day(random.Random(f"user-needle-day|{seed}|{len(days)}"), len(days) + 1))
        paragraphs = days[:n_days]
        at = round(depth * n_days)
        paragraphs = paragraphs[:at] + [needle] + paragraphs[at:]
        return ("Here are my notes from the survey trip.\n\n" + "\n\n".join(paragraphs)
                + f"\n\n{question}")

    def prompt(n_days: int) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": message(n_days)}], tokenize=False,
                                             add_generation_prompt=True)

    class _NoSpecial:                      # _largest_fitting counts with special tokens; the template has them
        def __call__(self, text, add_special_tokens=True):
            return tokenizer(text, add_special_tokens=False)

    n = _largest_fitting(prompt, _NoSpecial(), length)
    if n < 1:
        raise ValueError(f"length {length} too small for a user needle")
    text = prompt(n)
    if text.count(value) != 1:
        raise AssertionError(f"value {value} occurs {text.count(value)} times")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    c = text.index(needle)
    return Sample(task="niah_single", length=len(ids), depth=depth, seed=seed, prompt=text, prompt_ids=ids,
                  answer=value, answer_ids=[], target_spans=[(c, c + len(needle))], value_spans=[],
                  meta={"values": [value], "requested_length": length, "wording": f"user_{form}",
                        "chat_template": True, "question": question})


def is_user_wording(wording: str) -> bool:
    return wording.startswith("user_") and wording[len("user_"):] in FORMS


def rebuild(row: dict, tokenizer) -> Sample:
    """The sample of an eval_quality JSON row whose wording is ``user_<form>``."""
    return make_user_needle(row["wording"][len("user_"):], row["length"], row["depth"], row["seed"], tokenizer,
                            value_digits=len(row["expected"]))
