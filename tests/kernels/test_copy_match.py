"""``sfi.copy_ngram``'s device ops (``vllm_ext.kernels.copy_match``): the Triton kernels against
their PyTorch twins and both against a plain-Python reference, on histories with planted repeats,
prefill chunks and decode rows, rows without a slot and padding rows."""

import random

import pytest
import torch

from vllm_ext.kernels.copy_match import (copy_match, copy_match_torch, record_tokens,
                                         record_tokens_torch)
from vllm_ext.kernels.triton_utils import HAS_TRITON, use_triton

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
needs_triton = pytest.mark.skipif(not (HAS_TRITON and use_triton(DEVICE)),
                                  reason="needs CUDA or the Triton interpreter")


def reference_copy(tokens: list[int], t: int, n_sink: int, n_recent: int, m: int, max_matches: int = 0) -> bool:
    """The rule of the module docstring, spelled out: the last m of tokens[:t] occur earlier, ending
    at j, with the follower j + 1 in [n_sink, t - n_recent), at least once and at most max_matches
    times (0: any number)."""
    if t < m:
        return False
    tail = tokens[t - m:t]
    hits = sum(tokens[j - m + 1:j + 1] == tail for j in range(max(n_sink - 1, m - 1), t - n_recent - 1))
    return hits > 0 and (max_matches == 0 or hits <= max_matches)


def _history(rng: random.Random, slots: int, max_len: int, lens: list[int], vocab: int):
    """Random token streams per slot with planted copies: the stream's tail repeats a span."""
    hist = torch.full((slots + 1, max_len), -1, dtype=torch.int32)
    streams = []
    for s, n in enumerate(lens):
        toks = [rng.randrange(vocab) for _ in range(n)]
        if s % 2 == 0 and n > 12:              # the last 3 tokens copy an earlier span
            at = rng.randrange(1, n - 8)
            toks[n - 3:] = toks[at:at + 3]
        hist[s, :n] = torch.tensor(toks, dtype=torch.int32)
        streams.append(toks)
    return hist, streams


@pytest.mark.parametrize("max_matches", [0, 1, 2])
@pytest.mark.parametrize("m, n_sink, n_recent", [(2, 4, 8), (3, 4, 8), (4, 0, 0), (2, 1, 30)])
def test_copy_match_twin_equals_reference(m, n_sink, n_recent, max_matches):
    rng = random.Random(m * 100 + n_recent)
    lens = [40, 37, 64, 5, 2, 70, 33]
    hist, streams = _history(rng, len(lens), 80, lens, vocab=6)   # a small vocabulary: many repeats
    rows = len(lens) + 2
    slot = torch.tensor(list(range(len(lens))) + [-1, 3], dtype=torch.int32)   # a row without a slot
    seq = torch.tensor(lens + [40, 5], dtype=torch.int32)
    active = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 0], dtype=torch.int32)     # row 5 not a decode row
    out = torch.full((rows,), 7, dtype=torch.int32)
    copy_match_torch(hist, seq, slot, active, out, n_sink=n_sink, n_recent=n_recent, ngram=m,
                     max_matches=max_matches)
    want = [int(bool(active[r]) and int(slot[r]) >= 0 and
                reference_copy(streams[int(slot[r])], int(seq[r]), n_sink, n_recent, m, max_matches))
            for r in range(rows)]
    assert out.tolist() == want
    assert not all(want) and (any(want) or max_matches)


@needs_triton
@pytest.mark.parametrize("max_matches", [0, 1, 3])
@pytest.mark.parametrize("m, n_sink, n_recent", [(2, 4, 8), (3, 4, 8), (5, 0, 0), (8, 2, 16)])
@pytest.mark.parametrize("max_len", [80, 1500])        # one block / several blocks per row
def test_copy_match_kernel_equals_twin(m, n_sink, n_recent, max_len, max_matches):
    rng = random.Random(m + max_len)
    lens = [40, 37, 64, 5, 2, 70, 33] if max_len == 80 else [1500, 1200, 777, 1024, 513, 1499, 9]
    hist, _ = _history(rng, len(lens), max_len, lens, vocab=4 if max_len == 80 else 3)
    slot = torch.tensor(list(range(len(lens))) + [-1], dtype=torch.int32)
    seq = torch.tensor(lens + [33], dtype=torch.int32)
    active = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.int32)
    twin = copy_match_torch(hist, seq, slot, active, torch.zeros(8, dtype=torch.int32),
                            n_sink=n_sink, n_recent=n_recent, ngram=m, max_matches=max_matches)
    kern = copy_match(hist.to(DEVICE), seq.to(DEVICE), slot.to(DEVICE), active.to(DEVICE),
                      torch.full((8,), 7, dtype=torch.int32, device=DEVICE),
                      n_sink=n_sink, n_recent=n_recent, ngram=m, max_matches=max_matches)
    assert kern.cpu().tolist() == twin.tolist()


def _step(rng: random.Random, q_lens: list[int], computed: list[int], vocab: int = 1000):
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    n = int(qsl[-1])
    ids = torch.tensor([rng.randrange(vocab) for _ in range(n + 5)], dtype=torch.int32)   # padded
    seq = torch.tensor([c + q for c, q in zip(computed, q_lens)], dtype=torch.int32)
    return ids, qsl, seq


def test_record_tokens_twin_writes_each_token_at_its_position():
    rng = random.Random(0)
    q_lens, computed = [5, 1, 3, 1, 0], [0, 9, 20, 63, 4]        # prefill, decode, chunk, edge, padding
    ids, qsl, seq = _step(rng, q_lens, computed)
    slot = torch.tensor([2, 0, 1, 3, -1], dtype=torch.int32)
    hist = torch.full((5, 64), -1, dtype=torch.int32)
    record_tokens_torch(hist, ids, qsl, seq, slot, max_q_len=5)
    want = torch.full((5, 64), -1, dtype=torch.int32)
    for r, (q, c) in enumerate(zip(q_lens, computed)):
        if int(slot[r]) < 0:
            continue
        for j in range(q):
            if c + j < 64:
                want[int(slot[r]), c + j] = ids[int(qsl[r]) + j]
    assert torch.equal(hist[:4], want[:4])          # row 4 is the trash row


@needs_triton
@pytest.mark.parametrize("q_lens, computed, max_q_len", [
    ([5, 1, 3, 1, 0], [0, 9, 20, 63, 4], 5),
    ([1, 1, 1, 1, 1], [10, 0, 31, 62, 7], 1),                    # a decode-only step
    ([700, 1, 300, 0, 2], [0, 40, 900, 0, 1500], 700)])           # chunks over several blocks
def test_record_tokens_kernel_equals_twin(q_lens, computed, max_q_len):
    rng = random.Random(sum(q_lens))
    ids, qsl, seq = _step(rng, q_lens, computed)
    slot = torch.tensor([2, 0, 1, 3, -1], dtype=torch.int32)
    width = 64 if max_q_len < 100 else 1600
    twin = torch.full((5, width), -1, dtype=torch.int32)
    record_tokens_torch(twin, ids, qsl, seq, slot, max_q_len)
    kern = twin.new_full((5, width), -1).to(DEVICE)
    record_tokens(kern, ids.to(DEVICE), qsl.to(DEVICE), seq.to(DEVICE), slot.to(DEVICE), max_q_len)
    assert torch.equal(kern.cpu()[:4], twin[:4])


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_triton)])
def test_copy_once_fires_at_the_first_step_of_a_run(use_kernel):
    """``prev`` (sfi.copy_once): across steps a row fires when it starts copying, not while it goes
    on; an inactive row leaves its slot's state alone; the kernel and the twin agree step by step."""
    rng = random.Random(5)
    hist, _ = _history(rng, 3, 200, [150, 150, 150], vocab=1000)
    hist[0, 40:46] = torch.tensor([7, 8, 9, 10, 11, 12], dtype=torch.int32)    # a span row 0 copies
    slot = torch.tensor([0, 1, -1], dtype=torch.int32)
    prev_twin = torch.zeros(4, dtype=torch.int32)
    prev_kern = prev_twin.clone().to(DEVICE)
    fired = []
    stream = [1, 7, 8, 9, 10, 2, 7, 8, 3]        # two runs: 7 8 9 10 and 7 8
    for step, tok in enumerate(stream):
        t = 150 + step + 1
        hist[0, t - 1] = tok
        hist[1, t - 1] = 5000 + step
        seq = torch.tensor([t, t, t], dtype=torch.int32)
        active = torch.tensor([1, int(step != 3), 1], dtype=torch.int32)        # row 1 idle at step 3
        want = copy_match_torch(hist, seq, slot, active, torch.zeros(3, dtype=torch.int32), n_sink=4,
                                n_recent=8, ngram=2, max_matches=1, prev=prev_twin)
        if use_kernel:
            got = copy_match(hist.to(DEVICE), seq.to(DEVICE), slot.to(DEVICE), active.to(DEVICE),
                             torch.zeros(3, dtype=torch.int32, device=DEVICE), n_sink=4, n_recent=8,
                             ngram=2, max_matches=1, prev=prev_kern)
            assert got.cpu().tolist() == want.tolist(), f"step {step}"
            assert torch.equal(prev_kern.cpu()[:3], prev_twin[:3]), f"step {step}"
        fired.append(int(want[0]))
    # tails 7 8 / 8 9 / 9 10 copy (steps 2-4): fires at step 2 only; 7 8 again at step 7: fires
    assert fired == [0, 0, 1, 0, 0, 0, 0, 1, 0]
