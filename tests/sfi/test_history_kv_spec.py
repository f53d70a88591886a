"""SFI's copy-trigger token history in vLLM's block manager (``vllm_ext.methods.sfi.history_kv_spec``): the
spec's page format and block counts, its group beside the attention and compact layers and its share
of vLLM's "Maximum concurrency", and the manager's rule: ``cdiv(t, E)`` pages from the first chunk,
grown with the request, freed on finish / abort / preemption, never a prefix hit or cached."""

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

BLOCK, HKV, HEAD = 16, 2, 32          # fp32: a page is 2 x 16 x 64 x 4 bytes = 8 KiB, E = 2048
E = HKV * BLOCK * 2 * HEAD


def _full(**kw):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HKV, head_size=HEAD,
                             dtype=kw.pop("dtype", torch.float32), **kw)


def _spec(max_len=4096, **kw):
    from vllm_ext.methods.sfi.history_kv_spec import history_spec_for

    return history_spec_for(_full(**kw), max_len=max_len)


def _manager(num_blocks=64, max_len=4096):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_ext.methods.sfi.history_kv_spec import SfiHistoryManager

    spec = _spec(max_len)
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=BLOCK)
    return spec, pool, SfiHistoryManager(spec, block_pool=pool, enable_caching=False,
                                         kv_cache_group_id=2, scheduler_block_size=BLOCK)


def _step(mgr, rid, num_tokens):
    """What vLLM's ``KVCacheManager.allocate_slots`` asks of a group's manager for one step."""
    mgr.remove_skipped_blocks(rid, 0, num_prompt_tokens=None)
    n = mgr.get_num_blocks_to_allocate(rid, num_tokens, [], 0, 0, num_tokens, prefill_end=num_tokens)
    got = mgr.allocate_new_blocks(rid, num_tokens, num_tokens)
    assert len(got) == n
    return n


def test_spec_shares_the_layer_page_format_and_is_registered():
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    import vllm_ext
    from vllm_ext.methods.sfi.history_kv_spec import SfiHistoryManager

    vllm_ext.register()
    spec = _spec()
    assert KVCacheSpecRegistry.get_manager_class(spec) is SfiHistoryManager
    assert not isinstance(spec, FullAttentionSpec)
    assert spec.page_size_bytes == _full().page_size_bytes
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    assert spec.speedsfi_method == "sfi"
    assert spec.page_elems == E == 2048
    assert [spec.pages_for(t) for t in (0, 1, E, E + 1, 3 * E)] == [0, 1, 1, 2, 3]
    assert spec.blocks_per_request == 2 and spec.max_memory_usage_bytes(None) == 2 * spec.page_size_bytes
    assert spec.max_num_blocks_per_req(None, 5 * E) == 5           # a longer max_len than the spec's
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "remove_skipped_blocks",
                 "pop_blocks_for_free", "cache_blocks", "add_local_computed_blocks",
                 "allocate_external_computed_blocks"):
        assert list(inspect.signature(getattr(SfiHistoryManager, name)).parameters) == \
            list(inspect.signature(getattr(SingleTypeKVCacheManager, name)).parameters), name


def test_page_elems_follow_the_real_page():
    """bf16 halves E; a padded page's padding holds no positions."""
    import torch

    assert _spec(dtype=torch.bfloat16).page_elems == E // 2
    padded = _spec(page_size_padded=_full().page_size_bytes + 4096)
    assert padded.page_elems == E and padded.page_size_bytes > padded.real_page_size_bytes


def test_qwen3_4b_preset_cost():
    """What docs/per_request_memory.md quotes: Qwen3-4B (8 KV heads, D 128, bf16, block 16) has a page
    of 64 KiB, E = 16,384 positions; a 32K request holds 2 history blocks per layer group against 2,048
    KV blocks (0.1 %), and at max_model_len 131072 the start-up line counts 8."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ext.methods.sfi.history_kv_spec import history_spec_for

    qwen = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    spec = history_spec_for(qwen, max_len=131072)
    assert spec.page_size_bytes == 64 * 1024 and spec.page_elems == 16384
    assert spec.pages_for(32768) == 2 and spec.blocks_per_request == 8
    assert spec.pages_for(32768) / (32768 // 16) == pytest.approx(0.001, rel=0.03)


def test_its_own_group_beside_the_attention_and_compact_layers_and_its_share_of_concurrency():
    """vLLM groups one history layer per compact layer into a group of its own with the attention
    layers' pattern (no split), and its "Maximum concurrency" divides by the history's blocks too."""
    from vllm.v1.core.kv_cache_utils import (_get_kv_cache_groups_uniform_page_size,
                                             get_max_concurrency_for_kv_cache_config)
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.kv_spec import compact_spec_for

    max_len, layers = 4096, 4
    cfg = SfiConfig(enabled=True, k=60, n_sink=4, n_recent=32, k_min=8, copy_ngram=3)
    full, compact, hist = _full(), compact_spec_for(_full(), cfg), _spec(max_len)
    specs = {}
    for i in range(layers):
        specs[f"model.layers.{i}.attn"] = full
        specs[f"model.layers.{i}.attn.sfi_compact"] = compact
        specs[f"model.layers.{i}.attn.sfi_history"] = hist
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    assert sorted(kinds) == ["FullAttentionSpec", "SfiCompactSpec", "SfiHistorySpec"]
    assert all(len(g.layer_names) == layers for g in groups)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_len),
                                  parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    config = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=groups)
    per_request = max_len // BLOCK + compact.compact_blocks + max_len // E      # 256 + 5 + 2
    assert get_max_concurrency_for_kv_cache_config(vllm_config, config) == pytest.approx(1000 / per_request)


def test_pages_grow_with_the_request_from_its_first_chunk_and_are_freed():
    spec, pool, mgr = _manager()
    free = pool.get_num_free_blocks()
    assert _step(mgr, "chat", 12) == 1                     # a short chat holds one block per group
    held = 0
    for end in (100, E, E + 1, 2 * E, 2 * E + 7):          # chunks, then decode steps
        held += _step(mgr, "long", end)
        assert held == spec.pages_for(end) == len(mgr.req_to_blocks["long"])
    assert held == 3 and pool.get_num_free_blocks() == free - 4
    # finish, abort and preemption all come through vLLM's free; a resume grows them again
    mgr.free("long")
    assert pool.get_num_free_blocks() == free - 1 and "long" not in mgr.req_to_blocks
    assert _step(mgr, "long", E + 1) == 2
    mgr.free("long")
    mgr.free("chat")
    assert pool.get_num_free_blocks() == free


def test_first_pages_are_counted_once_per_request():
    from vllm_ext import metrics

    _, _, mgr = _manager()
    metrics.reset()
    for end in (10, 20, E + 1):
        _step(mgr, "r", end)
    assert metrics.snapshot().get("sfi.history_allocations") == 1


def test_never_a_prefix_hit_never_cached():
    from vllm_ext.methods.sfi.history_kv_spec import SfiHistoryManager

    spec, pool, mgr = _manager()
    blocks, hit = SfiHistoryManager.find_longest_cache_hit([], 1000, [2], pool, spec, False, BLOCK)
    assert blocks == ([],) and hit == 0
    _step(mgr, "r", 100)
    mgr.cache_blocks(SimpleNamespace(request_id="r"), 100)
    assert not pool.cached_block_hash_to_block
