"""SPEED in vLLM's block manager: the upper layers' KV-cache spec and its manager (vLLM glue).

Layers ``>= l_cut`` report :class:`SpeedUpperSpec`. It derives from ``AttentionSpec`` and not from
``FullAttentionSpec`` on purpose: vLLM merges every ``FullAttentionSpec`` into one KV-cache group
(one block table), and the upper layers need a group of their own to hold fewer blocks. Registered
with ``KVCacheSpecRegistry`` (after vLLM's built-ins, which register only into an empty registry),
it gets :class:`SpeedUpperManager`, which gives a request blocks for logical block 0 (the BoS
anchor) and for the blocks from ``(P - 1) // block_size`` on (the last prompt token and the decode
tokens), and the shared null block for the interior: block-table rows stay position-aligned
(row index = position // block_size), interior rows point at block 0 of the pool, which vLLM never
hands out, and the upper layers never write there (their slot mapping sends interior tokens to -1,
:mod:`vllm_ext.methods.speed.visibility`) nor read there (their attention masks the interior).

Prefix caching is refused with SPEED at start-up, so the manager never sees cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ext import metrics


@dataclass(frozen=True, kw_only=True)
class SpeedUpperSpec(AttentionSpec):
    """KV of a SPEED upper layer: the anchors and the decode-phase tokens only."""

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_memory_usage_bytes(self, vllm_config) -> int:
        """KV of one ``max_model_len`` request whose prompt fills it (what SPEED is for): block 0
        and the blocks of the last two positions. vLLM reports capacity and concurrency from this,
        so its start-up line shows the saving. A request that decodes most of ``max_model_len``
        holds up to ``cdiv(max_model_len, block_size)`` blocks here; they come from the shared
        pool like any request's growth."""
        return self.prompt_dominated_blocks(vllm_config.model_config.max_model_len) * \
            self.page_size_bytes

    def prompt_dominated_blocks(self, max_len: int) -> int:
        bs = self.block_size
        last = cdiv(max_len, bs)
        first_tail = max(1, (max_len - 2) // bs)
        return min(last, 1 + max(0, last - first_tail))


class SpeedUpperManager(SingleTypeKVCacheManager):
    """Blocks for logical block 0 and for ``[(P - 1) // bs, ...)``; the null block in between."""

    def __init__(self, kv_cache_spec: SpeedUpperSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self._prompt_len: dict[str, int] = {}

    # vLLM calls remove_skipped_blocks (with the prompt length) before every allocation of a step
    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is not None:
            self._prompt_len[request_id] = int(num_prompt_tokens)

    def _tail_block(self, request_id: str, prompt_hint: int = 0) -> int:
        """First logical block (after block 0) that holds upper-layer KV."""
        p = self._prompt_len.get(request_id, prompt_hint)
        if p <= 0:
            return 1                                  # unknown prompt: allocate everything
        return max(1, (p - 1) // self.block_size)

    def _needs_block(self, i: int, tail: int) -> bool:
        return i == 0 or i >= tail

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        assert len(new_computed_blocks) == 0, "SPEED runs without prefix caching"
        have = len(self.req_to_blocks.get(request_id, ()))
        tail = self._tail_block(request_id, prefill_end)
        need = cdiv(num_tokens, self.block_size)
        return sum(1 for i in range(have, need) if self._needs_block(i, tail))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        blocks = self.req_to_blocks[request_id]
        tail = self._tail_block(request_id)
        need = cdiv(num_tokens, self.block_size)
        if need <= len(blocks):
            return []
        idx = range(len(blocks), need)
        real = sum(1 for i in idx if self._needs_block(i, tail))
        fresh = iter(self.block_pool.get_new_blocks(real)) if real else iter(())
        new = []
        skipped = 0
        for i in idx:
            if self._needs_block(i, tail):
                b = next(fresh)
                if self._record_new_block_ids:
                    self.new_block_ids.append(b.block_id)
            else:
                b = self._null_block
                skipped += 1
            blocks.append(b)
            new.append(b)
        if skipped:
            metrics.bump("speed.blocks_saved", skipped)
        return new

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request, num_tokens: int, retention_interval=None, *,
                     replay_boundaries=()) -> None:
        return None                                   # never prefix-cached

    def pop_blocks_for_free(self, request_id: str):
        self._prompt_len.pop(request_id, None)
        return [b for b in super().pop_blocks_for_free(request_id) if not b.is_null]


def register_speed_kv_spec() -> None:
    """Register the spec and its manager (idempotent). vLLM's built-ins go first: its registry
    registers them only while it is empty."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SpeedUpperSpec, SpeedUpperManager,
                                 uniform_type_base_spec=SpeedUpperSpec)


def speed_spec_for_layer(spec, layer_name: str, vllm_config, cfg):
    """The spec a layer reports under SPEED: ``SpeedUpperSpec`` for layers ``>= l_cut`` (same
    shape fields), the layer's own spec otherwise. Without vLLM's hybrid KV-cache manager every
    layer must share one group: the upper layers then keep full prompt blocks (the interior is
    allocated but never written; visibility and compute are unchanged), logged and counted once."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not cfg.speed.enabled or type(spec) is not FullAttentionSpec:
        return spec
    l_cut = cfg.speed.resolved_l_cut(vllm_config.model_config.get_total_num_hidden_layers())
    if extract_layer_index(layer_name) < l_cut:
        return spec
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        metrics.fallback("speed_no_hybrid_kv", "vllm_ext: SPEED without vLLM's hybrid KV-cache "
                         "manager (--disable-hybrid-kv-cache-manager or a feature that turns it off): "
                         "the upper layers keep blocks for the whole prompt (no KV memory saved); "
                         "visibility and compute are unchanged")
        return spec
    num_layers = vllm_config.model_config.get_total_num_hidden_layers()
    metrics.log_once("speed_kv", "vllm_ext: SPEED: layers %d-%d of %d keep KV for the BoS anchor and "
                     "the decode-phase tokens only (their own KV-cache group): a prompt-dominated "
                     "request needs %.1f%% of dense KV (%d of %d layers hold its prompt)",
                     l_cut, num_layers - 1, num_layers, 100.0 * l_cut / num_layers, l_cut, num_layers)
    return SpeedUpperSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                          head_size=spec.head_size, head_size_v=spec.head_size_v, dtype=spec.dtype,
                          kv_quant_mode=spec.kv_quant_mode, page_size_padded=spec.page_size_padded,
                          dcp_sharded=spec.dcp_sharded, max_tp_shards=spec.max_tp_shards)
