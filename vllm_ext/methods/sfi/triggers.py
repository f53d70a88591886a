"""SFI trigger tokens: the vocabulary ids after which the next decode step is slow (ALGORITHMS.md §1).

The set is built once from the tokenizer at start-up (never hard-coded ids); at run time only ids are
compared, through an int8 look-up table of bits on the device (:func:`trigger_lut`): bit 0 marks the
triggers (sentence enders), bit 1 the whitespace-only tokens (which never start a sentence under
``fire_at = "sentence_start"``, :mod:`vllm_ext.methods.sfi.schedule`).

Rule ("ends in"), decided here and applied to every tokenizer the same way:

1. Each id is decoded *on its own* (``skip_special_tokens=False``, no clean-up of tokenization
   spaces). Special tokens (``all_special_ids`` and added tokens marked special) are never triggers.
2. Byte-level BPE can split a multi-byte character over several tokens, so one token may decode to a
   partial UTF-8 sequence, which every HF decoder renders as U+FFFD. A *trailing* run of U+FFFD is an
   incomplete character that continues in the next token (the start of the next character), so it is
   dropped before looking at the last character: ``b".\\xe3"`` counts as ending in ``.``. A token
   that holds only the tail bytes of a character (``b"\\x80\\x82"``, the end of ``。`` but also of
   U+2002 and others) is ambiguous without its left context and is never a trigger; a tokenizer that
   only ever spells ``。`` that way still gets slow steps from the refresh budget.
3. Trailing whitespace that is not itself a trigger character (spaces, tabs, ``\\r``, ...) is
   stripped: ``". "`` and ``"▁."`` count as ``.``; ``".\\n\\n"`` counts as ``\\n`` (a trigger by
   default); ``"\\n  "`` counts as ``\\n``. A token that is only such whitespace is not a trigger.
4. The token is a trigger when the remaining text's last character is one of ``trigger_chars``.

A token is *whitespace-only* when its decoded text (rule 1, special tokens excluded) is not empty and
every character is whitespace (``str.isspace``: ``"\n"``, ``"\n\n"``, ``" "``, ``"\t"``, ...); a
partial character (U+FFFD) is not whitespace. ``"\n"`` is both a trigger (by default) and
whitespace-only.

Works with ``transformers`` tokenizers (slow and fast), a bare ``tokenizers.Tokenizer``, and any
object that has ``decode`` (vLLM's tokenizer wrappers). Imports neither vLLM nor transformers.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

REPLACEMENT_CHAR = "\ufffd"


def _vocab_size(tokenizer: Any) -> int:
    get = getattr(tokenizer, "get_vocab_size", None)          # tokenizers.Tokenizer
    if callable(get):
        return int(get(with_added_tokens=True))
    try:
        return int(len(tokenizer))                            # HF: base vocab + added tokens
    except TypeError:
        return int(tokenizer.vocab_size)


def _special_ids(tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for i in getattr(tokenizer, "all_special_ids", None) or ():
        if i is not None:
            ids.add(int(i))
    decoder = None
    for name in ("added_tokens_decoder", "get_added_tokens_decoder"):
        attr = getattr(tokenizer, name, None)
        if attr is None:
            continue
        try:
            decoder = attr() if callable(attr) else attr
        except Exception:                                     # pragma: no cover - exotic wrappers
            decoder = None
        if decoder:
            break
    for i, tok in (decoder or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _decode_each(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Decode every id on its own, batched where the tokenizer offers it."""
    batch = [[i] for i in ids]
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "decode_batch"):
        return list(tokenizer.decode_batch(batch, skip_special_tokens=False))   # tokenizers.Tokenizer
    batch_decode = getattr(tokenizer, "batch_decode", None)
    if callable(batch_decode):
        try:
            return list(batch_decode(batch, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False))
        except TypeError:
            pass
    out = []
    for one in batch:
        try:
            out.append(tokenizer.decode(one, skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False))
        except TypeError:
            out.append(tokenizer.decode(one))
    return out


def ends_in_trigger(text: str, trigger_chars: Iterable[str]) -> bool:
    """The rule of this module on one decoded token text (see the module docstring)."""
    chars = set(trigger_chars)
    text = text.rstrip(REPLACEMENT_CHAR)
    end = len(text)
    while end > 0 and text[end - 1].isspace() and text[end - 1] not in chars:
        end -= 1
    return end > 0 and text[end - 1] in chars


def is_whitespace_only(text: str) -> bool:
    """The whitespace-only rule of the module docstring on one decoded token text."""
    return bool(text) and text.isspace()


def boundary_token_ids(tokenizer: Any, trigger_chars: Iterable[str]) -> tuple[list[int], list[int]]:
    """``(trigger ids, whitespace-only ids)`` over the vocabulary (added tokens included, special
    tokens excluded), from one decoding pass, under the rules of the module docstring. Sorted
    ascending."""
    chars = tuple(trigger_chars)
    n = _vocab_size(tokenizer)
    special = _special_ids(tokenizer)
    ids = [i for i in range(n) if i not in special]
    enders, spaces = [], []
    for i, text in zip(ids, _decode_each(tokenizer, ids)):
        if not text:
            continue
        if chars and ends_in_trigger(text, chars):
            enders.append(i)
        if is_whitespace_only(text):
            spaces.append(i)
    return enders, spaces


def trigger_token_ids(tokenizer: Any, trigger_chars: Iterable[str]) -> list[int]:
    """Every vocabulary id (added tokens included, special tokens excluded) whose decoded text ends in
    one of ``trigger_chars`` under the rule of the module docstring. Sorted ascending."""
    chars = tuple(trigger_chars)
    if not chars:
        return []
    return boundary_token_ids(tokenizer, chars)[0]


LUT_ENDER = 1       # bit 0: a trigger (sentence ender)
LUT_SPACE = 2       # bit 1: a whitespace-only token


def trigger_lut(ids: Iterable[int], vocab_size: int, device: torch.device | str | None = None, *,
                whitespace_ids: Iterable[int] = ()) -> torch.Tensor:
    """Look-up table ``[vocab_size]`` int8 of bits: ``LUT_ENDER`` (bit 0) for the trigger ``ids``,
    ``LUT_SPACE`` (bit 1) for ``whitespace_ids``. ``lut != 0`` does not mean "is a trigger": test bit 0
    (:func:`vllm_ext.methods.sfi.schedule.is_trigger`).

    ``vocab_size`` is the model's (possibly padded) vocabulary; ids outside ``[0, vocab_size)`` are
    ignored (ids the model cannot emit never trigger).
    """
    lut = torch.zeros(int(vocab_size), dtype=torch.int8)
    for bit, group in ((LUT_ENDER, ids), (LUT_SPACE, whitespace_ids)):
        idx = torch.tensor([int(i) for i in group if 0 <= int(i) < vocab_size], dtype=torch.long)
        if idx.numel():
            lut[idx] |= bit
    return lut.to(device) if device is not None else lut
