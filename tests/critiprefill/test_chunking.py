"""Chunk ends and prefix hits never cut a segment of the sparse range, and a prompt with one is never
prefilled in a one-token chunk (vllm_ext.methods.critiprefill.chunking), against a brute-force statement of
the rules over many prompts, budgets and block sizes."""

import random

import pytest

from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
from vllm_ext.methods.critiprefill.chunking import (aligned_chunk, is_critiprefill_chunk, is_critiprefill_prompt,
                                            prefix_hit_limit, sparse_range)

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
            budget = rng.randint(CFG.segment_size + 1, 300)     # start-up guarantees > one segment
            left = rng.randint(0, budget)                         # what the step has left for it
            want = min(plen - computed, left)
            got = aligned_chunk(CFG, plen, computed, want)
            assert 0 <= got <= want
            cp = is_critiprefill_prompt(CFG, plen)
            if got != want:              # shortened only to avoid a cut or a one-token chunk
                assert cp and (_cuts_a_sparse_segment(CFG, plen, computed + want)
                               or want == 1 or computed + want == plen - 1)
            if got:
                assert not _cuts_a_sparse_segment(CFG, plen, computed + got)
                if cp:
                    assert got >= 2 and computed + got != plen - 1
                computed += got
            # a step with the whole budget free always moves the prefill
            full = aligned_chunk(CFG, plen, computed, min(plen - computed, budget)) if computed < plen else 1
            assert full > 0
            steps += 1
            assert steps < 10_000


def test_short_prompts_and_dense_parts_are_never_cut():
    assert aligned_chunk(CFG, 99, 0, 50) == 50                   # no segment past min_len: dense prompt
    lo, hi = sparse_range(CFG, 1000)
    assert (lo, hi) == (128, 960)             # segment 1 starts before min_len (100): dense
    assert aligned_chunk(CFG, 1000, 0, 40) == 40                  # ends in the dense head
    assert aligned_chunk(CFG, 1000, 0, 100) == 100                # ends in segment 1, dense
    assert aligned_chunk(CFG, 1000, 0, 150) == 128                # would cut segment 2
    assert aligned_chunk(CFG, 1000, 128, 50) == 0                 # cannot reach 192 this step
    assert aligned_chunk(CFG, 1000, 832, 100) == 64               # would cut segment 14
    assert aligned_chunk(CFG, 1000, 896, 80) == 80                # ends inside the final segment
    assert aligned_chunk(CFG, 1000, 960, 30) == 30                # inside the final (dense) segment
    assert aligned_chunk(CFG, 1000, 900, 100) == 100              # the prefill ends


def test_critiprefill_chunks():
    assert is_critiprefill_chunk(CFG, 1000, 0, 64)                 # its dense head too
    assert is_critiprefill_chunk(CFG, 1000, 960, 40)               # and its final segment
    assert not is_critiprefill_chunk(CFG, 1000, 100, 1)            # one-token rows are decode-like
    assert not is_critiprefill_chunk(CFG, 1000, 1000, 5)           # generated tokens (a resume)
    assert not is_critiprefill_chunk(CFG, 99, 0, 99)               # no segment past min_len
    assert not is_critiprefill_chunk(CFG, 192, 0, 192)             # segment 2 is the final one
    assert not is_critiprefill_chunk(CFG, 128, 0, 128)             # no sparse segment
    assert aligned_chunk(CFG, 1000, 0, 999) == 998                 # never leaves one token
    assert aligned_chunk(CFG, 1000, 0, 1) == 0


@pytest.mark.parametrize("block_size", [16, 32, 48, 128])
def test_prefix_hit_limit_is_the_longest_hit_that_cuts_no_segment(block_size):
    for plen in (99, 300, 1000, 1500):
        for num_hit in range(0, plen, block_size):
            limit = prefix_hit_limit(CFG, plen, num_hit, block_size)
            ok = [h for h in range(0, num_hit + 1, block_size)
                  if not _cuts_a_sparse_segment(CFG, plen, h)
                  and not (is_critiprefill_prompt(CFG, plen) and h > plen - 2)]
            assert limit == max(ok), (plen, num_hit, limit)
