"""The schedule replay of ``vllm_ext.quality.copy_trace`` (pure Python): the warm-up's steps, the
sentence-end triggers and the copy trigger, as the device plan decides them."""

from vllm_ext.config import SpeedSfiConfig
from vllm_ext.quality.copy_trace import slow_steps


class _Tok:
    """Token id i decodes to "." for 9, else to "w<i>"."""

    def decode(self, ids, **kw):
        return "".join("." if i == 9 else f"w{i}" for i in ids)


def _cfg(**sfi):
    return SpeedSfiConfig.from_dict({"preset": "sfi", "sfi": {"n_recent": 4, "n_sink": 2, **sfi}}).sfi


def test_warmup_and_sentence_ends():
    answer = [1, 2, 3, 4, 5, 6, 7, 9, 8, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]
    # warm-up: the budget 1, 2, 4, 8, 16 doubles at every slow step; step 8 reads the "." (answer
    # token 7), after which the next due step is 8 + 16
    assert slow_steps(_cfg(copy_ngram=0), answer, list(range(100, 140)), 20, _Tok()) == [1, 3, 7, 8]


def test_copy_trigger_replay():
    prompt = list(range(100, 140))
    prompt[10:14] = [50, 51, 52, 53]
    answer = [60, 61, 62, 63, 64, 65, 66, 50, 51, 52, 53, 67]
    plain = slow_steps(_cfg(copy_ngram=0), answer, prompt, 12, _Tok())
    every = slow_steps(_cfg(copy_ngram=2, copy_once=False), answer, prompt, 12, _Tok())
    # step i reads answer[i - 1]: steps 9, 10, 11 end in 50 51 / 51 52 / 52 53, as at prompt
    # positions 10-13, whose followers (12, 13, 14) lie outside the sink and the recent window
    assert sorted(set(every) - set(plain)) == [9, 10, 11]
    # the preset (copy_ngram 2, copy_once): the first step of the run only
    assert sorted(set(slow_steps(_cfg(), answer, prompt, 12, _Tok())) - set(plain)) == [9]
