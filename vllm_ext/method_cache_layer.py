"""What every method's per-layer cache holder is (``docs/per_request_memory.md``): an
``AttentionLayerBase`` registered in vLLM's forward context beside a SPEEDSFI attention layer
(``<layer><suffix>``), as vLLM's own ``DeepseekV32IndexerCache`` is, so that vLLM collects its
KV-cache spec (built from the attention layer's, same page format), groups it, allocates its blocks
from the shared pool and binds a view of the KV cache to it (``kv_cache``). The model never calls
it; the attention impl or the step plan reads and writes the pages through the group's block table.

One class serves every method: a method names its holders by a :class:`CacheKind` (suffix, backend
name, and how its spec follows from the attention layer's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionMetadataBuilder,
                                       MultipleOf)


class _NothingToBuild(AttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        return None

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return None


class MethodCacheBackend(AttentionBackend):
    """A cache holder's backend: SPEEDSFI's page constraints (kernel block sizes, layouts: the pages
    share the attention layer's format), a builder that builds nothing, no impl."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    name: ClassVar[str] = "SPEEDSFI_METHOD_CACHE"

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("SPEEDSFI's method caches are read by the attention impl")

    @staticmethod
    def get_builder_cls():
        return _NothingToBuild

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.platforms import current_platform
        from vllm.v1.kv_cache_layout import KVCacheLayout

        if current_platform.is_cpu():
            return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
        return (KVCacheLayout.LBNHC,)


_backends: dict[str, type] = {}


def cache_backend(name: str) -> type:
    """The backend class of the holders named ``name`` (one class per name: vLLM tells caches apart
    by their backend's name)."""
    if name not in _backends:
        _backends[name] = type(f"MethodCacheBackend_{name}", (MethodCacheBackend,), {"name": name})
    return _backends[name]


# the spec a holder reports beside its attention layer's: (attn_spec, attn layer, vllm_config) -> spec
SpecFor = Callable[[object, object, object], object]


@dataclass(frozen=True)
class CacheKind:
    suffix: str           # the holder's name is the attention layer's plus this
    backend_name: str     # its backend's name (vLLM's logs and spec checks show it)


class MethodCacheLayer(torch.nn.Module, AttentionLayerBase):
    """One attention layer's pages of a method's per-request state (``attn``: the attention layer)."""

    def __init__(self, attn, prefix: str, kind: CacheKind, spec_for: SpecFor):
        super().__init__()
        self.kv_cache = torch.tensor([])
        self.layer_name = prefix
        self.kind = kind
        self._spec_for = spec_for
        self._attn = [attn]          # not a submodule: the model owns the attention layer

    def get_kv_cache_spec(self, vllm_config):
        from vllm.v1.kv_cache_interface import AttentionSpec

        attn = self._attn[0]
        spec = attn.get_kv_cache_spec(vllm_config)
        if not isinstance(spec, AttentionSpec):
            return None
        return self._spec_for(spec, attn, vllm_config)

    def get_attn_backend(self):
        return cache_backend(self.kind.backend_name)

    def forward(self):  # never called: the attention impl or the step plan reads the pages
        raise RuntimeError(f"{self.kind.backend_name} is a KV-cache holder, not a model layer")


def register_cache_layer(forward_context: dict, attn_layer_name: str, kind: CacheKind,
                         spec_for: SpecFor) -> MethodCacheLayer:
    """The holder ``attn_layer_name + kind.suffix`` in the forward context, made on first call
    (before vLLM collects the KV-cache specs: the attention impl calls this while the weights
    load)."""
    name = attn_layer_name + kind.suffix
    layer = forward_context.get(name)
    if layer is None:
        layer = MethodCacheLayer(forward_context[attn_layer_name], name, kind, spec_for)
        forward_context[name] = layer
    return layer
