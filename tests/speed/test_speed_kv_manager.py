"""SPEED's upper-layer block manager inside vLLM's own KVCacheManager (real BlockPool, coordinator,
two groups): interior prompt blocks are never allocated, rows stay position-aligned, and finish /
abort / preemption return every block."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

BS = 16


def _manager(num_blocks: int = 200):
    import vllm_ext
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from vllm_ext.methods.speed.kv_spec import SpeedUpperSpec

    vllm_ext.register()
    shape = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**shape)),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SpeedUpperSpec(**shape))]
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                          enable_caching=False)


def _request(rid: str, prompt_len: int):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), None)


def _prefill(mgr, req, chunks):
    for n in chunks:
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n


def _decode(mgr, req, steps):
    for _ in range(steps):
        req.append_output_token_ids(7)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


@pytest.mark.parametrize("prompt_len,chunks", [(1000, [1000]), (1000, [300, 300, 400]),
                                                (17, [17]), (16, [16]), (1, [1]), (513, [512, 1])])
def test_upper_group_holds_only_anchor_and_tail(prompt_len, chunks):
    mgr = _manager()
    free0 = mgr.block_pool.get_num_free_blocks()
    req = _request("a", prompt_len)
    _prefill(mgr, req, chunks)
    _decode(mgr, req, 40)
    lower, upper = mgr.get_block_ids("a")
    total = prompt_len + 40
    n_rows = -(-total // BS)
    assert len(lower) == len(upper) == n_rows              # rows position-aligned in both groups
    tail = max(1, (prompt_len - 1) // BS)
    for i, b in enumerate(upper):
        if i == 0 or i >= tail:
            assert b != 0, f"row {i} needs a real block"
        else:
            assert b == 0, f"row {i} is interior prompt: the null block"
    assert all(b != 0 for b in lower)
    real_upper = sum(b != 0 for b in upper)
    assert real_upper == n_rows - max(0, tail - 1)
    # the pool lost exactly the blocks the two groups hold, no more
    assert free0 - mgr.block_pool.get_num_free_blocks() == len(lower) + real_upper
    assert len(set(lower) | {b for b in upper if b}) == len(lower) + real_upper   # no sharing
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == free0


def test_preempt_abort_and_reuse_return_every_block():
    mgr = _manager()
    free0 = mgr.block_pool.get_num_free_blocks()
    reqs = [_request(f"r{i}", n) for i, n in enumerate((700, 33, 1200))]
    for r in reqs:
        _prefill(mgr, r, [min(r.num_prompt_tokens, 512), max(0, r.num_prompt_tokens - 512)]
                 if r.num_prompt_tokens > 512 else [r.num_prompt_tokens])
        _decode(mgr, r, 5)
    held = free0 - mgr.block_pool.get_num_free_blocks()
    # the saving is what the block arithmetic predicts: interior rows of the upper group
    dense = sum(2 * -(-(r.num_prompt_tokens + 5) // BS) for r in reqs)
    saved = sum(max(0, max(1, (r.num_prompt_tokens - 1) // BS) - 1) for r in reqs)
    assert held == dense - saved
    # preemption (the scheduler frees and the request recomputes later), abort, finish
    mgr.free(reqs[0])
    reqs[0].num_computed_tokens = 0
    _prefill(mgr, reqs[0], [reqs[0].num_tokens])        # resumed: prompt + 5 outputs recomputed
    upper = mgr.get_block_ids("r0")[1]
    assert upper[1] == 0 and upper[0] != 0 and upper[-1] != 0
    for r in reqs:
        mgr.free(r)
    assert mgr.block_pool.get_num_free_blocks() == free0
