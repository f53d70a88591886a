"""RULER-style synthetic long-context retrieval tasks, offline and seeded.

Two renderings of the same tasks:

* **tiny** (:func:`make_sample`): word-level prompts over :data:`VOCAB`, the vocabulary of the
  purpose-built model in ``models/retrieval-llama`` (one word = one token, so lengths and needle
  positions are exact token counts). The training script draws its documents from the same
  generators (:func:`training_document`).
* **text** (:func:`make_text_sample`): natural-language RULER prompts for any Hugging Face tokenizer
  (a real model on a GPU later), sized to a token length with that tokenizer.

Tasks (RULER's names in brackets):

* ``niah_single``  [niah_single]: one needle ``the magic number for A B is D D D D .`` in a haystack of
  filler sentences; the question asks for its number.
* ``niah_multikey`` [niah_multikey]: the target needle plus distractor needles with other keys, some of
  them sharing one of the target's two key words (a key is matched only by both words).
* ``niah_multivalue`` [niah_multivalue]: one key with several values at different depths
  (``the first magic number for A B is ...``, ``the second ...``); the answer lists all of them, in
  order, plus distractor needles.
* ``kv_lookup`` [kv retrieval]: the whole context is key-value pairs ``A B = D D D D ;``; the question
  asks for one key's value.

Two haystack styles (``filler``): ``"plain"`` (the default, what the committed models were trained and
measured on): filler sentences of 4-11 words, each ending in ``.``, sometimes a paragraph break;
``"prose"``: sentences of 3-25 words with commas between clauses, a few template words used as glue
(``the of is are``), ended by ``.``, ``;`` or (a ``what ...`` sentence) ``?``, paragraph breaks ``\n``,
so the sentence-boundary refresh schedule of SFI fires about as often as in real text. ``kv_lookup``
has no filler (its context is key-value pairs) and is the same in both styles.

``depth`` in [0, 1] places the target (the first value for ``niah_multivalue``, the queried pair
for ``kv_lookup``) at that fraction of the context; ``length`` is the prompt length in tokens,
BOS and question included. Everything is a pure function of ``(task, length, depth, seed)``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "kv_lookup")
# Text prompts only (a real model): the same four plus a task whose answer is several sentences.
LONG_ANSWER_TASKS = ("passage_copy",)
TEXT_TASKS = TASKS + LONG_ANSWER_TASKS

# --------------------------------------------------------------------------------------------
# The tiny model's vocabulary (word level; the tokenizer in models/retrieval-llama is built from it)
# --------------------------------------------------------------------------------------------
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = 0, 1, 2, 3
PUNCT = [".", "\n", ",", ":", "?", ";", "="]
DIGITS = [str(i) for i in range(10)]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"]
TEMPLATE = ["the", "magic", "number", "numbers", "for", "is", "are", "what", "all", "question",
            "answer", "value", "of"] + ORDINALS
KEY_A = ("red blue green black white brown pink gray gold silver amber azure coral crimson cyan "
         "ivory jade khaki lemon lilac lime maroon mint navy olive orange peach plum rose ruby "
         "rust sand scarlet slate tan teal violet wine bold calm dark fast grand happy lucky "
         "quiet rapid shy").split()
KEY_B = ("cat dog fox wolf bear lion tiger horse mouse eagle owl hawk crow swan duck goose frog "
         "toad snake whale shark seal otter moose deer goat sheep camel zebra panda koala lemur "
         "bison llama yak hare mole bat crab squid snail moth bee ant wasp newt gecko lynx").split()
FILLER = ("a an and or but so then when while after before under over near far into from with "
          "without about above below river mountain valley forest garden village city road "
          "bridge tower house door window table chair book letter paper story song music "
          "picture lamp clock bell stone tree flower leaf grass rain snow wind cloud sun moon "
          "star sky sea lake shore island field farm market school library kitchen morning "
          "evening night day week year time people child friend teacher farmer sailor painter "
          "walks runs sings reads writes builds opens closes finds brings carries watches "
          "waits sleeps dreams grows falls rises shines turns rests stays leaves returns "
          "travels speaks listens remembers slowly quickly quietly softly often never always "
          "again still also very old young new small large long short warm cold bright soft "
          "heavy light early late simple strange gentle busy empty full open narrow wide "
          "deep high low round sweet little great").split()
VOCAB: list[str] = SPECIAL + PUNCT + DIGITS + TEMPLATE + KEY_A + KEY_B + FILLER
assert len(VOCAB) == len(set(VOCAB)), "duplicate words in the tiny vocabulary"
assert len(KEY_A) == len(KEY_B) == 48
WORD_ID = {w: i for i, w in enumerate(VOCAB)}

N_DIGITS = 4                 # digits per value
N_MULTIVALUE = 4             # values of the multivalue key (RULER default)
N_DISTRACTORS = 12           # distractor needles in niah_multikey / niah_multivalue
N_HARD = 4                   # of which share a key word with the target


def ids_of(words: Sequence[str]) -> list[int]:
    return [WORD_ID[w] for w in words]


def words_of(ids: Sequence[int]) -> list[str]:
    return [VOCAB[i] for i in ids]


# --------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One prompt and its expected answer.

    ``prompt_ids`` starts with BOS. ``answer_ids`` is the expected greedy continuation up to and
    including its terminator (``.``); exact match compares the first ``len(answer_ids)`` generated
    tokens with it. ``target_spans``: ``[start, end)`` token spans of the needle(s) that hold the
    answer; ``value_spans``: spans of the answer's value tokens inside the prompt.
    """

    task: str
    length: int
    depth: float
    seed: int
    prompt: str
    prompt_ids: list[int]
    answer: str
    answer_ids: list[int]
    target_spans: list[tuple[int, int]] = field(default_factory=list)
    value_spans: list[tuple[int, int]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.task, self.length, self.depth, self.seed)


def _value(rng: random.Random) -> list[str]:
    return [rng.choice(DIGITS) for _ in range(N_DIGITS)]


def _keys(rng: random.Random, n: int, hard_for: tuple[str, str] | None = None, n_hard: int = 0,
          exclude: set | None = None) -> list[tuple[str, str]]:
    """``n`` distinct keys (pairs), ``n_hard`` of them sharing one word with ``hard_for``."""
    used = set(exclude or ())
    if hard_for is not None:
        used.add(hard_for)
    out = []
    for i in range(n):
        while True:
            if hard_for is not None and i < n_hard:
                k = (hard_for[0], rng.choice(KEY_B)) if i % 2 == 0 else (rng.choice(KEY_A), hard_for[1])
            else:
                k = (rng.choice(KEY_A), rng.choice(KEY_B))
            if k not in used:
                break
        used.add(k)
        out.append(k)
    return out


def _needle(key, value, ordinal: str | None = None) -> list[str]:
    head = ["the", ordinal] if ordinal else ["the"]
    return head + ["magic", "number", "for", key[0], key[1], "is"] + list(value) + ["."]


def _question(kind: str, key) -> tuple[list[str], list[str]]:
    """(question, restatement): the prompt ends with the question and then the answer's opening words,
    which repeat the needle's wording up to the value (RULER's "The special magic number for X ...
    is"). The training loss covers the restatement too (it is copied from the question)."""
    if kind == "multivalue":
        body = ["what", "are", "all", "the", "magic", "numbers", "for"]
        lead = ["the", ORDINALS[0], "magic", "number", "for", key[0], key[1], "is"]
    elif kind == "kv":
        body = ["what", "is", "the", "value", "of"]
        lead = [key[0], key[1], "="]
    else:
        body = ["what", "is", "the", "magic", "number", "for"]
        lead = ["the", "magic", "number", "for", key[0], key[1], "is"]
    return ["\n", "question", ":"] + body + [key[0], key[1], "?", "answer", ":"], lead


def _answer(kind: str, values: list[list[str]], key=None) -> list[str]:
    """The expected continuation after the restatement: the value and its terminator (``;`` for key
    value pairs, ``.`` otherwise); for multivalue every further value in its own needle sentence."""
    if kind == "kv":
        return list(values[0]) + [";"]
    out = list(values[0]) + ["."]
    for i, v in enumerate(values[1:], 1):
        out += ["the", ORDINALS[i], "magic", "number", "for", key[0], key[1], "is"] + list(v) + ["."]
    return out


def _filler(rng: random.Random, n: int) -> tuple[list[str], list[int]]:
    """Exactly ``n`` filler tokens (sentences ending in ``.``, sometimes a paragraph break) and the
    sentence boundaries (indices where a new sentence starts, 0 and ``n`` included)."""
    words: list[str] = []
    bounds = [0]
    while len(words) < n:
        words += [rng.choice(FILLER) for _ in range(rng.randint(4, 11))] + ["."]
        if rng.random() < 0.12:
            words.append("\n")
        bounds.append(len(words))
    words = words[:n]
    bounds = [b for b in bounds if b < n] + [n]
    if n and words[-1] not in (".", "\n"):
        words[-1] = "."
    return words, bounds


PROSE_GLUE = ["the", "the", "of", "is", "are"]     # template words that prose filler also uses
PROSE_P_GLUE = 0.2
PROSE_P_QUESTION = 0.1                              # "what ... ?" sentences
PROSE_P_SEMI = 0.15                                 # sentences ended by ";" (of the non-questions)
PROSE_P_PARAGRAPH = 0.15                            # a "\n" after the sentence
PROSE_ENDERS = (".", "?", ";")
FILLERS = ("plain", "prose")


def _prose_sentence(rng: random.Random, size: int) -> list[str]:
    """One prose sentence of exactly ``size`` >= 4 tokens: 3-25 words (``size`` <= 26), commas between
    clauses, an ender, sometimes a paragraph break after it."""
    nl = int(size >= 6 and rng.random() < PROSE_P_PARAGRAPH)
    body = size - 1 - nl                                # words and commas
    n_commas = rng.randint(0, min(3, (body - 3) // 5)) if body >= 8 else 0
    n_words = body - n_commas
    question = rng.random() < PROSE_P_QUESTION
    words = ["what"] if question else []
    while len(words) < n_words:
        words.append(rng.choice(PROSE_GLUE) if rng.random() < PROSE_P_GLUE else rng.choice(FILLER))
    for gap in sorted(rng.sample(range(2, n_words - 1), n_commas), reverse=True):
        words.insert(gap, ",")                          # never first / last, never two in a row
    ender = "?" if question else (";" if rng.random() < PROSE_P_SEMI else ".")
    return words + [ender] + ["\n"] * nl


def _prose(rng: random.Random, n: int) -> tuple[list[str], list[int]]:
    """Exactly ``n`` prose filler tokens and the sentence boundaries (0 and ``n`` included). Every
    sentence has 3-25 words and ends in ``.`` ``;`` or ``?`` (then maybe ``\n``) when ``n`` >= 4."""
    words: list[str] = []
    bounds = [0]
    while len(words) < n:
        left = n - len(words)
        if left < 4:                                    # only when n < 4: no room for a sentence
            words += [rng.choice(FILLER) for _ in range(left - 1)] + ["."]
        else:
            size = left if left <= 26 else rng.randint(4, min(26, left - 4))   # leave room for one more
            words += _prose_sentence(rng, size)
        bounds.append(len(words))
    return words, bounds


def _assemble(rng: random.Random, budget: int, needles: list[tuple[float | None, list[str]]],
              filler: str = "plain"):
    """Filler of ``budget - sum(len(needles))`` tokens with each needle inserted at a sentence boundary
    (None: a random boundary). A needle with a depth goes where its first token lands nearest to
    ``depth`` of the context (final coordinates, BOS excluded). Returns (words, [start of each
    needle in the prompt, BOS counted])."""
    n_fill = budget - sum(len(w) for _, w in needles)
    if n_fill < 0:
        raise ValueError(f"length too small: the needles alone take {budget - n_fill} tokens")
    fill, bounds = (_prose if filler == "prose" else _filler)(rng, n_fill)
    at: dict[int, int] = {}
    for i, (depth, _) in enumerate(needles):            # random ones first, distinct when possible
        if depth is None:
            free = [b for b in bounds if b not in at.values()] or bounds
            at[i] = rng.choice(free)
    for i, (depth, _) in enumerate(needles):
        if depth is None:
            continue
        target = depth * (budget - len(needles[i][1]))

        def final(b):
            return b + sum(len(needles[j][1]) for j, a in at.items() if a < b or (a == b and j < i))
        at[i] = min(bounds, key=lambda b: (abs(final(b) - target), b in at.values(), b))
    order = sorted(range(len(needles)), key=lambda i: (at[i], i))
    words: list[str] = []
    starts = [0] * len(needles)
    prev = 0
    for i in order:
        words += fill[prev:at[i]]
        starts[i] = len(words) + 1                      # +1: BOS precedes the context
        words += needles[i][1]
        prev = at[i]
    words += fill[prev:]
    return words, starts


def _kv_context(rng: random.Random, budget: int, target_key, target_value, depth: float,
                extra_targets: int = 0):
    """Key-value pairs ``A B = D D D D ;`` (sometimes followed by a line break) filling exactly
    ``budget`` tokens; the target pair sits at ``depth``. Returns (words, target start, pairs)."""
    pair_len = 2 + 1 + N_DIGITS + 1
    n_pairs = max(1, budget // pair_len)
    keys = _keys(rng, n_pairs - 1, exclude={target_key})
    pairs = [(k, _value(rng)) for k in keys]
    t = min(n_pairs - 1, int(round(depth * (n_pairs - 1))))
    pairs.insert(t, (target_key, list(target_value)))
    words: list[str] = []
    start = -1
    for i, (k, v) in enumerate(pairs):
        if i == t:
            start = len(words) + 1
        words += [k[0], k[1], "="] + v + [";"]
    # pad to exactly `budget` with line breaks spread between pairs
    missing = budget - len(words)
    if missing < 0:                                     # budget smaller than one pair
        raise ValueError("length too small for kv_lookup")
    if missing:
        slots = sorted(rng.sample(range(1, n_pairs + 1), min(missing, n_pairs)))
        # insert from the back so earlier indices stay valid
        flat = []
        for i, (k, v) in enumerate(pairs):
            flat.append([k[0], k[1], "="] + v + [";"])
        extra = {s: 1 for s in slots}
        left = missing - len(slots)
        j = 0
        while left > 0:                                 # only when budget > 2 * n_pairs (never in practice)
            extra[slots[j % len(slots)]] += 1
            left -= 1
            j += 1
        words = []
        for i, p in enumerate(flat):
            if i == t:
                start = len(words) + 1
            words += p
            words += ["\n"] * extra.get(i + 1, 0)
    return words, start, pairs


def make_sample(task: str, length: int, depth: float, seed: int, filler: str = "plain") -> Sample:
    """One evaluation sample of ``task`` with ``length`` prompt tokens (BOS and question included)
    and the target at ``depth``, for the tiny model's vocabulary; ``filler``: the haystack style
    (``"plain"``, the default, or ``"prose"``; the key, values and question are the same in both)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    if filler not in FILLERS:
        raise ValueError(f"unknown filler {filler!r}; known: {FILLERS}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"{task}|{length}|{depth:.6f}|{seed}")
    key = (rng.choice(KEY_A), rng.choice(KEY_B))
    kind = {"niah_multivalue": "multivalue", "kv_lookup": "kv"}.get(task, "single")
    q, lead = _question(kind, key)
    q = q + lead
    budget = length - 1 - len(q)
    meta: dict[str, Any] = {"key": " ".join(key), "context_tokens": budget}
    if task == "kv_lookup":
        value = _value(rng)
        ctx, start, pairs = _kv_context(rng, budget, key, value, depth)
        values = [value]
        spans = [(start, start + 3 + N_DIGITS + 1)]
        vspans = [(start + 3, start + 3 + N_DIGITS)]
        meta["n_pairs"] = len(pairs)
    else:
        needles: list[tuple[float | None, list[str]]] = []
        if task == "niah_multivalue":
            values = [_value(rng) for _ in range(N_MULTIVALUE)]
            # the first value at `depth`, the others at random depths; ordinals follow document order
            depths = sorted([depth] + [rng.random() for _ in range(N_MULTIVALUE - 1)])
            needles = [(d, _needle(key, v, ORDINALS[i])) for i, (d, v) in enumerate(zip(depths, values))]
        else:
            values = [_value(rng)]
            needles = [(depth, _needle(key, values[0]))]
        if task in ("niah_multikey", "niah_multivalue"):
            for k in _keys(rng, N_DISTRACTORS, hard_for=key, n_hard=N_HARD):
                needles.append((None, _needle(k, _value(rng))))
        ctx, starts = _assemble(rng, budget, needles, filler)
        n_t = N_MULTIVALUE if task == "niah_multivalue" else 1
        spans = [(s, s + len(needles[i][1])) for i, s in enumerate(starts[:n_t])]
        off = 2 if task == "niah_multivalue" else 1
        vspans = [(s + off + 6, s + off + 6 + N_DIGITS) for s in starts[:n_t]]
        meta["n_needles"] = len(needles)
    if filler != "plain":
        meta["filler"] = filler
    words = ctx + q
    ans = _answer(kind, values, key)
    prompt_ids = [BOS] + ids_of(words)
    assert len(prompt_ids) == length, (task, length, len(prompt_ids))
    return Sample(task=task, length=length, depth=depth, seed=seed, prompt=" ".join(words),
                  prompt_ids=prompt_ids, answer=" ".join(ans[:-1]), answer_ids=ids_of(ans),
                  target_spans=spans, value_spans=vspans, meta=meta)


def make_suite(tasks: Sequence[str] = TASKS, lengths: Sequence[int] = (2048,),
               depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), n_per_cell: int = 2,
               seed: int = 0, filler: str = "plain") -> list[Sample]:
    """Every (task, length, depth) cell with ``n_per_cell`` samples (seeds ``seed .. seed+n-1``)."""
    return [make_sample(t, n, d, seed + i, filler=filler) for t in tasks for n in lengths for d in depths
            for i in range(n_per_cell)]


def exact_match(sample: Sample, generated: Sequence[int]) -> bool:
    return list(generated[:len(sample.answer_ids)]) == sample.answer_ids


# --------------------------------------------------------------------------------------------
# Training documents: the same families, several questions per document, loss on the answers
# --------------------------------------------------------------------------------------------
def training_document(rng: random.Random, length: int, filler: str = "plain") -> tuple[list[int], list[int]]:
    """A document of exactly ``length`` tokens (BOS first) and its loss mask (1 on answer tokens,
    including the terminator ``.``). Families, mixed: haystack with several needles (some hard
    distractors, sometimes a multivalue key) and several questions; key-value pairs with several
    questions. ``filler``: the haystack style (as :func:`make_sample`; ``"plain"`` draws exactly the
    documents the committed models were trained on)."""
    if filler not in FILLERS:
        raise ValueError(f"unknown filler {filler!r}; known: {FILLERS}")
    family = rng.random()
    n_q = max(1, min(8, length // 96 + rng.randint(0, 2)))
    if family < 0.3:                                     # kv pairs
        qa = []
        q_lens = [len(sum(_question("kv", ("x", "y")), [])) + N_DIGITS + 1] * n_q
        budget = length - 1 - sum(q_lens)
        tkey = (rng.choice(KEY_A), rng.choice(KEY_B))
        tval = _value(rng)
        ctx, _, pairs = _kv_context(rng, budget, tkey, tval, rng.random())
        chosen = rng.sample(range(len(pairs)), min(n_q, len(pairs)))
        for i in chosen:
            k, v = pairs[i]
            qa.append((*_question("kv", k), _answer("kv", [v])))
    else:
        # needles: n_single single needles + maybe one multivalue group; hard distractors
        n_needles = max(1, min(48, length // 40 + rng.randint(-2, 2)))
        mv = rng.random() < 0.4 and length >= 256
        n_mv = N_MULTIVALUE if mv else 0                # always 4, like the evaluation (and RULER)
        mv_key = (rng.choice(KEY_A), rng.choice(KEY_B))
        base = mv_key if rng.random() < 0.6 else None
        keys = _keys(rng, n_needles, hard_for=base, n_hard=min(n_needles, rng.randint(0, 6)),
                     exclude={mv_key})
        vals = [_value(rng) for _ in keys]
        mv_vals = [_value(rng) for _ in range(n_mv)]
        asked = rng.sample(range(len(keys)), min(n_q - (1 if mv else 0), len(keys)))
        qa = [(*_question("single", keys[i]), _answer("single", [vals[i]])) for i in asked]
        if mv:
            qa.insert(rng.randint(0, len(qa)), (*_question("multivalue", mv_key),
                                                _answer("multivalue", mv_vals, mv_key)))
        budget = length - 1 - sum(len(q) + len(r) + len(a) for q, r, a in qa)
        keep = [i for i in range(len(keys)) if i in asked or rng.random() < 0.9]
        needles = [(None, _needle(keys[i], vals[i])) for i in keep]
        mv_depths = sorted(rng.random() for _ in range(n_mv))        # ordinals follow document order
        needles += [(d, _needle(mv_key, v, ORDINALS[i])) for i, (d, v) in enumerate(zip(mv_depths, mv_vals))]
        # too crowded for the length: drop needles nobody asks about
        droppable = [j for j, i in enumerate(keep) if i not in asked]
        while sum(len(w) + 6 for _, w in needles) > budget and droppable:
            needles.pop(droppable.pop())
        ctx, _ = _assemble(rng, budget, needles, filler)
    ids = [BOS] + ids_of(ctx)
    mask = [0] * len(ids)
    for j, (q, r, a) in enumerate(qa):
        # the question's first token ("\n") ends the previous answer: in the loss too (a multivalue
        # answer must stop after its last value)
        ids += ids_of(q) + ids_of(r) + ids_of(a)
        mask += [int(j > 0)] + [0] * (len(q) - 1) + [1] * (len(r) + len(a))
    if len(ids) != length:
        raise AssertionError((len(ids), length))
    return ids, mask


# --------------------------------------------------------------------------------------------
# Text prompts for any Hugging Face tokenizer (RULER's wording; a real model on a GPU)
# --------------------------------------------------------------------------------------------
# RULER's "noise" haystack: the same five sentences over and over.
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
         "There and back again.")
TEXT_INTRO = {
    "niah": "Some special magic numbers are hidden within the following text. Make sure to memorize "
            "it. I will quiz you about the numbers afterwards.",
    "kv": "Below is a list of keys and their values. Memorize them. I will ask you for the value of one "
          "key afterwards.",
}


def _text_key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_A)}-{rng.choice(KEY_B)}"


def _text_value(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


# Wordings of the single-needle question (``make_text_sample(wording=...)``): the intro, the needle
# and the question with its answer prefix. "ruler" is RULER's; the others say the same thing as a
# user might, so that a setting chosen on one wording can be checked on another. Each question ends
# in an answer prefix that starts with " The " (chat_sample opens the assistant's turn with it).
TEXT_WORDINGS = {
    "ruler": None,
    "order": ("Below is a long text with one order record in it. Read it carefully; I will ask about "
              "the record afterwards.",
              "The order number for {key} is {value}.",
              "\nWhat is the order number for {key}? Answer with the number. The order number for {key} is"),
    "code": ("A note with an access code is somewhere in the following text. Remember the code.",
             "Remember this: the access code of the {key} account is {value}.",
             "\nWhich access code does the {key} account have? The access code of the {key} account is"),
    "locker": ("The text below hides the place where a parcel waits. Keep it in mind.",
               "The parcel for {key} waits in locker {value}.",
               "\nIn which locker does the parcel for {key} wait? The parcel for {key} waits in locker"),
}


def _text_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def _largest_fitting(build, tokenizer, length: int) -> int:
    """The largest unit count whose prompt ``build(n)`` has at most ``length`` tokens (0 if none)."""
    lo, hi = 0, 1
    while _count(tokenizer, build(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _count(tokenizer, build(mid)) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def make_text_sample(task: str, length: int, depth: float, seed: int, tokenizer, *,
                     wording: str = "ruler", value_digits: int = 7) -> Sample:
    """RULER-style text prompt of at most ``length`` tokens of ``tokenizer`` (special tokens
    included), as long as whole haystack sentences allow. ``answer`` lists the expected values
    (``;``-separated for ``niah_multivalue``); score with :func:`text_score`. ``prompt_ids`` are
    the tokenizer's ids; ``answer_ids`` is empty (real models are scored on text).

    ``wording`` (:data:`TEXT_WORDINGS`; ``niah_single`` only, other than "ruler") and
    ``value_digits`` (the values' length) give prompts of other sets; the defaults are RULER's
    and draw the same prompts as before they existed."""
    if task not in TEXT_TASKS:
        raise ValueError(f"unknown task {task!r}; known: {TEXT_TASKS}")
    if wording not in TEXT_WORDINGS:
        raise ValueError(f"unknown wording {wording!r}; known: {sorted(TEXT_WORDINGS)}")
    if wording != "ruler" and task != "niah_single":
        raise ValueError(f"wording {wording!r} applies to niah_single only, not {task!r}")
    if not 1 <= value_digits <= 18:
        raise ValueError(f"value_digits must be 1-18, got {value_digits}")
    variant = "" if (wording, value_digits) == ("ruler", 7) else f"|{wording}|{value_digits}"
    rng = random.Random(f"text|{task}|{length}|{depth:.6f}|{seed}{variant}")
    key = _text_key(rng)
    if task == "passage_copy":
        return _make_passage_sample(length, depth, seed, tokenizer, rng, key)
    if task == "kv_lookup":
        key = f"{key}-{rng.randint(10, 99)}"
        value = _text_value(rng, value_digits)
        intro = TEXT_INTRO["kv"]
        question = (f"\nWhat is the value of the key {key}? Answer with the number only. "
                    f"The value of {key} is")
        used = {key}

        def unit(i):
            while True:                 # keys with a number: enough distinct ones for 100K+ tokens
                k = f"{_text_key(rng)}-{rng.randint(10, 99)}"
                if k not in used:
                    used.add(k)
                    return f"{k} = {_text_value(rng, value_digits)};"
        target = [f"{key} = {value};"]
        values = [value]
    else:
        intro = TEXT_INTRO["niah"]
        n_val = N_MULTIVALUE if task == "niah_multivalue" else 1
        values = [_text_value(rng, value_digits) for _ in range(n_val)]
        if wording != "ruler":
            intro, needle_form, question_form = TEXT_WORDINGS[wording]
            question = question_form.format(key=key)
        elif task == "niah_multivalue":
            question = (f"\nWhat are all the special magic numbers for {key} mentioned in the provided "
                        f"text? The special magic numbers for {key} mentioned in the provided text are")
        else:
            question = (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
                        f"The special magic number for {key} mentioned in the provided text is")
        if wording != "ruler":
            target = [needle_form.format(key=key, value=v) for v in values]
        else:
            target = [_text_needle(key, v) for v in values]
        distract = []
        if task in ("niah_multikey", "niah_multivalue"):
            a, b = key.split("-")
            keys = _keys(rng, N_DISTRACTORS, hard_for=(a, b), n_hard=N_HARD)
            distract = [_text_needle(f"{x}-{y}", _text_value(rng, value_digits)) for x, y in keys]

        def unit(i):
            return NOISE[i % len(NOISE)]

    def build(n_units):
        units = [unit(i) for i in range(n_units)]
        if task == "kv_lookup":
            at = min(n_units, int(round(depth * n_units)))
            items = units[:at] + target + units[at:]
        else:
            items = list(units)
            # distractors at random sentence boundaries; then the target needles (the first value at
            # `depth`, the others at random depths, in document order), each at the boundary whose
            # character offset in the context is nearest to its depth
            for d, t in sorted(zip(rand_d, distract), key=lambda x: x[0], reverse=True):
                items.insert(min(n_units, int(round(d * n_units))), t)
            depths = sorted([depth] + sorted_rand[: len(target) - 1])
            total = sum(len(x) + 1 for x in items) + sum(len(t) + 1 for t in target)
            lo = 0
            for d, t in zip(depths, target):
                offs, acc = [], 0
                for x in items:
                    offs.append(acc)
                    acc += len(x) + 1
                offs.append(acc)
                goal = d * (total - len(t))
                at = min(range(lo, len(items) + 1), key=lambda b: abs(offs[b] - goal))
                items.insert(at, t)
                lo = at + 1
        context = " ".join(items)
        return f"{intro}\n{context}\n{question}"

    sorted_rand = [rng.random() for _ in range(N_MULTIVALUE)]
    rand_d = [rng.random() for _ in range(N_DISTRACTORS)]
    state = rng.getstate()

    def build_fresh(n):
        rng.setstate(state)             # the same units for every candidate count
        if task == "kv_lookup":
            used.clear()
            used.add(key)
        return build(n)

    prompt = build_fresh(_largest_fitting(build_fresh, tokenizer, length))
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if len(ids) > length:
        raise ValueError(f"length {length} too small for {task} with this tokenizer")
    spans = []
    for t in target:
        c = prompt.index(t)
        spans.append((c, c + len(t)))
    ctx_start = len(intro) + 1
    ctx_end = len(prompt) - len(question) - 1
    return Sample(task=task, length=len(ids), depth=depth, seed=seed, prompt=prompt, prompt_ids=list(ids),
                  answer=";".join(values), answer_ids=[], target_spans=spans, value_spans=[],
                  meta={"key": key, "values": values, "requested_length": length, "wording": wording,
                        "context_chars": (ctx_start, ctx_end)})


def text_score(sample: Sample, generated_text: str) -> float:
    """RULER's string-match-all: the fraction of expected values present in the generated text;
    ``passage_copy``: the ROUGE-L F-measure of the text against the passage."""
    if sample.task == "passage_copy":
        return rouge_l(sample.answer, _first_sentences(generated_text, _PASSAGE_SENTENCES))
    values = sample.answer.split(";")
    return sum(v in generated_text for v in values) / len(values)


def sample_score(sample: Sample, generated_text: str) -> float:
    """What a text sample scores in the quality tables, in [0, 1]: 1 when every expected value is
    in the text (RULER string-match-all, all or nothing), and ROUGE-L F for ``passage_copy``."""
    score = text_score(sample, generated_text)
    return score if sample.task in LONG_ANSWER_TASKS else float(score == 1.0)


def rouge_l(reference: str, generated: str) -> float:
    """ROUGE-L F-measure (Google's ``rouge-score`` package; its default tokenizer: lower-cased
    alphanumeric words, no stemming)."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False).score(reference, generated)["rougeL"].fmeasure


def chat_sample(sample: Sample, tokenizer) -> Sample:
    """The text sample as an instruct model is asked it: the instruction, the context and the
    question as the user's turn of ``tokenizer``'s chat template, and the question's answer prefix
    ("The special magic number for ... is") as the start of the assistant's turn (RULER's form for
    chat models). The prompt grows by the template's few tokens."""
    cut = sample.prompt.rindex(" The ")
    user, prefix = sample.prompt[:cut], sample.prompt[cut + 1:]
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True) + prefix
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return dataclasses.replace(sample, prompt=text, prompt_ids=list(ids), length=len(ids),
                               meta={**sample.meta, "chat_template": True, "answer_prefix": prefix})


# --------------------------------------------------------------------------------------------
# passage_copy: the long answer (several sentences copied from the context)
# --------------------------------------------------------------------------------------------
_P_NAMES = ("Ada", "Bruno", "Celia", "Dmitri", "Elin", "Farouk", "Greta", "Hugo", "Ines", "Jonas",
            "Karin", "Luis", "Mara", "Nils", "Olga", "Pavel")
_P_THINGS = ("spare lantern", "brass compass", "red toolbox", "blue ledger", "copper kettle", "old radio",
             "wooden ladder", "first-aid kit", "tide chart", "signal lamp", "rain barrel", "fishing net")
_P_PLACES = ("boathouse", "cellar", "north shed", "chart room", "kitchen", "attic", "workshop",
             "pantry", "watch tower", "store hut")
_P_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_P_ACTIONS = ("oiled", "checked", "cleaned", "counted", "painted", "repaired")
_P_STATES = ("wet", "broken", "missing", "cracked", "empty", "locked")
_PASSAGE_SENTENCES = 3
# No other notes in the haystack: with four distractor notes of the same form the real model
# (SmolLM2-135M-Instruct) copied a wrong note densely, so the task measured its retrieval, not the copy.
N_PASSAGE_DISTRACTORS = 0


def _first_sentences(text: str, n: int) -> str:
    """The answer a copy task is scored on: the text up to its ``n``-th sentence end (a model that
    copied the passage and went on copying the haystack is not charged for what follows)."""
    import re

    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[:ends[n - 1]] if len(ends) >= n else text


def _passage(rng: random.Random) -> str:
    """Three ordinary sentences, each from its own template with random names and things."""
    a, b = rng.sample(_P_NAMES, 2)
    t1, t2, t3 = rng.sample(_P_THINGS, 3)
    p1, p2 = rng.sample(_P_PLACES, 2)
    return (f"{a} left the {t1} in the {p1} before the storm. "
            f"The {t2} must be {rng.choice(_P_ACTIONS)} every {rng.choice(_P_DAYS)} morning. "
            f"If the {t3} is {rng.choice(_P_STATES)}, ask {b} in the {p2}.")


def _make_passage_sample(length: int, depth: float, seed: int, tokenizer, rng: random.Random,
                         key: str) -> Sample:
    """A note of three sentences for ``key`` at ``depth`` of a RULER noise haystack, among
    ``N_PASSAGE_DISTRACTORS`` notes for other keys; the question asks for the note word for word.
    ``answer`` is the passage; score with :func:`text_score` (ROUGE-L F)."""
    intro = ("Some notes are hidden within the following text. Make sure to memorize them. I will "
             "ask you to repeat one of them afterwards.")
    passage = _passage(rng)
    target = f"The note for {key} says: {passage}"
    question = (f"\nWhat does the note for {key} say? Repeat it word for word. "
                f"The note for {key} says:")
    a, b = key.split("-")
    keys = _keys(rng, N_PASSAGE_DISTRACTORS, hard_for=(a, b), n_hard=1)
    distract = [(rng.random(), f"The note for {x}-{y} says: {_passage(rng)}") for x, y in keys]

    def build(n_units: int) -> str:
        items = [NOISE[i % len(NOISE)] for i in range(n_units)]
        for d, t in sorted(distract, key=lambda x: x[0], reverse=True):
            items.insert(min(n_units, int(round(d * n_units))), t)
        # the target at the sentence boundary nearest to `depth` of the context's characters
        offs, acc = [], 0
        for x in items:
            offs.append(acc)
            acc += len(x) + 1
        offs.append(acc)
        at = min(range(len(items) + 1), key=lambda i: abs(offs[i] - depth * acc))
        items.insert(at, target)
        return f"{intro}\n{' '.join(items)}\n{question}"

    prompt = build(_largest_fitting(build, tokenizer, length))
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if len(ids) > length:
        raise ValueError(f"length {length} too small for passage_copy with this tokenizer")
    c = prompt.index(target)
    return Sample(task="passage_copy", length=len(ids), depth=depth, seed=seed, prompt=prompt,
                  prompt_ids=list(ids), answer=passage, answer_ids=[], target_spans=[(c, c + len(target))],
                  value_spans=[], meta={"key": key, "values": [passage], "requested_length": length,
                                        "context_chars": (len(intro) + 1, len(prompt) - len(question) - 1)})
