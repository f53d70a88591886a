"""SFI's compact segments in vLLM's block manager (``vllm_ext.methods.sfi.kv_spec``): the spec's page format
and accounting, the manager's allocation rule, and the vLLM 0.32 internals both rely on (they fail
loudly here when those move)."""

import inspect

import pytest

pytest.importorskip("vllm")


def _params(fn):
    return list(inspect.signature(fn).parameters)


def _specs(k=60, n_sink=4, block=16):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.kv_spec import compact_spec_for

    cfg = SfiConfig(enabled=True, k=k, n_sink=n_sink, n_recent=32, k_min=8)
    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return cfg, full, compact_spec_for(full, cfg)


def test_spec_shares_the_layer_page_format_and_is_registered():
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    import vllm_ext
    from vllm_ext.methods.sfi.kv_spec import SfiCompactManager

    vllm_ext.register()
    cfg, full, spec = _specs()
    assert KVCacheSpecRegistry.get_manager_class(spec) is SfiCompactManager
    assert KVCacheSpecRegistry.get_manager_class(full) is not SfiCompactManager
    assert not isinstance(spec, FullAttentionSpec)          # its own group, never merged with the KV
    assert spec.page_size_bytes == full.page_size_bytes     # one pool: vLLM's hybrid groups need it
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    # ceil((4 + 60) / 16) = 4 of the compact segment, 1 of the prompt-tail queries (16 x 2 x 32 fp32
    # in a page of 2 x 16 x 64 fp32)
    assert spec.compact_blocks == 5
    assert spec.max_num_blocks_per_req(None, 1 << 20) == 5
    assert spec.max_memory_usage_bytes(None) == 5 * spec.page_size_bytes
    assert spec.first_len == 4 + 32 + 8 + 1 and spec.tail_window == 16
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "remove_skipped_blocks",
                 "pop_blocks_for_free", "cache_blocks", "add_local_computed_blocks",
                 "allocate_external_computed_blocks"):
        # same parameter names as vLLM's base class (the coordinator calls some by keyword)
        assert _params(getattr(SfiCompactManager, name)) == \
            _params(getattr(SingleTypeKVCacheManager, name)), name


def test_manager_gives_the_blocks_once_the_request_can_go_sparse_and_frees_them():
    from vllm.v1.core.block_pool import BlockPool

    from vllm_ext.methods.sfi.kv_spec import SfiCompactManager

    _, _, spec = _specs()
    pool = BlockPool(num_gpu_blocks=32, enable_caching=False, hash_block_size=16)
    mgr = SfiCompactManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=1,
                            scheduler_block_size=16)
    free = pool.get_num_free_blocks()
    first = spec.first_len
    # a short request (a chat question) never gets them (its prefill end: the prompt, 10 tokens)
    assert mgr.get_num_blocks_to_allocate("short", first - 1, [], 0, 0, first - 1, prefill_end=10) == 0
    assert mgr.allocate_new_blocks("short", first - 1, first - 1) == []
    # crossing the threshold: the fixed count, once
    assert mgr.get_num_blocks_to_allocate("long", first, [], 0, 0, first, prefill_end=10) == 5
    got = mgr.allocate_new_blocks("long", first, first)
    assert len(got) == 5 and pool.get_num_free_blocks() == free - 5
    assert mgr.get_num_blocks_to_allocate("long", 5000, [], 0, 0, 5000, prefill_end=10) == 0
    assert mgr.allocate_new_blocks("long", 5000, 5000) == []
    # a prompt long enough to select gets them with the chunk that reaches its tail queries
    # (positions [P - 16, P)), before the threshold: P = first + 3 -> from length P - 15
    p = first + 3
    assert mgr.get_num_blocks_to_allocate("prompt", p - 16, [], 0, 0, p - 16, prefill_end=p) == 0
    assert mgr.get_num_blocks_to_allocate("prompt", p - 15, [], 0, 0, p - 15, prefill_end=p) == 5
    assert len(mgr.allocate_new_blocks("prompt", p - 15, p - 15)) == 5
    # a long prompt: from the threshold (its tail comes later)
    assert mgr.get_num_blocks_to_allocate("longp", first, [], 0, 0, first, prefill_end=4000) == 5
    mgr.free("prompt")
    mgr.free("longp")
    assert set(mgr._prefill_end) == {"short", "long"}
    # never a prefix hit, never cached
    blocks, hit = SfiCompactManager.find_longest_cache_hit([], 1000, [1], pool, spec, False, 16)
    assert blocks == ([],) and hit == 0
    # finish, abort and preemption all free through vLLM's path
    mgr.free("long")
    assert pool.get_num_free_blocks() == free and "long" not in mgr.req_to_blocks
    assert "long" not in mgr._prefill_end


def test_state_pages_of_the_preset():
    """The rows of the compact group for the shipped preset (k 1024, keep_prefill 512, w_prefill 16)
    on two real geometries: the figures docs/per_request_memory.md quotes."""
    import dataclasses

    import torch

    from vllm_ext.methods.sfi.config import SfiConfig
    from vllm_ext.methods.sfi.state_pages import first_compact_len, first_state_len, sfi_state_pages, tail_window

    preset = dataclasses.replace(SfiConfig(), enabled=True, k=1024, n_sink=4, n_recent=128,
                                 keep_prefill=512)
    bf16 = dict(cache_dtype=torch.bfloat16, act_dtype=torch.bfloat16, block_size=16)
    smol = sfi_state_pages(preset, num_kv_heads=3, head_size=64, num_heads=9, **bf16)   # SmolLM2-135M
    qwen = sfi_state_pages(preset, num_kv_heads=8, head_size=128, num_heads=32, **bf16)  # Qwen3-4B
    assert (smol.segment, smol.kept, smol.tail) == (65, 1, 2)
    assert (qwen.segment, qwen.kept, qwen.tail) == (65, 1, 2)
    assert (qwen.kept_first, qwen.tail_first, qwen.total) == (65, 66, 68)
    first = first_compact_len(preset)
    assert first == 4 + 128 + 32 + 1 and tail_window(preset) == 16
    assert first_state_len(first, 16, 100) == first                 # a chat: from its decode
    assert first_state_len(first, 16, first + 2) == first - 13      # its tail's first chunk
    assert first_state_len(first, 16, 8000) == first
    quest = dataclasses.replace(preset, selector="quest", keep_prefill=0)
    assert sfi_state_pages(quest, num_kv_heads=8, head_size=128, num_heads=32, **bf16).total == 65
    assert tail_window(quest) == 0


def test_the_runner_facts_the_hooks_read():
    """The compact group's block table rows and their block counts (``runner_hooks``), and the
    forward-context registration vLLM's own per-layer caches use."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker.block_table import BlockTable, MultiGroupBlockTable

    from vllm_ext.method_cache_layer import MethodCacheLayer

    assert issubclass(MethodCacheLayer, AttentionLayerBase)
    for name in ("num_blocks_per_row", "get_device_tensor", "add_row", "append_row", "clear_row"):
        assert name in inspect.getsource(BlockTable), name
    assert "__getitem__" in vars(MultiGroupBlockTable)
    src = inspect.getsource(__import__("vllm.v1.worker.gpu_model_runner", fromlist=["x"])
                            .GPUModelRunner.get_kv_cache_spec)
    assert "get_layers_from_vllm_config" in src and "AttentionLayerBase" in src
