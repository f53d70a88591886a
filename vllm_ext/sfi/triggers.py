"""SFI trigger tokens: the vocabulary ids after which the next decode step is slow (ALGORITHMS.md §1).

The set is built once from the tokenizer at start-up (never hard-coded ids); at run time only ids are
compared, through a boolean look-up table on the device (:func:`trigger_lut`).

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


def trigger_token_ids(tokenizer: Any, trigger_chars: Iterable[str]) -> list[int]:
    """Every vocabulary id (added tokens included, special tokens excluded) whose decoded text ends in
    one of ``trigger_chars`` under the rule of the module docstring. Sorted ascending."""
    chars = tuple(trigger_chars)
    if not chars:
        return []
    n = _vocab_size(tokenizer)
    special = _special_ids(tokenizer)
    ids = [i for i in range(n) if i not in special]
    found = []
    for i, text in zip(ids, _decode_each(tokenizer, ids)):
        if text and ends_in_trigger(text, chars):
            found.append(i)
    return found


def trigger_lut(ids: Iterable[int], vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean look-up table ``[vocab_size]``: ``lut[id]`` is True for trigger ids.

    ``vocab_size`` is the model's (possibly padded) vocabulary; ids outside ``[0, vocab_size)`` are
    ignored (ids the model cannot emit never trigger).
    """
    lut = torch.zeros(int(vocab_size), dtype=torch.bool)
    idx = torch.tensor([i for i in ids if 0 <= int(i) < vocab_size], dtype=torch.long)
    if idx.numel():
        lut[idx] = True
    return lut.to(device) if device is not None else lut
