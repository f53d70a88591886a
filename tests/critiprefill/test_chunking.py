"""Chunk ends and prefix hits never cut a segment of the sparse range (vllm_ext.critiprefill.chunking),
against a brute-force statement of the rule over many prompts, budgets and block sizes."""

import random

import pytest

from vllm_ext.config import CritiPrefillConfig
from vllm_ext.critiprefill.chunking import aligned_chunk, prefix_hit_limit, touches_sparse_range
from vllm_ext.critiprefill.slots import sparse_range

CFG = CritiPrefillConfig(enabled=True, segment_size=64, block_size=16, budget=32, min_len=100)


def _cuts_a_sparse_segment(cfg, prompt_len, pos):
    lo, hi = sparse_range(cfg, prompt_len)
    return any(s < pos < s + cfg.segment_size for s in range(lo, hi, cfg.segment_size))


@pytest.mark.parametrize("seed", range(6))
def test_chunks_end_on_segment_boundaries_and_the_prefill_always_moves(seed):
    rng = random.Random(seed)
    for _ in range(200):
        plen = rng.randint(1, 1500)
        computed, steps = 0, 0
        while computed < plen:
            budget = rng.randint(CFG.segment_size, 300)         # start-up guarantees >= one segment
            left = rng.randint(0, budget)                         # what the step has left for it
            want = min(plen - computed, left)
            got = aligned_chunk(CFG, plen, computed, want)
            assert 0 <= got <= want
            if got != want:                                       # shortened only to avoid a cut
                assert _cuts_a_sparse_segment(CFG, plen, computed + want)
            if got:
                assert not _cuts_a_sparse_segment(CFG, plen, computed + got)
                computed += got
            # a step with the whole budget free always moves the prefill
            full = aligned_chunk(CFG, plen, computed, min(plen - computed, budget)) if computed < plen else 1
            assert full > 0
            steps += 1
            assert steps < 10_000


def test_short_prompts_and_dense_parts_are_never_cut():
    assert aligned_chunk(CFG, 99, 0, 50) == 50                   # below min_len: dense prompt
    lo, hi = sparse_range(CFG, 1000)
    assert (lo, hi) == (64, 960)
    assert aligned_chunk(CFG, 1000, 0, 40) == 40                  # ends in the dense head
    assert aligned_chunk(CFG, 1000, 0, 100) == 64                 # would cut segment 1
    assert aligned_chunk(CFG, 1000, 64, 50) == 0                  # cannot reach 128 this step
    assert aligned_chunk(CFG, 1000, 832, 100) == 64               # would cut segment 14
    assert aligned_chunk(CFG, 1000, 896, 80) == 80                # ends inside the final segment
    assert aligned_chunk(CFG, 1000, 960, 30) == 30                # inside the final (dense) segment
    assert aligned_chunk(CFG, 1000, 900, 100) == 100              # the prefill ends


def test_touches_sparse_range():
    assert not touches_sparse_range(CFG, 1000, 0, 64)
    assert touches_sparse_range(CFG, 1000, 0, 66)
    assert not touches_sparse_range(CFG, 1000, 960, 40)
    assert not touches_sparse_range(CFG, 1000, 100, 1)            # one-token chunks attend densely
    assert not touches_sparse_range(CFG, 99, 0, 99)


@pytest.mark.parametrize("block_size", [16, 32, 48, 128])
def test_prefix_hit_limit_is_the_longest_hit_that_cuts_no_segment(block_size):
    for plen in (99, 300, 1000, 1500):
        for num_hit in range(0, plen, block_size):
            limit = prefix_hit_limit(CFG, plen, num_hit, block_size)
            ok = [h for h in range(0, num_hit + 1, block_size)
                  if not _cuts_a_sparse_segment(CFG, plen, h)]
            assert limit == max(ok), (plen, num_hit, limit)
