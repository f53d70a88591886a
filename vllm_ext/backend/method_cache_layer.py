"""What the methods' per-layer cache holders share (``docs/per_request_memory.md``): an
``AttentionLayerBase`` registered in vLLM's forward context beside a SPEEDSFI attention layer, as
vLLM's own ``DeepseekV32IndexerCache`` is, so that vLLM collects its KV-cache spec (built from the
attention layer's, same page format), groups it, allocates its blocks and binds a view of the KV cache
to it (``kv_cache``). The model never calls it. A method's holder says which spec it reports
(:meth:`MethodCacheLayer.spec_for`) and which backend it names (``backend``)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase


class MethodCacheLayer(torch.nn.Module, AttentionLayerBase):
    """One attention layer's pages of a method's per-request state (``attn``: the attention layer)."""

    backend: type = None

    def __init__(self, attn, prefix: str):
        super().__init__()
        self.kv_cache = torch.tensor([])
        self.layer_name = prefix
        self._attn = [attn]          # not a submodule: the model owns the attention layer

    def spec_for(self, attn_spec, attn, vllm_config):
        """The method's spec beside the attention layer's ``attn_spec`` (an ``AttentionSpec``)."""
        raise NotImplementedError

    def get_kv_cache_spec(self, vllm_config):
        from vllm.v1.kv_cache_interface import AttentionSpec

        attn = self._attn[0]
        spec = attn.get_kv_cache_spec(vllm_config)
        if not isinstance(spec, AttentionSpec):
            return None
        return self.spec_for(spec, attn, vllm_config)

    def get_attn_backend(self):
        return self.backend

    def forward(self):  # never called: the attention impl or the step plan reads the pages
        raise RuntimeError(f"{type(self).__name__} is a KV-cache holder, not a model layer")


L = TypeVar("L", bound=MethodCacheLayer)


def register_cache_layer(forward_context: dict, attn_layer_name: str, suffix: str,
                         make: Callable[[object, str], L]) -> L:
    """The holder ``attn_layer_name + suffix`` in the forward context, made by ``make(attn, name)`` on
    first call (before vLLM collects the KV-cache specs: the attention impl calls this while the
    weights load)."""
    name = attn_layer_name + suffix
    layer = forward_context.get(name)
    if layer is None:
        layer = make(forward_context[attn_layer_name], name)
        forward_context[name] = layer
    return layer
