"""The vLLM 0.32 internals SPEED relies on (fail loudly when they move)."""

import inspect

import pytest

pytest.importorskip("vllm")


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_kv_spec_registry_and_manager_api():
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    import vllm_ext
    from vllm_ext.methods.speed.kv_spec import SpeedUpperManager, SpeedUpperSpec

    vllm_ext.register()
    # built-ins register only into an empty registry: ours must not have pre-empted them
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import torch
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    upper = SpeedUpperSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    assert KVCacheSpecRegistry.get_manager_class(upper) is SpeedUpperManager
    assert KVCacheSpecRegistry.get_manager_class(full) is not SpeedUpperManager
    assert not isinstance(upper, FullAttentionSpec)          # else it merges into the lower group
    assert upper.page_size_bytes == full.page_size_bytes     # hybrid groups need one page size
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "remove_skipped_blocks",
                 "pop_blocks_for_free", "cache_blocks"):
        # same parameter names as vLLM's base class (the coordinator calls some by keyword)
        assert _params(getattr(SpeedUpperManager, name)) == \
            _params(getattr(SingleTypeKVCacheManager, name)), name
    assert _params(SingleTypeKVCacheManager.find_longest_cache_hit)[:3] == \
        ["block_hashes", "max_length", "kv_cache_group_ids"]
    src = inspect.getsource(__import__("vllm.v1.core.kv_cache_manager", fromlist=["x"]).KVCacheManager.allocate_slots)
    assert "num_prompt_tokens=request.num_prompt_tokens" in src     # the manager learns P here


def test_model_forward_shape_we_replace():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.llama import LlamaModel
    from vllm.model_executor.models.qwen2 import Qwen2Model
    from vllm.model_executor.models.qwen3 import Qwen3Model

    assert issubclass(Qwen3Model, Qwen2Model) and "forward" not in vars(Qwen3Model)
    for cls in (LlamaModel, Qwen2Model):
        fn = getattr(cls.forward, "__wrapped__", cls.forward)
        assert _params(fn)[:5] == ["self", "input_ids", "positions", "intermediate_tensors",
                                   "inputs_embeds"]
        src = inspect.getsource(fn)
        for needle in ("self.layers", "self.start_layer", "self.end_layer", "self.norm(hidden_states, residual)",
                       "self.embed_input_ids(input_ids)"):
            assert needle in src, (cls.__name__, needle)
    assert _params(getattr(Attention.get_kv_cache_spec, "__wrapped__", Attention.get_kv_cache_spec)) == \
        ["self", "vllm_config"]


def test_request_validation_hook():
    from vllm.v1.engine.input_processor import InputProcessor

    fn = getattr(InputProcessor._validate_params, "__wrapped__", InputProcessor._validate_params)
    assert _params(fn) == ["self", "params", "supported_tasks"]
