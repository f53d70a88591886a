"""The teacher-forcing logits processor (vllm_ext/quality/forced_tokens.py) on hand-made logits and
batch updates, as vLLM's persistent batch drives it: it records the greedy choice of each opted-in
row at the step its output length says, then leaves only the reference token; other rows untouched;
record-only rows unforced; rows that move keep their request."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from vllm_ext.quality import forced_tokens as F  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_records():
    F.RECORDS.clear()
    yield
    F.RECORDS.clear()


def _logits(best_per_row, vocab=8):
    x = torch.zeros(len(best_per_row), vocab)
    for i, (tok, second) in enumerate(best_per_row):
        x[i, tok] = 3.0
        x[i, second] = 2.0
    return x


def test_records_then_forces():
    proc = F.ForcedTokensProcessor(None, torch.device("cpu"), False)
    out_a, out_b, out_c = [], [], []
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args=F.force_args("a", [4, 5, 6])), [1], out_a),
        (1, SamplingParams(), [1], out_b),                                   # not opted in
        (2, SamplingParams(extra_args=F.force_args("c", None)), [1], out_c),  # record only
    ]))
    logits = _logits([(4, 1), (2, 3), (7, 0)])
    before = logits.clone()
    res = proc.apply(logits)
    # row 0: the engine's choice 4 is the reference's: agreement, margin 0, gap 1
    assert F.RECORDS["a"][0] == F.ForcedStep(0, 4, 4, 0.0, 1.0)
    assert int(res[0].argmax()) == 4 and torch.isinf(res[0]).sum() == 7
    assert torch.equal(res[1], before[1]) and torch.equal(res[2], before[2])
    assert F.RECORDS["c"][0] == F.ForcedStep(0, 7, 7, 0.0, 1.0)
    # the next step: the row wrote 4; the engine now prefers 1, the reference says 5
    out_a.append(4)
    out_c.append(7)
    proc.update_state(None)
    res = proc.apply(_logits([(1, 5), (2, 3), (0, 7)]))
    assert F.RECORDS["a"][1] == F.ForcedStep(1, 5, 1, 1.0, 1.0)
    assert int(res[0].argmax()) == 5                       # forced against the engine's choice
    assert F.RECORDS["c"][1].argmax == 0 and int(res[2].argmax()) == 0


def test_moves_and_removals_keep_rows_with_their_requests():
    proc = F.ForcedTokensProcessor(None, torch.device("cpu"), False)
    out_a, out_b = [4], []
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args=F.force_args("a", [4, 5])), [1], out_a),
        (1, SamplingParams(extra_args=F.force_args("b", [6, 2])), [1], out_b)]))
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[],
                                  moved=[(0, 1, MoveDirectionality.SWAP)]))
    res = proc.apply(_logits([(3, 6), (5, 2)]))
    # "b" now sits in row 0 at its step 0, "a" in row 1 at its step 1
    assert F.RECORDS["b"][0] == F.ForcedStep(0, 6, 3, 1.0, 1.0) and int(res[0].argmax()) == 6
    assert F.RECORDS["a"][1] == F.ForcedStep(1, 5, 5, 0.0, 1.0) and int(res[1].argmax()) == 5
    # past the reference's end a row is left alone; a removed row is forgotten
    out_a.append(5)
    proc.update_state(BatchUpdate(batch_size=1, removed=[0], added=[], moved=[]))
    logits = _logits([(3, 6), (1, 2)])
    assert torch.equal(proc.apply(logits.clone()), logits)
    assert set(F.RECORDS["b"]) == {0} and set(F.RECORDS["a"]) == {1}


def test_validate_params_rejects_a_malformed_request():
    with pytest.raises(ValueError):
        F.ForcedTokensProcessor.validate_params(SamplingParams(extra_args={F.FORCE_KEY: {"tokens": [1]}}))
    F.ForcedTokensProcessor.validate_params(SamplingParams(extra_args=F.force_args("x", [1, 2])))
    assert not F.ForcedTokensProcessor(None, torch.device("cpu"), False).is_argmax_invariant()
