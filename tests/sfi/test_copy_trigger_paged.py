"""``sfi.copy_ngram`` with the token history in KV-cache pages (``vllm_ext.methods.sfi.history_slots``), through
the engine's request table (no vLLM): the history group binds like vLLM's (``runner_hooks.
method_kv_groups``: blocks per request, layer names, spec, page memory), each step brings the
request's block-table row and block count (``StepState.group_tables``). The paged run decides every
step as the contiguous one; a request lacking the pages of its step neither records nor matches
(copy flag 0: the plain schedule's step, counted once per row and step), and after the gap it
matches only tokens recorded since; a fresh request at the same compact slot never matches the
previous request's tokens left in reused pages."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ext import metrics
from vllm_ext.backend.request_table import EngineRequestTable
from vllm_ext.config import SpeedSfiConfig
from vllm_ext.methods.sfi.history_slots import HISTORY_SUFFIX

from tests.sfi.test_copy_trigger import ANSWER, K, M, N_RECENT, N_SINK, PROMPT, VALUE, reference_copy

GID, E, NUM_BLOCKS, WIDTH = 3, 16, 40, 8            # pages of 16 int32 positions: 128 max_model_len
LAYERS = [f"model.layers.{i}.self_attn.attn{HISTORY_SUFFIX}" for i in range(2)]


def _table(paged: bool, **more) -> EngineRequestTable:
    cfg = SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "k": K, "k_min": 4, "n_sink": N_SINK,
                                            "n_recent": N_RECENT, "refresh": 1000, "schedule": "periodic",
                                            "copy_ngram": M, "copy_once": False, **more}})
    t = EngineRequestTable(max_reqs=2, device="cpu", config=cfg, sfi_capacity=2, max_model_len=WIDTH * E,
                           paged_history=paged)
    if paged:
        # the first layer's page memory holds the history: [blocks, H 1, block_size 4, C 4] fp32, full of
        # other bytes; the second layer's is never touched
        g = torch.Generator().manual_seed(0)
        pages = {name: torch.randn(NUM_BLOCKS, 4, 1, 4, generator=g).transpose(1, 2) for name in LAYERS}
        t.bind_kv_groups({"sfi": {GID: (WIDTH, LAYERS, SimpleNamespace(page_elems=E), pages)}})
        t.pages = pages
    return t


class Pool:
    """vLLM's side: each request's blocks of the history group, grown as it grows."""

    def __init__(self):
        self.free = list(np.random.default_rng(1).permutation(np.arange(1, NUM_BLOCKS)))
        self.blocks: dict[str, list[int]] = {}

    def grow(self, rid: str, num_tokens: int) -> None:
        held = self.blocks.setdefault(rid, [])
        while len(held) * E < num_tokens:
            held.append(int(self.free.pop()))

    def release(self, rid: str) -> None:
        self.free.extend(self.blocks.pop(rid))

    def group_tables(self, rids: list[str], lacking: bool = False):
        rows = torch.zeros(len(rids), WIDTH, dtype=torch.int32)
        counts = np.zeros(len(rids), dtype=np.int32)
        for r, rid in enumerate(rids):
            held = self.blocks[rid]
            rows[r, :len(held)] = torch.tensor(held, dtype=torch.int32)
            counts[r] = len(held) - (1 if lacking else 0)
        return {GID: (rows, counts >= WIDTH, counts)}


def _step(t, pool, rid, tokens, chunk, done, *, lacking=False, host_ids=False):
    """One step of request ``rid`` computing ``chunk`` after ``done`` tokens (``host_ids``: with the
    runner's host token ids, as inside vLLM)."""
    n = done + len(chunk)
    ids = None
    if host_ids:
        ids = np.full((1, WIDTH * E), -7, dtype=np.int32)      # beyond the request's tokens: junk
        ids[0, :n] = tokens[:done] + chunk
    if pool is not None:
        pool.grow(rid, n)
    qsl = np.array([0, len(chunk)], dtype=np.int32)
    t.stage([rid], 1, 1, real=True, input_ids=torch.tensor(chunk + [0, 0], dtype=torch.int32),
            query_start_loc=torch.from_numpy(qsl), row_is_decode=np.array([done >= len(PROMPT)]),
            host_geometry=(qsl, np.array([done], dtype=np.int32)),
            group_tables=None if pool is None else pool.group_tables([rid], lacking), token_ids=ids)
    return t.build_step(torch.tensor([n], dtype=torch.int32))


def _run(t, pool, answer, rid="a", lacking_steps=(), start=0, host_ids=False):
    """The prompt in two chunks (from position ``start``: a prefix-cache hit before it), then one
    decode step per answer token."""
    t.sync_membership([], {rid: (len(PROMPT), None)})
    tokens = PROMPT[:start]
    for chunk in (PROMPT[start:33], PROMPT[33:]) if start < 33 else (PROMPT[start:],):
        _step(t, pool, rid, tokens, chunk, len(tokens), host_ids=host_ids)
        tokens += chunk
    modes, copies = [], []
    for i, tok in enumerate(answer):
        step = _step(t, pool, rid, tokens, [tok], len(tokens), lacking=i in lacking_steps, host_ids=host_ids)
        tokens.append(tok)
        modes.append("slow" if bool(step.sfi.row_slow[0]) else "fast")
        copies.append(int(t.sfi.row_copy[0]))
    return tokens, modes, copies


def test_paged_steps_equal_contiguous_steps():
    contiguous = _table(False)
    _, want_modes, want_copies = _run(contiguous, None, ANSWER)
    paged, pool = _table(True), Pool()
    other = {n: p.clone() for n, p in paged.pages.items()}
    tokens, modes, copies = _run(paged, pool, ANSWER)
    assert modes == want_modes and copies == want_copies
    assert copies == [int(reference_copy(tokens[:len(PROMPT) + i + 1])) for i in range(len(ANSWER))]
    assert sum(copies) == 4 and paged.sfi.counter_values()["sfi.copy_slow_steps"] == 4
    hist = paged.sfi.history
    slot = paged.sfi.slot_host[paged.slot_of["a"]]
    assert hist.read(slot)[:len(tokens)].tolist() == tokens
    assert len(pool.blocks["a"]) == -(-len(tokens) // E) == 5
    # the history is in the first layer's pages of the request's blocks only
    first, second = LAYERS
    assert torch.equal(paged.pages[second], other[second])
    untouched = [b for b in range(NUM_BLOCKS) if b not in pool.blocks["a"]]
    assert torch.equal(paged.pages[first][untouched], other[first][untouched])


def test_a_row_without_its_pages_gets_no_copy_flag_and_is_counted():
    metrics.reset()
    paged, pool = _table(True), Pool()
    # the value's 3rd token is step 6 (the first copying step): it lacks its pages
    _, modes, copies = _run(paged, pool, ANSWER, lacking_steps={6})
    assert copies[6] == 0 and modes[6] == "fast"
    # after the gap the history starts again: the value (positions 20-25) is before it, never matched
    assert copies == [0] * len(ANSWER)
    assert metrics.snapshot().get("fallback.sfi_no_history_pages") == 1


def test_a_fresh_request_never_matches_what_reused_pages_hold():
    """Request b takes a's compact slot and a's blocks in the same order after a finished, and starts
    with a prefix-cache hit of 32 tokens (never in the step's input ids): the pages at positions
    0-31 still hold a's tokens, the value at 20-25 included, but b matches only what it recorded
    itself, as the contiguous history (reset to -1) did."""
    paged, pool = _table(True), Pool()
    _, _, copies_a = _run(paged, pool, ANSWER)
    assert sum(copies_a) == 4
    slot_a = paged.sfi.slot_host[paged.slot_of["a"]]
    paged.sync_membership(["a"], {})
    blocks_a = pool.blocks.pop("a")
    pool.free.extend(reversed(blocks_a))
    _, _, copies_b = _run(paged, pool, ANSWER, rid="b", start=32)
    assert paged.sfi.slot_host[paged.slot_of["b"]] == slot_a and pool.blocks["b"] == blocks_a
    assert paged.sfi.history.read(slot_a)[20:26].tolist() == VALUE          # a's bytes, still there
    assert copies_b == [0] * len(ANSWER)
    contiguous = _table(False)
    assert _run(contiguous, None, ANSWER, start=32)[2] == copies_b


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("start", [20, 32, 40])
def test_a_prefix_cache_hit_is_backfilled_so_the_answer_does_not_depend_on_the_cache(paged, start):
    """Inside vLLM the step carries the runner's host token ids: a request whose first chunk starts
    at ``start`` (a prefix-cache hit, which depends on other traffic) writes positions 0..start-1
    from them, so it decides every step as the same request without a hit, and holds its whole
    history. Hits ending before, inside (20-25) and after the value; paged (over another request's
    reused pages) and contiguous."""
    metrics.reset()
    want = _run(_table(paged), Pool() if paged else None, ANSWER, host_ids=True)
    assert sum(want[2]) == 4
    t, pool = _table(paged), Pool() if paged else None
    if paged:                                          # the pages first held another request's tokens
        _run(t, pool, [9] * len(ANSWER), rid="x", host_ids=True)
        t.sync_membership(["x"], {})
        pool.free.extend(reversed(pool.blocks.pop("x")))
    metrics.reset()
    tokens, modes, copies = _run(t, pool, ANSWER, rid="b", start=start, host_ids=True)
    assert (modes, copies) == want[1:]
    slot = t.sfi.slot_host[t.slot_of["b"]]
    assert t.sfi.history.read(slot)[:len(tokens)].tolist() == tokens
    assert metrics.snapshot().get("sfi.history_backfilled_tokens") == start
    assert not any(k.startswith("fallback.") for k in metrics.snapshot())


def test_unbound_or_missing_history_group_is_refused_loudly():
    t = EngineRequestTable(max_reqs=2, device="cpu", sfi_capacity=2, max_model_len=128, paged_history=True,
                           config=SpeedSfiConfig.from_dict({"sfi": {"enabled": True, "copy_ngram": 3}}))
    assert t.sfi.history is None                     # no page memory before vLLM's KV cache exists
    with pytest.raises(RuntimeError, match="token history"):
        t.bind_kv_groups({"sfi": {}})
    with pytest.raises(RuntimeError, match="page memory"):
        t.bind_kv_groups({"sfi": {GID: (WIDTH, LAYERS, SimpleNamespace(page_elems=E), {})}})
