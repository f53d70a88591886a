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
