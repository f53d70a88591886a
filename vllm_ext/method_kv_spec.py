"""What every method's per-request memory in vLLM's block manager shares (vLLM glue;
``docs/per_request_memory.md``): a KV-cache spec in the attention layer's page format that vLLM never
prefix-caches, a manager that never finds, caches or imports blocks, and the registration. A method
adds its own fields (how many pages, from when) and its allocation rule; it names itself in the
spec's ``speedsfi_method`` (the one door, ``vllm_ext.method_slots``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec


def page_format(spec: AttentionSpec) -> dict[str, Any]:
    """The fields of an attention layer's ``spec`` that fix its page: a method's spec built with them
    has the same page size, so vLLM groups it beside the attention layers in the one block pool."""
    return dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                head_size_v=spec.head_size_v, dtype=spec.dtype, kv_quant_mode=spec.kv_quant_mode,
                page_size_padded=spec.page_size_padded, dcp_sharded=spec.dcp_sharded,
                max_tp_shards=spec.max_tp_shards)


@dataclass(frozen=True, kw_only=True)
class MethodPagesSpec(AttentionSpec):
    """Pages of a method's per-request state: never prefix-cached, no slot mapping; a request holds
    at most ``blocks_per_request`` of them (the subclass says how many)."""

    speedsfi_method = ""

    @property
    def blocks_per_request(self) -> int:
        raise NotImplementedError

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    @property
    def uses_slot_mapping(self) -> bool:
        return False

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """The most a request holds: vLLM's "Maximum concurrency" counts it beside the attention
        groups' blocks."""
        return self.blocks_per_request * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        return all(isinstance(spec, type(self)) for spec in kv_cache_specs.values())


class MethodPagesManager(SingleTypeKVCacheManager):
    """A manager that never shares its blocks: no prefix hit, no caching, no KV connector import;
    :meth:`_take` gives a request new blocks."""

    def _take(self, request_id: str, n: int) -> list:
        new = self.block_pool.get_new_blocks(n)
        self.req_to_blocks[request_id].extend(new)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new)
        return new

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        return None                  # KV connectors are refused with SPEEDSFI

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks,
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        return None                  # never a prefix hit (the group is not prefix-cacheable)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request, num_tokens: int, retention_interval=None, *,
                     replay_boundaries=()) -> None:
        return None                  # never prefix-cached

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0


def register_method_spec(spec_type: type[MethodPagesSpec], manager_type: type[MethodPagesManager]) -> None:
    """Register a method's spec and manager with vLLM (idempotent; after vLLM's built-ins)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_type, manager_type, uniform_type_base_spec=spec_type)
