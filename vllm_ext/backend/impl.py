"""The SPEEDSFI attention impl. It only dispatches: per layer call it lets a method that takes the
layer whole run it, or writes K/V through the dense path, lets each method with a share of the layer
claim its rows, hands the rest to the dense path, then lets the methods compute the rows they
claimed. It holds no step state; every step-dependent decision is in the step's plans (built by the
metadata builder, :mod:`vllm_ext.backend.metadata`).

- The dense path (:mod:`vllm_ext.backend.dense_path`) is chosen once: vLLM's own attention on CUDA
  (with every method off, output identical to that backend's), ``CPU_ATTN``'s kernels on their pages
  on the CPU build, the PyTorch reference where those pages cannot be read.
- The methods (:mod:`vllm_ext.methods.registry`) each give a share of this layer
  (:class:`~vllm_ext.methods.protocol.MethodLayer`) made while the weights load: its cache holders
  in vLLM's forward context and its persistent buffers come out of vLLM's memory budget.

The forward never synchronises with the host on CUDA and counts nothing on the host: counters are
device tensors (``vllm_ext.row_counters``, when on, counts the rows each path computed). On CUDA a
pure-decode step whose decode rows our kernels compute runs only our kernels, the same launches
whatever the rows decide, so vLLM captures it in a FULL CUDA graph.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from vllm_ext import row_counters
from vllm_ext.backend.dense_path import dense_path_for
from vllm_ext.backend.metadata import SpeedSfiMetadata
from vllm_ext.backend.startup import engine_of
from vllm_ext.config import ConfigError
from vllm_ext.methods.protocol import LayerGeometry

# Extra Attention(...) kwargs that are harmless at these values; anything else is refused.
_NEUTRAL_EXTRA_ARGS = {"sinks": None, "use_alibi_sqrt": False, "chunk_lookback": -1}


class SpeedSfiImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra_impl_args) -> None:
        _refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, attn_type,
                            kv_sharing_target_layer_name, extra_impl_args)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"SPEEDSFI: {num_heads} query heads are not a multiple of "
                              f"{self.num_kv_heads} KV heads")
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = None
        self.kv_sharing_target_layer_name = None
        vllm_config = get_current_vllm_config()
        self._vllm_config = vllm_config
        self.engine = engine_of(vllm_config)
        self.config = self.engine.config
        device = _device()
        self._rows = self.engine.row_counters(device)
        self._methods = self.engine.methods()
        self._forward_context = vllm_config.compilation_config.static_forward_context
        self.dense = dense_path_for(
            self.config, on_cpu=current_platform.is_cpu(), num_heads=num_heads, num_kv_heads=self.num_kv_heads,
            head_size=head_size, scale=self.scale, kv_cache_dtype=kv_cache_dtype, attn_type=attn_type,
            max_rows=vllm_config.scheduler_config.max_num_seqs,
            max_len=vllm_config.model_config.max_model_len, device=device, rows=self._rows,
            owns_decode=any(m.owns_decode_rows() for m in self._methods), shared=self.engine.buffers)
        self.layers = []                             # the methods' shares of this layer
        if not current_platform.is_cpu():
            # our Triton kernels compile while the engine starts (vLLM's JIT warm-up registry)
            from vllm_ext.backend.kernel_warmup import register_with_vllm

            register_with_vllm(vllm_config)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # Runs before vLLM profiles memory: what is allocated here comes out of its budget.
        allocate = getattr(self.dense, "allocate", None)
        if allocate is not None:
            allocate()
        if not self._methods:
            return
        geometry = self.geometry()
        layers = [share for share in (m.layer(geometry) for m in self._methods) if share is not None]
        whole = [share for share in layers if share.exclusive]
        self.layers = whole[:1] or layers
        for share in self.layers:
            share.prepare(self._forward_context, act_dtype)

    def geometry(self) -> LayerGeometry:
        from vllm.model_executor.models.utils import extract_layer_index

        name = next((n for n, attn in self._forward_context.items() if getattr(attn, "impl", None) is self),
                    None)
        if name is None:
            raise RuntimeError("SPEEDSFI: an attention impl not found in vLLM's forward context")
        vc = self._vllm_config
        return LayerGeometry(
            layer_name=name, layer_index=extract_layer_index(name),
            num_layers=vc.model_config.get_total_num_hidden_layers(), num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_size=self.head_size, scale=self.scale,
            max_rows=vc.scheduler_config.max_num_seqs, max_len=vc.model_config.max_model_len,
            max_batched_tokens=vc.scheduler_config.max_num_batched_tokens, device=_device())

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: SpeedSfiMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("SPEEDSFI does not fuse output quantization")
        if attn_metadata is None:                     # profiling run
            return output.fill_(0)
        md = attn_metadata
        whole = self.dense.forward_all(layer, query, key, value, kv_cache, md, output)
        if whole is not None:
            return whole
        active = [(share, plan) for share in self.layers if (plan := share.plan(md)) is not None]
        if (active and self.dense.host_plan and self._rows is None
                and all(share.idle(md, plan) for share, plan in active)):
            # no method acts in this layer this step (the CPU build reads that on the host): the
            # layer as with every method off, without the per-method hooks' work
            whole = self.dense.forward_all(layer, query, key, value, kv_cache, md, output, methods_idle=True)
            if whole is not None:
                for share, plan in active:
                    share.end_layer(layer.layer_name, md, plan)
                return whole
        pages = self.dense.pages(layer, query, kv_cache, md)
        for share, plan in active:
            share.bind(layer.layer_name, md, plan)
        try:
            for share, plan in active:
                if share.takes_layer(md, plan):
                    return share.forward_layer(self.dense, layer, query, key, value, pages, md, plan, output)
            return self._forward(layer, query, key, value, pages, md, output, active)
        finally:
            for share, plan in active:
                share.end_layer(layer.layer_name, md, plan)

    def _forward(self, layer, query, key, value, pages, md, output, active):
        self.dense.write_kv(layer, key, value, pages, md.slot_mapping)
        rows = self.dense.row_plan(md)
        for share, plan in active:
            share.claim_rows(rows, query, pages, md, plan)
        if self._rows is not None:
            # the rows of this layer call (a pure-decode step of our kernels: the padded batch)
            ours = rows.decode_owner is not None or self.dense.owns_decode_kernel()
            pure = not rows.host_plan and ours and md.num_decodes and not md.num_prefills
            self._rows.add(row_counters.LAYER, min(md.num_reqs, query.shape[0]) if pure else md.num_reqs)
        self.dense.attend(layer, query, key, value, pages, md, output, rows)
        for share, plan in active:
            share.attend_claimed(query, pages, md, plan, output, rows)
        self.dense.attend_decode_rows(layer, query, pages, md, output, rows)
        return output

    def warm_up(self, kv_cache: torch.Tensor, shape, dtype: torch.dtype) -> bool:
        """Compile this layer's kernels (start-up) over its pages as the forward hands them over (an
        fp8 cache: its fp8 view, with the layer's scales); False when it launches none of ours."""
        pages = self.dense.page_view(kv_cache)
        ran = False
        for share in self.layers:
            ran |= share.warm_up(pages, shape, dtype)
        if not ran:
            ran = self.dense.warm_up(self._attention_layer(), pages, shape, dtype)
        return ran

    def _attention_layer(self):
        """vLLM's attention layer this impl serves (its KV scales)."""
        return next((attn for attn in self._forward_context.values() if getattr(attn, "impl", None) is self),
                    None)

    def warmup_key(self) -> tuple:
        return tuple(share.warmup_key() for share in self.layers) + (self.dense.owns_decode_kernel(),)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # vLLM does not call this (forward_includes_kv_cache_update); kept for test harnesses.
        self.dense.write_kv_outside_forward(layer, key, value, kv_cache, slot_mapping)


def _device() -> torch.device:
    if current_platform.is_cpu():
        return torch.device("cpu")
    return torch.device(current_platform.device_type, torch.accelerator.current_device_index())


def _refuse_unsupported(alibi_slopes, sliding_window, logits_soft_cap, attn_type,
                        kv_sharing_target_layer_name, extra_impl_args) -> None:
    if alibi_slopes is not None:
        raise ConfigError("SPEEDSFI does not support ALiBi attention")
    if sliding_window is not None:
        raise ConfigError(f"SPEEDSFI does not support sliding-window attention (window {sliding_window})")
    if logits_soft_cap:
        raise ConfigError("SPEEDSFI does not support attention logit soft-capping")
    if attn_type != AttentionType.DECODER:
        raise ConfigError(f"SPEEDSFI supports decoder self-attention only, not {attn_type}")
    if kv_sharing_target_layer_name is not None:
        raise ConfigError("SPEEDSFI does not support cross-layer KV sharing")
    for name, value in extra_impl_args.items():
        neutral = _NEUTRAL_EXTRA_ARGS.get(name, object())
        if not (value is neutral or (not isinstance(value, torch.Tensor) and value == neutral)):
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise ConfigError(f"SPEEDSFI does not support the attention option {name}={shown}")
