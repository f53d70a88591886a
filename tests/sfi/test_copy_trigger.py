"""``sfi.copy_ngram`` through the engine's request table (no vLLM): the prefill and decode steps
record each request's tokens, and a decode step is slow exactly while its last tokens copy a span of
the context whose next token lies outside the sink and the recent window; off, the same steps are
fast. Configuration errors are clear."""

import numpy as np
import pytest
import torch

from vllm_ext.backend.request_table import EngineRequestTable
from vllm_ext.config import ConfigError, SpeedSfiConfig

N_SINK, N_RECENT, K, M = 2, 4, 8, 3
PROMPT = [(7 * i + 3) % 50 + 100 for i in range(60)]      # no token repeats within 50 positions...
VALUE = [901, 902, 903, 904, 905, 906]
PROMPT[20:26] = VALUE                                     # ...and a 6-token value at position 20


def reference_copy(tokens, m=M):
    t = len(tokens)
    tail = tokens[t - m:]
    return any(tokens[j - m + 1:j + 1] == tail for j in range(max(N_SINK - 1, m - 1), t - N_RECENT - 1))


def _run(copy_ngram: int | None, answer: list[int], **more):
    """``copy_ngram`` None: left unset (the default); ``copy_once`` False unless ``more`` says (every
    copying step slow: what most tests here look at)."""
    sfi = {"enabled": True, "k": K, "k_min": 4, "n_sink": N_SINK, "n_recent": N_RECENT, "refresh": 1000,
           "schedule": "periodic", "copy_once": False, **more}
    if copy_ngram is not None:
        sfi["copy_ngram"] = copy_ngram
    cfg = SpeedSfiConfig.from_dict({"sfi": sfi})
    t = EngineRequestTable(max_reqs=2, device="cpu", config=cfg, sfi_capacity=2, max_model_len=128)
    t.sync_membership([], {"a": (len(PROMPT), None)})
    # the prefill in two chunks
    tokens = []
    for chunk in (PROMPT[:33], PROMPT[33:]):
        qsl = np.array([0, len(chunk)], dtype=np.int32)
        computed = np.array([len(tokens)], dtype=np.int32)
        tokens += chunk
        ids = torch.tensor(chunk + [0, 0], dtype=torch.int32)
        t.begin_step(["a"], 1, 1, ids, torch.from_numpy(qsl), np.array([False]),
                     seq_lens=torch.tensor([len(tokens)], dtype=torch.int32), host_geometry=(qsl, computed))
    modes, expected = [], []
    for tok in answer:
        tokens.append(tok)
        qsl = np.array([0, 1], dtype=np.int32)
        step = t.begin_step(["a"], 1, 1, torch.tensor([tok, 0], dtype=torch.int32), torch.from_numpy(qsl),
                            np.array([True]), seq_lens=torch.tensor([len(tokens)], dtype=torch.int32),
                            host_geometry=(qsl, np.array([len(tokens) - 1], dtype=np.int32)))
        modes.append("slow" if bool(step.sfi.row_slow[0]) else "fast")
        expected.append(reference_copy(tokens))
    return t, modes, expected


ANSWER = [1, 2, 3, 4, 901, 902, 903, 904, 905, 906, 5, 6, 7, 8]


def test_slow_exactly_while_the_value_is_copied():
    t, modes, expected = _run(M, ANSWER)
    # steps 0-3: no selection yet, then fast; the value's 3rd token (903 after 901 902) on: copying
    assert expected == [False] * 6 + [True] * 4 + [False] * 4
    assert hist_of(t)[:len(PROMPT)].tolist() == PROMPT           # the prefill's tokens, chunk by chunk
    for i, (mode, copy) in enumerate(zip(modes, expected)):
        if copy:
            assert mode == "slow", f"step {i}"
    assert modes[4:6] == ["fast", "fast"] and modes[10:] == ["fast"] * 4
    assert t.sfi.counter_values()["sfi.copy_slow_steps"] == 4


def test_a_span_the_context_repeats_does_not_fire():
    """copy_max_matches 1 (the default): the value stated twice in the prompt is no longer a span
    only one place holds; with 2 it fires again."""
    global PROMPT
    saved = list(PROMPT)
    PROMPT[40:46] = VALUE
    try:
        _, modes, _ = _run(M, ANSWER)
        assert modes[6:10] == ["fast"] * 4
    finally:
        PROMPT[:] = saved


def test_copy_once_is_slow_at_the_first_copying_step_only():
    t, modes, expected = _run(M, ANSWER, copy_once=True)
    assert modes[6:10] == ["slow", "fast", "fast", "fast"]
    assert t.sfi.counter_values()["sfi.copy_slow_steps"] == 1


def test_the_default_is_the_bigram_once():
    """Unset, the copy trigger is on: copy_ngram 2, copy_max_matches 1, copy_once; the
    value's 2nd token (902 after 901) is the first copying step, and only it is slow."""
    t, modes, _ = _run(None, ANSWER, copy_once=True)
    cfg = t.sfi.cfg
    assert (cfg.copy_ngram, cfg.resolved_copy_ngram, cfg.copy_max_matches, cfg.copy_once) == (None, 2, 1, True)
    assert modes[5:10] == ["slow", "fast", "fast", "fast", "fast"]
    assert t.sfi.counter_values()["sfi.copy_slow_steps"] == 1
    plain = SpeedSfiConfig.from_dict({"sfi": {"enabled": True}}).sfi
    assert (plain.copy_ngram, plain.resolved_copy_ngram, plain.copy_once) == (2, 2, True)   # the sfi preset


def test_off_leaves_the_same_steps_fast():
    t, modes, _ = _run(0, ANSWER)
    assert modes[6:10] == ["fast"] * 4
    assert t.sfi.history is None


def hist_of(t):
    return t.sfi.history.read(t.sfi.slot_host[t.slot_of["a"]])


@pytest.mark.parametrize("sfi, words", [({"copy_ngram": 1}, "copy_ngram"), ({"copy_ngram": 9}, "copy_ngram"),
                                        ({"copy_ngram": 3, "schedule": "always_slow"}, "always_slow")])
def test_bad_copy_ngram_is_refused(sfi, words):
    with pytest.raises(ConfigError, match=words):
        SpeedSfiConfig.from_dict({"sfi": {"enabled": True, **sfi}})


def test_copy_ngram_needs_max_model_len():
    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "copy_ngram": 3}})
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineRequestTable(max_reqs=2, device="cpu", config=cfg, sfi_capacity=2)
