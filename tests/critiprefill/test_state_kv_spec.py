"""CritiPrefill's per-request state in vLLM's block manager (``vllm_ext.methods.critiprefill.kv_spec``): the
spec's page format and accounting, and the manager's rule: pages only for a CritiPrefill prompt,
grown with its chunks, given back once the prompt is computed, and on finish / abort / preemption."""

import inspect

import pytest

pytest.importorskip("vllm")

from vllm_ext.methods.critiprefill.state_layout import state_pages  # noqa: E402

PAGE, HKV, HQ = 16, 2, 8          # G = 4 carry entries per KV head


def _spec(max_len=4096):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
    from vllm_ext.methods.critiprefill.kv_spec import state_spec_for

    cfg = CritiPrefillConfig(enabled=True, segment_size=64, block_size=16, budget=64, min_len=256)
    full = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=32, dtype=torch.float32)
    return cfg, full, state_spec_for(full, cfg, num_heads=HQ, max_len=max_len, query_dtype=torch.float32)


def _manager(num_blocks=64):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_ext.methods.critiprefill.kv_spec import CritiPrefillStateManager

    _, _, spec = _spec()
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=PAGE)
    return spec, pool, CritiPrefillStateManager(spec, block_pool=pool, enable_caching=False,
                                                kv_cache_group_id=1, scheduler_block_size=PAGE)


def _step(mgr, rid, processed, num_tokens, plen):
    """What vLLM's ``KVCacheManager.allocate_slots`` asks of a group's manager for one chunk."""
    mgr.remove_skipped_blocks(rid, processed, num_prompt_tokens=plen)
    n = mgr.get_num_blocks_to_allocate(rid, num_tokens, [], processed, processed, num_tokens,
                                       prefill_end=plen)
    got = mgr.allocate_new_blocks(rid, num_tokens, num_tokens)
    assert len(got) == n
    return n


def test_page_count_formula():
    assert state_pages(0, 4, 16, 16) == 0
    assert state_pages(1, 4, 16, 16) == 1                  # 4 carry + 1 key block
    assert state_pages(16 * 12, 4, 16, 16) == 1            # 4 + 12 = 16 entries
    assert state_pages(16 * 12 + 1, 4, 16, 16) == 2
    assert state_pages(4096, 4, 16, 16) == 17              # ceil((4 + 256) / 16)


def test_spec_shares_the_layer_page_format_and_is_registered():
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    import vllm_ext
    from vllm_ext.methods.critiprefill.kv_spec import CritiPrefillStateManager

    vllm_ext.register()
    _, full, spec = _spec()
    assert KVCacheSpecRegistry.get_manager_class(spec) is CritiPrefillStateManager
    assert not isinstance(spec, FullAttentionSpec)
    assert spec.page_size_bytes == full.page_size_bytes
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    assert spec.speedsfi_method == "critiprefill"
    assert spec.carry_entries == HQ // HKV
    assert spec.blocks_per_request == state_pages(4096, 4, 16, PAGE) == 17
    assert spec.max_memory_usage_bytes(None) == 17 * spec.page_size_bytes
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "remove_skipped_blocks",
                 "pop_blocks_for_free", "cache_blocks", "add_local_computed_blocks",
                 "allocate_external_computed_blocks"):
        assert list(inspect.signature(getattr(CritiPrefillStateManager, name)).parameters) == \
            list(inspect.signature(getattr(SingleTypeKVCacheManager, name)).parameters), name


def test_only_critiprefill_prompts_get_pages():
    spec, pool, mgr = _manager()
    free = pool.get_num_free_blocks()
    # shorter than min_len: never a sparse range, never a page
    assert _step(mgr, "short", 0, 200, 200) == 0
    assert _step(mgr, "short", 200, 201, 200) == 0           # nor in its decode steps
    assert pool.get_num_free_blocks() == free and not mgr.req_to_blocks.get("short")


def test_pages_grow_with_the_chunks_and_are_freed_when_the_prompt_is_computed():
    spec, pool, mgr = _manager()
    free = pool.get_num_free_blocks()
    plen = 1000                                    # sparse range [128, 960)
    held = 0
    for processed, end in ((0, 128), (128, 512), (512, 896), (896, 1000)):
        held += _step(mgr, "r", processed, end, plen)
        assert held == spec.pages_for(end) == len(mgr.req_to_blocks["r"])
        assert pool.get_num_free_blocks() == free - held
    assert held == state_pages(plen, 4, 16, PAGE) == 5
    # decode steps past the prompt ask for nothing more; once the last chunk's forward has
    # finished (processed >= prompt) every page goes back to the pool
    assert _step(mgr, "r", 999, 1001, plen) == 0 and pool.get_num_free_blocks() == free - held
    assert _step(mgr, "r", 1000, 1001, plen) == 0
    assert pool.get_num_free_blocks() == free
    assert _step(mgr, "r", 1001, 1002, plen) == 0 and pool.get_num_free_blocks() == free
    mgr.free("r")                                 # finish: nothing left to give back
    assert pool.get_num_free_blocks() == free and "r" not in mgr.req_to_blocks


def test_abort_and_preemption_free_and_a_resume_grows_again():
    spec, pool, mgr = _manager()
    free = pool.get_num_free_blocks()
    assert _step(mgr, "a", 0, 512, 1000) == spec.pages_for(512)
    mgr.free("a")                                 # abort / preemption: vLLM frees every group
    assert pool.get_num_free_blocks() == free and "a" not in mgr.req_to_blocks
    # the resume recomputes from scratch (vLLM's prefill_end covers its output tokens too)
    assert _step(mgr, "a", 0, 256, 1000) == spec.pages_for(256)
    mgr.free("a")
    assert pool.get_num_free_blocks() == free


def test_admission_check_before_the_first_step_knows_the_prompt():
    """vLLM's full-sequence admission check asks before ``remove_skipped_blocks`` ran for the
    request: the manager takes the prompt from ``prefill_end``."""
    spec, _, mgr = _manager()
    assert mgr.get_num_blocks_to_allocate("n", 1000, [], 0, 0, 1000, apply_admission_cap=True,
                                          prefill_end=1000) == spec.pages_for(1000)
    assert mgr.get_num_blocks_to_allocate("s", 100, [], 0, 0, 100, prefill_end=100) == 0


def test_never_a_prefix_hit():
    from vllm_ext.methods.critiprefill.kv_spec import CritiPrefillStateManager

    spec, pool, _ = _manager()
    blocks, hit = CritiPrefillStateManager.find_longest_cache_hit([], 1000, [1], pool, spec, False, 16)
    assert blocks == ([],) and hit == 0


def test_the_carry_takes_the_bytes_of_the_querys_dtype():
    """A query head's carry (max and min, D values each, in the query's dtype) takes as many page
    entries as its bytes need: one where the pages hold the query's dtype, two of an fp8 page for a
    bf16 query, four for fp32; the pages' count follows."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ext.methods.critiprefill.config import CritiPrefillConfig
    from vllm_ext.methods.critiprefill.kv_spec import state_spec_for
    from vllm_ext.methods.critiprefill.state_layout import carry_entries

    cfg = CritiPrefillConfig(enabled=True, segment_size=64, block_size=16, budget=64, min_len=256)
    g = HQ // HKV
    for page_dtype, query_dtype, per_head in ((torch.bfloat16, torch.bfloat16, 1), (torch.float32, torch.float32, 1),
                                              (torch.uint8, torch.bfloat16, 2), (torch.uint8, torch.float32, 4),
                                              (torch.float32, torch.bfloat16, 1)):
        full = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=32, dtype=page_dtype)
        spec = state_spec_for(full, cfg, num_heads=HQ, max_len=4096, query_dtype=query_dtype)
        assert spec.carry_entries == carry_entries(HQ, HKV, query_dtype.itemsize, page_dtype.itemsize) == g * per_head
        assert spec.blocks_per_request == state_pages(4096, g * per_head, 16, PAGE)
