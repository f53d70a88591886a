"""What every method's per-request memory in vLLM's block manager shares (vLLM glue;
``docs/per_request_memory.md``): a KV-cache spec in the attention layer's page format that vLLM never
prefix-caches, a manager that never finds, caches or imports blocks, and the registration. A method
adds its own fields (how many pages, from when) and its allocation rule; it names itself in the
spec's ``speedsfi_method`` (the one interface, ``vllm_ext.method_slots``)."""

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


@dataclass(frozen=True, kw_only=True)
class GrowingPagesSpec(MethodPagesSpec):
    """Pages of a per-request state that grows with the request's length, as its KV does:
    :meth:`pages_for` of ``num_tokens`` (the subclass's layout); a ``max_len`` request holds the most
    (what "Maximum concurrency" counts)."""

    max_len: int = 1                # max_model_len

    def pages_for(self, num_tokens: int) -> int:
        raise NotImplementedError

    @property
    def blocks_per_request(self) -> int:
        return self.pages_for(self.max_len)

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return self.pages_for(max(max_len, self.max_len))


class GrowingPagesManager(MethodPagesManager):
    """Gives a request ``pages_for(num_tokens)`` pages in all as its length grows (the tokens it will
    hold after the step being scheduled, as vLLM counts a KV block), once :meth:`wants_pages` says it
    needs any (:meth:`target_pages` for another rule); held for its life unless a subclass gives them
    back in ``remove_skipped_blocks``, freed on finish, abort and preemption. :meth:`on_first_pages`
    is called when a request gets its first pages (a counter)."""

    def wants_pages(self, request_id: str, num_tokens: int) -> bool:
        return True

    def on_first_pages(self, request_id: str) -> None:
        return None

    def target_pages(self, request_id: str, num_tokens: int) -> int:
        """The pages the request should hold once it has ``num_tokens`` tokens (never fewer than it
        holds: a manager gives pages back only through vLLM's own paths)."""
        if not self.req_to_blocks.get(request_id) and not self.wants_pages(request_id, num_tokens):
            return 0
        return self.kv_cache_spec.pages_for(num_tokens)

    def _growth(self, request_id: str, num_tokens: int) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, self.target_pages(request_id, num_tokens) - held)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        return self._growth(request_id, num_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        n = self._growth(request_id, num_tokens)
        if not n:
            return []
        if not self.req_to_blocks.get(request_id):
            self.on_first_pages(request_id)
        return self._take(request_id, n)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None                  # held for the request's life


def register_method_spec(spec_type: type[MethodPagesSpec], manager_type: type[MethodPagesManager]) -> None:
    """Register a method's spec and manager with vLLM (idempotent; after vLLM's built-ins)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_type, manager_type, uniform_type_base_spec=spec_type)
