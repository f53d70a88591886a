"""SPEED as the engine runs it (:class:`~vllm_ext.methods.protocol.Method`): the upper layers (from
``l_cut``) hold only the anchors' and the decode-phase tokens' KV, in a KV-cache group of their own
(:mod:`vllm_ext.methods.speed.kv_spec`); each metadata builder plans the step's upper-layer view
(:mod:`vllm_ext.methods.speed.visibility`), and each upper layer is SPEED's alone: K/V written only
for the tokens that exist there, attention over each row's anchors and decode-phase tokens.
"""

from __future__ import annotations

import torch

from vllm_ext.config_fields import ConfigError
from vllm_ext.methods.protocol import LayerGeometry, Method, MethodLayer

# model families whose decoder layers SPEED is tested on (their attention modules are vLLM's
# ``Attention``, one per layer, named ``model.layers.N.self_attn.attn``)
SPEED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


class SpeedMethod(Method):
    name = "speed"

    @staticmethod
    def enabled(config) -> bool:
        return config.speed.enabled

    @staticmethod
    def register_kv_specs() -> None:
        from vllm_ext.methods.speed.kv_spec import register_speed_kv_spec

        register_speed_kv_spec()

    @staticmethod
    def install_patches() -> None:
        from vllm_ext.methods.speed import upper_stack

        upper_stack.install()

    def check_engine(self) -> None:
        vllm_config = self.vllm_config
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        if vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError("speedsfi.speed.enabled: SPEED needs --no-enable-prefix-caching (the "
                              "upper layers hold no prompt KV that a cache hit could reuse)")
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("speedsfi.speed.enabled: SPEED does not support pipeline parallelism")
        from vllm.config import CompilationMode

        if vllm_config.compilation_config.mode != CompilationMode.NONE:
            from vllm_ext import metrics

            metrics.fallback("speed_compute_compiled", "vllm_ext: SPEED with a compiled model: "
                             "prompt tokens still run the upper layers (masked, same outputs; KV "
                             "memory is saved, prefill compute is not); --enforce-eager enables "
                             "the skip (vllm_ext.methods.speed.upper_stack)")
        archs = set(getattr(model_config.hf_config, "architectures", None) or [])
        if not archs & SPEED_ARCHITECTURES:
            raise ConfigError(f"speedsfi.speed.enabled: SPEED supports the "
                              f"{', '.join(sorted(SPEED_ARCHITECTURES))} families; this model is "
                              f"{', '.join(sorted(archs)) or 'of an unknown architecture'}")

    def attention_kv_spec(self, spec, layer_name: str):
        from vllm_ext.methods.speed.kv_spec import speed_spec_for_layer

        return speed_spec_for_layer(spec, layer_name, self.vllm_config, self.config)

    def keeps_full_cuda_graphs(self) -> bool:
        return False

    def l_cut(self, num_layers: int) -> int:
        return self.config.speed.resolved_l_cut(num_layers)

    def layer(self, geometry: LayerGeometry):
        if geometry.layer_index < self.l_cut(geometry.num_layers):
            return None
        return SpeedUpperLayer(self, geometry)

    def plan_group(self, builder, cm, step):
        """The upper layers' view of the step: every group plans it (cheap), the upper layers use it
        (without vLLM's hybrid KV manager the upper layers share a group)."""
        from vllm_ext.host_staging import PinnedStaging
        from vllm_ext.methods.speed.visibility import (SpeedPlanBuffers, anchor_count, kept_token_index,
                                                       plan_upper_step)

        state = builder.method_state.get(self.name)
        if state is None:
            sched = builder.vllm_config.scheduler_config
            device = torch.device(builder.device)
            state = builder.method_state[self.name] = (
                SpeedPlanBuffers(sched.max_num_seqs, sched.max_num_batched_tokens, device),
                PinnedStaging(sched.max_num_batched_tokens, torch.int64, device))
        buffers, keep_staging = state
        cfg = self.config.speed
        anchor_end = anchor_count(cfg.anchor)
        geometry = step.table.staged_host_geometry if step.is_real else None
        n = cm.num_actual_tokens
        if n > buffers.slot_mapping.shape[0]:
            raise RuntimeError(f"SPEEDSFI: a step of {n} tokens exceeds max_num_batched_tokens")
        keep = None
        counts = (0, 0)
        if geometry is not None:
            # host geometry is exact for every row: the tokens the upper stack must run on
            idx = kept_token_index(geometry[0], geometry[1], step.row_prompt_len_np, step.num_reqs,
                                   anchor_end)
            counts = (len(idx), int(geometry[0][step.num_reqs]) - len(idx))
            keep_staging.np[:len(idx)] = idx
            keep = keep_staging.copy_to_device(len(idx))
        plan = plan_upper_step(slot_mapping=cm.slot_mapping[:n], query_start_loc=cm.query_start_loc,
                               seq_lens=cm.seq_lens, row_prompt_len=step.row_prompt_len,
                               num_reqs=cm.num_reqs, anchor_end=anchor_end,
                               self_only=cfg.variant == "self_only", buffers=buffers,
                               host_counts=counts)
        plan.keep_idx = keep
        plan.l_cut = self.l_cut(self.vllm_config.model_config.get_total_num_hidden_layers())
        return plan


class SpeedUpperLayer(MethodLayer):
    """One upper layer: SPEED's alone (no SFI or CritiPrefill: only anchors and decode-phase tokens
    exist here; ALGORITHMS.md §2, §4)."""

    name = "speed"
    exclusive = True

    def __init__(self, method: SpeedMethod, geometry: LayerGeometry):
        self.method = method
        self.g = geometry
        self.attn = None                     # vLLM's attention layer (its KV scales)

    def prepare(self, forward_context: dict, act_dtype: torch.dtype) -> None:
        self.attn = forward_context.get(self.g.layer_name)

    def plan(self, md):
        return md.plans.get(self.name)

    def takes_layer(self, md, plan) -> bool:
        return True

    def forward_layer(self, dense, layer, query, key, value, kv_cache, md, sp, output):
        """K/V written only for the tokens that exist here (the plan's slot mapping), attention over
        each row's anchors and decode-phase tokens (one kernel for prefill and decode rows; interior
        prompt queries get an unused anchor-only output)."""
        from vllm_ext.kernels.kv_quant import layer_scales
        from vllm_ext.kernels.speed_attention import speed_attention

        slots, rows, positions = sp.slot_mapping, sp.token_row, sp.positions
        if query.shape[0] < slots.shape[0]:
            # the upper stack runs on the kept rows only (vllm_ext.methods.speed.upper_stack)
            keep = sp.keep_idx
            slots, rows, positions = slots[keep], rows[keep], positions[keep]
        n = slots.shape[0]
        dense.write_kv(layer, key, value, kv_cache, slots)
        k_scale, v_scale = layer_scales(layer)
        speed_attention(query[:n], kv_cache, md.block_table, rows, positions, sp.tail_start,
                        sp.anchor_end, sp.self_only, self.g.scale, output[:n], k_scale=k_scale,
                        v_scale=v_scale)
        return output

    def warmup_key(self) -> tuple:
        return (self.name,)

    def warm_up(self, kv_cache, shape, dtype) -> bool:
        from vllm_ext.kernels.kv_quant import layer_scales
        from vllm_ext.methods.speed.visibility import anchor_count
        from vllm_ext.methods.speed.warmup import warm_up_speed_layer

        cfg = self.method.config.speed
        k_scale, v_scale = layer_scales(self.attn)
        warm_up_speed_layer(kv_cache=kv_cache, num_heads=self.g.num_heads, head_size=self.g.head_size,
                            scale=self.g.scale, dtype=dtype, shape=shape,
                            anchor_end=anchor_count(cfg.anchor), self_only=cfg.variant == "self_only",
                            k_scale=k_scale, v_scale=v_scale)
        return True
