"""The RULER-style task generators of the quality harness (no engine, no model)."""

import random

import pytest

from vllm_ext.quality import tasks as T

LENGTHS = (300, 1024, 2048, 4096)
DEPTHS = (0.0, 0.1, 0.5, 0.9, 1.0)


def _count(seq, sub):
    return sum(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("task", T.TASKS)
def test_deterministic_and_seed_dependent(task):
    a = T.make_sample(task, 1024, 0.5, 7)
    b = T.make_sample(task, 1024, 0.5, 7)
    c = T.make_sample(task, 1024, 0.5, 8)
    assert a == b
    assert a.prompt_ids != c.prompt_ids and a.answer_ids != c.answer_ids


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_length_vocabulary_and_text(task, length):
    s = T.make_sample(task, length, 0.3, 1)
    assert len(s.prompt_ids) == length
    assert s.prompt_ids[0] == T.BOS and T.BOS not in s.prompt_ids[1:]
    assert all(0 <= i < len(T.VOCAB) for i in s.prompt_ids + s.answer_ids)
    assert T.UNK not in s.prompt_ids and T.PAD not in s.prompt_ids
    assert T.words_of(s.prompt_ids[1:]) == s.prompt.split(" ")
    assert T.VOCAB[s.answer_ids[-1]] == (";" if task == "kv_lookup" else ".")
    # the prompt ends by restating the needle up to its value
    assert s.prompt.endswith(" =" if task == "kv_lookup" else " is")
    assert s.meta["key"] in s.prompt.split("answer :")[-1]


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_answer_present_once_at_the_requested_depth(task, depth):
    length = 2048
    s = T.make_sample(task, length, depth, 3)
    ids = s.prompt_ids
    n_values = T.N_MULTIVALUE if task == "niah_multivalue" else 1
    assert len(s.target_spans) == len(s.value_spans) == n_values
    key = T.ids_of(s.meta["key"].split())
    for (a, b), (va, vb) in zip(s.target_spans, s.value_spans):
        assert a <= va < vb <= b
        needle = ids[a:b]
        assert _count(needle, key) == 1                      # the needle names the key
        assert _count(ids, needle) == 1                      # ... and occurs exactly once
    # the values, in answer order, are the needles' values (document order)
    values = [ids[va:vb] for va, vb in s.value_spans]
    digits = [i for i in s.answer_ids if T.VOCAB[i].isdigit()]
    assert sum(values, []) == digits
    assert [a for a, _ in s.target_spans] == sorted(a for a, _ in s.target_spans)
    # the key occurs in the context only in the target needle(s) (then in the question and in the
    # restatement that ends the prompt)
    assert _count(ids, key) == n_values + 2
    # position: the target's first token sits at `depth` of the context (between BOS and the
    # question); needles go to sentence boundaries, key-value pairs to pair boundaries
    ctx = s.meta["context_tokens"]
    starts = [a - 1 for a, _ in s.target_spans]                  # context coordinates
    lens = [b - a for a, b in s.target_spans]
    err = min(abs(a - depth * (ctx - n)) for a, n in zip(starts, lens))
    assert err <= 16                       # one sentence (or one distractor needle) of slack


def test_multikey_distractors_share_key_words():
    s = T.make_sample("niah_multikey", 2048, 0.5, 0)
    a, b = (T.WORD_ID[w] for w in s.meta["key"].split())
    ids = s.prompt_ids
    the_magic = T.ids_of(["magic", "number", "for"])
    keys = [tuple(ids[i + 3:i + 5]) for i in range(len(ids) - 5) if ids[i:i + 3] == the_magic]
    assert len(keys) == 1 + T.N_DISTRACTORS + 2              # target, distractors, question, restatement
    hard = [k for k in keys if (k[0] == a) != (k[1] == b)]
    assert len(hard) >= T.N_HARD                            # (a random key may share one too)


def test_kv_lookup_keys_unique():
    s = T.make_sample("kv_lookup", 4096, 0.5, 0)
    w = s.prompt.split("question")[0].split(" ")
    keys = [(w[i - 2], w[i - 1]) for i, x in enumerate(w) if x == "="]
    assert len(keys) == len(set(keys)) == s.meta["n_pairs"]


def test_suite_and_exact_match():
    suite = T.make_suite(T.TASKS, [512, 1024], [0.0, 1.0], 2, seed=5)
    assert len(suite) == len(T.TASKS) * 2 * 2 * 2
    assert len({s.key for s in suite}) == len(suite)
    s = suite[0]
    assert T.exact_match(s, s.answer_ids + [5, 6])
    assert not T.exact_match(s, s.answer_ids[:-1])


def test_training_documents():
    rng = random.Random(0)
    for length in (128, 256, 512, 2048):
        for _ in range(30):
            ids, mask = T.training_document(rng, length)
            assert len(ids) == len(mask) == length and ids[0] == T.BOS
            assert sum(mask) >= len(T.ids_of(["0"] * T.N_DIGITS)) + 1
            # the loss covers answers (restatement, values, terminators), never the context
            first_q = ids.index(T.WORD_ID["question"])
            assert not any(mask[:first_q])
            digits = set(T.ids_of(T.DIGITS))
            assert sum(m for i, m in zip(ids, mask) if i in digits) >= T.N_DIGITS


def test_text_samples_with_a_hf_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from vllm_ext.tools.tiny_models import build_tokenizer

    tok = build_tokenizer(str(tmp_path))
    for task in T.TASKS:
        for depth in (0.0, 0.5, 1.0):
            s = T.make_text_sample(task, 1500, depth, 2, tok)
            assert s == T.make_text_sample(task, 1500, depth, 2, tok)
            assert 1300 <= s.length <= 1500 and len(s.prompt_ids) == s.length
            values = s.meta["values"]
            assert len(values) == (T.N_MULTIVALUE if task == "niah_multivalue" else 1)
            for v, (a, b) in zip(values, s.target_spans):
                assert s.prompt.count(v) == 1 and v in s.prompt[a:b]
            lo, hi = s.meta["context_chars"]
            assert s.prompt[lo:hi].strip() and all(lo <= a < b <= hi for a, b in s.target_spans)
            rel = [(a - lo) / (hi - lo) for a, _ in s.target_spans]
            assert min(abs(r - depth) for r in rel) < 0.05
            assert T.text_score(s, " ".join(values)) == 1.0
            assert T.text_score(s, "nothing") == 0.0


def test_passage_copy_text_sample(tmp_path):
    """The long-answer task: one note of three sentences at `depth`, asked for word for word and
    scored by ROUGE-L F on the answer's first three sentences."""
    pytest.importorskip("transformers")
    pytest.importorskip("rouge_score")
    from vllm_ext.tools.tiny_models import build_tokenizer

    tok = build_tokenizer(str(tmp_path))
    for depth in (0.0, 0.5, 1.0):
        s = T.make_text_sample("passage_copy", 1500, depth, 4, tok)
        assert s == T.make_text_sample("passage_copy", 1500, depth, 4, tok)
        assert 1300 <= s.length <= 1500 and len(s.prompt_ids) == s.length
        passage = s.answer
        assert passage.count(". ") == 2 and passage.endswith(".") and s.prompt.count(passage) == 1
        (a, b), = s.target_spans
        assert passage in s.prompt[a:b] and s.meta["key"] in s.prompt[a:b]
        lo, hi = s.meta["context_chars"]
        assert abs((a - lo) / (hi - lo - (b - a)) - depth) < 0.05
        assert s.prompt.rstrip().endswith(f"The note for {s.meta['key']} says:")
        # a copy scores 1 whatever follows it; half the passage about half; nothing 0
        assert T.text_score(s, " " + passage + " The grass is green. The sky is blue.") == 1.0
        half = T.text_score(s, " " + passage.split(". ")[0] + ".")
        assert 0.3 < half < 0.7
        assert T.text_score(s, "The sun is yellow.") < 0.2
        assert T.sample_score(s, passage) == 1.0
    assert T.make_text_sample("passage_copy", 1500, 0.5, 5, tok).answer != s.answer


# --------------------------------------------------------------------------------------------
# Haystack styles: the default ("plain") is what the committed models were trained and measured on
# --------------------------------------------------------------------------------------------
# SHA-256 of the samples / training documents below in the plain style (the committed models' documents)
PLAIN_SAMPLES_SHA = "d150562edc2f129de5941192b010fc902c0ef01ea213023ea36b4ae1e8ad543b"
PLAIN_DOCS_SHA = "5d5623152d655f758e7ce436e4b52d6e0a22af4729f74faf0ad716fc77889d46"


def test_default_filler_is_unchanged():
    import hashlib
    import json

    h = hashlib.sha256()
    for task in T.TASKS:
        for n in (256, 512, 2048):
            for d in (0.0, 0.37, 1.0):
                for seed in range(3):
                    x = T.make_sample(task, n, d, seed)
                    assert x == T.make_sample(task, n, d, seed, filler="plain")
                    h.update(json.dumps([x.prompt_ids, x.answer_ids, x.target_spans, x.value_spans,
                                         x.meta]).encode())
    assert h.hexdigest() == PLAIN_SAMPLES_SHA
    h = hashlib.sha256()
    for i in range(40):
        ids, mask = T.training_document(random.Random(f"doc|{i}"), [128, 256, 512, 1024, 2048][i % 5])
        h.update(json.dumps([ids, mask]).encode())
    assert h.hexdigest() == PLAIN_DOCS_SHA


def _sentences(words):
    """Split filler words into sentences (each ends in an ender, then maybe a paragraph break)."""
    out, cur = [], []
    for w in words:
        if w == "\n":
            assert not cur and out, "a paragraph break only right after a sentence ender"
            out[-1].append(w)
            continue
        cur.append(w)
        if w in T.PROSE_ENDERS:
            out.append(cur)
            cur = []
    assert not cur, "the filler ends with a sentence ender"
    return out


def _check_prose_sentences(words):
    sents = _sentences(words)
    for s in sents:
        body = [w for w in s if w not in T.PROSE_ENDERS and w != "\n"]
        n_words = sum(w != "," for w in body)
        assert 3 <= n_words <= 25, s
        assert body[0] != "," and body[-1] != ","
        assert all(not (a == b == ",") for a, b in zip(body, body[1:]))
        assert all(w in T.FILLER or w in T.PROSE_GLUE or w in ("what", ",") for w in body), s
        assert (s[len(body)] == "?") == (body[0] == "what")
    return sents


def test_prose_filler_exact_budget_and_sentences():
    rng = random.Random(5)
    for n in list(range(0, 80)) + [500, 1999]:
        words, bounds = T._prose(rng, n)
        assert len(words) == n
        assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(set(bounds))
        if n >= 4:
            sents = _check_prose_sentences(words)
            assert [0] + [sum(map(len, sents[:i + 1])) for i in range(len(sents))] == bounds


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("depth", (0.0, 0.5, 1.0))
def test_prose_samples(task, depth):
    plain = T.make_sample(task, 2048, depth, 4)
    s = T.make_sample(task, 2048, depth, 4, filler="prose")
    assert len(s.prompt_ids) == 2048 and s.prompt_ids[0] == T.BOS
    # the same key, values and question: only the haystack differs
    assert (s.meta["key"], s.answer_ids) == (plain.meta["key"], plain.answer_ids)
    q = s.prompt_ids.index(T.WORD_ID["question"]) - 1            # the "\n" before "question"
    assert s.prompt_ids[q:] == plain.prompt_ids[plain.prompt_ids.index(T.WORD_ID["question"]) - 1:]
    if task == "kv_lookup":                                       # no filler: the same context
        assert s.prompt_ids == plain.prompt_ids
        return
    assert s.prompt_ids != plain.prompt_ids and s.meta["filler"] == "prose"
    # needles intact, at the requested depth (as close as plain), holding the answer's values
    words = T.words_of(s.prompt_ids)
    key = s.meta["key"].split()
    for (a, b), (va, vb) in zip(s.target_spans, s.value_spans):
        assert words[a] == "the" and words[b - 1] == "." and words[a:b].count(key[0]) == 1
        assert words[b - 1 - T.N_DIGITS - 3:b - 1 - T.N_DIGITS] == [key[0], key[1], "is"]
    digits = [i for i in s.answer_ids if T.VOCAB[i].isdigit()]
    assert sum((s.prompt_ids[va:vb] for va, vb in s.value_spans), []) == digits
    a0, p0 = s.target_spans[0][0], plain.target_spans[0][0]
    assert abs(a0 - p0) <= 30
    # what is left after cutting the needles out is prose: 3-25-word sentences, enders . ; ?
    ctx = list(words[1:q])
    starts = [i for i in range(len(ctx)) if ctx[i] == "the" and "magic" in ctx[i + 1:i + 3]]
    keep, i = [], 0
    for st in starts:
        keep += ctx[i:st]
        i = ctx.index(".", st) + 1
    keep += ctx[i:]
    _check_prose_sentences(keep)


def test_prose_has_every_ender_and_paragraphs():
    words = T._prose(random.Random(1), 5000)[0]
    for tok in (".", ";", "?", ",", "\n"):
        assert words.count(tok) >= 10, tok
    lens = [sum(w not in (",", "\n") for w in s) - 1 for s in _sentences(words)]
    assert min(lens) <= 5 and max(lens) >= 22                      # varied lengths


def test_prose_training_documents():
    rng = random.Random(3)
    for length in (128, 512, 2048):
        for _ in range(20):
            ids, mask = T.training_document(rng, length, "prose")
            assert len(ids) == len(mask) == length and ids[0] == T.BOS
            first_q = ids.index(T.WORD_ID["question"])
            assert not any(mask[:first_q]) and sum(mask) > T.N_DIGITS
    with pytest.raises(ValueError):
        T.make_sample("niah_single", 512, 0.5, 0, filler="poetry")


def test_text_wordings_and_value_lengths(tmp_path):
    """Other wordings and value lengths: a different set (other prompts, other values), the value
    once at its depth, an answer prefix the chat form can open the assistant's turn with; the
    defaults draw the prompts they always drew."""
    pytest.importorskip("transformers")
    from vllm_ext.tools.tiny_models import build_tokenizer

    tok = build_tokenizer(str(tmp_path))
    base = T.make_text_sample("niah_single", 1500, 0.5, 2, tok)
    assert base == T.make_text_sample("niah_single", 1500, 0.5, 2, tok, wording="ruler", value_digits=7)
    for wording in T.TEXT_WORDINGS:
        for digits in (5, 8):
            s = T.make_text_sample("niah_single", 1500, 0.5, 2, tok, wording=wording, value_digits=digits)
            (v,) = s.meta["values"]
            assert len(v) == digits and s.prompt.count(v) == 1 and s.meta["wording"] == wording
            assert v in s.prompt[slice(*s.target_spans[0])]
            assert " The " in s.prompt[s.prompt.rindex("\n"):]          # chat_sample's answer prefix
            assert s.prompt != base.prompt
    with pytest.raises(ValueError, match="wording"):
        T.make_text_sample("niah_single", 1500, 0.5, 2, tok, wording="nope")
    with pytest.raises(ValueError, match="niah_single"):
        T.make_text_sample("kv_lookup", 1500, 0.5, 2, tok, wording="code")
