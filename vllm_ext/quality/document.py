"""A long document a person can read, with one fact in it and a question about that fact (the demo's
question on a real model).

The document is the logbook of a fictional coastal survey: one paragraph per day, each made of
ordinary sentences (weather, work, meals, what was seen), drawn from a seeded generator so that the
same seed gives the same text. One sentence, at a chosen depth, records where a key is kept; the
question asks for it. The other numbers in the log are day numbers and small counts, and the answer
(a four-digit locker number) is drawn so that it appears in the document exactly once, in that
sentence.

    q = make_document_question(tokenizer, length=5000, depth=0.5, seed=0)
    client.chat.completions.create(model=..., messages=q.messages(), max_tokens=24, temperature=0)
    q.correct(reply)

``length`` bounds the whole prompt the model reads: the user's message with the tokenizer's chat
template applied (system turn, if the template adds one, and the assistant's opening included), or
the message alone for a tokenizer without a chat template.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_WIND = ("north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west")
_NAMES = ("Ada", "Bruno", "Celia", "Dmitri", "Elin", "Farouk", "Greta", "Hugo", "Ines", "Jonas")
_WORK = ("mapped the rocks along the inner bay", "sounded the channel with the lead line",
         "dried the sails on the beach", "carried water up from the spring",
         "mended the nets that the storm had torn", "measured the tide against the old post",
         "cleaned the lenses of the survey instruments", "cut fresh planks for the boat",
         "walked the cliff path to count the nesting birds", "copied yesterday's soundings into the chart")
_THINGS = ("pump", "rudder", "stove", "anchor chain", "compass housing", "rain barrel", "lantern",
           "hand winch", "chart table", "door of the store hut")
_SKY = ("grey", "pale blue", "the colour of slate", "orange over the western hills", "clear",
        "heavy with low cloud", "streaked with thin white cloud")
_FOOD = ("fish stew", "bread and cheese", "boiled potatoes with salted pork", "barley soup",
         "smoked herring", "porridge with dried apples", "beans and onions")
_PLACES = ("fire", "boathouse", "lighthouse steps", "big table in the hut", "shelter of the dunes")
_ANIMALS = ("seals", "gannets", "porpoises", "puffins", "cormorants", "terns", "hares")
_MOODS = ("Everyone was tired but cheerful.", "Nobody said much that evening.",
          "Greta played the fiddle until the lamp ran low.", "We went to bed early.",
          "The younger crew told stories about the old keeper.", "It rained softly through the night.")

QUESTION = "In which locker is the spare key to the lighthouse kept?"
MAX_DAYS = 4000          # far more than any context this is asked at (about 80 tokens a day)


@dataclass(frozen=True)
class DocumentQuestion:
    document: str          # the logbook
    question: str          # what the user asks after the document
    answer: str            # the expected answer (the locker number)
    fact: str              # the one sentence that holds it
    depth: float           # where that sentence sits, 0 (start) to 1 (end)
    seed: int = 0

    def message(self) -> str:
        """The user's message: the question, the document, then the question again (as one asks about
        a long text: a 135M-parameter model finds the fact at mid-depth this way, not when the
        question comes only after the document)."""
        return (f"Read the survey logbook below, then answer this question: {self.question}\n\n"
                f"{self.document}\n\nQuestion: {self.question} Answer with the number only.")

    def messages(self) -> list[dict[str, str]]:
        """The chat request (OpenAI ``messages``): one user turn."""
        return [{"role": "user", "content": self.message()}]

    def prompt_tokens(self, tokenizer) -> int:
        """Tokens of the prompt the model reads (chat template applied when the tokenizer has one)."""
        return len(_prompt_ids(tokenizer, self.message()))

    def correct(self, text: str | None) -> bool:
        """Whether the reply gives the locker number: its first number (digits, thousands separators
        allowed) is the answer. 'Locker 9186.' and '9,186' are right; '918', '91860' and a reply
        that names another number first are not."""
        if not text:
            return False
        numbers = re.findall(r"\d+", re.sub(r"(?<=\d)[,\u202f ](?=\d{3}\b)", "", text))
        return bool(numbers) and numbers[0] == self.answer


def _prompt_ids(tokenizer, message: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
        # the template writes the special tokens itself (vLLM's chat endpoint tokenizes it the same)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(message, add_special_tokens=False)["input_ids"])


def _day(rng: random.Random, n: int) -> str:
    a, b = rng.sample(_NAMES, 2)
    sentences = [
        f"Day {n}. The wind came from the {rng.choice(_WIND)} and the sea was "
        f"{rng.choice(('calm', 'choppy', 'rough', 'almost flat'))}.",
        f"{a} and the others {rng.choice(_WORK)}, while {b} repaired the {rng.choice(_THINGS)}.",
        f"We counted {rng.randint(2, 40)} {rng.choice(_ANIMALS)} near the "
        f"{rng.choice(('point', 'reef', 'harbour mouth', 'north beach', 'sand bar'))}.",
        f"By evening the sky was {rng.choice(_SKY)}, and we ate {rng.choice(_FOOD)} by the "
        f"{rng.choice(_PLACES)}.",
        rng.choice(_MOODS),
    ]
    if rng.random() < 0.5:
        sentences.insert(2, f"{rng.choice(_NAMES)} {rng.choice(_WORK)} in the afternoon.")
    return " ".join(sentences)


def fact_sentence(locker: str) -> str:
    return (f"Before the boat left for the mainland, the keeper told us that the spare key to the "
            f"lighthouse is kept in locker number {locker}, behind the tide tables.")


def make_document_question(tokenizer, length: int = 5000, depth: float = 0.5,
                           seed: int = 0) -> DocumentQuestion:
    """The longest logbook whose prompt (see the module's docstring) has at most ``length`` tokens of
    ``tokenizer``, with the fact at ``depth`` (0: after the first day, 1: after the last)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"logbook|{seed}")
    lockers = [str(rng.randint(1000, 9999)) for _ in range(64)]
    days: list[str] = []

    def build(n_days: int) -> DocumentQuestion:
        while len(days) < n_days:
            days.append(_day(random.Random(f"logbook|{seed}|{len(days)}"), len(days) + 1))
        paragraphs = days[:n_days]
        body = "\n\n".join(paragraphs)
        # the first locker whose digits occur nowhere else in the log (day numbers >= 1000 could)
        locker = next((x for x in lockers if x not in body), None)
        if locker is None:
            raise ValueError(f"no locker number left that the {n_days}-day logbook does not contain")
        fact = fact_sentence(locker)
        at = min(n_days - 1, int(depth * n_days))
        paragraphs = paragraphs[:at] + [paragraphs[at] + " " + fact] + paragraphs[at + 1:]
        return DocumentQuestion("\n\n".join(paragraphs), QUESTION, locker, fact, depth, seed)

    def size(n: int) -> int:
        return build(n).prompt_tokens(tokenizer)

    if size(1) > length:
        raise ValueError(f"length {length} is too small for one day of the logbook")
    lo, hi = 1, 2                     # size(lo) <= length; grow hi until size(hi) > length
    while size(hi) <= length:
        if hi >= MAX_DAYS:
            return build(hi)
        lo, hi = hi, min(2 * hi, MAX_DAYS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= length else (lo, mid)
    return build(lo)
