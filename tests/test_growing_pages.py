"""The base of per-request state that grows with the request (``vllm_ext.method_kv_spec``:
``GrowingPagesSpec`` / ``GrowingPagesManager``): a request holds ``pages_for(num_tokens)`` pages in
all, taken as it grows (never twice, never before it wants them), counted once per request, and every
page goes back to vLLM's pool on free; "Maximum concurrency" counts a ``max_model_len`` request."""

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")

PAGE = 16


def _toy_types():
    from vllm_ext.method_kv_spec import GrowingPagesManager, GrowingPagesSpec

    @dataclass(frozen=True, kw_only=True)
    class OnePagePerFortyTokens(GrowingPagesSpec):
        speedsfi_method = "toy"

        def pages_for(self, num_tokens: int) -> int:
            return -(-num_tokens // 40)

    class FromSixtyTokens(GrowingPagesManager):
        firsts: list

        def wants_pages(self, request_id, num_tokens):
            return num_tokens >= 60

        def on_first_pages(self, request_id):
            self.firsts.append(request_id)

    return OnePagePerFortyTokens, FromSixtyTokens


def _manager(num_blocks=32):
    import torch
    from vllm.v1.core.block_pool import BlockPool

    spec_t, mgr_t = _toy_types()
    spec = spec_t(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32, max_len=1000)
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=PAGE)
    mgr = mgr_t(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=1,
                scheduler_block_size=PAGE)
    mgr.firsts = []
    return spec, pool, mgr


def _grow(mgr, rid, num_tokens):
    n = mgr.get_num_blocks_to_allocate(rid, num_tokens, [], 0, 0, num_tokens)
    got = mgr.allocate_new_blocks(rid, num_tokens, num_tokens)
    assert len(got) == n
    return n


def test_pages_follow_the_length_from_when_the_request_wants_them():
    spec, pool, mgr = _manager()
    free0 = pool.get_num_free_blocks()
    assert _grow(mgr, "a", 50) == 0                       # below its threshold: nothing
    assert _grow(mgr, "a", 60) == 2                       # all it needs at once: ceil(60 / 40)
    assert _grow(mgr, "a", 80) == 0                       # still 2 pages
    assert _grow(mgr, "a", 81) == 1
    assert _grow(mgr, "a", 81) == 0                       # asked again: nothing twice
    assert len(mgr.req_to_blocks["a"]) == 3 and mgr.firsts == ["a"]
    assert pool.get_num_free_blocks() == free0 - 3
    mgr.free("a")
    assert pool.get_num_free_blocks() == free0            # every page back on free


def test_max_concurrency_counts_a_max_model_len_request():
    spec, _, _ = _manager()
    assert spec.blocks_per_request == 25                  # ceil(1000 / 40)
    assert spec.max_memory_usage_bytes(None) == 25 * spec.page_size_bytes
    assert spec.max_num_blocks_per_req(None, 2000) == 50  # a longer model length counts
    assert not spec.prefix_cacheable
