"""Trigger sets from real tokenizers (trained locally) and the device look-up table."""

import random

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from vllm_ext.methods.sfi.config import SfiConfig  # noqa: E402
from vllm_ext.methods.sfi.schedule import is_trigger, lut_bits  # noqa: E402
from vllm_ext.methods.sfi.triggers import (LUT_ENDER, LUT_SPACE, boundary_token_ids, ends_in_trigger,  # noqa: E402
                                   is_whitespace_only, trigger_lut, trigger_token_ids)

CHARS = SfiConfig().trigger_chars          # . ? ! ; \n 。 ？ ！


def _corpus():
    rng = random.Random(0)
    en = "the quick brown fox jumps over a lazy dog while sparse attention selects tokens".split()
    zh = ["注意力", "稀疏", "解码", "模型", "选择", "令牌"]
    for _ in range(1500):
        yield " ".join(rng.choice(en) for _ in range(rng.randint(3, 12))) + rng.choice(
            [".", "?", "!", ";", ".\n", "\n\n", " .", "...", ".。"])
        yield "".join(rng.choice(zh) for _ in range(rng.randint(2, 6))) + rng.choice(["。", "？", "！", "。\n", "，"])


@pytest.fixture(scope="module")
def trained():
    """A byte-level BPE (GPT-2 style) trained here, with one special and two plain added tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(["[END.]"])
    tok.add_tokens(["done.", "wait "])
    return tok


def _id(tok, s):
    i = tok.token_to_id(s)
    assert i is not None, f"token {s!r} missing from the trained vocabulary"
    return i


def test_rule_on_strings():
    assert ends_in_trigger(".", CHARS) and ends_in_trigger("end.", CHARS)
    assert ends_in_trigger(". ", CHARS) and ends_in_trigger(" .", CHARS) and ends_in_trigger(".\t ", CHARS)
    assert ends_in_trigger(".\n\n", CHARS) and ends_in_trigger("\n  ", CHARS)
    assert ends_in_trigger("。", CHARS) and ends_in_trigger("好？", CHARS) and ends_in_trigger("！", CHARS)
    assert ends_in_trigger(".\ufffd", CHARS)                  # '.' then the start of the next character
    assert not ends_in_trigger("\ufffd\ufffd", CHARS)         # only a tail: ambiguous, never a trigger
    assert not ends_in_trigger("a", CHARS) and not ends_in_trigger(" ", CHARS) and not ends_in_trigger("", CHARS)
    assert not ends_in_trigger(".a", CHARS) and not ends_in_trigger('."', CHARS) and not ends_in_trigger("，", CHARS)
    assert not ends_in_trigger("\n", (".",))                  # \n is not a trigger there: stripped as whitespace
    assert ends_in_trigger(".\n", (".",))


def test_trained_tokenizer_hand_checked(trained):
    ids = set(trigger_token_ids(trained, CHARS))
    must = {".": ".", "?": "?", "!": "!", ";": ";", "Ċ": "\n", "ĊĊ": "\n\n", "Ġ.": " .", "...": "...",
            "ãĢĤ": "。", "ï¼Ł": "？", "ï¼ģ": "！", ".ãĢĤ": ".。", "done.": "done."}
    for token, text in must.items():
        i = _id(trained, token)
        assert trained.decode([i], skip_special_tokens=False) == text
        assert i in ids, (token, text)
    never = ["ãĢ", "ã", "Ĥ", "Ġ", "a", "the", "wait ", "[END.]", "<s>", "</s>", "<unk>", "ï¼Į"]   # ï¼Į = '，'
    for token in never:
        assert _id(trained, token) not in ids, token
    # only the listed characters count
    assert _id(trained, "Ċ") not in set(trigger_token_ids(trained, (".", "?")))
    assert set(trigger_token_ids(trained, ("。",))) >= {_id(trained, "ãĢĤ"), _id(trained, ".ãĢĤ")}


def test_trained_tokenizer_matches_byte_oracle(trained):
    """Every id of the vocabulary against an independent byte-level decode of its token string."""
    from tokenizers.pre_tokenizers import ByteLevel
    # GPT-2's bytes_to_unicode, inverted (ByteLevel.alphabet() is the same set of 256 characters)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    assert set(inv) == set(ByteLevel.alphabet())
    added = trained.get_added_tokens_decoder()
    expected = set()
    for i in range(trained.get_vocab_size(with_added_tokens=True)):
        if i in added:
            if added[i].special:
                continue
            text = added[i].content
        else:
            text = bytes(inv[c] for c in trained.id_to_token(i)).decode("utf-8", errors="replace")
        if ends_in_trigger(text, CHARS):
            expected.add(i)
    assert set(trigger_token_ids(trained, CHARS)) == expected


def test_partial_utf8_hand_built_bpe():
    """A hand-built byte-level BPE where tokens end inside a multi-byte character."""
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [(".", "ã"), ("ã", "Ģ"), ("ãĢ", "Ĥ"), ("Ģ", "Ĥ"), (".", "Ġ"), ("!", "ĠĠ"), ("Ġ", "Ġ")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ids = set(trigger_token_ids(tok, CHARS))
    assert vocab[".ã"] in ids               # b".\xe3": the sentence ended, the next character begins
    assert vocab["ãĢĤ"] in ids              # 。
    assert vocab[".Ġ"] in ids               # ". "
    assert vocab["ĠĠ"] not in ids
    assert vocab["!ĠĠ"] in ids              # "!  "
    assert vocab["ãĢ"] not in ids           # b"\xe3\x80": incomplete
    assert vocab["ĢĤ"] not in ids           # b"\x80\x82": the tail of 。 but also of U+2002, ...
    assert vocab["Ĥ"] not in ids and vocab["ã"] not in ids
    assert vocab["Ċ"] in ids and vocab["."] in ids and vocab["a"] not in ids


def test_hf_wrapper_same_set(trained):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=trained, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    assert trigger_token_ids(fast, CHARS) == trigger_token_ids(trained, CHARS)


def test_generic_decode_only_object():
    class Tiny:                                 # just decode() and __len__, like a minimal wrapper
        vocab = ["a", ".", " b", "?", "<eos>", "x\n", "\ufffd"]
        all_special_ids = [4]

        def __len__(self):
            return len(self.vocab)

        def decode(self, ids, **kwargs):
            return "".join(self.vocab[i] for i in ids)

    assert trigger_token_ids(Tiny(), CHARS) == [1, 3, 5]
    assert trigger_token_ids(Tiny(), ()) == []


def test_lut():
    lut = trigger_lut([1, 5, 9, 100, -3], vocab_size=10, device="cpu")
    assert lut.dtype == torch.int8 and lut.shape == (10,)
    assert lut.nonzero().flatten().tolist() == [1, 5, 9]
    assert set(lut.tolist()) == {0, LUT_ENDER}
    assert not trigger_lut([], 4).any()


def test_lut_whitespace_bit():
    lut = trigger_lut([1, 5, 9, 100], vocab_size=10, whitespace_ids=[2, 5, 12, -1])
    assert lut.dtype == torch.int8
    # bit 0 = ender, bit 1 = whitespace-only; 5 is both (e.g. "\n"); out-of-range ids are dropped
    assert lut.tolist() == [0, 1, 2, 0, 0, 3, 0, 0, 0, 1]
    assert LUT_ENDER == 1 and LUT_SPACE == 2
    tok = torch.tensor([0, 1, 2, 5, 9, -1, 10, 1000])
    # is_trigger keeps its meaning (bit 0), whatever the other bits, and ids outside the LUT are 0
    assert is_trigger(tok, lut).tolist() == [False, True, False, True, True, False, False, False]
    assert lut_bits(tok, lut).tolist() == [0, 1, 2, 3, 1, 0, 0, 0]
    # a bool LUT (ender bit only) still reads the same
    assert is_trigger(tok, lut != 0).tolist() == [False, True, True, True, True, False, False, False]
    assert lut_bits(tok, (lut & 1) != 0).tolist() == [0, 1, 0, 1, 1, 0, 0, 0]


def test_whitespace_rule_on_strings():
    for text in ("\n", "\n\n", " ", "  ", "\t", "\r\n", "\u3000"):
        assert is_whitespace_only(text), repr(text)
    for text in ("", "a", " a", ".\n", "\ufffd", " \ufffd", "\n."):
        assert not is_whitespace_only(text), repr(text)


def test_trained_tokenizer_whitespace_ids(trained):
    enders, spaces = boundary_token_ids(trained, CHARS)
    assert enders == trigger_token_ids(trained, CHARS)
    spaces = set(spaces)
    for token in ("Ċ", "ĊĊ", "Ġ"):                         # "\n", "\n\n", " "
        assert _id(trained, token) in spaces, token
    for token in (".", "a", "the", "Ġ.", "wait ", "ãĢ", "[END.]", "<s>"):
        assert _id(trained, token) not in spaces, token
    # every whitespace-only id decodes to whitespace, and "\n" is in both sets
    for i in spaces:
        assert trained.decode([i], skip_special_tokens=False).isspace()
    assert _id(trained, "Ċ") in set(enders)
    # without trigger characters: no enders, the whitespace set is the same
    assert boundary_token_ids(trained, ())[0] == [] and set(boundary_token_ids(trained, ())[1]) == spaces
    lut = trigger_lut(enders, trained.get_vocab_size(), whitespace_ids=spaces)
    nl, sp, dot = _id(trained, "Ċ"), _id(trained, "Ġ"), _id(trained, ".")
    assert lut[nl].item() == LUT_ENDER | LUT_SPACE and lut[sp].item() == LUT_SPACE
    assert lut[dot].item() == LUT_ENDER
